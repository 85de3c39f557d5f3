"""``remax``: the reward of each prompt's greedy completion as baseline (Li et al. 2023, ReMax,
Alg. 1; :func:`alignax.advantages.group_advantages`). The rollout decodes each prompt greedily
once more (``greedy_baseline``)."""

from __future__ import annotations

from alignax.advantages import group_advantages
from alignax.estimators.base import Estimator, per_token


def advantages(x, section, num_groups: int):
    """``[R, N]``: ``r_i - r_greedy`` on every loss token of row ``i``."""
    del section, num_groups  # the baseline is per row
    return per_token(group_advantages(x.rewards, method="remax", baseline=x.baseline), x.loss_mask)


ESTIMATOR = Estimator("remax", advantages, "greedy-completion baseline (ReMax, Li et al. 2023)", verl_name="remax",
                      min_group_size=1, greedy_baseline=True)
