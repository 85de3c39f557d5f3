"""``opo``: On-Policy RL with the Optimal reward baseline (Hao et al. 2025, arXiv:2505.23585;
verl's ``opo``).

Under exactly on-policy training the variance-minimising baseline of a sequence-level reward
weights each sample by its squared gradient norm, which the paper approximates by the response
length ``l_i``::

    b_g = sum_{i in g} l_i r_i / sum_{i in g} l_i,      A_i = r_i - b_g

on every loss token of row ``i``. ``l_i`` counts row ``i``'s loss tokens. A group of one
sample gets ``b = 0`` (``A = r``), as verl's; a group whose rows have no loss token gets
``b = 0`` too (its advantages are masked away anyway).

Sources. Hao et al. 2025, equation number not checked:
the stored copies of the paper read here hold only its abstract and introduction
(the stored page https://arxiv.org/html/2505.23585v2 holds the abstract and introduction only).
Two reviews give the same baseline, unnumbered:
https://www.themoonlight.io/review/on-policy-rl-with-optimal-reward-baseline (``b* = E[||grad
log pi||^2 r] / E[||grad log pi||^2]`` with ``||grad log pi(y|x)||^2`` taken proportional to the
length ``l_y``) and https://jeybird248.github.io/blog/2025/research_30 (``b* = sum(l_i r_i) /
sum(l_i)``); ``b_g`` above matches both. The formula is verl's ``compute_opo_outcome_advantage``
(``verl/trainer/ppo/core_algos.py``) and its ``docs/algo/opo.md`` ("the length-weighted reward
of the group", no std normalisation), which alignax follows; it differs from verl in two places
only: ``l_i`` counts loss tokens (verl: response tokens, the same unless
``rewards.mask_truncated`` drops a row), and an all-empty group gets ``b = 0`` where verl
divides by 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from alignax.advantages import _f32
from alignax.estimators.base import Estimator, flat_groups, per_token, segment

Array = jax.Array


def opo_advantages(rewards: Array, loss_mask: Array, *, group_ids: Array, num_groups: int) -> Array:
    """``[R, N]`` OPO advantages of ``rewards [R]`` with lengths from ``loss_mask [R, N]``.

    Paper: Hao et al. 2025 (arXiv:2505.23585), equation number not checked:
    the stored copies of the paper read here hold only its abstract and introduction."""
    r = _f32(rewards).reshape(-1)
    ids = flat_groups(group_ids, num_groups, r.shape[0])
    mask = jnp.asarray(loss_mask, jnp.float32)
    lengths = mask.sum(axis=1)
    count = segment(jnp.ones_like(r), ids, num_groups)
    total_length = segment(lengths, ids, num_groups)
    baseline = segment(lengths * r, ids, num_groups) / jnp.maximum(total_length, 1.0)
    baseline = jnp.where((count > 1) & (total_length > 0), baseline, 0.0)
    return per_token(r - baseline, mask)


def advantages(x, section, num_groups: int):
    """``[R, N]`` OPO advantages of the rollout."""
    del section  # no options
    return opo_advantages(x.rewards, x.loss_mask, group_ids=x.group_ids, num_groups=num_groups)


ESTIMATOR = Estimator("opo", advantages, "length-weighted optimal reward baseline (OPO, arXiv:2505.23585)",
                      verl_name="opo")
