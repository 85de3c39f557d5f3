"""Mixture-of-experts MLP (Qwen3-MoE): a softmax router, top-k experts on stacked weights,
the Switch load-balancing loss, and the trace-time record of that loss for the train step.

Per token ``x [D]`` of a layer (Shazeer et al. 2017; Fedus et al. 2022, Switch Transformer;
the form of transformers' ``Qwen3MoeSparseMoeBlock``)::

    p = softmax(x @ W_router)                       # [E] float32
    S = top_k(p, k)                                 # the k most probable experts
    w_e = p_e (/ sum_{e' in S} p_e' if norm_topk_prob) for e in S, else 0
    y = sum_e w_e * down_e(silu(gate_e(x)) * up_e(x))

The experts' weights are stacked on a leading ``experts`` axis (``[E, D, F]``, ``[E, F, D]``)
and every expert runs on every token as one einsum; the unselected ones get weight 0.
So no token is ever dropped (no capacity factor), the compiled program has no loop over
experts, and an ``experts`` axis sharded over the mesh splits the work by expert (the
sum over ``E`` becomes a reduction across devices). The price is ``E / k`` times the FLOPs
of the selected experts; a grouped matmul over tokens sorted by expert would avoid it.

Load balancing (Switch eq. 4-6, as transformers' ``load_balancing_loss_func`` computes it
over all layers' router probabilities together, real tokens only)::

    f_e = (1/N) sum_{l, t real} [e in S_{l,t}]      # top-k assignments per expert
    P_e = (1/N) sum_{l, t real} p_{l,t,e}           # mean router probability
    aux = E * sum_e f_e P_e,   N = L * (real tokens)

Uniform routing gives ``aux = k``. Trainers add ``router_aux_loss_coef * aux`` to their
objective: each trained model's full forward pass records its ``aux`` here
(:func:`record_router_loss`), the train step collects them (:func:`collect_router_losses`)
and adds each trained model's term once (:func:`router_objective`: the mean over a model's
passes, summed over models; a separate critic's passes run under :func:`routed_model`).
Passes that train nothing (frozen models, a pass under ``stop_gradient``) run under
:func:`frozen_forward` and record nothing. A pass traced inside a ``lax.cond`` branch
collects its own record there and returns the objective (:func:`record_router_objective`).

LoRA (:mod:`alignax.models.lora`) adapts the attention projections of a mixture model; the
router and the experts stay frozen with the base (the load-balancing loss still reaches
the adapters through the router's inputs).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from alignax.models.config import ModelConfig
from alignax.models.layers import MLP_HIDDEN, RESIDUAL, activation_fn, normal_param
from alignax.parallel.sharding import constrain

Array = jax.Array

# Logical axes of the experts' activations (alignax.parallel.LOGICAL_AXIS_RULES).
ROUTER_SCORES = ("batch", "length", None)  # [B, T, E]
EXPERT_HIDDEN = ("batch", "length", "activation_experts", MLP_HIDDEN[-1])  # [B, T, E, F]


class MoE(nnx.Module):
    """The mixture-of-experts MLP of one layer; ``__call__`` returns ``(y [B, T, D], router
    probabilities [B, T, E] float32)``.

    Parameters: ``router [D, E]`` (``embed``, replicated over experts), ``gate_kernel`` and
    ``up_kernel [E, D, F]``, ``down_kernel [E, F, D]`` (``experts``, ``embed``/``mlp``).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        pd = jnp.dtype(c.param_dtype)
        E, D, F = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.activation = c.activation
        self.top_k = c.num_experts_per_tok
        self.norm_topk_prob = c.norm_topk_prob
        self.router = normal_param(rngs, (D, E), ("embed", None), pd)
        self.gate_kernel = normal_param(rngs, (E, D, F), ("experts", "embed", "mlp"), pd)
        self.up_kernel = normal_param(rngs, (E, D, F), ("experts", "embed", "mlp"), pd)
        self.down_kernel = normal_param(rngs, (E, F, D), ("experts", "mlp", "embed"), pd)

    def __call__(self, x: Array) -> tuple[Array, Array]:
        # Router logits in the compute dtype (transformers' F.linear), softmax in float32.
        logits = jnp.einsum("BTD,DE->BTE", x, self.router[...].astype(x.dtype))
        probs = constrain(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), ROUTER_SCORES)
        weights = combine_weights(probs, self.top_k, normalize=self.norm_topk_prob).astype(x.dtype)
        act = activation_fn(self.activation)
        gate = jnp.einsum("BTD,EDF->BTEF", x, self.gate_kernel[...].astype(x.dtype))
        up = jnp.einsum("BTD,EDF->BTEF", x, self.up_kernel[...].astype(x.dtype))
        hidden = constrain(act(gate) * up * weights[..., None], EXPERT_HIDDEN)
        y = jnp.einsum("BTEF,EFD->BTD", hidden, self.down_kernel[...].astype(x.dtype))
        return constrain(y, RESIDUAL), probs


def combine_weights(probs: Array, top_k: int, *, normalize: bool) -> Array:
    """``[..., E]`` router probabilities -> ``[..., E]`` weights: the ``top_k`` largest kept
    (renormalised to sum to 1 when ``normalize``), the rest 0."""
    top, index = jax.lax.top_k(probs, top_k)
    if normalize:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    one_hot = jax.nn.one_hot(index, probs.shape[-1], dtype=probs.dtype)  # [..., k, E]
    return jnp.einsum("...k,...kE->...E", top, one_hot)


def load_balancing_loss(router_probs: Array, attention_mask: Array, *, top_k: int) -> Array:
    """Switch load-balancing loss (module docstring) over every layer's routing.

    Args:
      router_probs: ``[L, B, T, E]`` float32 router probabilities of each layer.
      attention_mask: ``[B, T]``, 1 on real tokens (padding is not counted).
      top_k: experts per token.

    Returns ``E * sum_e f_e P_e`` (float32 scalar); 0 when no token is real.
    """
    num_experts = router_probs.shape[-1]
    mask = attention_mask.astype(jnp.float32)[None, :, :, None]  # [1, B, T, 1]
    _, index = jax.lax.top_k(router_probs, top_k)
    chosen = jnp.sum(jax.nn.one_hot(index, num_experts, dtype=jnp.float32), axis=-2)  # [L, B, T, E]
    count = router_probs.shape[0] * jnp.sum(attention_mask.astype(jnp.float32))
    fraction = jnp.sum(chosen * mask, axis=(0, 1, 2)) / jnp.maximum(count, 1.0)
    mean_prob = jnp.sum(router_probs * mask, axis=(0, 1, 2)) / jnp.maximum(count, 1.0)
    return num_experts * jnp.sum(fraction * mean_prob)


# ------------------------------------------------------------ the train step's record

class RouterRecord(list):
    """``(model, coef * aux, aux)`` of each recorded forward pass, and the trace the record
    was opened in (a pass traced in an inner trace, such as a ``lax.cond`` branch, cannot
    be used outside it)."""

    def __init__(self):
        super().__init__()
        self.trace = _trace_state()


_RECORD: contextvars.ContextVar[RouterRecord | None] = contextvars.ContextVar("alignax_router_losses", default=None)
POLICY = "policy"  # the name of the trained model's passes outside routed_model()
_MODEL: contextvars.ContextVar[str] = contextvars.ContextVar("alignax_routed_model", default=POLICY)


def _trace_state():
    from jax._src import core  # no public API tells which trace is current

    return core.get_opaque_trace_state()


@contextlib.contextmanager
def collect_router_losses() -> Iterator[RouterRecord]:
    """Collect ``(model, coef * aux, aux)`` of every mixture model's full forward
    pass traced inside the block (outside :func:`frozen_forward`). Read at trace time: open
    it in the same trace as the forward passes (the train step opens it around the loss)."""
    record = RouterRecord()
    token = _RECORD.set(record)
    try:
        yield record
    finally:
        _RECORD.reset(token)


@contextlib.contextmanager
def frozen_forward() -> Iterator[None]:
    """Forward passes that train nothing (a live reference, a teacher, a pass under
    ``stop_gradient``): their routing adds nothing to the objective."""
    token = _RECORD.set(None)
    try:
        yield
    finally:
        _RECORD.reset(token)


@contextlib.contextmanager
def routed_model(name: str) -> Iterator[None]:
    """Forward passes inside the block are of the trained model ``name`` (a separate critic):
    :func:`router_objective` adds each trained model's term once. Outside: ``"policy"``."""
    token = _MODEL.set(name)
    try:
        yield
    finally:
        _MODEL.reset(token)


def record_router_loss(aux: Array, coef: float) -> None:
    """Add one forward pass's load-balancing loss to the open record (none open: no-op).

    Raises ValueError when the pass is traced in a trace inside the one the record was
    opened in (a ``lax.cond`` branch, a ``scan`` body): that value does not exist outside it;
    collect there (:func:`collect_router_losses`) and return the objective from it."""
    record = _RECORD.get()
    if record is None:
        return
    if isinstance(aux, jax.core.Tracer) and _trace_state() != record.trace:
        raise ValueError("a mixture model's forward pass is traced inside a jax.lax.cond/scan/jit within the loss, "
                         "so its load-balancing loss cannot be added outside it: open collect_router_losses() "
                         "inside that function and return router_objective(...) with its result")
    record.append((_MODEL.get(), coef * aux, aux))


def record_router_objective(scaled: Array, plain: dict[str, Array]) -> None:
    """Add an objective collected inside an inner trace (:func:`router_objective` of a
    ``lax.cond`` branch's record, returned from the branch) to the open record: its scaled
    term once, under its first model, and each model's ``aux``."""
    record = _RECORD.get()
    if record is None:
        return
    for i, (model, aux) in enumerate(plain.items()):
        record.append((model, scaled if i == 0 else jnp.zeros_like(scaled), aux))


def router_objective(record: list[tuple[str, Array, Array]]) -> tuple[Array, dict[str, Array]]:
    """``(sum coef * aux, {model: aux})`` over the distinct trained models of the record
    (float32 scalars; ``(0, {})`` for an empty record), each model's terms the mean over its
    forward passes: a policy and a separate critic each add their own ``coef * aux``; two
    passes of one model (PPO-ptx's) add it once."""
    models: dict[str, list[tuple[Array, Array]]] = {}
    for model, scaled, plain in record:
        models.setdefault(model, []).append((scaled, plain))
    scaled = sum((jnp.mean(jnp.stack([s for s, _ in passes])) for passes in models.values()), jnp.float32(0.0))
    plain = {model: jnp.mean(jnp.stack([p for _, p in passes])).astype(jnp.float32)
             for model, passes in models.items()}
    return scaled.astype(jnp.float32), plain
