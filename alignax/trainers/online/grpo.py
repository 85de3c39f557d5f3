"""The GRPO family on the shared online trainer: one config section, many papers.

- Advantages (``grpo.advantage``): ``grpo`` (Shao et al. 2024, group-standardised
  rewards), ``dr_grpo`` (Liu et al. 2025, no std division), ``rloo`` (Ahmadian et al.
  2024, leave-one-out baseline), ``reinforce_pp`` (Hu 2025), ``remax`` (Li et al. 2023,
  the greedy completion's reward as baseline, from an extra greedy rollout), ``process``
  (step rewards at step boundaries turned into dense per-token advantages, DeepSeekMath
  process supervision).
- Policy loss (``grpo.policy_loss``): PPO-clip with DAPO's clip-higher and an optional
  dual clip, GSPO's sequence-level ratio, CISPO's clipped importance weight, or plain PG.
- KL to the reference in the loss (k3, GRPO) or subtracted from the sequence reward.
- DAPO's dynamic sampling: keep sampling prompt batches until the rollout holds
  ``data.batch_size`` groups whose rewards vary (at most ``max_refills`` more batches).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from alignax import advantages as adv_lib
from alignax import kl as kl_lib
from alignax.trainers.config import TrainConfig
from alignax.trainers.online import POLICY_LOSSES, OnlineTrainer, generation_figures
from alignax.trainers.rollout import (
    Groups,
    group_reward_std,
    load_callable,
    process_step_rewards,
    select_informative_groups,
    sequence_kl,
    step_boundaries,
)


class GRPOTrainer(OnlineTrainer):
    """``algorithm: grpo``: the ``grpo`` config section."""

    algorithm = "grpo"

    def __init__(self, config: TrainConfig, *, records: Sequence[Mapping] | None = None):
        gc = config.grpo
        if gc.advantage != "remax" and config.rollout.num_samples < 2:
            raise ValueError(f"grpo.advantage={gc.advantage} compares samples of a prompt: rollout.num_samples "
                             f"must be >= 2; got {config.rollout.num_samples}")
        self.process_fn = load_callable(gc.process_reward) if gc.advantage == "process" else None
        super().__init__(config, records=records)

    # ------------------------------------------------------------------ hooks
    def update_schedule(self) -> tuple[int, int]:
        return self.config.grpo.epochs, self.config.grpo.minibatches

    def kl_setup(self):
        return self.config.grpo.kl_coef, kl_lib.FixedKLController(self.config.grpo.kl_coef)

    def reads_policy_before_update(self) -> bool:
        # The sequence KL subtracted from the reward reads the recomputed old log-probs.
        gc = self.config.grpo
        return gc.kl_placement == "reward" and gc.kl_coef > 0 and self.config.rollout.old_logps == "recompute"

    def loss_kl_options(self):
        gc = self.config.grpo
        if gc.kl_placement == "loss" and self.kl_coef > 0:
            return dict(kl_coef=self.kl_coef, kl_kind=gc.kl_kind)
        return {}

    def final_rewards(self, rewards, rollout):
        gc = self.config.grpo
        if gc.kl_placement == "reward" and self.kl_coef > 0:
            seq_kl = sequence_kl(rollout["old_logps"], rollout["ref_logps"], rollout["response_mask"], gc.kl_kind)
            return rewards - self.kl_coef * np.asarray(seq_kl)
        return rewards

    def loss_setup(self):
        gc = self.config.grpo
        name = gc.policy_loss
        clip = {} if name == "pg" else dict(clip_eps_low=gc.clip_eps_low, clip_eps_high=gc.clip_eps_high)
        if name == "ppo":
            clip["dual_clip_c"] = gc.dual_clip_c
        if name in ("gspo", "cispo") and clip["clip_eps_high"] is None:
            clip.pop("clip_eps_high")  # the loss's own default
        return POLICY_LOSSES[name], clip, gc.aggregation, gc.entropy_coef

    def _build_functions(self) -> None:
        super()._build_functions()
        gc = self.config.grpo
        method = gc.advantage
        options = dict(method=method, num_groups=self.num_prompts)
        if method == "grpo":
            options["unbiased_std"] = gc.unbiased_std
        if method == "reinforce_pp":
            options["subtract_group_mean"] = gc.reinforce_baseline

        def outcome_advantages(rewards, mask, group_ids, baseline):
            if method == "remax":
                seq = adv_lib.group_advantages(rewards, method="remax", baseline=baseline)
            else:
                seq = adv_lib.group_advantages(rewards, group_ids=group_ids, **options)
            return seq[:, None] * mask

        self._outcome_advantages = jax.jit(outcome_advantages)
        self._process_advantages = jax.jit(
            lambda step_rewards, step_mask, mask, group_ids: adv_lib.process_advantages(
                step_rewards, step_mask, mask, group_ids=group_ids, num_groups=self.num_prompts,
                unbiased_std=gc.unbiased_std))

    def collect(self, state, prompt_batch, batches) -> tuple[Groups, dict[str, float]]:
        """Sample and score; under ``dynamic_sampling``, refill until enough groups vary."""
        if not self.config.grpo.dynamic_sampling:
            return super().collect(state, prompt_batch, batches)
        _, key = self.rollout_key(state)
        sampling_state = self.sampling_state(state.params)
        groups, gen_s, gen_tokens = self.sampler.sample(sampling_state, prompt_batch, jax.random.fold_in(key, 0))
        parts = [groups]
        informative = int(np.sum(group_reward_std(groups.rewards, self.group_size) > 0))
        refills = 0
        while informative < self.num_prompts and refills < self.config.grpo.max_refills:
            refills += 1
            extra, s, t = self.sampler.sample(sampling_state, next(batches), jax.random.fold_in(key, refills))
            parts.append(extra)
            gen_s, gen_tokens = gen_s + s, gen_tokens + t
            informative += int(np.sum(group_reward_std(extra.rewards, self.group_size) > 0))
        groups, _ = select_informative_groups(parts, num_groups=self.num_prompts, group_size=self.group_size)
        figures = generation_figures(gen_s, gen_tokens)
        figures["groups/refills"] = float(refills)
        figures["groups/sampled"] = float(sum(p.size for p in parts) // self.group_size)
        return groups, figures

    def advantages(self, state, groups: Groups, rewards: np.ndarray, rollout, figures):
        gc = self.config.grpo
        mask = rollout["mask"]
        group_ids = self.place(np.repeat(np.arange(self.num_prompts, dtype=np.int32), self.group_size))
        zeros = jnp.zeros_like(mask)
        if gc.advantage == "process":
            step_mask, texts = step_boundaries(self.tokenizer, groups.tokens, groups.response_mask, gc.step_delimiter)
            step_rewards = process_step_rewards(self.process_fn, step_mask, texts, groups.references)
            figures["process/steps_per_completion"] = float(step_mask.sum() / max(groups.size, 1))
            return self._process_advantages(self.place(step_rewards), self.place(step_mask), mask, group_ids), zeros
        baseline = None
        if gc.advantage == "remax":
            baseline = self.place(self.greedy_baseline(state, groups, figures))
        return self._outcome_advantages(self.place(rewards), mask, group_ids, baseline), zeros

    def greedy_baseline(self, state, groups: Groups, figures: dict[str, float]) -> np.ndarray:
        """ReMax: the reward of each prompt's greedy completion, repeated over its group."""
        prompts = {"prompt_tokens": groups.prompt_tokens[:: self.group_size],
                   "prompt_attention_mask": groups.prompt_mask[:: self.group_size],
                   "references": groups.references[:: self.group_size]}
        greedy, _, _ = self.sampler.sample(self.sampling_state(state.params), prompts, jax.random.key(0),
                                           config=self.greedy)
        figures["reward/greedy_baseline"] = float(np.mean(greedy.rewards))
        return np.repeat(greedy.rewards, self.group_size).astype(np.float32)
