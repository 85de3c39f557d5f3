"""The decoder trunk and the four models built on it: LM, critic, policy+value, reward.

All share one forward signature::

    model(tokens [B, T] int, positions [B, T] int, attention_mask [B, T] (1 = real token),
          *, cache=None) -> ModelOutput

- ``positions`` are explicit so a left-padded row gives the same outputs as the same
  row unpadded: use :func:`positions_from_mask` (``cumsum(mask) - 1``, clipped at 0).
  When ``positions`` is ``None`` and there is no cache it is derived that way.
- The mask is causal (slot order) and drops pad keys; pad queries give finite garbage.
  Sliding-window layers (Mistral, Phi-3, Gemma 2 and 3) also drop keys outside their
  window, counted in positions (:mod:`alignax.models.layer_types`).
- ``segment_ids [B, T]`` (LM, policy+value and reward models, no cache) pack one prefix with
  several continuations in a row: a key of segment 0 (the shared prefix) is seen by every
  later query, a key of segment ``k > 0`` only by queries of segment ``k``. With restarted
  positions per continuation, each continuation's outputs equal those of the
  prefix + continuation row on its own (see ``alignax.trainers.engine.packing``).
- ``cache`` (:class:`alignax.models.cache.KVCache`) is written and returned in
  ``ModelOutput.cache``; see cache.py for the layout and the mask over cache slots.

Outputs are float32 where they are scores: ``logits [B, T, V]``, ``values [B, T]``,
``rewards [B]`` (``[B, num_labels]`` when ``num_labels > 1``). ``hidden [B, T, D]`` is the
final-norm output in the compute dtype, which :func:`token_logprobs_from_hidden` turns
into per-token log-probs chunk by chunk without the full ``[B, T, V]`` logits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from alignax import ops
from alignax._checks import check_rank, check_same_shape
from alignax.models.cache import KVCache, slot_positions
from alignax.models.config import ModelConfig, local_rope_inv_freq, rope_inv_freq
from alignax.models.dense import DENSE_OUTPUT, dense
from alignax.models.layer_types import by_layer_type, softcap, window_mask
from alignax.models.layers import RESIDUAL, Block, KeyMask, Norm, longrope_sin_cos, normal_param, param, rope_sin_cos
from alignax.models.lora import adapter
from alignax.models.moe import MoE, load_balancing_loss, record_router_loss
from alignax.parallel.sharding import constrain

Array = jax.Array


@struct.dataclass
class ModelOutput:
    """What a forward returns; fields a model does not compute are ``None``."""

    logits: Array | None = None  # [B, T, V] float32
    hidden: Array | None = None  # [B, T, D] compute dtype, after the final norm
    values: Array | None = None  # [B, T] float32 (value heads; a reward head's per-token scores)
    rewards: Array | None = None  # [B] float32 at the last real token (reward head)
    cache: KVCache | None = None
    router_probs: Array | None = None  # [L, B, T, E] float32, mixture-of-experts models
    router_aux_loss: Array | None = None  # float32 load-balancing loss of a full pass (alignax.models.moe)


def positions_from_mask(attention_mask: Array) -> Array:
    """Position of each token among the real tokens of its row: ``clip(cumsum(mask) - 1, 0)``.

    A left-padded row ``[0, 0, 1, 1, 1]`` gets ``[0, 0, 0, 1, 2]``: its real tokens sit
    at the positions they would have unpadded.
    """
    check_rank(attention_mask=(attention_mask, 2))
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def last_token_index(attention_mask: Array) -> Array:
    """Index ``[B]`` of the rightmost real token of each row (0 for an all-pad row).

    Works for left and right padding alike; with pad id == eos id the real end-of-turn
    token is found through the mask, never through token ids.
    """
    check_rank(attention_mask=(attention_mask, 2))
    t = jnp.arange(attention_mask.shape[1], dtype=jnp.int32)
    return jnp.max(jnp.where(attention_mask.astype(bool), t, 0), axis=-1)


def _stack_layer_metadata(state):
    """Prepend the logical axis ``layers`` to every parameter of a vmapped layer state."""

    def add(v):  # keeps the variable's type (an adapter's LoRAParam stays one)
        return type(v)(v.get_value(), out_sharding=("layers", *v.get_metadata()["out_sharding"]),
                       eager_sharding=False)

    return jax.tree.map(add, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


class Decoder(nnx.Module):
    """Token (+ learned position) embeddings, ``L`` pre-norm layers, final norm.

    With ``config.scan_layers`` the layers are one :class:`Block` whose parameters carry a
    leading ``[L]`` axis, run by ``jax.lax.scan``; otherwise an ``nnx.List`` of blocks.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        pd = jnp.dtype(c.param_dtype)
        self.config = c
        self.embed = normal_param(rngs, (c.vocab_size, c.hidden_size), ("vocab", "embed"), pd)
        if c.position_embedding == "learned":
            self.pos_embed = normal_param(
                rngs, (c.max_position_embeddings, c.hidden_size), ("positions", "embed"), pd
            )
        else:
            self.pos_embed = None
        # Layers are initialised together under vmap (one random op per parameter kind,
        # not per layer: XLA compile time of the init does not grow with L), then kept
        # stacked for scan or split into a list.
        keys = jax.random.split(rngs.params(), c.num_layers)
        mlp_cls = MoE if c.num_experts else None
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: Block(c, rngs=nnx.Rngs(0), mlp_cls=mlp_cls)))
        stacked = jax.vmap(lambda key: nnx.state(Block(c, rngs=nnx.Rngs(params=key), mlp_cls=mlp_cls)))(keys)
        if c.scan_layers:
            self.layers = nnx.merge(graphdef, _stack_layer_metadata(stacked))
        else:
            self.layers = nnx.List(
                [nnx.merge(graphdef, jax.tree.map(lambda x, i=i: x[i], stacked)) for i in range(c.num_layers)]
            )
        self.final_norm = Norm(c.hidden_size, kind=c.norm_type, eps=c.norm_eps, param_dtype=pd, offset=c.norm_offset)

    def __call__(
        self,
        tokens: Array,
        positions: Array,
        attention_mask: Array,
        *,
        cache: KVCache | None = None,
        segment_ids: Array | None = None,
    ) -> tuple[Array, KVCache | None, Array | None]:
        """``(hidden [B, T, D], cache, router probabilities [L, B, T, E] float32 or None)``;
        see the module docstring."""
        c = self.config
        check_rank(tokens=(tokens, 2))
        check_same_shape(tokens=tokens, positions=positions, attention_mask=attention_mask)
        if segment_ids is not None:
            if cache is not None:
                raise ValueError("segment_ids are for full forward passes; a cached decode step cannot take them")
            check_same_shape(tokens=tokens, segment_ids=segment_ids)
        mask = attention_mask.astype(bool)
        x = self._embed(tokens, positions)
        if c.position_embedding != "rope":
            sin_cos = None
        else:  # Phi-3's longrope picks its factors from the positions
            sin_cos = longrope_sin_cos(positions, c) if c.rope_type == "longrope" else rope_sin_cos(
                positions, rope_inv_freq(c))
        allowed, index, kv, slot_mask, query_positions, key_positions = self._attention_inputs(
            tokens, positions, mask, cache, segment_ids)
        if any(c.sliding_layers):
            sin_cos, allowed = self._sliding_inputs(sin_cos, allowed, positions, query_positions, key_positions)
        x, kv, router_probs = self._run_layers(x, sin_cos, allowed, kv, index)
        hidden = constrain(self.final_norm(x), RESIDUAL)
        if cache is None:
            return hidden, None, router_probs
        return hidden, KVCache(k=kv[0], v=kv[1], mask=slot_mask, index=index + tokens.shape[1]), router_probs

    def _embed(self, tokens: Array, positions: Array) -> Array:
        """Token (and GPT-2's learned position) embeddings ``[B, T, D]`` in the compute dtype."""
        c = self.config
        dtype = jnp.dtype(c.dtype)
        x = jnp.take(self.embed[...], tokens, axis=0)
        if c.scale_embeddings:  # Gemma: times sqrt(D), rounded to the table's dtype as transformers does
            x = x * jnp.asarray(c.hidden_size**0.5, x.dtype)
        x = x.astype(dtype)
        if self.pos_embed is not None:
            x = x + jnp.take(self.pos_embed[...], positions, axis=0, mode="clip").astype(dtype)
        # Rows looked up in the fsdp-sharded table come out split on D; in two steps (batch
        # over data while D stays on fsdp, then an all-to-all over fsdp) they reach the
        # batch axes without the table being gathered, where one step makes XLA replicate
        # them on some meshes (its "involuntary full rematerialization").
        x = constrain(constrain(x, ("activation_lookup_batch", "length", "embed")), RESIDUAL)
        return x

    def _attention_inputs(self, tokens, positions, mask, cache, segment_ids):
        """``(allowed, index, kv, slot_mask, query_positions, key_positions)``: which keys each
        query sees (``[B, T, T]``, ``[B, T, S]`` with a cache, or a ``KeyMask`` for the fused
        kernels), the cache's write index, stacked keys/values and slot mask, and the positions
        the sliding windows are counted in."""
        c = self.config
        T = tokens.shape[1]
        if cache is None and c.attention in ("splash", "cudnn"):  # fused kernels: causal + real keys only
            if segment_ids is not None:
                raise ValueError(f"model.attention={c.attention} cannot run shared-prompt packing (segment_ids: a "
                                 "prefix every continuation sees); set rollout.pack_groups=off or model.attention=xla")
            allowed, index, kv, slot_mask = KeyMask(mask), None, None, None
            query_positions = key_positions = None
        elif cache is None:
            t = jnp.arange(T)
            allowed = (t[None, :] <= t[:, None])[None] & mask[:, None, :]  # [B, T, T]
            if segment_ids is not None:  # segment 0 is a shared prefix; others see only themselves
                seg = jnp.asarray(segment_ids)
                allowed = allowed & ((seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None]))
            index, kv, slot_mask = None, None, None
            query_positions = key_positions = positions
        else:
            if cache.k.shape[1] != tokens.shape[0] or cache.k.shape[0] != c.num_layers:
                raise ValueError(
                    f"cache k has shape {cache.k.shape}; expected [L={c.num_layers}, B={tokens.shape[0]}, S, K, H]"
                )
            if T > cache.max_len:
                raise ValueError(f"{T} new tokens do not fit a cache of {cache.max_len} slots")
            index = cache.index
            slot_mask = jax.lax.dynamic_update_slice(cache.mask, mask, (0, index))
            q_slots = index + jnp.arange(T)
            k_slots = jnp.arange(cache.max_len)
            allowed = (k_slots[None, :] <= q_slots[:, None])[None] & slot_mask[:, None, :]  # [B, T, S]
            kv = (cache.k, cache.v)
            key_positions = slot_positions(slot_mask)
            query_positions = jax.lax.dynamic_slice_in_dim(key_positions, index, T, axis=1)

        return allowed, index, kv, slot_mask, query_positions, key_positions

    def _sliding_inputs(self, sin_cos, allowed, positions, query_positions, key_positions):
        """``(sin_cos, allowed)`` with the sliding layers' forms beside the full layers'
        (:mod:`alignax.models.layer_types`): keys within the window, and Gemma 3's local RoPE."""
        c = self.config
        local = allowed & window_mask(query_positions, key_positions, c.sliding_window)
        allowed = by_layer_type(c.sliding_layers, allowed, local)
        if c.rope_local_theta is not None and sin_cos is not None:
            sin_cos = by_layer_type(c.sliding_layers, sin_cos, rope_sin_cos(positions, local_rope_inv_freq(c)))
        return sin_cos, allowed

    def _run_layers(self, x, sin_cos, allowed, kv, index):
        """Run every layer; ``kv`` (the stacked cache, or ``None``) is threaded through
        them whole and each layer updates its own slice in place. Mixture layers' router
        probabilities come out stacked ``[L, B, T, E]`` (``None`` for dense layers)."""
        c = self.config
        if c.scan_layers:
            graphdef, state = nnx.split(self.layers)

            def body(carry, xs):
                h, layer_kv = carry
                layer_state, layer = xs
                h, layer_kv, probs = nnx.merge(graphdef, layer_state)(h, sin_cos, allowed, layer_kv, index, layer)
                return (h, layer_kv), probs

            if c.remat != "none":
                body = jax.checkpoint(body, prevent_cse=False, policy=remat_policy(c.remat))
            (x, kv), router_probs = jax.lax.scan(body, (x, kv), (state, jnp.arange(c.num_layers)))
            return x, kv, router_probs

        per_layer = []
        for i, layer in enumerate(self.layers):
            if c.remat != "none":
                graphdef, state = nnx.split(layer)

                def run(layer_state, h, layer_kv, graphdef=graphdef, i=i):
                    return nnx.merge(graphdef, layer_state)(h, sin_cos, allowed, layer_kv, index, i)

                x, kv, probs = jax.checkpoint(run, policy=remat_policy(c.remat))(state, x, kv)
            else:
                x, kv, probs = layer(x, sin_cos, allowed, kv, index, i)
            per_layer.append(probs)
        return x, kv, (None if per_layer[0] is None else jnp.stack(per_layer))


def remat_policy(name: str):
    """The ``jax.checkpoint`` policy of ``ModelConfig.remat`` (``None``: save nothing).

    The projections are custom-VJP matmuls (:func:`alignax.models.dense.dense`) whose
    outputs are named :data:`DENSE_OUTPUT`; the attention products are plain ``dot_general``
    with batch axes. So "the dots" are the named projection outputs, plus the attention
    products for ``dots_saveable``."""
    policies = jax.checkpoint_policies
    projections = policies.save_only_these_names(DENSE_OUTPUT)
    return {
        "full": None,
        "dots_saveable": policies.save_from_both_policies(projections, policies.dots_saveable),
        "dots_with_no_batch_dims_saveable": projections,
        "offload_dots": policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=[DENSE_OUTPUT],
            offload_src="device", offload_dst="pinned_host"),
    }[name]


def _prepare(tokens, positions, attention_mask, cache):
    tokens = jnp.asarray(tokens)
    if attention_mask is None:
        attention_mask = jnp.ones(tokens.shape, jnp.int32)
    if positions is None:
        if cache is not None:
            raise ValueError("positions are required with a cache (decode steps cannot infer them from the mask)")
        positions = positions_from_mask(attention_mask)
    return tokens, jnp.asarray(positions), jnp.asarray(attention_mask)


def _routing(config: ModelConfig, router_probs, attention_mask, cache) -> dict:
    """A mixture model's routing for :class:`ModelOutput`: its router probabilities and, for a
    full pass (no cache), its load-balancing loss, recorded for the train step
    (:func:`alignax.models.moe.record_router_loss`)."""
    if router_probs is None:
        return {}
    if cache is not None:  # a prefill or decode step: nothing trains on it
        return {"router_probs": router_probs}
    aux = load_balancing_loss(router_probs, attention_mask, top_k=config.num_experts_per_tok)
    record_router_loss(aux, config.router_aux_loss_coef)
    return {"router_probs": router_probs, "router_aux_loss": aux}


class _LMHeadMixin:
    """Unembedding shared by the models that produce logits."""

    def _init_lm_head(self, config: ModelConfig, rngs: nnx.Rngs):
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = normal_param(
                rngs, (config.hidden_size, config.vocab_size), ("embed", "vocab"), jnp.dtype(config.param_dtype)
            )
        if config.lora is not None and "lm_head" in config.lora.targets and not config.tie_word_embeddings:
            self.lm_head_lora = adapter(config.lora, "lm_head", (config.hidden_size,), (config.vocab_size,),
                                        ("embed",), ("vocab",), jnp.dtype(config.param_dtype), rngs)
        else:
            self.lm_head_lora = None

    def logits(self, hidden: Array) -> Array:
        """``hidden [B, ..., D] -> logits [B, ..., V]`` in float32 (accumulated in float32).

        On a mesh the rows stay on the batch axes and the head's weight is gathered (the
        same FSDP pinning as the decoder layers'), logits split over vocab by the rules.
        """
        rows = ("batch",) + (None,) * (hidden.ndim - 2) if hidden.ndim >= 2 else ()
        hidden = constrain(hidden, (*rows, "activation_embed"))
        if self.lm_head is None:
            w = self.model.embed[...].astype(hidden.dtype)
            logits = dense(hidden, w, transposed=True, out_dtype=jnp.float32)
        else:
            logits = dense(hidden, self.lm_head[...].astype(hidden.dtype), out_dtype=jnp.float32)
        if self.lm_head_lora is not None:
            logits = logits + self.lm_head_lora(hidden, out_dtype=jnp.float32)
        logits = softcap(logits, self.config.final_softcap)  # Gemma 2's final_logit_softcapping
        return constrain(logits, (*rows, "activation_vocab"))


class CausalLM(_LMHeadMixin, nnx.Module):
    """Decoder + LM head (tied to the embeddings or separate). The policy and the reference."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.model = Decoder(config, rngs=rngs)
        self._init_lm_head(config, rngs)

    def __call__(
        self, tokens, positions=None, attention_mask=None, *, cache=None, segment_ids=None, return_logits: bool = True
    ):
        """``ModelOutput(logits, hidden, cache)``; ``return_logits=False`` skips the LM head."""
        tokens, positions, attention_mask = _prepare(tokens, positions, attention_mask, cache)
        hidden, cache, router_probs = self.model(tokens, positions, attention_mask, cache=cache,
                                                 segment_ids=segment_ids)
        routing = _routing(self.config, router_probs, attention_mask, cache)
        logits = self.logits(hidden) if return_logits else None
        return ModelOutput(logits=logits, hidden=hidden, cache=cache, **routing)


def _head_param(config: ModelConfig, rngs: nnx.Rngs, num_out: int, zero_init: bool) -> nnx.Param:
    shape = (config.hidden_size, num_out)
    names = ("embed", "labels")
    pd = jnp.dtype(config.param_dtype)
    if zero_init:
        return param(jnp.zeros(shape, pd), names)
    return normal_param(rngs, shape, names, pd, std=1.0 / np.sqrt(config.hidden_size + 1))


def _score(hidden: Array, kernel: nnx.Param) -> Array:
    return dense(hidden, kernel[...].astype(hidden.dtype), out_dtype=jnp.float32)


class ValueModel(nnx.Module):
    """A separate critic: decoder + per-token value head ``values = hidden @ w`` (no bias).

    ``values[b, t]`` estimates the return after token ``t`` (PPO's V(s_t), Schulman et
    al. 2017). The head starts at zero (``zero_init_head=True``, every value 0) or is
    copied from a reward model with :meth:`from_reward_model`, the usual critic
    initialisation (Ouyang et al. 2022).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, zero_init_head: bool = True):
        self.config = config
        self.model = Decoder(config, rngs=rngs)
        self.value_head = _head_param(config, rngs, 1, zero_init_head)

    @classmethod
    def from_reward_model(cls, reward_model: RewardModel) -> ValueModel:
        """A critic whose trunk and head are copies of ``reward_model``'s."""
        if reward_model.config.num_labels != 1:
            raise ValueError(
                f"a value head needs a reward model with num_labels=1; got {reward_model.config.num_labels}"
            )
        critic = nnx.eval_shape(lambda: cls(reward_model.config, rngs=nnx.Rngs(0)))
        nnx.update(critic, {"model": nnx.state(reward_model.model)})
        critic.value_head = param(jnp.array(reward_model.score[...]), ("embed", "labels"))
        return critic

    def __call__(self, tokens, positions=None, attention_mask=None, *, cache=None):
        """``ModelOutput(values [B, T] float32, hidden, cache)``."""
        tokens, positions, attention_mask = _prepare(tokens, positions, attention_mask, cache)
        hidden, cache, router_probs = self.model(tokens, positions, attention_mask, cache=cache)
        routing = _routing(self.config, router_probs, attention_mask, cache)
        values = _score(hidden, self.value_head)[..., 0]
        return ModelOutput(hidden=hidden, values=values, cache=cache, **routing)


class PolicyValueModel(_LMHeadMixin, nnx.Module):
    """Policy and critic on one shared trunk: LM head and value head on the same hidden states."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, zero_init_head: bool = True):
        self.config = config
        self.model = Decoder(config, rngs=rngs)
        self._init_lm_head(config, rngs)
        self.value_head = _head_param(config, rngs, 1, zero_init_head)

    def init_value_head_from(self, reward_model: RewardModel) -> None:
        """Copy a reward model's score head (``num_labels=1``) into the value head."""
        if reward_model.config.num_labels != 1 or reward_model.config.hidden_size != self.config.hidden_size:
            raise ValueError("the reward model must have num_labels=1 and the same hidden_size")
        self.value_head[...] = jnp.asarray(reward_model.score[...], self.value_head[...].dtype)

    def __call__(
        self, tokens, positions=None, attention_mask=None, *, cache=None, segment_ids=None, return_logits: bool = True
    ):
        """``ModelOutput(logits, hidden, values [B, T], cache)``."""
        tokens, positions, attention_mask = _prepare(tokens, positions, attention_mask, cache)
        hidden, cache, router_probs = self.model(tokens, positions, attention_mask, cache=cache,
                                                 segment_ids=segment_ids)
        routing = _routing(self.config, router_probs, attention_mask, cache)
        logits = self.logits(hidden) if return_logits else None
        values = _score(hidden, self.value_head)[..., 0]
        return ModelOutput(logits=logits, hidden=hidden, values=values, cache=cache, **routing)


class RewardModel(nnx.Module):
    """Decoder + score head read at the last real token: ``r_b = hidden[b, last_b] @ w``.

    ``last_b`` is :func:`last_token_index` of the attention mask (the rightmost real
    token), as in transformers' ``*ForSequenceClassification`` with the pad id replaced
    by the mask. Bradley-Terry reward models (Ouyang et al. 2022) use ``num_labels=1``:
    ``rewards`` is ``[B]``; otherwise ``[B, num_labels]``.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.model = Decoder(config, rngs=rngs)
        self.score = _head_param(config, rngs, config.num_labels, zero_init=False)

    def __call__(self, tokens, positions=None, attention_mask=None, *, cache=None, segment_ids=None,
                 per_token: bool = False):
        """``ModelOutput(rewards [B] float32, hidden, cache)``.

        ``per_token=True`` (a process reward model, ``num_labels=1``) also gives ``values
        [B, T]``: the score head at every position, ``hidden[b, t] @ w``; the score at a
        step's end token is that step's score (the prefix up to it, read causally), and
        ``rewards`` is the one at the last real token. ``segment_ids`` pack several
        continuations of one prefix in a row (see the module docstring)."""
        tokens, positions, attention_mask = _prepare(tokens, positions, attention_mask, cache)
        hidden, cache, router_probs = self.model(tokens, positions, attention_mask, cache=cache,
                                                 segment_ids=segment_ids)
        routing = _routing(self.config, router_probs, attention_mask, cache)
        last = last_token_index(attention_mask)
        pooled = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [B, D]
        rewards = _score(pooled, self.score)
        if self.config.num_labels == 1:
            rewards = rewards[:, 0]
        values = _score(hidden, self.score)[..., 0] if per_token else None
        return ModelOutput(hidden=hidden, rewards=rewards, values=values, cache=cache, **routing)


def _chunk_time(x: Array, chunk: int) -> Array:
    """``[B, T, ...] -> [n, B, chunk, ...]``, ``T`` zero-padded up to ``n * chunk``."""
    t = x.shape[1]
    n = -(-t // chunk)
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, n * chunk - t)
    x = jnp.pad(x, widths).reshape(x.shape[0], n, chunk, *x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _unchunk_time(y: Array, t: int) -> Array:
    return jnp.moveaxis(y, 0, 1).reshape(y.shape[1], -1)[:, :t]


def map_time_chunks(fn, hidden: Array, targets: Array, *, chunk_size: int | None, remat: bool = False):
    """``fn(hidden, targets)`` (``[B, T, D]``, ``[B, T]`` -> a tree of ``[B, T]`` arrays) applied
    ``chunk_size`` positions at a time with ``jax.lax.map``, so that whatever ``fn`` builds per
    position (the ``[B, chunk, V]`` logits) never exists for the whole sequence; the results are
    those of one call. ``remat``: each chunk under ``jax.checkpoint``, so that the backward pass
    recomputes a chunk's logits rather than keep them. ``chunk_size`` ``None`` or ``>= T``: one call."""
    t = hidden.shape[1]
    if chunk_size is None or chunk_size >= t:
        return fn(hidden, targets)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    body = jax.checkpoint(fn) if remat else fn
    outs = jax.lax.map(lambda args: body(*args), (_chunk_time(hidden, chunk_size), _chunk_time(targets, chunk_size)))
    return jax.tree.map(lambda y: _unchunk_time(y, t), outs)


def token_logprobs_from_hidden(
    hidden: Array,
    model: CausalLM | PolicyValueModel,
    targets: Array,
    *,
    chunk_size: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> Array | tuple[Array, Array]:
    """Per-token ``log softmax(hidden @ W / temperature)[targets]``, float32 ``[B, T]``.

    Args:
      hidden: ``[B, T, D]`` final hidden states (``model(..., return_logits=False).hidden``);
        position ``t`` scores ``targets[:, t]`` (shift first: ``hidden[:, :-1]`` against
        ``tokens[:, 1:]``).
      model: supplies the unembedding (``model.logits``).
      targets: ``[B, T]`` token ids.
      chunk_size: when set, the time axis is processed ``chunk_size`` positions at a time
        under ``jax.checkpoint``: no ``[B, T, V]`` logits exist in the forward or the
        backward pass, only ``[B, chunk_size, V]``. Results equal the unchunked path.
      with_entropy: also return the entropy of each position's distribution.

    Built on :func:`alignax.ops.token_logprobs` / ``token_logprobs_and_entropy``.
    """
    check_rank(hidden=(hidden, 3), targets=(targets, 2))
    if hidden.shape[:2] != targets.shape:
        raise ValueError(f"hidden {hidden.shape} and targets {targets.shape} disagree on [B, T]")

    def fn(h, tg):
        logits = model.logits(h)
        if with_entropy:
            return ops.token_logprobs_and_entropy(logits, tg, temperature=temperature)
        return ops.token_logprobs(logits, tg, temperature=temperature)

    return map_time_chunks(fn, hidden, targets, chunk_size=chunk_size, remat=True)


MODEL_KINDS = {"causal_lm": CausalLM, "reward": RewardModel, "value": ValueModel, "policy_value": PolicyValueModel}


def create_model(config: ModelConfig, *, kind: str = "causal_lm", seed: int = 0, mesh=None):
    """A randomly initialised model of ``kind`` (see :data:`MODEL_KINDS`), built in one
    ``jax.jit`` (fast even for many layers); with ``mesh``, each parameter is created
    directly in its sharding from the logical-axis rules (:func:`alignax.parallel.create_sharded`).
    """
    from alignax._checks import check_choice
    from alignax.parallel.sharding import create_sharded

    check_choice("kind", kind, MODEL_KINDS)
    cls = MODEL_KINDS[kind]

    def constructor():
        return cls(config, rngs=nnx.Rngs(seed))

    if mesh is not None:
        return create_sharded(constructor, mesh)
    graphdef, _ = nnx.split(nnx.eval_shape(constructor))
    state = jax.jit(lambda: nnx.state(constructor()))()
    return nnx.merge(graphdef, state)
