"""Low-rank adapters (LoRA, Hu et al. 2021) on the decoder's projections: the config, the
adapter module, attaching adapters to a built model, merging them back, and the adapter in
PEFT's file format.

A targeted projection ``y = x W`` becomes ``y = x W + s (x A) B`` with ``A [*in, r]``,
``B [r, *out]`` and ``s = alpha / r`` (rsLoRA, Kalajdzievski 2023: ``alpha / sqrt(r)``). ``A``
starts uniform in ``±1/sqrt(fan_in)`` (PEFT's Kaiming-uniform with ``a = sqrt(5)``), ``B`` at
zero, so a fresh adapter adds an exact ``0.0`` and the model's outputs are the base model's
bit for bit.

Adapter weights are :class:`LoRAParam` (an ``nnx.Param``), so ``nnx.split(model, LoRAParam,
nnx.Param, ...)`` separates what a LoRA run trains from the frozen base. Their logical axes
are the projection's own plus ``lora_rank`` (replicated): ``A`` of q is
``("embed", "lora_rank")``, ``B`` of q ``("lora_rank", "heads", "head_dim")``, so under the
mesh rules they shard like the kernel they adapt. Stacked for scan they gain ``layers``.

Targets: ``q k v o`` (attention), ``gate up down`` (MLP), ``lm_head`` (an untied LM head);
``all`` is the seven projections. A mixture-of-experts model (:mod:`alignax.models.moe`) has
no dense MLP and its experts take no adapters: there ``all`` (or the seven named) adapts
attention only, and ``gate up down`` named without the rest are refused. Dropout on the adapter's input (``lora.dropout``, as
PEFT: ``s dropout(x) A B``) applies only inside :func:`adapter_dropout` (the trainers enter
it in the training loss with a key from the step's rng); everywhere else (eval, the
reference, sampling, export) adapters run without it. Each adapter draws its mask from that
key folded with its layer index and projection, so a step is deterministic given its rng.

QLoRA (``lora.quantize: int8 | nf4``): the seven projections' base kernels are stored
quantised, blockwise (``lora.quant_block_size``), and dequantised inside the projection
(:mod:`alignax.models.quant`); embeddings, norms and an untied LM head stay in the
frozen dtype (as bitsandbytes leaves them). :func:`with_adapters` quantises the loaded
base; :func:`merge_adapters` (export) dequantises it and adds the adapters.

Sampling (``lora.merge_for_sampling``): the sampler runs base + adapters unmerged by
default; :func:`merged_state` gives it the merged model instead, computed once per
rollout, so its decode steps run the base architecture's matmuls alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import math
import os
from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from alignax.models.dense import dense
from alignax.models.quant import QUANTIZE_KINDS, dequantize_state, quantize_state

Array = jax.Array

PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")
TARGETS = (*PROJECTIONS, "lm_head")
# our projection -> (module attribute holding its kernel, PEFT/transformers module name)
_ATTENTION = ("q", "k", "v", "o")
# Families whose transformers modules are named as _HF_MODULE says; phi3's qkv_proj and
# gate_up_proj fuse several of our projections (_FUSED_MODULES: one PEFT adapter each, the
# projections' adapters side by side); gpt2's c_attn (a Conv1D) has no export.
PEFT_FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3")
_HF_MODULE = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_FUSED_MODULES = {"phi3": {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up"),
                           "self_attn.o_proj": ("o",), "mlp.down_proj": ("down",)}}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """The ``lora:`` section (``null``: full-parameter training).

    Fields:
      rank: ``r``, the inner dimension of every adapter.
      alpha: scale numerator: adapters add ``alpha / r * x A B`` (``alpha / sqrt(r)`` with
        ``rslora``).
      dropout: dropout probability on the adapter's input during training (module
        docstring); 0: none.
      targets: projections that get an adapter, from ``q k v o gate up down lm_head``, or
        ``all`` (the seven projections, not the LM head).
      rslora: rank-stabilised scaling ``alpha / sqrt(r)`` (Kalajdzievski 2023).
      seed: seed of the ``A`` matrices' initialisation.
      quantize: QLoRA: the frozen base's projection kernels stored as ``int8`` or ``nf4``
        (4-bit NormalFloat), blockwise absmax (:mod:`alignax.models.quant`); ``none``: in
        ``precision.frozen_dtype``.
      quant_block_size: weights per absmax block of a quantised kernel (QLoRA's 64).
      merge_for_sampling: online rollouts (and generation-based evaluation) sample from the
        merged model ``W + s A B``, computed once per rollout (:func:`merged_state`),
        instead of base + adapters unmerged.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("all",)
    rslora: bool = False
    seed: int = 0
    quantize: Literal["none", "int8", "nf4"] = "none"
    quant_block_size: int = 64
    merge_for_sampling: bool = False

    def __post_init__(self):
        if self.quantize not in QUANTIZE_KINDS:
            raise ValueError(f"lora.quantize must be one of {', '.join(QUANTIZE_KINDS)}; got {self.quantize!r}")
        if self.quant_block_size < 2:
            raise ValueError(f"lora.quant_block_size must be >= 2; got {self.quant_block_size}")
        if self.rank < 1:
            raise ValueError(f"lora.rank must be >= 1; got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"lora.alpha must be > 0; got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1); got {self.dropout}")
        if not self.targets:
            raise ValueError("lora.targets is empty; name projections from " + ", ".join(TARGETS) + " or 'all'")
        unknown = [t for t in self.targets if t not in (*TARGETS, "all")]
        if unknown:
            raise ValueError(f"lora.targets: unknown {', '.join(map(repr, unknown))}; valid: "
                             f"{', '.join(TARGETS)}, all")
        expanded = []
        for t in self.targets:
            for name in (PROJECTIONS if t == "all" else (t,)):
                if name not in expanded:
                    expanded.append(name)
        object.__setattr__(self, "targets", tuple(expanded))

    @property
    def scale(self) -> float:
        """``s``: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


class LoRAParam(nnx.Param):
    """An adapter weight: the only parameters a LoRA run trains."""


class LoRA(nnx.Module):
    """``x [..., *in] -> scale * (x A) B [..., *out]``, in ``x``'s dtype (``A``/``B`` are cast
    to it where they are used, as the kernels are)."""

    def __init__(self, spec: LoraConfig, target: str, in_shape: Sequence[int], out_shape: Sequence[int],
                 in_names: Sequence[str], out_names: Sequence[str], param_dtype, *, rngs: nnx.Rngs):
        r = spec.rank
        bound = 1.0 / math.sqrt(math.prod(in_shape))
        a = jax.random.uniform(rngs.params(), (*in_shape, r), jnp.float32, -bound, bound).astype(param_dtype)
        self.a = LoRAParam(a, out_sharding=(*in_names, "lora_rank"), eager_sharding=False)
        self.b = LoRAParam(jnp.zeros((r, *out_shape), param_dtype), out_sharding=("lora_rank", *out_names),
                           eager_sharding=False)
        self.scale = spec.scale
        self.in_axes = len(in_shape)
        self.dropout = spec.dropout
        self.stream = TARGETS.index(target)

    def __call__(self, x: Array, *, out_dtype=None) -> Array:
        key = _DROPOUT_KEY.get()
        if self.dropout and key is not None:
            keep = jax.random.bernoulli(jax.random.fold_in(key, self.stream), 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), 0.0).astype(x.dtype)
        h = dense(x, self.a[...].astype(x.dtype), in_axes=self.in_axes)  # [..., r]
        y = dense(h, self.b[...].astype(x.dtype), out_dtype=out_dtype)
        return y * jnp.asarray(self.scale, y.dtype)


def adapter(spec: LoraConfig | None, target: str, in_shape, out_shape, in_names, out_names, param_dtype,
            rngs: nnx.Rngs) -> LoRA | None:
    """The adapter of projection ``target``, or ``None`` when ``spec`` does not target it."""
    if spec is None or target not in spec.targets:
        return None
    return LoRA(spec, target, in_shape, out_shape, in_names, out_names, param_dtype, rngs=rngs)


_DROPOUT_KEY: contextvars.ContextVar = contextvars.ContextVar("alignax_lora_dropout", default=None)


@contextlib.contextmanager
def adapter_dropout(key: Array | None):
    """Adapters traced inside the block apply ``lora.dropout`` with masks drawn from
    ``key`` (``None``: no dropout). Read at trace time."""
    token = _DROPOUT_KEY.set(key)
    try:
        yield
    finally:
        _DROPOUT_KEY.reset(token)


@contextlib.contextmanager
def layer_dropout(layer):
    """Inside a decoder layer: the dropout key (if any) folded with the layer's index."""
    key = _DROPOUT_KEY.get()
    with adapter_dropout(None if key is None else jax.random.fold_in(key, layer)):
        yield


# ---------------------------------------------------------------------------- whole models
def split_adapters(params: nnx.State) -> tuple[nnx.State, nnx.State]:
    """``(adapter weights, everything else)`` of a parameter state; ``nnx.merge_state``
    puts them back together."""
    return nnx.split_state(params, LoRAParam, ...)


def adapters_off(adapters: Any) -> Any:
    """Adapter weights that add exactly nothing (``B = 0``, and ``A = 0``): with them the
    model computes its base's outputs bit for bit (``x W + 0.0``)."""
    return jax.tree.map(jnp.zeros_like, adapters)


MLP_PROJECTIONS = ("gate", "up", "down")


def check_targets(config, spec: LoraConfig) -> None:
    """Refuse MLP targets that a mixture-of-experts model of ``config`` cannot adapt: its
    experts have no adapters, so ``gate up down`` named apart from ``all`` would do less than
    asked (``all``, or the seven projections, adapts the attention projections only)."""
    named = [t for t in MLP_PROJECTIONS if t in spec.targets]
    if config.num_experts and named and not set(PROJECTIONS) <= set(spec.targets):
        raise ValueError(f"lora.targets names {' '.join(named)}, but this {config.model_type} model's MLPs are "
                         f"{config.num_experts} experts, which take no adapters; target q k v o (or 'all', which "
                         "is attention only on a mixture of experts)")


def projection_sizes(config) -> dict[str, tuple[int, int]]:
    """``{projection: (fan in, fan out)}`` of one layer of a model of ``config`` (a
    ``ModelConfig``): the kernels LoRA adapts and QLoRA quantises (a mixture of experts:
    the attention projections; its experts take no adapters and stay unquantised)."""
    D, N, K, H, F = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim, \
        config.intermediate_size
    sizes = {"q": (D, N * H), "k": (D, K * H), "v": (D, K * H), "o": (N * H, D), "gate": (D, F), "up": (D, F),
             "down": (F, D)}
    if not config.gated_mlp:
        sizes.pop("gate")
    if config.num_experts:
        sizes = {t: size for t, size in sizes.items() if t not in MLP_PROJECTIONS}
    return sizes


def adapter_parameter_count(config, spec: LoraConfig, *, lm_head: bool = True) -> int:
    """Adapter weights ``spec`` puts on a model of ``config`` (a ``ModelConfig``): ``r (in +
    out)`` per targeted projection and layer (what :func:`count_adapter_params` counts on a
    built model, from the shape alone). ``lm_head=False``: a model without an LM head (a
    value model: PPO's adapter critic)."""
    D = config.hidden_size
    sizes = projection_sizes(config)
    per_layer = sum(spec.rank * (i + o) for t, (i, o) in sizes.items() if t in spec.targets)
    head = spec.rank * (D + config.vocab_size) if (
        lm_head and "lm_head" in spec.targets and not config.tie_word_embeddings) else 0
    return config.num_layers * per_layer + head


def count_adapter_params(model_or_state) -> int:
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state, LoRAParam)
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))


def _rebuild(model: nnx.Module, config) -> tuple[nnx.GraphDef, nnx.State]:
    abstract = nnx.eval_shape(lambda: type(model)(config, rngs=nnx.Rngs(0)))
    return nnx.split(abstract)


def with_adapters(model: nnx.Module, spec: LoraConfig, *, mesh: jax.sharding.Mesh | None = None) -> nnx.Module:
    """``model`` (any kind of :mod:`alignax.models.modeling`) with fresh adapters on
    ``spec.targets``; its base weights are the same arrays (not copied), or with
    ``spec.quantize`` its projection kernels quantised (the float kernels are not kept:
    the caller's model still holds them until it lets go of it).

    The adapters are initialised in one jitted program (seeded by ``spec.seed``) and, with
    ``mesh``, created in their sharding from the logical-axis rules.
    """
    from alignax.parallel.sharding import tree_shardings

    if model.config.lora is not None:
        raise ValueError("the model already has adapters")
    check_targets(model.config, spec)
    if "lm_head" in spec.targets and getattr(model, "lm_head", 0) is None:
        raise ValueError("lora.targets names lm_head, but this model's LM head is tied to the embeddings "
                         "(tie_word_embeddings); drop lm_head from lora.targets")
    config = model.config.replace(lora=spec)
    cls = type(model)
    graphdef, abstract = _rebuild(model, config)

    def init():
        return nnx.state(cls(config, rngs=nnx.Rngs(spec.seed)), LoRAParam)  # XLA drops the unused base init

    out_shardings = tree_shardings(jax.eval_shape(init), mesh) if mesh is not None else None
    adapters = jax.jit(init, out_shardings=out_shardings)()
    state = nnx.state(model)
    if spec.quantize != "none":
        state = quantize_state(state, abstract, kind=spec.quantize, block_size=spec.quant_block_size, mesh=mesh)
    return nnx.merge(graphdef, nnx.merge_state(state, adapters))


def _adapter_modules(model: nnx.Module):
    """``(layer index or None, target, owner module, LoRA module)`` of every adapter;
    with scan-over-layers the layer index is ``None`` and the weights carry ``[L]``."""
    c = model.config
    out = []
    layers = model.model.layers
    blocks = [(None, layers)] if c.scan_layers else list(enumerate(layers))
    for i, block in blocks:
        for name in _ATTENTION:
            out.append((i, name, block.attn, getattr(block.attn, f"{name}_lora", None)))
        for name in ("gate", "up", "down"):
            out.append((i, name, block.mlp, getattr(block.mlp, f"{name}_lora", None)))
    return [m for m in out if m[3] is not None]


def _delta(lora: LoRA) -> Array:
    """``s A B`` as a kernel-shaped float32 array (``[L, *in, *out]`` when stacked)."""
    a = jnp.asarray(lora.a[...], jnp.float32)
    b = jnp.asarray(lora.b[...], jnp.float32)
    stacked = a.ndim - lora.in_axes == 2
    a2 = a.reshape(*a.shape[:1] * stacked, -1, a.shape[-1])
    b2 = b.reshape(*b.shape[:1] * stacked, b.shape[stacked], -1)
    kernel = lora.scale * jnp.matmul(a2, b2, precision=jax.lax.Precision.HIGHEST)
    return kernel.reshape(*a.shape[:-1], *b.shape[1 + stacked:])


def merge_adapters(model: nnx.Module) -> nnx.Module:
    """The model with every adapter folded into its kernel (``W + s A B``, computed in
    float32 and stored in the kernel's dtype) and no adapters: a plain model of the base
    architecture (what :func:`alignax.models.save_pretrained` exports). A QLoRA base is
    dequantised (``W`` is what the model computed with)."""
    if model.config.lora is None:
        return model
    base_config = model.config.replace(lora=None)
    graphdef, _ = _rebuild(model, base_config)
    params, rest = nnx.state(model, nnx.Param, ...)
    _, base = split_adapters(params)
    spec = model.config.lora
    if spec.quantize != "none":  # QLoRA: the dequantised base, in the model's param dtype
        base = dequantize_state(base, kind=spec.quantize, block_size=spec.quant_block_size,
                                dtype=model.config.param_dtype)
    # Variables of its own: setting its kernels below leaves ``model`` as it was
    merged = nnx.merge(graphdef, base, rest, copy=True)
    for i, name, owner, lora in _adapter_modules(model):
        target_owner = _owner_in(merged, owner, i)
        kernel = getattr(target_owner, f"{name}_kernel")
        kernel[...] = (kernel[...].astype(jnp.float32) + _delta(lora)).astype(kernel[...].dtype)
    if getattr(model, "lm_head_lora", None) is not None:
        merged.lm_head[...] = (merged.lm_head[...].astype(jnp.float32)
                               + _delta(model.lm_head_lora)).astype(merged.lm_head[...].dtype)
    return merged


@functools.partial(jax.jit, static_argnums=0)
def merged_state(graphdef: nnx.GraphDef, state: nnx.State) -> nnx.State:
    """The state of the merged model (:func:`merge_adapters`) of the model ``graphdef`` /
    ``state`` (with adapters), for the sampler (``lora.merge_for_sampling``; its graphdef:
    :func:`merged_graphdef`). One jitted program computes every ``W + s A B`` (float32,
    stored in the kernel's dtype); the merged model has no adapters, so each decode step
    runs one matmul a projection instead of three (``x W``, ``x A``, ``(x A) B``).

    Memory: the merged kernels are new arrays, held beside the frozen base while the
    rollout samples: one extra copy of every adapted projection kernel in
    ``precision.param_dtype`` (with ``targets: all``, nearly the whole model: 12.95 GB for
    Llama-2-7B in bfloat16). With QLoRA the merge dequantises: for that rollout the
    sampler holds the base's projections in ``param_dtype`` (2 bytes a weight in bfloat16,
    4 in float32) beside their NF4 codes (0.5625 bytes a weight at block 64) or int8 codes
    (1.0625), which gives back most of what QLoRA saves; unmerged, each decode step
    dequantises each projection again instead.
    """
    return nnx.state(merge_adapters(nnx.merge(graphdef, state)))


@functools.lru_cache(maxsize=16)
def _merged_graphdef(graphdef: nnx.GraphDef, shapes) -> nnx.GraphDef:
    state = jax.tree.unflatten(shapes[0], shapes[1])
    return nnx.graphdef(nnx.eval_shape(lambda s: merge_adapters(nnx.merge(graphdef, s)), state))


def merged_graphdef(graphdef: nnx.GraphDef, state: nnx.State) -> nnx.GraphDef:
    """The graphdef of :func:`merged_state`'s model (the base architecture, no adapters);
    ``state`` may be abstract (``jax.ShapeDtypeStruct`` leaves)."""
    leaves, treedef = jax.tree.flatten(state)
    shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves)
    return _merged_graphdef(graphdef, (treedef, shapes))


def _owner_in(model: nnx.Module, owner: nnx.Module, layer: int | None) -> nnx.Module:
    block = model.model.layers if layer is None else model.model.layers[layer]
    return block.attn if type(owner).__name__ == "Attention" else block.mlp


def _peft_shapes(name: str, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ours (``A [*in, r]``, ``B [r, *out]``) -> PEFT's ``lora_A.weight [r, in]``,
    ``lora_B.weight [out, r]`` (PyTorch ``Linear`` layout, heads flattened)."""
    r = a.shape[-1]
    return a.reshape(-1, r).T, b.reshape(r, -1).T


def save_peft_adapter(model: nnx.Module, path: str | os.PathLike, *, base_model_name: str | None = None,
                      base_model_revision: str | None = None) -> None:
    """Write the adapter alone as PEFT does (``adapter_config.json`` +
    ``adapter_model.safetensors``), loadable with ``peft.PeftModel.from_pretrained`` onto the
    transformers model of the base weights. The families of :data:`PEFT_FAMILIES`.

    Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` get one adapter each holding the adapters of
    the projections they fuse side by side, exactly: ``A = [A_q; A_k; A_v]`` (rank ``n r`` for
    ``n`` adapted parts) and ``B`` block-diagonal (zero rows for a part without an adapter), so
    ``B A x = [B_q A_q x; B_k A_k x; B_v A_v x]``; ``rank_pattern`` and ``alpha_pattern`` give the
    module that rank and the ``lora_alpha`` keeping the scale ``alpha / r`` (``alpha / sqrt(r)``
    with rsLoRA).

    ``base_model_name`` / ``base_model_revision``: the base as ``AutoPeftModelForCausalLM``
    looks it up (``base_model_name_or_path``, ``revision``): a hub id where the base has one
    (:func:`alignax.models.registry.hub_id`), else its folder."""
    from alignax.models.safetensors_io import write_safetensors

    spec: LoraConfig | None = model.config.lora
    if spec is None:
        raise ValueError("the model has no adapters to save")
    if model.config.model_type not in PEFT_FAMILIES:
        raise ValueError(f"PEFT export is for the families {', '.join(PEFT_FAMILIES)}; {model.config.model_type}'s "
                         "fused projections (gpt2's c_attn, a Conv1D) have no adapter in PEFT's layout (the merged "
                         "export carries the adapters)")
    per_layer: dict[int, dict[str, tuple[np.ndarray, np.ndarray]]] = {}
    for i, name, _owner, lora in _adapter_modules(model):
        a = np.asarray(jax.device_get(lora.a[...]), np.float32)
        b = np.asarray(jax.device_get(lora.b[...]), np.float32)
        for layer in (range(model.config.num_layers) if i is None else (i,)):
            la, lb = (a[layer], b[layer]) if i is None else (a, b)
            per_layer.setdefault(layer, {})[name] = _peft_shapes(name, la, lb)
    modules = _FUSED_MODULES.get(model.config.model_type, {m: (t,) for t, m in _HF_MODULE.items()})
    parts_out = _projection_outputs(model.config)
    tensors: dict[str, np.ndarray] = {}
    ranks: dict[str, int] = {}
    for layer, adapters in sorted(per_layer.items()):
        for module, parts in modules.items():
            adapted = [t for t in parts if t in adapters]
            if not adapted:
                continue
            pa = np.concatenate([adapters[t][0] for t in adapted])  # [n r, in]
            pb = np.zeros((sum(parts_out[t] for t in parts), pa.shape[0]), np.float32)
            row = 0
            for t in parts:
                if t in adapters:
                    col = adapted.index(t) * spec.rank
                    pb[row:row + parts_out[t], col:col + spec.rank] = adapters[t][1]
                row += parts_out[t]
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(pa)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(pb)
            ranks[module.split(".")[1]] = pa.shape[0]
    if getattr(model, "lm_head_lora", None) is not None:
        lo = model.lm_head_lora
        pa, pb = _peft_shapes("lm_head", np.asarray(jax.device_get(lo.a[...]), np.float32),
                              np.asarray(jax.device_get(lo.b[...]), np.float32))
        tensors["base_model.model.lm_head.lora_A.weight"] = np.ascontiguousarray(pa)
        tensors["base_model.model.lm_head.lora_B.weight"] = np.ascontiguousarray(pb)
        ranks["lm_head"] = spec.rank
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    write_safetensors(os.path.join(path, "adapter_model.safetensors"), tensors)
    widened = {m: r for m, r in ranks.items() if r != spec.rank}  # fused modules of several adapted parts
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout, "use_rslora": spec.rslora, "target_modules": sorted(ranks), "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "modules_to_save": None,
        "base_model_name_or_path": base_model_name, "revision": base_model_revision,
        "rank_pattern": widened,
        # the scale alpha / r (alpha / sqrt(r) with rsLoRA) of each part, at the module's rank
        "alpha_pattern": {m: spec.alpha * (r / spec.rank) ** (0.5 if spec.rslora else 1.0) for m, r in widened.items()},
    }
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _projection_outputs(c) -> dict[str, int]:
    """Each projection's output width in transformers' layout (heads flattened)."""
    return {"q": c.num_heads * c.head_dim, "k": c.num_kv_heads * c.head_dim, "v": c.num_kv_heads * c.head_dim,
            "o": c.hidden_size, "gate": c.intermediate_size, "up": c.intermediate_size, "down": c.hidden_size}


def load_peft_adapter(model: nnx.Module, path: str | os.PathLike, *, mesh: jax.sharding.Mesh | None = None
                      ) -> nnx.Module:
    """``model`` (the base, without adapters) with the PEFT adapter in ``path`` attached:
    ``adapter_config.json`` sets rank, alpha, rsLoRA and targets; every tensor of
    ``adapter_model.safetensors`` must map to an adapter and every adapter be present."""
    from alignax.models.safetensors_io import read_safetensors

    path = os.fspath(path)
    with open(os.path.join(path, "adapter_config.json")) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {cfg.get('peft_type')!r}; only LORA adapters load")
    modules = cfg.get("target_modules") or []
    if isinstance(modules, str):
        raise ValueError(f"{path}: target_modules is a pattern ({modules!r}); list the module names")
    by_module = {v.split(".")[1]: k for k, v in _HF_MODULE.items()}
    fused = sorted({m.split(".")[1] for family in _FUSED_MODULES.values() for m, parts in family.items()
                    if len(parts) > 1} & set(modules))
    if fused:
        raise ValueError(f"{path}: target_modules {fused} are fused modules (Phi-3's), whose adapter spans several "
                         "alignax projections and is not read back; load the merged export instead")
    unknown = [m for m in modules if m not in by_module and m != "lm_head"]
    if unknown:
        raise ValueError(f"{path}: target_modules {unknown} have no alignax projection; known: "
                         f"{', '.join([*by_module, 'lm_head'])}")
    patterns = [key for key in ("rank_pattern", "alpha_pattern") if cfg.get(key)]
    if patterns:
        raise ValueError(f"{path}: {' and '.join(patterns)} give modules their own rank or alpha, which alignax's "
                         "adapters (one rank and alpha for all) cannot hold; got "
                         + ", ".join(f"{key}={cfg[key]}" for key in patterns))
    spec = LoraConfig(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), rslora=bool(cfg.get("use_rslora", False)),
                      targets=tuple(t for t in TARGETS if t in {by_module.get(m, m) for m in modules}))
    model = with_adapters(model, spec, mesh=mesh)
    tensors = dict(read_safetensors(os.path.join(path, "adapter_model.safetensors")))
    tensors = {k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
               for k, v in tensors.items()}
    L = model.config.num_layers

    def fill(lora: LoRA, names: list[str]):
        a_shape, b_shape = lora.a[...].shape, lora.b[...].shape
        a_list, b_list = [], []
        for prefix in names:
            try:
                pa, pb = tensors.pop(f"{prefix}.lora_A.weight"), tensors.pop(f"{prefix}.lora_B.weight")
            except KeyError as err:
                raise ValueError(f"{path}: adapter tensor {err.args[0]} is missing") from None
            a_list.append(np.asarray(pa, np.float32).T)
            b_list.append(np.asarray(pb, np.float32).T)
        a = np.stack(a_list).reshape(a_shape) if len(names) > 1 else a_list[0].reshape(a_shape)
        b = np.stack(b_list).reshape(b_shape) if len(names) > 1 else b_list[0].reshape(b_shape)
        lora.a[...] = jax.device_put(jnp.asarray(a, lora.a[...].dtype), lora.a[...].sharding)
        lora.b[...] = jax.device_put(jnp.asarray(b, lora.b[...].dtype), lora.b[...].sharding)

    for i, name, _owner, lora in _adapter_modules(model):
        layers = range(L) if i is None else (i,)
        fill(lora, [f"base_model.model.model.layers.{j}.{_HF_MODULE[name]}" for j in layers])
    if getattr(model, "lm_head_lora", None) is not None:
        fill(model.lm_head_lora, ["base_model.model.lm_head"])
    if tensors:
        raise ValueError(f"{path}: tensors that match no adapter: {', '.join(sorted(tensors)[:10])}")
    return model
