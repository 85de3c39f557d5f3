"""``rloo``: the leave-one-out baseline (Ahmadian et al. 2024, "Back to Basics"; formula in
:func:`alignax.advantages.group_advantages`)."""

from __future__ import annotations

from alignax.advantages import group_advantages
from alignax.estimators.base import Estimator, per_token


def advantages(x, section, num_groups: int):
    """``[R, N]``: ``r_i - mean_{j != i} r_j`` on every loss token of row ``i``."""
    del section  # no options
    return per_token(group_advantages(x.rewards, method="rloo", group_ids=x.group_ids, num_groups=num_groups),
                     x.loss_mask)


ESTIMATOR = Estimator("rloo", advantages, "leave-one-out baseline (RLOO, Ahmadian et al. 2024)", verl_name="rloo")
