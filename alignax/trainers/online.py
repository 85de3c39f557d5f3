"""Online RL: PPO with a critic, and the GRPO family, on the on-device sampler.

One rollout step (``OnlineTrainer.rl_step``):

1. sample ``G`` completions for each of ``B`` prompts (DAPO's dynamic sampling keeps
   sampling prompt batches until ``B`` groups have rewards that vary);
2. decode and score them (verifiers, reward models, shaping: :mod:`rl_rewards`);
3. old log-probs (recomputed by a forward pass, or the sampler's), reference log-probs,
   values (PPO); the sampler/trainer log-prob mismatch is measured either way;
4. advantages: GAE on per-token rewards with the KL penalty (PPO), or group-relative
   (``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp``, ``remax`` with a greedy baseline
   rollout, ``process`` from step rewards);
5. ``epochs`` passes of ``minibatches`` clipped, KL-regularised updates (the shared
   jitted step: non-finite guard, clipping, optimiser), PPO stopping early at
   ``target_kl``;
6. the adaptive KL controller, metrics and alarms.

The host loop around it (logging, eval, checkpoints at rollout boundaries, SIGTERM) is
:func:`alignax.trainers.loop.run_loop`; a resumed run repeats the same rollouts because
each one's randomness is derived from the seed and the rollout index alone.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from alignax import advantages as adv_lib
from alignax import config as config_io
from alignax import kl as kl_lib
from alignax import models, ops
from alignax.checkpoint import Checkpointer
from alignax.data import prepare_dataset
from alignax.losses import cispo_policy_loss, gspo_policy_loss, pg_loss, ppo_policy_loss, sft_loss, value_loss
from alignax.metrics import to_host
from alignax.parallel.sharding import batch_sharding, place_array, tree_shardings
from alignax.sampling import SamplingConfig
from alignax.trainers.common import build_mesh, build_model, load_tokenizer, response_logps, split_params
from alignax.trainers.config import TrainConfig
from alignax.trainers.loop import LoopConfig, run_loop
from alignax.trainers.monitoring import Alarms
from alignax.trainers.optim import build_optimizer
from alignax.trainers.rl_rewards import RewardModels, RewardScorer
from alignax.trainers.rollout import (
    Groups,
    Sampler,
    evaluate_greedy,
    group_reward_std,
    load_callable,
    process_step_rewards,
    response_forward,
    select_informative_groups,
    sequence_kl,
    step_boundaries,
)
from alignax.trainers.run import TrainResult, _writers
from alignax.trainers.step import init_train_state, make_train_step

log = logging.getLogger("alignax")

ONLINE_ALGORITHMS = ("ppo", "grpo")
POLICY_LOSSES = {"ppo": ppo_policy_loss, "gspo": gspo_policy_loss, "cispo": cispo_policy_loss, "pg": pg_loss}


def check_algorithm(name: str) -> None:
    if name not in ONLINE_ALGORITHMS:
        raise ValueError(f"algorithm {name!r} is not an online trainer; valid: {', '.join(ONLINE_ALGORITHMS)}")


class OnlineTrainer:
    """Everything a PPO / GRPO-family run holds between rollout steps."""

    def __init__(self, config: TrainConfig, *, records: Sequence[Mapping] | None = None):
        check_algorithm(config.algorithm)
        if config.data.format != "prompt":
            raise ValueError(f"algorithm {config.algorithm} needs data.format=prompt; got {config.data.format!r}")
        self.config = config
        self.is_ppo = config.algorithm == "ppo"
        rc, gc, pc = config.rollout, config.grpo, config.ppo
        self.group_size = rc.num_samples
        self.num_prompts = config.data.batch_size
        self.rows = self.num_prompts * self.group_size
        self.max_new = rc.max_new_tokens
        if not self.is_ppo and gc.advantage != "remax" and self.group_size < 2:
            raise ValueError(f"grpo.advantage={gc.advantage} compares samples of a prompt: rollout.num_samples "
                             f"must be >= 2; got {self.group_size}")
        epochs, minibatches = (pc.epochs, pc.minibatches) if self.is_ppo else (gc.epochs, gc.minibatches)
        if self.rows % minibatches:
            raise ValueError(f"{self.rows} rollout rows (data.batch_size x rollout.num_samples) do not split into "
                             f"{minibatches} minibatches")
        self.epochs, self.minibatches = epochs, minibatches

        self.mesh = build_mesh(config.mesh)
        self.tokenizer = load_tokenizer(config.model)
        self.data = prepare_dataset(config.data, self.tokenizer, records=records)
        self.prompt_len = config.data.max_prompt_length

        self.shared_critic = self.is_ppo and pc.critic == "shared"
        self.separate_critic = self.is_ppo and pc.critic == "separate"
        policy = build_model(config.model, kind="policy_value" if self.shared_critic else "causal_lm", mesh=self.mesh)
        self.graphdef, policy_params, self.rest = split_params(policy)
        params: Any = policy_params
        if self.separate_critic:
            if pc.critic_init == "reward_model":
                if not pc.critic_path:
                    raise ValueError("ppo.critic_init=reward_model needs ppo.critic_path (a reward model folder)")
                critic = models.from_pretrained(pc.critic_path, kind="value", mesh=self.mesh)
            else:
                critic = build_model(config.model, kind="value", mesh=self.mesh)
            self.critic_graphdef, critic_params, self.critic_rest = split_params(critic)
            params = {"policy": policy_params, "critic": critic_params}
        self.initial_params = params

        self.kl_coef = pc.kl_coef if self.is_ppo else gc.kl_coef
        self.uses_reference = self.kl_coef > 0 or (self.is_ppo and pc.adaptive_kl)
        self.kl_in_loss = not self.is_ppo and gc.kl_placement == "loss" and self.kl_coef > 0
        if self.is_ppo and pc.adaptive_kl:
            self.kl_controller = kl_lib.AdaptiveKLController(pc.kl_coef, target=pc.kl_target, horizon=pc.kl_horizon)
        else:
            self.kl_controller = kl_lib.FixedKLController(self.kl_coef)

        eos = self.tokenizer.eos_token_id
        self.stop_ids = tuple(rc.stop_token_ids) if rc.stop_token_ids else (eos,)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        self.sampling = SamplingConfig(max_new_tokens=rc.max_new_tokens, temperature=rc.temperature, top_k=rc.top_k,
                                       top_p=rc.top_p, stop_token_ids=self.stop_ids, pad_id=pad,
                                       num_samples=self.group_size)
        self.greedy = SamplingConfig(max_new_tokens=rc.max_new_tokens, greedy=True, stop_token_ids=self.stop_ids,
                                     pad_id=pad, num_samples=1)
        reward_models = None
        if config.rewards.reward_models:
            reward_models = RewardModels.load(config.rewards.reward_models, mesh=self.mesh,
                                              vocab_size=policy.config.vocab_size)
        self.scorer = RewardScorer(config.rewards, max_new_tokens=rc.max_new_tokens, stop_token_ids=self.stop_ids,
                                   reward_models=reward_models)
        self.sampler = Sampler(self.graphdef, self.tokenizer, self.scorer, self.sampling, mesh=self.mesh,
                               place=self.place)
        self.process_fn = load_callable(gc.process_reward) if (not self.is_ppo and gc.advantage == "process") else None
        self.ptx = None
        if self.is_ppo and pc.ptx_coef > 0:
            if pc.ptx_data is None or pc.ptx_data.format != "sft":
                raise ValueError("ppo.ptx_coef > 0 needs ppo.ptx_data with format sft")
            self.ptx = prepare_dataset(pc.ptx_data, self.tokenizer).iterator("train")
        self.alarms = Alarms()
        self._build_functions()

    # ------------------------------------------------------------------ placement
    def place(self, value: np.ndarray) -> jax.Array:
        value = np.asarray(value)
        return place_array(value, batch_sharding(self.mesh, value.ndim))

    def policy_params(self, params):
        return params["policy"] if self.separate_critic else params

    def sampling_state(self, params) -> nnx.State:
        return nnx.merge_state(self.policy_params(params), self.rest)

    # ------------------------------------------------------------------ compiled pieces
    def _build_functions(self) -> None:
        config = self.config
        rc, gc, pc = config.rollout, config.grpo, config.ppo
        chunk = config.model.logprob_chunk_size
        temperature = rc.temperature
        prompt_len, n = self.prompt_len, self.max_new

        def policy_forward(policy_params, tokens, positions, attention):
            model = nnx.merge(self.graphdef, policy_params, self.rest)
            return response_forward(model, tokens, positions, attention, prompt_len=prompt_len,
                                    temperature=temperature, chunk_size=chunk)

        def critic_values(critic_params, tokens, positions, attention):
            critic = nnx.merge(self.critic_graphdef, critic_params, self.critic_rest)
            return critic(tokens, positions, attention).values[:, prompt_len - 1 : -1]

        self._policy_forward = jax.jit(policy_forward)
        self._critic_values = jax.jit(critic_values) if self.separate_critic else None

        loss_name = "ppo" if self.is_ppo else gc.policy_loss
        policy_loss = POLICY_LOSSES[loss_name]
        if self.is_ppo:
            clip = dict(clip_eps_low=pc.clip_eps, clip_eps_high=pc.clip_eps)
            aggregation, entropy_coef = pc.aggregation, pc.entropy_coef
        else:
            clip = {"ppo": dict(clip_eps_low=gc.clip_eps_low, clip_eps_high=gc.clip_eps_high, dual_clip_c=gc.dual_clip_c),
                    "gspo": dict(clip_eps_low=gc.clip_eps_low, clip_eps_high=gc.clip_eps_high),
                    "cispo": dict(clip_eps_low=gc.clip_eps_low, clip_eps_high=gc.clip_eps_high),
                    "pg": {}}[loss_name]
            if loss_name in ("gspo", "cispo") and clip.get("clip_eps_high") is None:
                clip.pop("clip_eps_high")  # the loss's own default
            aggregation, entropy_coef = gc.aggregation, gc.entropy_coef

        def loss_fn(params, frozen, mb, normalisers, rng):
            del frozen, rng
            logps, entropy, values = policy_forward(self.policy_params(params), mb["tokens"], mb["positions"],
                                                    mb["attention_mask"])
            options = dict(aggregation=aggregation, num_tokens=normalisers["num_tokens"],
                           num_seqs=normalisers["num_seqs"], norm_length=n, entropy=entropy,
                           entropy_coef=entropy_coef)
            if self.kl_in_loss:
                options.update(ref_logps=mb["ref_logps"], kl_coef=gc.kl_coef, kl_kind=gc.kl_kind)
            if rc.tis_cap is not None:
                options.update(sampler_logps=mb["sampler_logps"], tis_cap=rc.tis_cap)
            loss, metrics = policy_loss(logps, mb["old_logps"], mb["advantages"], mb["mask"], **clip, **options)
            metrics = dict(metrics)
            metrics["policy_loss"] = loss
            if self.is_ppo:
                if self.separate_critic:
                    values = critic_values(params["critic"], mb["tokens"], mb["positions"], mb["attention_mask"])
                v_loss, v_metrics = value_loss(values, mb["old_values"], mb["returns"], mb["mask"],
                                               clip_eps=pc.value_clip, aggregation=aggregation,
                                               num_tokens=normalisers["num_tokens"], num_seqs=normalisers["num_seqs"],
                                               norm_length=n)
                loss = loss + pc.vf_coef * v_loss
                metrics.update({f"value/{k}": v for k, v in v_metrics.items()})
                metrics["value/loss"] = v_loss
            if self.ptx is not None:
                model = nnx.merge(self.graphdef, self.policy_params(params), self.rest)
                ptx_logps, ptx_mask = response_logps(model, mb["ptx_tokens"], mb["ptx_positions"],
                                                     mb["ptx_attention_mask"], mb["ptx_response_mask"], chunk_size=chunk)
                ptx_loss, _ = sft_loss(ptx_logps, ptx_mask)
                loss = loss + pc.ptx_coef * ptx_loss
                metrics["ptx/loss"] = ptx_loss
            return loss, metrics

        def normalisers_fn(mb):
            return ops.aggregation_normalisers(mb["mask"])

        total_updates = config.train.total_steps * self.epochs * self.minibatches
        self.optimizer, schedule = build_optimizer(config.optim, total_updates)
        self._loss_fn = loss_fn
        self._make_step = lambda: make_train_step(loss_fn, self.optimizer, normalisers_fn=normalisers_fn,
                                                  grad_accum_steps=config.train.grad_accum_steps, schedule=schedule)

        method = "ppo" if self.is_ppo else gc.advantage

        def advantages_fn(rewards, mask, old_logps, ref_logps, old_values, kl_coef, group_ids, baseline):
            """``(advantages [R, N], returns [R, N])`` for the configured method."""
            if method == "ppo":
                penalty = kl_lib.kl_penalty(old_logps, ref_logps, mask, beta=kl_coef, kind=pc.kl_kind)
                token_rewards = adv_lib.token_rewards(rewards, mask, kl_penalty=penalty)
                advantages, returns = adv_lib.gae(token_rewards, old_values, mask, gamma=pc.gamma, lam=pc.lam)
                if pc.whiten_advantages:
                    advantages = ops.masked_whiten(advantages, mask)
                return advantages, returns
            if method == "process":
                raise AssertionError("process advantages are computed from step rewards")
            kwargs = dict(method=method, group_ids=group_ids, num_groups=self.num_prompts)
            if method == "grpo":
                kwargs["unbiased_std"] = gc.unbiased_std
            if method == "reinforce_pp":
                kwargs["subtract_group_mean"] = gc.reinforce_baseline
            if method == "remax":
                kwargs = dict(method="remax", baseline=baseline)
            seq = adv_lib.group_advantages(rewards, **kwargs)
            return seq[:, None] * mask, jnp.zeros_like(mask)

        self._advantages = jax.jit(advantages_fn)
        self._process_advantages = jax.jit(
            lambda step_rewards, step_mask, mask, group_ids: adv_lib.process_advantages(
                step_rewards, step_mask, mask, group_ids=group_ids, num_groups=self.num_prompts,
                unbiased_std=gc.unbiased_std))

    # ------------------------------------------------------------------ one rollout step
    def collect(self, state, prompt_batch, batches) -> tuple[Groups, dict[str, float]]:
        """Sample and score this step's groups (refilling under dynamic sampling)."""
        config = self.config
        rollout_index = int(jax.device_get(state.extra["rollouts"]))
        key = jax.random.fold_in(jax.random.key(config.train.seed), rollout_index)
        sampling_state = self.sampling_state(state.params)
        groups, gen_s, gen_tokens = self.sampler.sample(sampling_state, prompt_batch, jax.random.fold_in(key, 0))
        figures = {"groups/refills": 0.0}
        if not self.is_ppo and config.grpo.dynamic_sampling:
            parts = [groups]
            informative = int(np.sum(group_reward_std(groups.rewards, self.group_size) > 0))
            refills = 0
            while informative < self.num_prompts and refills < config.grpo.max_refills:
                refills += 1
                extra, s, t = self.sampler.sample(sampling_state, next(batches), jax.random.fold_in(key, refills))
                parts.append(extra)
                gen_s, gen_tokens = gen_s + s, gen_tokens + t
                informative += int(np.sum(group_reward_std(extra.rewards, self.group_size) > 0))
            groups, informative = select_informative_groups(parts, num_groups=self.num_prompts,
                                                            group_size=self.group_size)
            figures["groups/refills"] = float(refills)
            figures["groups/sampled"] = float(sum(p.size for p in parts) // self.group_size)
        figures["perf/generation_s"] = gen_s
        figures["perf/generation_tokens_per_s"] = gen_tokens / gen_s if gen_s > 0 else 0.0
        return groups, figures

    def rl_step(self, state, frozen, prompt_batch, batches):
        config = self.config
        rc, gc, pc = config.rollout, config.grpo, config.ppo
        t_start = time.perf_counter()
        groups, figures = self.collect(state, prompt_batch, batches)
        rollout_index = int(jax.device_get(state.extra["rollouts"]))

        # ---- per-token quantities of the rollout under the current policy ----
        t_fwd = time.perf_counter()
        tokens, positions, attention = (self.place(a) for a in groups.full_sequences())
        response_mask = self.place(groups.response_mask.astype(np.float32))
        sampler_logps = self.place(groups.sampler_logps)
        policy_params = self.policy_params(state.params)
        recomputed, entropy, shared_values = self._policy_forward(policy_params, tokens, positions, attention)
        old_logps = recomputed if rc.old_logps == "recompute" else sampler_logps
        ref_logps = (self._policy_forward(frozen["reference"], tokens, positions, attention)[0]
                     if self.uses_reference else jnp.zeros_like(old_logps))
        if self.separate_critic:
            old_values = self._critic_values(state.params["critic"], tokens, positions, attention)
        else:
            old_values = shared_values if self.shared_critic else jnp.zeros_like(old_logps)
        loss_mask = groups.response_mask.astype(np.float32)
        if config.rewards.mask_truncated:
            loss_mask = loss_mask * groups.stopped[:, None].astype(np.float32)
        mask = self.place(loss_mask)

        # ---- rewards and advantages ----
        rewards = groups.rewards.astype(np.float32)
        seq_kl = np.asarray(sequence_kl(old_logps, ref_logps, response_mask, "k1"))
        kl_coef = state.extra["kl_coef"].coef
        if not self.is_ppo and gc.kl_placement == "reward" and self.kl_coef > 0:
            rewards = rewards - self.kl_coef * np.asarray(sequence_kl(old_logps, ref_logps, response_mask, gc.kl_kind))
        group_ids = self.place(np.repeat(np.arange(self.num_prompts, dtype=np.int32), self.group_size))
        baseline = None
        if not self.is_ppo and gc.advantage == "remax":
            prompts = {"prompt_tokens": groups.prompt_tokens[:: self.group_size],
                       "prompt_attention_mask": groups.prompt_mask[:: self.group_size],
                       "references": groups.references[:: self.group_size]}
            greedy, _, _ = self.sampler.sample(self.sampling_state(state.params), prompts, jax.random.key(0),
                                               config=self.greedy)
            baseline = np.repeat(greedy.rewards, self.group_size)
            figures["reward/greedy_baseline"] = float(np.mean(greedy.rewards))
        if not self.is_ppo and gc.advantage == "process":
            step_mask, texts = step_boundaries(self.tokenizer, groups.tokens, groups.response_mask, gc.step_delimiter)
            step_rewards = process_step_rewards(self.process_fn, step_mask, texts, groups.references)
            advantages = self._process_advantages(self.place(step_rewards), self.place(step_mask), mask, group_ids)
            returns = jnp.zeros_like(advantages)
            figures["process/steps_per_completion"] = float(step_mask.sum() / max(groups.size, 1))
        else:
            advantages, returns = self._advantages(
                self.place(rewards), mask, old_logps, ref_logps, old_values, kl_coef, group_ids,
                None if baseline is None else self.place(baseline.astype(np.float32)))
        rollout = {"tokens": tokens, "positions": positions, "attention_mask": attention, "mask": mask,
                   "old_logps": old_logps, "sampler_logps": sampler_logps, "ref_logps": ref_logps,
                   "advantages": advantages, "old_values": old_values, "returns": returns}
        t_update = time.perf_counter()

        # ---- updates ----
        order_rng = np.random.default_rng([config.train.seed, rollout_index])
        update_metrics: list[dict[str, float]] = []
        first = None
        epochs_run = 0
        for epoch in range(self.epochs):
            epoch_metrics = []
            for rows in np.split(order_rng.permutation(self.rows), self.minibatches):
                index = self.place(np.sort(rows).astype(np.int32))
                minibatch = {k: jnp.take(v, index, axis=0) for k, v in rollout.items()}
                if self.ptx is not None:
                    ptx_batch = next(self.ptx)
                    minibatch.update({f"ptx_{k}": self.place(ptx_batch[k]) for k in
                                      ("tokens", "positions", "attention_mask", "response_mask")})
                state, metrics = self.update(state, frozen, minibatch)
                metrics = to_host(metrics)
                first = first or metrics
                epoch_metrics.append(metrics)
            update_metrics.extend(epoch_metrics)
            epochs_run += 1
            if self.is_ppo and pc.target_kl is not None:
                epoch_kl = float(np.mean([m["approx_kl"] for m in epoch_metrics]))
                if epoch_kl > 1.5 * pc.target_kl:
                    log.info("rollout %d: approx KL %.4g > 1.5 x target %.4g after epoch %d; stopping early",
                             rollout_index + 1, epoch_kl, pc.target_kl, epoch + 1)
                    break
        t_end = time.perf_counter()

        # ---- carried state: rollout count and the KL controller ----
        new_coef = self.kl_controller.update(state.extra["kl_coef"], float(np.mean(seq_kl)), self.rows)
        state = state._replace(extra={"kl_coef": new_coef, "rollouts": state.extra["rollouts"] + 1})

        figures.update(self._rollout_figures(groups, rewards, seq_kl, old_logps, ref_logps, recomputed, sampler_logps,
                                             response_mask, entropy, advantages))
        for key in update_metrics[0]:
            figures[key] = float(np.mean([m[key] for m in update_metrics]))
        figures["grad_norm_max"] = float(np.max([m["grad_norm"] for m in update_metrics]))
        figures["update_skipped"] = float(np.sum([m["update_skipped"] for m in update_metrics]))
        for key in ("ratio_mean", "ratio_min", "ratio_max", "approx_kl"):
            figures[f"first_minibatch/{key}"] = first[key]
        figures["epochs_run"] = float(epochs_run)
        figures["kl_coef"] = float(jax.device_get(new_coef.coef))
        train_tokens = float(np.sum(loss_mask)) * epochs_run
        figures["perf/logprob_s"] = t_update - t_fwd
        figures["perf/training_s"] = t_end - t_update
        figures["perf/training_tokens_per_s"] = train_tokens / max(t_end - t_update, 1e-9)
        figures["perf/step_time_s"] = t_end - t_start
        figures.update(self.alarms.update(rollout_index + 1, kl=figures["kl/ref_seq"], entropy=figures["entropy"],
                                          length=figures["response/length_mean"],
                                          reward=figures.get("reward/answer", figures["reward/total"])))
        return state, figures

    def _rollout_figures(self, groups, rewards, seq_kl, old_logps, ref_logps, recomputed, sampler_logps,
                         response_mask, entropy, advantages) -> dict[str, float]:
        mask = np.asarray(response_mask)
        lengths = mask.sum(axis=1)
        n_tokens = max(mask.sum(), 1.0)
        masked_mean = lambda x: float(np.sum(np.where(mask > 0, np.asarray(x), 0.0)) / n_tokens)  # noqa: E731
        diff = np.asarray(recomputed) - np.asarray(sampler_logps)
        figures = {
            "reward/total": float(np.mean(groups.rewards)),
            "reward/std": float(np.std(groups.rewards)),
            "reward/after_kl": float(np.mean(rewards)),
            "response/length_mean": float(lengths.mean()),
            "response/length_min": float(lengths.min()),
            "response/length_max": float(lengths.max()),
            "response/stop_rate": float(np.mean(groups.stopped)),
            "response/truncation_rate": float(np.mean(~groups.stopped)),
            "kl/ref_seq": float(np.mean(seq_kl)),
            "kl/ref_k1": masked_mean(np.asarray(old_logps) - np.asarray(ref_logps)),
            "kl/ref_k3": masked_mean(kl_lib.kl_estimate(old_logps, ref_logps, kind="k3")),
            "entropy": masked_mean(entropy),
            "mismatch/sampler_trainer_abs": masked_mean(np.abs(diff)),
            "mismatch/sampler_trainer_max": float(np.max(np.where(mask > 0, np.abs(diff), 0.0))),
            "mismatch/sampler_trainer_k3": masked_mean(kl_lib.kl_estimate(sampler_logps, recomputed, kind="k3")),
            "advantages/mean": masked_mean(advantages),
            "advantages/abs_mean": masked_mean(np.abs(np.asarray(advantages))),
        }
        for name, values in groups.components.items():
            figures[f"reward/{name}"] = float(np.mean(values))
        if self.group_size > 1:
            figures["groups/zero_variance_fraction"] = float(np.mean(group_reward_std(groups.rewards, self.group_size) == 0))
        return figures

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, params) -> dict[str, float]:
        """Greedy decoding on held-out prompts, scored like the rollouts."""
        if self.data.stats.get("eval", 0) == 0:
            return {}
        return evaluate_greedy(self.sampler, self.sampling_state(params), self.data.iterator("eval"),
                               limit=self.config.rollout.greedy_eval_prompts, config=self.greedy)

    # ------------------------------------------------------------------ the run
    def train(self) -> TrainResult:
        config = self.config
        os.makedirs(config.output_dir, exist_ok=True)
        with open(os.path.join(config.output_dir, "config.yaml"), "w", encoding="utf-8") as f:
            yaml.safe_dump(config_io.to_dict(config), f, sort_keys=False)
        extra = {"kl_coef": self.kl_controller.init(), "rollouts": jnp.zeros((), jnp.int32)}
        init = lambda p: init_train_state(p, self.optimizer, jax.random.key(config.train.seed), extra)  # noqa: E731
        shardings = tree_shardings(jax.eval_shape(init, self.initial_params), self.mesh)
        state = jax.jit(init, out_shardings=shardings)(self.initial_params)
        self.update = jax.jit(self._make_step(), donate_argnums=(0,), out_shardings=(shardings, None))

        checkpointer = (Checkpointer(os.path.join(config.output_dir, "checkpoints"), keep=config.checkpoint.keep,
                                     async_save=config.checkpoint.async_save) if config.checkpoint.enabled else None)
        batches = self.data.iterator("train")
        reference = None
        if self.uses_reference:
            reference = jax.jit(lambda p: jax.tree.map(jnp.copy, p))(self.policy_params(self.initial_params))
        resumed = False
        if checkpointer is not None and config.checkpoint.resume and checkpointer.latest_step() is not None:
            state, meta = checkpointer.restore(state)
            batches.set_state(meta["data"])
            self.alarms.set_state(meta.get("alarms", {}))
            if reference is not None:
                reference = checkpointer.restore_reference(reference)
            resumed = True
            log.info("resumed at rollout %d from %s", int(state.extra["rollouts"]), checkpointer.directory)
        elif checkpointer is not None and reference is not None:
            checkpointer.save_reference(reference)
        frozen = {"reference": reference} if reference is not None else {}

        writer = _writers(config, ("reward/total", "reward/answer", "kl/ref_seq", "entropy", "response/length_mean"))
        if not resumed:
            writer.write(0, {f"data/{k}": float(v) for k, v in self.data.stats.items()})
        has_eval = self.data.stats.get("eval", 0) > 0
        loop_config = LoopConfig(total_steps=config.train.total_steps, log_every=config.train.log_every,
                                 eval_every=config.train.eval_every, save_every=config.train.save_every,
                                 max_nonfinite_streak=config.train.max_nonfinite_streak,
                                 eval_at_start=has_eval and not resumed)
        try:
            result = run_loop(
                config=loop_config, state=state, frozen=frozen,
                step_fn=lambda st, fr, batch: self.rl_step(st, fr, batch, batches),
                batches=batches, place_batch=lambda b: b, writer=writer, checkpointer=checkpointer,
                meta_fn=lambda: {"config": config_io.to_dict(config), "data_stats": self.data.stats,
                                 "alarms": self.alarms.state()},
                eval_fn=(lambda st: self.evaluate(st.params)) if has_eval else None,
                count_tokens=None, progress=lambda st: st.extra["rollouts"],
            )
        finally:
            writer.close()
            if checkpointer is not None:
                checkpointer.close()
        policy = nnx.merge(self.graphdef, self.policy_params(result.state.params), self.rest)
        return TrainResult(config=config, model=policy, tokenizer=self.tokenizer, loop=result,
                           data_stats=dict(self.data.stats))


def train(config: TrainConfig, *, records: Sequence[Mapping] | None = None) -> TrainResult:
    """Run a PPO / GRPO-family recipe to ``train.total_steps`` rollout steps."""
    return OnlineTrainer(config, records=records).train()
