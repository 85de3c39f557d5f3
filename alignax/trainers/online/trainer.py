"""The online-RL trainer both families share: rollout → reward → advantage → updates.

One rollout step (``OnlineTrainer.rl_step``):

1. sample ``G`` completions for each of ``B`` prompts (:meth:`OnlineTrainer.collect`;
   the GRPO family can refill the batch, DAPO's dynamic sampling);
2. decode and score them (verifiers, reward models, shaping: :mod:`rl_rewards`);
3. old log-probs (recomputed by a forward pass, or the sampler's), reference log-probs,
   values (PPO); the sampler/trainer log-prob mismatch is measured either way. When a
   rollout gets exactly one update and nothing before it reads the policy's log-probs
   (GRPO with the KL in the loss), the separate forward pass is skipped: that update's
   own forward pass is the policy the rollout came from, so the old log-probs are its
   log-probs with the gradient stopped (ratio exactly 1, as TRL and Tunix do), and the
   figures read the log-probs and entropy the update returns;
4. advantages, by the algorithm: GAE on per-token rewards with the KL penalty
   (:mod:`alignax.trainers.ppo`), or group-relative (:mod:`alignax.trainers.grpo`);
5. ``epochs`` passes of ``minibatches`` clipped, KL-regularised updates (the shared
   jitted step: non-finite guard, clipping, optimiser); an algorithm may stop the
   epochs early (PPO's ``target_kl``);
6. the KL controller, metrics and alarms.

A subclass supplies the algorithm through the hooks marked below; :func:`train` picks
it from ``config.algorithm``. The host loop around a step (logging, eval, checkpoints
at rollout boundaries, SIGTERM) is :func:`alignax.trainers.loop.run_loop`; a resumed run
repeats the same rollouts because each one's randomness is derived from the seed and the
rollout index alone.
"""

from __future__ import annotations

import abc
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

from alignax import config as config_io
from alignax import kl as kl_lib
from alignax import ops
from alignax.checkpoint import Checkpointer
from alignax.data import prepare_dataset
from alignax.losses import cispo_policy_loss, gspo_policy_loss, pg_loss, ppo_policy_loss
from alignax.metrics import to_host
from alignax.parallel.sharding import batch_sharding, place_array, tree_shardings
from alignax.sampling import SamplingConfig
from alignax.trainers import packing
from alignax.trainers.common import build_mesh, build_model, load_tokenizer, split_params
from alignax.trainers.config import TrainConfig
from alignax.trainers.loop import LoopConfig, run_loop
from alignax.trainers.monitoring import Alarms
from alignax.trainers.optim import build_optimizer
from alignax.trainers.rl_rewards import RewardModels, RewardScorer
from alignax.trainers.rollout import Groups, Sampler, evaluate_greedy, group_reward_std, response_forward, sequence_kl
from alignax.trainers.run import TrainResult, _writers
from alignax.trainers.step import init_train_state, make_train_step

log = logging.getLogger("alignax")

# Metric-name prefix of per-row outputs of the update (log-probs, entropy) in single-update mode.
ROWS = "rows/"

POLICY_LOSSES = {"ppo": ppo_policy_loss, "gspo": gspo_policy_loss, "cispo": cispo_policy_loss, "pg": pg_loss}


class OnlineTrainer(abc.ABC):
    """Everything an online-RL run holds between rollout steps; subclassed per family."""

    algorithm: str = ""  # the config.algorithm a subclass runs
    policy_kind: str = "causal_lm"  # models.MODEL_KINDS entry of the policy

    def __init__(self, config: TrainConfig, *, records: Sequence[Mapping] | None = None):
        if config.algorithm != self.algorithm:
            raise ValueError(f"{type(self).__name__} runs algorithm {self.algorithm!r}; got {config.algorithm!r}")
        if config.data.format != "prompt":
            raise ValueError(f"algorithm {config.algorithm} needs data.format=prompt; got {config.data.format!r}")
        self.config = config
        rc = config.rollout
        self.group_size = rc.num_samples
        self.num_prompts = config.data.batch_size
        self.rows = self.num_prompts * self.group_size
        self.max_new = rc.max_new_tokens
        self.epochs, self.minibatches = self.update_schedule()
        if self.rows % self.minibatches:
            raise ValueError(f"{self.rows} rollout rows (data.batch_size x rollout.num_samples) do not split into "
                             f"{self.minibatches} minibatches")

        self.mesh = build_mesh(config.mesh)
        self.tokenizer = load_tokenizer(config.model)
        self.data = prepare_dataset(config.data, self.tokenizer, records=records)
        self.prompt_len = config.data.max_prompt_length

        policy = build_model(config.model, kind=self.policy_kind, mesh=self.mesh)
        self.graphdef, policy_params, self.rest = split_params(policy)
        self.initial_params = self.build_params(policy_params)
        self.pack_group = self._packed_group_size(policy.config)

        self.kl_coef, self.kl_controller = self.kl_setup()
        self.uses_reference = self.kl_coef > 0 or isinstance(self.kl_controller, kl_lib.AdaptiveKLController)
        self.logps_from_update = self.epochs * self.minibatches == 1 and not self.reads_policy_before_update()

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
        self.alarms = Alarms()
        self._build_functions()

    def _packed_group_size(self, model_config) -> int:
        """``G`` when the trainer's forward passes pack each group into one row, else 1.

        Packing needs every minibatch and micro-batch to hold whole groups (minibatches
        are then drawn group by group); ``pack_groups: on`` says so when they cannot.
        """
        rc, config = self.config.rollout, self.config
        G, P, N = self.group_size, config.data.max_prompt_length, rc.max_new_tokens
        if rc.pack_groups == "off" or G < 2:
            return 1
        if rc.pack_groups == "auto" and not packing.group_packing_pays(model_config, prompt_len=P, new_tokens=N,
                                                                      group=G):
            return 1
        rows_per_micro = self.rows // (self.minibatches * config.train.grad_accum_steps)
        if self.num_prompts % self.minibatches or rows_per_micro % G:
            if rc.pack_groups == "on":
                raise ValueError(
                    f"rollout.pack_groups=on needs whole groups of {G} in every minibatch and micro-batch; "
                    f"{self.num_prompts} prompts into {self.minibatches} minibatches x "
                    f"{config.train.grad_accum_steps} micro-batches do not give that"
                )
            return 1
        return G

    # ------------------------------------------------------------------ algorithm hooks
    @abc.abstractmethod
    def update_schedule(self) -> tuple[int, int]:
        """``(epochs, minibatches)`` per rollout."""

    def build_params(self, policy_params: nnx.State) -> Any:
        """The trained parameter tree (the policy's, plus a separate critic's if any)."""
        return policy_params

    def policy_params(self, params):
        """The policy's part of the trained tree."""
        return params

    def reads_policy_before_update(self) -> bool:
        """Whether rewards or advantages read the policy's log-probs or values (computed
        by a forward pass before the update); otherwise a single update supplies them."""
        return True

    @abc.abstractmethod
    def kl_setup(self) -> tuple[float, Any]:
        """``(KL coefficient, KL controller)``; a zero fixed coefficient drops the reference."""

    @abc.abstractmethod
    def loss_setup(self) -> tuple[Any, dict[str, Any], str, float]:
        """``(policy loss function, its clip keywords, aggregation mode, entropy coefficient)``."""

    def loss_kl_options(self) -> dict[str, Any]:
        """``kl_coef``/``kl_kind`` when the policy loss carries the KL to the reference."""
        return {}

    def extra_loss(self, params, mb, normalisers, values) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Terms added to the policy loss (PPO: value loss, ptx), traced in the jitted step;
        ``values`` are the policy's own value head's (``None`` without one)."""
        del params, mb, normalisers, values
        return jnp.zeros((), jnp.float32), {}

    def old_values(self, params, tokens, positions, attention, shared_values) -> jax.Array:
        """The critic's values of the rollout (zeros without a critic)."""
        del params, positions, attention, shared_values
        return jnp.zeros(tokens.shape[:1] + (self.max_new,), jnp.float32)

    def minibatch_extras(self) -> dict[str, jax.Array]:
        """Arrays added to every minibatch (PPO-ptx's SFT batch)."""
        return {}

    def final_rewards(self, rewards: np.ndarray, rollout: Mapping[str, jax.Array]) -> np.ndarray:
        """The sequence rewards the advantages see (GRPO: minus the KL when it is placed there)."""
        del rollout
        return rewards

    @abc.abstractmethod
    def advantages(self, state, groups: Groups, rewards: np.ndarray, rollout: Mapping[str, jax.Array],
                   figures: dict[str, float]) -> tuple[jax.Array, jax.Array]:
        """``(advantages [R, N], returns [R, N])``; may add figures."""

    def stop_epochs(self, rollout_index: int, epoch: int, epoch_metrics: Sequence[Mapping[str, float]]) -> bool:
        """Whether to skip the remaining epochs of this rollout."""
        del rollout_index, epoch, epoch_metrics
        return False

    # ------------------------------------------------------------------ placement
    def place(self, value: np.ndarray) -> jax.Array:
        value = np.asarray(value)
        return place_array(value, batch_sharding(self.mesh, value.ndim))

    def sampling_state(self, params) -> nnx.State:
        return nnx.merge_state(self.policy_params(params), self.rest)

    # ------------------------------------------------------------------ compiled pieces
    def policy_forward(self, policy_params, tokens, positions, attention):
        """``(log-probs, entropy, shared-head values or None)`` of the response window."""
        model = nnx.merge(self.graphdef, policy_params, self.rest)
        return response_forward(model, tokens, positions, attention, prompt_len=self.prompt_len,
                                temperature=self.config.rollout.temperature,
                                chunk_size=self.config.model.logprob_chunk_size, group=self.pack_group)

    def _build_functions(self) -> None:
        config = self.config
        rc = config.rollout
        n = self.max_new
        self._policy_forward = jax.jit(self.policy_forward)
        policy_loss, clip, aggregation, entropy_coef = self.loss_setup()
        kl_options = self.loss_kl_options()

        def loss_fn(params, frozen, mb, normalisers, rng):
            del frozen, rng
            logps, entropy, values = self.policy_forward(self.policy_params(params), mb["tokens"], mb["positions"],
                                                    mb["attention_mask"])
            options = dict(aggregation=aggregation, num_tokens=normalisers["num_tokens"],
                           num_seqs=normalisers["num_seqs"], norm_length=n, entropy=entropy,
                           entropy_coef=entropy_coef)
            if kl_options:
                options.update(ref_logps=mb["ref_logps"], **kl_options)
            if rc.tis_cap is not None:
                options.update(sampler_logps=mb["sampler_logps"], tis_cap=rc.tis_cap)
            if self.logps_from_update and rc.old_logps == "recompute":
                old_logps = jax.lax.stop_gradient(logps)  # this forward pass is the rollout's policy
            else:
                old_logps = mb["old_logps"]
            loss, metrics = policy_loss(logps, old_logps, mb["advantages"], mb["mask"], **clip, **options)
            metrics = dict(metrics)
            metrics["policy_loss"] = loss
            if self.logps_from_update:  # per-row outputs: the step concatenates them over micro-batches
                metrics[ROWS + "logps"] = jax.lax.stop_gradient(logps)
                metrics[ROWS + "entropy"] = jax.lax.stop_gradient(entropy)
            extra, extra_metrics = self.extra_loss(params, mb, normalisers, values)
            metrics.update(extra_metrics)
            return loss + extra, metrics

        def normalisers_fn(mb):
            return ops.aggregation_normalisers(mb["mask"])

        total_updates = config.train.total_steps * self.epochs * self.minibatches
        self.optimizer, schedule = build_optimizer(config.optim, total_updates)
        self._loss_fn = loss_fn
        self._make_step = lambda: make_train_step(loss_fn, self.optimizer, normalisers_fn=normalisers_fn,
                                                  grad_accum_steps=config.train.grad_accum_steps, schedule=schedule)

    def init_state(self):
        """``(train state, frozen)`` placed on the mesh, and ``self.update`` compiled for them."""
        config = self.config
        extra = {"kl_coef": self.kl_controller.init(), "rollouts": jnp.zeros((), jnp.int32)}
        init = lambda p: init_train_state(p, self.optimizer, jax.random.key(config.train.seed), extra)  # noqa: E731
        shardings = tree_shardings(jax.eval_shape(init, self.initial_params), self.mesh)
        state = jax.jit(init, out_shardings=shardings)(self.initial_params)
        self.update = jax.jit(self._make_step(), donate_argnums=(0,), out_shardings=(shardings, None))
        frozen = {}
        if self.uses_reference:
            copy = jax.jit(lambda p: jax.tree.map(jnp.copy, p))
            frozen["reference"] = copy(self.policy_params(self.initial_params))
        return state, frozen

    # ------------------------------------------------------------------ one rollout step
    def rollout_key(self, state) -> tuple[int, jax.Array]:
        rollout_index = int(jax.device_get(state.extra["rollouts"]))
        return rollout_index, jax.random.fold_in(jax.random.key(self.config.train.seed), rollout_index)

    def collect(self, state, prompt_batch, batches) -> tuple[Groups, dict[str, float]]:
        """Sample and score this step's groups."""
        del batches
        _, key = self.rollout_key(state)
        groups, gen_s, gen_tokens = self.sampler.sample(self.sampling_state(state.params), prompt_batch,
                                                        jax.random.fold_in(key, 0))
        return groups, generation_figures(gen_s, gen_tokens)

    def _minibatch_rows(self, order_rng: np.random.Generator) -> list[np.ndarray]:
        """One epoch's minibatches of rollout rows: a random split of the rows, or of the
        groups when groups are packed (each group's rows stay together; the caller sorts
        the rows, which keeps every group contiguous)."""
        if self.pack_group == 1:
            return np.split(order_rng.permutation(self.rows), self.minibatches)
        G = self.pack_group
        groups = np.split(order_rng.permutation(self.num_prompts), self.minibatches)
        return [(g[:, None] * G + np.arange(G)[None, :]).reshape(-1) for g in groups]

    def rl_step(self, state, frozen, prompt_batch, batches):
        config = self.config
        rc = config.rollout
        t_start = time.perf_counter()
        groups, figures = self.collect(state, prompt_batch, batches)
        rollout_index, _ = self.rollout_key(state)

        # ---- per-token quantities of the rollout under the current policy ----
        t_fwd = time.perf_counter()
        tokens, positions, attention = (self.place(a) for a in groups.full_sequences())
        response_mask = self.place(groups.response_mask.astype(np.float32))
        sampler_logps = self.place(groups.sampler_logps)
        if self.logps_from_update:
            recomputed = entropy = shared_values = None  # the update returns them
        else:
            recomputed, entropy, shared_values = self._policy_forward(self.policy_params(state.params), tokens,
                                                                      positions, attention)
        old_logps = sampler_logps if rc.old_logps == "sampler" else recomputed
        ref_logps = (self._policy_forward(frozen["reference"], tokens, positions, attention)[0]
                     if self.uses_reference else jnp.zeros_like(sampler_logps))
        old_values = self.old_values(state.params, tokens, positions, attention, shared_values)
        loss_mask = groups.response_mask.astype(np.float32)
        if config.rewards.mask_truncated:
            loss_mask = loss_mask * groups.stopped[:, None].astype(np.float32)
        rollout = {"tokens": tokens, "positions": positions, "attention_mask": attention,
                   "mask": self.place(loss_mask), "response_mask": response_mask, "old_logps": old_logps,
                   "sampler_logps": sampler_logps, "ref_logps": ref_logps, "old_values": old_values}

        # ---- rewards and advantages ----
        rewards = self.final_rewards(groups.rewards.astype(np.float32), rollout)
        rollout["advantages"], rollout["returns"] = self.advantages(state, groups, rewards, rollout, figures)
        del rollout["response_mask"]
        if rollout["old_logps"] is None:  # taken from the update's own forward pass
            del rollout["old_logps"]
        jax.block_until_ready(rollout)  # so perf/logprob_s times the forward passes, not their dispatch
        t_update = time.perf_counter()

        # ---- updates ----
        order_rng = np.random.default_rng([config.train.seed, rollout_index])
        update_metrics: list[dict[str, float]] = []
        first = None
        epochs_run = 0
        for epoch in range(self.epochs):
            epoch_metrics = []
            for rows in self._minibatch_rows(order_rng):
                index = self.place(np.sort(rows).astype(np.int32))
                minibatch = {k: jnp.take(v, index, axis=0) for k, v in rollout.items()}
                minibatch.update(self.minibatch_extras())
                state, metrics = self.update(state, frozen, minibatch)
                rows = {k[len(ROWS):]: metrics.pop(k) for k in list(metrics) if k.startswith(ROWS)}
                metrics = to_host(metrics)
                first = first or metrics
                epoch_metrics.append(metrics)
            update_metrics.extend(epoch_metrics)
            epochs_run += 1
            if self.stop_epochs(rollout_index, epoch, epoch_metrics):
                break
        t_end = time.perf_counter()
        if self.logps_from_update:  # one update over every row, in rollout order
            recomputed, entropy = rows["logps"], rows["entropy"]
            old_logps = recomputed if old_logps is None else old_logps

        # ---- carried state: rollout count and the KL controller ----
        seq_kl = np.asarray(sequence_kl(old_logps, ref_logps, response_mask, "k1"))
        new_coef = self.kl_controller.update(state.extra["kl_coef"], float(np.mean(seq_kl)), self.rows)
        state = state._replace(extra={"kl_coef": new_coef, "rollouts": state.extra["rollouts"] + 1})

        figures.update(self._rollout_figures(groups, rewards, seq_kl, old_logps, ref_logps, recomputed, sampler_logps,
                                             response_mask, entropy, rollout["advantages"]))
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
        state, frozen = self.init_state()
        checkpointer = (Checkpointer(os.path.join(config.output_dir, "checkpoints"), keep=config.checkpoint.keep,
                                     async_save=config.checkpoint.async_save) if config.checkpoint.enabled else None)
        batches = self.data.iterator("train")
        resumed = False
        if checkpointer is not None and config.checkpoint.resume and checkpointer.latest_step() is not None:
            state, meta = checkpointer.restore(state)
            batches.set_state(meta["data"])
            self.alarms.set_state(meta.get("alarms", {}))
            if "reference" in frozen:
                frozen["reference"] = checkpointer.restore_reference(frozen["reference"])
            resumed = True
            log.info("resumed at rollout %d from %s", int(state.extra["rollouts"]), checkpointer.directory)
        elif checkpointer is not None and "reference" in frozen:
            checkpointer.save_reference(frozen["reference"])

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


def generation_figures(seconds: float, tokens: int) -> dict[str, float]:
    return {"perf/generation_s": seconds, "perf/generation_tokens_per_s": tokens / seconds if seconds > 0 else 0.0}


def trainer_class(algorithm: str) -> type[OnlineTrainer]:
    """The :class:`OnlineTrainer` subclass that runs ``algorithm`` (``ppo`` or ``grpo``)."""
    from alignax.trainers.grpo import GRPOTrainer
    from alignax.trainers.ppo import PPOTrainer

    classes = {cls.algorithm: cls for cls in (PPOTrainer, GRPOTrainer)}
    if algorithm not in classes:
        raise ValueError(f"algorithm {algorithm!r} is not an online trainer; valid: {', '.join(classes)}")
    return classes[algorithm]


def make_trainer(config: TrainConfig, *, records: Sequence[Mapping] | None = None) -> OnlineTrainer:
    return trainer_class(config.algorithm)(config, records=records)


def train(config: TrainConfig, *, records: Sequence[Mapping] | None = None) -> TrainResult:
    """Run a PPO / GRPO-family recipe to ``train.total_steps`` rollout steps."""
    return make_trainer(config, records=records).train()
