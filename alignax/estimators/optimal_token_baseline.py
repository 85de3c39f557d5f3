"""``optimal_token_baseline``: the Optimal Token Baseline (OTB, arXiv:2602.07078; verl's
``optimal_token_baseline``, docs/algo/otb.md there).

A baseline per token position instead of per sequence. The squared norm of the log-prob
gradient of token ``j`` with respect to its logits is ``||e_{y_j} - pi_j||^2 = 1 - 2 pi(y_j) +
sum_v pi(v)^2`` (the logit-gradient proxy); its running sum along the completion,
``W_t = sum_{j <= t} (1 - 2 pi(y_j) + sum_v pi_j(v)^2)``, measures how much variance the path has
accumulated by token ``t``. The variance-minimising baseline of the return-to-go ``G_t`` weights
each completion of a group by it::

    B_t = sum_{i in g} G_t^i W_t^i / (sum_{i in g} W_t^i + eps),     A_t^i = G_t^i - B_t

The sum runs over the completions of the group that have a token at position ``t``. With an
outcome reward ``G_t^i = r_i`` on every loss token. Where only one completion of the group
reaches ``t`` (the tail of a group's unique longest completion, past the second longest), or
the group has one non-empty completion, ``B_t = 0`` and ``A_t = G_t``: a completion used as its
own baseline would cancel its signal (verl's ``handle_zero_tail``, on by default).

Positions: ``optimal_token_baseline`` counts ``t`` in columns of the response window;
``tir_optimal_token_baseline`` (:mod:`alignax.estimators.tir_optimal_token_baseline`) counts only
loss tokens, so the observation tokens of a multi-turn trajectory (tool outputs, which the
policy did not choose) neither take a position nor add to ``W``. On a single-turn rollout the
two agree.

``pi(y_j)`` and ``sum_v pi_j(v)^2`` come from one forward pass of one policy
(:func:`token_statistics`, at the sampling temperature): the learner's weights when the
rollout is priced, verl's ``pi_old`` (verl computes ``sum_pi_squared`` in the actor's
``compute_log_prob`` pass that recomputes ``old_log_probs``, ``ray_trainer.py``
``_compute_old_log_prob``). ``||e_y - pi||^2`` is the squared logit-gradient of the policy the
update differentiates, so that is the policy both terms are of. With synchronous rollouts it
is also the one that sampled the tokens; under ``rollout.async.max_staleness >= 1`` the
sampler's weights are up to ``k`` updates older, and with ``rollout.old_logps: sampler`` the
loss's old log-probs are the sampler's, but the estimator still reads the learner's pair,
never the sampler's ``pi(y_j)`` beside the learner's ``sum pi^2`` (verl's bypass mode computes
no ``sum_pi_squared`` at all, so verl runs OTB only with recomputed old log-probs).

Sources. Li et al. 2026, equation number not checked:
the stored copies of the paper read here hold only its abstract and introduction
(the stored page https://arxiv.org/html/2602.07078v1 holds the abstract and the start of the
introduction only). The squared logit-gradient form of the proxy agrees with the first author's
note "Logit Dynamics in Softmax Policy Gradient Methods"
(https://ar5iv.labs.arxiv.org/html/2506.12912: ``||Delta z||_2 proportional to sqrt(1 - 2 P_c +
C(P))``, ``C(P)`` the collision probability ``sum_v pi(v)^2``). The formulas are those of verl's
``compute_optimal_token_baseline_advantage`` (``verl/trainer/ppo/core_algos.py``) and
``docs/algo/otb.md`` (``B*_t = sum G W / (sum W + eps)``, ``W_t = sum_{j<=t} (1 - 2 pi_j + sum
pi_j^2)``, the zero-tail rule), which alignax follows. Where it differs from verl: ``G_t`` is
the sequence reward on every loss token (verl's reward-to-go of token-level rewards is the same
for an outcome reward).

Rollout correction. With ``rollout.tis_cap`` and recomputed old log-probs (verl's decoupled
mode, where its ``rollout_is_weights`` are computed once on the batch before the advantages,
``ray_trainer.py``), each token's energy is multiplied by the square of its rollout-correction
weight ``w_j`` (:func:`alignax.losses.sampler_correction` of ``pi_old / pi_sampler``, with
``tis_level``, ``tis_lower`` and ``tis_batch_normalize``, the mean over the whole rollout as
verl's), as verl's ``compute_optimal_token_baseline_advantage`` does (``core_algos.py``,
``w_per_timestep * rollout_is_weights**2``). In bypass mode (``rollout.old_logps: sampler``)
verl passes no weights to the estimator and neither does alignax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from alignax._checks import check_rank, check_same_shape
from alignax.advantages import _f32
from alignax.estimators.base import Estimator, flat_groups

Array = jax.Array


def sum_pi_squared(logits: Array, *, temperature: float = 1.0) -> Array:
    """``sum_v softmax(z)_v^2 = exp(logsumexp(2 z) - 2 logsumexp(z))``, ``z = logits / temperature``.

    ``logits [..., V]`` in any float dtype; returns float32 ``[...]`` in ``[1/V, 1]``.
    """
    z = jnp.asarray(logits, jnp.float32) / temperature
    return _sum_squares(z, jax.nn.logsumexp(z, axis=-1))


def _sum_squares(z: Array, lse: Array) -> Array:
    """``sum_v softmax(z)_v^2`` from ``z`` and its ``logsumexp``."""
    return jnp.exp(jax.nn.logsumexp(2.0 * z, axis=-1) - 2.0 * lse)


def token_statistics(logits: Array, targets: Array, *, temperature: float = 1.0) -> tuple[Array, Array]:
    """``(log pi(y), sum_v pi(v)^2)``, each float32 ``[...]``: the two per-token inputs of the
    path-variance proxy ``1 - 2 pi(y) + sum_v pi(v)^2``, from the same ``logits [..., V]`` (at
    ``temperature``) and the sampled tokens ``targets [...]``, so that both are of one policy."""
    z = jnp.asarray(logits, jnp.float32) / temperature
    lse = jax.nn.logsumexp(z, axis=-1)
    logp = jnp.take_along_axis(z, jnp.asarray(targets)[..., None].astype(jnp.int32), axis=-1)[..., 0] - lse
    return logp, _sum_squares(z, lse)


def otb_advantages(rewards: Array, loss_mask: Array, old_logps: Array, sum_pi_sq: Array, *, group_ids: Array,
                   num_groups: int, skip_observations: bool = False, is_weights: Array | None = None,
                   eps: float = 1e-8) -> Array:
    """``[R, N]`` Optimal Token Baseline advantages (module docstring).

    Paper: Li et al. 2026 (arXiv:2602.07078), equation number not checked:
    the stored copies of the paper read here hold only its abstract and introduction.

    Args:
      rewards: ``[R]`` sequence rewards (the return-to-go of every loss token).
      loss_mask: ``[R, N]`` 1 on the tokens the policy chose and that get loss.
      old_logps: ``[R, N]`` log-probs of the sampled tokens under the sampling policy.
      sum_pi_sq: ``[R, N]`` ``sum_v pi(v)^2`` of the same distributions.
      group_ids / num_groups: the prompt of each row, in ``[0, num_groups)``.
      skip_observations: count positions over loss tokens only (the tool-integrated variant).
      is_weights: ``[R, N]`` the rollout-correction weights ``w_j`` of the tokens, or ``None``:
        each ``1 - 2 pi_j + sum pi_j^2`` is multiplied by ``w_j^2`` before the running sum
        (verl's ``W`` "scaled by rho-bar^2 to minimize MSE under truncated IS").
    """
    check_rank(loss_mask=(loss_mask, 2))
    check_same_shape(loss_mask=loss_mask, old_logps=old_logps, sum_pi_sq=sum_pi_sq)
    rows, width = loss_mask.shape
    mask = jnp.asarray(loss_mask, jnp.float32)
    ids = flat_groups(group_ids, num_groups, rows)
    returns = _f32(rewards).reshape(-1)[:, None] * mask
    energy = (1.0 - 2.0 * jnp.exp(_f32(old_logps)) + _f32(sum_pi_sq)) * mask
    if is_weights is not None:
        check_same_shape(loss_mask=loss_mask, is_weights=is_weights)
        energy = energy * jnp.square(_f32(is_weights))
    cumulative = jnp.cumsum(energy, axis=1)
    position = (jnp.cumsum(mask, axis=1) - 1.0).astype(jnp.int32) if skip_observations else \
        jnp.broadcast_to(jnp.arange(width), (rows, width))
    position = jnp.clip(position, 0, width - 1)
    cells = (ids[:, None] * width + position).reshape(-1)  # one cell per (group, position)

    def by_cell(values):
        return jax.ops.segment_sum(values.reshape(-1), cells, num_segments=num_groups * width)[cells].reshape(rows, width)

    baseline = by_cell(returns * cumulative * mask) / (by_cell(cumulative * mask) + eps)
    lengths = mask.sum(axis=1)
    nonempty = jax.ops.segment_sum((lengths > 0).astype(jnp.float32), ids, num_segments=num_groups)[ids]
    longest = jax.ops.segment_max(lengths, ids, num_segments=num_groups)[ids]
    n_longest = jax.ops.segment_sum((lengths == longest).astype(jnp.float32), ids, num_segments=num_groups)[ids]
    second = jax.ops.segment_max(jnp.where(lengths == longest, -1.0, lengths), ids, num_segments=num_groups)[ids]
    # the tail of a group's unique longest completion past the second longest has no other completion
    tail = ((n_longest == 1) & (lengths == longest))[:, None] & (position >= second[:, None])
    baseline = jnp.where(tail | (nonempty < 2)[:, None], 0.0, baseline)
    return (returns - baseline) * mask


def advantages(x, section, num_groups: int):
    """``[R, N]`` OTB advantages, positions counted in columns of the response."""
    del section  # no options
    return otb_advantages(x.rewards, x.loss_mask, x.stat_logps, x.sum_pi_squared, group_ids=x.group_ids,
                          num_groups=num_groups, is_weights=x.is_weights)


ESTIMATOR = Estimator("optimal_token_baseline", advantages, "per-token baseline weighted by the path's accumulated "
                      "logit-gradient energy (OTB, arXiv:2602.07078)", verl_name="optimal_token_baseline",
                      token_stats=True)
