"""PPO with a critic (Schulman et al. 2017; the RLHF recipe of Ziegler et al. 2019 and
Ouyang et al. 2022) as an :class:`~alignax.trainers.online.algorithm.OnlineAlgorithm`.

- Critic: a separate decoder with a value head (``ppo.critic: separate``, initialised
  from the policy's weights or a trained reward model's, with its own learning rate when
  ``ppo.critic_learning_rate`` is set), a value head on the policy trunk (``shared``) or,
  in a LoRA run, an adapter and value head of its own on the policy's frozen base
  (``adapter``: one base in memory).
- Reward: the sequence reward at the last response token, minus the per-token KL penalty
  ``beta * KL_t`` to the reference (k1 by default) under a fixed or adaptive ``beta``
  (``ppo.kl_placement: reward``); or the KL in the loss (``loss``), as GRPO does.
- Advantages: GAE over the response (γ, λ), optionally whitened; returns for the
  clipped value loss.
- Updates: ``epochs`` passes of clipped policy (clip-higher with ``clip_eps_high``, dual
  clip with ``dual_clip_c``) + ``vf_coef`` x value loss (+ entropy bonus, + PPO-ptx's SFT
  loss); the remaining epochs are skipped once an epoch's mean approx KL exceeds
  ``1.5 x target_kl``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from alignax import advantages as adv_lib
from alignax import ops
from alignax.losses import ppo_policy_loss
from alignax.trainers.config import TrainConfig
from alignax.trainers.online.algorithm import (
    AdvantageInputs,
    CriticSetup,
    KLSetup,
    OnlineAlgorithm,
    PolicyObjective,
    PtxSetup,
)
from alignax.trainers.online.grpo import kl_controller, mask_keywords


def target_kl_rule(target: float):
    """``stop(epoch_metrics)``: true once the epoch's mean approx KL exceeds 1.5 x target
    (Schulman et al.'s PPO implementation detail; OpenAI baselines, verl)."""

    def stop(epoch_metrics: Sequence[Mapping[str, float]]) -> bool:
        return float(np.mean([m["approx_kl"] for m in epoch_metrics])) > 1.5 * target

    return stop


def build_algorithm(config: TrainConfig) -> OnlineAlgorithm:
    """PPO of ``config.ppo``."""
    pc = config.ppo
    kl = KLSetup(pc.kl_coef, kl_controller(pc.kl_coef, pc.adaptive_kl, pc.kl_target, pc.kl_horizon), pc.kl_kind,
                 "token_reward" if pc.kl_placement == "reward" else "loss", pc.kl_importance_weight)

    def advantages(x: AdvantageInputs):
        token_rewards = adv_lib.token_rewards(x.rewards, x.loss_mask, kl_penalty=kl.token_penalty(x))
        adv, returns = adv_lib.gae(token_rewards, x.old_values, x.loss_mask, gamma=pc.gamma, lam=pc.lam)
        if pc.whiten_advantages:
            adv = ops.masked_whiten(adv, x.loss_mask)
        return adv, returns

    clip = dict(clip_eps_low=pc.clip_eps, clip_eps_high=pc.clip_eps if pc.clip_eps_high is None else pc.clip_eps_high)
    if pc.dual_clip_c is not None:
        clip["dual_clip_c"] = pc.dual_clip_c
    clip.update(mask_keywords(pc))
    critic_optim = None
    if pc.critic_learning_rate is not None:
        critic_optim = dataclasses.replace(config.optim, learning_rate=pc.critic_learning_rate)
    return OnlineAlgorithm(
        name="ppo",
        policy_kind="policy_value" if pc.critic == "shared" else "causal_lm",
        epochs=pc.epochs,
        minibatches=pc.minibatches,
        objective=PolicyObjective(ppo_policy_loss, clip, pc.aggregation, pc.entropy_coef),
        kl=kl,
        advantages=advantages,
        critic=CriticSetup(pc.critic, pc.critic_init, pc.critic_path, pc.vf_coef, pc.value_clip, critic_optim),
        ptx=PtxSetup(pc.ptx_coef, pc.ptx_data) if pc.ptx_coef > 0 else None,
        stop_after_epoch=target_kl_rule(pc.target_kl) if pc.target_kl is not None else None,
    )
