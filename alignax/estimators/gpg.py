"""``gpg``: Group Policy Gradient's advantage (Chu et al. 2025, "GPG: A Simple and Strong
Reinforcement Learning Baseline for Model Reasoning", arXiv:2504.02546; verl's ``gpg``).

The group mean is the baseline, without the std, and the batch is rescaled by how many of
its samples carry a reward, so that batches with few rewarded samples are not drowned::

    alpha = B / max(1, #{i : r_i != 0}),     A_i = alpha * (r_i - mean_g(r)) / F_norm

with ``B`` the rollout's rows and ``F_norm = 1`` (verl's default, as the paper's). A group of
one sample gets the baseline 0 (``A = alpha r``), as verl's. Pair it with
``grpo.policy_loss: pg`` for the paper's unclipped objective.

Sources. Chu et al. 2025, equation number not checked:
the stored copies of the paper read here hold only its abstract and introduction
(the stored page https://arxiv.org/html/2504.02546v3 holds the abstract and introduction only).
The authors' README (AMAP-ML/GPG) writes the correction ``alpha = B / (B - M)`` with ``M`` the
invalid samples and ``F_norm`` 1 or the group std; verl's ``compute_gpg_outcome_advantage``
reads ``B - M`` as the number of samples with a non-zero reward, and alignax follows verl. If
the paper's ``M`` counts the samples of groups whose rewards are all equal (no advantage), the
two differ where a group is all-correct: verl and alignax count its samples as valid. Not
checked against the paper's text; two third-party summaries read it that way
(https://www.besthub.dev/articles/group-policy-gradient-direct-objective-optimization-for-faster-reinforcement-learning-b57e84436d5a:
"N_invalid counts groups with homogeneous outcomes"; https://papers.lunadong.com/paper/14060:
the correction is for groups whose samples "have identical rewards (all right/wrong)").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from alignax.advantages import _f32
from alignax.estimators.base import Estimator, flat_groups, per_token, segment

Array = jax.Array


def gpg_advantages(rewards: Array, *, group_ids: Array, num_groups: int, f_norm: float = 1.0) -> Array:
    """``[R]`` GPG sequence advantages of ``rewards [R]`` in groups ``group_ids`` (module docstring).

    Paper: Chu et al. 2025 (arXiv:2504.02546), equation number not checked:
    the stored copies of the paper read here hold only its abstract and introduction."""
    r = _f32(rewards).reshape(-1)
    ids = flat_groups(group_ids, num_groups, r.shape[0])
    count = segment(jnp.ones_like(r), ids, num_groups)
    baseline = jnp.where(count > 1, segment(r, ids, num_groups) / count, 0.0)
    alpha = r.shape[0] / jnp.maximum(jnp.count_nonzero(r), 1).astype(jnp.float32)
    return alpha * (r - baseline) / f_norm


def advantages(x, section, num_groups: int):
    """``[R, N]``: the GPG advantage of each row on its loss tokens."""
    del section  # no options
    return per_token(gpg_advantages(x.rewards, group_ids=x.group_ids, num_groups=num_groups), x.loss_mask)


ESTIMATOR = Estimator("gpg", advantages, "group-mean baseline rescaled by the share of rewarded samples "
                      "(GPG, arXiv:2504.02546)", verl_name="gpg")
