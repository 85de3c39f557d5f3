"""``process``: GRPO with process supervision (Shao et al. 2024, DeepSeekMath §4.1.3): step
rewards at step boundaries, normalised over the group and summed over the steps that end at or
after each token (:func:`alignax.advantages.process_advantages`)."""

from __future__ import annotations

from alignax.advantages import process_advantages
from alignax.estimators.base import Estimator


def advantages(x, section, num_groups: int):
    """``[R, N]`` dense per-token advantages from ``x.step_rewards`` on ``x.step_mask``."""
    return process_advantages(x.step_rewards, x.step_mask, x.loss_mask, group_ids=x.group_ids,
                              num_groups=num_groups, unbiased_std=section.unbiased_std)


ESTIMATOR = Estimator("process", advantages, "normalised step rewards summed to go (DeepSeekMath process supervision)",
                      step_rewards=True)
