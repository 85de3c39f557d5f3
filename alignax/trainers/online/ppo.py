"""PPO with a critic (Schulman et al. 2017; the RLHF recipe of Ziegler et al. 2019 and
Ouyang et al. 2022) on the shared online trainer.

- Critic: a separate decoder with a value head (``ppo.critic: separate``, initialised
  from the policy's weights or a trained reward model's) or a value head on the policy
  trunk (``shared``).
- Reward: the sequence reward at the last response token, minus the per-token KL penalty
  ``beta * KL_t`` to the reference (k1 by default) under a fixed or adaptive ``beta``.
- Advantages: GAE over the response (γ, λ), optionally whitened; returns for the
  clipped value loss.
- Updates: ``epochs`` passes of clipped policy + ``vf_coef`` x value loss (+ entropy
  bonus, + PPO-ptx's SFT loss); the remaining epochs are skipped once an epoch's mean
  approx KL exceeds ``1.5 x target_kl``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from alignax import advantages as adv_lib
from alignax import kl as kl_lib
from alignax import models, ops
from alignax.data import prepare_dataset
from alignax.losses import ppo_policy_loss, sft_loss, value_loss
from alignax.trainers.common import build_model, response_logps, split_params
from alignax.trainers.config import TrainConfig
from alignax.trainers.online import OnlineTrainer
from alignax.trainers.rollout import Groups

log = logging.getLogger("alignax")


class PPOTrainer(OnlineTrainer):
    """``algorithm: ppo``: the ``ppo`` config section."""

    algorithm = "ppo"

    def __init__(self, config: TrainConfig, *, records: Sequence[Mapping] | None = None):
        pc = config.ppo
        self.shared_critic = pc.critic == "shared"
        self.policy_kind = "policy_value" if self.shared_critic else "causal_lm"
        self.ptx = None
        if pc.ptx_coef > 0 and (pc.ptx_data is None or pc.ptx_data.format != "sft"):
            raise ValueError("ppo.ptx_coef > 0 needs ppo.ptx_data with format sft")
        super().__init__(config, records=records)
        if pc.ptx_coef > 0:
            self.ptx = prepare_dataset(pc.ptx_data, self.tokenizer).iterator("train")

    # ------------------------------------------------------------------ hooks
    def update_schedule(self) -> tuple[int, int]:
        return self.config.ppo.epochs, self.config.ppo.minibatches

    def build_params(self, policy_params: nnx.State) -> Any:
        pc = self.config.ppo
        if self.shared_critic:
            return policy_params
        if pc.critic_init == "reward_model":
            if not pc.critic_path:
                raise ValueError("ppo.critic_init=reward_model needs ppo.critic_path (a reward model folder)")
            critic = models.from_pretrained(pc.critic_path, kind="value", mesh=self.mesh)
        else:
            critic = build_model(self.config.model, kind="value", mesh=self.mesh)
        self.critic_graphdef, critic_params, self.critic_rest = split_params(critic)
        self._critic_values = jax.jit(self.critic_values)
        return {"policy": policy_params, "critic": critic_params}

    def policy_params(self, params):
        return params if self.shared_critic else params["policy"]

    def kl_setup(self):
        pc = self.config.ppo
        if pc.adaptive_kl:
            return pc.kl_coef, kl_lib.AdaptiveKLController(pc.kl_coef, target=pc.kl_target, horizon=pc.kl_horizon)
        return pc.kl_coef, kl_lib.FixedKLController(pc.kl_coef)

    def loss_setup(self):
        pc = self.config.ppo
        return ppo_policy_loss, dict(clip_eps_low=pc.clip_eps, clip_eps_high=pc.clip_eps), pc.aggregation, pc.entropy_coef

    def critic_values(self, critic_params, tokens, positions, attention):
        """Values at the positions that predict each response token, ``[R, N]``."""
        critic = nnx.merge(self.critic_graphdef, critic_params, self.critic_rest)
        return critic(tokens, positions, attention).values[:, self.prompt_len - 1 : -1]

    def old_values(self, params, tokens, positions, attention, shared_values):
        if self.shared_critic:
            return shared_values
        return self._critic_values(params["critic"], tokens, positions, attention)

    def extra_loss(self, params, mb, normalisers, values):
        pc = self.config.ppo
        if not self.shared_critic:
            values = self.critic_values(params["critic"], mb["tokens"], mb["positions"], mb["attention_mask"])
        v_loss, v_metrics = value_loss(values, mb["old_values"], mb["returns"], mb["mask"], clip_eps=pc.value_clip,
                                       aggregation=pc.aggregation, num_tokens=normalisers["num_tokens"],
                                       num_seqs=normalisers["num_seqs"], norm_length=self.max_new)
        metrics = {f"value/{k}": v for k, v in v_metrics.items()}
        metrics["value/loss"] = v_loss
        extra = pc.vf_coef * v_loss
        if self.ptx is not None:
            model = nnx.merge(self.graphdef, self.policy_params(params), self.rest)
            ptx_logps, ptx_mask = response_logps(model, mb["ptx_tokens"], mb["ptx_positions"],
                                                 mb["ptx_attention_mask"], mb["ptx_response_mask"],
                                                 chunk_size=self.config.model.logprob_chunk_size)
            ptx_loss, _ = sft_loss(ptx_logps, ptx_mask)
            extra = extra + pc.ptx_coef * ptx_loss
            metrics["ptx/loss"] = ptx_loss
        return extra, metrics

    def minibatch_extras(self):
        if self.ptx is None:
            return {}
        batch = next(self.ptx)
        return {f"ptx_{k}": self.place(batch[k]) for k in ("tokens", "positions", "attention_mask", "response_mask")}

    def _build_functions(self) -> None:
        super()._build_functions()
        pc = self.config.ppo

        def advantages_fn(rewards, mask, old_logps, ref_logps, old_values, kl_coef):
            penalty = kl_lib.kl_penalty(old_logps, ref_logps, mask, beta=kl_coef, kind=pc.kl_kind)
            token_rewards = adv_lib.token_rewards(rewards, mask, kl_penalty=penalty)
            advantages, returns = adv_lib.gae(token_rewards, old_values, mask, gamma=pc.gamma, lam=pc.lam)
            if pc.whiten_advantages:
                advantages = ops.masked_whiten(advantages, mask)
            return advantages, returns

        self._gae = jax.jit(advantages_fn)

    def advantages(self, state, groups: Groups, rewards: np.ndarray, rollout, figures):
        del groups, figures
        return self._gae(self.place(rewards), rollout["mask"], rollout["old_logps"], rollout["ref_logps"],
                         rollout["old_values"], state.extra["kl_coef"].coef)

    def stop_epochs(self, rollout_index, epoch, epoch_metrics) -> bool:
        target = self.config.ppo.target_kl
        if target is None:
            return False
        epoch_kl = float(np.mean([m["approx_kl"] for m in epoch_metrics]))
        if epoch_kl > 1.5 * target:
            log.info("rollout %d: approx KL %.4g > 1.5 x target %.4g after epoch %d; stopping early",
                     rollout_index + 1, epoch_kl, target, epoch + 1)
            return True
        return False
