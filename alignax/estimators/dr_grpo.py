"""``dr_grpo``: the group mean as baseline, no std division (Liu et al. 2025, "Understanding
R1-Zero-Like Training"; :func:`alignax.advantages.group_advantages` holds the formula)."""

from __future__ import annotations

from alignax.advantages import group_advantages
from alignax.estimators.base import Estimator, per_token


def advantages(x, section, num_groups: int):
    """``[R, N]``: ``r_i - mean_g`` on every loss token of row ``i``."""
    del section  # no options
    return per_token(group_advantages(x.rewards, method="dr_grpo", group_ids=x.group_ids, num_groups=num_groups),
                     x.loss_mask)


ESTIMATOR = Estimator("dr_grpo", advantages, "group mean baseline without the std (Dr. GRPO, Liu et al. 2025)",
                      verl_name="grpo with norm_adv_by_std_in_grpo=false")
