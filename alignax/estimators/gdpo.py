"""``gdpo``: Group reward-Decoupled normalisation Policy Optimization (GDPO, arXiv:2601.05242;
verl's ``gdpo``, TRL's ``multi_objective_aggregation="normalize_then_sum"``).

With several rewards, GRPO sums them and then normalises the sum within each group, so the
component with the largest spread decides the sign of most advantages. GDPO normalises each
component on its own first (:func:`normalize_then_sum`), then whitens the weighted sum over
the batch::

    A_k,i = (r_k,i - mean_g(r_k)) / (std_g(r_k) + eps)        each component k, group g (GRPO's)
    S_i   = sum_k w_k A_k,i                                   w_k: the component's weight in ``rewards:``
    A_i   = (S_i - mean_batch(S)) / (std_batch(S) + eps)      over the rollout's sequences

``r_k`` is the component *before* its weight (``rewards.verifier_weight``, ``rewards.functions``'
weights, ...): normalising ``w_k r_k`` would cancel ``|w_k|``. ``std_g`` is GRPO's
(:func:`alignax.advantages.group_advantages`, Bessel-corrected unless ``grpo.unbiased_std:
false``); a component that is constant within a group (or a group of one) contributes 0 there.
The batch whitening is over sequences as the paper and TRL do it (verl whitens over tokens, so
a long completion weighs more in its statistics).

``grpo.reward_aggregation: normalize_then_sum`` (TRL's key) is this estimator; the default
``sum_then_normalize`` normalises the total reward, as GRPO always has.

Sources. Liu et al. 2026, equation number not checked:
the stored copies of the paper read here hold only its abstract and introduction
(no stored page holds its text past the abstract). Two summaries describe the same three steps,
unnumbered: https://xinzhang-ops.github.io/daily_paper/dailies/pages/2026-01-09.html
("group-wise normalization for each reward separately before aggregation, followed by batch-wise
advantage normalization") and
https://liner.com/review/gdpo-group-rewarddecoupled-normalization-policy-optimization-for-multireward-rl-optimization;
neither says whether the batch statistics are over sequences or tokens. The three steps are
those of verl's ``compute_gdpo_outcome_advantage`` docstring
(``verl/trainer/ppo/core_algos.py``; per-dimension GRPO normalisation, weighted sum,
``masked_whiten``). That the paper whitens over sequences rather than tokens is TRL's reading,
not checked against the paper's text; alignax follows it and differs from verl there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from alignax._checks import check_rank
from alignax.advantages import _GroupStats, _std, group_advantages
from alignax.estimators.base import Estimator, per_token

Array = jax.Array


def normalize_then_sum(components: Array, weights: Array, *, group_ids: Array, num_groups: int,
                       unbiased_std: bool = True, eps: float = 1e-6) -> Array:
    """``[R]``: ``sum_k w_k * GRPO-normalised(components[:, k])``.

    Args:
      components: ``[R, K]`` each reward component of each row, unweighted.
      weights: ``[K]`` the components' weights.
      group_ids / num_groups: the prompt of each row, in ``[0, num_groups)``.
    """
    check_rank(components=(components, 2), weights=(weights, 1))
    if components.shape[1] != weights.shape[0]:
        raise ValueError(f"reward components {components.shape} have {components.shape[1]} columns; weights "
                         f"{weights.shape} must have one per column")

    def one(column):
        return group_advantages(column, method="grpo", group_ids=group_ids, num_groups=num_groups,
                                unbiased_std=unbiased_std, eps=eps)

    normalised = jax.vmap(one, in_axes=1, out_axes=1)(jnp.asarray(components, jnp.float32))
    return normalised @ jnp.asarray(weights, jnp.float32)


def gdpo_advantages(components: Array, weights: Array, *, group_ids: Array, num_groups: int,
                    unbiased_std: bool = True, eps: float = 1e-6) -> Array:
    """``[R]`` GDPO sequence advantages: :func:`normalize_then_sum` whitened over the batch
    (all-equal sums give exactly 0).

    Paper: Liu et al. 2026 (arXiv:2601.05242), equation number not checked:
    the stored copies of the paper read here hold only its abstract and introduction."""
    summed = normalize_then_sum(components, weights, group_ids=group_ids, num_groups=num_groups,
                                unbiased_std=unbiased_std, eps=eps)
    batch = _GroupStats(summed, jnp.ones_like(summed, bool), jnp.zeros(summed.shape, jnp.int32), 1)
    return jnp.where(batch.constant, 0.0, batch.centred / (_std(batch.sq, batch.count, unbiased_std) + eps))


def advantages(x, section, num_groups: int):
    """``[R, N]``: the GDPO advantage of each row on its loss tokens."""
    return per_token(gdpo_advantages(x.reward_components, x.reward_weights, group_ids=x.group_ids,
                                     num_groups=num_groups, unbiased_std=section.unbiased_std), x.loss_mask)


ESTIMATOR = Estimator("gdpo", advantages, "each reward component normalised in its group, weighted, summed, then "
                      "whitened over the batch (GDPO, arXiv:2601.05242)", verl_name="gdpo", reward_components=True)
