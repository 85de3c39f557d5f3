"""Will it fit? Per-device memory and per-step FLOPs of a recipe, before a pod is booked.

``alignax estimate CONFIG [--devices N] [--device-memory GB] [--mesh d,f,t] [--model NAME]
[--assumptions standard|seed] [--json]`` prints, per device: the trained model's weights,
gradients, optimiser moments and float32 master copy; the frozen models (reference, the
models that score the rollout: reward models, process reward models, a judge) and PPO's
critic; activations under the config's remat setting and micro-batch; the chunked LM-head
buffers; the rollout's KV cache, decode buffers, gathered weights and
the sampler's compute-dtype copy (a program of its own: the total counts the larger of the
rollout's and the update's temporaries beside the states); the optimal token baseline's
logits (``sum pi^2 logits``: its pass over the rollout is a third program, counted the same
way); the total against the device's
memory, with a "does not fit; try ..." line naming the cheapest change that fits. It also
gives the FLOPs of one step (policy update, reference and critic passes, generation; the
collector's old-log-prob pass, "policy forward", only where the trainer runs it: not in
single-update mode, :func:`alignax.trainers.online.collect.single_update`) and the time
they take at a stated MFU.

Accounting (``standard``): every array at its dtype, sharded ``fsdp x tensor`` ways
(replicated over ``data``); gradients have the parameters' dtype; Adam keeps two moments
(the first in ``precision.mu_dtype``, the second float32) and, for bfloat16 parameters with
a float32 master, a float32 copy. ``seed`` reproduces the rule of thumb of seed 001 §9.2 (bf16
weights, a float32 master, Adam moments at 2 bytes, no gradients, frozen models in bf16):
it leaves out the gradients and counts moments at half their size, so it is lower than
``standard`` (for a 7B model PPO ~170 GB against ~240 GB; see the README).

LoRA (the ``lora`` section): the trained weights, their gradients, moments and master copy
are the adapters' (:func:`alignax.models.lora.adapter_parameter_count`); the base is one
frozen copy in ``precision.frozen_dtype`` ("frozen base"), and the reference is that same
base with the adapters off (nothing more). QLoRA (``lora.quantize``): the seven
projections of the base at 1 (int8) or 1/2 (nf4) byte a weight plus a float32 scale per
``lora.quant_block_size`` weights; embeddings, norms and an untied LM head in the frozen
dtype. PPO's ``critic: adapter``: the critic's trained weights are its own adapter (on the
decoder's projections; a value model has no LM head) and value head, on the same frozen
base. The update's backward pass still carries
activation gradients through the base (``4 N`` FLOPs per token) but computes no weight
gradient for it.

Placement: models held in host memory (``placement.*: host``) are host lines, not in the
device total; models on devices of their own (``placement.*: submesh``) leave the training
devices' items for a second set, per sub-mesh device (their shards and their forward
pass's peak), and ``devices`` then counts the sub-mesh's devices as well.

Activations are an estimate (the compiler decides what it keeps): with remat, each
layer's input is kept and one layer's working set is live; without, every layer's
working set, over the rows the step runs (a DPO pair, or a GRPO/PPO group under
``rollout.pack_groups``, is one packed row holding its prompt once). The states (weights,
gradients, moments, master, frozen models) are exact. The per-token working set and the
transient terms (LM-head buffers, weights gathered whole under FSDP, the optimiser's
update) are calibrated against compiled steps by tools/estimate_vs_compiled.py
(docs/estimate_vs_compiled.json), on XLA:CPU of jaxlib 0.10.2, 0.11.2 and 0.12.1; where those
differ (the LM-head buffers: :data:`LM_HEAD_ARRAYS`) the estimate counts as the installed
jaxlib compiles (``jaxlib=`` picks another) and says which (``Estimate.jaxlib``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from typing import Any

from alignax import estimators
from alignax.models.config import ModelConfig
from alignax.models.lora import adapter_parameter_count, projection_sizes
from alignax.models.quant import quantized_bytes
from alignax.parallel.placement import SUBMESH_ROLES
from alignax.parallel.sharding import logical_to_spec
from alignax.config import NEVER, ConfigError, Given, Is, get
from alignax.trainers.algorithms import algorithm
from alignax.trainers.engine import packing
from alignax.trainers.online.collect import single_update
from alignax.trainers.validation import LIVE_REFERENCE  # the rule that accepts placement.reference

GB = 1e9

# Dense bf16 peak FLOP/s per device (vendor figures).
PEAK_FLOPS = {"h100": 989e12, "h200": 989e12, "a100": 312e12, "v4": 275e12, "v5e": 197e12, "v5p": 459e12,
              "v6e": 918e12}
# Memory per device (GB).
DEVICE_MEMORY = {"h100": 80.0, "h200": 141.0, "a100": 80.0, "v4": 32.0, "v5e": 16.0, "v5p": 95.0, "v6e": 32.0}

# Public Hugging Face config.json fields of common models (for recipes whose model folder
# is not on this machine): ``--model llama-2-7b``.
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": {"model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
                   "rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
    "llama-2-70b": {"model_type": "llama", "vocab_size": 32000, "hidden_size": 8192, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
                    "rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
    "llama-3-8b": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                   "rms_norm_eps": 1e-5, "max_position_embeddings": 8192, "rope_theta": 500000.0},
    "qwen2.5-7b": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "num_hidden_layers": 28,
                   "num_attention_heads": 28, "num_key_value_heads": 4, "intermediate_size": 18944,
                   "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "rope_theta": 1000000.0},
}

_BYTES = {"float32": 4, "bfloat16": 2}

# The float32 [rows, chunk, V] arrays the backward pass of one log-prob chunk holds at once,
# per row the compiled step runs, by the jaxlib whose XLA compiles it: ``(first jaxlib,
# log-probs alone, log-probs and the entropy)``. Read from the compiled steps' buffer
# assignments (``XLA_FLAGS=--xla_dump_to``; docs/jax-versions.md). Before 0.12: the
# recomputed logits and their softmax (2); with the entropy, the logits, the two softmaxes
# (log-prob and entropy) and their product, the cotangent then written over the logits (4).
# From 0.12, XLA:CPU's YNNPACK fusions take in the elementwise work around a dot: the
# softmax's exponential is computed inside the logits' dot, so the logits are never written
# apart (1); the entropy's cotangent becomes a YNNPACK fusion with a reduction, whose output
# cannot be written over the logits it reads and whose [rows, chunk] scale operand is
# broadcast to the full shape first (5). alignax's code is the same on all three.
LM_HEAD_ARRAYS = (((0, 10), 2, 4), ((0, 12), 1, 5))
# The float32 [rows, chunk, V] arrays the optimal token baseline's pass (log pi(y) and
# sum_v pi(v)^2 of each position, alignax.estimators.optimal_token_baseline.token_statistics)
# holds per chunk: the logits and the two exponentials of its two logsumexps. Read from the
# compiled pass's memory_analysis() on jaxlib 0.10.2 (3.03 with its per-row outputs, chunked
# or whole); not read on other releases.
TOKEN_STATS_ARRAYS = 3
CALIBRATED_JAXLIB = ("0.10.2", "0.11.2", "0.12.1")  # the jaxlib releases the compiled steps were read on


def installed_jaxlib() -> str:
    import jaxlib.version

    return jaxlib.version.__version__


def lm_head_arrays(jaxlib: str) -> tuple[int, int]:
    """``(log-probs alone, log-probs and the entropy)``: how many float32 ``[rows, chunk, V]``
    arrays a log-prob chunk's backward pass holds under jaxlib ``jaxlib`` ("0.12.1";
    :data:`LM_HEAD_ARRAYS`, the newest entry at or before it)."""
    version = tuple(int(x) for x in re.findall(r"\d+", jaxlib)[:2])
    if len(version) < 2:
        raise ValueError(f"jaxlib version {jaxlib!r}: expected a release such as '0.12.1'")
    at_or_before = [entry for entry in LM_HEAD_ARRAYS if entry[0] <= version] or LM_HEAD_ARRAYS[:1]
    return at_or_before[-1][1:]


def parameter_count(model: ModelConfig, *, head: str = "lm") -> int:
    """Parameters of the decoder with an LM head (``head="lm"``; none when tied) or a
    scalar head (``"scalar"``: a reward model or a critic)."""
    D, N, K, H, F, V, L = (model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim,
                           model.intermediate_size, model.vocab_size, model.num_layers)
    norm = D * (2 if model.norm_type == "layer" else 1)
    attention = D * N * H + 2 * D * K * H + N * H * D
    if model.qkv_bias:
        attention += N * H + 2 * K * H
    if model.out_bias:
        attention += D
    if model.qk_norm:
        attention += 2 * H
    mlp = (3 if model.gated_mlp else 2) * D * F
    if model.mlp_bias:
        mlp += (2 * F if model.gated_mlp else F) + D
    if model.num_experts:  # a mixture: the router and E gated experts replace the MLP
        mlp = D * model.num_experts + model.num_experts * 3 * D * model.moe_intermediate_size
    total = V * D + L * (attention + mlp + (4 if model.post_norms else 2) * norm) + norm
    if model.position_embedding == "learned":
        total += model.max_position_embeddings * D
    if head == "lm":
        total += 0 if model.tie_word_embeddings else V * D
    else:
        total += D * model.num_labels  # a bias-free score / value head
    return total


@dataclasses.dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of state."""

    params: int  # the trained model's weights
    grads: int | None  # None: not counted (the seed's rule)
    moments: int  # Adam's two moments together
    master: int  # a float32 master copy (0: none)
    frozen: int  # reference / reward models
    compute: int  # activations and the KV cache


SEED = Precision(params=2, grads=None, moments=4, master=4, frozen=2, compute=2)


def precision_of(config) -> Precision:
    """The bytes a run of ``config`` uses (its ``precision`` section,
    :class:`alignax.trainers.engine.precision.PrecisionConfig`)."""
    pc = config.precision
    params = _BYTES[pc.param_dtype]
    master = 4 if params == 2 and pc.master_dtype == "float32" else 0
    return Precision(params=params, grads=params, moments=_BYTES[pc.mu_dtype] + 4, master=master,
                     frozen=_BYTES[pc.frozen], compute=_BYTES[pc.compute_dtype])


@dataclasses.dataclass
class Estimate:
    """Per-device bytes by item, per-step FLOPs, and the verdict."""

    items: dict[str, float]
    flops: dict[str, float]
    devices: int
    mesh: tuple[int, int, int]
    device_memory: float | None
    parameters: int
    assumptions: str
    mfu: float
    peak_flops: float | None
    rollout_tokens: int | None = None
    suggestion: str | None = None
    notes: tuple[str, ...] = ()  # what the figures assume that a run may refuse or that is not calibrated
    online: bool = False
    host: dict[str, float] = dataclasses.field(default_factory=dict)  # per device's shard, in host memory
    # placement.submesh: per device of the sub-mesh (its frozen models and their forward passes)
    submesh: dict[str, float] = dataclasses.field(default_factory=dict)
    submesh_shape: tuple[int, int, int] | None = None
    submesh_flops: tuple[str, ...] = ()  # the FLOPs items that run on the sub-mesh
    jaxlib: str = ""  # the jaxlib whose XLA the LM-head buffers are counted for (LM_HEAD_ARRAYS)

    @property
    def total(self) -> float:
        return float(sum(self.items.values()))

    def update_step_items(self) -> dict[str, float]:
        """The items the compiled update step holds (what ``memory_analysis()`` of the
        trainer's jitted step measures: arguments + outputs - aliased + temporaries): all
        but the rollout's KV cache, and for online runs but the frozen models, which the
        rollout's programs read (the update takes their log-probs)."""
        left_out = (*ROLLOUT_TEMPORARIES, "rollout not live with the update", *TOKEN_STATS_ITEMS)
        if self.online:
            left_out += ("reference", *SCORER_ITEMS)
        return {k: v for k, v in self.items.items() if k not in left_out}

    def rollout_items(self) -> dict[str, float]:
        """The items the rollout's generation program holds (what ``memory_analysis()`` of
        the compiled sampler measures): the weights it samples with (the policy's, or the
        trainer's compute-dtype copy), the KV cache and its buffers (online runs only)."""
        weights = "sampler weights" if self.items.get("sampler weights") else "policy weights"
        keys = (weights, "KV cache", "sampling buffers", "sampler gathered weights")
        return {k: self.items[k] for k in keys if k in self.items}

    @property
    def submesh_total(self) -> float:
        return float(sum(self.submesh.values()))

    @property
    def fits(self) -> bool | None:
        """Whether the training devices' total (and a sub-mesh's, with one) fits a device."""
        if self.device_memory is None:
            return None
        return self.total <= self.device_memory and self.submesh_total <= self.device_memory

    @property
    def step_seconds(self) -> float | None:
        """The step's FLOPs at the stated MFU over every device; with a sub-mesh, the
        training devices' FLOPs over them plus the sub-mesh's over its devices (one after
        the other: the trainers wait for the frozen models' outputs); the scoring models
        loaded whole on the first device (:data:`SCORERS_UNSHARDED`) on that one device, after
        the rest (the rollout waits for their scores)."""
        if not self.peak_flops:
            return None
        rate = self.peak_flops * self.mfu
        alone = self.flops.get(SCORERS_UNSHARDED, 0.0) / rate
        spread = sum(v for k, v in self.flops.items() if k != SCORERS_UNSHARDED)
        if self.submesh_shape is None:
            return spread / (self.devices * rate) + alone
        apart = math.prod(self.submesh_shape)
        frozen = sum(v for k, v in self.flops.items() if k in self.submesh_flops)
        return (spread - frozen) / ((self.devices - apart) * rate) + frozen / (apart * rate) + alone

    def to_dict(self) -> dict[str, Any]:
        return {"per_device_bytes": dict(self.items), "total_bytes": self.total,
                "device_memory_bytes": self.device_memory, "fits": self.fits, "suggestion": self.suggestion,
                "flops_per_step": dict(self.flops), "step_seconds_at_mfu": self.step_seconds, "mfu": self.mfu,
                "devices": self.devices, "mesh": list(self.mesh), "parameters": self.parameters,
                "rollout_tokens": self.rollout_tokens, "assumptions": self.assumptions, "notes": list(self.notes),
                "host_bytes_per_device": dict(self.host),
                "submesh": None if self.submesh_shape is None else list(self.submesh_shape),
                "submesh_bytes_per_device": dict(self.submesh), "submesh_total_bytes": self.submesh_total,
                "jaxlib": self.jaxlib}

    def table(self) -> str:
        lines = [f"{'per device':<28}{'GB':>10}"]
        for name, value in self.items.items():
            if value:
                lines.append(f"  {name:<26}{value / GB:>10.2f}")
        lines.append(f"  {'total':<26}{self.total / GB:>10.2f}")
        for name, value in self.host.items():
            lines.append(f"  {name + ' (host memory)':<26}{value / GB:>10.2f}   not in the total")
        if self.submesh_shape is not None:
            lines.append(f"{'per sub-mesh device':<28}{'GB':>10}   (placement.submesh {list(self.submesh_shape)}: "
                         f"{math.prod(self.submesh_shape)} of the {self.devices} devices)")
            for name, value in self.submesh.items():
                lines.append(f"  {name:<26}{value / GB:>10.2f}")
            lines.append(f"  {'total':<26}{self.submesh_total / GB:>10.2f}")
        if self.device_memory is not None:
            verdict = "fits" if self.fits else "does not fit"
            lines.append(f"  {'device memory':<26}{self.device_memory / GB:>10.2f}   {verdict}")
        if self.suggestion:
            lines.append(self.suggestion)
        lines.extend(f"note: {note}" for note in self.notes)
        training = self.devices - (math.prod(self.submesh_shape) if self.submesh_shape else 0)
        lines.append(f"parameters: {self.parameters / 1e9:.3f} B; mesh (data, fsdp, tensor) = {self.mesh} on "
                     f"{training} devices; accounting: {self.assumptions}")
        if self.rollout_tokens is not None:
            lines.append(f"rollout tokens per step: {self.rollout_tokens:,}")
        flops = sum(self.flops.values())
        parts = ", ".join(f"{k} {v:.3g}" for k, v in self.flops.items() if v)
        lines.append(f"FLOPs per step: {flops:.3g} ({parts})")
        if self.step_seconds is not None:
            lines.append(f"step time at {self.mfu:.0%} MFU: {self.step_seconds:.2f} s")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class _MeshShape:
    """The axis sizes :func:`alignax.parallel.logical_to_spec` reads of a mesh (``.shape``)."""

    shape: Mapping[str, int]


def _mesh(shape: tuple[int, int, int], devices: int) -> tuple[int, int, int]:
    sizes = list(shape)
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh shape {shape}: at most one -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if devices % known:
            raise ValueError(f"mesh shape {shape} does not divide {devices} devices")
        sizes[sizes.index(-1)] = devices // known
    if math.prod(sizes) != devices:
        raise ValueError(f"mesh shape {tuple(sizes)} has {math.prod(sizes)} devices, not {devices}")
    return tuple(sizes)  # type: ignore[return-value]


def _trained(params: int, p: Precision, shard: int) -> dict[str, float]:
    return {"weights": params * p.params / shard, "gradients": params * (p.grads or 0) / shard,
            "optimizer moments": params * p.moments / shard, "master weights": params * p.master / shard}


def _frozen_base_bytes(model: ModelConfig, lora, params: int, frozen_bytes: int) -> float:
    """A LoRA run's frozen base: every weight in the frozen dtype, or under QLoRA the seven
    projections quantised (:func:`alignax.models.quant.quantized_bytes`) and the rest
    (embeddings, norms, an untied LM head) in the frozen dtype."""
    if lora.quantize == "none":
        return params * frozen_bytes
    projections = model.num_layers * sum(i * o for i, o in projection_sizes(model).values())
    return quantized_bytes(projections, lora.quantize, lora.quant_block_size) + (params - projections) * frozen_bytes


def estimate(config, *, model: ModelConfig, devices: int, mesh: tuple[int, int, int] | None = None,
             device_memory_gb: float | None = None, assumptions: str = "standard", mfu: float = 0.4,
             peak_flops: float | None = None, suggest: bool = True, jaxlib: str | None = None) -> Estimate:
    """The estimate of one step of ``config`` (a ``TrainConfig``) for ``model``'s shape on
    ``devices`` devices laid out as ``mesh`` (default: ``config.mesh.shape``); with a model
    on ``placement.submesh``, ``devices`` counts the sub-mesh's too and ``mesh`` lays out
    the rest. ``jaxlib``: the release whose compiler the LM-head buffers are counted for
    (default: the installed one)."""
    jaxlib = jaxlib or installed_jaxlib()
    if assumptions not in ("standard", "seed"):
        raise ValueError(f"assumptions: {assumptions!r} is not one of 'standard', 'seed'")
    placement = config.placement
    on_submesh = {role for role in SUBMESH_ROLES if placement.on_submesh(role)}
    apart = placement.devices_apart
    sub = tuple(placement.submesh) if apart else None
    if apart and apart >= devices:
        raise ValueError(f"placement.submesh={list(sub)} sets {apart} of the {devices} devices apart; training needs "
                         "the rest")
    data, fsdp, tensor = _mesh(tuple(mesh or config.mesh.shape), devices - apart)
    shard = fsdp * tensor
    p = SEED if assumptions == "seed" else precision_of(config)
    entry = algorithm(config.algorithm)
    if entry.estimate_as is not None:  # e.g. iterative DPO: its rounds' training runs
        config = entry.estimate_as(config)
        entry = algorithm(config.algorithm)
    P = parameter_count(model, head=entry.head)
    # the seed's rule counts every model (reward model, critic) at the policy's size
    scalar = P if assumptions == "seed" else parameter_count(model, head="scalar")
    lora = getattr(config, "lora", None)
    if lora is not None and assumptions == "standard":
        adapters = adapter_parameter_count(model, lora)
        items: dict[str, float] = {f"policy {k}": v for k, v in _trained(adapters, p, shard).items()}
        items["frozen base"] = _frozen_base_bytes(model, lora, P, p.frozen) / shard
    else:
        adapters = None
        items = {f"policy {k}": v for k, v in _trained(P, p, shard).items()}
    frozen = P * p.frozen / shard
    teacher = _teacher_model(config, entry)
    if teacher is not None:  # distillation's teacher, held in the reference's place at its own size
        frozen = parameter_count(teacher) * p.frozen / shard
    online = entry.family == "online"
    section = getattr(config, entry.sections[0])
    live = entry.reference(config) and not entry.precomputed_reference(config)
    uses_reference = live or (assumptions == "seed" and entry.reference is not NEVER)
    # LoRA's reference is the base with the adapters off (no second copy); a teacher is a model of its own
    separate_reference = adapters is None or teacher is not None
    items["reference"] = frozen if uses_reference and separate_reference else 0.0
    notes: list[str] = []
    if assumptions == "seed":  # the seed's GRPO/PPO count one reward model at the policy's size
        scorers = [_Scorer("reward models", scalar, P - model.vocab_size * model.hidden_size)] * (
            max(len(config.rewards.reward_models or ()), 1) if online else 0)
    else:
        scorers = _scorers(config, model, entry, notes) if online else []
    items.update(_scorer_items(scorers, p.frozen / shard, p.frozen))
    # placement: host (alignax.parallel.placement): held in pinned host memory, each device's
    # shard of it. A frozen model's device copy lives only while the program that runs it
    # does (not counted: how much of it is live at once is the compiler's scheduling); the
    # optimiser state comes back for the update after the backward pass and is counted
    # there (``moved_in``, in "optimizer update").
    # placement: submesh: on the sub-mesh's devices, sharded over its fsdp x tensor
    host, submesh = {}, {}
    # (rewards.prm is loaded on the reward models' mesh, never held in host memory)
    for key, name in (("reference", "reference"), ("reward_models", "reward models"),
                      ("reward_models", "process reward models")):
        if name != "process reward models" and getattr(config.placement, key) == "host" and items.get(name):
            host[name], items[name] = items[name], 0.0
        if key in on_submesh and items.get(name):
            submesh[name], items[name] = items[name] * shard / (sub[1] * sub[2]), 0.0
    critic_on_base = entry.critic_on_base(config)
    critic = entry.critic(config) or (assumptions == "seed" and entry.critic is not NEVER)
    critic_trained = scalar
    if critic_on_base and adapters is not None:
        # ppo.critic=adapter: its own adapter on the policy's frozen base (no second base;
        # a value model has no LM head to adapt) and a value head
        critic_trained = adapter_parameter_count(model, lora, lm_head=False) + model.hidden_size
    if critic:
        for key, value in _trained(critic_trained, p, shard).items():
            items[f"critic {key}"] = value
    moved_in = 0.0  # placement.optimizer_state: host: the state the update moves back in
    if config.placement.optimizer_state == "host":
        for name in [k for k in items if k.endswith(("optimizer moments", "master weights")) and items[k]]:
            host[name], items[name] = items[name], 0.0
            moved_in += host[name]

    # ---- activations, LM head, KV cache (per device)
    accum = config.train.grad_accum_steps
    if online:
        samples = config.rollout.num_samples
        rows = config.data.batch_size * samples
        minibatches = section.minibatches
        length = config.data.max_prompt_length + config.rollout.max_new_tokens
        train_rows = rows / minibatches / accum
        # the policy's forward packs each group of G rows into one row, the prompt once
        # (rollout.pack_groups; the trainer's own rule)
        group = packing.packed_group_size(config, dataclasses.replace(model, attention=config.model.attention),
                                          minibatches=minibatches, batch_devices=data * fsdp)
        policy_rows = train_rows / group
        policy_length = config.data.max_prompt_length + group * config.rollout.max_new_tokens
    else:
        rows = config.data.batch_size * entry.rows_per_record(config)  # a pair's two rows; KTO's KL partner
        length = config.data.max_length
        train_rows = rows / accum
        policy_rows, policy_length = train_rows, length
        window = config.data.max_response_length
        if entry.packs_pairs(config) and packing.pair_packs(
                config.model.attention, row_length=length, window=window):
            # a preference pair is one packed row: the prompt once, then both responses
            policy_rows, policy_length = train_rows / 2, packing.packed_width(length, 2, window)

    def rows_per_device(global_rows: float) -> float:
        """The rows of a ``[rows, ...]`` batch each device runs: the rows split over the
        ``data`` and ``fsdp`` axes that divide them, replicated over those that do not
        (alignax.parallel's logical-axis rule drops a mesh axis that does not divide a dim;
        e.g. 4 packed PPO groups on 8 devices: every device runs all 4)."""
        if global_rows != int(global_rows):
            return global_rows / (data * fsdp)
        spec = logical_to_spec(("batch",), (int(global_rows),), _MeshShape({"data": data, "fsdp": fsdp}))
        axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],) if spec[0] else ()
        return global_rows / math.prod({"data": data, "fsdp": fsdp}[a] for a in axes)

    per_device_rows = rows_per_device(train_rows)
    batch_devices = data * fsdp
    placed = {"data.batch_size": config.data.batch_size}  # the rows of each array a step places
    if online:
        placed["rollout rows"] = int(rows)
    apart_rows = [f"{name} {n}" for name, n in placed.items() if n % batch_devices]
    if apart_rows:
        notes.append(f"{' and '.join(apart_rows)}: not a multiple of the {batch_devices} batch devices (data x fsdp); "
                     "one process places such rows whole on every device, several processes refuse the batch "
                     "(alignax.parallel.multihost.place_local_batch); and these figures are not calibrated for "
                     "rows that run whole (SmolLM2's shape on 16 devices: DPO 1.8x and PPO 1.3x the compiled "
                     "step): a batch of at least one row per batch device is the layout to plan with")
    D, V, L = model.hidden_size, model.vocab_size, model.num_layers
    # a mixture runs every expert on every token (alignax.models.moe): its MLP arrays are
    # [tokens, E, moe_intermediate_size] where a dense MLP's are [tokens, F]
    F = model.num_experts * model.moe_intermediate_size if model.num_experts else model.intermediate_size
    heads = model.num_heads / tensor
    q_width, kv_width = model.num_heads * model.head_dim / tensor, model.num_kv_heads * model.head_dim / tensor
    # float32 scores and probabilities, unless a fused kernel keeps only its [B, N, T] statistics
    fused = config.model.attention in ("cudnn", "splash")
    # F-sized arrays a layer keeps without remat: gated, the up and gate outputs, the
    # gate's sigmoid and activation, their product and one more (6, as the compiled steps'
    # scanned residuals show); plain, the up output, its activation and its derivative's
    # input (3, not measured)
    mlp_arrays = 6 if model.gated_mlp else 3
    # a mixture's [tokens, E, F] arrays: also the routing weights' product and its gradient's
    # inputs (11 per layer, read from compiled SFT steps of the toy mixture at E x F = 1024:
    # remat none 5.0 more than 6 a layer, remat full 3.7 more in the recomputed layer)
    mlp_arrays = 11 if model.num_experts else mlp_arrays

    def layer_set_of(device_rows: float, row_length: int) -> tuple[float, float]:
        """``(one layer's working set, its attention scores)`` over ``device_rows`` rows of
        ``row_length`` tokens."""
        tokens = device_rows * row_length
        scores = 0.0 if fused else device_rows * heads * row_length * row_length * 4
        # D-sized: the layer input, its norms' inputs and outputs, the residual stream, the
        # attention and MLP outputs (8); q and the attention output; k and v
        return tokens * (8 * D + 2 * q_width + 2 * kv_width + mlp_arrays * F / tensor) * p.compute + 2 * scores, scores

    def layer_activations(device_rows: float, row_length: int) -> float:
        """What the layers keep for the backward pass of one forward over ``device_rows``
        rows of ``row_length`` tokens: every layer's saved set under the remat policy, and
        the rest of one layer's working set while it is recomputed."""
        tokens = device_rows * row_length
        layer_set, scores = layer_set_of(device_rows, row_length)
        projections = tokens * (2 * D + q_width + 2 * kv_width + 2 * F / tensor) * p.compute  # q k v o gate up down
        inputs = tokens * D * p.compute
        saved = {"none": layer_set, "full": inputs,  # per layer, kept for the backward pass
                 "dots_with_no_batch_dims_saveable": inputs + projections,
                 "dots_saveable": inputs + projections + scores,
                 "offload_dots": inputs}  # the projections wait in host memory
        kept = min(saved[config.model.remat], layer_set)
        # a mixture's float32 router probabilities [L, rows, T, E] leave the layer stack for
        # the load-balancing loss, whatever the remat policy
        router = L * tokens * model.num_experts * 4
        return L * kept + (layer_set - kept) + router

    # Packed rows (DPO pairs, online groups) are counted as the compiled steps run them:
    # fewer, longer rows. A separate critic runs its own forward and backward in the same
    # update, over the unpacked rows (its values are read per row).
    items["activations"] = layer_activations(rows_per_device(policy_rows), policy_length)
    if critic and assumptions == "standard":
        items["activations"] += layer_activations(per_device_rows, length)
    # float32 logits of one chunk of positions (alignax.models.token_logprobs_from_hidden;
    # the chunk is recomputed in the backward pass): the [rows, chunk, V] arrays live at once
    # for log-probs alone (offline; over the rows the step runs, a packed DPO pair one) or
    # with the entropy (the online loss), as many as jaxlib's XLA writes (LM_HEAD_ARRAYS).
    # Online updates score the response positions only.
    scored = config.rollout.max_new_tokens if online else length
    chunk = min(config.model.logprob_chunk_size or scored, scored)
    logprob_arrays, entropy_arrays = lm_head_arrays(jaxlib)
    lm_rows, arrays = (per_device_rows, entropy_arrays) if online else (rows_per_device(policy_rows), logprob_arrays)
    items["LM head buffers"] = lm_rows * chunk * V * 4 * arrays / tensor
    if jaxlib.split(".")[:2] not in [v.split(".")[:2] for v in CALIBRATED_JAXLIB]:
        notes.append(f"the LM-head buffers are counted as jaxlib {jaxlib}'s XLA would be by the releases before it; "
                     f"the terms were read from compiled steps of jaxlib {', '.join(CALIBRATED_JAXLIB)} "
                     "(tools/estimate_vs_compiled.py)")
    # Under FSDP a weight is all-gathered whole where it is used: the embedding or LM head
    # for the logits, and one layer at a time in the scan (models run one after another,
    # so one model's layer at a time), in the dtype they are stored in. The gathered head is
    # not alone when it arrives: XLA also holds a second whole copy of it (a copy in the
    # layout or compute dtype the logits' dot reads, or under remat a second all-gather for
    # the backward pass), and a live reference's gathered head (DPO). The LM-head buffers
    # come after those are freed, so the head costs the larger of two moments: two whole
    # heads (three with a live reference), or one head beside the LM-head buffers. Read
    # from the compiled steps' buffers on 8 devices: SmolLM2's shape peaks at that moment
    # with 3 whole float32 heads live for DPO (policy, its copy, the reference) and 2 for
    # PPO; the 7B DPO step on 64 devices with 2.5 (two all-gathers of the head and its
    # bfloat16 cast); the tiny recipes peak at the logits.
    if shard > 1 and assumptions == "standard":
        embedding = V * D
        layer = (P - embedding * (1 if model.tie_word_embeddings else 2)) / L
        stored = p.frozen if adapters is not None else p.params
        head = embedding * stored / tensor
        live_reference = uses_reference and separate_reference and not online and "reference" not in submesh
        held = 2 * head + (embedding * p.frozen / tensor if live_reference else 0.0)
        # A third moment: the head's gradient, written whole before its reduce-scatter, beside
        # the gathered head and the last chunk's cotangent (one of the chunk's arrays). It is
        # the peak where the chunk holds few arrays: jaxlib 0.12's one for log-probs (DPO
        # with its reference on a 4-device sub-mesh: 0.75 of the compiled step without it,
        # 0.93 with), and it moves eleven jaxlib 0.10.2 rows up by 0.2-3.2 points
        # (SmolLM2's shape on 4-16 devices, 7B GRPO/PPO on 64), none past 0.96.
        lm_buffers = items["LM head buffers"]
        with_gradient = 2 * head + lm_buffers / arrays if adapters is None else 0.0
        items["gathered weights"] = layer * stored / tensor + max(head, held - lm_buffers, with_gradient - lm_buffers)
    # The optimiser's step holds float32 temporaries beside the gradients, one trained
    # weights' worth (Adam's update; the compiled steps under full remat peak there with
    # exactly gradients + 1x: SmolLM2's shape on one device, the 7B steps on 8 devices),
    # and, with the optimiser state in host memory, the state it moves back in for the
    # update. The two phases do not overlap: the gradients and the update exist once the
    # backward pass has let go of the activations, the LM-head buffers and the gathered
    # weights, so the step peaks at the larger set, and the smaller one is taken back off
    # the total ("not live at once"). (Under the step's non-finite guard as a select, XLA
    # copied the donated Adam moments at the start and held the copies at the peaks;
    # the guard is a conditional now and updates them in place: alignax/trainers/engine/step.py.)
    if assumptions == "standard":
        trained = (adapters if adapters is not None else P) + (critic_trained if critic else 0)
        items["optimizer update"] = trained * 4 / shard + moved_in
        passes = items["activations"] + items["LM head buffers"] + items.get("gathered weights", 0.0)
        optimiser_step = items["optimizer update"] + sum(v for k, v in items.items() if k.endswith("gradients"))
        items["not live at once"] = -min(passes, optimiser_step)
    rollout_tokens = None
    if online:
        # the rollout's own program, on the sampler's mesh (rollout.mesh, or the training mesh)
        r_data, r_fsdp, r_tensor = (_mesh(tuple(config.rollout.mesh), devices - apart) if config.rollout.mesh
                                    else (data, fsdp, tensor))
        kv_rows = rows / (r_data * r_fsdp)
        items["KV cache"] = kv_rows * length * L * 2 * (model.num_kv_heads / r_tensor) * model.head_dim * p.compute
        rollout_tokens = int(rows * config.rollout.max_new_tokens)
        if assumptions == "standard":
            items.update(_rollout_items(config, model, p, (r_data, r_fsdp, r_tensor), rows=rows, params=P))
            # the rollout and the update are programs of their own: the device holds the
            # larger of the two sets of temporaries beside the states, not both
            rollout = sum(items[k] for k in ROLLOUT_TEMPORARIES)
            update = (items["activations"] + items["LM head buffers"] + items.get("gathered weights", 0.0)
                      + items["optimizer update"] + sum(v for k, v in items.items() if k.endswith("gradients"))
                      + items["not live at once"])
            items["rollout not live with the update"] = -min(rollout, update)
            if hasattr(section, "advantage") and estimators.estimator(estimators.effective_name(section)).token_stats:
                # the optimal token baseline's pass, a program of its own when the rollout is
                # priced: over every rollout row at once (groups unpacked at the head), a chunk
                # of positions of logits at a time; the device holds the largest of the three
                # programs' temporaries beside the states
                scored = config.rollout.max_new_tokens
                chunk = min(config.model.logprob_chunk_size or scored, scored)
                logits = TOKEN_STATS_ARRAYS * rows_per_device(rows) * chunk * V * 4 / tensor
                items["sum pi^2 logits"] = logits
                items["sum pi^2 not live with the others"] = -min(logits, max(rollout, update))

    if submesh:
        # the reference runs on every row of the step (online: of the rollout) at once, packed as the policy's are
        packed_rows = policy_rows * accum * (minibatches if online else 1)
        # the positions a row scores: G responses of a packed group, a packed pair's two windows
        scored_per_row = (group * config.rollout.max_new_tokens if online
                          else policy_length if not entry.packs_pairs(config)
                          else 2 * window if policy_rows != train_rows else length)
        submesh.update(_submesh_forward(config, model, p, sub, submesh, rows=rows,
                                        packed=(packed_rows, policy_length, scored_per_row),
                                        online=online, length=length,
                                        layer_set=lambda r, n: layer_set_of(r, n)[0], params=P))

    # ---- FLOPs of one step (all devices)
    non_embedding = P - V * model.hidden_size
    attention = 12 * L * D * length  # per token: scores and values, forward + backward
    # per trained token: forward 2N, activation gradients 2N, weight gradients 2N (adapters only under LoRA)
    update = 6 * non_embedding if adapters is None else 4 * non_embedding + 6 * adapters
    # the frozen model's forward at its own size (distillation's teacher, in the reference's place)
    frozen_non_embedding = (non_embedding if teacher is None
                            else parameter_count(teacher) - teacher.vocab_size * teacher.hidden_size)
    if online:
        trained_tokens = rows * length * section.epochs
        # once in the collector, or once an epoch inside the update (on-policy distillation's exact loss)
        reference_passes = section.epochs if entry.reference_in_update(config) else 1
        # the collector's pass for the old log-probs; none in single-update mode, where the
        # update's own forward supplies them (the trainer's rule, on the algorithm it builds)
        priced = not single_update(config, entry.make(config))
        flops = {"policy update": trained_tokens * (update + attention),
                 "generation": 2 * non_embedding * rows * length,
                 "policy forward": 2 * non_embedding * rows * length if priced else 0.0,
                 "reference forward": (2 * frozen_non_embedding * rows * length * reference_passes
                                       if uses_reference else 0.0)}
        if hasattr(section, "advantage") and estimators.estimator(estimators.effective_name(section)).token_stats:
            flops["sum pi^2 forward"] = 2 * non_embedding * rows * length  # the estimator's per-token statistic
        if critic:
            critic_update = 6 * non_embedding if not critic_on_base or adapters is None else (
                4 * non_embedding + 6 * critic_trained)
            flops["critic update"] = trained_tokens * (critic_update + attention)
            flops["critic forward"] = 2 * non_embedding * rows * length
        flops.update(_scorer_flops(scorers, config, rows=rows, length=length))
    else:
        trained_tokens = rows * length
        flops = {"policy update": trained_tokens * (update + attention),
                 "reference forward": 2 * frozen_non_embedding * trained_tokens if uses_reference else 0.0}

    if teacher is not None:
        notes.append(f"the reference rows are the teacher's ({parameter_count(teacher):,} parameters); its whole "
                     "[rows, window, vocab] logits, the student's and the divergence's are not counted")
    memory = device_memory_gb * GB if device_memory_gb is not None else None
    result = Estimate(items=items, flops=flops, devices=devices, mesh=(data, fsdp, tensor), device_memory=memory,
                      parameters=P, assumptions=assumptions, mfu=mfu, peak_flops=peak_flops,
                      rollout_tokens=rollout_tokens, online=online, host=host, submesh=submesh, submesh_shape=sub,
                      notes=tuple(notes), jaxlib=jaxlib,
                      submesh_flops=tuple(k for k, role in (("reference forward", "reference"),
                                                            ("reward models", "reward_models")) if role in on_submesh))
    if suggest and result.fits is False:
        result.suggestion = _suggestion(config, model, result, assumptions=assumptions, mfu=mfu, peak_flops=peak_flops,
                                        jaxlib=jaxlib)
    return result


# the models that score a rollout (alignax.rewards): the reward models and rewards.prm on the
# reward models' mesh (placement.reward_models), sharded; a judge model and grpo.process_reward_model
# whole on the first device (they are loaded without a mesh)
SCORERS_UNSHARDED = "scoring models on the first device"
SCORER_ITEMS = ("reward models", "process reward models", SCORERS_UNSHARDED)


@dataclasses.dataclass(frozen=True)
class _Scorer:
    """A model that scores rollouts: its item of :data:`SCORER_ITEMS`, its size, and whether
    it scores the gold prompts (``monitor.gold``) rather than every rollout."""

    item: str
    parameters: int
    non_embedding: int
    gold: bool = False


def _scorers(config, model: ModelConfig, entry, notes: list[str]) -> list[_Scorer]:
    """The scoring models an online run of ``config`` loads, each at its own size (read from
    its folder or registry name; a folder not on this machine counts at the policy's shape,
    said in ``notes``): ``rewards.reward_models``, ``rewards.prm`` and ``rewards.judge_model``,
    the same of ``monitor.gold.rewards`` when the gold signal is on, and the entry's own
    (``entry.scorers``: GRPO's ``grpo.process_reward_model``)."""
    wanted = []
    sources = [(config.rewards, False)]
    if config.monitor.gold.prompts is not None:
        sources.append((config.monitor.gold.rewards, True))
    for rewards, gold in sources:
        wanted += [("reward models", path, "scalar", gold) for path in rewards.reward_models or ()]
        wanted += [("process reward models", rewards.prm, "scalar", gold)] if rewards.prm else []
        wanted += [(SCORERS_UNSHARDED, rewards.judge_model, "lm", gold)] if rewards.judge_model else []
    if isinstance(entry.scorers, Given) and entry.scorers(config):
        wanted.append((SCORERS_UNSHARDED, get(config, entry.scorers.path), "scalar", False))
    out = []
    for item, name, head, gold in wanted:
        try:
            shape = model_config_for(dataclasses.replace(config, model=dataclasses.replace(
                config.model, name=name, random_init=None)))
        except (ConfigError, OSError, ValueError):
            shape = model
            notes.append(f"{name}: no model folder here to read its shape; counted at the policy's")
        params = parameter_count(shape, head=head)
        out.append(_Scorer(item, params, params - shape.vocab_size * shape.hidden_size, gold))
    return out


def _scorer_items(scorers: list[_Scorer], sharded: float, whole: float) -> dict[str, float]:
    """Per device, the bytes of the scoring models by item (``reward models`` always, 0 without):
    ``sharded`` bytes a parameter on the reward models' mesh, ``whole`` on the first device."""
    out = {}
    for item in SCORER_ITEMS:
        mine = [s.parameters for s in scorers if s.item == item]
        if mine or item == "reward models":
            out[item] = sum(mine) * (whole if item == SCORERS_UNSHARDED else sharded)
    return out


def _scorer_flops(scorers: list[_Scorer], config, *, rows: float, length: int) -> dict[str, float]:
    """The scoring models' forward FLOPs a step: over every rollout row, ``reward models`` for
    those on the reward models' mesh, :data:`SCORERS_UNSHARDED` for those run on the first
    device (a judge's rubric tokens are not counted); the gold signal's, ``max_prompts``
    greedy completions every ``every`` rollouts, averaged over the steps."""
    gold = config.monitor.gold
    gold_rows = min(gold.max_prompts, rows) / gold.every
    out: dict[str, float] = {}
    for s in scorers:
        item = "gold scoring" if s.gold else "reward models" if s.item != SCORERS_UNSHARDED else SCORERS_UNSHARDED
        out[item] = out.get(item, 0.0) + 2 * s.non_embedding * (gold_rows if s.gold else rows) * length
    return out


# what the rollout's program holds beside the states (the update's own program holds none of it)
ROLLOUT_TEMPORARIES = ("sampler weights", "KV cache", "sampling buffers", "sampler gathered weights")
# the optimal token baseline's pass (TOKEN_STATS_ARRAYS): neither the rollout's program nor the update's
TOKEN_STATS_ITEMS = ("sum pi^2 logits", "sum pi^2 not live with the others")


def _rollout_items(config, model: ModelConfig, p: Precision, mesh: tuple[int, int, int], *, rows: float,
                   params: int) -> dict[str, float]:
    """Per device, what the rollout's generation holds beyond the states and its KV cache
    (read from the compiled sampler, ``alignax.sampling.generate``, tools/estimate_vs_compiled.py
    ``--rollout``): a copy of the policy in the compute dtype on the sampler's mesh when the
    trainer makes one (a compute dtype other than the parameters', or ``rollout.mesh``); the
    decode step's buffers, six ``[rows, V]`` float32 arrays (the logits and the sampler's
    work on them: tempered, log-softmax, noise, the untempered log-prob) and the ``[rows, N]``
    token and log-prob buffers; and under FSDP one layer and, as measured, two and a half
    whole embedding-sized heads gathered (the token lookup and the LM head, each step)."""
    r_data, r_fsdp, r_tensor = mesh
    shard = r_fsdp * r_tensor
    device_rows = rows / (r_data * r_fsdp)
    pc = config.precision
    copies = config.rollout.mesh is not None or pc.compute_dtype != pc.param_dtype
    stored = p.compute if copies else p.params
    out = {"sampler weights": params * p.compute / shard if copies else 0.0,
           "sampling buffers": device_rows * (6 * model.vocab_size * 4 / r_tensor + config.rollout.max_new_tokens * 16),
           "sampler gathered weights": 0.0}
    if shard > 1:
        embedding = model.vocab_size * model.hidden_size
        layer = (params - embedding * (1 if model.tie_word_embeddings else 2)) / model.num_layers
        out["sampler gathered weights"] = (layer + 2.5 * embedding) * stored / r_tensor
    return out


def _submesh_forward(config, model: ModelConfig, p: Precision, sub: tuple[int, int, int], placed: dict[str, float],
                     *, rows: float, packed: tuple[float, int, int], online: bool, length: int, layer_set,
                     params: int) -> dict[str, float]:
    """Per sub-mesh device, the peak of the placed models' forward passes beyond their
    weights (``{"forward pass": bytes}``). A forward keeps nothing for a backward pass, so
    it peaks at one of two moments, as read from the compiled programs
    (tools/estimate_vs_compiled.py ``--submesh``): in the layers, one layer's working set
    (``layer_set``) beside that layer gathered whole (under FSDP); or at the LM head, the
    larger of two whole heads (the gathered head and its copy, as in the training step) and
    one head beside the chunked LM-head buffers (``[rows, chunk, V]`` float32: one, or two
    where an online pass, which also takes the entropy, scans more than one chunk of a row;
    as measured: GRPO's packed groups of 64 positions in chunks of 32 hold two, PPO's rows
    of one chunk one, DPO's packed pairs one). The reference runs on every
    row of the step at once (offline: the packed pairs before micro-batching; online: every
    rollout row, groups packed as the update packs them), in chunks of at most the positions
    a row scores (``packed``: rows, row length, scored positions a row); a reward model on the full rows,
    with a scalar head. (The working set is the training mesh's per token; it assumes the
    sub-mesh splits heads over ``tensor`` as training does.)"""
    s_data, s_fsdp, s_tensor = sub
    batch_devices = s_data * s_fsdp
    gathered = s_fsdp * s_tensor > 1
    embedding = model.vocab_size * model.hidden_size
    layer = (params - embedding * (1 if model.tie_word_embeddings else 2)) / model.num_layers
    layer_whole = layer * p.frozen / s_tensor if gathered else 0.0
    peak = 0.0
    if "reference" in placed:
        ref_rows, ref_length, scored = packed
        device_rows = max(ref_rows / batch_devices, 1)
        chunk = min(config.model.logprob_chunk_size or scored, scored)
        buffers = 2 if online and scored > chunk else 1
        lm_buffers = device_rows * chunk * model.vocab_size * 4 * buffers / s_tensor
        head = embedding * p.frozen / s_tensor if gathered else 0.0
        peak = max(layer_whole + layer_set(device_rows, ref_length), 2 * head, head + lm_buffers)
    # (rewards.prm reaches the sub-mesh only beside rewards.reward_models: placement.reward_models needs them;
    # counted at the policy's layer size)
    if "reward models" in placed:
        peak = max(peak, layer_whole + layer_set(max(rows / batch_devices, 1), length))
    return {"forward pass": peak}


def _changes(config, mesh: tuple[int, int, int]) -> list[tuple[str, Any, tuple[int, int, int]]]:
    """Candidate changes, cheapest first: ``(what to set, new config, new mesh)``."""
    data, fsdp, tensor = mesh
    out = []
    if config.model.remat not in ("full", "offload_dots"):
        out.append(("model.remat=full", dataclasses.replace(config, model=dataclasses.replace(config.model, remat="full")),
                    mesh))
    entry = algorithm(config.algorithm)
    precompute = entry.precomputed_reference
    if isinstance(precompute, Is) and entry.reference(config) and not precompute(config):
        section, _, key = precompute.path.partition(".")  # e.g. preference.reference=precomputed
        value = precompute.values[0]
        changed = dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **{key: value})})
        out.append((f"{precompute.path}={value}", changed, mesh))

    placement = config.placement
    separate_reference = config.lora is None or entry.teacher is not None  # not LoRA's base with the adapters off
    if LIVE_REFERENCE(config) and separate_reference and placement.reference == "device":
        out.append(("placement.reference=host", dataclasses.replace(
            config, placement=dataclasses.replace(placement, reference="host")), mesh))
    if entry.family == "online" and config.rewards.reward_models and placement.reward_models == "device":
        out.append(("placement.reward_models=host", dataclasses.replace(
            config, placement=dataclasses.replace(placement, reward_models="host")), mesh))
    if data > 1:
        out.append((f"mesh.shape=[1, {data * fsdp}, {tensor}] (more FSDP)", config, (1, data * fsdp, tensor)))
    if config.data.batch_size % (config.train.grad_accum_steps * 2) == 0:
        out.append((f"train.grad_accum_steps={config.train.grad_accum_steps * 2} (a smaller micro-batch)",
                    dataclasses.replace(config, train=dataclasses.replace(
                        config.train, grad_accum_steps=config.train.grad_accum_steps * 2)), mesh))
    pc = config.precision
    if pc.param_dtype == "float32":
        out.append(("precision.param_dtype=bfloat16 and compute_dtype=bfloat16 (a float32 master is kept)",
                    dataclasses.replace(config, precision=dataclasses.replace(
                        pc, param_dtype="bfloat16", compute_dtype="bfloat16", master_dtype="float32")), mesh))
    elif pc.mu_dtype == "float32":
        out.append(("precision.mu_dtype=bfloat16", dataclasses.replace(
            config, precision=dataclasses.replace(pc, mu_dtype="bfloat16")), mesh))
    if placement.optimizer_state == "device":  # last: a round trip of the state every step
        out.append(("placement.optimizer_state=host", dataclasses.replace(
            config, placement=dataclasses.replace(placement, optimizer_state="host")), mesh))
    return out


def _suggestion(config, model, result: Estimate, **kwargs) -> str:
    tried = []
    current, mesh = config, result.mesh
    for what, changed, new_mesh in _changes(config, result.mesh):
        candidate = estimate(changed, model=model, devices=result.devices, mesh=new_mesh,
                             device_memory_gb=result.device_memory / GB, suggest=False, **kwargs)
        tried.append(what)
        if candidate.fits:
            return f"does not fit; try {what} ({candidate.total / GB:.1f} GB per device)"
        current, mesh = changed, new_mesh
    combined = " and ".join(tried) if tried else "nothing left to change here"
    last = estimate(current, model=model, devices=result.devices, mesh=mesh,
                    device_memory_gb=result.device_memory / GB, suggest=False, **kwargs) if tried else result
    return (f"does not fit even with {combined} ({last.total / GB:.1f} GB per device); use more devices, "
            + ("or a smaller LoRA rank" if getattr(config, "lora", None) is not None
               else "or LoRA (parameter-efficient training: lora.rank)"))


def _teacher_model(config, entry) -> ModelConfig | None:
    """The shape of the frozen model an entry holds in the reference's place (distillation's
    teacher, ``entry.teacher``), from its folder or registry name (+ ``random_init``)."""
    spec = entry.teacher(config) if entry.teacher is not None else None
    if spec is None:
        return None
    return model_config_for(dataclasses.replace(config, model=spec))


def model_config_for(config, model: str | Mapping[str, Any] | None = None) -> ModelConfig:
    """The shape to estimate: a preset name of :data:`MODEL_PRESETS`, a config.json dict, or
    (``None``) the config's own ``model.name`` (+ ``random_init``)."""
    policy = config.precision.model_dtypes()
    if isinstance(model, str):
        if model not in MODEL_PRESETS:
            raise ValueError(f"unknown model preset {model!r}; known: {', '.join(MODEL_PRESETS)}")
        return ModelConfig.from_hf_config(MODEL_PRESETS[model], **policy)
    if isinstance(model, Mapping):
        return ModelConfig.from_hf_config(model, **policy)
    from alignax.models.hf import read_config
    from alignax.trainers.engine.setup import model_directory

    hf = read_config(model_directory(config.model), name=config.model.name)
    return ModelConfig.from_hf_config({**hf, **(config.model.random_init or {})}, **policy)
