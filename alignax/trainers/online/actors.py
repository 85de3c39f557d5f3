"""The online run's actors: its models, meshes and where each lives (Tunix's ``RLCluster``
idea: actors apart from the learner).

:class:`Actors` holds the policy (graph, trainable params, the frozen LoRA base), a
separate critic when the algorithm trains one, the frozen reference (built by
:meth:`Actors.initial_reference`, placed by :meth:`Actors.frozen_inputs`), the sampler
(built by :func:`alignax.evaluation.build_sampler`, the one that evaluation uses, with
the rollout's sampling distribution) with its reward models, and the meshes: training,
the sub-mesh of frozen models (``placement.submesh``) and the sampler's
(``rollout.mesh``). Its forward passes (:meth:`Actors.forward`, :meth:`Actors.values`)
give the per-token quantities of a rollout; nothing here updates a parameter.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from flax import nnx

from alignax import evaluation, models
from alignax.config import ConfigError
from alignax.estimators.optimal_token_baseline import token_statistics
from alignax.models import lora as lora_lib
from alignax.models import modeling
from alignax.parallel.multihost import place_rows
from alignax.parallel.placement import move_shards, place, rows_to, split_devices, to_device, twin_mesh
from alignax.parallel.sharding import make_mesh, tree_shardings
from alignax.trainers.config import TrainConfig
from alignax.trainers.engine import adapters, packing
from alignax.trainers.engine.precision import compute_copy, frozen_params
from alignax.trainers.engine.setup import (build_frozen_params, build_meshes, build_model, load_tokenizer,
                                           split_params, split_sampler_devices)
from alignax.trainers.online.algorithm import OnlineAlgorithm
from alignax.trainers.online.rollout import response_forward, response_states


class Actors:
    """The models of an online run and where they run (see the module docstring)."""

    def __init__(self, config: TrainConfig, algorithm: OnlineAlgorithm):
        self.config, self.algorithm = config, algorithm
        rc = config.rollout
        self.prompt_len, self.max_new = config.data.max_prompt_length, rc.max_new_tokens
        self.mesh, self.submesh = build_meshes(config)  # submesh: placement.submesh, or None
        self.submesh_reference = None  # placement.reference: submesh: the reference's params there
        # rollout.async.devices: the sampler's own devices, and the learner device paired with each
        self.sampler_counterpart: dict[jax.Device, jax.Device] | None = None
        self.sampler_mesh = self._sampler_mesh(rc.mesh)
        self.tokenizer = load_tokenizer(config.model)
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
        # lora.merge_for_sampling: the sampler runs the merged model (W + s A B, once per rollout)
        self.merge_sampling = config.lora is not None and config.lora.merge_for_sampling
        self.sampling_graphdef = self.graphdef
        if self.merge_sampling:
            self.sampling_graphdef = lora_lib.merged_graphdef(
                self.graphdef, nnx.merge_state(self.whole_policy(self.initial_params), self.rest))
        # The sampler decodes on its own mesh from a compute-dtype copy of the policy (made
        # by sampling_state); rewards from reward models are computed on the training mesh
        # (on the sub-mesh under placement.reward_models: submesh).
        # An asynchronous schedule samples while the update donates the state: always a copy.
        self.sampler_copies = (self.sampler_mesh is not self.mesh
                               or config.precision.compute_dtype != config.precision.param_dtype
                               or rc.async_.max_staleness > 0)
        self._copy_program = None  # built on first use (it needs the state's structure)
        self.sampler = evaluation.build_sampler(self.sampling_graphdef, self.tokenizer, config,
                                                mesh=self.sampler_mesh, vocab_size=self.model_config.vocab_size,
                                                model_config=self.model_config, rollout=True,
                                                reward_mesh=self.frozen_mesh("reward_models"))
        self.greedy = evaluation.greedy_sampling(config, self.tokenizer)  # ReMax's baseline
        self.forward = jax.jit(self.policy_forward)  # the policy's and the reference's
        # on-policy distillation: the teacher in the reference's place runs its own graph
        self.reference_forward = self.forward if algorithm.teacher is None else jax.jit(self.teacher_forward)
        self.values = jax.jit(self.critic_values)

    # ------------------------------------------------------------------ meshes and placement
    def _sampler_mesh(self, shape) -> jax.sharding.Mesh:
        """The sampler's mesh: ``rollout.mesh`` (``null``: the training mesh's shape) over the
        sampler's own devices under ``rollout.async.devices``; else ``rollout.mesh`` over the
        training mesh's devices (every device, less a sub-mesh's), or the training mesh
        itself when it is null."""
        learner, own = split_sampler_devices(self.config, split_devices(self.config.placement)[0])
        if own is not None:
            self.sampler_counterpart = dict(zip(own, learner))  # both by process: pairs of one process
            shape, where = shape or tuple(self.mesh.devices.shape), f"its own {len(own)} devices (rollout.async.devices)"
        elif shape is None:
            return self.mesh
        else:
            where = f"the same {len(learner)} devices as training"
        try:
            return make_mesh(shape, devices=own or learner)
        except ValueError as err:
            raise ConfigError(f"rollout.mesh={list(shape)}: the sampler's mesh spans {where}: {err}") from None

    def place(self, value: np.ndarray) -> jax.Array:
        """This process's rows of a host array, global on the training mesh."""
        return place_rows(value, self.mesh)

    def frozen_mesh(self, role: str) -> jax.sharding.Mesh:
        """Where the frozen model of ``role`` (``reference`` | ``reward_models``) runs: the
        sub-mesh under ``placement.<role>: submesh``, else the training mesh."""
        return self.submesh if self.config.placement.on_submesh(role) else self.mesh

    # ------------------------------------------------------------------ the trained tree
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

    def export_models(self, params, *, critic: bool = False) -> dict[str, nnx.Module]:
        """``{"": the policy}``, and ``{"critic": ...}`` with ``critic`` (a separate critic)."""
        out = {"": nnx.merge(self.graphdef, self.whole_policy(params), self.rest)}
        if critic:
            if not self.separate_critic:
                raise ValueError("only ppo.critic=separate has a critic model of its own to export "
                                 "(a shared critic is the policy's value head)")
            out["critic"] = nnx.merge(self.critic_graphdef, self.whole_critic(params), self.critic_rest)
        return out

    # ------------------------------------------------------------------ the sampler's weights
    def sampling_state(self, params) -> nnx.State:
        """What the sampler generates with: base + adapters, unmerged, under LoRA (with
        ``lora.merge_for_sampling`` the merged model's weights, computed here once a call);
        with its own mesh or a compute dtype other than the parameters', a copy with kernels
        in the compute dtype laid out on the sampler's mesh (:func:`compute_copy`), made from
        ``params`` at each call (each rollout, after the previous rollout's updates). Under
        ``rollout.async.devices`` the copy program lays it out as on the sampler's mesh but
        on the learner's devices (:func:`twin_mesh`), and each shard is then copied to its
        sampler device (:func:`move_shards`: device to device, no host round trip)."""
        state = nnx.merge_state(self.whole_policy(params), self.rest)
        if self.merge_sampling:
            state = lora_lib.merged_state(self.graphdef, state)
        if not self.sampler_copies:
            return state
        paired = self.sampler_counterpart
        if self._copy_program is None:
            laid_out = self.sampler_mesh if paired is None else twin_mesh(self.sampler_mesh, paired)
            self._copy_program = compute_copy(self.config.precision.compute_dtype, tree_shardings(state, laid_out))
        copy = self._copy_program(state)
        return copy if paired is None else move_shards(copy, self.sampler_mesh, {v: k for k, v in paired.items()})

    # ------------------------------------------------------------------ the frozen reference
    def initial_reference(self, initial_params) -> Any:
        """The reference a run starts from and saves once (``None`` without a KL): with LoRA
        the adapters switched off; under ``placement.reference: submesh`` the same weights
        built on the sub-mesh; else the initial policy params in ``precision.frozen_dtype``."""
        if self.algorithm.teacher is not None:  # on-policy distillation: the teacher, where the reference would be
            return self.algorithm.teacher.build(self.frozen_mesh("reference"))
        if not self.algorithm.kl.uses_reference:
            return None
        initial = self.policy_params(initial_params)
        if self.base is not None:
            return adapters.reference_adapters(initial)
        if self.config.placement.on_submesh("reference"):  # built there: the same weights, other devices
            return build_frozen_params(self.config.model, kind=self.algorithm.policy_kind, mesh=self.submesh,
                                       precision=self.config.precision)
        return frozen_params(initial, self.config.precision)

    def frozen_inputs(self, reference) -> dict[str, Any]:
        """``frozen`` of the update: the reference when the KL is on and, with LoRA, the base
        (the reference is then that base with the adapters off, on the same buffers; a
        distillation teacher is a model of its own, placed beside the base). Under
        ``placement.reference: submesh`` the reference stays here (:meth:`reference_logps`
        runs it on the sub-mesh) and the update gets none."""
        teacher = self.algorithm.teacher is not None
        if self.base is not None and not teacher:
            return adapters.frozen_base(self.base, reference)
        frozen = adapters.frozen_base(self.base, None)  # {"base": ...} with LoRA, else {}
        if reference is not None and self.config.placement.on_submesh("reference"):
            self.submesh_reference = reference
            return frozen
        if reference is None:
            return frozen
        return {**frozen, "reference": place(reference, self.config.placement.reference)}

    def reference_logps(self, frozen, sequences: tuple[np.ndarray, ...], placed: tuple[jax.Array, ...]) -> jax.Array:
        """The reference's log-probs of the rollout's response tokens, ``[R, N]`` on the
        training mesh: from ``frozen["reference"]`` on the full sequences ``placed`` on the
        training mesh, or on the sub-mesh (the host ``sequences`` placed there) and brought back."""
        if self.submesh_reference is None:
            return self.reference_forward(frozen["reference"], *placed)[0]
        submesh = self.frozen_mesh("reference")
        on_submesh = [place_rows(a, submesh) for a in sequences]
        return rows_to(self.mesh, self.reference_forward(self.submesh_reference, *on_submesh)[0])

    # ------------------------------------------------------------------ forward passes
    def policy_forward(self, policy_params, tokens, positions, attention):
        """``(log-probs, entropy, shared-head values or None)`` of the response window,
        each ``[R, N]``. The params are moved into device memory first: a no-op for the
        policy's, and the reference's under ``placement.reference: host`` (held in host
        memory between uses)."""
        model = nnx.merge(self.graphdef, to_device(policy_params), self.rest)
        return response_forward(model, tokens, positions, attention, prompt_len=self.prompt_len,
                                temperature=self.config.rollout.temperature,
                                chunk_size=self.config.model.logprob_chunk_size, group=self.pack_group)

    @functools.cached_property
    def token_statistics(self):
        """A jitted ``(policy params, tokens, positions, attention) -> (log pi(y) [R, N],
        sum_v pi(v)^2 [R, N])``: the sampled token's log-prob and ``sum_v pi(v)^2`` of the
        policy's next-token distribution (at the sampling temperature) at each response
        position, from the same logits: the optimal token baseline's per-token inputs
        (:func:`alignax.estimators.optimal_token_baseline.token_statistics`). The forward is
        :meth:`policy_forward`'s (packed under ``rollout.pack_groups`` as that one is), and the
        logits come ``model.logprob_chunk_size`` positions at a time, never the whole ``[R, N, V]``."""
        temperature, prompt_len = self.config.rollout.temperature, self.prompt_len
        chunk, group = self.config.model.logprob_chunk_size, self.pack_group

        def per_token(policy_params, tokens, positions, attention):
            model = nnx.merge(self.graphdef, to_device(policy_params), self.rest)
            hidden, _ = response_states(model, tokens, positions, attention, prompt_len=prompt_len, group=group)
            targets = tokens[:, prompt_len:]
            stat = lambda h, y: token_statistics(model.logits(h), y, temperature=temperature)  # noqa: E731
            return modeling.map_time_chunks(stat, hidden, targets, chunk_size=chunk)

        return jax.jit(per_token)

    def teacher_forward(self, teacher_params, tokens, positions, attention):
        """:meth:`policy_forward` of on-policy distillation's teacher (``algorithm.teacher``:
        its own graph and size), from device or host memory like the reference's."""
        model = self.algorithm.teacher.model(to_device(teacher_params))
        return response_forward(model, tokens, positions, attention, prompt_len=self.prompt_len,
                                temperature=self.config.rollout.temperature,
                                chunk_size=self.config.model.logprob_chunk_size, group=self.pack_group)

    def critic_values(self, critic_params, tokens, positions, attention):
        """A separate critic's values at the positions that predict each response token, ``[R, N]``."""
        critic = nnx.merge(self.critic_graphdef, critic_params, self.critic_rest)
        return critic(tokens, positions, attention).values[:, self.prompt_len - 1 : -1]
