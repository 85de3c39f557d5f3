"""Hugging Face weights in and out: config.json + safetensors <-> our NNX models, no torch.

Tensor names are transformers' (``model.layers.0.self_attn.q_proj.weight``,
``transformer.h.0.attn.c_attn.weight`` ...). Each family has one table (:func:`_layout`)
pairing HF tensors with our parameters and the transform between them (PyTorch
``Linear`` weights are ``[out, in]``, ours ``[in, out]`` split per head; GPT-2's Conv1D
weights are already ``[in, out]`` and its ``c_attn`` holds q, k and v side by side).
Loading checks every tensor's presence and shape before building anything, and raises
one error listing all missing, unexpected and mis-shaped tensors.

Model kinds: ``"causal_lm"`` (:class:`CausalLM`), ``"reward"`` (:class:`RewardModel`, from
a ``*ForSequenceClassification`` checkpoint: ``score.weight``; from an LM checkpoint with
``new_head=True``, the usual start of reward-model training), ``"value"``
(:class:`ValueModel`: head from ``score.weight`` when present, else zero) and
``"policy_value"`` (:class:`PolicyValueModel`: LM checkpoint, value head zero or from
``score.weight``). Loading an LM checkpoint as ``reward`` or ``value`` drops its
``lm_head.weight`` (those models have no LM head).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from alignax import paths
from alignax._checks import check_choice
from alignax.config import ConfigError
from alignax.models.config import ModelConfig
from alignax.models.lora import merge_adapters
from alignax.models.modeling import MODEL_KINDS, PolicyValueModel
from alignax.models.safetensors_io import read_safetensors, write_safetensors
from alignax.parallel.sharding import LOGICAL_AXIS_RULES, place_array, tree_shardings

_KIND_OF = {cls: kind for kind, cls in MODEL_KINDS.items()}

# Buffers some checkpoints carry that are not parameters.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$|(^|\.)attn\.(masked_)?bias$")
VALUE_HEAD_FILE = "value_head.safetensors"

Path = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One HF tensor <-> one or more of our parameters."""

    hf: str
    hf_shape: tuple[int, ...]
    paths: tuple[Path, ...]  # our parameter paths (per-layer form: ("model", "layers", i, ...))
    to_ours: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    to_hf: Callable[..., np.ndarray]


def _linear_in(out_shape):
    """HF ``Linear.weight [out, in]`` <-> our ``[in, *out_shape]``."""

    def to_ours(w):
        return (w.T.reshape(w.shape[1], *out_shape),)

    def to_hf(k):
        return k.reshape(k.shape[0], -1).T

    return to_ours, to_hf


def _linear_out(in_shape):
    """HF ``Linear.weight [out, in]`` <-> our ``[*in_shape, out]`` (output projections)."""

    def to_ours(w):
        return (w.T.reshape(*in_shape, w.shape[0]),)

    def to_hf(k):
        return k.reshape(-1, k.shape[-1]).T

    return to_ours, to_hf


def _reshape(shape, hf_shape):
    return (lambda w: (w.reshape(shape),)), (lambda k: k.reshape(hf_shape))


_IDENTITY = ((lambda w: (w,)), (lambda k: k))
_TRANSPOSE = ((lambda w: (w.T,)), (lambda k: k.T))


def _layout(c: ModelConfig, kind: str, prefix: str) -> list[_Entry]:
    """Every HF tensor of a checkpoint of ``kind`` for config ``c``."""
    D, V = c.hidden_size, c.vocab_size
    out: list[_Entry] = []

    def add(hf, hf_shape, paths, fns):
        out.append(_Entry(hf, tuple(hf_shape), tuple(paths), *fns))

    p = prefix
    if c.model_type == "gpt2":
        add(f"{p}wte.weight", (V, D), [("model", "embed")], _IDENTITY)
        add(f"{p}wpe.weight", (c.max_position_embeddings, D), [("model", "pos_embed")], _IDENTITY)
        for i in range(c.num_layers):
            _add_gpt2_block(add, c, f"{p}h.{i}.", ("model", "layers", i))
        add(f"{p}ln_f.weight", (D,), [("model", "final_norm", "scale")], _IDENTITY)
        add(f"{p}ln_f.bias", (D,), [("model", "final_norm", "bias")], _IDENTITY)
    else:
        add(f"{p}embed_tokens.weight", (V, D), [("model", "embed")], _IDENTITY)
        for i in range(c.num_layers):
            _add_decoder_block(add, c, f"{p}layers.{i}.", ("model", "layers", i))
        add(f"{p}norm.weight", (D,), [("model", "final_norm", "scale")], _IDENTITY)
    if kind in ("causal_lm", "policy_value") and not c.tie_word_embeddings:
        add("lm_head.weight", (V, D), [("lm_head",)], _TRANSPOSE)
    if kind == "reward":
        add("score.weight", (c.num_labels, D), [("score",)], _TRANSPOSE)
    if kind in ("value", "policy_value"):
        add("score.weight", (1, D), [("value_head",)], _TRANSPOSE)
    return out


def _add_gpt2_block(add, c: ModelConfig, h: str, L: Path) -> None:
    """One GPT-2 block (``h``: its HF prefix, ``L``: our layer path): LayerNorms with biases,
    Conv1D ``[in, out]`` weights, q/k/v fused in ``c_attn``."""
    D, N, H, F = c.hidden_size, c.num_heads, c.head_dim, c.intermediate_size
    add(f"{h}ln_1.weight", (D,), [(*L, "attn_norm", "scale")], _IDENTITY)
    add(f"{h}ln_1.bias", (D,), [(*L, "attn_norm", "bias")], _IDENTITY)
    qkv_paths = [(*L, "attn", f"{x}_kernel") for x in "qkv"]
    add(
        f"{h}attn.c_attn.weight",
        (D, 3 * D),
        qkv_paths,
        (
            lambda w: tuple(x.reshape(D, N, H) for x in np.split(w, 3, axis=1)),
            lambda q, k, v: np.concatenate([x.reshape(D, D) for x in (q, k, v)], axis=1),
        ),
    )
    add(
        f"{h}attn.c_attn.bias",
        (3 * D,),
        [(*L, "attn", f"{x}_bias") for x in "qkv"],
        (
            lambda b: tuple(x.reshape(N, H) for x in np.split(b, 3)),
            lambda q, k, v: np.concatenate([x.reshape(-1) for x in (q, k, v)]),
        ),
    )
    add(f"{h}attn.c_proj.weight", (D, D), [(*L, "attn", "o_kernel")], _reshape((N, H, D), (D, D)))
    add(f"{h}attn.c_proj.bias", (D,), [(*L, "attn", "o_bias")], _IDENTITY)
    add(f"{h}ln_2.weight", (D,), [(*L, "mlp_norm", "scale")], _IDENTITY)
    add(f"{h}ln_2.bias", (D,), [(*L, "mlp_norm", "bias")], _IDENTITY)
    add(f"{h}mlp.c_fc.weight", (D, F), [(*L, "mlp", "up_kernel")], _IDENTITY)
    add(f"{h}mlp.c_fc.bias", (F,), [(*L, "mlp", "up_bias")], _IDENTITY)
    add(f"{h}mlp.c_proj.weight", (F, D), [(*L, "mlp", "down_kernel")], _IDENTITY)
    add(f"{h}mlp.c_proj.bias", (D,), [(*L, "mlp", "down_bias")], _IDENTITY)


def _add_decoder_block(add, c: ModelConfig, h: str, L: Path) -> None:
    """One layer of the llama-like families (``h``: its HF prefix, ``L``: our layer path):
    Phi-3's fused projections, biases, q/k norms, Gemma's four norms, or a mixture MLP."""
    D, N, K, H, F = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    add(f"{h}input_layernorm.weight", (D,), [(*L, "attn_norm", "scale")], _IDENTITY)
    if c.model_type == "phi3":  # fused projections: one table of its own
        for hf, hf_shape, paths, fns in _phi3_fused(c, h, L):
            add(hf, hf_shape, paths, fns)
    for name, heads in (("q", N), ("k", K), ("v", K)) if c.model_type != "phi3" else ():
        add(f"{h}self_attn.{name}_proj.weight", (heads * H, D), [(*L, "attn", f"{name}_kernel")],
            _linear_in((heads, H)))
        if c.qkv_bias:
            add(f"{h}self_attn.{name}_proj.bias", (heads * H,), [(*L, "attn", f"{name}_bias")],
                _reshape((heads, H), (heads * H,)))
    add(f"{h}self_attn.o_proj.weight", (D, N * H), [(*L, "attn", "o_kernel")], _linear_out((N, H)))
    if c.out_bias:
        add(f"{h}self_attn.o_proj.bias", (D,), [(*L, "attn", "o_bias")], _IDENTITY)
    if c.qk_norm:
        add(f"{h}self_attn.q_norm.weight", (H,), [(*L, "attn", "q_norm", "scale")], _IDENTITY)
        add(f"{h}self_attn.k_norm.weight", (H,), [(*L, "attn", "k_norm", "scale")], _IDENTITY)
    if c.post_norms:  # Gemma: post_attention_layernorm is after attention, not before the MLP
        add(f"{h}post_attention_layernorm.weight", (D,), [(*L, "attn_post_norm", "scale")], _IDENTITY)
        add(f"{h}pre_feedforward_layernorm.weight", (D,), [(*L, "mlp_norm", "scale")], _IDENTITY)
        add(f"{h}post_feedforward_layernorm.weight", (D,), [(*L, "mlp_post_norm", "scale")], _IDENTITY)
    else:
        add(f"{h}post_attention_layernorm.weight", (D,), [(*L, "mlp_norm", "scale")], _IDENTITY)
    if c.num_experts:
        _add_experts(add, c, h, L)
        return
    mlp = (("gate", (F, D)), ("up", (F, D)), ("down", (D, F)))
    for name, shape in mlp if c.model_type != "phi3" else mlp[2:]:
        add(f"{h}mlp.{name}_proj.weight", shape, [(*L, "mlp", f"{name}_kernel")], _TRANSPOSE)
        if c.mlp_bias:
            add(f"{h}mlp.{name}_proj.bias", (shape[0],), [(*L, "mlp", f"{name}_bias")], _IDENTITY)


def _phi3_fused(c: ModelConfig, h: str, L: Path) -> list[tuple]:
    """Phi-3's ``qkv_proj`` ([q; k; v] rows) and ``gate_up_proj`` ([gate; up] rows) <-> our
    separate q/k/v and gate/up kernels: ``(hf, hf_shape, paths, (to_ours, to_hf))``."""
    D, N, K, H, F = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    rows = np.cumsum([N * H, K * H])

    def qkv_to_ours(w):
        q, k, v = np.split(w, rows, axis=0)
        return q.T.reshape(D, N, H), k.T.reshape(D, K, H), v.T.reshape(D, K, H)

    def qkv_to_hf(q, k, v):
        return np.concatenate([x.reshape(D, -1).T for x in (q, k, v)], axis=0)

    def gate_up_to_ours(w):
        gate, up = np.split(w, 2, axis=0)
        return gate.T, up.T

    def gate_up_to_hf(gate, up):
        return np.concatenate([gate.T, up.T], axis=0)

    return [
        (f"{h}self_attn.qkv_proj.weight", ((N + 2 * K) * H, D), tuple((*L, "attn", f"{x}_kernel") for x in "qkv"),
         (qkv_to_ours, qkv_to_hf)),
        (f"{h}mlp.gate_up_proj.weight", (2 * F, D), ((*L, "mlp", "gate_kernel"), (*L, "mlp", "up_kernel")),
         (gate_up_to_ours, gate_up_to_hf)),
    ]


_SWAP_LAST = ((lambda w: (np.swapaxes(w, -1, -2),)), (lambda k: np.swapaxes(k, -1, -2)))
_EXPERT = re.compile(r"^(?P<layer>.*\.mlp\.experts\.)(?P<index>\d+)\.(?P<proj>(gate|up|down)_proj\.weight)$")


def _add_experts(add, c: ModelConfig, h: str, L: Path) -> None:
    """A mixture layer's router and experts. Checkpoints hold one ``Linear`` per expert
    (``mlp.experts.{e}.gate_proj.weight [F, D]``); the table names them stacked
    (``mlp.experts.gate_proj.weight [E, F, D]``, :func:`_stack_experts` / :func:`_split_experts`)."""
    E, D, F = c.num_experts, c.hidden_size, c.moe_intermediate_size
    add(f"{h}mlp.gate.weight", (E, D), [(*L, "mlp", "router")], _TRANSPOSE)
    for name, shape in (("gate", (E, F, D)), ("up", (E, F, D)), ("down", (E, D, F))):
        add(f"{h}mlp.experts.{name}_proj.weight", shape, [(*L, "mlp", f"{name}_kernel")], _SWAP_LAST)


def _stack_experts(tensors: Mapping[str, np.ndarray], num_experts: int) -> dict[str, np.ndarray]:
    """Per-expert tensors stacked under the table's names where all ``num_experts`` are
    present (a partial set stays as it is, and the load reports it). transformers' fused
    in-memory form (``mlp.experts.gate_up_proj [E, 2F, D]``, ``mlp.experts.down_proj [E, D, F]``,
    its ``state_dict()``) is read too."""
    groups: dict[str, dict[int, str]] = {}
    out = dict(tensors)
    for name in tensors:
        match = _EXPERT.match(name)
        if match:
            groups.setdefault(match["layer"] + match["proj"], {})[int(match["index"])] = name
        elif name.endswith(".mlp.experts.gate_up_proj") and np.ndim(tensors[name]) == 3:
            base = name[: -len("gate_up_proj")]
            gate, up = np.split(np.asarray(out.pop(name)), 2, axis=1)
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = gate, up
        elif name.endswith(".mlp.experts.down_proj"):
            out[name + ".weight"] = out.pop(name)
    for stacked, members in groups.items():
        if sorted(members) == list(range(num_experts)):
            out[stacked] = np.stack([np.asarray(tensors[members[e]]) for e in range(num_experts)])
            for name in members.values():
                del out[name]
    return out


def _split_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The table's stacked expert tensors written one per expert, as transformers saves them."""
    out = {}
    for name, value in tensors.items():
        head, sep, proj = name.rpartition(".mlp.experts.")
        if sep and proj.count(".") == 1:
            for e in range(value.shape[0]):
                out[f"{head}{sep}{e}.{proj}"] = np.ascontiguousarray(value[e])
        else:
            out[name] = value
    return out


def _trunk_prefix(c: ModelConfig, names) -> str:
    """``model.`` / ``transformer.`` for full checkpoints, ``""`` for bare base models."""
    full, bare = ("transformer.", "wte.weight") if c.model_type == "gpt2" else ("model.", "embed_tokens.weight")
    if full + bare in names:
        return full
    if bare in names:
        return ""
    return full  # the missing embedding is then reported with the full name


# ------------------------------------------------------------------------------ loading


def _path_of(keypath) -> Path:
    out = []
    for k in keypath:
        key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        out.append(key)
    return tuple(out)


def _state_path(path: Path, scan: bool) -> tuple[Path, int | None]:
    """Per-layer path -> (path in our state, layer index to stack on when scanning)."""
    if scan and len(path) > 2 and path[:2] == ("model", "layers"):
        return ("model", "layers", *path[3:]), path[2]
    return path, None


def from_hf_state_dict(
    hf_config: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    *,
    kind: str = "causal_lm",
    param_dtype: str = "float32",
    dtype: str = "float32",
    scan_layers: bool = False,
    remat: bool | str = "none",
    attention: str = "xla",
    mesh: jax.sharding.Mesh | None = None,
    rules=LOGICAL_AXIS_RULES,
    new_head: bool = False,
    seed: int = 0,
):
    """Build a model of ``kind`` from a ``config.json`` dict and HF-named tensors.

    Args:
      hf_config: the parsed ``config.json``.
      tensors: name -> array (NumPy, any float dtype incl. ``ml_dtypes.bfloat16``).
      kind: ``causal_lm`` | ``reward`` | ``value`` | ``policy_value`` (module docstring).
      param_dtype, dtype, scan_layers, remat, attention: run-time policy (:class:`ModelConfig`).
      mesh: when given, every parameter is placed sharded by ``rules``.
      new_head: ``kind="reward"`` only: a checkpoint without ``score.weight`` gets a fresh
        head, normal with std ``1 / sqrt(D + 1)`` from ``seed`` (else it is an error).

    Raises ``ValueError`` listing every missing, unexpected and mis-shaped tensor
    (name, expected and found shapes) before anything is built.
    """
    check_choice("kind", kind, MODEL_KINDS)
    config = ModelConfig.from_hf_config(
        hf_config, param_dtype=param_dtype, dtype=dtype, scan_layers=scan_layers, remat=remat, attention=attention
    )
    if config.num_experts:
        tensors = _stack_experts(tensors, config.num_experts)
    names = set(tensors)
    entries = _layout(config, kind, _trunk_prefix(config, names))
    if new_head and kind != "reward":
        raise ValueError(f"new_head=True is for kind='reward'; kind={kind!r} (value heads start at zero by default)")
    optional_head = kind in ("value", "policy_value") or new_head
    expected = {e.hf for e in entries}
    dropped = {"lm_head.weight"} if config.tie_word_embeddings or kind in ("reward", "value") else set()
    missing = sorted(n for n in expected - names if not (optional_head and n == "score.weight"))
    if "score.weight" in missing and kind == "reward":
        missing[missing.index("score.weight")] = "score.weight (an LM checkpoint? pass new_head=True for a fresh head)"
    extra = sorted(n for n in names - expected - dropped if not _IGNORED.search(n))
    wrong = [
        f"{e.hf}: expected {list(e.hf_shape)}, found {list(np.shape(tensors[e.hf]))}"
        for e in entries
        if e.hf in names and tuple(np.shape(tensors[e.hf])) != e.hf_shape
    ]
    if missing or extra or wrong:
        def listed(names):
            return ", ".join(names[:20]) + (" ..." if len(names) > 20 else "")

        parts = []
        if missing:
            parts.append(f"missing tensors ({len(missing)}): {listed(missing)}")
        if extra:
            hint = " (a score head: load with kind='reward' or 'value')" if "score.weight" in extra else ""
            parts.append(f"unexpected tensors ({len(extra)}){hint}: {listed(extra)}")
        if wrong:
            parts.append(f"wrong shapes ({len(wrong)}): " + "; ".join(wrong[:20]))
        raise ValueError(f"{config.model_type} checkpoint does not match its config: " + " | ".join(parts))

    per_layer: dict[Path, np.ndarray] = {}
    for e in entries:
        if e.hf not in names:  # optional value head: stays zero
            continue
        arrays = e.to_ours(np.asarray(tensors[e.hf]))
        for path, arr in zip(e.paths, arrays, strict=True):
            per_layer[path] = arr

    model_cls = MODEL_KINDS[kind]
    abstract = nnx.eval_shape(lambda: model_cls(config, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    shardings = tree_shardings(abstract_state, mesh, rules=rules) if mesh is not None else None

    grouped: dict[Path, dict[int | None, np.ndarray]] = {}
    for path, arr in per_layer.items():
        spath, layer = _state_path(path, config.scan_layers)
        grouped.setdefault(spath, {})[layer] = arr

    flat_shardings = {}
    if shardings is not None:
        for kp, s in jax.tree_util.tree_leaves_with_path(shardings, is_leaf=lambda x: isinstance(x, nnx.Variable)):
            flat_shardings[_path_of(kp)] = s.get_value() if isinstance(s, nnx.Variable) else s

    def fill(kp, var):
        path = _path_of(kp)
        want = var.get_value()
        if path in grouped:
            layers = grouped[path]
            arr = np.stack([layers[i] for i in range(config.num_layers)]) if None not in layers else layers[None]
        elif path == ("value_head",):
            arr = np.zeros(want.shape, np.float32)
        elif path == ("score",):
            std = 1.0 / np.sqrt(config.hidden_size + 1)
            arr = np.random.default_rng(seed).normal(0.0, std, want.shape).astype(np.float32)
        else:
            raise AssertionError(f"no HF tensor maps to parameter {'.'.join(map(str, path))}")
        if arr.shape != tuple(want.shape):
            raise AssertionError(f"{path}: converted shape {arr.shape} != parameter shape {want.shape}")
        arr = np.asarray(arr, dtype=want.dtype)
        value = place_array(arr, flat_shardings[path]) if path in flat_shardings else jax.numpy.asarray(arr)
        return var.replace(value)

    state = jax.tree_util.tree_map_with_path(fill, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


def read_config(path: str, *, name: str | None = None) -> dict[str, Any]:
    """The ``config.json`` dict of the model folder ``path``. A missing file is a
    ``FileNotFoundError``; an unreadable or non-JSON one a :class:`~alignax.config.ConfigError`;
    both name the file and, when ``name`` is given, the ``model.name`` it was found through."""
    cfg_path = os.path.join(path, "config.json")
    where = f"model.name={name}: " if name is not None else ""
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{where}no config.json in the model folder {path}")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}{cfg_path} is not valid JSON ({e.msg}: line {e.lineno}, column {e.colno}); "
                          "restore it from the model's source, or re-export the model") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where}{cfg_path} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{where}{cfg_path} holds a JSON {type(config).__name__}, not an object of model fields")
    return config


def read_hf_tensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Tensors of a checkpoint directory: ``model.safetensors`` or a sharded index."""
    path = os.fspath(path)
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        return read_safetensors(single)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {e}") from e
        tensors: dict[str, np.ndarray] = {}
        for file in sorted(set(weight_map.values())):
            shard = read_safetensors(os.path.join(path, file))
            for name, arr in shard.items():
                tensors[name] = arr
        listed = set(weight_map)
        if listed != set(tensors):
            missing = sorted(listed - set(tensors))
            if missing:
                raise ValueError(f"{index} lists tensors absent from its shards: {', '.join(missing[:20])}")
        return tensors
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def from_pretrained(path: str | os.PathLike, *, kind: str = "causal_lm", **kwargs):
    """Load ``config.json`` + safetensors from a directory; ``kwargs`` as in :func:`from_hf_state_dict`.

    For ``kind="policy_value"`` a ``value_head.safetensors`` beside the weights (written by
    :func:`save_pretrained`) supplies the value head.
    """
    path = paths.staged(path, key="model folder")  # a URI is read from a local copy
    hf_config = read_config(path)
    tensors = read_hf_tensors(path)
    if kind == "policy_value" and os.path.isfile(os.path.join(path, VALUE_HEAD_FILE)):
        tensors = {**tensors, **read_safetensors(os.path.join(path, VALUE_HEAD_FILE))}
    return from_hf_state_dict(hf_config, tensors, kind=kind, **kwargs)


# ------------------------------------------------------------------------------ saving


def _written_dtype(tensors: Mapping[str, np.ndarray], *, default: str | None) -> str | None:
    """The floating dtype holding most of ``tensors``' elements (config.json's ``dtype``)."""
    counts: dict[str, int] = {}
    for value in tensors.values():
        if jax.numpy.issubdtype(value.dtype, jax.numpy.floating):
            counts[str(value.dtype)] = counts.get(str(value.dtype), 0) + value.size
    return max(counts, key=counts.get) if counts else default


def to_hf_state_dict(model) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(config.json dict, HF-named NumPy tensors)`` of a model, in its parameter dtype; a
    model with LoRA adapters is written with them merged into its kernels."""
    model = merge_adapters(model)
    kind = _KIND_OF.get(type(model))
    if kind is None:
        raise TypeError(f"cannot export {type(model).__name__}; supported: {', '.join(c.__name__ for c in _KIND_OF)}")
    c: ModelConfig = model.config
    state = nnx.state(model)
    flat = {
        _path_of(kp): np.asarray(jax.device_get(v.get_value()))
        for kp, v in jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    }
    prefix = "transformer." if c.model_type == "gpt2" else "model."
    tensors: dict[str, np.ndarray] = {}
    for e in _layout(c, kind, prefix):
        arrays = []
        for path in e.paths:
            spath, layer = _state_path(path, c.scan_layers)
            arr = flat[spath]
            arrays.append(arr if layer is None else arr[layer])
        out = np.ascontiguousarray(e.to_hf(*arrays))
        if out.shape != e.hf_shape:
            raise AssertionError(f"{e.hf}: exported shape {out.shape} != {e.hf_shape}")
        tensors[e.hf] = out
    if c.num_experts:
        tensors = _split_experts(tensors)
    arch = "sequence_classification" if kind in ("reward", "value") else "causal_lm"
    hf_config = c.to_hf_config(architecture=arch)
    # the dtype of the weights as written, not the one the model was built with: params cast
    # for export (`alignax export --dtype`), or a bfloat16 run's float32 master, differ from it
    hf_config["dtype"] = _written_dtype(tensors, default=hf_config.get("dtype"))
    if arch == "sequence_classification" and hf_config.get("pad_token_id") is None:
        eos = c.eos_token_id[0] if isinstance(c.eos_token_id, tuple) else c.eos_token_id
        hf_config["pad_token_id"] = eos if eos is not None else 0
    return hf_config, tensors


def save_pretrained(model, path: str | os.PathLike) -> None:
    """Write ``config.json`` + ``model.safetensors`` that transformers loads.

    ``CausalLM`` -> ``*ForCausalLM``; ``RewardModel`` and ``ValueModel`` ->
    ``*ForSequenceClassification`` (head as ``score.weight``); ``PolicyValueModel`` -> the
    policy as ``*ForCausalLM`` plus the value head in ``value_head.safetensors``.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    hf_config, tensors = to_hf_state_dict(model)
    head = {}
    if isinstance(model, PolicyValueModel):  # keep the policy file a plain *ForCausalLM checkpoint
        head = {"score.weight": tensors.pop("score.weight")}
    write_safetensors(os.path.join(path, "model.safetensors"), tensors)
    if head:
        write_safetensors(os.path.join(path, VALUE_HEAD_FILE), head)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2, sort_keys=True)
