"""Bad input gives a clear error naming what is wrong, never a silent partial load."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from alignax.models import (
    CausalLM,
    ModelConfig,
    create_model,
    SafetensorsError,
    from_hf_state_dict,
    from_pretrained,
    read_hf_tensors,
    read_safetensors,
    save_pretrained,
    to_hf_state_dict,
    ValueModel,
    write_safetensors,
)

CFG = dict(
    model_type="qwen2",
    vocab_size=24,
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def checkpoint():
    model = create_model(ModelConfig.from_hf_config(CFG), seed=0)
    return to_hf_state_dict(model)


def test_config_errors():
    for field in ("hidden_size", "num_hidden_layers", "vocab_size"):
        cfg = {k: v for k, v in CFG.items() if k != field}
        with pytest.raises(ValueError, match=f"qwen2 config is missing the required field '{field}'"):
            ModelConfig.from_hf_config(cfg)
    with pytest.raises(ValueError, match="gpt2 config is missing the required field 'n_head'"):
        ModelConfig.from_hf_config({"model_type": "gpt2", "vocab_size": 8, "n_embd": 8, "n_layer": 1})
    unsupported = (r"unsupported architecture model_type='falcon'; supported: llama, qwen2, qwen3, qwen3_moe, gpt2, "
                   r"mistral, phi3, gemma2, gemma3_text")
    with pytest.raises(ValueError, match=unsupported):
        ModelConfig.from_hf_config(dict(CFG, model_type="falcon"))
    with pytest.raises(ValueError, match="missing the field 'model_type'"):
        ModelConfig.from_hf_config({k: v for k, v in CFG.items() if k != "model_type"})
    with pytest.raises(ValueError, match=r"unsupported rope_type 'yarn' .*supported: default, linear, llama3, longrope"):
        ModelConfig.from_hf_config(dict(CFG, rope_parameters={"rope_type": "yarn", "factor": 2.0}))
    with pytest.raises(ValueError, match="'llama3' is missing the field 'low_freq_factor'"):
        ModelConfig.from_hf_config(dict(CFG, rope_parameters={"rope_type": "llama3", "factor": 8.0}))
    with pytest.raises(ValueError, match="sliding-window attention is not supported"):
        ModelConfig.from_hf_config(dict(CFG, use_sliding_window=True))
    with pytest.raises(ValueError, match="unsupported hidden_act 'tanh'"):
        ModelConfig.from_hf_config(dict(CFG, hidden_act="tanh"))
    with pytest.raises(ValueError, match="param_dtype must be one of"):
        ModelConfig.from_hf_config(CFG, param_dtype="float16")
    with pytest.raises(TypeError, match="unknown policy arguments"):
        ModelConfig.from_hf_config(CFG, dtype_="float32")
    with pytest.raises(ValueError, match=r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"):
        ModelConfig.from_hf_config(dict(CFG, num_key_value_heads=3))


def test_tensor_errors(checkpoint):
    hf_config, tensors = checkpoint
    # the intact checkpoint loads
    assert isinstance(from_hf_state_dict(hf_config, tensors), CausalLM)

    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    with pytest.raises(ValueError, match=r"missing tensors \(1\): model\.layers\.1\.self_attn\.k_proj\.bias"):
        from_hf_state_dict(hf_config, missing)

    extra = dict(tensors, **{"model.layers.0.mlp.extra.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(ValueError, match=r"unexpected tensors \(1\): model\.layers\.0\.mlp\.extra\.weight"):
        from_hf_state_dict(hf_config, extra)

    score = dict(tensors, **{"score.weight": np.zeros((1, 16), np.float32)})
    with pytest.raises(ValueError, match="load with kind='reward'"):
        from_hf_state_dict(hf_config, score)

    wrong = dict(tensors, **{"model.layers.0.mlp.up_proj.weight": np.zeros((24, 15), np.float32)})
    both_shapes = r"wrong shapes \(1\): model\.layers\.0\.mlp\.up_proj\.weight: expected \[24, 16\], found \[24, 15\]"
    with pytest.raises(ValueError, match=both_shapes):
        from_hf_state_dict(hf_config, wrong)

    # a checkpoint for another size: every problem is listed in one error
    other = dict(hf_config, num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"missing tensors \(\d+\): model\.layers\.2\."):
        from_hf_state_dict(other, tensors)

    with pytest.raises(ValueError, match="unknown kind 'critic'"):
        from_hf_state_dict(hf_config, tensors, kind="critic")


def test_corrupt_and_missing_files(checkpoint, tmp_path):
    hf_config, tensors = checkpoint
    model = from_hf_state_dict(hf_config, tensors)
    good = tmp_path / "good"
    save_pretrained(model, good)
    blob = (good / "model.safetensors").read_bytes()

    cases = {
        "truncated": (blob[: len(blob) - 40], "outside the .* data bytes; file corrupt or truncated"),
        "tiny": (blob[:5], "too short for a safetensors file"),
        "header_len": ((10**9).to_bytes(8, "little") + blob[8:], "header length 1000000000 exceeds the file"),
        "garbage": (blob[:8] + b"\xff" * (len(blob) - 8), "header is not valid JSON"),
    }
    for name, (data, message) in cases.items():
        bad = tmp_path / name
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps(hf_config))
        (bad / "model.safetensors").write_bytes(data)
        with pytest.raises(SafetensorsError, match=message):
            from_pretrained(bad)

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_pretrained(empty)
    (empty / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        from_pretrained(empty)
    (empty / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index.json"):
        from_pretrained(empty)


def test_sharded_checkpoint_and_bfloat16_round_trip(checkpoint, tmp_path):
    import ml_dtypes

    hf_config, tensors = checkpoint
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, keys in shards.items():
        write_safetensors(tmp_path / file, {k: tensors[k].astype(ml_dtypes.bfloat16) for k in keys})
    index = {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    read = read_hf_tensors(tmp_path)
    assert set(read) == set(tensors) and read[names[0]].dtype == ml_dtypes.bfloat16
    model = from_pretrained(tmp_path, param_dtype="bfloat16")
    _, back = to_hf_state_dict(model)
    for k in names:
        np.testing.assert_array_equal(back[k], tensors[k].astype(ml_dtypes.bfloat16))
    # the bfloat16 file we write is read back bit for bit
    write_safetensors(tmp_path / "x.safetensors", back)
    again = read_safetensors(tmp_path / "x.safetensors")
    assert all(np.array_equal(again[k], back[k]) for k in back)
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_a_model_name_resolves_to_a_registry_entry_or_a_folder_or_an_error_naming_its_key(toy_model):
    """One resolver (alignax.models.registry.model_directory) serves the trainers' model.name
    and the judge's rewards.judge_model: a local folder is itself, its tokenizer loads from
    it, and a name that is neither is an error naming the key and the known models."""
    from alignax.models.registry import ModelNotFoundError, load, load_tokenizer, model_directory
    from alignax.trainers.config import ModelSpec
    from alignax.trainers.engine.setup import load_tokenizer as spec_tokenizer, model_directory as spec_directory

    assert model_directory(toy_model) == type(model_directory(toy_model))(toy_model)
    assert spec_directory(ModelSpec(name=toy_model)) == toy_model
    ids = load_tokenizer(toy_model).encode("hi there")
    assert ids == spec_tokenizer(ModelSpec(name=toy_model)).encode("hi there") and len(ids) == 2
    model, tokenizer = load(toy_model, kind="value")
    assert isinstance(model, ValueModel) and tokenizer.encode("hi there") == ids
    for key in ("model.name", "rewards.judge_model"):
        with pytest.raises(ModelNotFoundError, match=rf"{key} 'no-such' is neither a registry model nor a local "
                                                     r"Hugging Face folder \(unknown model 'no-such'; known models: "
                                                     "smollm2-135m-instruct"):
            model_directory("no-such", key=key)
        # spelt as a hub id, the line also says where the hub cache was looked in (tests/test_hub_models.py)
        with pytest.raises(ModelNotFoundError, match=rf"{key} 'no/such' is neither a registry model, a local Hugging "
                                                     r"Face folder nor available from the hub: no/such is not in the "
                                                     r"Hugging Face cache .*\(known models: smollm2-135m-instruct\)"):
            model_directory("no/such", key=key)
    with pytest.raises(ValueError, match="model.name 'no-such' is neither"):  # a ValueError for config checks
        spec_directory(ModelSpec(name="no-such"))
    with pytest.raises(FileNotFoundError, match="model 'no-such' is neither"):  # and a missing file
        load("no-such")
