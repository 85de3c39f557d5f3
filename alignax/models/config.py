"""Model configuration: one frozen dataclass for every decoder family, read from and
written back to a Hugging Face ``config.json`` dict.

Families (``model_type``): ``llama`` (SmolLM2 is one), ``qwen2`` (Qwen2 and Qwen2.5: q/k/v
biases), ``qwen3`` (q/k RMS norms on the head dim), ``qwen3_moe`` (Qwen3 attention, every MLP a
mixture of experts: :mod:`alignax.models.moe`), ``gpt2`` (learned positions,
LayerNorm, GELU, fused Conv1D projections), ``mistral`` (sliding-window attention),
``phi3`` (fused qkv and gate_up projections in its files; optional sliding window),
``gemma2`` (soft-capped attention and final logits, alternating sliding-window/global
layers, norms before and after attention and MLP, ``(1 + w)`` RMSNorm, embeddings scaled
by ``sqrt(D)``, ``query_pre_attn_scalar``), ``gemma3_text`` (Gemma 3's text decoder,
``Gemma3ForCausalLM``: Gemma 2's layer plus q/k norms, a sliding pattern, and a local RoPE
base for the sliding layers).

Defaults for optional fields are the ones transformers applies for that family, so a
config read here describes the same network transformers builds from the same dict.
RoPE follows transformers 5: settings live in ``rope_parameters`` (older files use
``rope_scaling`` plus a top-level ``rope_theta``); the inverse frequencies are computed
by :func:`rope_inv_freq` exactly as ``transformers.modeling_rope_utils`` does for the
supported types ``default``, ``linear``, ``llama3`` and ``longrope`` (Phi-3's long-context
variants: :func:`longrope_inv_freqs`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from alignax.models.lora import LoraConfig

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gpt2", "mistral", "phi3", "gemma2",
                           "gemma3_text")
# Attention kinds of ``layer_types`` (transformers' names).
LAYER_TYPES = ("full_attention", "sliding_attention")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
SUPPORTED_DTYPES = ("float32", "bfloat16")
# Rematerialisation of each decoder layer in the backward pass (JAX's checkpoint policies):
# "none" keeps every activation; "full" keeps only each layer's input and recomputes the
# rest; "dots_saveable" keeps every matmul output (attention scores too);
# "dots_with_no_batch_dims_saveable" keeps the projections' outputs but not the attention
# scores and probabilities; "offload_dots" moves those projection outputs to pinned host
# memory and back (the device holds layer inputs only; the host link carries the rest).
REMAT_POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "offload_dots")
# Attention of full forward passes: "xla" materialises float32 scores [B, K, G, T, S] (every
# backend); "cudnn" is cuDNN's fused kernel through jax.nn.dot_product_attention (GPU,
# bfloat16 or float16 compute); "splash" is the Pallas splash kernel (TPU; interpreted
# elsewhere; rows without shared-prompt packing). Decode steps and prefills into a KV cache
# take the "xla" path.
ATTENTION_IMPLEMENTATIONS = ("xla", "cudnn", "splash")

# transformers' ACT2FN names -> our activation names (the function lives in layers.py).
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "relu": "relu",
}

_HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
_HF_SEQ_CLS_ARCHITECTURES = {
    "llama": "LlamaForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification",
    "qwen3_moe": "Qwen3MoeForSequenceClassification",
    "gpt2": "GPT2ForSequenceClassification",
    "mistral": "MistralForSequenceClassification",
    "phi3": "Phi3ForSequenceClassification",
    "gemma2": "Gemma2ForSequenceClassification",
    "gemma3_text": "Gemma3TextForSequenceClassification",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape, family options and run-time policy of one decoder.

    Shape letters used across alignax.models: B batch, T length, S cache length,
    D ``hidden_size``, N ``num_heads``, K ``num_kv_heads``, H ``head_dim``,
    F ``intermediate_size``, V ``vocab_size``, L ``num_layers``.

    Run-time policy (not part of the HF config):
      param_dtype: storage dtype of parameters, ``"float32"`` or ``"bfloat16"`` (any
        dtype-like is accepted and stored as its name).
      dtype: compute dtype of activations and matmuls. Norm statistics, softmax,
        logits, log-probs, values and rewards are always float32.
      scan_layers: store layer parameters stacked on a leading ``layers`` axis and run
        them with ``jax.lax.scan`` (one layer traced and compiled, whatever ``L``).
      remat: what each layer keeps for the backward pass, one of :data:`REMAT_POLICIES`
        (``jax.checkpoint`` with that policy; ``True``/``False`` read as ``"full"``/``"none"``).
      attention: one of :data:`ATTENTION_IMPLEMENTATIONS`.
      Mixture of experts (``num_experts > 0``; :mod:`alignax.models.moe`): every layer's MLP
      is ``num_experts`` SwiGLU experts of width ``moe_intermediate_size``, each token sent
      to its ``num_experts_per_tok`` most probable ones (their router probabilities
      renormalised to sum to 1 when ``norm_topk_prob``); ``router_aux_loss_coef`` weighs
      the load-balancing loss the trainers add to every objective.
      lora: low-rank adapters on the projections (:class:`alignax.models.lora.LoraConfig`);
        ``None``: none. Not part of the exported HF config (adapters are merged or saved
        apart, see :mod:`alignax.models.lora`).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    activation: str = "silu"
    norm_type: str = "rms"  # "rms" | "layer"
    gated_mlp: bool = True
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    position_embedding: str = "rope"  # "rope" | "learned"
    max_position_embeddings: int = 2048
    rope_theta: float = 10_000.0
    rope_type: str = "default"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    # longrope (Phi-3 128k, Phi-3.5): per-frequency divisors for a forward whose positions stay
    # within rope_original_max_position_embeddings (short) or reach past it (long), and the
    # factor on sin/cos
    rope_short_factor: tuple[float, ...] | None = None
    rope_long_factor: tuple[float, ...] | None = None
    rope_attention_factor: float = 1.0
    attn_scale: float | None = None  # None: head_dim ** -0.5
    # Sliding windows and the Gemma layer (module docstring; alignax.models.layer_types).
    sliding_window: int | None = None  # W: a query sees the W latest positions, itself included
    layer_types: tuple[str, ...] | None = None  # per layer, from LAYER_TYPES; None: all sliding iff W is set
    rope_local_theta: float | None = None  # sliding layers' RoPE base (default type); None: the global RoPE
    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + w): Gemma's 1.0, its w starting at 0
    post_norms: bool = False  # a norm after attention and after the MLP too, before each residual add
    scale_embeddings: bool = False  # embeddings times sqrt(D)
    attn_softcap: float | None = None  # attention scores c * tanh(s / c) before the mask
    final_softcap: float | None = None  # logits c * tanh(z / c)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    num_labels: int = 1
    num_experts: int = 0  # 0: dense MLPs
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.0
    # run-time policy
    param_dtype: str = "float32"
    dtype: str = "float32"
    scan_layers: bool = False
    remat: str = "none"
    attention: str = "xla"
    lora: LoraConfig | None = None

    def __post_init__(self):
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention must be one of {ATTENTION_IMPLEMENTATIONS}; got {self.attention!r}")
        if isinstance(self.remat, bool):
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {REMAT_POLICIES} (or true/false); got {self.remat!r}")
        if self.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture model_type={self.model_type!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("param_dtype", "dtype"):
            try:  # accept jnp.float32, np.dtype("bfloat16"), "float32", ...
                object.__setattr__(self, name, np.dtype(getattr(self, name)).name)
            except TypeError:
                pass
            if getattr(self, name) not in SUPPORTED_DTYPES:
                raise ValueError(f"{name} must be one of {SUPPORTED_DTYPES}; got {getattr(self, name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"unsupported rope_type {self.rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if self.rope_type == "longrope":
            for name in ("rope_short_factor", "rope_long_factor"):
                value = getattr(self, name)
                if value is None or len(value) != self.head_dim // 2:
                    raise ValueError(f"longrope needs {name} of head_dim / 2 = {self.head_dim // 2} numbers; "
                                     f"got {value!r}")
                object.__setattr__(self, name, tuple(float(v) for v in value))
        if self.activation not in set(_ACTIVATIONS.values()):
            raise ValueError(f"unknown activation {self.activation!r}; valid: {sorted(set(_ACTIVATIONS.values()))}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}]; "
                             f"got {self.num_experts_per_tok}")
        if self.num_experts and self.moe_intermediate_size < 1:
            raise ValueError(f"moe_intermediate_size must be >= 1 with experts; got {self.moe_intermediate_size}")
        if self.router_aux_loss_coef < 0:
            raise ValueError(f"router_aux_loss_coef must be >= 0; got {self.router_aux_loss_coef}")
        if self.head_dim % 2 and self.position_embedding == "rope":
            raise ValueError(f"RoPE needs an even head_dim; got {self.head_dim}")
        _check_window_fields(self)

    @property
    def num_groups(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def sliding_layers(self) -> tuple[bool, ...]:
        """Per layer: does it attend through the sliding window (``[L]``)?"""
        if self.layer_types is None:
            return (self.sliding_window is not None,) * self.num_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def needs_xla_attention(self) -> bool:
        """Sliding windows or soft-capped scores: masks the fused kernels (cuDNN, splash) do not take."""
        return any(self.sliding_layers) or self.attn_softcap is not None

    @property
    def attention_scale(self) -> float:
        return self.head_dim**-0.5 if self.attn_scale is None else self.attn_scale

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF dicts

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any], **policy) -> ModelConfig:
        """Read a Hugging Face ``config.json`` dict.

        ``policy`` sets the run-time fields (``param_dtype``, ``dtype``, ``scan_layers``,
        ``remat``, ``attention``). Raises ``ValueError`` naming the missing field or the unsupported
        architecture / rope type / option.
        """
        if not isinstance(hf_config, Mapping):
            raise TypeError(f"hf_config must be a dict (parsed config.json); got {type(hf_config).__name__}")
        model_type = hf_config.get("model_type")
        if model_type is None:
            raise ValueError(
                "config is missing the field 'model_type'; supported: " + ", ".join(SUPPORTED_ARCHITECTURES)
            )
        if model_type not in SUPPORTED_ARCHITECTURES:
            hint = (" (model_type='gemma3' is the multimodal Gemma3ForConditionalGeneration; its text decoder alone, "
                    "gemma3_text as in Gemma3ForCausalLM checkpoints such as gemma-3-1b, is supported)"
                    if model_type == "gemma3" else "")
            raise ValueError(
                f"unsupported architecture model_type={model_type!r}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}{hint}"
            )
        unknown = set(policy) - {"param_dtype", "dtype", "scan_layers", "remat", "attention"}
        if unknown:
            raise TypeError(
                f"unknown policy arguments {sorted(unknown)}; valid: param_dtype, dtype, scan_layers, remat, attention"
            )
        reader = {"gpt2": _GPT2_READER, "gemma2": _gemma_fields, "gemma3_text": _gemma_fields}.get(
            model_type, _llama_like_fields)
        fields = reader(hf_config)
        fields.update(_token_ids(hf_config))
        num_labels = hf_config.get("num_labels")
        if num_labels is None and isinstance(hf_config.get("id2label"), Mapping):
            num_labels = len(hf_config["id2label"])
        fields["num_labels"] = int(num_labels or 1)
        return cls(model_type=model_type, **fields, **policy)

    def to_hf_config(self, *, architecture: str = "causal_lm") -> dict[str, Any]:
        """A ``config.json`` dict transformers builds this network from.

        ``architecture``: ``"causal_lm"`` (``*ForCausalLM`` / ``GPT2LMHeadModel``) or
        ``"sequence_classification"`` (``*ForSequenceClassification``, the reward head).
        """
        if architecture not in ("causal_lm", "sequence_classification"):
            raise ValueError(f"architecture must be 'causal_lm' or 'sequence_classification'; got {architecture!r}")
        names = _HF_ARCHITECTURES if architecture == "causal_lm" else _HF_SEQ_CLS_ARCHITECTURES
        act = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}[self.activation]
        out: dict[str, Any] = {"architectures": [names[self.model_type]], "model_type": self.model_type}
        if self.model_type == "gpt2":
            _write_gpt2(self, out, act)
        else:
            _write_decoder(self, out, act)
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        out.update(bos_token_id=self.bos_token_id, eos_token_id=eos, pad_token_id=self.pad_token_id)
        if architecture == "sequence_classification":
            out["num_labels"] = self.num_labels
            out["id2label"] = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
            out["label2id"] = {f"LABEL_{i}": i for i in range(self.num_labels)}
        out["dtype"] = self.param_dtype
        return out


# ---------------------------------------------------------------------------- writers


def _write_gpt2(c: ModelConfig, out: dict[str, Any], act: str) -> None:
    """GPT-2's own field names (``n_embd``, ``n_layer``, ...)."""
    out.update(
        vocab_size=c.vocab_size,
        n_embd=c.hidden_size,
        n_layer=c.num_layers,
        n_head=c.num_heads,
        n_inner=c.intermediate_size,
        n_positions=c.max_position_embeddings,
        layer_norm_epsilon=c.norm_eps,
        activation_function=act,
        scale_attn_weights=c.attn_scale is None,
        tie_word_embeddings=c.tie_word_embeddings,
    )


def _hf_rope_parameters(c: ModelConfig) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` of the global RoPE."""
    rope: dict[str, Any] = {"rope_type": c.rope_type, "rope_theta": c.rope_theta}
    if c.rope_type in ("linear", "llama3"):
        rope["factor"] = c.rope_factor
    if c.rope_type == "llama3":
        rope.update(
            low_freq_factor=c.rope_low_freq_factor,
            high_freq_factor=c.rope_high_freq_factor,
            original_max_position_embeddings=c.rope_original_max_position_embeddings,
        )
    if c.rope_type == "longrope":
        rope.update(short_factor=list(c.rope_short_factor), long_factor=list(c.rope_long_factor),
                    original_max_position_embeddings=c.rope_original_max_position_embeddings,
                    attention_factor=c.rope_attention_factor)
    return rope


def _write_decoder(c: ModelConfig, out: dict[str, Any], act: str) -> None:
    """The llama-like fields every family but GPT-2 shares, then each family's own."""
    rope = _hf_rope_parameters(c)
    out.update(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        hidden_act=act,
        rms_norm_eps=c.norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        rope_parameters=rope,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    if c.model_type == "llama":
        out.update(attention_bias=c.qkv_bias, mlp_bias=c.mlp_bias)
    elif c.model_type == "qwen3":
        out.update(attention_bias=c.qkv_bias, use_sliding_window=False)
    elif c.model_type == "qwen3_moe":
        out.update(attention_bias=c.qkv_bias, use_sliding_window=False, num_experts=c.num_experts,
                   num_experts_per_tok=c.num_experts_per_tok,
                   moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
                   router_aux_loss_coef=c.router_aux_loss_coef, decoder_sparse_step=1,
                   mlp_only_layers=[])
    elif c.model_type == "qwen2":
        out.update(use_sliding_window=False)
    else:
        _write_window_family(c, out)


# ---------------------------------------------------------------------------- readers


def _require(hf: Mapping[str, Any], name: str, model_type: str) -> Any:
    if name not in hf or hf[name] is None:
        raise ValueError(f"{model_type} config is missing the required field {name!r}")
    return hf[name]


def _activation(name: str, field: str) -> str:
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported {field} {name!r}; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _token_ids(hf: Mapping[str, Any]) -> dict[str, Any]:
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = tuple(int(e) for e in eos)
    return {"bos_token_id": hf.get("bos_token_id"), "eos_token_id": eos, "pad_token_id": hf.get("pad_token_id")}


def _rope_fields(hf: Mapping[str, Any], model_type: str, max_pos: int) -> dict[str, Any]:
    """``rope_parameters`` (transformers 5) or ``rope_scaling`` + ``rope_theta`` (older files)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_parameters must be a dict; got {params!r}")
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters (nested dicts) are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r} in {model_type} config; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    theta = params.get("rope_theta", hf.get("rope_theta", 10_000.0))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    out: dict[str, Any] = {"rope_type": rope_type, "rope_theta": float(theta)}
    if rope_type == "longrope":
        out.update(_longrope_fields(params, _original_max_position(params, hf, model_type, max_pos), max_pos))
    if rope_type in ("linear", "llama3"):
        if "factor" not in params:
            raise ValueError(f"rope_parameters of type {rope_type!r} is missing the field 'factor'")
        out["rope_factor"] = float(params["factor"])
    if rope_type == "llama3":
        for key, field in (("low_freq_factor", "rope_low_freq_factor"), ("high_freq_factor", "rope_high_freq_factor")):
            if key not in params:
                raise ValueError(f"rope_parameters of type 'llama3' is missing the field {key!r}")
            out[field] = float(params[key])
        out["rope_original_max_position_embeddings"] = _original_max_position(params, hf, model_type, max_pos)
    return out


# Phi3Config's top-level ``original_max_position_embeddings`` when a config.json omits it.
_PHI3_ORIGINAL_MAX_POSITION = 4096


def _original_max_position(params: Mapping[str, Any], hf: Mapping[str, Any], model_type: str, max_pos: int) -> int:
    """The pretraining length of ``llama3`` and ``longrope`` scaling, with transformers' priority
    (``standardize_rope_params``): Phi-3's config class always has a top-level field (4096 when
    the file omits it) that replaces the one in ``rope_parameters``; the other families read
    ``rope_parameters`` only (a top-level field is ignored), else ``max_position_embeddings``."""
    if model_type == "phi3":
        value = hf.get("original_max_position_embeddings", _PHI3_ORIGINAL_MAX_POSITION)
    else:
        value = params.get("original_max_position_embeddings", max_pos)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{model_type} config: original_max_position_embeddings must be a positive integer; "
                         f"got {value!r}")
    return int(value)


def _longrope_fields(params: Mapping[str, Any], original: int, max_pos: int) -> dict[str, Any]:
    """``longrope``'s factors; the attention factor as transformers derives it when absent:
    ``sqrt(1 + ln(factor) / ln(original_max))`` with ``factor = max_pos / original_max``."""
    for key in ("short_factor", "long_factor"):
        if not isinstance(params.get(key), (list, tuple)):
            raise ValueError(f"rope_parameters of type 'longrope' needs the list {key!r}; got {params.get(key)!r}")
    factor = params.get("factor") or max_pos / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return dict(rope_short_factor=tuple(params["short_factor"]), rope_long_factor=tuple(params["long_factor"]),
                rope_original_max_position_embeddings=original, rope_attention_factor=float(attention))


# transformers' per-family defaults for fields a config.json may omit (num_key_value_heads
# None: as many as the query heads).
_LLAMA_LIKE_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "head_dim": None, "num_key_value_heads": None},
    "qwen2": {"max_position_embeddings": 32768, "head_dim": None, "num_key_value_heads": 32},
    "qwen3": {"max_position_embeddings": 32768, "head_dim": 128, "num_key_value_heads": 32},
    "qwen3_moe": {"max_position_embeddings": 32768, "head_dim": None, "num_key_value_heads": 4},
    "mistral": {"max_position_embeddings": 131072, "head_dim": None, "num_key_value_heads": 8},
    "phi3": {"max_position_embeddings": 4096, "head_dim": None, "rms_norm_eps": 1e-5, "num_key_value_heads": None},
}


def _kv_heads(hf: Mapping[str, Any], model_type: str, heads: int, default: int | None) -> int:
    """``num_key_value_heads`` as transformers reads it: the family's class default when the
    field is absent (8 for Mistral, 4 for Gemma 2/3, ...), the query heads when it is null."""
    value = hf.get("num_key_value_heads", default)
    if value is None:
        return heads
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{model_type} config: num_key_value_heads must be a positive integer; got {value!r}")
    return int(value)


def _llama_like_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    mt = hf["model_type"]
    req = {name: int(_require(hf, name, mt)) for name in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")}
    heads = req["num_attention_heads"]
    kv_heads = _kv_heads(hf, mt, heads, _LLAMA_LIKE_DEFAULTS[mt]["num_key_value_heads"])
    head_dim = hf.get("head_dim") or _LLAMA_LIKE_DEFAULTS[mt]["head_dim"] or req["hidden_size"] // heads
    max_pos = int(hf.get("max_position_embeddings") or _LLAMA_LIKE_DEFAULTS[mt]["max_position_embeddings"])
    if hf.get("use_sliding_window"):
        raise ValueError(f"{mt} config sets use_sliding_window=true; sliding-window attention is not supported "
                         "for it (it is for mistral, phi3, gemma2 and gemma3_text)")
    if hf.get("pretraining_tp", 1) not in (None, 1):
        raise ValueError(f"pretraining_tp={hf['pretraining_tp']} is not supported (only 1)")
    fields: dict[str, Any] = dict(
        vocab_size=req["vocab_size"],
        hidden_size=req["hidden_size"],
        intermediate_size=req["intermediate_size"],
        num_layers=req["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        norm_eps=float(hf.get("rms_norm_eps", _LLAMA_LIKE_DEFAULTS[mt].get("rms_norm_eps", 1e-6))),
        activation=_activation(hf.get("hidden_act", "silu"), "hidden_act"),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    if mt == "llama":
        bias = bool(hf.get("attention_bias", False))
        fields.update(qkv_bias=bias, out_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))
    elif mt == "qwen2":
        fields.update(qkv_bias=True, out_bias=False)
    elif mt in ("mistral", "phi3"):  # every layer sliding when the window is set
        fields.update(sliding_window=hf.get("sliding_window", 4096 if mt == "mistral" else None))
    else:  # qwen3, qwen3_moe
        bias = bool(hf.get("attention_bias", False))
        fields.update(qkv_bias=bias, out_bias=bias, qk_norm=True)
    if mt == "qwen3_moe":
        fields.update(_moe_fields(hf))
    fields.update(_rope_fields(hf, mt, max_pos))
    return fields


def _moe_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's expert fields (transformers' defaults where omitted). Every layer must be
    a mixture: layers that alternate with dense MLPs are not supported."""
    if hf.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"qwen3_moe config sets decoder_sparse_step={hf['decoder_sparse_step']}; only 1 (every "
                         "layer a mixture of experts) is supported")
    if hf.get("mlp_only_layers"):
        raise ValueError(f"qwen3_moe config sets mlp_only_layers={hf['mlp_only_layers']}; dense layers between "
                         "mixture layers are not supported")
    experts = hf.get("num_experts", hf.get("num_local_experts", 128))
    return dict(
        num_experts=int(experts),
        num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
        moe_intermediate_size=int(hf.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


def _gpt2_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    def get(name, alias, default=None, required=False):
        for key in (name, alias):
            if hf.get(key) is not None:
                return hf[key]
        if required:
            raise ValueError(f"gpt2 config is missing the required field {name!r}")
        return default

    hidden = int(get("n_embd", "hidden_size", required=True))
    heads = int(get("n_head", "num_attention_heads", required=True))
    if hidden % heads:
        raise ValueError(f"gpt2 n_embd ({hidden}) must be a multiple of n_head ({heads})")
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise ValueError("gpt2 scale_attn_by_inverse_layer_idx=true is not supported")
    if hf.get("add_cross_attention"):
        raise ValueError("gpt2 add_cross_attention=true is not supported")
    head_dim = hidden // heads
    return dict(
        vocab_size=int(_require(hf, "vocab_size", "gpt2")),
        hidden_size=hidden,
        num_layers=int(get("n_layer", "num_hidden_layers", required=True)),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        intermediate_size=int(get("n_inner", "intermediate_size") or 4 * hidden),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        activation=_activation(hf.get("activation_function", "gelu_new"), "activation_function"),
        norm_type="layer",
        gated_mlp=False,
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        position_embedding="learned",
        max_position_embeddings=int(get("n_positions", "max_position_embeddings", 1024)),
        attn_scale=None if hf.get("scale_attn_weights", True) else 1.0,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
    )


_GPT2_READER = _gpt2_fields


# ------------------------------------------------- sliding windows and the Gemma layer


def _check_window_fields(c: ModelConfig) -> None:
    """The fields of sliding-window and Gemma-style models (ModelConfig.__post_init__)."""
    window = c.sliding_window
    if window is not None and (isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1):
        raise ValueError(f"{c.model_type} config: sliding_window must be a positive integer or null; got {window!r}")
    if c.layer_types is not None:
        object.__setattr__(c, "layer_types", tuple(c.layer_types))
        if len(c.layer_types) != c.num_layers:
            raise ValueError(f"layer_types has {len(c.layer_types)} entries; the model has {c.num_layers} layers")
        unknown = sorted(set(c.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types: unknown {unknown}; valid: {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in c.layer_types and c.sliding_window is None:
            raise ValueError("layer_types names sliding_attention layers but sliding_window is not set")
    for name in ("attn_softcap", "final_softcap", "rope_local_theta"):
        value = getattr(c, name)
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be > 0 or None; got {value!r}")
    if c.attention != "xla" and c.needs_xla_attention:
        raise ValueError(f"attention={c.attention!r} runs plain causal attention; this {c.model_type} model has "
                         "sliding-window layers or soft-capped attention scores: use attention=xla "
                         "(model.attention: xla or auto)")


# transformers' defaults of the two Gemma text decoders.
_GEMMA_DEFAULTS = {
    "gemma2": dict(max_position_embeddings=8192, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
                   pattern=2, rope_theta=10_000.0, num_key_value_heads=4),
    "gemma3_text": dict(max_position_embeddings=131_072, final_logit_softcapping=None, attn_logit_softcapping=None,
                        pattern=6, rope_theta=1_000_000.0, num_key_value_heads=4),
}


def _gemma_rope(hf: Mapping[str, Any], mt: str, max_pos: int) -> dict[str, Any]:
    """Gemma 2: one RoPE. Gemma 3: ``rope_parameters`` per layer type (transformers 5), or the
    older ``rope_theta`` + ``rope_scaling`` (global) and ``rope_local_base_freq`` (sliding)."""
    params = hf.get("rope_parameters") or {}
    default_theta = _GEMMA_DEFAULTS[mt]["rope_theta"]
    if mt == "gemma2" or not isinstance(params.get("full_attention", params.get("sliding_attention")), Mapping):
        if mt == "gemma2":
            return _rope_fields({"rope_theta": default_theta, **hf}, mt, max_pos)
        out = _rope_fields({"rope_theta": default_theta, **hf}, mt, max_pos)
        out["rope_local_theta"] = float(hf.get("rope_local_base_freq", 10_000.0))
        return out
    unknown = sorted(set(params) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"{mt} rope_parameters: unknown layer types {unknown}; valid: {', '.join(LAYER_TYPES)}")
    full = {"rope_theta": default_theta, **(params.get("full_attention") or {})}
    local = {"rope_theta": 10_000.0, **(params.get("sliding_attention") or {})}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"{mt} rope_parameters.sliding_attention: rope_type {local['rope_type']!r} is not "
                         "supported for the sliding layers (only 'default')")
    out = _rope_fields({"rope_parameters": full}, mt, max_pos)
    out["rope_local_theta"] = float(local["rope_theta"])
    return out


def _gemma_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 2 and Gemma 3 text (``Gemma2ForCausalLM``, ``Gemma3ForCausalLM``)."""
    mt = hf["model_type"]
    defaults = _GEMMA_DEFAULTS[mt]
    req = {name: int(_require(hf, name, mt)) for name in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")}
    if hf.get("use_bidirectional_attention"):
        raise ValueError(f"{mt} config sets use_bidirectional_attention=true (an embedding model); "
                         "only causal decoders are supported")
    layers = req["num_hidden_layers"]
    # Gemma 2 always alternates (Gemma2Config ignores sliding_window_pattern); Gemma 3 reads it
    pattern = int(hf.get("sliding_window_pattern") or defaults["pattern"]) if mt == "gemma3_text" else 2
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    max_pos = int(hf.get("max_position_embeddings") or defaults["max_position_embeddings"])
    bias = bool(hf.get("attention_bias", False))
    head_dim = int(hf.get("head_dim") or 256)
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"

    def cap(name):
        value = hf.get(name, defaults[name])
        return None if value is None else float(value)

    fields: dict[str, Any] = dict(
        vocab_size=req["vocab_size"],
        hidden_size=req["hidden_size"],
        intermediate_size=req["intermediate_size"],
        num_layers=layers,
        num_heads=req["num_attention_heads"],
        num_kv_heads=_kv_heads(hf, mt, req["num_attention_heads"], defaults["num_key_value_heads"]),
        head_dim=head_dim,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        activation=_activation(activation, "hidden_activation"),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qkv_bias=bias,
        out_bias=bias,
        qk_norm=mt == "gemma3_text",
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        sliding_window=hf.get("sliding_window", 4096 if "sliding_attention" in layer_types else None),
        layer_types=tuple(layer_types),
        norm_offset=1.0,
        post_norms=True,
        scale_embeddings=True,
        attn_softcap=cap("attn_logit_softcapping"),
        final_softcap=cap("final_logit_softcapping"),
    )
    fields.update(_gemma_rope(hf, mt, max_pos))
    return fields


def _write_window_family(c: ModelConfig, out: dict[str, Any]) -> None:
    """The HF fields of mistral, phi3, gemma2 and gemma3_text beyond the llama-like ones."""
    out["sliding_window"] = c.sliding_window
    if c.model_type == "phi3" and c.rope_type == "longrope":
        # Phi3Config has this field whatever the file says (4096 when absent) and transformers
        # puts it over the one in rope_parameters
        out["original_max_position_embeddings"] = c.rope_original_max_position_embeddings
    if c.model_type not in ("gemma2", "gemma3_text"):
        return
    out["hidden_activation"] = out.pop("hidden_act")
    scalar = c.attention_scale**-2
    out.update(
        layer_types=list(c.layer_types or ()),
        attention_bias=c.qkv_bias,
        query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
        attn_logit_softcapping=c.attn_softcap,
        final_logit_softcapping=c.final_softcap,
    )
    if c.model_type == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": c.rope_local_theta or c.rope_theta}
        out["rope_parameters"] = {"full_attention": out["rope_parameters"], "sliding_attention": local}


# ---------------------------------------------------------------------------- RoPE


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies ``[H/2]`` (float32) of rotary embeddings, as transformers computes them.

    ``default``: ``inv_freq_i = theta^(-2i/H)`` (Su et al. 2021, RoFormer).
    ``linear``: ``inv_freq / factor`` (position interpolation, Chen et al. 2023).
    ``llama3``: wavelengths ``2 pi / inv_freq`` above ``original_max / low_freq_factor``
    are divided by ``factor``, those below ``original_max / high_freq_factor`` kept, and
    the band between interpolated smoothly (Llama 3.1).

    ``longrope`` has two sets and a factor on sin/cos, chosen per forward: it raises here
    (:func:`longrope_inv_freqs`, and ``layers.longrope_sin_cos`` for the whole rotation).
    """
    if config.rope_type == "longrope":
        raise ValueError("rope_inv_freq: rope_type 'longrope' has short and long inverse frequencies and an "
                         "attention factor on sin/cos; use longrope_inv_freqs(config) (both sets) or "
                         "alignax.models.layers.longrope_sin_cos(positions, config)")
    inv_freq = (1.0 / _rope_powers(config)).astype(np.float32)
    if config.rope_type == "linear":
        inv_freq = inv_freq / np.float32(config.rope_factor)
    elif config.rope_type == "llama3":
        factor = config.rope_factor
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        old_len = config.rope_original_max_position_embeddings
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


def local_rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies of the sliding layers' RoPE (Gemma 3: the default type with base
    ``rope_local_theta``; transformers' ``rope_parameters["sliding_attention"]``)."""
    if config.rope_local_theta is None:
        return rope_inv_freq(config)
    return rope_inv_freq(config.replace(rope_type="default", rope_theta=config.rope_local_theta))


def longrope_inv_freqs(config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """``(short, long)`` inverse frequencies ``[H/2]`` of ``longrope``: ``1 / (f_i * theta^(2i/H))``
    with ``f`` the short or long factors (Phi-3; transformers' ``_compute_longrope_parameters``).
    A forward uses the long ones when its largest position reaches ``original_max`` (as
    transformers decides per call, from ``max(position_ids) + 1``)."""
    base = _rope_powers(config)
    return tuple((1.0 / (np.asarray(f, np.float32) * base)).astype(np.float32)
                 for f in (config.rope_short_factor, config.rope_long_factor))


def _rope_powers(config: ModelConfig) -> np.ndarray:
    """``theta^(2i/H)`` ``[H/2]`` in float32, the wavelengths' base before any scaling (the
    inverse frequencies of the default type are its reciprocals)."""
    dim = config.head_dim
    return np.float32(config.rope_theta) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim))
