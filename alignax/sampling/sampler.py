"""Generation as one compiled program: prefill, then a ``jax.lax.while_loop`` decode.

Log-prob conventions (what importance ratios mean)
--------------------------------------------------
Each response token ``y_t`` comes with two log-probabilities, both float32:

- ``sampling_logps[t] = log q(y_t | x, y_<t)`` where ``q`` is the distribution the token
  was actually drawn from: ``softmax(logits / temperature)`` restricted to the top-k /
  top-p set and renormalised (:func:`alignax.sampling.sampling_logprobs`). Greedy
  decoding draws from a point mass, so its ``sampling_logps`` are 0. This is the
  behaviour policy's log-prob: off-policy corrections (importance ratios against the
  sampler, truncated IS) divide by ``exp(sampling_logps)``.
- ``logps[t] = log p(y_t | x, y_<t)`` with ``p = softmax(logits)``: the model's own
  untempered, untruncated distribution, i.e. what a trainer recomputes from a full
  forward pass at temperature 1 (``alignax.ops.token_logprobs``). PPO/GRPO ratios
  ``pi_theta / pi_old`` at temperature 1 use these as ``old_logps``.

The two agree when ``temperature == 1`` and neither top-k nor top-p truncates. A trainer
that recomputes with ``ops.token_logprobs(..., temperature=T)`` matches
``sampling_logps`` when nothing is truncated. A token outside the top-k/top-p set has
``q = 0`` but ``p > 0``, so ratios against ``q`` are only defined on sampled tokens.
Both are 0 where ``response_mask`` is 0.

Layout of the output
--------------------
``R = B * num_samples`` rows: row ``b * num_samples + g`` is sample ``g`` of prompt
``b`` (``group_ids[r] = r // num_samples``), so any ``[R]`` array reshapes to
``[B, num_samples]`` groups for GRPO-style advantages. ``response_mask`` is 1 on every
generated token up to and including the first stop token and 0 after it (those slots
hold ``pad_id``): with pad id == eos id the real end-of-turn token stays in the mask.

How it runs
-----------
Prompts are left-padded (every row's last column is a real token), so one prefill over
``[B, P]`` gives each row's next-token logits at column ``P - 1``. For
``num_samples > 1`` the prefilled KV cache and those logits are repeated over the batch
(``jnp.repeat``) instead of running the prompt again per sample: a broadcast and a
reshape, so under a mesh each prompt's copies are made on the devices that hold it (the
gather ``jnp.repeat`` becomes when given ``total_repeat_length`` needs the whole cache on
every device). The decode loop feeds one token per row per step; a row that has emitted
a stop token feeds ``pad_id`` with attention mask 0 (its cache slots are never
attended), keeps ``response_mask`` 0 and stops advancing its position. The loop ends
when every row is done or after ``max_new_tokens``; ``num_steps`` says how many tokens
were drawn per row (the model ran ``num_steps - 1`` decode steps after the prefill).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from alignax._checks import check_rank, check_same_shape
from alignax.models.cache import CACHE_AXES, KVCache, init_cache
from alignax.models.modeling import positions_from_mask
from alignax.parallel import constrain
from alignax.sampling.distribution import draw_from_logprobs, first_argmax, sampling_logprobs

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample; frozen and hashable, so it is a static argument of the jitted loop.

    Fields:
      max_new_tokens: generation budget ``N`` per row (the response arrays are ``[R, N]``).
      temperature: divides the logits before sampling; ``> 0`` (ignored when ``greedy``).
      top_k: keep the ``top_k`` most likely tokens; ``0`` keeps all.
      top_p: nucleus mass in ``(0, 1]``; ``1`` keeps all.
      greedy: take the argmax of the logits instead of sampling.
      stop_token_ids: ids that end a row (the stop token is kept in the response).
      pad_id: written after a row has stopped.
      num_samples: samples per prompt (the GRPO group size ``G``).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    stop_token_ids: tuple[int, ...] = ()
    pad_id: int = 0
    num_samples: int = 1

    def __post_init__(self):
        ids = self.stop_token_ids
        if isinstance(ids, (int, np.integer)):
            ids = (ids,)
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))
        if int(self.max_new_tokens) != self.max_new_tokens or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer; got {self.max_new_tokens!r}")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 when sampling; got {self.temperature!r} (use greedy=True for argmax decoding)"
            )
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = no top-k); got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = no nucleus truncation); got {self.top_p!r}")
        if int(self.num_samples) != self.num_samples or self.num_samples < 1:
            raise ValueError(f"num_samples must be a positive integer; got {self.num_samples!r}")
        if any(i < 0 for i in self.stop_token_ids) or self.pad_id < 0:
            raise ValueError(f"token ids must be >= 0; got stop_token_ids={self.stop_token_ids}, pad_id={self.pad_id}")


@struct.dataclass
class SamplingOutput:
    """What :func:`generate` returns; ``R = B * num_samples`` rows, ``N = max_new_tokens``.

    Fields:
      prompt_tokens: ``[R, P]`` int32, the left-padded prompts, repeated per sample.
      prompt_mask: ``[R, P]`` int32, 1 on real prompt tokens.
      tokens: ``[R, N]`` int32 response tokens; ``pad_id`` after a row stopped.
      response_mask: ``[R, N]`` int32, 1 up to and including the first stop token.
      sampling_logps: ``[R, N]`` float32, log-prob under the distribution sampled from.
      logps: ``[R, N]`` float32, log-prob under the untempered model (module docstring).
      lengths: ``[R]`` int32, ``sum(response_mask)``.
      stopped: ``[R]`` bool, the row emitted a stop token.
      truncated: ``[R]`` bool, the row ran out of ``max_new_tokens`` (``== ~stopped``).
      group_ids: ``[R]`` int32, index of the prompt the row answers.
      num_steps: ``[]`` int32, tokens drawn per row before the loop ended (``<= N``).
    """

    prompt_tokens: Array
    prompt_mask: Array
    tokens: Array
    response_mask: Array
    sampling_logps: Array
    logps: Array
    lengths: Array
    stopped: Array
    truncated: Array
    group_ids: Array
    num_steps: Array

    def sequences(self) -> tuple[Array, Array, Array]:
        """``(tokens, attention_mask, response_mask)``, each ``[R, P + N]``: prompt and
        response side by side, as a trainer's full forward pass takes them (positions:
        :func:`alignax.models.positions_from_mask` of the attention mask)."""
        tokens = jnp.concatenate([self.prompt_tokens, self.tokens], axis=1)
        attention_mask = jnp.concatenate([self.prompt_mask, self.response_mask], axis=1)
        response_mask = jnp.concatenate([jnp.zeros_like(self.prompt_mask), self.response_mask], axis=1)
        return tokens, attention_mask, response_mask


@struct.dataclass
class _LoopState:
    step: Array  # [] tokens drawn so far
    cache: KVCache
    logits: Array  # [R, V] float32, next-token logits
    position: Array  # [R] position of the token fed next
    done: Array  # [R] bool
    stopped: Array  # [R] bool
    tokens: Array  # [R, N]
    response_mask: Array  # [R, N]
    sampling_logps: Array  # [R, N]
    logps: Array  # [R, N]


# Under a mesh (alignax.parallel.constrain), the batch dim of the cache and of every loop
# buffer stays split over ("data", "fsdp") (axes that do not divide the batch are dropped
# by the rules), rather than whatever the propagation settles on for the loop carry.
def constrain_cache(cache: KVCache) -> KVCache:
    return KVCache(**{name: constrain(getattr(cache, name), axes) for name, axes in CACHE_AXES.items()})


def repeat_prefill(cache: KVCache, logits: jax.Array, position: jax.Array,
                   times: int) -> tuple[KVCache, jax.Array, jax.Array]:
    """A prefill of ``B`` prompts (cache, next-token ``logits [B, V]``, ``position [B]``) as
    ``B * times`` rows, row ``b * times + g`` a copy of prompt ``b``'s."""
    # No total_repeat_length: with it jnp.repeat is a scatter and a gather (see the
    # module docstring); without, a broadcast and a reshape that keep rows in place.
    repeat = functools.partial(jnp.repeat, repeats=times)
    cache = constrain_cache(KVCache(
        k=repeat(cache.k, axis=1), v=repeat(cache.v, axis=1), mask=repeat(cache.mask, axis=0), index=cache.index
    ))
    return cache, constrain(repeat(logits, axis=0), ("batch", None)), constrain(repeat(position, axis=0), ("batch",))


def _constrain_loop(s: _LoopState) -> _LoopState:
    rows = ("batch",)
    per_token = ("batch", "length")
    return s.replace(
        cache=constrain_cache(s.cache),
        logits=constrain(s.logits, ("batch", None)),
        position=constrain(s.position, rows),
        done=constrain(s.done, rows),
        stopped=constrain(s.stopped, rows),
        tokens=constrain(s.tokens, per_token),
        response_mask=constrain(s.response_mask, per_token),
        sampling_logps=constrain(s.sampling_logps, per_token),
        logps=constrain(s.logps, per_token),
    )


def _check_context(prompt_len: int, config: SamplingConfig, max_positions: int) -> None:
    n = config.max_new_tokens
    if prompt_len >= max_positions:
        raise ValueError(
            f"the prompts already fill the context: padded prompt length {prompt_len} >= the model's "
            f"max_position_embeddings {max_positions}; shorten the prompts to at most "
            f"{max_positions - n} tokens for max_new_tokens={n}"
        )
    if prompt_len + n > max_positions:
        raise ValueError(
            f"padded prompt length {prompt_len} + max_new_tokens {n} = {prompt_len + n} exceeds the model's "
            f"max_position_embeddings {max_positions}; lower max_new_tokens to {max_positions - prompt_len} "
            f"or shorten the prompts to {max_positions - n} tokens"
        )


def _draw(logits: Array, key: Array, config: SamplingConfig) -> tuple[Array, Array, Array]:
    """``(token [R] int32, sampling logp [R], untempered logp [R])`` from ``[R, V]`` logits."""
    if config.greedy:
        token = first_argmax(logits)
        sampling_logp = jnp.zeros(token.shape, jnp.float32)
    else:
        logq = sampling_logprobs(logits, temperature=config.temperature, top_k=config.top_k, top_p=config.top_p)
        token = draw_from_logprobs(key, logq)
        sampling_logp = jnp.take_along_axis(logq, token[:, None], axis=-1)[:, 0]
    logp = jnp.take_along_axis(logits, token[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)
    return token, sampling_logp, logp


def _sample_step(s: _LoopState, rng: Array, config: SamplingConfig) -> _LoopState:
    """Draw token ``s.step`` of every row that is not done; record it and its log-probs."""
    token, sampling_logp, logp = _draw(s.logits, jax.random.fold_in(rng, s.step), config)
    alive = ~s.done
    token = jnp.where(alive, token, config.pad_id)
    if config.stop_token_ids:
        stop = alive & jnp.any(token[:, None] == jnp.asarray(config.stop_token_ids, jnp.int32), axis=-1)
    else:
        stop = jnp.zeros_like(alive)

    def put(buffer, column):
        return jax.lax.dynamic_update_slice(buffer, column[:, None].astype(buffer.dtype), (0, s.step))

    zero = jnp.zeros_like(sampling_logp)
    return s.replace(
        step=s.step + 1,
        done=s.done | stop,
        stopped=s.stopped | stop,
        tokens=put(s.tokens, token),
        response_mask=put(s.response_mask, alive),
        sampling_logps=put(s.sampling_logps, jnp.where(alive, sampling_logp, zero)),
        logps=put(s.logps, jnp.where(alive, logp, zero)),
    )


def new_loop_state(cache: KVCache, logits: Array, position: Array, done: Array, config: SamplingConfig) -> _LoopState:
    """The decode loop's state before its first draw: ``logits [R, V]`` predict each row's
    next token, ``position [R]`` is its position; rows ``done`` draw nothing."""
    R, N = done.shape[0], config.max_new_tokens
    return _LoopState(
        step=jnp.zeros((), jnp.int32),
        cache=cache,
        logits=logits,
        position=position,
        done=done,
        stopped=jnp.zeros((R,), bool),
        tokens=jnp.full((R, N), config.pad_id, jnp.int32),
        response_mask=jnp.zeros((R, N), jnp.int32),
        sampling_logps=jnp.zeros((R, N), jnp.float32),
        logps=jnp.zeros((R, N), jnp.float32),
    )


def decode_step(model, s: _LoopState, rng: Array, config: SamplingConfig) -> _LoopState:
    """One step of the decode loop: feed each row's last drawn token (``pad_id`` with
    attention mask 0 for rows that are done), then draw the next. What runs once per
    generated token (tests/fsdp_compile_check.py compiles it alone, ``--program decode``)."""
    alive = ~s.done
    last = jax.lax.dynamic_slice_in_dim(s.tokens, s.step - 1, 1, axis=1)  # [R, 1]
    feed_mask = alive[:, None].astype(jnp.int32)
    step_out = model(last, s.position[:, None], feed_mask, cache=s.cache, return_logits=False)
    s = s.replace(
        cache=step_out.cache,
        logits=model.logits(step_out.hidden[:, 0]),
        position=s.position + alive.astype(s.position.dtype),
    )
    return _constrain_loop(_sample_step(s, rng, config))


def decode_loop(model, s: _LoopState, rng: Array, config: SamplingConfig) -> _LoopState:
    """Draw up to ``config.max_new_tokens`` tokens per row from ``s`` (the next-token
    logits of the last fed token, the cache holding it); rows already ``done`` draw
    nothing. The last token drawn is never fed to the cache."""
    N = config.max_new_tokens
    s = _sample_step(_constrain_loop(s), rng, config)

    def cond(s: _LoopState):
        return (s.step < N) & ~jnp.all(s.done)

    return jax.lax.while_loop(cond, lambda s: decode_step(model, s, rng, config), s)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("config",))
def generate(graphdef, state, prompt_tokens, prompt_mask, rng, *, config: SamplingConfig) -> SamplingOutput:
    """Sample ``config.max_new_tokens`` tokens after each prompt, in one jitted program.

    Args:
      graphdef, state: ``nnx.split(model)`` of a ``CausalLM`` (or ``PolicyValueModel``).
        The graphdef is static and the state an argument, so new weights of the same
        structure reuse the compiled program; it recompiles only when shapes, dtypes,
        shardings or ``config`` change.
      prompt_tokens: ``[B, P]`` int, left-padded (each row ends with a real token).
      prompt_mask: ``[B, P]``, 1 on real prompt tokens (at least one per row).
      rng: a ``jax.random.key`` (unused when ``config.greedy``).
      config: :class:`SamplingConfig` (static).

    Returns a :class:`SamplingOutput` with ``R = B * num_samples`` rows; see the module
    docstring for the row layout and the two log-prob conventions.

    Raises ``ValueError`` at trace time when ``P >= max_position_embeddings`` or
    ``P + max_new_tokens > max_position_embeddings``.

    Under a mesh: shard the state by the logical rules (``alignax.parallel.shard_model``
    or ``from_pretrained(..., mesh=mesh)``), the prompts with
    ``alignax.parallel.batch_sharding(mesh)``, and call inside ``with jax.set_mesh(mesh):``
    so the KV cache and the loop buffers keep the batch split over ``("data", "fsdp")``
    (outputs come back sharded the same way). Results equal the single-device ones.
    """
    model = nnx.merge(graphdef, state)
    if not hasattr(model, "logits"):
        raise TypeError(
            f"generate needs a model with an LM head (CausalLM, PolicyValueModel); got {type(model).__name__}"
        )
    check_rank(prompt_tokens=(prompt_tokens, 2))
    check_same_shape(prompt_tokens=prompt_tokens, prompt_mask=prompt_mask)
    B, P = prompt_tokens.shape
    G, N = config.num_samples, config.max_new_tokens
    _check_context(P, config, model.config.max_position_embeddings)
    prompt_tokens = prompt_tokens.astype(jnp.int32)
    prompt_mask = prompt_mask.astype(jnp.int32)

    # Prefill once per prompt; the last sampled token is never fed, so P + N - 1 slots.
    cache = constrain_cache(init_cache(model.config, batch=B, max_len=P + N - 1))
    out = model(prompt_tokens, positions_from_mask(prompt_mask), prompt_mask, cache=cache, return_logits=False)
    logits = model.logits(out.hidden[:, -1])  # left padding: column P - 1 is real in every row
    position = jnp.sum(prompt_mask, axis=-1)
    cache = out.cache
    if G > 1:
        cache, logits, position = repeat_prefill(cache, logits, position, G)
        repeat = functools.partial(jnp.repeat, repeats=G)
        prompt_tokens = constrain(repeat(prompt_tokens, axis=0), ("batch", "length"))
        prompt_mask = constrain(repeat(prompt_mask, axis=0), ("batch", "length"))
    R = B * G

    s = decode_loop(model, new_loop_state(cache, logits, position, jnp.zeros((R,), bool), config), rng, config)
    return SamplingOutput(
        prompt_tokens=constrain(prompt_tokens, ("batch", "length")),
        prompt_mask=constrain(prompt_mask, ("batch", "length")),
        tokens=s.tokens,
        response_mask=s.response_mask,
        sampling_logps=s.sampling_logps,
        logps=s.logps,
        lengths=jnp.sum(s.response_mask, axis=-1),
        stopped=s.stopped,
        truncated=~s.stopped,
        group_ids=jnp.arange(R, dtype=jnp.int32) // G,
        num_steps=s.step,
    )


def left_pad(
    sequences: Sequence[Sequence[int]], *, pad_id: int, length: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token lists into ``(tokens [B, P] int32, mask [B, P] int32)`` for :func:`generate`.

    ``length`` defaults to the longest sequence; a longer sequence raises, naming it.
    """
    if not sequences:
        raise ValueError("left_pad needs at least one sequence")
    longest = max(len(s) for s in sequences)
    length = longest if length is None else length
    tokens = np.full((len(sequences), length), pad_id, np.int32)
    mask = np.zeros((len(sequences), length), np.int32)
    for i, seq in enumerate(sequences):
        if len(seq) == 0:
            raise ValueError(f"sequence {i} is empty; every prompt needs at least one token")
        if len(seq) > length:
            raise ValueError(f"sequence {i} has {len(seq)} tokens; length is {length}")
        tokens[i, length - len(seq) :] = np.asarray(seq, np.int32)
        mask[i, length - len(seq) :] = 1
    return tokens, mask
