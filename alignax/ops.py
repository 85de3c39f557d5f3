"""Masked reductions, loss aggregation, and token log-probs / entropy from logits.

Everything here is pure and traces under ``jax.jit``. Per-token arrays are ``[B, T]``
and ``mask`` is 1 on the tokens that count (response tokens) and 0 elsewhere.
Reductions accumulate in float32 whatever the input dtype.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import jax.numpy as jnp

from alignax._checks import check_choice, check_rank, check_same_shape

Array = jax.Array

AGGREGATION_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
AggregationMode = Literal[
    "token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
]


def _f32(x: Array) -> Array:
    return jnp.asarray(x, jnp.float32)


def masked_sum(x: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """``sum(x * mask)`` over ``axis`` (all axes when ``None``), in float32.

    Masked entries are selected out with ``where`` rather than multiplied, so a NaN or
    inf under the mask cannot leak into the result or its gradient.
    """
    check_same_shape(x=x, mask=mask)
    return jnp.sum(jnp.where(mask.astype(bool), _f32(x), 0.0), axis=axis)


def masked_mean(x: Array, mask: Array, axis: int | tuple[int, ...] | None = None) -> Array:
    """``sum(x * mask) / sum(mask)`` over ``axis``; 0 where the mask is empty (never NaN)."""
    count = jnp.sum(_f32(mask), axis=axis)
    return masked_sum(x, mask, axis) / jnp.maximum(count, 1.0)


def masked_var(x: Array, mask: Array, *, unbiased: bool = True) -> Array:
    """Variance of the masked entries of ``x`` (all axes), Bessel-corrected by default.

    With fewer than two entries (one when ``unbiased=False``) the result is 0.
    """
    mean = masked_mean(x, mask)
    count = jnp.sum(_f32(mask))
    sq = masked_sum(jnp.square(_f32(x) - mean), mask)
    denom = count - 1.0 if unbiased else count
    return jnp.where(denom > 0, sq / jnp.maximum(denom, 1.0), 0.0)


def masked_whiten(
    x: Array, mask: Array, *, shift_mean: bool = True, unbiased: bool = True, eps: float = 1e-8
) -> Array:
    """Standardise the masked entries of ``x``: ``(x - mean) / sqrt(var + eps)``.

    Mean and variance are taken over masked entries of the whole array. With
    ``shift_mean=False`` the mean is added back (PPO's advantage whitening keeps it for
    rewards). Unmasked entries of the result are 0.
    """
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=unbiased)
    white = (_f32(x) - mean) * jax.lax.rsqrt(var + eps)
    if not shift_mean:
        white = white + mean
    return jnp.where(mask.astype(bool), white, 0.0)


def aggregate(
    per_token: Array,
    mask: Array,
    *,
    mode: AggregationMode = "token-mean",
    num_tokens: Array | float | None = None,
    num_seqs: Array | float | None = None,
    norm_length: Array | float | None = None,
) -> Array:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    Modes (``m`` the mask, ``L_i = sum_t m_it``, ``S`` the sequences with ``L_i > 0``):

    - ``token-mean``: ``sum_it x m / sum_it m`` (DAPO; every token weighs the same).
    - ``token-sum``: ``sum_it x m``.
    - ``seq-mean-token-mean``: ``mean_{i in S} (sum_t x m / L_i)`` (original GRPO).
    - ``seq-mean-token-sum``: ``mean_{i in S} sum_t x m``.
    - ``seq-mean-token-sum-norm``: ``sum_it x m / (|S| * norm_length)`` — Dr. GRPO's
      constant normaliser (Liu et al. 2025, "Understanding R1-Zero-Like Training"):
      ``norm_length`` defaults to ``T``, the generation budget.

    Sequences with no unmasked token count in no denominator.

    Global normalisers: when a batch is split over micro-batches or data-parallel shards,
    pass ``num_tokens`` (total unmasked tokens of the full batch) and ``num_seqs``
    (sequences with at least one unmasked token, of the full batch); the sum of the
    per-shard results then equals the full-batch result exactly for every mode.
    Without them the local counts are used. An all-masked batch gives 0, never NaN.
    """
    check_rank(per_token=(per_token, 2))
    check_same_shape(per_token=per_token, mask=mask)
    check_choice("mode", mode, AGGREGATION_MODES)
    maskf = _f32(mask)
    token_sums = masked_sum(per_token, mask, axis=-1)  # [B]
    lengths = jnp.sum(maskf, axis=-1)  # [B]

    if mode == "token-sum":
        return jnp.sum(token_sums)
    if mode == "token-mean":
        denom = jnp.sum(lengths) if num_tokens is None else _f32(num_tokens)
        return jnp.sum(token_sums) / jnp.maximum(denom, 1.0)

    seq_denom = jnp.sum(lengths > 0) if num_seqs is None else num_seqs
    seq_denom = jnp.maximum(_f32(seq_denom), 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = token_sums / jnp.maximum(lengths, 1.0)
        return jnp.sum(per_seq) / seq_denom
    if mode == "seq-mean-token-sum":
        return jnp.sum(token_sums) / seq_denom
    # seq-mean-token-sum-norm
    length = per_token.shape[-1] if norm_length is None else norm_length
    return jnp.sum(token_sums) / (seq_denom * _f32(length))


def aggregation_normalisers(mask: Array) -> dict[str, Array]:
    """The global normalisers of a full batch, to pass to :func:`aggregate` per shard.

    Returns ``{"num_tokens": sum(mask), "num_seqs": #rows with a masked-in token}``.
    """
    check_rank(mask=(mask, 2))
    lengths = jnp.sum(_f32(mask), axis=-1)
    return {"num_tokens": jnp.sum(lengths), "num_seqs": jnp.sum(lengths > 0).astype(jnp.float32)}


def _logprob_and_entropy(logits: Array, targets: Array, temperature: float) -> tuple[Array, Array]:
    logits = _f32(logits) / temperature
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    probs = jnp.exp(logits - lse[..., None])
    entropy = lse - jnp.sum(probs * logits, axis=-1)
    return target_logit - lse, entropy


def _time_chunk_start(i: Array, t: int, chunk: int) -> Array:
    # The last chunk is shifted left to end at T rather than padded: padding would copy
    # the whole [B, T, V] logits. Overlapping rows are recomputed and rewritten with the
    # same values (never accumulated), so results are unchanged.
    return jnp.minimum(i * chunk, t - chunk)


def _chunked_forward(logits: Array, targets: Array, temperature: float, chunk: int) -> tuple[Array, Array]:
    b, t, _ = logits.shape
    num_chunks = -(-t // chunk)

    def body(i, carry):
        logps, entropy = carry
        start = _time_chunk_start(i, t, chunk)
        lg = jax.lax.dynamic_slice_in_dim(logits, start, chunk, axis=1)
        tg = jax.lax.dynamic_slice_in_dim(targets, start, chunk, axis=1)
        lp_c, ent_c = _logprob_and_entropy(lg, tg, temperature)
        return (
            jax.lax.dynamic_update_slice_in_dim(logps, lp_c, start, axis=1),
            jax.lax.dynamic_update_slice_in_dim(entropy, ent_c, start, axis=1),
        )

    zeros = jnp.zeros((b, t), jnp.float32)
    return jax.lax.fori_loop(0, num_chunks, body, (zeros, zeros))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _chunked_logprob_entropy(logits: Array, targets: Array, temperature: float, chunk: int) -> tuple[Array, Array]:
    """Token log-probs and entropies, ``chunk`` positions at a time along T.

    A custom VJP keeps only the (input) logits as residual and recomputes each chunk's
    softmax in the backward pass, so neither pass holds a float32 ``[B, T, V]`` array:
    with ``z = logits / temperature``, ``log p = z - lse(z)`` and ``H = -sum p log p``,
    ``d logp_target / dz = onehot - p`` and ``dH / dz = -p (log p + H)``.
    Chunks slice the time axis only, so a batch sharded over a mesh stays sharded.
    """
    return _chunked_forward(logits, targets, temperature, chunk)


def _chunked_fwd(logits, targets, temperature, chunk):
    return _chunked_forward(logits, targets, temperature, chunk), (logits, targets)


def _chunked_bwd(temperature, chunk, residuals, cotangents):
    logits, targets = residuals
    g_logps, g_entropy = cotangents
    _, t, vocab = logits.shape
    num_chunks = -(-t // chunk)

    def body(i, grad):
        start = _time_chunk_start(i, t, chunk)
        lg = jax.lax.dynamic_slice_in_dim(logits, start, chunk, axis=1)
        tg = jax.lax.dynamic_slice_in_dim(targets, start, chunk, axis=1)
        g_lp = jax.lax.dynamic_slice_in_dim(g_logps, start, chunk, axis=1)[..., None]
        g_ent = jax.lax.dynamic_slice_in_dim(g_entropy, start, chunk, axis=1)[..., None]
        z = _f32(lg) / temperature
        log_p = z - jax.nn.logsumexp(z, axis=-1, keepdims=True)
        p = jnp.exp(log_p)
        entropy = -jnp.sum(p * log_p, axis=-1, keepdims=True)
        onehot = jnp.arange(vocab) == tg[..., None]
        g_z = g_lp * (onehot - p) - g_ent * p * (log_p + entropy)
        return jax.lax.dynamic_update_slice_in_dim(grad, (g_z / temperature).astype(grad.dtype), start, axis=1)

    grad = jax.lax.fori_loop(0, num_chunks, body, jnp.zeros_like(logits))
    return grad, None


_chunked_logprob_entropy.defvjp(_chunked_fwd, _chunked_bwd)


def _logprobs_entropy(logits: Array, targets: Array, temperature: float, chunk_size: int | None):
    check_rank(logits=(logits, 3), targets=(targets, 2))
    if logits.shape[:2] != targets.shape:
        raise ValueError(f"logits {logits.shape} and targets {targets.shape} disagree on [B, T]")
    if not jnp.issubdtype(jnp.result_type(targets), jnp.integer):
        raise ValueError(f"targets must be integer token ids; got dtype {jnp.result_type(targets)}")
    if chunk_size is None or chunk_size >= logits.shape[1]:
        return _logprob_and_entropy(logits, targets, temperature)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of positions; got {chunk_size}")
    return _chunked_logprob_entropy(logits, targets, temperature, chunk_size)


def token_logprobs(
    logits: Array, targets: Array, *, temperature: float = 1.0, chunk_size: int | None = None
) -> Array:
    """``log softmax(logits / temperature)[targets]`` per position, float32 ``[B, T]``.

    Args:
      logits: ``[B, T, V]`` in any float dtype; position ``t`` scores ``targets[:, t]``
        (shift before calling: ``logits[:, :-1]`` against ``tokens[:, 1:]``).
      targets: ``[B, T]`` integer token ids.
      temperature: divides the logits first (the sampler's convention).
      chunk_size: when set, ``chunk_size`` positions of the time axis are processed at a
        time, forward and backward, so the float32 log-softmax is never held for the
        whole ``[B, T, V]``; results equal the direct path to float32 rounding.
    """
    return _logprobs_entropy(logits, targets, temperature, chunk_size)[0]


def entropy_from_logits(
    logits: Array, *, temperature: float = 1.0, chunk_size: int | None = None
) -> Array:
    """Entropy ``H = logsumexp(z) - sum softmax(z) z`` of each position's distribution.

    ``z = logits / temperature``; returns float32 ``[B, T]`` (for ``[B, T, V]`` logits).
    ``chunk_size`` as in :func:`token_logprobs`.
    """
    check_rank(logits=(logits, 3))
    dummy = jnp.zeros(logits.shape[:2], jnp.int32)
    return _logprobs_entropy(logits, dummy, temperature, chunk_size)[1]


def token_logprobs_and_entropy(
    logits: Array, targets: Array, *, temperature: float = 1.0, chunk_size: int | None = None
) -> tuple[Array, Array]:
    """Both :func:`token_logprobs` and :func:`entropy_from_logits` in one pass over ``V``."""
    return _logprobs_entropy(logits, targets, temperature, chunk_size)
