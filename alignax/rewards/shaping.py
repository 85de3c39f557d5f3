"""Reward shaping for online RL: length, missing-EOS and overlong penalties; clipping; sums.

Sequence-level arrays are ``[B]``; lengths are response lengths in tokens (from a
response mask: ``mask.sum(-1)``). Each penalty returns a ``[B]`` float32 term, 0 or
negative, to be *added* to the reward (directly or through :func:`composite_reward`).
All functions are pure and trace under ``jax.jit``; hyper-parameters are keyword-only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from alignax._checks import check_choice, check_rank, check_same_shape

Array = jax.Array

LENGTH_PENALTY_MODES = ("beyond", "around")


def _f32(x) -> Array:
    return jnp.asarray(x, jnp.float32)


def length_penalty(
    lengths: Array, *, target_length: float, coef: float, mode: Literal["beyond", "around"] = "beyond"
) -> Array:
    """A linear penalty per token away from a target length.

    - ``beyond``: ``-coef * max(L - target_length, 0)`` (only overshoot is penalised);
    - ``around``: ``-coef * |L - target_length|`` (both directions).

    Args:
      lengths: ``[B]`` response lengths in tokens.
      target_length: the length that costs nothing.
      coef: penalty per token (>= 0).
      mode: ``beyond`` | ``around``.

    Returns ``[B]`` float32, <= 0.
    """
    check_rank(lengths=(lengths, 1))
    check_choice("length penalty mode", mode, LENGTH_PENALTY_MODES)
    if isinstance(coef, (int, float)) and coef < 0:
        raise ValueError(f"coef is the penalty per token and must be >= 0; got {coef}")
    excess = _f32(lengths) - target_length
    distance = jnp.maximum(excess, 0.0) if mode == "beyond" else jnp.abs(excess)
    return -coef * distance


def missing_eos_penalty(tokens: Array, mask: Array, *, stop_token_ids: int | Sequence[int], penalty: float) -> Array:
    """``-penalty`` for each sequence whose response holds no stop token, else 0.

    As TRL's ``missing_eos_penalty``: a response that was cut off by the length budget
    (no EOS among its tokens) is penalised by a fixed amount. The stop token must be
    inside the response mask (the sampler's mask includes the real end-of-turn token,
    even when pad and EOS share an id); a row with no response token counts as missing.

    Args:
      tokens: ``[B, T]`` token ids.
      mask: ``[B, T]`` 1 on response tokens.
      stop_token_ids: one id or several (e.g. ``<|im_end|>`` and ``<|endoftext|>``).
      penalty: the amount subtracted (>= 0).

    Returns ``[B]`` float32: ``-penalty`` or 0.
    """
    check_rank(tokens=(tokens, 2))
    check_same_shape(tokens=tokens, mask=mask)
    stop_ids = np.atleast_1d(np.asarray(stop_token_ids))
    if stop_ids.size == 0 or not np.issubdtype(stop_ids.dtype, np.integer):
        raise ValueError(f"stop_token_ids must be one or more integer token ids; got {stop_token_ids!r}")
    if isinstance(penalty, (int, float)) and penalty < 0:
        raise ValueError(f"penalty is subtracted and must be >= 0; got {penalty}")
    is_stop = jnp.isin(jnp.asarray(tokens), jnp.asarray(stop_ids)) & jnp.asarray(mask).astype(bool)
    ended = jnp.any(is_stop, axis=-1)
    return jnp.where(ended, 0.0, -_f32(penalty))


def overlong_penalty(lengths: Array, *, max_length: int, cache_length: int, scale: float = 1.0) -> Array:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), times ``scale``.

    With ``L_max = max_length`` and ``L_cache = cache_length``::

        R(L) = 0                                  if L <= L_max - L_cache
               ((L_max - L_cache) - L) / L_cache  if L_max - L_cache < L <= L_max
               -1                                 if L > L_max

    The penalty ramps linearly from 0 to -1 over the last ``L_cache`` tokens of the
    budget. In DAPO ``L_max`` is the expected maximum length, shorter than the hard
    generation budget by ``L_cache`` (e.g. 16,384 + 4,096 = 20,480 tokens).

    Args:
      lengths: ``[B]`` response lengths in tokens.
      max_length: ``L_max``.
      cache_length: ``L_cache``, in ``(0, L_max]``.
      scale: multiplies the penalty (verl's ``overlong_penalty_factor``).

    Returns ``[B]`` float32 in ``[-scale, 0]``.
    """
    check_rank(lengths=(lengths, 1))
    if not 0 < cache_length <= max_length:
        raise ValueError(
            f"cache_length must be in (0, max_length]; got cache_length={cache_length}, max_length={max_length}"
        )
    length = _f32(lengths)
    soft_start = max_length - cache_length
    ramp = (soft_start - length) / cache_length
    penalty = jnp.where(length <= soft_start, 0.0, jnp.where(length <= max_length, ramp, -1.0))
    return scale * penalty


def clip_rewards(rewards: Array, *, low: float, high: float) -> Array:
    """``clip(rewards, low, high)`` in float32 (any shape)."""
    if isinstance(low, (int, float)) and isinstance(high, (int, float)) and low > high:
        raise ValueError(f"clip_rewards needs low <= high; got low={low}, high={high}")
    return jnp.clip(_f32(rewards), low, high)


def composite_reward(
    components: Mapping[str, Array], weights: Mapping[str, float]
) -> tuple[Array, dict[str, Array]]:
    """A weighted sum of named reward components: ``total = sum_k w_k * c_k``.

    Args:
      components: name -> ``[B]`` reward (e.g. ``{"correct": ..., "format": ...,
        "overlong": overlong_penalty(...)}``).
      weights: name -> weight; its names must equal those of ``components`` exactly,
        so a misspelt or forgotten component is an error, not a silent zero.

    Returns ``(total [B], {name: w_k * c_k [B]})``, float32; the per-component dict is
    for logging each part's contribution.
    """
    missing = sorted(set(components) - set(weights))
    extra = sorted(set(weights) - set(components))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"components without a weight: {', '.join(missing)}")
        if extra:
            parts.append(f"weights for absent components: {', '.join(extra)}")
        raise ValueError(
            f"composite_reward: {'; '.join(parts)} (components: {', '.join(sorted(components)) or 'none'})"
        )
    if not components:
        raise ValueError("composite_reward needs at least one component")
    for name, value in components.items():
        check_rank(**{f"components[{name!r}]": (value, 1)})
    check_same_shape(**{f"components[{name!r}]": value for name, value in components.items()})
    weighted = {name: weights[name] * _f32(value) for name, value in components.items()}
    total = sum(weighted[name] for name in sorted(weighted))
    return total, weighted
