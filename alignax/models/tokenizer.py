"""The tokenizer stored in a GGUF file's metadata, rebuilt with the ``tokenizers`` package.

A GGUF carries no ``tokenizer.json``: llama.cpp keeps the vocabulary
(``tokenizer.ggml.tokens``), the BPE merges, the token types, the special ids, the
pre-tokenizer family (``tokenizer.ggml.pre``) and the Jinja chat template as metadata.
``tokenizer_from_gguf`` turns those into a ``transformers.PreTrainedTokenizerFast``:

- model: byte-level BPE (``tokenizer.ggml.model == "gpt2"``), vocabulary and merges as
  stored (llama.cpp stores ordinary tokens already in GPT-2's byte-to-unicode spelling);
- pre-tokenizer: the regex split llama.cpp uses for the ``pre`` family, then byte-level
  mapping. SmolLM2 (``smollm``) splits every digit apart, then applies GPT-2's regex;
- added tokens: llama.cpp token type 3 (CONTROL, e.g. ``<|im_end|>``) become special
  tokens, type 4 (USER_DEFINED) plain added tokens, both matched whole in the text;
- bos/eos/pad/unk from the ``tokenizer.ggml.*_token_id`` keys, BOS/EOS insertion from
  ``add_bos_token`` / ``add_eos_token``, the chat template from ``tokenizer.chat_template``.

For SmolLM2 pad and eos are one id (``<|im_end|>``, 2): padding masks must come from
lengths, not from comparing ids with ``pad_token_id``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

# llama.cpp's token types (gguf.TokenType).
_CONTROL, _USER_DEFINED = 3, 4

# Llama 3 (tiktoken cl100k style): case-insensitive contractions, digits in runs of at most three.
_LLAMA3_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen2: the Llama 3 split with single digits.
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# tokenizer.ggml.pre value -> pre-tokenizer family, following llama.cpp's grouping.
PRE_TOKENIZER_FAMILIES = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "smollm": "digits+gpt2",
    "starcoder": "digits+gpt2",
    "refact": "digits+gpt2",
    "codeshell": "digits+gpt2",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "llama-bpe": "llama3",
    "smaug-bpe": "llama3",
    "falcon3": "llama3",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "stablelm2": "qwen2",
}


def _pre_tokenizer(pre: str, path: str):
    from tokenizers import Regex, pre_tokenizers

    family = PRE_TOKENIZER_FAMILIES.get(pre)
    if family is None:
        raise ValueError(
            f"{path}: tokenizer.ggml.pre={pre!r} is not supported; supported: {', '.join(sorted(PRE_TOKENIZER_FAMILIES))}"
        )
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "digits+gpt2":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}[family]
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def build_tokenizer(metadata: Mapping[str, Any], *, path: str = "<metadata>"):
    """``PreTrainedTokenizerFast`` from GGUF metadata (the dict ``gguf.gguf_metadata`` returns)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    kind = metadata.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{path}: tokenizer.ggml.model={kind!r} is not supported; only byte-level BPE ('gpt2') is"
        )
    for required in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        if required not in metadata:
            raise ValueError(f"{path}: GGUF metadata lacks {required!r}, needed to build a BPE tokenizer")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    types: list[int] = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    if len(types) != len(tokens):
        raise ValueError(f"{path}: {len(types)} token types for {len(tokens)} tokens")
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{path}: the vocabulary repeats {len(tokens) - len(vocab)} token(s)")
    merges = []
    for merge in metadata["tokenizer.ggml.merges"]:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ValueError(f"{path}: merge {merge!r} is not two tokens separated by a space")
        merges.append((left, right))

    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"), path)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    # Whole-token matches before BPE: special (control) ones first, then user-defined ones.
    backend.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == _CONTROL]
    )
    backend.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == _USER_DEFINED]
    )
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError(
            f"{path}: rebuilt vocabulary has {backend.get_vocab_size(with_added_tokens=True)} entries, "
            f"the file lists {len(tokens)}"
        )

    def special(name: str) -> str | None:
        index = metadata.get(f"tokenizer.ggml.{name}")
        if index is None:
            return None
        if not 0 <= int(index) < len(tokens):
            raise ValueError(f"{path}: tokenizer.ggml.{name}={index} is outside the vocabulary (size {len(tokens)})")
        return tokens[int(index)]

    kwargs: dict[str, Any] = {
        "tokenizer_object": backend,
        "bos_token": special("bos_token_id"),
        "eos_token": special("eos_token_id"),
        "pad_token": special("padding_token_id"),
        "unk_token": special("unknown_token_id"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    architecture = metadata.get("general.architecture")
    if architecture and f"{architecture}.context_length" in metadata:
        kwargs["model_max_length"] = int(metadata[f"{architecture}.context_length"])
    if "tokenizer.chat_template" in metadata:
        kwargs["chat_template"] = metadata["tokenizer.chat_template"]
    return PreTrainedTokenizerFast(**kwargs)


def tokenizer_from_gguf(path: str | os.PathLike):
    """The tokenizer described by the GGUF file at ``path`` (see the module docstring)."""
    from alignax.models.gguf import gguf_metadata, read_gguf

    path = os.fspath(path)
    return build_tokenizer(gguf_metadata(read_gguf(path)), path=path)
