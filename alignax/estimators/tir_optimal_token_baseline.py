"""``tir_optimal_token_baseline``: the Optimal Token Baseline of tool-integrated (multi-turn)
trajectories (verl's ``tir_optimal_token_baseline``; OTB, arXiv:2602.07078).

The same baseline as :mod:`alignax.estimators.optimal_token_baseline`, with positions counted
over the policy's own tokens only: the observation tokens an environment or tool inserted are
skipped, so the ``k``-th token the policy chose in each trajectory shares a baseline with the
``k``-th of the others, wherever the tool outputs fell.

Sources. Li et al. 2026, equation number not checked:
the stored copies of the paper read here hold only its abstract and introduction
(the stored page https://arxiv.org/html/2602.07078v1 holds the abstract and the start of the
introduction only). The variant is verl's
``compute_multi_turn_optimal_token_baseline_advantage``, which alignax follows: it packs each
trajectory's loss tokens to the left and runs OTB on the packed rows, ``W`` accumulating over
loss tokens only and the zero-tail rule on loss-token counts (verl's docstring says
``handle_zero_tail`` defaults to False; its signature, which runs, defaults to True, as here).
"""

from __future__ import annotations

from alignax.estimators.base import Estimator
from alignax.estimators.optimal_token_baseline import otb_advantages


def advantages(x, section, num_groups: int):
    """``[R, N]`` OTB advantages, positions counted over loss tokens only.

    Paper: Li et al. 2026 (arXiv:2602.07078), equation number not checked:
    the stored copies of the paper read here hold only its abstract and introduction."""
    del section  # no options
    return otb_advantages(x.rewards, x.loss_mask, x.stat_logps, x.sum_pi_squared, group_ids=x.group_ids,
                          num_groups=num_groups, skip_observations=True, is_weights=x.is_weights)


ESTIMATOR = Estimator("tir_optimal_token_baseline", advantages, "the optimal token baseline over the policy's own "
                      "tokens of multi-turn trajectories, observations skipped (OTB, arXiv:2602.07078)",
                      verl_name="tir_optimal_token_baseline", token_stats=True)
