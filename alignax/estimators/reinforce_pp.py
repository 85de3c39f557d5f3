"""``reinforce_pp``: REINFORCE++ (Hu 2025, arXiv:2501.03262), sequence rewards whitened over the
batch; ``grpo.reinforce_baseline`` subtracts the group mean first (formula in
:func:`alignax.advantages.group_advantages`; the token-level variant verl ships is
:mod:`alignax.estimators.reinforce_plus_plus_baseline`)."""

from __future__ import annotations

from alignax.advantages import group_advantages
from alignax.estimators.base import Estimator, per_token


def advantages(x, section, num_groups: int):
    """``[R, N]``: ``(r - mean_batch) / std_batch`` (or its group-mean-first variant) on the loss tokens."""
    adv = group_advantages(x.rewards, method="reinforce_pp", group_ids=x.group_ids, num_groups=num_groups,
                           subtract_group_mean=section.reinforce_baseline)
    return per_token(adv, x.loss_mask)


ESTIMATOR = Estimator("reinforce_pp", advantages,
                      "batch-whitened sequence rewards (REINFORCE++, Hu 2025)")
