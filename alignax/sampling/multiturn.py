"""One model turn of a multi-turn rollout, on device: append new context to the KV cache
(prefilling only those tokens), then decode until a stop token or the turn's budget.

A multi-turn rollout (:mod:`alignax.envs.rollout`) keeps one KV cache per row across
turns. Each turn feeds a left-padded chunk ``[R, L]`` of new context — the prompt on the
first turn; then the model's last token of the previous turn (a drawn token is never fed
by the decode loop) followed by the observation — into slots ``[index, index + L)`` of
the existing cache, at positions continuing each row's own count, and decodes from the
chunk's last column with :func:`alignax.sampling.sampler.decode_loop`. Pad slots (chunk
padding, rows that stopped early or whose trajectory is over) keep mask 0 and are never
attended, so the cache holds each row's trajectory in order with holes, and its logits
equal a forward pass over the trajectory written contiguously.

A row that is not ``live`` (its trajectory ended) feeds nothing and draws nothing.
Capacity: the cache's slots must hold every chunk plus each turn's decode steps
(:func:`turn_cache_length`); positions advance by real tokens only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from alignax.models.cache import KVCache, init_cache
from alignax.sampling.sampler import SamplingConfig, constrain_cache, decode_loop, new_loop_state, repeat_prefill

Array = jax.Array


@struct.dataclass
class TurnOutput:
    """One turn of ``R`` rows, ``T = config.max_new_tokens``; fields as
    :class:`~alignax.sampling.SamplingOutput`'s, plus the carried ``cache`` and
    ``position [R]`` (the position of the last drawn token, which the next chunk feeds)."""

    tokens: Array
    response_mask: Array
    sampling_logps: Array
    logps: Array
    stopped: Array
    num_steps: Array
    cache: KVCache
    position: Array


def turn_cache_length(prompt_len: int, chunk_len: int, turn_tokens: int, max_turns: int) -> int:
    """Cache slots for ``max_turns`` turns: the prompt, ``max_turns - 1`` chunks of
    ``chunk_len``, and up to ``turn_tokens - 1`` decode steps per turn."""
    return prompt_len + (max_turns - 1) * chunk_len + max_turns * (turn_tokens - 1)


def extend(model, cache: KVCache, position: Array, tokens: Array, mask: Array) -> tuple[Array, KVCache, Array]:
    """Prefill a left-padded chunk ``tokens [R, L]`` (``mask`` 1 on real tokens) into
    ``cache``: ``(next-token logits [R, V] at the chunk's last column, cache, position + real tokens)``."""
    mask = mask.astype(jnp.int32)
    positions = position[:, None] + jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
    out = model(tokens.astype(jnp.int32), positions, mask, cache=cache, return_logits=False)
    return model.logits(out.hidden[:, -1]), out.cache, position + jnp.sum(mask, axis=1)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("config", "cache_len", "shared"))
def generate_turn(graphdef, state, cache: KVCache | None, position, chunk_tokens, chunk_mask, live, rng, *,
                  config: SamplingConfig, cache_len: int | None = None, shared: int = 1) -> TurnOutput:
    """Feed ``chunk_tokens [R, L]`` into ``cache`` and draw up to ``config.max_new_tokens``
    tokens for every ``live [R]`` row (``config.num_samples`` must be 1: rows are trajectories).

    The first turn passes ``cache=None`` and ``position=None``: an empty cache of
    ``cache_len`` slots (:func:`turn_cache_length`) is made here, on the mesh when called
    under one. A write past the cache's end would be clamped by ``dynamic_update_slice``,
    so the caller (:class:`alignax.envs.rollout.EnvSampler`) keeps count of the slots.

    ``shared`` (first turn only): every block of ``shared`` consecutive rows holds one
    prompt (a GRPO group's trajectories of one record), so it is prefilled once per block
    and the cache repeated, as :func:`alignax.sampling.generate` does for ``num_samples``.
    """
    if config.num_samples != 1:
        raise ValueError(f"generate_turn draws one continuation per row; got num_samples={config.num_samples}")
    model = nnx.merge(graphdef, state)
    if cache is None:
        if cache_len is None:
            raise ValueError("the first turn (cache=None) needs cache_len")
        rows = chunk_tokens.shape[0]
        if rows % shared:
            raise ValueError(f"shared={shared} does not divide the {rows} rows")
        prompts = rows // shared
        cache = constrain_cache(init_cache(model.config, batch=prompts, max_len=cache_len))
        logits, cache, position = extend(model, cache, jnp.zeros((prompts,), jnp.int32),
                                         chunk_tokens[::shared], chunk_mask[::shared])
        if shared > 1:
            cache, logits, position = repeat_prefill(cache, logits, position, shared)
    elif shared != 1:
        raise ValueError("shared applies to the first turn's prompt (cache=None)")
    else:
        logits, cache, position = extend(model, cache, position, chunk_tokens, chunk_mask)
    s = decode_loop(model, new_loop_state(cache, logits, position, ~live.astype(bool), config), rng, config)
    return TurnOutput(tokens=s.tokens, response_mask=s.response_mask, sampling_logps=s.sampling_logps, logps=s.logps,
                      stopped=s.stopped, num_steps=s.step, cache=s.cache, position=s.position)
