"""What differs between a model's layers, and the soft cap: sliding-window layers beside
full-attention ones (Mistral, Phi-3, Gemma 2 and 3), and Gemma 3's local RoPE base.

A sliding layer's query at position ``p`` sees the keys at positions ``p - W < q <= p``
(``W = config.sliding_window``, itself included), transformers' ``sliding_window_overlay``
(``kv_idx > q_idx - W``). Windows are counted in positions, not array slots: a full pass
compares the ``positions`` it is given (so packed continuations with restarted positions
see the same window as alone), a pass into the KV cache the positions of its slots among
the row's real tokens (:func:`alignax.models.cache.slot_positions`). For a row whose real
tokens are contiguous (left or right padding) both equal transformers' index distance.

Per-layer inputs that differ (the attention mask, RoPE's sin/cos) travel as a
:class:`ByLayerType`; each layer takes its own with :func:`pick`: a Python choice in a
layer loop, a ``jnp.where`` on the layer index under ``jax.lax.scan``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array


def softcap(x: Array, cap: float | None) -> Array:
    """``cap * tanh(x / cap)`` (Gemma 2's attention and final-logit soft-capping); ``x`` when
    ``cap`` is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def window_mask(query_positions: Array, key_positions: Array, window: int) -> Array:
    """``[B, T, S]`` bool: key ``s`` lies in query ``t``'s window, ``k_pos > q_pos - window``
    (``query_positions [B, T]``, ``key_positions [B, S]``; causality is the caller's mask)."""
    return key_positions[:, None, :] > query_positions[:, :, None] - window


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ByLayerType:
    """One input in two forms: for full-attention layers and for sliding-window layers."""

    full: Any
    sliding: Any


def by_layer_type(sliding_layers: tuple[bool, ...], full: Any, sliding: Any) -> Any:
    """``full`` or ``sliding`` alone when every layer takes the same; else both."""
    if all(sliding_layers):
        return sliding
    if not any(sliding_layers):
        return full
    return ByLayerType(full=full, sliding=sliding)


def pick(value: Any, layer: Array | int, sliding_layers: tuple[bool, ...]) -> Any:
    """Layer ``layer``'s form of ``value`` (anything else passes through)."""
    if not isinstance(value, ByLayerType):
        return value
    if isinstance(layer, int):
        return value.sliding if sliding_layers[layer] else value.full
    flag = jnp.asarray(sliding_layers)[layer]
    return jax.tree.map(lambda s, f: jnp.where(flag, s, f), value.sliding, value.full)
