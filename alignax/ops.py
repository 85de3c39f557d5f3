"""Masked reductions, loss aggregation, and token log-probs / entropy from logits.

Everything here is pure and traces under ``jax.jit``. Per-token arrays are ``[B, T]``
and ``mask`` is 1 on the tokens that count (response tokens) and 0 elsewhere.
Reductions accumulate in float32 whatever the input dtype.
"""

from __future__ import annotations

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


def _chunk_time(x: Array, chunk_size: int) -> tuple[Array, int]:
    """``[B, T, ...] -> [n, B, chunk, ...]`` with ``T`` padded up to ``n * chunk``."""
    t = x.shape[1]
    n = -(-t // chunk_size)
    pad = n * chunk_size - t
    if pad:
        widths = [(0, 0)] * x.ndim
        widths[1] = (0, pad)
        x = jnp.pad(x, widths)
    x = x.reshape(x.shape[0], n, chunk_size, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0), t


def _unchunk_time(y: Array, t: int) -> Array:
    """``[n, B, chunk] -> [B, T]``."""
    y = jnp.moveaxis(y, 0, 1)
    return y.reshape(y.shape[0], -1)[:, :t]


def _logprob_and_entropy(logits: Array, targets: Array, temperature: float) -> tuple[Array, Array]:
    logits = _f32(logits) / temperature
    lse = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    probs = jnp.exp(logits - lse[..., None])
    entropy = lse - jnp.sum(probs * logits, axis=-1)
    return target_logit - lse, entropy


def _map_chunks(fn, logits: Array, targets: Array, chunk_size: int):
    # Each chunk's float32 softmax lives only inside the checkpointed body, so neither
    # the forward nor the backward pass holds a full [B, T, V] float32 array.
    body = jax.checkpoint(fn)
    logit_chunks, t = _chunk_time(logits, chunk_size)
    target_chunks, _ = _chunk_time(targets, chunk_size)
    outs = jax.lax.map(lambda args: body(*args), (logit_chunks, target_chunks))
    return jax.tree.map(lambda y: _unchunk_time(y, t), outs)


def token_logprobs(
    logits: Array, targets: Array, *, temperature: float = 1.0, chunk_size: int | None = None
) -> Array:
    """``log softmax(logits / temperature)[targets]`` per position, float32 ``[B, T]``.

    Args:
      logits: ``[B, T, V]`` in any float dtype; position ``t`` scores ``targets[:, t]``
        (shift before calling: ``logits[:, :-1]`` against ``tokens[:, 1:]``).
      targets: ``[B, T]`` integer token ids.
      temperature: divides the logits first (the sampler's convention).
      chunk_size: when set, the time axis is processed in chunks of this many positions
        under ``jax.checkpoint`` so the float32 log-softmax is never held for the whole
        ``[B, T, V]`` at once; results equal the direct path.
    """
    check_rank(logits=(logits, 3), targets=(targets, 2))
    if logits.shape[:2] != targets.shape:
        raise ValueError(f"logits {logits.shape} and targets {targets.shape} disagree on [B, T]")

    def fn(lg, tg):
        return _logprob_and_entropy(lg, tg, temperature)[0]

    if chunk_size is None or chunk_size >= logits.shape[1]:
        return fn(logits, targets)
    return _map_chunks(fn, logits, targets, chunk_size)


def entropy_from_logits(
    logits: Array, *, temperature: float = 1.0, chunk_size: int | None = None
) -> Array:
    """Entropy ``H = logsumexp(z) - sum softmax(z) z`` of each position's distribution.

    ``z = logits / temperature``; returns float32 ``[B, T]`` (for ``[B, T, V]`` logits).
    ``chunk_size`` as in :func:`token_logprobs`.
    """
    check_rank(logits=(logits, 3))
    dummy = jnp.zeros(logits.shape[:2], jnp.int32)

    def fn(lg, tg):
        return _logprob_and_entropy(lg, tg, temperature)[1]

    if chunk_size is None or chunk_size >= logits.shape[1]:
        return fn(logits, dummy)
    return _map_chunks(fn, logits, dummy, chunk_size)


def token_logprobs_and_entropy(
    logits: Array, targets: Array, *, temperature: float = 1.0, chunk_size: int | None = None
) -> tuple[Array, Array]:
    """Both :func:`token_logprobs` and :func:`entropy_from_logits` in one pass over ``V``."""
    check_rank(logits=(logits, 3), targets=(targets, 2))
    if logits.shape[:2] != targets.shape:
        raise ValueError(f"logits {logits.shape} and targets {targets.shape} disagree on [B, T]")

    def fn(lg, tg):
        return _logprob_and_entropy(lg, tg, temperature)

    if chunk_size is None or chunk_size >= logits.shape[1]:
        return fn(logits, targets)
    return _map_chunks(fn, logits, targets, chunk_size)
