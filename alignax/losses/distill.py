"""Distillation losses: a student's next-token distributions pulled toward a teacher's.

Per-token divergences between full distributions over the vocabulary (``[B, T, V]``
logits in, ``[B, T]`` out), and the losses built on them, each ``(loss, metrics)`` with
the shared aggregation modes (:func:`alignax.ops.aggregate`):

- :func:`forward_kl` ``KL(teacher || student)`` (Hinton et al. 2015, "Distilling the
  Knowledge in a Neural Network"; mode-covering), :func:`reverse_kl`
  ``KL(student || teacher)`` (mode-seeking; MiniLLM, Gu et al. 2024), and
  :func:`generalized_jsd` ``JSD(beta)`` of GKD (Agarwal et al. 2024, "On-Policy
  Distillation of Language Models"), which is forward KL at ``beta = 0`` and reverse KL at
  ``beta = 1``;
- :func:`distill_loss`: one of them aggregated over the response tokens;
- :func:`sparse_distill_loss`: forward KL against the teacher's top-``k`` tokens only
  (``teacher_topk``), for teacher log-probs computed once and stored.

Temperature divides both models' logits before the softmax (as TRL's GKDTrainer does);
no ``T^2`` factor is applied, so the loss is the divergence between the tempered
distributions themselves.
"""

from __future__ import annotations

import math
from typing import Literal

import jax
import jax.numpy as jnp

from alignax import ops
from alignax._checks import check_choice, check_interval, check_leading_shape, check_rank, check_same_shape

Array = jax.Array

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")
Divergence = Literal["forward_kl", "reverse_kl", "jsd"]


def _log_softmax(logits: Array, temperature: float) -> Array:
    check_interval("temperature", temperature, 0.0, math.inf, low_open=True)
    return jax.nn.log_softmax(jnp.asarray(logits, jnp.float32) / temperature, axis=-1)


def _kl(log_p: Array, log_q: Array) -> Array:
    """``sum_v p_v (log p_v - log q_v)`` over the last axis; a zero-probability ``p_v``
    contributes 0 (``0 log 0 = 0``)."""
    p = jnp.exp(log_p)
    return jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)


def forward_kl(student_logits: Array, teacher_logits: Array, *, temperature: float = 1.0) -> Array:
    """``KL(p_teacher || p_student)`` at each position: ``[B, T, V]`` logits -> ``[B, T]``.

    ``p = softmax(logits / temperature)``; the student learns to cover every token the
    teacher gives mass to.
    """
    check_same_shape(student_logits=student_logits, teacher_logits=teacher_logits)
    return _kl(_log_softmax(teacher_logits, temperature), _log_softmax(student_logits, temperature))


def reverse_kl(student_logits: Array, teacher_logits: Array, *, temperature: float = 1.0) -> Array:
    """``KL(p_student || p_teacher)`` at each position: ``[B, T, V]`` logits -> ``[B, T]``.

    The on-policy distillation objective's per-token term: the student is pushed off the
    tokens the teacher finds unlikely (mode-seeking).
    """
    check_same_shape(student_logits=student_logits, teacher_logits=teacher_logits)
    return _kl(_log_softmax(student_logits, temperature), _log_softmax(teacher_logits, temperature))


def generalized_jsd(student_logits: Array, teacher_logits: Array, *, beta: float = 0.5,
                    temperature: float = 1.0) -> Array:
    """GKD's generalised Jensen-Shannon divergence at each position, ``[B, T, V] -> [B, T]``.

    With ``P`` the teacher, ``Q`` the student and ``M = beta P + (1 - beta) Q``::

        JSD(beta) = beta KL(P || M) + (1 - beta) KL(Q || M)

    (Agarwal et al. 2024, eq. 3). As ``beta -> 0`` it vanishes like ``beta KL(P || Q)``, and
    as ``beta -> 1`` like ``(1 - beta) KL(Q || P)``; the endpoints are defined as those
    limits divided by their factor, as in GKD and TRL: ``beta = 0`` is :func:`forward_kl`,
    ``beta = 1`` is :func:`reverse_kl`. ``beta`` is a Python float in ``[0, 1]``.
    """
    check_interval("beta", beta, 0.0, 1.0)
    if beta == 0.0:
        return forward_kl(student_logits, teacher_logits, temperature=temperature)
    if beta == 1.0:
        return reverse_kl(student_logits, teacher_logits, temperature=temperature)
    check_same_shape(student_logits=student_logits, teacher_logits=teacher_logits)
    log_q = _log_softmax(student_logits, temperature)
    log_p = _log_softmax(teacher_logits, temperature)
    log_m = jnp.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    return beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)


def teacher_topk(teacher_logits: Array, k: int) -> tuple[Array, Array]:
    """The teacher's ``k`` most likely tokens at each position: ``(log-probs [B, T, k],
    token ids [B, T, k] int32)``, log-probs normalised over the whole vocabulary at
    temperature 1 (what a precomputed table stores; :func:`sparse_distill_loss` tempers
    and renormalises them)."""
    check_rank(teacher_logits=(teacher_logits, 3))
    logps, ids = jax.lax.top_k(jax.nn.log_softmax(jnp.asarray(teacher_logits, jnp.float32), axis=-1), k)
    return logps, ids.astype(jnp.int32)


def sparse_forward_kl(student_logits: Array, teacher_topk_logps: Array, teacher_topk_ids: Array, *,
                      temperature: float = 1.0) -> Array:
    """Forward KL against the teacher's top-``k`` tokens: ``[B, T]``.

    ``p~ = softmax(teacher_topk_logps / temperature)`` over the ``k`` stored tokens (the
    teacher's mass outside them is dropped and the rest renormalised), ``q`` the student's
    full-vocabulary tempered distribution::

        sum_{j <= k} p~_j (log p~_j - log q[id_j])

    Non-negative (``q`` sums to at most 1 over the ``k`` ids) and equal to
    :func:`forward_kl` when ``k = V``.
    """
    check_rank(student_logits=(student_logits, 3), teacher_topk_logps=(teacher_topk_logps, 3))
    check_same_shape(teacher_topk_logps=teacher_topk_logps, teacher_topk_ids=teacher_topk_ids)
    if teacher_topk_logps.shape[:2] != student_logits.shape[:2]:
        raise ValueError(f"teacher_topk_logps {teacher_topk_logps.shape} and student_logits "
                         f"{student_logits.shape} disagree on [B, T]")
    log_p = _log_softmax(teacher_topk_logps, temperature)
    log_q = jnp.take_along_axis(_log_softmax(student_logits, temperature), teacher_topk_ids, axis=-1)
    return _kl(log_p, log_q)


def _masked_logits(logits: Array, mask: Array) -> Array:
    # Masked positions are zeroed before the softmax: whatever sits there (NaN, inf) never
    # reaches the loss or its gradient (a where after the softmax would still pass 0 * NaN back).
    return jnp.where(mask.astype(bool)[..., None], jnp.asarray(logits, jnp.float32), 0.0)


def _reduce(per_token: Array, mask: Array, student_logits: Array, agree_ids: Array, aggregation: str,
            normalisers: dict) -> tuple[Array, dict[str, Array]]:
    loss = ops.aggregate(per_token, mask, mode=aggregation, **normalisers)
    agreement = (jnp.argmax(student_logits, axis=-1) == agree_ids).astype(jnp.float32)
    metrics = {
        "divergence": ops.masked_mean(per_token, mask),
        "teacher_agreement": ops.masked_mean(agreement, mask),
        "num_tokens": jnp.sum(jnp.asarray(mask, jnp.float32)),
    }
    return loss, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}


def distill_loss(
    student_logits: Array,
    teacher_logits: Array,
    mask: Array,
    *,
    divergence: Divergence = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
    aggregation: ops.AggregationMode = "token-mean",
    num_tokens: Array | float | None = None,
    num_seqs: Array | float | None = None,
    norm_length: Array | float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Token-level distillation: ``aggregate(D(p_teacher, p_student)_t, mask)``.

    Args:
      student_logits / teacher_logits: ``[B, T, V]``, position ``t`` predicting the same
        token for both (same tokenizer). The teacher's are treated as constants
        (``stop_gradient``).
      mask: ``[B, T]``, 1 on the tokens that count. Masked positions get exactly zero
        gradient whatever their logits hold.
      divergence: ``forward_kl`` (the default, as ``distill.divergence``'s: Hinton et al.'s
        objective, and the one divergence the top-``k`` path computes, so a dense and a
        sparse run of one config minimise the same quantity), ``reverse_kl`` or ``jsd``
        (:func:`generalized_jsd` at ``beta``).
      temperature: divides both models' logits.
      aggregation, num_tokens, num_seqs, norm_length: as :func:`alignax.ops.aggregate`.

    Returns ``(loss, metrics)``: ``divergence`` (token-mean of the per-token divergence),
    ``teacher_agreement`` (share of counted positions where the student's argmax is the
    teacher's), ``num_tokens``. An all-masked batch gives loss 0, never NaN.
    """
    check_rank(student_logits=(student_logits, 3), mask=(mask, 2))
    check_choice("divergence", divergence, DIVERGENCES)
    check_interval("beta", beta, 0.0, 1.0)  # refused whatever the divergence: a typo never passes silently
    check_choice("aggregation", aggregation, ops.AGGREGATION_MODES)
    check_leading_shape("mask", mask, student_logits=student_logits)
    student = _masked_logits(student_logits, mask)
    teacher = jax.lax.stop_gradient(_masked_logits(teacher_logits, mask))
    if divergence == "forward_kl":
        per_token = forward_kl(student, teacher, temperature=temperature)
    elif divergence == "reverse_kl":
        per_token = reverse_kl(student, teacher, temperature=temperature)
    else:
        per_token = generalized_jsd(student, teacher, beta=beta, temperature=temperature)
    normalisers = {"num_tokens": num_tokens, "num_seqs": num_seqs, "norm_length": norm_length}
    return _reduce(per_token, mask, student, jnp.argmax(teacher, axis=-1), aggregation, normalisers)


def sparse_distill_loss(
    student_logits: Array,
    teacher_topk_logps: Array,
    teacher_topk_ids: Array,
    mask: Array,
    *,
    temperature: float = 1.0,
    aggregation: ops.AggregationMode = "token-mean",
    num_tokens: Array | float | None = None,
    num_seqs: Array | float | None = None,
    norm_length: Array | float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Distillation from stored top-``k`` teacher log-probs: ``aggregate(`` :func:`sparse_forward_kl` ``, mask)``.

    Args:
      student_logits: ``[B, T, V]``.
      teacher_topk_logps / teacher_topk_ids: ``[B, T, k]`` (:func:`teacher_topk`), ids
        sorted by the teacher's probability (the first is the teacher's argmax).
      mask, temperature, aggregation, normalisers: as :func:`distill_loss`.

    Returns ``(loss, metrics)`` with the metrics of :func:`distill_loss`.
    """
    check_rank(student_logits=(student_logits, 3), mask=(mask, 2))
    check_choice("aggregation", aggregation, ops.AGGREGATION_MODES)
    check_leading_shape("mask", mask, student_logits=student_logits)
    student = _masked_logits(student_logits, mask)
    teacher_logps = jax.lax.stop_gradient(_masked_logits(teacher_topk_logps, mask))
    ids = jnp.where(mask.astype(bool)[..., None], teacher_topk_ids, 0)
    per_token = sparse_forward_kl(student, teacher_logps, ids, temperature=temperature)
    normalisers = {"num_tokens": num_tokens, "num_seqs": num_seqs, "norm_length": norm_length}
    return _reduce(per_token, mask, student, ids[..., 0], aggregation, normalisers)
