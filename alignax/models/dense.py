"""``dense``: activations times a weight, with a backward pass written as two plain matmuls.

Every projection of the decoder (q/k/v/o, gate/up/down, the LM head, the value and score
heads) contracts the trailing axes of ``x [..., *in]`` with a weight. Flattened, that is
``y2 = x2 @ W2`` with ``x2 [M, I]`` (``M`` = all leading axes) and ``W2 [I, O]``, and the
backward pass is

    dx2 = dy2 @ W2^T        dW2 = x2^T @ dy2

JAX's generic rule for ``dot_general`` differentiates the un-flattened einsum instead: the
weight gradient becomes a product over the (batch, time) axes followed by a transpose, and
on CPU XLA answers with a transposed copy of the activation gradient for every projection
and a weight-gradient product outside its fast matmul path. Asking for the two products
above directly, on the 2-core CPU at 16 × 128 tokens: the SmolLM2 MLP's forward + backward
takes 176 ms instead of 241 ms, and the gradient of the whole SmolLM2 model 11.0 s instead
of 13.1 s (tools/benchmarks/bench_backward.py). The values are those of autodiff up to the order of
float32 summation (tests/test_dense.py).

The cotangent keeps its dtype into the products (a float32 gradient of float32-accumulated
logits meets bfloat16 weights as a mixed-dtype matmul, as in JAX's own rule); ``dx`` and
``dW`` are cast to the dtypes of ``x`` and ``w``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

Array = jax.Array

# The name every projection's output carries for remat policies (``jax.checkpoint`` sees
# the custom-VJP call, not its matmul, so the dot-based policies are stated by name).
DENSE_OUTPUT = "dense_output"


def dense(x: Array, w: Array, *, in_axes: int = 1, transposed: bool = False, out_dtype=None) -> Array:
    """Contract the last ``in_axes`` axes of ``x`` with the weight ``w``.

    Args:
      x: ``[..., *in]`` activations.
      w: ``[*in, *out]``, or ``[*out, *in]`` when ``transposed`` (tied embeddings ``[V, D]``
        used as the LM head).
      in_axes: how many trailing axes of ``x`` are contracted.
      out_dtype: accumulation and result dtype (``preferred_element_type``); ``None`` keeps
        ``x``'s dtype.

    Returns ``[..., *out]``.
    """
    if in_axes < 1 or in_axes > x.ndim or in_axes > w.ndim:
        raise ValueError(f"in_axes={in_axes} does not fit x {x.shape} and w {w.shape}")
    in_shape = x.shape[x.ndim - in_axes :]
    w_in = w.shape[w.ndim - in_axes :] if transposed else w.shape[:in_axes]
    if in_shape != w_in:
        raise ValueError(f"x {x.shape} and w {w.shape} disagree on the contracted axes {in_shape} vs {w_in}")
    out_dtype = jnp.dtype(out_dtype) if out_dtype is not None else None
    return checkpoint_name(_dense(x, w, in_axes, transposed, out_dtype), DENSE_OUTPUT)


def _flatten(x: Array, w: Array, in_axes: int, transposed: bool):
    """``x2 [M, I]``, ``w2`` (``[I, O]``, or ``[O, I]`` when transposed) and the output shape."""
    size_in = math.prod(x.shape[x.ndim - in_axes :])
    out_shape = w.shape[: w.ndim - in_axes] if transposed else w.shape[in_axes:]
    x2 = x.reshape(-1, size_in)
    w2 = w.reshape(-1, size_in) if transposed else w.reshape(size_in, -1)
    return x2, w2, x.shape[: x.ndim - in_axes] + tuple(out_shape)


def _matmul(a: Array, b: Array, a_axis: int, b_axis: int, out_dtype) -> Array:
    """``a`` and ``b`` (2-D) contracted over ``a_axis`` and ``b_axis``."""
    return jax.lax.dot_general(a, b, (((a_axis,), (b_axis,)), ((), ())), preferred_element_type=out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _dense(x, w, in_axes, transposed, out_dtype):
    x2, w2, out_shape = _flatten(x, w, in_axes, transposed)
    return _matmul(x2, w2, 1, 1 if transposed else 0, out_dtype).reshape(out_shape)


def _dense_fwd(x, w, in_axes, transposed, out_dtype):
    return _dense(x, w, in_axes, transposed, out_dtype), (x, w)


def _dense_bwd(in_axes, transposed, out_dtype, residuals, dy):
    x, w = residuals
    x2, w2, _ = _flatten(x, w, in_axes, transposed)
    dy2 = dy.reshape(x2.shape[0], -1)
    acc = out_dtype
    dx2 = _matmul(dy2, w2, 1, 0 if transposed else 1, acc)
    if transposed:
        dw2 = _matmul(dy2, x2, 0, 0, acc)  # [O, I]
    else:
        dw2 = _matmul(x2, dy2, 0, 0, acc)  # [I, O]
    return dx2.astype(x.dtype).reshape(x.shape), dw2.astype(w.dtype).reshape(w.shape)


_dense.defvjp(_dense_fwd, _dense_bwd)
