"""``grpo_passk``: the Pass@k advantage of arXiv:2503.19595, as verl's ``grpo_passk`` implements it.

Only the best completion of a group is credited, with its margin over the runner-up::

    A_i = (r_max - r_second) / (std_g + eps)   if i is the group's best (the first on ties)
    A_i = 0                                    otherwise

``std_g`` the group's std (Bessel-corrected unless ``grpo.unbiased_std: false``), as verl's
default ``norm_adv_by_std_in_grpo``. A tie for the best gives 0 (no margin); a group of one
sample has no runner-up and gets 0 (verl refuses it; the trainer needs two samples anyway).

Sources. Tang et al. 2025, "Optimizing Language Models for Inference Time Objectives using
Reinforcement Learning", arXiv:2503.19595, equation number not checked: the paper's text is not
available offline (no stored page holds its text; https://paperhub.cn/paper/ZVWJO5YTz4, a
review, says only that it derives "an unbiased gradient estimator using the leave-one-out
method, and a biased variant that reduces variance by centering the advantage function"), so the
formula above is verl's ``compute_grpo_passk_outcome_advantage``
(``verl/trainer/ppo/core_algos.py``, which cites the paper), followed here line for line:
``r_max - r_second`` is the leave-one-out credit of the group's max, ``max_j r_j - max_{j != i}
r_j``, which is 0 for every sample but the best. The division by the group std is verl's option;
whether the paper divides is not checked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from alignax.advantages import _f32, _GroupStats, _std
from alignax.estimators.base import Estimator, flat_groups, per_token, segment

Array = jax.Array


def passk_advantages(rewards: Array, *, group_ids: Array, num_groups: int, normalize_by_std: bool = True,
                     unbiased_std: bool = True, eps: float = 1e-6) -> Array:
    """``[R]`` Pass@k sequence advantages of ``rewards [R]`` in groups ``group_ids [R]``
    (``[0, num_groups)``, any order and sizes). No gradient flows (they are targets).

    Paper: Tang et al. 2025 (arXiv:2503.19595), equation number not checked:
    the stored copies of the paper read here hold only its abstract and introduction."""
    r = _f32(rewards).reshape(-1)
    ids = flat_groups(group_ids, num_groups, r.shape[0])
    rows = jnp.arange(r.shape[0])
    count = segment(jnp.ones_like(r), ids, num_groups)
    best_value = jax.ops.segment_max(r, ids, num_segments=num_groups)[ids]
    first_best = jax.ops.segment_min(jnp.where(r == best_value, rows, r.shape[0]), ids, num_segments=num_groups)[ids]
    is_best = rows == first_best
    runner_up = jax.ops.segment_max(jnp.where(is_best, -jnp.inf, r), ids, num_segments=num_groups)[ids]
    margin = jnp.where(count > 1, best_value - runner_up, 0.0)
    if normalize_by_std:
        stats = _GroupStats(r, jnp.ones_like(r, bool), ids, num_groups)
        margin = margin / (_std(stats.sq, stats.count, unbiased_std) + eps)
    return jnp.where(is_best & (count > 1), margin, 0.0)


def advantages(x, section, num_groups: int):
    """``[R, N]``: the Pass@k advantage of each row on its loss tokens."""
    return per_token(passk_advantages(x.rewards, group_ids=x.group_ids, num_groups=num_groups,
                                      unbiased_std=section.unbiased_std), x.loss_mask)


ESTIMATOR = Estimator("grpo_passk", advantages, "only a group's best completion is credited, by its margin over the "
                      "runner-up (Pass@k training, arXiv:2503.19595)", verl_name="grpo_passk")
