"""The GRPO family as an :class:`~alignax.trainers.online.algorithm.OnlineAlgorithm`.

- The estimator registry (:data:`alignax.estimators.ESTIMATORS`, one module each) gives the
  advantages; besides those below it has verl's ``grpo_passk``, ``reinforce_plus_plus_baseline``,
  ``opo``, ``gpg``, ``optimal_token_baseline``, ``tir_optimal_token_baseline`` and ``gdpo``
  (also ``grpo.reward_aggregation: normalize_then_sum``).
- Advantages (``grpo.advantage``): ``grpo`` (Shao et al. 2024, group-normalised),
  ``dr_grpo`` (Liu et al. 2025, no std division), ``rloo`` (Ahmadian et al. 2024,
  leave-one-out baseline), ``reinforce_pp`` (Hu 2025), ``remax`` (Li et al. 2023, the
  greedy completion's reward as baseline, from an extra greedy rollout), ``process``
  (step rewards at step boundaries turned into dense per-token advantages, DeepSeekMath
  process supervision).
- Policy loss (``grpo.policy_loss``): an objective of the registry
  (:data:`alignax.losses.objectives.OBJECTIVES`: PPO-clip with DAPO's clip-higher and an
  optional dual clip, GSPO, CISPO, SAPO, plain PG, GPG, DPPO, Clip-Cov, KL-Cov, GMPO, DRO,
  VESPO); the keys its entry names, left out (``null``), take the loss's own defaults (its paper's).
- KL to the reference in the loss (k3, GRPO) or subtracted from the sequence reward,
  with a fixed or adaptive coefficient (``grpo.adaptive_kl``).
- DAPO's dynamic sampling: keep sampling prompt batches until the rollout holds
  ``data.batch_size`` groups whose rewards vary (at most ``max_refills`` more batches).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from alignax import estimators
from alignax import kl as kl_lib
from alignax.config import load_callable
from alignax.losses import objectives
from alignax.rewards.process import ProcessRewardModel
from alignax.sampling.scored import Groups
from alignax.trainers.config import TrainConfig
from alignax.trainers.online.entropy import AdaptiveEntropyController
from alignax.trainers.online.algorithm import AdvantageInputs, KLSetup, OnlineAlgorithm, PolicyObjective

def objective_keywords(section, loss_name: str) -> dict[str, float]:
    """The keys of the objective ``loss_name`` (its registry entry's) that the user set (not
    ``null``); the loss's own defaults stand for the others."""
    entry = objectives.objective(loss_name)
    return {k: getattr(section, k) for k in entry.keys if getattr(section, k) is not None}


def policy_objective(gc) -> PolicyObjective:
    """The policy loss of a GRPO section: its registry entry with the keys set."""
    entry = objectives.objective(gc.policy_loss)
    control = None if gc.target_entropy is None else AdaptiveEntropyController(
        gc.entropy_coef, gc.target_entropy, delta=gc.entropy_coef_delta, max_coef=gc.entropy_coef_max)
    return PolicyObjective(entry.loss, {**objective_keywords(gc, gc.policy_loss), **mask_keywords(gc)},
                           gc.aggregation, gc.entropy_coef, ratio=entry.ratio, rng=entry.rng, entropy_control=control)


def mask_keywords(section) -> dict[str, float]:
    """The token masks of a ``PolicyUpdateSection`` that are set (off-policy sequences, top
    entropy), as policy-loss keywords."""
    return {key: getattr(section, key) for key in ("off_policy_mask_threshold", "top_entropy_quantile")
            if getattr(section, key) is not None}


def kl_controller(coef: float, adaptive: bool, target: float, horizon: float):
    if adaptive:
        return kl_lib.AdaptiveKLController(coef, target=target, horizon=horizon)
    return kl_lib.FixedKLController(coef)


def build_algorithm(config: TrainConfig) -> OnlineAlgorithm:
    """The GRPO-family algorithm of ``config.grpo``; its advantages are the estimator
    ``grpo.advantage`` names (:data:`alignax.estimators.ESTIMATORS`), GDPO's under
    ``grpo.reward_aggregation: normalize_then_sum``."""
    gc = config.grpo
    num_groups = config.data.batch_size
    est = estimators.estimator(estimators.effective_name(gc))

    def advantages(x: AdvantageInputs):
        adv = est.advantages(x, gc, num_groups)
        return adv, jax.numpy.zeros_like(adv)

    return OnlineAlgorithm(
        name="grpo",
        policy_kind="causal_lm",
        epochs=gc.epochs,
        minibatches=gc.minibatches,
        objective=policy_objective(gc),
        kl=KLSetup(gc.kl_coef, kl_controller(gc.kl_coef, gc.adaptive_kl, gc.kl_target, gc.kl_horizon), gc.kl_kind,
                   "loss" if gc.kl_placement == "loss" else "sequence_reward", gc.kl_importance_weight),
        advantages=advantages,
        min_group_size=est.min_group_size,
        greedy_baseline=est.greedy_baseline,
        process_reward=(None if not est.step_rewards else
                        ProcessRewardModel(gc.process_reward_model, aggregation=gc.process_reward_aggregation,
                                           param_dtype=config.precision.frozen)
                        if gc.process_reward_model else load_callable(gc.process_reward)),
        step_delimiter=gc.step_delimiter,
        dynamic_sampling_refills=gc.max_refills if gc.dynamic_sampling else None,
        reward_components=est.reward_components,
        token_stats=est.token_stats,
    )


def group_reward_std(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """Per-group population std of rewards, ``[R] -> [R / G]``."""
    return rewards.reshape(-1, group_size).std(axis=1)


def select_informative_groups(parts: Sequence[Groups], *, num_groups: int, group_size: int) -> tuple[Groups, int]:
    """DAPO dynamic sampling: the first ``num_groups`` groups whose rewards vary, topped up
    with zero-variance groups (which carry exactly zero advantage) if there are too few.

    Returns the chosen groups and how many of them have non-zero variance.
    """
    pool = Groups.concat(parts)
    std = group_reward_std(pool.rewards, group_size)
    informative = np.flatnonzero(std > 0)
    flat = np.flatnonzero(std == 0)
    chosen = np.concatenate([informative, flat])[:num_groups]
    rows = (chosen[:, None] * group_size + np.arange(group_size)[None]).reshape(-1)
    return pool.take(rows), int(min(len(informative), num_groups))
