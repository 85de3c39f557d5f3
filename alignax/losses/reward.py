"""Reward-model losses: the Bradley-Terry pairwise loss, and ensembles of reward models.

Rewards are one scalar per sequence, ``[B]`` (the reward head's output on the last
response token). The loss reduction and its global normaliser follow
:mod:`alignax.losses.preference`: ``sum_i w_i l_i / N`` with optional per-pair
``weights`` and full-batch ``num_pairs``, so per-shard losses sum to the full-batch loss.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

from alignax._checks import check_choice, check_interval, check_rank
from alignax.losses._pairwise import batch_mean, check_scalar, check_vectors, f32, weighted_means

Array = jax.Array

ENSEMBLE_METHODS = ("mean", "min", "mean_minus_std", "mean_minus_var")
EnsembleMethod = Literal["mean", "min", "mean_minus_std", "mean_minus_var"]


def bradley_terry_loss(
    chosen_rewards: Array,
    rejected_rewards: Array,
    *,
    margin: Array | float | None = None,
    center_coef: float | Array = 0.0,
    weights: Array | None = None,
    num_pairs: Array | float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Pairwise Bradley-Terry reward-model loss, with optional margin and centring.

    ``l_i = -log s(r_c,i - r_r,i - m_i) + center_coef * (r_c,i + r_r,i)^2``, loss
    ``sum_i w_i l_i / N``. The first term is the negative log-likelihood of the
    preference under Bradley-Terry (Ouyang et al. 2022, "Training language models to
    follow instructions with human feedback", eq. 1); ``m`` is Llama 2's margin for
    graded preferences (Touvron et al. 2023, "Llama 2", eq. 2: larger for "significantly
    better" pairs). The second is TRL's ``center_rewards_coefficient`` term
    ``c * mean((r_c + r_r)^2)`` (Eisenstein et al. 2023), which pins the otherwise free
    offset of the rewards near zero.

    Args:
      chosen_rewards, rejected_rewards: ``[B]`` rewards of the preferred / other response.
      margin: ``None``, a scalar, or ``[B]`` per-pair margins.
      center_coef: the centring coefficient ``c >= 0``.
      weights, num_pairs: per-pair weights and global normaliser ``N``.

    Metrics (local weighted means): ``accuracy`` (fraction with ``r_c > r_r``),
    ``margin`` (mean ``r_c - r_r``), ``rewards/chosen``, ``rewards/rejected``.
    """
    check_vectors(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards, weights=weights)
    check_scalar(num_pairs=num_pairs)
    if margin is not None:
        check_rank(margin=(margin, (0, 1)))
        if jnp.ndim(margin) == 1:
            check_vectors(chosen_rewards=chosen_rewards, margin=margin)
    check_interval("center_coef", center_coef, 0.0, float("inf"), low_open=False, high_open=True)
    r_c, r_r = f32(chosen_rewards), f32(rejected_rewards)
    diff = r_c - r_r
    logits = diff if margin is None else diff - f32(margin)
    per_pair = -jax.nn.log_sigmoid(logits) + f32(center_coef) * jnp.square(r_c + r_r)
    loss = batch_mean(per_pair, weights, num_pairs)
    values = {
        "accuracy": f32(r_c > r_r),
        "margin": diff,
        "rewards/chosen": r_c,
        "rewards/rejected": r_r,
    }
    return loss, weighted_means(values, weights)


def ensemble_rewards(rewards: Array, *, method: EnsembleMethod = "mean", k: float | Array = 1.0) -> Array:
    """Combine the rewards of ``K`` reward models into one per sequence, ``[K, B] -> [B]``.

    Methods (Coste et al. 2023, "Reward Model Ensembles Help Mitigate Overoptimization";
    Eisenstein et al. 2023, "Helping or Herding?"), with ``mu`` and ``sigma^2`` the mean
    and the *population* variance over the ensemble axis (divided by ``K``, as Coste's
    intra-ensemble variance; ``K = 1`` gives ``sigma = 0``):

    - ``mean``: ``mu``.
    - ``min``: ``min_k r_k`` (worst-case optimisation, WCO).
    - ``mean_minus_std``: ``mu - k * sigma`` (a lower confidence bound).
    - ``mean_minus_var``: ``mu - k * sigma^2`` (uncertainty-weighted optimisation, UWO,
      Coste et al., ``k`` their ``lambda``).

    Returns float32 ``[B]``. ``k >= 0``.
    """
    check_rank(rewards=(rewards, 2))
    check_choice("method", method, ENSEMBLE_METHODS)
    check_interval("k", k, 0.0, float("inf"), low_open=False, high_open=True)
    rewards = f32(rewards)
    if method == "min":
        return jnp.min(rewards, axis=0)
    mean = jnp.mean(rewards, axis=0)
    if method == "mean":
        return mean
    var = jnp.mean(jnp.square(rewards - mean), axis=0)
    if method == "mean_minus_var":
        return mean - f32(k) * var
    # sqrt has an infinite derivative at 0; route identical members to a zero gradient.
    positive = var > 0
    std = jnp.where(positive, jnp.sqrt(jnp.where(positive, var, 1.0)), 0.0)
    return mean - f32(k) * std
