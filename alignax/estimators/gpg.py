"""``gpg``: Group Policy Gradient's advantage (Chu et al. 2025, "GPG: A Simple and Strong
Reinforcement Learning Baseline for Model Reasoning", arXiv:2504.02546; verl's ``gpg``).

The group mean is the baseline, without the std, and the batch is rescaled by the share of
its samples that are *valid*, so that batches with few learnable samples are not drowned::

    alpha = B / max(1, B - M),     A_i = alpha * (r_i - mean_g(r)) / F_norm

with ``B`` the rollout's rows, ``M`` the invalid ones and ``F_norm = 1`` (verl's default, as
the paper's). Which samples are invalid is ``grpo.gpg_valid``:

- ``nonzero_reward`` (the default, verl's ``compute_gpg_outcome_advantage``): ``B - M`` is the
  number of samples with a non-zero reward.
- ``varied_group`` (the authors' code, AMAP-ML/GPG ``open-r1/src/open_r1/gpg_trainer.py``:
  ``inverse_alpha`` = the groups whose rewards' std is not 0 over all groups): ``B - M`` is the
  number of samples in groups whose rewards are not all equal; an all-correct or all-wrong
  group has no advantage and counts as invalid. The authors count groups, alignax samples: the
  two shares agree where every group has the same size (the trainer's rollouts; groups of
  several sizes come only from a direct call). A group of one counts as invalid here; in the
  authors' code its std is NaN, which is not 0, so it would count as valid (their groups
  always hold several samples). The authors' code also resamples
  prompts until ``B - M >= 0.5 B`` (``min_inverse_alpha``); alignax does not (DAPO's
  ``grpo.dynamic_sampling`` keeps only groups with varied rewards, which makes ``alpha = 1``).

The two differ where a group is all-correct (verl counts its samples as valid) or where a
varied group holds zero rewards (verl counts those as invalid). A group of one sample gets
the baseline 0 (``A = alpha r``), as verl's. Pair it with ``grpo.policy_loss: pg`` for the
paper's unclipped objective.

Sources. Chu et al. 2025, equation number not checked: the stored copies of the paper read
here hold only its abstract and introduction (https://arxiv.org/html/2504.02546v3). The
authors' README (AMAP-ML/GPG) writes the correction ``alpha = B / (B - M)`` with ``M`` the
invalid samples and ``F_norm`` 1 or the group std; their training code, read for
``varied_group``, counts ``B - M`` over groups with ``std > 0``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from alignax.advantages import _f32, _GroupStats
from alignax.estimators.base import Estimator, flat_groups, per_token, segment

Array = jax.Array


GPG_VALID = ("nonzero_reward", "varied_group")


def gpg_advantages(rewards: Array, *, group_ids: Array, num_groups: int, f_norm: float = 1.0,
                   valid: str = "nonzero_reward") -> Array:
    """``[R]`` GPG sequence advantages of ``rewards [R]`` in groups ``group_ids`` (module docstring);
    ``valid`` says which samples count in ``alpha``'s ``B - M``: ``nonzero_reward`` (verl) or
    ``varied_group`` (the authors' code).

    Paper: Chu et al. 2025 (arXiv:2504.02546), equation number not checked:
    the stored copies of the paper read here hold only its abstract and introduction."""
    if valid not in GPG_VALID:
        raise ValueError(f"valid must be one of {', '.join(GPG_VALID)}; got {valid!r}")
    r = _f32(rewards).reshape(-1)
    ids = flat_groups(group_ids, num_groups, r.shape[0])
    count = segment(jnp.ones_like(r), ids, num_groups)
    baseline = jnp.where(count > 1, segment(r, ids, num_groups) / count, 0.0)
    if valid == "nonzero_reward":
        n_valid = jnp.count_nonzero(r)
    else:  # a sample of a group of one, or of a group whose rewards are all equal, is invalid
        n_valid = jnp.sum(~_GroupStats(r, jnp.ones_like(r, bool), ids, num_groups).constant)
    alpha = r.shape[0] / jnp.maximum(n_valid, 1).astype(jnp.float32)
    return alpha * (r - baseline) / f_norm


def advantages(x, section, num_groups: int):
    """``[R, N]``: the GPG advantage of each row on its loss tokens."""
    return per_token(gpg_advantages(x.rewards, group_ids=x.group_ids, num_groups=num_groups,
                                    valid=section.gpg_valid), x.loss_mask)


ESTIMATOR = Estimator("gpg", advantages, "group-mean baseline rescaled by the share of valid samples: rewarded "
                      "(verl) or in groups whose rewards differ (`grpo.gpg_valid`; GPG, arXiv:2504.02546)",
                      verl_name="gpg")
