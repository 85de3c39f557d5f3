"""The precision policy of a run (the ``precision:`` section) and what applies it: the
dtypes models are built with, an optax wrapper that keeps a float32 master copy of
bfloat16 parameters, and the dtype frozen models are held in.

Whatever the policy, these stay float32: logits (the LM head accumulates in float32),
log-softmax, per-token log-probs and entropies, values and rewards (the heads accumulate
in float32), KL estimates, advantages and every loss; so do gradient accumulation over
micro-batches, the gradient norm and the optimiser's arithmetic.

Why a master copy. bfloat16 keeps 8 significant bits: a weight ``w`` moves only when an
update exceeds half its spacing, at least ``|w| * 2**-9`` (0.2 % of the weight). Adam's steps are
about the learning rate, so at ``lr = 1e-6`` on weights of ~1e-2 every update rounds away
and the run does not learn (issue 13). With ``master_dtype: float32`` the optimiser keeps
the weights in float32 in its state, applies every update there, and writes the bfloat16
rounding of the result back to the parameters the model computes from.

Memory per parameter (bytes): params + master + Adam's two moments, and the reference:

    float32 policy                            4 + 0 + 4 + 4     reference 4   (16)
    bfloat16 params, float32 master           2 + 4 + 4 + 4     reference 2   (16)
    ... and mu_dtype: bfloat16                2 + 4 + 2 + 4     reference 2   (14)
    bfloat16 params, no master                2 + 0 + 4 + 4     reference 2   (12)

plus the gradients (in the parameter dtype) during a step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from alignax.models.quant import QuantizedParam
from alignax.trainers.config import PrecisionConfig


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def cast_floating(tree: Any, dtype) -> Any:
    """``tree`` with its floating-point leaves in ``dtype`` (others unchanged); inside a jit
    a leaf already of ``dtype`` is passed through, not copied."""
    dtype = jnp.dtype(dtype)
    return jax.tree.map(lambda x: x.astype(dtype) if _is_float(x) else x, tree)


# ---------------------------------------------------------------------------- the optimiser
class MasterWeightsState(NamedTuple):
    """``master``: the parameters in the master dtype; ``inner``: the wrapped optimiser's
    state, built on the master copy (its moments follow the master's dtype)."""

    master: Any
    inner: Any


def master_weights(inner: optax.GradientTransformation, *, dtype=jnp.float32) -> optax.GradientTransformationExtraArgs:
    """``inner`` run on a ``dtype`` copy of the parameters kept in the optimiser state.

    ``update(grads, state, params)``: the gradients are cast to ``dtype``, ``inner`` updates
    the master copy (``master + inner_updates``), and the returned updates move each
    parameter to the master's rounding to the parameter's own dtype:
    ``u = cast(cast(master, p.dtype), dtype) - p`` in ``dtype``, so ``optax.apply_updates``
    gives ``params == cast(master, params' dtype)``. (The float32 difference of two
    bfloat16 numbers is exact unless one is over 2**16 times the other, a weight jumping
    across zero; then the parameter is off by at most a float32 spacing of the old weight,
    and the next update rewrites it from the master.)

    Extra arguments of ``update`` (``schedule_step``) reach ``inner``. Pure and jittable;
    the state is a pytree Orbax saves with the rest of the train state.
    """
    dtype = jnp.dtype(dtype)
    inner = optax.with_extra_args_support(inner)

    def init(params):
        master = cast_floating(params, dtype)
        return MasterWeightsState(master=master, inner=inner.init(master))

    def update(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError("master_weights needs the params in update(grads, state, params)")
        steps, inner_state = inner.update(cast_floating(updates, dtype), state.inner, state.master, **extra_args)
        master = optax.apply_updates(state.master, steps)
        updates = jax.tree.map(lambda m, p: m.astype(p.dtype).astype(dtype) - p.astype(dtype), master, params)
        return updates, MasterWeightsState(master=master, inner=inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def float32_arithmetic(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``inner`` computing in float32 on narrower parameters, with no master copy: its
    state (Adam's moments) is built float32, gradients and params are cast up, and the
    float32 updates are rounded into the parameters by ``optax.apply_updates``."""
    inner = optax.with_extra_args_support(inner)

    def init(params):
        return inner.init(cast_floating(params, jnp.float32))

    def update(updates, state, params=None, **extra_args):
        return inner.update(cast_floating(updates, jnp.float32), state,
                            None if params is None else cast_floating(params, jnp.float32), **extra_args)

    return optax.GradientTransformationExtraArgs(init, update)


def with_precision(optimizer: optax.GradientTransformation, policy: PrecisionConfig) -> optax.GradientTransformation:
    """``optimizer`` under ``policy``: unchanged for float32 parameters; for bfloat16
    parameters wrapped in :func:`master_weights` (``master_dtype`` set) or
    :func:`float32_arithmetic` (``master_dtype: null``)."""
    if policy.param_dtype == "float32":
        return optimizer
    if policy.master_dtype is not None:
        return master_weights(optimizer, dtype=policy.master_dtype)
    return float32_arithmetic(optimizer)


def master_params(params: Any, opt_state: Any) -> Any:
    """The trained weights at the precision the optimiser keeps them: each leaf of
    ``params`` replaced by its master copy where ``opt_state`` holds a
    :class:`MasterWeightsState` (anywhere in it: under ``optax.chain``, or per label under
    ``optax.multi_transform``, whose masked-out leaves are ``optax.MaskedNode``); ``params``
    itself when it holds none (float32 runs, ``master_dtype: null``). What an export writes."""
    states = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, MasterWeightsState))
    out = params
    for state in states:
        if isinstance(state, MasterWeightsState):
            out = jax.tree.map(lambda p, m: p if isinstance(m, optax.MaskedNode) else m, out, state.master)
    return out


# ---------------------------------------------------------------------------- frozen models
def cast_params(state: Any, dtype) -> Any:
    """An ``nnx.State`` (or plain pytree) with its ``nnx.Param`` arrays in ``dtype``; other
    variables keep theirs. One compiled program; when every floating array already has
    ``dtype``, ``state`` itself is returned (no copy)."""
    dtype = jnp.dtype(dtype)
    if all(not _is_float(x) or x.dtype == dtype for x in jax.tree.leaves(state)):
        return state

    return jax.jit(lambda s: _cast_tree(s, dtype, min_rank=0))(state)


def _cast_tree(state: Any, dtype, *, min_rank: int) -> Any:
    """``state`` with the floating arrays of its ``nnx.Param``s of rank ``>= min_rank`` in
    ``dtype``; other variables, and a QLoRA kernel's codes and scales
    (alignax.models.quant), keep their dtypes."""
    def cast(leaf):
        if isinstance(leaf, nnx.Variable) and (not isinstance(leaf, nnx.Param) or isinstance(leaf, QuantizedParam)):
            return leaf
        if jnp.ndim(leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf) < min_rank:
            return leaf
        return cast_floating(leaf, dtype)

    return jax.tree.map(cast, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def compute_copy(dtype, shardings: Any):
    """The program that makes the weights a sampler decodes with: ``program(state)`` is a
    copy of ``state`` whose kernels and embeddings (``nnx.Param`` arrays of rank >= 2) are
    in the compute ``dtype``, every array placed by ``shardings`` (a tree of
    ``NamedSharding``s like ``state``'s, on the sampler's mesh: a mesh other than the one
    ``state`` lies on is a reshard, done by the same program). Keep the program: it
    compiles once per tree structure.

    The decoder casts every kernel and embedding to the compute dtype where it uses it
    (``kernel[...].astype(x.dtype)``), so generation from the copy is generation from
    ``state``; norm scales and biases (rank 1, a few KB) keep their dtype, because some are
    applied in float32 (layer norms). Decoding then reads, and on an FSDP mesh gathers,
    compute-dtype weights instead of float32 ones.
    """
    dtype = jnp.dtype(dtype)
    return jax.jit(lambda s: _cast_tree(s, dtype, min_rank=2), out_shardings=shardings)


def frozen_params(params: Any, policy: PrecisionConfig) -> Any:
    """The frozen reference made from the initial ``params``, in ``policy.frozen``: the
    initial arrays themselves when they already have that dtype (the train state holds
    distinct buffers, so nothing is copied), else their cast."""
    return cast_params(params, policy.frozen)
