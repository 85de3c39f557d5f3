"""Quantised frozen kernels for QLoRA (Dettmers et al. 2023): int8 and 4-bit NormalFloat
(NF4), blockwise absmax, dequantised inside the projection.

A kernel ``W`` (``[*in, *out]``, or ``[L, *in, *out]`` stacked for scan) is cut into
blocks of ``block_size`` consecutive elements in row-major order along its trailing axes;
each block keeps its absmax ``m`` (float32) and codes of ``W / m``:

- ``int8``: ``q = round(127 W / m)`` in ``[-127, 127]``; ``W' = q m / 127``, so
  ``|W - W'| <= m / 254`` (half a step).
- ``nf4``: the index of the nearest of the 16 NF4 values (:data:`NF4`, the QLoRA paper's
  codebook, as bitsandbytes ships it); ``W' = NF4[q] m``, so ``|W - W'| <= m * g`` with
  ``g`` the largest half-gap between neighbouring codebook values. Two codes per byte:
  element ``2i`` of the last axis in the high nibble, ``2i + 1`` in the low one.

Blocks lie along the last axis when its size is a multiple of ``block_size`` (every
projection of SmolLM2, Llama, Qwen and GPT-2 at the default 64); otherwise they span the
fewest trailing axes whose size is (a test-sized model: ``head_dim`` 8). The codes keep
the kernel's shape (NF4: the last axis halved) and its logical axis names, so under the
mesh rules they shard as the kernel does. The scales ``[*lead, n_blocks]`` keep the names
of the leading axes; their blocked axis keeps the kernel's last name when the blocks lie
along that one axis, and is unnamed (replicated) when they span several.
No double quantisation of the scales: they stay float32 (4 bytes a block, 1/16 byte a
weight at block 64).

:class:`QuantizedKernel` holds ``codes`` and ``scales`` as :class:`QuantizedParam` (an
``nnx.Param``: they travel with the frozen base as arguments, never trained, never cast to
another dtype). :func:`project` is ``dense`` for a kernel of either kind; for a quantised
one the backward pass dequantises again rather than keeping the dequantised kernel as a
residual, so only one projection's full-precision weights exist at a time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from alignax.models.dense import DENSE_OUTPUT, dense

Array = jax.Array

QUANTIZE_KINDS = ("none", "int8", "nf4")

# The NF4 codebook (QLoRA, Dettmers et al. 2023, appendix E; bitsandbytes' create_normal_map
# with offset 0.9677): quantiles of N(0, 1), 8 positive and 7 negative, scaled to [-1, 1],
# with an exact zero.
NF4 = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], np.float32)
_NF4_MIDPOINTS = (NF4[1:] + NF4[:-1]) / 2


def block_axes(shape: Sequence[int], block_size: int) -> int:
    """How many trailing axes of a (per-layer) kernel ``shape`` the blocks run along: the
    fewest whose size is a multiple of ``block_size``."""
    for t in range(1, len(shape) + 1):
        if math.prod(shape[len(shape) - t:]) % block_size == 0:
            return t
    raise ValueError(f"lora.quant_block_size={block_size} does not divide a kernel of shape {tuple(shape)} "
                     f"({math.prod(shape)} weights); choose a block size that divides it")


def _blocks(w: Array, block_size: int, axes: int) -> Array:
    """``w`` as ``[*lead, n_blocks, block_size]`` (the last ``axes`` axes cut into blocks)."""
    return w.reshape(*w.shape[:w.ndim - axes], -1, block_size)


@functools.partial(jax.jit, static_argnames=("kind", "block_size", "axes"))
def quantize(w: Array, kind: str, block_size: int, axes: int) -> tuple[Array, Array]:
    """``(codes, scales)`` of ``w``: int8 codes of ``w``'s shape, or NF4 nibbles packed two
    a byte (``uint8``, last axis halved); scales float32 ``[*lead, n_blocks]``."""
    blocks = _blocks(jnp.asarray(w, jnp.float32), block_size, axes)
    scales = jnp.max(jnp.abs(blocks), axis=-1)
    unit = blocks / jnp.where(scales == 0, 1.0, scales)[..., None]  # in [-1, 1]
    if kind == "int8":
        codes = jnp.clip(jnp.round(unit * 127.0), -127, 127).astype(jnp.int8).reshape(w.shape)
    elif kind == "nf4":
        index = jnp.searchsorted(jnp.asarray(_NF4_MIDPOINTS), unit).astype(jnp.uint8).reshape(w.shape)
        if w.shape[-1] % 2:
            raise ValueError(f"nf4 packs two codes a byte along the last axis; a kernel of shape {w.shape} has an "
                             "odd one")
        codes = (index[..., 0::2] << 4) | index[..., 1::2]
    else:
        raise ValueError(f"lora.quantize={kind!r}; valid: {', '.join(QUANTIZE_KINDS)}")
    return codes, scales


@functools.partial(jax.jit, static_argnames=("kind", "block_size", "dtype"))
def dequantize(codes: Array, scales: Array, kind: str, block_size: int, dtype=jnp.float32) -> Array:
    """The kernel ``codes`` and ``scales`` stand for, in ``dtype`` (computed in float32)."""
    if kind == "int8":
        unit = codes.astype(jnp.float32) / 127.0
    elif kind == "nf4":
        index = jnp.stack([codes >> 4, codes & 0xF], axis=-1).reshape(*codes.shape[:-1], -1)
        unit = jnp.asarray(NF4)[index.astype(jnp.int32)]
    else:
        raise ValueError(f"lora.quantize={kind!r} has no codes; valid: int8, nf4")
    w = unit.reshape(*scales.shape, block_size) * scales[..., None]
    return w.reshape(unit.shape).astype(dtype)


def max_error(kind: str) -> float:
    """The largest ``|W - W'|`` per unit of block absmax: ``1/254`` (int8), the largest
    half-gap of the NF4 codebook (nf4)."""
    return 1.0 / 254.0 if kind == "int8" else float(np.max(np.diff(NF4)) / 2)


def quantized_bytes(weights: int, kind: str, block_size: int) -> float:
    """Bytes that ``weights`` quantised weights take: codes (1 byte int8, 1/2 byte NF4) and
    one float32 scale per block (the arrays :class:`QuantizedKernel` stores)."""
    per_weight = {"int8": 1.0, "nf4": 0.5}[kind]
    return weights * per_weight + 4.0 * weights / block_size


class QuantizedParam(nnx.Param):
    """A quantised kernel's codes or scales: frozen, and kept in its own dtype."""


class QuantizedKernel(nnx.Module):
    """A frozen kernel stored as ``codes`` and ``scales`` (module docstring); ``names``: the
    kernel's logical axis names."""

    def __init__(self, value: Array, names: Sequence[str], *, kind: str, block_size: int):
        self.kind = kind
        self.block_size = block_size
        self.axes = block_axes(np.shape(value), block_size)
        codes, scales = quantize(value, kind, block_size, self.axes)
        names = tuple(names)
        scale_names = names[:len(names) - self.axes] + ((names[-1],) if self.axes == 1 else (None,))
        self.codes = QuantizedParam(codes, out_sharding=names, eager_sharding=False)
        self.scales = QuantizedParam(scales, out_sharding=scale_names, eager_sharding=False)

    def dequantize(self, dtype=jnp.float32) -> Array:
        return dequantize(self.codes[...], self.scales[...], self.kind, self.block_size, dtype)


def project(x: Array, kernel, *, in_axes: int = 1) -> Array:
    """``dense(x, W)`` in ``x``'s dtype for ``kernel`` an ``nnx.Param`` or a
    :class:`QuantizedKernel` (dequantised to ``x``'s dtype here, and again in the backward)."""
    if not isinstance(kernel, QuantizedKernel):
        return dense(x, kernel[...].astype(x.dtype), in_axes=in_axes)
    y = _quantized_dense(x, kernel.codes[...], kernel.scales[...], kernel.kind, kernel.block_size, in_axes)
    return checkpoint_name(y, DENSE_OUTPUT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _quantized_dense(x, codes, scales, kind, block_size, in_axes):
    return dense(x, dequantize(codes, scales, kind, block_size, x.dtype), in_axes=in_axes)


def _quantized_dense_fwd(x, codes, scales, kind, block_size, in_axes):
    return _quantized_dense(x, codes, scales, kind, block_size, in_axes), (x, codes, scales)


def _quantized_dense_bwd(kind, block_size, in_axes, residuals, dy):
    """``dx = dy W^T`` with ``W`` dequantised again (not kept from the forward); the codes
    and scales are frozen: a zero (``float0`` for the integer codes) cotangent."""
    x, codes, scales = residuals
    w = dequantize(codes, scales, kind, block_size, dy.dtype)
    dx = dense(dy, w, in_axes=w.ndim - in_axes, transposed=True)  # [..., *out] x [*in, *out]
    return dx.astype(x.dtype), np.zeros(codes.shape, jax.dtypes.float0), jnp.zeros_like(scales)


_quantized_dense.defvjp(_quantized_dense_fwd, _quantized_dense_bwd)


# ---------------------------------------------------------------------------- whole states
def quantize_state(state: nnx.State, abstract: nnx.State, *, kind: str, block_size: int,
                   mesh: jax.sharding.Mesh | None = None) -> nnx.State:
    """``state`` (a model's, float kernels) in the layout of ``abstract`` (the same model
    built with quantised kernels): each kernel ``.../q_kernel`` that ``abstract`` holds as
    ``.../q_kernel/codes`` and ``.../scales`` is quantised (one jitted program, with
    ``mesh`` created in its sharding) and the float kernel dropped from the result."""
    from alignax.parallel.sharding import tree_shardings

    flat = dict(nnx.to_flat_state(state))
    target = dict(nnx.to_flat_state(abstract))
    sources = {path[:-1] for path in target if path[-1] == "codes"}
    missing = [p for p in sources if p not in flat]
    if missing:
        raise ValueError(f"no float kernel at {'/'.join(map(str, missing[0]))} to quantise")
    kernels = {p: flat.pop(p)[...] for p in sorted(sources, key=str)}
    axes = {p: kernels[p].ndim - (target[(*p, "scales")].ndim - 1) for p in kernels}
    out = {p: (target[(*p, "codes")], target[(*p, "scales")]) for p in kernels}

    def run(values):
        return {p: quantize(values[p], kind, block_size, axes[p]) for p in values}

    shardings = None
    if mesh is not None:
        shardings = {p: tuple(s.get_value() for s in tree_shardings(list(v), mesh)) for p, v in out.items()}
    quantized = jax.jit(run, out_shardings=shardings)(kernels)
    for p, (codes, scales) in quantized.items():
        flat[(*p, "codes")] = out[p][0].replace(codes)
        flat[(*p, "scales")] = out[p][1].replace(scales)
    return nnx.from_flat_state(flat)


def dequantize_state(state: nnx.State, *, kind: str, block_size: int, dtype) -> nnx.State:
    """``state`` with every quantised kernel back as a float ``nnx.Param`` in ``dtype`` (the
    layout of the same model without quantisation: for merging and export)."""
    flat = dict(nnx.to_flat_state(state))
    for path in [p for p in flat if p[-1] == "codes" and isinstance(flat[p], QuantizedParam)]:
        codes, scales = flat.pop(path), flat.pop((*path[:-1], "scales"))
        value = dequantize(codes[...], scales[...], kind, block_size, dtype)
        flat[path[:-1]] = nnx.Param(value, out_sharding=codes.get_metadata()["out_sharding"], eager_sharding=False)
    return nnx.from_flat_state(flat)
