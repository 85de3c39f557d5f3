"""``grpo``: group-normalised rewards (Shao et al. 2024, DeepSeekMath §4.1.2), the default.

``A_i = (r_i - mean_g) / (std_g + eps)`` on every loss token of row ``i``; ``grpo.scale_rewards``
picks the std (group, batch, none) and ``grpo.unbiased_std`` Bessel's correction
(:func:`alignax.advantages.group_advantages`, which holds the formula).
"""

from __future__ import annotations

from alignax.advantages import group_advantages
from alignax.estimators.base import Estimator, per_token


def advantages(x, section, num_groups: int):
    """``[R, N]`` GRPO advantages of ``x.rewards [R]`` grouped by ``x.group_ids``."""
    adv = group_advantages(x.rewards, method="grpo", group_ids=x.group_ids, num_groups=num_groups,
                           unbiased_std=section.unbiased_std, scale=section.scale_rewards)
    return per_token(adv, x.loss_mask)


ESTIMATOR = Estimator("grpo", advantages, "group-normalised rewards (DeepSeekMath, Shao et al. 2024)",
                      verl_name="grpo")
