"""Decoder building blocks in Flax NNX: norms, rotary embeddings, attention, MLP, one layer.

Every parameter is an ``nnx.Param`` whose ``out_sharding`` metadata holds logical axis
names (``embed``, ``heads``, ``kv_heads``, ``head_dim``, ``mlp``, ``vocab``, ``norm``,
``positions``, ``labels``; ``layers`` when stacked for scan). ``alignax.parallel`` maps
them to mesh axes; nothing here knows about meshes (``eager_sharding=False``).

Activations name their dims the same way at each layer's boundaries and inside it
(:data:`RESIDUAL`: ``[batch, length, activation_embed]``; q/k/v and the attention output
on ``activation_heads`` / ``activation_kv_heads``; the MLP's hidden on ``activation_mlp``)
through :func:`alignax.parallel.constrain`, the identity without a mesh. On a mesh this
pins the residual stream to the batch axes, replicated on its model dim, so XLA
all-gathers each layer's weights (FSDP) instead of moving activations to where the
weights lie. Weights are cast to the compute dtype before the matmul (``kernel[...]
.astype(x.dtype)``), so what is gathered is the compute-dtype copy.

A projection named in ``config.lora.targets`` also carries an adapter
(:mod:`alignax.models.lora`): ``q_lora`` ... ``down_lora``, added to the kernel's output.
With ``config.lora.quantize`` (QLoRA) those seven kernels are stored quantised
(:class:`alignax.models.quant.QuantizedKernel`) and dequantised inside the projection.

Einsum letters: B batch, T new tokens, S key slots, D model, N heads, K kv heads,
G query heads per kv head, H head dim, F mlp.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from alignax.models.config import ModelConfig, longrope_inv_freqs
from alignax.models.layer_types import pick, softcap
from alignax.models.lora import adapter, layer_dropout
from alignax.models.quant import QuantizedKernel, project
from alignax.models.splash import splash_attention
from alignax.parallel.sharding import constrain

Array = jax.Array

INIT_STD = 0.02  # transformers' initializer_range default for every supported family
_MASKED = float(np.finfo(np.float32).min)  # finite, so an all-masked row (a pad query) stays NaN-free

# Logical axes of activations (alignax.parallel.LOGICAL_AXIS_RULES).
RESIDUAL = ("batch", "length", "activation_embed")  # [B, T, D], the residual stream
QUERY_HEADS = ("batch", "length", "activation_heads", "head_dim")  # [B, T, N, H]
KV_HEADS = ("batch", "length", "activation_kv_heads", "head_dim")  # [B, T, K, H]
MLP_HIDDEN = ("batch", "length", "activation_mlp")  # [B, T, F]


def param(value: Array, names: tuple[str | None, ...]) -> nnx.Param:
    """An ``nnx.Param`` tagged with logical axis names (one per dim)."""
    if len(names) != np.ndim(value):
        raise ValueError(f"{len(names)} axis names {names} for a parameter of shape {np.shape(value)}")
    return nnx.Param(value, out_sharding=tuple(names), eager_sharding=False)


def normal_param(rngs: nnx.Rngs, shape, names, dtype, std: float = INIT_STD) -> nnx.Param:
    return param((std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype), names)


def projection_kernel(config: ModelConfig, rngs: nnx.Rngs, shape, names, dtype) -> nnx.Param | QuantizedKernel:
    """A projection's kernel: an ``nnx.Param``, or under QLoRA (``config.lora.quantize``) its
    quantised codes and scales."""
    kernel = normal_param(rngs, shape, names, dtype)
    spec = config.lora
    if spec is None or spec.quantize == "none":
        return kernel
    return QuantizedKernel(kernel[...], names, kind=spec.quantize, block_size=spec.quant_block_size)


def const_param(value: float, shape, names, dtype) -> nnx.Param:
    return param(jnp.full(shape, value, dtype), names)


def activation_fn(name: str):
    return {
        "silu": jax.nn.silu,
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "relu": jax.nn.relu,
    }[name]


class Norm(nnx.Module):
    """RMSNorm ``x / sqrt(mean(x^2) + eps) * scale`` (Zhang & Sennrich 2019) or LayerNorm
    ``(x - mean) / sqrt(var + eps) * scale + bias`` (Ba et al. 2016) over the last axis.

    Statistics in float32; the normalised activations are cast back to the input dtype
    before the scale, as transformers does. With ``offset`` (Gemma's RMSNorm: 1.0) the
    scale is ``offset + w``, ``w`` starting at 0, applied in float32 before the cast back.
    """

    def __init__(self, size: int, *, kind: str, eps: float, param_dtype, names=("norm",), offset: float = 0.0):
        self.kind = kind
        self.eps = eps
        self.offset = offset
        self.scale = const_param(1.0 - offset, (size,), names, param_dtype)
        self.bias = const_param(0.0, (size,), names, param_dtype) if kind == "layer" else None

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        if self.kind == "rms":
            y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
            if self.offset:
                return (y * (self.offset + self.scale[...].astype(jnp.float32))).astype(x.dtype)
            return self.scale[...].astype(x.dtype) * y.astype(x.dtype)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


def rope_sin_cos(positions: Array, inv_freq: np.ndarray) -> tuple[Array, Array]:
    """``sin, cos`` of ``positions[..., None] * inv_freq``: float32 ``[B, T, H/2]``."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.sin(angles), jnp.cos(angles)


def longrope_sin_cos(positions: Array, config: ModelConfig) -> tuple[Array, Array]:
    """``sin, cos`` of ``longrope`` (Phi-3): the long factors when ``max(positions) + 1`` exceeds
    ``rope_original_max_position_embeddings`` (over the whole call, as transformers picks), else
    the short ones; both times ``rope_attention_factor``. A generation that runs past
    ``original_max`` switches to the long factors at that step while the cached keys keep the
    short ones, as transformers' ``generate`` does; a full forward over the whole sequence uses
    the long ones throughout, so sampler and learner disagree on such rows."""
    short, long = longrope_inv_freqs(config)
    use_long = jnp.max(positions) + 1 > config.rope_original_max_position_embeddings
    sin, cos = rope_sin_cos(positions, jnp.where(use_long, long, short))
    return sin * config.rope_attention_factor, cos * config.rope_attention_factor


def apply_rope(x: Array, sin: Array, cos: Array) -> Array:
    """Rotate ``x [B, T, heads, H]`` by the angles (halves layout, transformers' ``rotate_half``).

    ``out = x * cos + rotate_half(x) * sin`` with ``rotate_half([x1, x2]) = [-x2, x1]``;
    computed in float32, returned in ``x.dtype``.
    """
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    sin, cos = sin[:, :, None, :], cos[:, :, None, :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KeyMask:
    """What the fused kernels (splash, cuDNN) need of a full pass's mask: causal over the
    real keys ``mask [B, T]`` (the decoder passes this instead of the dense ``allowed``)."""

    mask: Array


def fused_attention(q: Array, k: Array, v: Array, mask: Array, *, scale: float, implementation: str) -> Array:
    """Causal attention over the real tokens of a full pass through ``jax.nn.dot_product_attention``
    with no dense mask: ``q [B, T, N, H]``, ``k, v [B, T, K, H]`` (grouped heads), ``mask [B, T]``
    (1 = real token, anywhere in the row: left padding, right padding or holes) -> ``[B, T, N, H]``.

    The kernel's own masks are ``is_causal`` and per-row sequence lengths, which describe a
    right-padded row only. So each row's real tokens are gathered to its front, in order
    (a stable sort of the pad flags), attended with ``query_seq_lengths = key_value_seq_lengths
    = sum(mask)``, and put back. Causality among real tokens is their order, which the
    gather keeps; positions (RoPE) were applied before, so they travel with q and k. Pad
    queries get zeros (the materialised path gives them finite garbage; nothing reads them).
    The gathers cost ``O(B T N H)``, where the dense mask they replace is ``[B, T, T]``.

    ``implementation="cudnn"`` is cuDNN's fused kernel (GPU, bfloat16/float16; no
    ``[B, N, T, S]`` scores kept for the backward pass); ``"xla"`` runs the same call on any
    backend (the suite checks the arguments with it on CPU).
    """
    real = mask.astype(bool)
    order = jnp.argsort(jnp.logical_not(real).astype(jnp.int32), axis=1, stable=True)  # [B, T] real first
    restore = jnp.argsort(order, axis=1)
    lengths = jnp.sum(real, axis=1, dtype=jnp.int32)  # [B]

    def along_rows(x, index):
        return jnp.take_along_axis(x, index[:, :, None, None], axis=1)

    out = jax.nn.dot_product_attention(
        along_rows(q, order), along_rows(k, order), along_rows(v, order), scale=scale, is_causal=True,
        query_seq_lengths=lengths, key_value_seq_lengths=lengths, implementation=implementation)
    return jnp.where(real[:, :, None, None], along_rows(out, restore), 0).astype(q.dtype)


class Attention(nnx.Module):
    """Grouped-query self-attention with optional q/k/v/o biases and q/k RMS norms.

    Scores ``q k^T * scale`` and the softmax are float32; ``allowed [B, T, S]`` selects
    the keys each query sees (causal + padding, built once per forward by the decoder).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        pd = jnp.dtype(c.param_dtype)
        D, N, K, H = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        self.config = c
        self.q_kernel = projection_kernel(c, rngs, (D, N, H), ("embed", "heads", "head_dim"), pd)
        self.k_kernel = projection_kernel(c, rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), pd)
        self.v_kernel = projection_kernel(c, rngs, (D, K, H), ("embed", "kv_heads", "head_dim"), pd)
        self.o_kernel = projection_kernel(c, rngs, (N, H, D), ("heads", "head_dim", "embed"), pd)
        if c.qkv_bias:
            self.q_bias = const_param(0.0, (N, H), ("heads", "head_dim"), pd)
            self.k_bias = const_param(0.0, (K, H), ("kv_heads", "head_dim"), pd)
            self.v_bias = const_param(0.0, (K, H), ("kv_heads", "head_dim"), pd)
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        self.o_bias = const_param(0.0, (D,), ("embed",), pd) if c.out_bias else None
        if c.qk_norm:
            self.q_norm = Norm(H, kind="rms", eps=c.norm_eps, param_dtype=pd, offset=c.norm_offset)
            self.k_norm = Norm(H, kind="rms", eps=c.norm_eps, param_dtype=pd, offset=c.norm_offset)
        else:
            self.q_norm = self.k_norm = None
        self.q_lora = adapter(c.lora, "q", (D,), (N, H), ("embed",), ("heads", "head_dim"), pd, rngs)
        self.k_lora = adapter(c.lora, "k", (D,), (K, H), ("embed",), ("kv_heads", "head_dim"), pd, rngs)
        self.v_lora = adapter(c.lora, "v", (D,), (K, H), ("embed",), ("kv_heads", "head_dim"), pd, rngs)
        self.o_lora = adapter(c.lora, "o", (N, H), (D,), ("heads", "head_dim"), ("embed",), pd, rngs)

    def _project(self, x: Array, kernel, bias: nnx.Param | None, lora=None) -> Array:
        y = project(x, kernel)  # [B, T, D] x [D, N, H]
        if lora is not None:
            y = y + lora(x)
        return y if bias is None else y + bias[...].astype(x.dtype)

    def __call__(
        self,
        x: Array,
        sin_cos: tuple[Array, Array] | None,
        allowed: Array,
        kv: tuple[Array, Array] | None,
        index: Array | None,
        layer: Array | int = 0,
    ) -> tuple[Array, tuple[Array, Array] | None]:
        """``kv`` is the whole stacked cache ``([L, B, S, K, H], [L, B, S, K, H])``: this
        layer writes its new keys/values at ``[layer, :, index:index+T]`` in place and
        reads ``[layer]`` — no copy of the other layers' slots per step."""
        c = self.config
        q = constrain(self._project(x, self.q_kernel, self.q_bias, self.q_lora), QUERY_HEADS)  # [B, T, N, H]
        k = constrain(self._project(x, self.k_kernel, self.k_bias, self.k_lora), KV_HEADS)  # [B, T, K, H]
        v = constrain(self._project(x, self.v_kernel, self.v_bias, self.v_lora), KV_HEADS)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if sin_cos is not None:
            q, k = apply_rope(q, *sin_cos), apply_rope(k, *sin_cos)
        if kv is not None:
            k_all, v_all = kv
            start = (layer, 0, index, 0, 0)
            k_all = jax.lax.dynamic_update_slice(k_all, k[None].astype(k_all.dtype), start)
            v_all = jax.lax.dynamic_update_slice(v_all, v[None].astype(v_all.dtype), start)
            k = jax.lax.dynamic_index_in_dim(k_all, layer, axis=0, keepdims=False).astype(x.dtype)
            v = jax.lax.dynamic_index_in_dim(v_all, layer, axis=0, keepdims=False).astype(x.dtype)
            kv = (k_all, v_all)
        B, T, N, H = q.shape
        S, K, G = k.shape[1], c.num_kv_heads, c.num_groups
        if isinstance(allowed, KeyMask) and c.attention == "splash":  # a full pass, no packed segments
            out = splash_attention(q, k, v, allowed.mask, scale=c.attention_scale)
        elif isinstance(allowed, KeyMask):  # attention=cudnn, a full pass without packed segments
            out = fused_attention(q, k, v, allowed.mask, scale=c.attention_scale, implementation=c.attention)
        elif T == 1:  # a decode step: contract in place, no transposed copy of the cache
            q = q.reshape(B, T, K, G, H)
            scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=jnp.float32)
            scores = softcap(scores * c.attention_scale, c.attn_softcap)
            scores = jnp.where(allowed[:, None, None, :, :], scores, _MASKED)
            probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
            out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v).reshape(B, T, N, H)
        else:  # attention=xla, and every pass into a KV cache (prefill: no backward, once per generate)
            # Heads-major: each kv head's G query heads x T positions form one [G*T, H]
            # matrix, so both products are plain batched matmuls over (B, K); on CPU this
            # is ~1.6x faster, forward and backward, than contracting G and T separately.
            q = q.reshape(B, T, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * T, H)
            k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, H]
            scores = jnp.einsum("BKMH,BKSH->BKMS", q, k, preferred_element_type=jnp.float32).reshape(B, K, G, T, S)
            scores = softcap(scores * c.attention_scale, c.attn_softcap)
            scores = jnp.where(allowed[:, None, None, :, :], scores, _MASKED)
            probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype).reshape(B, K, G * T, S)
            out = jnp.einsum("BKMS,BKSH->BKMH", probs, v).reshape(B, K, G, T, H)
            out = out.transpose(0, 3, 1, 2, 4).reshape(B, T, N, H)
        out = constrain(out, QUERY_HEADS)
        y = project(out, self.o_kernel, in_axes=2)  # [B, T, N, H] x [N, H, D]
        if self.o_lora is not None:
            y = y + self.o_lora(out)
        if self.o_bias is not None:
            y = y + self.o_bias[...].astype(x.dtype)
        return constrain(y, RESIDUAL), kv


class MLP(nnx.Module):
    """Gated ``down(act(gate(x)) * up(x))`` (SwiGLU, Shazeer 2020) or plain ``down(act(up(x)))``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        pd = jnp.dtype(c.param_dtype)
        D, F = c.hidden_size, c.intermediate_size
        self.activation = c.activation
        self.gate_kernel = projection_kernel(c, rngs, (D, F), ("embed", "mlp"), pd) if c.gated_mlp else None
        self.up_kernel = projection_kernel(c, rngs, (D, F), ("embed", "mlp"), pd)
        self.down_kernel = projection_kernel(c, rngs, (F, D), ("mlp", "embed"), pd)
        if c.mlp_bias:
            self.gate_bias = const_param(0.0, (F,), ("mlp",), pd) if c.gated_mlp else None
            self.up_bias = const_param(0.0, (F,), ("mlp",), pd)
            self.down_bias = const_param(0.0, (D,), ("embed",), pd)
        else:
            self.gate_bias = self.up_bias = self.down_bias = None
        gate_lora = adapter(c.lora, "gate", (D,), (F,), ("embed",), ("mlp",), pd, rngs) if c.gated_mlp else None
        self.gate_lora = gate_lora
        self.up_lora = adapter(c.lora, "up", (D,), (F,), ("embed",), ("mlp",), pd, rngs)
        self.down_lora = adapter(c.lora, "down", (F,), (D,), ("mlp",), ("embed",), pd, rngs)

    @staticmethod
    def _linear(x, kernel, bias, lora=None):
        y = project(x, kernel)
        if lora is not None:
            y = y + lora(x)
        return y if bias is None else y + bias[...].astype(x.dtype)

    def __call__(self, x: Array) -> Array:
        act = activation_fn(self.activation)
        h = constrain(self._linear(x, self.up_kernel, self.up_bias, self.up_lora), MLP_HIDDEN)
        if self.gate_kernel is not None:
            h = act(constrain(self._linear(x, self.gate_kernel, self.gate_bias, self.gate_lora), MLP_HIDDEN)) * h
        else:
            h = act(h)
        return constrain(self._linear(h, self.down_kernel, self.down_bias, self.down_lora), RESIDUAL)


class Block(nnx.Module):
    """One pre-norm decoder layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; with
    ``config.post_norms`` (Gemma 2 and 3) ``x + post_norm(attn(norm(x)))`` and the same
    around the MLP.

    Its input, the stream between attention and MLP, and its output are pinned to
    :data:`RESIDUAL` (the layer boundaries FSDP needs). ``sin_cos`` and ``allowed`` may
    differ between sliding and full layers (:mod:`alignax.models.layer_types`): the layer
    takes its own. ``mlp_cls`` builds the MLP: :class:`MLP`, or a mixture of experts
    (:class:`alignax.models.moe.MoE`) that also returns its router probabilities; the block
    returns ``(x, kv, router probabilities [B, T, E] or None)``.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, mlp_cls=None):
        c = config
        pd = jnp.dtype(c.param_dtype)

        def norm():
            return Norm(c.hidden_size, kind=c.norm_type, eps=c.norm_eps, param_dtype=pd, offset=c.norm_offset)

        self.sliding_layers = c.sliding_layers
        self.attn_norm = norm()
        self.attn = Attention(c, rngs=rngs)
        self.mlp_norm = norm()
        self.mlp = (mlp_cls or MLP)(c, rngs=rngs)
        self.attn_post_norm = norm() if c.post_norms else None
        self.mlp_post_norm = norm() if c.post_norms else None

    def __call__(self, x, sin_cos, allowed, kv, index, layer=0):
        sin_cos, allowed = pick(sin_cos, layer, self.sliding_layers), pick(allowed, layer, self.sliding_layers)
        with layer_dropout(layer):  # adapter dropout masks differ per layer (alignax.models.lora)
            x = constrain(x, RESIDUAL)
            h, kv = self.attn(self.attn_norm(x), sin_cos, allowed, kv, index, layer)
            if self.attn_post_norm is not None:
                h = self.attn_post_norm(h)
            x = constrain(x + h, RESIDUAL)
            h = self.mlp(self.mlp_norm(x))
            h, router_probs = h if isinstance(h, tuple) else (h, None)
            if self.mlp_post_norm is not None:
                h = self.mlp_post_norm(h)
            x = constrain(x + h, RESIDUAL)
        return x, kv, router_probs
