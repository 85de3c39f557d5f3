"""The key/value cache for incremental decoding: a plain pytree of arrays.

Layout (``L`` layers, ``B`` batch, ``S`` cache slots, ``K`` kv heads, ``H`` head dim)::

    k, v   [L, B, S, K, H]   keys (RoPE already applied) and values, in the cache dtype
    mask   [B, S] bool       True where a slot holds a real (non-pad) token
    index  [] int32          next slot to write; every row writes the same slots

A forward pass on ``T`` new tokens with a cache writes their keys/values and their
``attention_mask`` into slots ``[index, index + T)`` of every row and returns the cache
with ``index + T``. Query ``t`` of the call sits in slot ``index + t`` and attends to
slot ``s`` iff ``s <= index + t`` and ``mask[b, s]``. Slots are time order, so this is
the causal mask; pad slots (left padding of the prompt, or rows that already finished)
are never attended, whatever their content. Positions (for RoPE or learned position
embeddings) are an explicit input, so a left-padded row's first real token can sit in
slot 3 with position 0.

Typical use (what the sampler does inside one ``jax.jit``)::

    cache = init_cache(config, batch=B, max_len=P + N)
    out = model(prompt, positions, prompt_mask, cache=cache)           # prefill: slots [0, P)
    cache = out.cache
    # loop (lax.while_loop / scan), one token per row per step:
    out = model(next_tok[:, None], next_pos[:, None], alive[:, None], cache=cache)

Under a mesh, :func:`cache_shardings` places the cache by the logical-axis rules (batch
over ``("data", "fsdp")``, kv heads over ``tensor``), matching the activations.

Sliding-window layers (:mod:`alignax.models.layer_types`) keep every slot and mask the
keys out of the window: a slot's position is its count among the row's real slots
(:func:`slot_positions`), so the window spans the ``W`` latest real tokens, as in a full pass.

Slots past ``S`` cannot be written: ``jax.lax.dynamic_update_slice`` would clamp the
index, so callers size ``max_len`` for prompt plus generation budget.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from alignax.models.config import ModelConfig
from alignax.parallel.sharding import LOGICAL_AXIS_RULES, logical_to_spec

Array = jax.Array


@struct.dataclass
class KVCache:
    """Keys, values, slot mask and write index; see the module docstring for the layout."""

    k: Array
    v: Array
    mask: Array
    index: Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> KVCache:
    """An empty cache: zeros, ``mask`` all False, ``index`` 0.

    ``dtype`` defaults to the config's compute dtype.
    """
    if batch < 1 or max_len < 1:
        raise ValueError(f"batch and max_len must be >= 1; got batch={batch}, max_len={max_len}")
    dtype = jnp.dtype(dtype or config.dtype)
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        mask=jnp.zeros((batch, max_len), bool),
        index=jnp.zeros((), jnp.int32),
    )


# Logical axis names of each cache field (see alignax.parallel.LOGICAL_AXIS_RULES).
CACHE_AXES = {
    "k": ("layers", "batch", "length", "kv_heads", "head_dim"),
    "v": ("layers", "batch", "length", "kv_heads", "head_dim"),
    "mask": ("batch", "length"),
    "index": (),
}


def cache_shardings(cache: KVCache, mesh, *, rules=LOGICAL_AXIS_RULES) -> KVCache:
    """A ``KVCache`` of ``NamedSharding``s for ``cache`` on ``mesh`` (for ``jax.device_put``
    or ``jax.jit(..., out_shardings=...)``)."""
    from jax.sharding import NamedSharding

    def one(name):
        value = getattr(cache, name)
        return NamedSharding(mesh, logical_to_spec(CACHE_AXES[name], value.shape, mesh, rules=rules))

    return KVCache(**{name: one(name) for name in CACHE_AXES})


def slot_positions(mask: Array) -> Array:
    """Position ``[B, S]`` of each slot among its row's real slots, ``cumsum(mask) - 1``
    (what :func:`alignax.models.positions_from_mask` gives the same tokens in a full pass;
    a pad slot carries its predecessor's, and is never attended)."""
    return jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1
