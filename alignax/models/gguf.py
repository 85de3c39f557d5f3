"""GGUF import: a llama.cpp GGUF file as a Hugging Face config dict and HF-named float32 arrays.

``gguf_to_hf(path)`` reads the file with the ``gguf`` package, dequantises every tensor
(Q4_1, Q8_0, K-quants, F16, ... whatever ``gguf.quants`` can unpack), undoes the row
permutation llama.cpp's ``convert_hf_to_gguf.py`` applies to the query and key
projections, renames the tensors to transformers' Llama names and rebuilds a
``LlamaConfig``-style dict from the metadata. The result feeds
``alignax.models.from_hf_state_dict`` or a safetensors + ``config.json`` directory.

The q/k permutation. llama.cpp's rotary kernel rotates adjacent pairs ``(x[2i], x[2i+1])``
while transformers rotates the two halves ``(x[i], x[i + d/2])`` of each head, so the
converter reorders the output rows of ``q_proj`` (and of ``k_proj`` with the kv-head count)
within every head of size ``d``::

    gguf_rows = w.reshape(n_head, 2, d // 2, in).swapaxes(1, 2).reshape(n_head * d, in)

and this module applies the inverse, ``w.reshape(n_head, d // 2, 2, in).swapaxes(1, 2)``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF leaf name -> transformers name inside ``model.layers.{i}``.
_LLAMA_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_PATTERN = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_TOP_PATTERN = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def read_gguf(path: str | os.PathLike):
    """Open ``path`` with ``gguf.GGUFReader``; a corrupt or truncated file raises ``ValueError``.

    ``GGUFReader`` memory-maps the file, so a file cut short shows up either as a failure
    while parsing the header (caught and re-raised here with the path) or as a tensor whose
    bytes run past the end of the file (checked here, naming the tensor).
    """
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    size = os.path.getsize(path)
    try:
        reader = gguf.GGUFReader(path)
    except Exception as error:  # the reader raises ValueError, IndexError, KeyError... on bad bytes
        raise ValueError(
            f"{path} ({size:,} bytes) is not a readable GGUF file; it is corrupt or truncated "
            f"({type(error).__name__}: {error})"
        ) from error
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != int(tensor.n_bytes):
            raise ValueError(
                f"{path} is truncated: tensor {tensor.name!r} needs bytes up to {end:,} "
                f"but the file has {size:,} bytes"
            )
    return reader


def gguf_metadata(reader) -> dict[str, Any]:
    """All metadata fields of an open ``GGUFReader`` as plain Python values.

    Strings come back as ``str``, arrays as ``list``; the three header pseudo-fields
    (``GGUF.version`` and the counts) are left out.
    """
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }


def _require(metadata: Mapping[str, Any], key: str, path: str):
    if key not in metadata:
        raise ValueError(f"{path}: GGUF metadata lacks the required key {key!r}")
    return metadata[key]


def unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (see the module docstring); works on weights and biases.

    ``weight``: ``[n_head * head_dim, ...]``; returns the same shape with the rows of every
    head reordered from interleaved pairs back to transformers' half-split layout.
    """
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot unpermute {rows} rows over {n_head} heads: rows must be a multiple of 2 * heads")
    half = rows // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def hf_name(gguf_name: str) -> str | None:
    """The transformers Llama name of a GGUF tensor name, or ``None`` if it has none."""
    if match := _BLOCK_PATTERN.match(gguf_name):
        layer, leaf, kind = match.groups()
        if leaf in _LLAMA_BLOCK_NAMES:
            return f"model.layers.{int(layer)}.{_LLAMA_BLOCK_NAMES[leaf]}.{kind}"
        return None
    if match := _TOP_PATTERN.match(gguf_name):
        leaf, kind = match.groups()
        if leaf in _LLAMA_TOP_NAMES:
            return f"{_LLAMA_TOP_NAMES[leaf]}.{kind}"
    return None


def _llama_config(metadata: Mapping[str, Any], tensor_names: set[str], path: str) -> dict[str, Any]:
    """``LlamaConfig``-style dict (transformers 5 layout, rope in ``rope_parameters``)."""
    arch = "llama"

    def key(name: str):
        return _require(metadata, f"{arch}.{name}", path)

    if metadata.get(f"{arch}.expert_count", 0):
        raise ValueError(
            f"{path}: mixture-of-experts llama GGUF files ({arch}.expert_count="
            f"{metadata[f'{arch}.expert_count']}) are not supported; only dense llama models are"
        )
    if "rope_freqs.weight" in tensor_names:
        raise ValueError(
            f"{path}: the file carries rope_freqs.weight (llama-3.1 style rope frequency factors), "
            "which cannot be turned back into transformers' rope_parameters; not supported"
        )
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = int(metadata.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // heads))
    value_dim = int(metadata.get(f"{arch}.attention.value_length", head_dim))
    rope_dim = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim or rope_dim != head_dim:
        raise ValueError(
            f"{path}: key_length={head_dim}, value_length={value_dim}, rope.dimension_count={rope_dim}; "
            "a transformers Llama needs all three equal (full rotary, one head_dim)"
        )
    for per_layer in ("attention.head_count", "attention.head_count_kv", "feed_forward_length"):
        if isinstance(metadata.get(f"{arch}.{per_layer}"), list):
            raise ValueError(f"{path}: per-layer {arch}.{per_layer} is not supported; it must be one number")

    rope = {"rope_type": "default", "rope_theta": float(metadata.get(f"{arch}.rope.freq_base", 10000.0))}
    scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        rope = {**rope, "rope_type": "linear", "factor": float(key("rope.scaling.factor"))}
    elif scaling != "none":
        raise ValueError(f"{path}: {arch}.rope.scaling.type={scaling!r} is not supported; supported: none, linear")

    n_tokens = len(metadata["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in metadata else None
    vocab = metadata.get(f"{arch}.vocab_size", n_tokens)
    if vocab is None:
        raise ValueError(f"{path}: neither {arch}.vocab_size nor tokenizer.ggml.tokens says the vocabulary size")

    def token_id(name: str):
        value = metadata.get(f"tokenizer.ggml.{name}")
        return None if value is None else int(value)

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_parameters": rope,
        "attention_bias": any(name.endswith("attn_q.bias") for name in tensor_names),
        "mlp_bias": any(name.endswith("ffn_gate.bias") for name in tensor_names),
        # llama.cpp writes output.weight only when the LM head is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": token_id("bos_token_id"),
        "eos_token_id": token_id("eos_token_id"),
        "pad_token_id": token_id("padding_token_id"),
        "dtype": "float32",
    }


def expected_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor a Llama with this config has (biases included if flagged)."""
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, d)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }
        if config["attention_bias"]:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (d,)}
        if config["mlp_bias"]:
            shapes |= {p + "mlp.gate_proj.bias": (f,), p + "mlp.up_proj.bias": (f,), p + "mlp.down_proj.bias": (d,)}
    return shapes


def _dequantize(tensor, path: str) -> np.ndarray:
    """float32 values of one ``ReaderTensor`` in numpy (row-major, fastest GGUF dim last) order."""
    import gguf

    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    kind = tensor.tensor_type
    try:
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F64):
            values = np.array(tensor.data, dtype=np.float32)  # a copy: tensor.data is a read-only file map
        else:
            values = gguf.quants.dequantize(tensor.data, kind)
    except NotImplementedError as error:
        raise ValueError(
            f"{path}: tensor {tensor.name!r} is stored as {kind.name}, which gguf.quants cannot dequantise"
        ) from error
    return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)


def gguf_to_hf(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a llama-architecture GGUF as ``(hf_config, tensors)``.

    ``hf_config`` is a ``LlamaConfig``-style dict (what ``config.json`` would hold) and
    ``tensors`` maps transformers names (``model.layers.0.self_attn.q_proj.weight``, ...)
    to C-contiguous float32 arrays in transformers' layout (``[out, in]`` for linears),
    quantised tensors dequantised and q/k rows un-permuted. Every tensor the config
    implies must be present with its shape, and no unknown tensor may appear; any
    violation raises ``ValueError`` naming the tensor, never a partial result.
    """
    path = os.fspath(path)
    reader = read_gguf(path)
    return hf_from_reader(reader, gguf_metadata(reader), path=path)


def hf_from_reader(reader, metadata: Mapping[str, Any], *, path: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``gguf_to_hf`` on an already open reader and its metadata (parsing a file's header is the slow part)."""
    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {architecture!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    gguf_names = {tensor.name for tensor in reader.tensors}
    config = _llama_config(metadata, gguf_names, path)
    shapes = expected_shapes(config)
    heads = {"self_attn.q_proj": config["num_attention_heads"], "self_attn.k_proj": config["num_key_value_heads"]}

    # Names first, so a wrong file fails before any dequantisation work.
    names = {tensor.name: hf_name(tensor.name) for tensor in reader.tensors}
    for gguf_name, name in names.items():
        if name is None or name not in shapes:
            raise ValueError(
                f"{path}: unexpected tensor {gguf_name!r} for a {architecture} model with "
                f"{config['num_hidden_layers']} layers; it has no transformers counterpart"
            )
    missing = sorted(set(shapes) - set(names.values()))
    if missing:
        listed = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"{path}: missing tensor(s) {listed}")

    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = names[tensor.name]
        values = _dequantize(tensor, path)
        if values.shape != shapes[name]:
            raise ValueError(
                f"{path}: tensor {tensor.name!r} ({name}) has shape {values.shape}; "
                f"the metadata implies {shapes[name]}"
            )
        module = name.rsplit(".", 1)[0].split(".", 3)[-1]  # e.g. "self_attn.q_proj"
        if module in heads:
            values = unpermute_rows(values, heads[module])
        tensors[name] = values
    return config, tensors
