"""Where the gradient of a loss goes through a real model: per token, per layer, per step.

Any alignax loss is a function of the per-token log-probs a model gives its rows
(``[prompt | response | padding]``, ``mask = response_mask[:, 1:]``, as the trainers
see them). For such a loss this module measures, through the model:

- :func:`token_gradients`: per token, the signal ``-dL/d log pi(y_t)`` (how hard one
  gradient-descent step pushes that token's log-prob up, positive, or down, negative)
  and the norm of ``dL/de_t``, the gradient at the input embedding of each position; with
  ``parameters=True`` also the parameter gradients. Built from two pieces, public as well:
  :func:`forward_logps` (the model's log-probs, and values for a ``policy_value`` model)
  and :func:`logps_vjp` (the chain rule back from any ``dL/d logps`` to the parameters and
  the input embeddings).
- :func:`group_norms`: norms of a parameter-shaped tree (gradients, updates, weights)
  per parameter group (:func:`parameter_group`: embeddings, attention, MLP, norms, heads,
  LoRA adapters, other — by path names), per layer and group, or per parameter.
- :func:`optimiser_updates` and :func:`update_to_weight_ratios`: one step of the
  trainers' optimiser (:func:`alignax.trainers.engine.optim.build_optimizer`) and
  ``||update|| / ||weight||`` per group.
- Rows and models for notebooks: :func:`completion_rows` (one prompt, several
  completions, encoded as the data pipeline encodes them), :func:`load_model`.
- Rendering: :func:`tokens_html` (tokens coloured by a diverging scale, text escaped),
  :func:`token_strings`, :func:`plot_token_values`, :func:`plot_layer_norms`
  (matplotlib, imported when called).

The input-embedding gradient needs no change to the model: the decoder's embedding table
is swapped, inside the traced function, for the rows it would gather (one per position)
plus a zero perturbation ``delta [B, T, D]``, and the model is called on position indices
instead of token ids. The forward is the model's own, bit for bit up to float rounding;
``dL/d delta`` is the gradient at each position's input embedding (for GPT-2's learned
positions, at token + position embedding: the same gradient), taken at the looked-up table
row: for Gemma, which multiplies that row by ``sqrt(D)``, it is ``sqrt(D)`` times the gradient
at the scaled embedding, and the rows' gradients still add up to the table's. Works with scanned and
remat layers, tied and untied LM heads, on ``causal_lm`` and ``policy_value`` models.
"""

from __future__ import annotations

import dataclasses
import functools
import html
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from alignax import models
from alignax._checks import check_choice, check_rank, check_same_shape
from alignax.data.formats import Encoder
from alignax.models.hf import _path_of
from alignax.models.registry import DEFAULT_MODEL
from alignax.trainers.config import ModelSpec
from alignax.trainers.engine.optim import OptimConfig, build_optimizer
from alignax.trainers.engine.setup import build_model, load_tokenizer, model_directory

Array = jax.Array
# loss_fn(logps [B, T-1], values [B, T-1] or None) -> (loss, metrics)
LossFn = Callable[[Array, Array | None], tuple[Array, Mapping[str, Array]]]
PARAMETER_GROUPS = ("embeddings", "attention", "mlp", "norms", "heads", "lora", "other")
NORM_KEYS = ("group", "layer_group", "path")
# ``load_model("tiny")``: SmolLM2's config and tokenizer with these fields replaced, random weights.
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=128)


# ----------------------------------------------------------------------- through the model


def _split(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    if not isinstance(model, (models.CausalLM, models.PolicyValueModel)):
        raise TypeError(
            f"token gradients need a model with an LM head (kind causal_lm or policy_value); got {type(model).__name__}"
        )
    return nnx.split(model, nnx.Param, ...)


def _rows(model, tokens, attention_mask, positions):
    """Device arrays ``(tokens, positions, attention_mask, zero delta [B, T, D])``."""
    tokens = jnp.asarray(tokens, jnp.int32)
    check_rank(tokens=(tokens, 2))
    attention_mask = jnp.ones_like(tokens) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
    positions = models.positions_from_mask(attention_mask) if positions is None else jnp.asarray(positions, jnp.int32)
    check_same_shape(tokens=tokens, attention_mask=attention_mask, positions=positions)
    delta = jnp.zeros((*tokens.shape, model.config.hidden_size), jnp.dtype(model.config.param_dtype))
    return tokens, positions, attention_mask, delta


def _probe_forward(model, tokens, positions, attention_mask, delta, temperature, chunk_size):
    """``(logps [B, T-1], values [B, T-1] or None)`` with ``delta`` added to each
    position's input embedding (see the module docstring)."""
    embed = model.model.embed
    table = embed.get_value()
    b, t = tokens.shape
    gathered = jnp.take(table, tokens, axis=0) + delta.astype(table.dtype)  # [B, T, D]
    embed.set_value(gathered.reshape(b * t, -1))
    try:
        out = model(jnp.arange(b * t, dtype=jnp.int32).reshape(b, t), positions, attention_mask, return_logits=False)
    finally:
        embed.set_value(table)  # the LM head (tied or not) scores against the real vocabulary
    logps = models.token_logprobs_from_hidden(out.hidden[:, :-1], model, tokens[:, 1:], chunk_size=chunk_size,
                                              temperature=temperature)
    values = None if out.values is None else out.values[:, :-1]
    return logps, values


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "chunk_size"))
def _forward(graphdef, params, rest, tokens, positions, attention_mask, delta, *, temperature, chunk_size):
    model = nnx.merge(graphdef, params, rest)
    return _probe_forward(model, tokens, positions, attention_mask, delta, temperature, chunk_size)


@functools.partial(jax.jit, static_argnames=("graphdef", "temperature", "chunk_size", "parameters"))
def _backward(graphdef, params, rest, tokens, positions, attention_mask, delta, cotangents, *, temperature,
              chunk_size, parameters):
    def outputs(params, delta):
        model = nnx.merge(graphdef, params, rest)
        return _probe_forward(model, tokens, positions, attention_mask, delta, temperature, chunk_size)

    _, vjp = jax.vjp(outputs, params, delta)
    grads, dembed = vjp(cotangents)
    return (grads if parameters else None), dembed  # unused parameter gradients are dead code to XLA


def forward_logps(
    model: nnx.Module,
    tokens,
    attention_mask=None,
    *,
    positions=None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> tuple[Array, Array | None]:
    """``(logps [B, T-1], values [B, T-1] or None)`` of rows ``tokens [B, T]``.

    ``logps[:, t] = log pi(tokens[:, t+1] | tokens[:, :t+1])`` at ``temperature`` (float32),
    the layout of :func:`alignax.trainers.engine.setup.response_logps` (pair it with
    ``response_mask[:, 1:]``); ``values[:, t]`` is a ``policy_value`` model's value at the
    same position (the state before token ``t+1``), ``None`` for a ``causal_lm``. Jitted:
    one compilation per model and row shape, shared with :func:`token_gradients`.
    """
    graphdef, params, rest = _split(model)
    tokens, positions, attention_mask, delta = _rows(model, tokens, attention_mask, positions)
    return _forward(graphdef, params, rest, tokens, positions, attention_mask, delta, temperature=temperature,
                    chunk_size=chunk_size)


def logps_vjp(
    model: nnx.Module,
    tokens,
    attention_mask,
    dloss_dlogps,
    dloss_dvalues=None,
    *,
    positions=None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    parameters: bool = True,
) -> tuple[nnx.State | None, Array]:
    """The chain rule from ``dL/d logps`` (and ``dL/d values``) back through the model.

    Args:
      dloss_dlogps: ``[B, T-1]``, the gradient of some loss with respect to
        :func:`forward_logps`'s log-probs; ``dloss_dvalues`` likewise for its values
        (``policy_value`` models; ``None``: the loss does not read them).
      parameters: also return the parameter gradients (``False`` saves their memory).

    Returns ``(parameter gradients (an nnx.State of the model's nnx.Param) or None,
    input-embedding gradients [B, T, D])``. A cotangent that is zero outside row ``b``
    gives row ``b``'s own share of the gradient.
    """
    graphdef, params, rest = _split(model)
    tokens, positions, attention_mask, delta = _rows(model, tokens, attention_mask, positions)
    has_values = isinstance(model, models.PolicyValueModel)
    if dloss_dvalues is not None and not has_values:
        raise ValueError(f"dloss_dvalues given, but a {type(model).__name__} has no value head")
    dloss_dlogps = jnp.asarray(dloss_dlogps, jnp.float32)
    if dloss_dlogps.shape != (tokens.shape[0], tokens.shape[1] - 1):
        raise ValueError(f"dloss_dlogps has shape {dloss_dlogps.shape}; expected [B, T-1] = "
                         f"{[tokens.shape[0], tokens.shape[1] - 1]} for tokens {list(tokens.shape)}")
    values_cotangent = None
    if has_values:
        values_cotangent = jnp.zeros_like(dloss_dlogps) if dloss_dvalues is None else jnp.asarray(dloss_dvalues,
                                                                                                     jnp.float32)
    return _backward(graphdef, params, rest, tokens, positions, attention_mask, delta,
                     (dloss_dlogps, values_cotangent), temperature=temperature, chunk_size=chunk_size,
                     parameters=parameters)


@dataclasses.dataclass(frozen=True)
class TokenGradients:
    """What :func:`token_gradients` measured; per-token arrays are NumPy ``[B, T]``,
    aligned with ``tokens`` (column 0, which no position predicts, holds 0).

    - ``logps[b, t]``: ``log pi(tokens[b, t] | tokens[b, :t])``.
    - ``signal[b, t]``: ``-dL/d log pi(tokens[b, t])``, the push one gradient-descent step
      gives that log-prob (positive: up); 0 where the loss does not read it.
    - ``embedding_grad_norm[b, t]``: ``||dL/de_{b,t}||_2`` at the input embedding of
      position ``t`` (it moves every later prediction of the row, prompt positions included).
    - ``loss``, ``metrics``: the loss's own outputs. ``grads``: parameter gradients
      (an ``nnx.State``) when asked for, else ``None``.
    """

    tokens: np.ndarray
    logps: np.ndarray
    signal: np.ndarray
    embedding_grad_norm: np.ndarray
    loss: float
    metrics: dict[str, float]
    grads: nnx.State | None = None


def _shift_right(x: Array) -> np.ndarray:
    """``[B, T-1]`` (position ``t`` scores token ``t+1``) -> ``[B, T]`` aligned with the tokens."""
    x = np.asarray(jax.device_get(x), np.float32)
    return np.concatenate([np.zeros((x.shape[0], 1), np.float32), x], axis=1)


def token_gradients(
    model: nnx.Module,
    tokens,
    attention_mask,
    loss_fn: LossFn,
    *,
    positions=None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    parameters: bool = False,
) -> TokenGradients:
    """Per-token gradient signal and input-embedding gradient norms of ``loss_fn`` on rows.

    Args:
      model: a ``causal_lm`` or ``policy_value`` model (``alignax.models.MODEL_KINDS``).
      tokens, attention_mask, positions: rows ``[B, T]`` (positions default to
        ``positions_from_mask``), e.g. from :func:`completion_rows`.
      loss_fn: ``loss_fn(logps [B, T-1], values [B, T-1] or None) -> (loss, metrics)``,
        the layout of :func:`forward_logps`; call the alignax loss there exactly as the
        trainer does (``response_mask[:, 1:]`` as the mask, its aggregation and
        normalisers; a DPO pair's sums from ``trainers.engine.setup.sequence_logps``;
        ``jax.lax.stop_gradient(logps)`` as GRPO's single-update old log-probs).
      temperature, chunk_size: as the trainers' log-probs (the sampler's temperature online).
      parameters: also return the parameter gradients in ``grads``.

    Computed as ``dL/d logps`` (``jax.grad`` of ``loss_fn`` at the model's log-probs), then
    :func:`logps_vjp`: one forward pass more than a train step, and the model compiles
    once per row shape whatever the loss.
    """
    options = dict(positions=positions, temperature=temperature, chunk_size=chunk_size)
    logps, values = forward_logps(model, tokens, attention_mask, **options)
    # Jitted: one small compilation is quicker than running a loss with its metrics op by op.
    loss_and_grads = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))
    (loss, metrics), (dlogps, dvalues) = loss_and_grads(logps, values)
    grads, dembed = logps_vjp(model, tokens, attention_mask, dlogps, dvalues, parameters=parameters, **options)
    embedding_norm = jnp.sqrt(jnp.sum(jnp.square(dembed.astype(jnp.float32)), axis=-1))
    return TokenGradients(
        tokens=np.asarray(tokens),
        logps=_shift_right(logps),
        signal=_shift_right(-dlogps),
        embedding_grad_norm=np.asarray(jax.device_get(embedding_norm), np.float32),
        loss=float(loss),
        metrics={k: float(v) for k, v in metrics.items()},
        grads=grads,
    )


# ------------------------------------------------------------------------ per parameter group


def parameter_group(path: Sequence[Any]) -> str:
    """The group of a parameter path (``("model", "layers", 3, "attn", "q_kernel")``), by its
    names: ``lora`` (any name holding ``lora``), ``norms``, ``attention`` (``attn``),
    ``mlp``, ``embeddings`` (``embed``, ``pos_embed``), ``heads`` (``lm_head``,
    ``value_head``, ``score``), else ``other``; the first rule that matches wins."""
    names = [str(p).lower() for p in path if not isinstance(p, int)]

    def has(*parts):
        return any(part in name for name in names for part in parts)

    if has("lora"):
        return "lora"
    if has("norm"):
        return "norms"
    if has("attn", "attention"):
        return "attention"
    if has("mlp"):
        return "mlp"
    if has("embed"):
        return "embeddings"
    if has("head") or "score" in names:
        return "heads"
    return "other"


@functools.partial(jax.jit, static_argnames="stacked")
def _sums_of_squares(leaves, stacked):
    """Per leaf: the sum of squares (float32), per slice of the leading axis where ``stacked``."""
    out = []
    for leaf, by_layer in zip(leaves, stacked):
        squares = jnp.square(jnp.asarray(leaf, jnp.float32))
        out.append(jnp.sum(squares.reshape(squares.shape[0], -1), axis=1) if by_layer else jnp.sum(squares))
    return out


def _squared_norms(tree) -> list[tuple[tuple, int | None, float]]:
    """``(path, layer, sum of squares)`` per parameter; a scanned layer stack (a leaf under
    ``layers`` with a leading ``[L]`` axis) is split into one entry per layer, named as the
    unscanned model names it."""
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    paths, values, stacked = [], [], []
    for keypath, leaf in leaves:
        path = _path_of(keypath)
        at = path.index("layers") + 1 if "layers" in path else None
        paths.append(path)
        values.append(leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf)
        stacked.append(at is not None and not (at < len(path) and isinstance(path[at], int)))
    sums = jax.device_get(_sums_of_squares(values, tuple(stacked)))
    out = []
    for path, by_layer, squared in zip(paths, stacked, sums):
        if not by_layer:
            at = path.index("layers") + 1 if "layers" in path else None
            out.append((path, None if at is None else path[at], float(squared)))
            continue
        at = path.index("layers") + 1
        out.extend(((*path[:at], i, *path[at:]), i, float(s)) for i, s in enumerate(squared))
    return out


def group_norms(tree, *, by: str = "group") -> dict:
    """L2 norms of a parameter-shaped tree (gradients, updates or weights) by ``by``:

    - ``group``: ``{group: norm}`` over :data:`PARAMETER_GROUPS` present;
    - ``layer_group``: ``{(layer, group): norm}``, ``layer`` the decoder layer's index or
      ``None`` for parameters outside the layer stack (embeddings, final norm, heads);
    - ``path``: ``{"model/layers/3/attn/q_kernel": norm}``, one per parameter and layer.

    The keys partition the parameters: the squares of any ``by``'s norms add up to the
    squared global norm. Scanned and unscanned models give the same keys and numbers.
    """
    check_choice("by", by, NORM_KEYS)
    sums: dict = {}
    for path, layer, squared in _squared_norms(tree):
        group = parameter_group(path)
        key = {"group": group, "layer_group": (layer, group), "path": "/".join(map(str, path))}[by]
        sums[key] = sums.get(key, 0.0) + squared
    return {key: math.sqrt(s) for key, s in sums.items()}


@functools.cache
def _jitted_update(config: OptimConfig, total_steps: int):
    optimizer, _ = build_optimizer(config, total_steps)
    # one compilation each beats running the rules (and the state's zeros) op by op
    return jax.jit(optimizer.init), jax.jit(optimizer.update)


def optimiser_updates(params, grads, config: OptimConfig | None = None, *, total_steps: int = 1):
    """The first update the trainers' optimiser makes from ``grads``: the tree added to
    ``params`` (``optax.apply_updates``). ``config``: :class:`OptimConfig` (defaults: AdamW
    at 1e-5, gradients clipped to norm 1); the learning rate is the schedule's at step 0
    of ``total_steps`` (with ``warmup_steps > 0`` that is 0)."""
    init, update = _jitted_update(config or OptimConfig(), total_steps)
    updates, _ = update(grads, init(params), params)
    return updates


def update_to_weight_ratios(params, updates, *, by: str = "layer_group") -> dict:
    """``||update|| / ||weight||`` per key of :func:`group_norms` (``by``); NaN where the
    weights are all zero (a fresh value head)."""
    u, w = group_norms(updates, by=by), group_norms(params, by=by)
    return {key: (u[key] / w[key] if w[key] > 0 else math.nan) for key in w}


# ---------------------------------------------------------------------------- rows and models


def completion_rows(tokenizer, prompt, completions: Sequence[Any], *, max_length: int | None = None
                    ) -> dict[str, np.ndarray]:
    """One prompt and its completions as rows ``[prompt | completion | padding]``.

    Encoded as the data pipeline encodes them (:class:`alignax.data.Encoder`: the chat
    template, the end-of-turn token inside the response mask). Returns ``tokens``,
    ``positions``, ``attention_mask``, ``response_mask`` ``[B, T]`` int32, ``T`` =
    ``max_length`` or the longest row; every row has the same prompt, so rows ``2i`` and
    ``2i + 1`` also serve as a DPO pair, and all rows as a GRPO group.
    """
    limit = max_length or 1 << 20
    encoder = Encoder(tokenizer, format="unpaired", max_length=limit, max_prompt_length=limit, truncation="reject")
    encoded = [encoder.encode({"prompt": prompt, "completion": c, "label": 1}) for c in completions]
    length = max_length or max(len(e.prompt) + len(e.responses["response"][0]) for e in encoded)
    encoder.max_length = length
    arrays = [encoder.arrays(e) for e in encoded]
    return {k: np.stack([a[k] for a in arrays]) for k in ("tokens", "positions", "attention_mask", "response_mask")}


def load_model(name: str = "smollm2", *, kind: str = "causal_lm", scan_layers: bool | None = None, seed: int = 0):
    """``(model, tokenizer)``: ``smollm2`` (SmolLM2-135M-Instruct from the registry),
    ``tiny`` (SmolLM2's config with :data:`TINY_SHAPE`, random weights, SmolLM2's
    tokenizer), or any ``model.name`` a config takes (a registry name or a local Hugging
    Face folder). ``kind``: ``causal_lm`` or ``policy_value`` (the value head starts at
    zero). ``scan_layers``: ``None`` scans deep models (more than 4 layers: SmolLM2's 30
    compile in seconds rather than a minute) and unrolls shallow ones (quicker to compile)."""
    spec_name = DEFAULT_MODEL if name in ("smollm2", "tiny") else name
    random_init = TINY_SHAPE if name == "tiny" else None
    if scan_layers is None:
        with open(os.path.join(model_directory(ModelSpec(name=spec_name)), "config.json"), encoding="utf-8") as f:
            layers = {**json.load(f), **(random_init or {})}["num_hidden_layers"]
        scan_layers = layers > 4
    spec = ModelSpec(name=spec_name, random_init=random_init, seed=seed, scan_layers=scan_layers)
    return build_model(spec, kind=kind), load_tokenizer(spec)


# ----------------------------------------------------------------------------------- rendering

POSITIVE_RGB = (33, 102, 172)  # ColorBrewer RdBu's ends: blue for positive values,
NEGATIVE_RGB = (178, 24, 43)  # red for negative ones, white at zero


def token_strings(tokenizer, ids) -> list[str]:
    """Each id decoded on its own (``tokenizer.decode([id])``): the pieces of the text."""
    return [tokenizer.decode([int(i)]) for i in np.asarray(ids).reshape(-1)]


def _background(value: float, scale: float) -> tuple[str, float]:
    strength = min(abs(value) / scale, 1.0) if scale > 0 else 0.0
    end = POSITIVE_RGB if value > 0 else NEGATIVE_RGB
    rgb = (int(255 + (c - 255) * strength + 0.5) for c in end)
    return "rgb({}, {}, {})".format(*rgb), strength


def tokens_html(
    tokens: Sequence[str],
    values,
    *,
    mask=None,
    scale: float | None = None,
    label: str | None = None,
) -> str:
    """HTML of ``tokens`` on a diverging colour scale of ``values`` (one per token).

    Positive values are blue, negative red, with intensity ``|value| / scale`` capped at
    1 (``scale`` defaults to the largest ``|value|`` under the mask); tokens where ``mask``
    is false are grey and uncoloured. Each token's text is HTML-escaped, its value is in
    the ``title`` (shown on hover), newlines are kept (``white-space: pre-wrap``).
    ``label`` (escaped) heads the block with the scale. Display with
    ``IPython.display.HTML``.
    """
    values = np.asarray(values, np.float64).reshape(-1)
    keep = np.ones(len(tokens), bool) if mask is None else np.asarray(mask, bool).reshape(-1)
    if not len(tokens) == len(values) == len(keep):
        raise ValueError(f"{len(tokens)} tokens, {len(values)} values and {len(keep)} mask entries must agree")
    if scale is None:
        scale = float(np.max(np.abs(values[keep]))) if keep.any() else 0.0
    spans = []
    for text, value, on in zip(tokens, values, keep):
        if not on:
            spans.append(f'<span style="color:#999">{html.escape(text)}</span>')
            continue
        background, strength = _background(float(value), scale)
        colour = "#fff" if strength > 0.6 else "#000"
        spans.append(f'<span title="{value:+.4g}" style="background:{background};color:{colour};'
                     f'border-radius:2px">{html.escape(text)}</span>')
    head = ""
    if label is not None:
        head = f'<div style="font-weight:bold">{html.escape(label)} <small>(scale ±{scale:.3g})</small></div>'
    body = "".join(spans)
    return (f'<div style="margin:4px 0">{head}<div style="font-family:monospace;white-space:pre-wrap;'
            f'line-height:1.6">{body}</div></div>')


def plot_token_values(tokens: Sequence[str], series: Mapping[str, Sequence[float]], *, ax=None, title=None):
    """Grouped bars of one or more per-token series (``{label: values}``), the tokens as
    tick labels; returns the matplotlib axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(max(6.0, 0.3 * len(tokens)), 3.0))
    width = 0.8 / max(len(series), 1)
    x = np.arange(len(tokens))
    for i, (name, values) in enumerate(series.items()):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, np.asarray(values, np.float64), width, label=name)
    ax.set_xticks(x, [t.replace("\n", "\\n") for t in tokens], rotation=90, fontsize=7)
    ax.axhline(0.0, color="black", linewidth=0.5)
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title)
    return ax


def plot_layer_norms(norms: Mapping[tuple[int | None, str], float], *, ax=None, ylabel: str = "gradient norm",
                     title=None, log: bool = True):
    """Lines per parameter group across decoder layers from ``group_norms(...,
    by="layer_group")``; groups outside the layer stack are dashed horizontal lines.
    Returns the matplotlib axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6.0, 3.2))
    groups = sorted({g for _, g in norms}, key=PARAMETER_GROUPS.index)
    for i, group in enumerate(groups):
        colour = f"C{i}"
        layers = sorted(layer for layer, g in norms if g == group and layer is not None)
        if layers:
            ax.plot(layers, [norms[(layer, group)] for layer in layers], "o-", color=colour, markersize=3,
                    label=group)
        if (None, group) in norms:
            ax.axhline(norms[(None, group)], color=colour, linestyle="--", linewidth=1,
                       label=f"{group} (outside the layers)")
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=7)
    if title:
        ax.set_title(title)
    return ax
