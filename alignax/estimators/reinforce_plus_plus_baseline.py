"""``reinforce_plus_plus_baseline``: REINFORCE++-baseline as verl computes it (Hu 2025,
arXiv:2501.03262, its REINFORCE++-baseline variant): the group mean is the baseline, then the
advantages are whitened over every *token* of the batch::

    c_i   = r_i - mean_g(r)                       (a group of one sample: c_i = r_i, verl's baseline 0)
    A_i,t = (c_i - mean_tok(c)) / sqrt(var_tok(c) + 1e-8)   on the loss tokens

``mean_tok`` / ``var_tok`` (unbiased) run over all loss tokens of the rollout, so a long
completion weighs more than a short one in the statistics. This differs from
``grpo.advantage: reinforce_pp`` with ``grpo.reinforce_baseline: true``, which whitens per
*sequence* and does not re-centre.

Sources. Hu et al. 2025, equation number not checked:
the stored copies of the paper read here hold only its abstract and introduction
(the stored pages, https://arxiv.org/html/2501.03262v9 and
https://www.sciencestack.ai/paper/2501.03262v9, hold the abstract and the start of the
introduction only). The figure-1 caption, quoted by
https://liner.com/review/reinforce-simple-and-efficient-approach-for-aligning-large-language-models,
gives the same two steps, unnumbered: "a group-mean subtraction followed by global batch
normalization"; whether the batch statistics are over tokens or sequences is not said there. The
formula is verl's ``compute_reinforce_plus_plus_baseline_outcome_advantage``
(``verl/trainer/ppo/core_algos.py``: group mean, baseline 0 for a group of one, then
``masked_whiten`` over the response tokens), followed exactly; ``masked_whiten`` there and
``alignax.ops.masked_whiten`` here both use the unbiased token variance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from alignax.advantages import _f32
from alignax.estimators.base import Estimator, flat_groups, per_token, segment
from alignax.ops import masked_whiten

Array = jax.Array


def reinforce_pp_baseline_advantages(rewards: Array, loss_mask: Array, *, group_ids: Array, num_groups: int) -> Array:
    """``[R, N]``: group-mean-centred rewards of ``rewards [R]`` whitened over the tokens of
    ``loss_mask [R, N]``. Rows without a loss token are 0 and do not enter the statistics.

    Paper: Hu et al. 2025 (arXiv:2501.03262), equation number not checked:
    the stored copies of the paper read here hold only its abstract and introduction."""
    r = _f32(rewards).reshape(-1)
    ids = flat_groups(group_ids, num_groups, r.shape[0])
    count = segment(jnp.ones_like(r), ids, num_groups)
    baseline = jnp.where(count > 1, segment(r, ids, num_groups) / count, 0.0)
    mask = jnp.asarray(loss_mask, jnp.float32)
    return masked_whiten(per_token(r - baseline, mask), mask)


def advantages(x, section, num_groups: int):
    """``[R, N]`` token-whitened REINFORCE++-baseline advantages."""
    del section  # no options
    return reinforce_pp_baseline_advantages(x.rewards, x.loss_mask, group_ids=x.group_ids, num_groups=num_groups)


ESTIMATOR = Estimator("reinforce_plus_plus_baseline", advantages,
                      "group-mean baseline, whitened over the batch's tokens (REINFORCE++-baseline, Hu 2025)",
                      verl_name="reinforce_plus_plus_baseline")
