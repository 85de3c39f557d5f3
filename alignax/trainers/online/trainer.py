"""The online-RL trainer: rollout → reward → advantage → update, for any
:class:`~alignax.trainers.online.algorithm.OnlineAlgorithm`.

One rollout step (:meth:`OnlineTrainer.rollout_step`):

1. sample ``G`` completions for each of ``B`` prompts and score them
   (:class:`alignax.sampling.scored.ScoredSampler` with the run's
   :class:`alignax.rewards.composite.RewardScorer`); under DAPO's dynamic sampling, refill
   until enough groups have varying rewards;
2. old log-probs (recomputed by a forward pass, or the sampler's), reference log-probs and
   the critic's values; the sampler/trainer log-prob mismatch is measured either way. When
   a rollout gets exactly one update and nothing before it reads the policy's log-probs
   (GRPO with the KL in the loss), the separate forward pass is skipped: that update's own
   forward pass is the policy the rollout came from, so the old log-probs are its log-probs
   with the gradient stopped (ratio exactly 1, as TRL and Tunix do), and the figures read
   the :class:`~alignax.trainers.online.rollout.UpdateRows` the update returns;
3. the sequence rewards (minus the KL when the algorithm places it there) and the
   algorithm's advantages, as one typed :class:`~alignax.trainers.online.rollout.Rollout`;
4. ``epochs`` passes of ``minibatches`` updates (the engine's jitted step: non-finite
   guard, clipping, optimiser); ``stop_after_epoch`` may end them early;
5. the KL controller, metrics and alarms (:mod:`alignax.trainers.online.monitoring`).

The host loop around a step (logging, eval, checkpoints at rollout boundaries, SIGTERM)
is the engine's :class:`~alignax.trainers.engine.session.Session`; a resumed run repeats
the same rollouts because each one's randomness comes from the seed and the rollout index.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from alignax import evaluation, models, ops
from alignax import kl as kl_lib
from alignax.config import ConfigError
from alignax.data import prepare_dataset
from alignax.envs.registry import env_factory
from alignax.envs.rollout import EnvSampler, trajectory_figures
from alignax.losses import sft_loss, value_loss
from alignax.metrics import to_host
from alignax.models import lora as lora_lib
from alignax.parallel.multihost import allgather_rows, host_global, local_rows, place_rows, process_rows
from alignax.parallel.placement import place, place_optimizer_state, rows_to, split_devices, to_device
from alignax.parallel.sharding import batch_sharding, fit_rows, make_mesh, tree_shardings
from alignax.rewards.composite import RewardModels, RewardScorer
from alignax.rewards.process import ProcessRewardModel, process_step_rewards, step_boundaries
from alignax.rewards.verifiers import with_task
from alignax.sampling import SamplingConfig
from alignax.sampling.scored import Groups, ScoredSampler
from alignax.trainers.config import TrainConfig
from alignax.trainers.engine import packing
from alignax.trainers.engine.optim import build_optimizer
from alignax.trainers.engine.precision import compute_copy, frozen_params
from alignax.trainers.engine.session import Session, TrainResult, init_state_on_mesh
from alignax.trainers.engine import adapters
from alignax.trainers.engine.setup import (build_frozen_params, build_meshes, build_model, load_tokenizer,
                                           response_logps, split_params)
from alignax.trainers.engine.step import LossAux, StepOutput, TrainState, make_train_step
from alignax.trainers.online.algorithm import AdvantageInputs, OnlineAlgorithm
from alignax.trainers.online.grpo import group_reward_std, select_informative_groups
from alignax.trainers.online.monitoring import Alarms, rollout_figures
from alignax.trainers.online.rollout import Minibatch, Rollout, UpdateRows, response_forward

log = logging.getLogger("alignax")


class OnlineTrainer:
    """Everything an online-RL run holds between rollout steps."""

    def __init__(self, config: TrainConfig, algorithm: OnlineAlgorithm, *, records: Sequence[Mapping] | None = None):
        if config.data.format != "prompt":
            raise ValueError(f"algorithm {config.algorithm} needs data.format=prompt; got {config.data.format!r}")
        rc = config.rollout
        if rc.num_samples < algorithm.min_group_size:
            raise ValueError(f"{config.algorithm} compares samples of a prompt: rollout.num_samples must be >= "
                             f"{algorithm.min_group_size}; got {rc.num_samples}")
        self.config, self.algorithm = config, algorithm
        self.group_size = rc.num_samples
        self.num_prompts = config.data.batch_size  # global: every process's prompts
        self.rows = self.num_prompts * self.group_size
        # This process's share: it samples, scores and picks minibatch rows of its own
        # prompts (alignax.parallel.multihost); one process holds them all.
        self.local_prompts = self.num_prompts // jax.process_count()
        self.local_rows = self.local_prompts * self.group_size
        self.row_offset = process_rows(self.rows).start
        self.max_new = rc.max_new_tokens
        self.prompt_len = config.data.max_prompt_length
        if self.local_rows % algorithm.minibatches:
            raise ValueError(f"each of the {jax.process_count()} processes holds {self.local_rows} rollout rows, which "
                             f"do not split into {algorithm.minibatches} minibatches")
        if self.rows % algorithm.minibatches:
            raise ValueError(f"{self.rows} rollout rows (data.batch_size x rollout.num_samples) do not split into "
                             f"{algorithm.minibatches} minibatches")

        self.mesh, self.submesh = build_meshes(config)  # submesh: placement.submesh, or None
        self.submesh_reference = None  # placement.reference: submesh: the reference's params there
        self.sampler_mesh = self._sampler_mesh(rc.mesh)
        self.tokenizer = load_tokenizer(config.model)
        self.data = prepare_dataset(config.data, self.tokenizer, records=records)
        policy = build_model(config.model, kind=algorithm.policy_kind, mesh=self.mesh, precision=config.precision,
                             lora=config.lora)
        self.model_config = policy.config
        self.graphdef, policy_params, self.rest = split_params(policy)
        del policy
        # with LoRA: the adapters are trained, the base is frozen (alignax.trainers.engine.adapters)
        policy_params, base = adapters.split_trainable(policy_params, config.lora)
        self.base = None if base is None else frozen_params(base, config.precision)
        del base
        # a critic with trained params of its own: its own decoder, or (LoRA) its own adapter
        # and value head on the policy's frozen base (ppo.critic=adapter)
        critic_kind = None if algorithm.critic is None else algorithm.critic.kind
        self.separate_critic = critic_kind in ("separate", "adapter")
        self.adapter_critic = critic_kind == "adapter"
        self.initial_params = self._with_critic(policy_params)
        self.pack_group = packing.packed_group_size(config, self.model_config, minibatches=algorithm.minibatches,
                                                    batch_devices=self.mesh.shape["data"] * self.mesh.shape["fsdp"])

        kl = algorithm.kl
        self.uses_reference = kl.uses_reference
        reads_policy = algorithm.critic is not None or (
            kl.placement != "loss" and kl.uses_reference and rc.old_logps == "recompute")
        self.logps_from_update = algorithm.epochs * algorithm.minibatches == 1 and not reads_policy

        eos = self.tokenizer.eos_token_id
        self.stop_ids = tuple(rc.stop_token_ids) if rc.stop_token_ids else (eos,)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        self.sampling = SamplingConfig(max_new_tokens=rc.max_new_tokens, temperature=rc.temperature, top_k=rc.top_k,
                                       top_p=rc.top_p, stop_token_ids=self.stop_ids, pad_id=pad,
                                       num_samples=self.group_size)
        self.greedy = SamplingConfig(max_new_tokens=rc.max_new_tokens, greedy=True, stop_token_ids=self.stop_ids,
                                     pad_id=pad, num_samples=1)  # ReMax's baseline
        reward_models = None
        if config.rewards.reward_models:
            # held in precision.frozen_dtype, as the judge and a PRM are (they compute in float32)
            reward_models = RewardModels.load(config.rewards.reward_models, mesh=self.frozen_mesh("reward_models"),
                                              vocab_size=self.model_config.vocab_size,
                                              param_dtype=config.precision.frozen)
            reward_models.states = place(reward_models.states, config.placement.reward_models)
        self.scorer = RewardScorer(config.rewards, max_new_tokens=rc.max_new_tokens, stop_token_ids=self.stop_ids,
                                   reward_models=reward_models, frozen_dtype=config.precision.frozen)
        # lora.merge_for_sampling: the sampler runs the merged model (W + s A B, once per rollout)
        self.merge_sampling = config.lora is not None and config.lora.merge_for_sampling
        self.sampling_graphdef = self.graphdef
        if self.merge_sampling:
            self.sampling_graphdef = lora_lib.merged_graphdef(
                self.graphdef, nnx.merge_state(self.whole_policy(self.initial_params), self.rest))
        # The sampler decodes on its own mesh from a compute-dtype copy of the policy (made
        # by sampling_state); rewards from reward models are computed on the training mesh
        # (on the sub-mesh under placement.reward_models: submesh).
        self.sampler_copies = rc.mesh is not None or config.precision.compute_dtype != config.precision.param_dtype
        self._copy_program = None  # built on first use (it needs the state's structure)
        self.sampler = ScoredSampler(self.sampling_graphdef, self.tokenizer, self.scorer, self.sampling,
                                     mesh=self.sampler_mesh, place=self.sampler_place,
                                     score_place=self.frozen_place("reward_models"))
        if config.env.name is not None:  # multi-turn: the environment gives the rewards
            self.sampler = self._env_sampler()
        self.alarms = Alarms()
        self.ptx = None
        if algorithm.ptx is not None:
            self.ptx = prepare_dataset(algorithm.ptx.data, self.tokenizer).iterator("train")
        total_updates = config.train.total_steps * algorithm.epochs * algorithm.minibatches
        self.optimizer, self.schedule = self._build_optimizer(total_updates)
        self._policy_forward = jax.jit(self.policy_forward)  # the policy's and the reference's
        self._critic_values = jax.jit(self.critic_values)
        self._advantages = jax.jit(algorithm.advantages)

    # ------------------------------------------------------------------ setup
    def _env_sampler(self):
        """Multi-turn rollouts with ``config.env``'s environment (:class:`alignax.envs.rollout.EnvSampler`)."""
        ec = self.config.env
        return EnvSampler(self.sampling_graphdef, self.model_config, self.tokenizer, env_factory(ec.name, ec.kwargs),
                          self.sampling, mesh=self.sampler_mesh, place=self.sampler_place, prompt_len=self.prompt_len,
                          max_turns=ec.max_turns, max_turn_tokens=ec.max_turn_tokens,
                          max_observation_tokens=ec.max_observation_tokens)

    def _sampler_mesh(self, shape) -> jax.sharding.Mesh:
        """``rollout.mesh`` over the training mesh's devices (every device, less a sub-mesh's),
        or the training mesh itself when it is null."""
        if shape is None:
            return self.mesh
        devices, _ = split_devices(self.config.placement)
        try:
            return make_mesh(shape, devices=devices)
        except ValueError as err:
            raise ConfigError(f"rollout.mesh={list(shape)}: the sampler's mesh spans the same {len(devices)} "
                             f"devices as training: {err}") from None

    def _with_critic(self, policy_params: nnx.State) -> Any:
        """The trained tree: the policy's params, or ``{"policy", "critic"}`` with a separate critic."""
        critic = self.algorithm.critic
        if not self.separate_critic:
            return policy_params
        if self.adapter_critic:
            self.critic_graphdef, critic_params, self.critic_rest = adapters.critic_adapter(
                self.model_config, mesh=self.mesh)
            return {"policy": policy_params, "critic": critic_params}
        if critic.init == "reward_model":
            if not critic.path:
                raise ValueError("ppo.critic_init=reward_model needs ppo.critic_path (a reward model folder)")
            model = models.from_pretrained(critic.path, kind="value", mesh=self.mesh,
                                           **self.config.precision.model_dtypes())
        else:
            model = build_model(self.config.model, kind="value", mesh=self.mesh, precision=self.config.precision)
        self.critic_graphdef, critic_params, self.critic_rest = split_params(model)
        return {"policy": policy_params, "critic": critic_params}

    def _build_optimizer(self, total_updates: int):
        """The policy's optimiser; with a critic learning rate of its own, the critic's
        params (a separate critic, or the shared trunk's value head) get their own."""
        optimizer, schedule = build_optimizer(self.config.optim, total_updates, precision=self.config.precision)
        critic = self.algorithm.critic
        if critic is None or critic.optim is None:
            return optimizer, schedule
        critic_optimizer, _ = build_optimizer(critic.optim, total_updates, precision=self.config.precision)

        def labels(params):
            if self.separate_critic:
                return {"policy": jax.tree.map(lambda _: "policy", params["policy"]),
                        "critic": jax.tree.map(lambda _: "critic", params["critic"])}
            return jax.tree.map_with_path(
                lambda path, _: "critic" if "value_head" in jax.tree_util.keystr(path) else "policy", params)

        return optax.multi_transform({"policy": optimizer, "critic": critic_optimizer}, labels), schedule

    def place(self, value: np.ndarray) -> jax.Array:
        return place_rows(value, self.mesh)

    def frozen_mesh(self, role: str) -> jax.sharding.Mesh:
        """Where the frozen model of ``role`` (``reference`` | ``reward_models``) runs: the
        sub-mesh under ``placement.<role>: submesh``, else the training mesh."""
        return self.submesh if self.config.placement.on_submesh(role) else self.mesh

    def frozen_place(self, role: str):
        """Puts this process's rows of a host array on :meth:`frozen_mesh` of ``role``."""
        mesh = self.frozen_mesh(role)
        return lambda value: place_rows(value, mesh)

    def sampler_place(self, value: np.ndarray) -> jax.Array:
        """Prompt rows of this process on the sampler's mesh."""
        return place_rows(value, self.sampler_mesh)

    def policy_params(self, params):
        """The policy's part of the trained tree."""
        return params["policy"] if self.separate_critic else params

    def whole_policy(self, params):
        """The policy's parameters whole: its trained part, with the frozen base of a LoRA run."""
        policy = self.policy_params(params)
        return policy if self.base is None else nnx.merge_state(policy, self.base)

    def whole_critic(self, params):
        """A separate critic's parameters whole: with ``ppo.critic=adapter``, its adapter and
        value head with the policy's frozen decoder (the same buffers)."""
        return self.with_frozen_base(params, self.base)["critic"]

    def with_frozen_base(self, params, base):
        """The trained tree with the frozen ``base`` merged in: into the policy's params, and
        with ``ppo.critic=adapter`` its decoder into the critic's (no second copy)."""
        if base is None:
            return params
        if self.adapter_critic:
            return {"policy": nnx.merge_state(params["policy"], base),
                    "critic": nnx.merge_state(params["critic"], adapters.critic_base(base))}
        return nnx.merge_state(params, base)

    def sampling_state(self, params) -> nnx.State:
        """What the sampler generates with: base + adapters, unmerged, under LoRA (with
        ``lora.merge_for_sampling`` the merged model's weights, computed here once a call);
        with its own mesh or a compute dtype other than the parameters', a copy with kernels
        in the compute dtype laid out on the sampler's mesh (:func:`compute_copy`), made from
        ``params`` at each call (each rollout, after the previous rollout's updates)."""
        state = nnx.merge_state(self.whole_policy(params), self.rest)
        if self.merge_sampling:
            state = lora_lib.merged_state(self.graphdef, state)
        if not self.sampler_copies:
            return state
        if self._copy_program is None:
            self._copy_program = compute_copy(self.config.precision.compute_dtype,
                                              tree_shardings(state, self.sampler_mesh))
        return self._copy_program(state)

    def frozen_inputs(self, reference) -> dict[str, Any]:
        """``frozen`` of the update: the reference when the KL is on and, with LoRA, the base
        (the reference is then that base with the adapters off, on the same buffers). Under
        ``placement.reference: submesh`` the reference stays with the trainer
        (:meth:`reference_logps` runs it on the sub-mesh) and the update gets none."""
        if self.base is not None:
            return adapters.frozen_base(self.base, reference)
        if reference is not None and self.config.placement.on_submesh("reference"):
            self.submesh_reference = reference
            return {}
        return {} if reference is None else {"reference": place(reference, self.config.placement.reference)}

    def reference_logps(self, frozen, sequences: tuple[np.ndarray, ...], placed: tuple[jax.Array, ...]) -> jax.Array:
        """The reference's log-probs of the rollout's response tokens, ``[R, N]`` on the
        training mesh: from ``frozen["reference"]`` on the full sequences ``placed`` on the
        training mesh, or on the sub-mesh (the host ``sequences`` placed there) and brought back."""
        if self.submesh_reference is None:
            return self._policy_forward(frozen["reference"], *placed)[0]
        on_submesh = [self.frozen_place("reference")(a) for a in sequences]
        return rows_to(self.mesh, self._policy_forward(self.submesh_reference, *on_submesh)[0])

    # ------------------------------------------------------------------ compiled pieces
    def policy_forward(self, policy_params, tokens, positions, attention):
        """``(log-probs, entropy, shared-head values or None)`` of the response window. The
        params are moved into device memory first: a no-op for the policy's, and the
        reference's under ``placement.reference: host`` (held in host memory between uses)."""
        model = nnx.merge(self.graphdef, to_device(policy_params), self.rest)
        return response_forward(model, tokens, positions, attention, prompt_len=self.prompt_len,
                                temperature=self.config.rollout.temperature,
                                chunk_size=self.config.model.logprob_chunk_size, group=self.pack_group)

    def critic_values(self, critic_params, tokens, positions, attention):
        """A separate critic's values at the positions that predict each response token, ``[R, N]``."""
        critic = nnx.merge(self.critic_graphdef, critic_params, self.critic_rest)
        return critic(tokens, positions, attention).values[:, self.prompt_len - 1 : -1]

    def loss_fn(self, params, frozen, mb: Minibatch, normalisers, rng):
        """The update's loss on one micro-batch: the policy objective (with the KL to the
        reference when it sits in the loss), plus the critic's value loss and PPO-ptx."""
        del frozen, rng
        algo, rc, ro = self.algorithm, self.config.rollout, mb.rollout
        objective = algo.objective
        logps, entropy, values = self.policy_forward(self.policy_params(params), ro.tokens, ro.positions,
                                                     ro.attention_mask)
        options = dict(aggregation=objective.aggregation, num_tokens=normalisers["num_tokens"],
                       num_seqs=normalisers["num_seqs"], norm_length=self.max_new, entropy=entropy,
                       entropy_coef=objective.entropy_coef)
        if algo.kl.placement == "loss" and self.uses_reference:
            options.update(ref_logps=ro.ref_logps, kl_coef=mb.kl_coef, kl_kind=algo.kl.kind)
        if rc.tis_cap is not None:
            options.update(sampler_logps=ro.sampler_logps, tis_cap=rc.tis_cap)
        # Single-update mode: this forward pass is the rollout's policy.
        old_logps = jax.lax.stop_gradient(logps) if ro.old_logps is None else ro.old_logps
        loss, metrics = objective.loss_fn(logps, old_logps, ro.advantages, ro.loss_mask, **objective.keywords,
                                          **options)
        metrics = dict(metrics)
        # Loss parts computed with the minibatch's normalisers add up over micro-batches.
        sums = {"pg_loss": metrics.pop("pg_loss"), "policy_loss": loss}
        critic = algo.critic
        if critic is not None:
            if self.separate_critic:
                values = self.critic_values(params["critic"], ro.tokens, ro.positions, ro.attention_mask)
            v_loss, v_metrics = value_loss(values, ro.old_values, ro.returns, ro.loss_mask, clip_eps=critic.value_clip,
                                           aggregation=objective.aggregation, num_tokens=normalisers["num_tokens"],
                                           num_seqs=normalisers["num_seqs"], norm_length=self.max_new)
            metrics.update({f"value/{k}": v for k, v in v_metrics.items()})
            sums["value/loss"] = v_loss
            loss = loss + critic.vf_coef * v_loss
        if mb.ptx is not None:
            model = nnx.merge(self.graphdef, self.policy_params(params), self.rest)
            ptx = mb.ptx
            ptx_logps, ptx_mask = response_logps(model, ptx["tokens"], ptx["positions"], ptx["attention_mask"],
                                                 ptx["response_mask"], chunk_size=self.config.model.logprob_chunk_size)
            ptx_loss, _ = sft_loss(ptx_logps, ptx_mask, num_tokens=normalisers["ptx_num_tokens"])
            sums["ptx/loss"] = ptx_loss
            loss = loss + algo.ptx.coef * ptx_loss
        rows = UpdateRows(logps=jax.lax.stop_gradient(logps), entropy=jax.lax.stop_gradient(entropy))
        return loss, LossAux(metrics, rows, sums)

    @staticmethod
    def normalisers_fn(mb: Minibatch) -> dict[str, jax.Array]:
        """Counts of the whole minibatch, so micro-batch losses add up to its loss."""
        out = ops.aggregation_normalisers(mb.rollout.loss_mask)
        if mb.ptx is not None:
            out["ptx_num_tokens"] = jnp.sum(mb.ptx["response_mask"][:, 1:].astype(jnp.float32))
        return out

    def init_state(self) -> tuple[TrainState, Any]:
        """The fresh train state on the mesh (carrying the KL controller and the rollout
        count), and its shardings."""
        extra = {"kl_coef": self.algorithm.kl.controller.init(), "rollouts": jnp.zeros((), jnp.int32)}
        state, shardings = init_state_on_mesh(self.initial_params, self.optimizer, seed=self.config.train.seed,
                                              mesh=self.mesh, extra=extra)
        return place_optimizer_state(state, shardings, self.config.placement.optimizer_state)

    def start(self) -> tuple[TrainState, dict[str, Any]]:
        """``(fresh train state, frozen)`` on the mesh, ``frozen`` holding the reference (the
        initial policy params themselves, in ``precision.frozen_dtype``) when the KL is on;
        compiles :attr:`update` for them. :attr:`initial_params` is None from here on: the
        state holds buffers of its own."""
        state, shardings = self.init_state()
        step = make_train_step(adapters.with_base(adapters.with_dropout(self.loss_fn, self.config.lora),
                                                  merge=self.with_frozen_base),
                               self.optimizer, normalisers_fn=self.normalisers_fn,
                               grad_accum_steps=self.config.train.grad_accum_steps, schedule=self.schedule,
                               schedule_position=lambda state, mb: mb.schedule_position,
                               row_block=self.pack_group)
        self.update = jax.jit(step, donate_argnums=(0,), out_shardings=(shardings, None))
        self.reference = None  # what a run saves once as its reference
        if self.uses_reference:
            initial = self.policy_params(self.initial_params)
            if self.base is not None:
                self.reference = adapters.reference_adapters(initial)
            elif self.config.placement.on_submesh("reference"):  # built there: the same weights, other devices
                self.reference = build_frozen_params(self.config.model, kind=self.algorithm.policy_kind,
                                                     mesh=self.submesh, precision=self.config.precision)
            else:
                self.reference = frozen_params(initial, self.config.precision)
        self.initial_params = None
        return state, self.frozen_inputs(self.reference)

    def minibatch_shapes(self) -> Minibatch:
        """The :class:`Minibatch` an :attr:`update` takes, as ``jax.ShapeDtypeStruct`` with
        its shardings: ``update.lower(state, frozen, trainer.minibatch_shapes())`` compiles
        the update without a rollout (memory checks, alignax.estimate's calibration)."""
        rows = self.rows // self.algorithm.minibatches
        width = self.prompt_len + self.max_new

        def array(shape, dtype):  # rows over the batch axes that divide them (as placed); a scalar replicated
            sharding = (fit_rows(batch_sharding(self.mesh, len(shape)), shape[0]) if shape
                        else jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        per_token = array((rows, self.max_new), jnp.float32)
        rollout = Rollout(tokens=array((rows, width), jnp.int32), positions=array((rows, width), jnp.int32),
                          attention_mask=array((rows, width), jnp.int32), loss_mask=per_token,
                          sampler_logps=per_token, old_logps=None if self.logps_from_update else per_token,
                          ref_logps=per_token if self.uses_reference else None, old_values=per_token,
                          advantages=per_token, returns=per_token)
        ptx = None
        if self.ptx is not None:
            ptx = {k: array(v.shape, v.dtype) for k, v in self.next_ptx_batch().items()}
        return Minibatch(rollout=rollout, kl_coef=array((), jnp.float32),
                         schedule_position=array((), jnp.int32), ptx=ptx)

    # ------------------------------------------------------------------ one rollout step
    def rollout_key(self, state) -> tuple[int, jax.Array]:
        rollout_index = int(jax.device_get(state.extra["rollouts"]))
        return rollout_index, jax.random.fold_in(jax.random.key(self.config.train.seed), rollout_index)

    def collect(self, state, sampling_state, prompt_batch, batches) -> tuple[Groups, dict[str, float]]:
        """Sample and score this step's groups (from ``sampling_state``, :meth:`sampling_state`);
        under dynamic sampling, refill until enough groups have varying rewards."""
        _, key = self.rollout_key(state)
        groups, gen_s, gen_tokens = self.sampler.sample(sampling_state, prompt_batch, jax.random.fold_in(key, 0))
        max_refills = self.algorithm.dynamic_sampling_refills
        if max_refills is None:
            return groups, generation_figures(gen_s, gen_tokens)
        parts = [groups]
        informative = int(np.sum(group_reward_std(groups.rewards, self.group_size) > 0))
        refills = 0
        # refill until every process has its share of informative groups (sampling is a
        # collective: the processes refill together)
        while refills < max_refills and not np.all(allgather_rows(np.array([informative >= self.local_prompts]))):
            refills += 1
            extra, s, t = self.sampler.sample(sampling_state, next(batches), jax.random.fold_in(key, refills))
            parts.append(extra)
            gen_s, gen_tokens = gen_s + s, gen_tokens + t
            informative += int(np.sum(group_reward_std(extra.rewards, self.group_size) > 0))
        groups, _ = select_informative_groups(parts, num_groups=self.local_prompts, group_size=self.group_size)
        figures = generation_figures(gen_s, gen_tokens)
        figures["groups/refills"] = float(refills)
        figures["groups/sampled"] = float(sum(p.size for p in parts) // self.group_size * jax.process_count())
        return groups, figures

    def greedy_baseline(self, sampling_state, groups: Groups, figures: dict[str, float]) -> np.ndarray:
        """ReMax: the reward of each prompt's greedy completion, repeated over its group."""
        prompts = {"prompt_tokens": groups.prompt_tokens[:: self.group_size],
                   "prompt_attention_mask": groups.prompt_mask[:: self.group_size],
                   "references": groups.references[:: self.group_size]}
        greedy, _, _ = self.sampler.sample(sampling_state, prompts, jax.random.key(0),
                                           config=self.greedy)
        figures["reward/greedy_baseline"] = float(np.mean(allgather_rows(greedy.rewards)))
        return np.repeat(greedy.rewards, self.group_size).astype(np.float32)

    def _minibatch_rows(self, order_rng: np.random.Generator) -> list[np.ndarray]:
        """One epoch's minibatches of rollout rows: a random split of the rows, or of the
        groups when groups are packed (each group's rows stay together; the caller sorts
        the rows, which keeps every group contiguous)."""
        minibatches = self.algorithm.minibatches
        # each process splits its own rows (the same draw on every process); a minibatch is
        # every process's part of it, as global row indices
        if self.pack_group == 1:
            return [self.row_offset + rows for rows in np.split(order_rng.permutation(self.local_rows), minibatches)]
        G = self.pack_group
        groups = np.split(order_rng.permutation(self.local_prompts), minibatches)
        return [self.row_offset + (g[:, None] * G + np.arange(G)[None, :]).reshape(-1) for g in groups]

    def next_ptx_batch(self):
        if self.ptx is None:
            return None
        batch = next(self.ptx)
        return {k: self.place(batch[k]) for k in ("tokens", "positions", "attention_mask", "response_mask")}

    def rollout_step(self, state, frozen, prompt_batch, batches) -> tuple[TrainState, StepOutput]:
        """One rollout and its updates: the new state and the rollout's figures (host floats)."""
        config, algo = self.config, self.algorithm
        rc = config.rollout
        t_start = time.perf_counter()
        sampling_state = self.sampling_state(state.params)  # merged once a rollout (lora.merge_for_sampling)
        groups, figures = self.collect(state, sampling_state, prompt_batch, batches)
        rollout_index, _ = self.rollout_key(state)

        # ---- per-token quantities of the rollout under the current policy ----
        t_fwd = time.perf_counter()
        sequences = groups.full_sequences()
        tokens, positions, attention = placed = tuple(self.place(a) for a in sequences)
        response_mask = self.place(groups.actions().astype(np.float32))  # the policy's tokens (model turns)
        sampler_logps = self.place(groups.sampler_logps)
        recomputed = entropy = shared_values = None  # single-update mode: the update returns them
        if not self.logps_from_update:
            recomputed, entropy, shared_values = self._policy_forward(self.whole_policy(state.params), tokens,
                                                                      positions, attention)
        old_logps = sampler_logps if rc.old_logps == "sampler" else recomputed
        # no reference model (a zero fixed KL coefficient): no reference log-probs, no KL figures
        ref_logps = self.reference_logps(frozen, sequences, placed) if self.uses_reference else None
        if self.separate_critic:
            old_values = self._critic_values(self.whole_critic(state.params), tokens, positions, attention)
        elif shared_values is not None:
            old_values = shared_values
        else:
            old_values = jnp.zeros_like(sampler_logps)
        loss_mask = groups.actions().astype(np.float32)  # observation tokens of a trajectory get no loss
        if config.rewards.mask_truncated:
            loss_mask = loss_mask * groups.stopped[:, None].astype(np.float32)
        loss_mask = self.place(loss_mask)

        # ---- rewards and advantages ----
        kl_coef = jnp.array(state.extra["kl_coef"].coef)  # a copy: the update donates the state
        rewards = groups.rewards.astype(np.float32)
        if algo.kl.placement == "sequence_reward" and self.uses_reference:
            seq_kl = kl_lib.sequence_kl(old_logps, ref_logps, response_mask, kind=algo.kl.kind)
            rewards = rewards - float(jax.device_get(kl_coef)) * local_rows(seq_kl)
        zeros = np.zeros(groups.tokens.shape, np.float32)
        step_rewards = step_mask = zeros
        if algo.process_reward is not None:
            step_mask, texts = step_boundaries(self.tokenizer, groups.tokens, groups.response_mask, algo.step_delimiter)
            if isinstance(algo.process_reward, ProcessRewardModel):
                step_rewards = algo.process_reward.step_rewards(groups, step_mask)
            else:
                step_rewards = process_step_rewards(algo.process_reward, step_mask, texts,
                                                    with_task(groups.references, self.config.rewards.task))
            counts = allgather_rows(np.array([[step_mask.sum(), groups.size]], np.float64)).sum(axis=0)
            figures["process/steps_per_completion"] = float(counts[0] / max(counts[1], 1))
        baseline = (self.greedy_baseline(sampling_state, groups, figures) if algo.greedy_baseline
                    else np.zeros(self.local_rows, np.float32))
        del sampling_state  # the merged weights (lora.merge_for_sampling) are not needed past sampling
        first_prompt = self.row_offset // self.group_size  # group ids are global: no two processes share one
        group_ids = np.repeat(np.arange(first_prompt, first_prompt + self.local_prompts, dtype=np.int32),
                              self.group_size)
        # In single-update mode nothing here reads the policy's log-probs (that is what the
        # mode requires), so the sampler's stand in for the inputs' old log-probs.
        inputs = AdvantageInputs(
            rewards=self.place(rewards), loss_mask=loss_mask, group_ids=self.place(group_ids),
            old_logps=sampler_logps if old_logps is None else old_logps, ref_logps=ref_logps, old_values=old_values,
            kl_coef=kl_coef, baseline=self.place(baseline), step_rewards=self.place(step_rewards),
            step_mask=self.place(step_mask.astype(np.float32)),
        )
        advantages, returns = self._advantages(inputs)
        rollout = Rollout(tokens=tokens, positions=positions, attention_mask=attention, loss_mask=loss_mask,
                          sampler_logps=sampler_logps, old_logps=old_logps, ref_logps=ref_logps,
                          old_values=old_values, advantages=advantages, returns=returns)
        jax.block_until_ready(rollout)  # so perf/logprob_s times the forward passes, not their dispatch
        t_update = time.perf_counter()

        # ---- updates ----
        order_rng = np.random.default_rng([config.train.seed, rollout_index])
        update_metrics: list[dict[str, float]] = []
        first = None
        epochs_run = 0
        updates_per_rollout = algo.epochs * algo.minibatches
        for epoch in range(algo.epochs):
            epoch_metrics = []
            for index, rows in enumerate(self._minibatch_rows(order_rng)):
                position = rollout_index * updates_per_rollout + epoch * algo.minibatches + index
                minibatch = Minibatch(rollout=rollout.take(self.place(np.sort(rows).astype(np.int32))),
                                      kl_coef=kl_coef, schedule_position=jnp.asarray(position, jnp.int32),
                                      ptx=self.next_ptx_batch())
                state, out = self.update(state, frozen, minibatch)
                metrics = to_host(out.metrics)
                first = first or metrics
                epoch_metrics.append(metrics)
            update_metrics.extend(epoch_metrics)
            epochs_run += 1
            if algo.stop_after_epoch is not None and epoch + 1 < algo.epochs and algo.stop_after_epoch(epoch_metrics):
                log.info("rollout %d: stopping the updates after epoch %d of %d (ppo.target_kl)", rollout_index + 1,
                         epoch + 1, algo.epochs)
                break
        t_end = time.perf_counter()
        if self.logps_from_update:  # one update over every row, in rollout order
            recomputed, entropy = out.rows.logps, out.rows.entropy
            old_logps = recomputed if old_logps is None else old_logps

        # ---- carried state: rollout count and the KL controller ----
        seq_kl, new_coef = None, state.extra["kl_coef"]  # without a reference the coefficient is a fixed 0
        if self.uses_reference:
            seq_kl = host_global(kl_lib.sequence_kl(old_logps, ref_logps, response_mask, kind="k1"), self.mesh)
            new_coef = algo.kl.controller.update(new_coef, float(np.mean(seq_kl)), self.rows)
        state = state._replace(extra={"kl_coef": new_coef, "rollouts": state.extra["rollouts"] + 1})

        figures.update(self._rollout_figures(groups, rewards, seq_kl, old_logps, ref_logps, recomputed, sampler_logps,
                                             response_mask, entropy, advantages))
        if groups.trajectory:
            figures.update(trajectory_figures(self._gathered(groups), figures["perf/generation_s"]))
        for key in update_metrics[0]:
            figures[key] = float(np.mean([m[key] for m in update_metrics]))
        figures["grad_norm_max"] = float(np.max([m["grad_norm"] for m in update_metrics]))
        figures["update_skipped"] = float(np.sum([m["update_skipped"] for m in update_metrics]))
        for key in ("ratio_mean", "ratio_min", "ratio_max", "approx_kl"):
            if key in first:
                figures[f"first_minibatch/{key}"] = first[key]
        figures["epochs_run"] = float(epochs_run)
        figures["kl_coef"] = float(jax.device_get(new_coef.coef))
        train_tokens = float(jax.device_get(jnp.sum(loss_mask))) * epochs_run
        figures["perf/logprob_s"] = t_update - t_fwd
        figures["perf/training_s"] = t_end - t_update
        figures["perf/training_tokens_per_s"] = train_tokens / max(t_end - t_update, 1e-9)
        figures["perf/step_time_s"] = t_end - t_start
        figures.update(self.alarms.update(rollout_index + 1, kl=figures.get("kl/ref_seq"), entropy=figures["entropy"],
                                          length=figures["response/length_mean"],
                                          reward=figures.get("reward/answer", figures["reward/total"])))
        return state, StepOutput(metrics=figures)

    @staticmethod
    def _gathered(groups: Groups) -> Groups:
        """The per-row trajectory counts of every process (multi-turn monitoring)."""
        if jax.process_count() == 1:
            return groups
        return dataclasses.replace(groups, response_mask=allgather_rows(groups.response_mask),
                                   action_mask=allgather_rows(groups.actions()),
                                   trajectory={k: allgather_rows(v) for k, v in groups.trajectory.items()})

    def _rollout_figures(self, groups: Groups, rewards, seq_kl, *device_arrays) -> dict[str, float]:
        """:func:`rollout_figures` over every process's rows: the per-row host values are
        gathered, the device arrays fetched whole (the same figures on every process)."""
        if jax.process_count() > 1:
            groups = dataclasses.replace(  # only these fields are read by rollout_figures
                groups, rewards=allgather_rows(groups.rewards), stopped=allgather_rows(groups.stopped),
                components={k: allgather_rows(v) for k, v in groups.components.items()})
            rewards = allgather_rows(rewards)
        device_arrays = host_global(device_arrays, self.mesh)
        return rollout_figures(groups, rewards, seq_kl, *device_arrays, group_size=self.group_size)

    # ------------------------------------------------------------------ evaluation and export
    def eval_frozen(self) -> None:
        return None

    def has_evaluation(self) -> bool:
        """Whether there are prompts to evaluate on: ``evaluation.prompts`` or an eval split."""
        return self.config.evaluation.prompts is not None or self.data.stats.get("eval", 0) > 0

    def evaluate(self, params, frozen: Any = None) -> dict[str, float]:
        """Generation-based figures (:mod:`alignax.evaluation`: greedy accuracy, pass@k,
        rewards, lengths) on ``evaluation.prompts`` or the eval split, scored like the rollouts."""
        del frozen
        batches = evaluation.prompt_batches(self.config, self.tokenizer, run_data=self.data)
        return evaluation.evaluate_policy(self.sampler, self.sampling_state(params), batches, self.config.evaluation,
                                          seed=self.config.train.seed)

    def export_models(self, params, *, critic: bool = False) -> dict[str, nnx.Module]:
        """``{"": the policy}``, and ``{"critic": ...}`` with ``critic`` (a separate critic)."""
        out = {"": nnx.merge(self.graphdef, self.whole_policy(params), self.rest)}
        if critic:
            if not self.separate_critic:
                raise ValueError("only ppo.critic=separate has a critic model of its own to export "
                                 "(a shared critic is the policy's value head)")
            out["critic"] = nnx.merge(self.critic_graphdef, self.whole_critic(params), self.critic_rest)
        return out

    # ------------------------------------------------------------------ the run
    def train(self) -> TrainResult:
        config = self.config
        state, frozen = self.start()
        batches = self.data.iterator("train")
        console_keys = ("reward/total", "reward/answer", "kl/ref_seq", "entropy", "response/length_mean")
        with Session(config, console_keys=console_keys) as session:
            state, reference = session.resume(state, batches, self.reference)
            frozen, self.reference = self.frozen_inputs(reference), None
            if session.resumed:
                self.alarms.set_state(session.meta.get("alarms", {}))
                if self.ptx is not None:
                    self.ptx.set_state(session.meta["ptx_data"])
            def meta():
                out = {"alarms": self.alarms.state()}
                if self.ptx is not None:
                    out["ptx_data"] = self.ptx.get_state()
                return out

            result = session.run(
                state=state, frozen=frozen, batches=batches, data_stats=self.data.stats,
                step_fn=lambda st, fr, batch: self.rollout_step(st, fr, batch, batches),
                eval_fn=session.reporting_eval(lambda st: self.evaluate(st.params),
                                               step_of=lambda st: st.extra["rollouts"])
                if self.has_evaluation() else None,
                meta_fn=meta, progress=lambda st: st.extra["rollouts"], count_batch_tokens=None,
            )
        policy = nnx.merge(self.graphdef, self.whole_policy(result.state.params), self.rest)
        return TrainResult(config=config, model=policy, tokenizer=self.tokenizer, loop=result,
                           data_stats=dict(self.data.stats))


def generation_figures(seconds: float, tokens: int) -> dict[str, float]:
    return {"perf/generation_s": seconds, "perf/generation_tokens_per_s": tokens / seconds if seconds > 0 else 0.0}
