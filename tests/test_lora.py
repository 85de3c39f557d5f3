"""LoRA (alignax.models.lora, alignax.trainers.engine.adapters).

- A fresh adapter leaves the model's logits unchanged bit for bit (list and scan+remat
  layers, an untied LM head with its own adapter); the adapter path against a NumPy
  ``x W + s (x A) B``; merging equals the unmerged model.
- The PEFT adapter we write loads with ``peft`` onto the transformers base and gives our
  logits; a PEFT adapter written by ``peft`` itself loads into alignax with its logits.
- A LoRA DPO run on the toy task (the full-parameter test's setup) learns; its train state
  and optimiser state hold adapter leaves only; the base is bitwise unchanged; the reference
  (adapters off) shares the base's buffers and scores as a separately loaded base does;
  resume is bit-identical; export merges (transformers logits = ours).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from alignax.models import ModelConfig, create_model, from_pretrained
from alignax.models.lora import (LoRAParam, LoraConfig, count_adapter_params, load_peft_adapter, merge_adapters,
                                 save_peft_adapter, with_adapters)
from alignax.trainers.api import build_trainer, export, train
from alignax.trainers.engine.setup import response_logps
from tests.support.trainer_helpers import separable_pairs, tiny_config

HF = dict(model_type="llama", vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=64, rms_norm_eps=1e-5,
          tie_word_embeddings=False)
TOKENS = np.array([[1, 17, 3, 12, 9, 4, 22], [5, 6, 7, 8, 2, 30, 31]])


_FORWARD = jax.jit(lambda graphdef, state, tokens: nnx.merge(graphdef, state)(tokens).logits, static_argnums=0)


def logits(model) -> np.ndarray:
    """The model's logits on TOKENS, through one compiled forward per architecture."""
    graphdef, state = nnx.split(model)
    return np.asarray(_FORWARD(graphdef, state, TOKENS))


def _perturbed(model, scale=0.05, seed=1):
    """The model with every adapter weight moved off its initial value (B no longer 0)."""
    state = nnx.state(model, LoRAParam)
    keys = iter(jax.random.split(jax.random.key(seed), len(jax.tree.leaves(state))))
    nnx.update(model, jax.tree.map(lambda x: x + scale * jax.random.normal(next(keys), x.shape, x.dtype), state))
    return model


# ---------------------------------------------------------------------------- the module
def test_config_validates_and_expands_targets():
    spec = LoraConfig(rank=4, alpha=8, targets=("all", "q", "lm_head"))
    assert spec.targets == ("q", "k", "v", "o", "gate", "up", "down", "lm_head")
    assert spec.scale == 2.0 and LoraConfig(rank=4, alpha=8, rslora=True).scale == 4.0
    for bad, message in [(dict(rank=0), "lora.rank"), (dict(targets=("qq",)), "unknown 'qq'"),
                         (dict(dropout=1.0), "lora.dropout"), (dict(targets=()), "lora.targets")]:
        with pytest.raises(ValueError, match=message):
            LoraConfig(**bad)


def test_fresh_adapter_is_the_base_bit_for_bit_and_merging_is_exact():
    scan = True  # scan + remat; list layers: the PEFT test and the DPO run (accuracy 0 at step 0)
    base = create_model(ModelConfig.from_hf_config(HF, scan_layers=scan, remat=scan), seed=0)
    expected = logits(base)
    model = with_adapters(base, LoraConfig(rank=4, alpha=8, targets=("all", "lm_head")))
    # 2 layers x (q k v o gate up down) + LM head, r (in + out) each
    per_layer = 4 * ((32 + 32) + (32 + 16) * 2 + (32 + 32) + (32 + 64) * 2 + (64 + 32))
    assert count_adapter_params(model) == 2 * per_layer + 4 * (32 + 32)
    a = nnx.state(model, LoRAParam)["model"]["layers"]
    q_a = (a["attn"] if scan else a[0]["attn"])["q_lora"]["a"]
    assert q_a.get_metadata()["out_sharding"] == (("layers",) if scan else ()) + ("embed", "lora_rank")
    np.testing.assert_array_equal(logits(model), expected)  # exact, not close
    _perturbed(model)
    changed = logits(model)
    assert np.max(np.abs(changed - expected)) > 0.1
    merged = merge_adapters(model)
    assert merged.config.lora is None and not jax.tree.leaves(nnx.state(merged, LoRAParam))
    np.testing.assert_allclose(logits(merged), changed, atol=2e-5)
    # the adapted model is left as it was (merging once set its kernels to W + s A B in place,
    # so an exported model then computed W + 2 s A B)
    np.testing.assert_array_equal(logits(model), changed)


def test_adapter_adds_s_x_a_b_to_a_projection():
    model = _perturbed(with_adapters(create_model(ModelConfig.from_hf_config(HF), seed=0),
                                     LoraConfig(rank=2, alpha=3, targets=("o",))))
    attn = model.model.layers[0].attn
    x = np.random.default_rng(0).normal(size=(3, 2, 4, 8)).astype(np.float32)  # [B, T, N, H]
    a, b = np.asarray(attn.o_lora.a[...]), np.asarray(attn.o_lora.b[...])  # [N, H, r], [r, D]
    want = 1.5 * (x.reshape(6, 32) @ a.reshape(32, 2)) @ b
    np.testing.assert_allclose(np.asarray(attn.o_lora(jnp.asarray(x))), want.reshape(3, 2, 32), rtol=1e-5, atol=1e-6)


def test_sampler_generates_with_adapters_unmerged_as_the_merged_model_does():
    from alignax.sampling import SamplingConfig, generate

    model = _perturbed(with_adapters(create_model(ModelConfig.from_hf_config(HF), seed=0),
                                     LoraConfig(rank=4, alpha=8, targets=("all", "lm_head"))), scale=0.2)
    config = SamplingConfig(max_new_tokens=6, temperature=1.0, num_samples=2)
    prompts, mask = jnp.asarray(TOKENS[:, :4]), jnp.ones((2, 4), jnp.int32)
    run = jax.jit(generate, static_argnums=0, static_argnames=("config",))
    unmerged = run(*nnx.split(model), prompts, mask, jax.random.key(3), config=config)
    merged = run(*nnx.split(merge_adapters(model)), prompts, mask, jax.random.key(3), config=config)
    base = run(*nnx.split(create_model(ModelConfig.from_hf_config(HF), seed=0)), prompts, mask, jax.random.key(3),
               config=config)
    np.testing.assert_array_equal(np.asarray(unmerged.tokens), np.asarray(merged.tokens))
    np.testing.assert_allclose(np.asarray(unmerged.sampling_logps), np.asarray(merged.sampling_logps), atol=1e-4)
    assert np.any(np.asarray(unmerged.tokens) != np.asarray(base.tokens))  # the adapters are in the samples


# ---------------------------------------------------------------------------- PEFT interchange
def test_peft_adapter_round_trip_with_transformers_and_peft(tmp_path):
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from alignax.models import save_pretrained

    base = create_model(ModelConfig.from_hf_config(HF), seed=0)
    save_pretrained(base, tmp_path / "base")
    model = _perturbed(with_adapters(base, LoraConfig(rank=4, alpha=8, targets=("all",), rslora=True)))
    ours = logits(model)
    save_peft_adapter(model, tmp_path / "adapter")
    save_pretrained(model, tmp_path / "merged")  # merged into the kernels

    def hf_logits(m):
        with torch.no_grad():
            return m(torch.tensor(TOKENS)).logits.numpy()

    hf_base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", local_files_only=True).eval()
    with_peft = peft.PeftModel.from_pretrained(hf_base, str(tmp_path / "adapter")).eval()
    np.testing.assert_allclose(hf_logits(with_peft), ours, atol=1e-4)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True).eval()
    np.testing.assert_allclose(hf_logits(merged), ours, atol=1e-4)

    # An adapter written by peft itself (random B, so it does something) loads into alignax.
    fresh = AutoModelForCausalLM.from_pretrained(tmp_path / "base", local_files_only=True)
    config = peft.LoraConfig(r=2, lora_alpha=5, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)
    theirs = peft.get_peft_model(fresh, config).eval()
    theirs.save_pretrained(tmp_path / "theirs")
    loaded = load_peft_adapter(from_pretrained(tmp_path / "base"), tmp_path / "theirs")
    assert loaded.config.lora.targets == ("q", "v", "down") and loaded.config.lora.scale == 2.5
    np.testing.assert_allclose(logits(loaded), hf_logits(theirs), atol=1e-4)


@pytest.mark.parametrize("targets,rslora", [(("all", "lm_head"), False), (("q", "v", "up", "o"), True)])
def test_a_phi3_adapter_exports_to_peft_through_its_fused_projections(tmp_path, targets, rslora):
    """Phi-3 fuses q, k, v into ``qkv_proj`` and gate, up into ``gate_up_proj``: the export
    writes one PEFT adapter per fused module, the parts' adapters side by side (rank n r,
    block-diagonal B, zero rows for a part without one, ``alpha_pattern`` keeping each part's
    scale), and peft on the transformers base gives our logits."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from alignax.models import save_pretrained
    from tests.support.model_families import CONFIGS

    base = create_model(ModelConfig.from_hf_config(CONFIGS["phi3"]), seed=0)
    save_pretrained(base, tmp_path / "base")
    model = _perturbed(with_adapters(base, LoraConfig(rank=2, alpha=3, targets=targets, rslora=rslora)), scale=0.2)
    ours = logits(model)
    assert np.max(np.abs(ours - logits(base))) > 0.05  # the adapters change the logits
    save_peft_adapter(model, tmp_path / "adapter")
    with open(tmp_path / "adapter" / "adapter_config.json") as f:
        written = json.load(f)
    fused = {"qkv_proj": 3, "gate_up_proj": 2} if "all" in targets else {"qkv_proj": 2}  # adapted parts
    assert written["rank_pattern"] == {m: 2 * n for m, n in fused.items()}
    hf_base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", local_files_only=True).eval()
    with_peft = peft.PeftModel.from_pretrained(hf_base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        theirs = with_peft(torch.tensor(TOKENS)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4)
    with pytest.raises(ValueError, match=r"target_modules \[.*'qkv_proj'\] are fused modules \(Phi-3's\)"):
        load_peft_adapter(base, tmp_path / "adapter")


def test_a_peft_adapter_with_per_module_ranks_or_alphas_is_refused_by_name(tmp_path):
    """alignax's adapters have one rank and one alpha: a PEFT adapter whose ``rank_pattern`` or
    ``alpha_pattern`` gives a module its own would load at the wrong scale (alpha) or fail in a
    reshape (rank); both are refused, naming the key."""
    model = _perturbed(with_adapters(create_model(ModelConfig.from_hf_config(HF), seed=0),
                                     LoraConfig(rank=2, alpha=4, targets=("q", "v"))))
    save_peft_adapter(model, tmp_path / "adapter")
    config_path = tmp_path / "adapter" / "adapter_config.json"
    written = json.loads(config_path.read_text())
    assert load_peft_adapter(create_model(ModelConfig.from_hf_config(HF), seed=0), tmp_path / "adapter")
    for key, value in (("alpha_pattern", {"v_proj": 8.0}), ("rank_pattern", {"q_proj": 4})):
        config_path.write_text(json.dumps({**written, key: value}))
        with pytest.raises(ValueError, match=f"{key} give modules their own rank or alpha"):
            load_peft_adapter(create_model(ModelConfig.from_hf_config(HF), seed=0), tmp_path / "adapter")


# ---------------------------------------------------------------------------- a LoRA DPO run
LORA = {"rank": 4, "alpha": 8}


@pytest.fixture(scope="module")
def lora_dpo(tmp_path_factory, toy_model):
    out = tmp_path_factory.mktemp("lora-dpo")
    config = tiny_config(out, "dpo", steps=30, model_dir=toy_model, preference={"beta": 0.5}, lora=LORA,
                         optim={"learning_rate": 3e-2}, train={"save_every": 0})
    trainer = build_trainer(config, records=separable_pairs(96))
    return config, trainer, train(config, records=separable_pairs(96))


@pytest.mark.xdist_group("lora-dpo")  # shares the module fixture: one worker builds it
def test_lora_dpo_learns_the_separable_preference(lora_dpo):
    _, _, result = lora_dpo
    before, after = result.eval_history[0], result.eval_history[-1]
    assert before["eval/rewards/accuracies"] == 0.0  # fresh adapter == reference: every margin is 0
    assert after["eval/rewards/accuracies"] >= 0.9
    assert after["eval/loss"] < before["eval/loss"] - 0.1


@pytest.mark.xdist_group("lora-dpo")  # shares the module fixture: one worker builds it
def test_only_adapters_are_trained_and_the_base_is_unchanged(lora_dpo, toy_model):
    _, trainer, result = lora_dpo
    state = result.loop.state
    adapter_shapes = [x.shape for x in jax.tree.leaves(nnx.state(result.model, LoRAParam))]
    assert [x.shape for x in jax.tree.leaves(state.params)] == adapter_shapes
    n_adapter = count_adapter_params(result.model)
    # rank 4 on (q k v o gate up down) of each of the toy model's layers, r (in + out) each
    layers = result.model.config.num_layers
    assert n_adapter == layers * 4 * ((32 + 32) + (32 + 16) * 2 + (32 + 32) + (32 + 64) * 2 + (64 + 32))
    # Adam's two moments, float32: 8 bytes per adapter weight, nothing for the base
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.nbytes for x in moments) == 8 * n_adapter
    loaded = dict(nnx.to_flat_state(nnx.state(from_pretrained(toy_model), nnx.Param)))
    now = dict(nnx.to_flat_state(nnx.state(result.model, nnx.Param)))
    assert set(loaded) == {p for p in now if not any(str(k).endswith("_lora") for k in p)}
    for path, value in loaded.items():  # bitwise: the trained model's base is the checkpoint's
        np.testing.assert_array_equal(np.asarray(now[path][...]), np.asarray(value[...]))
    assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(nnx.state(result.model, LoRAParam)))


@pytest.mark.xdist_group("lora-dpo")  # shares the module fixture: one worker builds it
def test_reference_is_the_base_with_adapters_off_and_no_second_copy(lora_dpo, toy_model):
    _, trainer, result = lora_dpo
    frozen = trainer.eval_frozen(result.loop.state)
    base_leaves = {id(x) for x in jax.tree.leaves(frozen["base"])}
    ref = frozen["reference"]
    ref_base, ref_adapters = nnx.split_state(ref, nnx.Not(LoRAParam), ...)
    assert all(id(x) in base_leaves for x in jax.tree.leaves(ref_base))  # the same buffers
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(ref_adapters))
    mask = np.ones_like(TOKENS)
    positions = np.broadcast_to(np.arange(TOKENS.shape[1]), TOKENS.shape)

    @functools.partial(jax.jit, static_argnums=0)
    def logps(graphdef, state):
        return response_logps(nnx.merge(graphdef, state), TOKENS, positions, mask, mask)[0]

    ours = logps(trainer.graphdef, nnx.merge_state(ref, trainer.rest))
    theirs = logps(*nnx.split(from_pretrained(toy_model)))
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))


@pytest.mark.xdist_group("lora-dpo")  # shares the module fixture: one worker builds it
def test_lora_resume_is_bit_identical_and_checkpoints_hold_adapters_only(tmp_path, lora_dpo):
    from alignax.checkpoint import Checkpointer, _shapes

    config, _, full = lora_dpo
    split = dataclasses.replace(config, output_dir=str(tmp_path))
    records = separable_pairs(96)
    train(dataclasses.replace(split, train=dataclasses.replace(config.train, total_steps=20)), records=records)
    resumed = train(split, records=records)
    assert [h["step"] for h in resumed.history] == list(range(21, 31))
    assert [h["loss"] for h in full.history[20:]] == [h["loss"] for h in resumed.history]
    for a, b in zip(jax.tree.leaves(full.loop.state.params), jax.tree.leaves(resumed.loop.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ckpt = Checkpointer(os.path.join(tmp_path, "checkpoints"))
    saved = _shapes(ckpt._manager.item_metadata(30)["state"])
    ckpt.close()
    params = {k: v for k, v in saved.items() if k.startswith("params/")}
    assert params and all("_lora/" in k for k in params)  # adapters only: the base is never re-saved
    n_adapter = count_adapter_params(resumed.model)
    assert sum(int(np.prod(v)) for v in saved.values() if v) < 4 * n_adapter  # params + Adam's two moments


@pytest.mark.xdist_group("lora-dpo")  # shares the module fixture: one worker builds it
def test_export_of_a_lora_run_is_merged_and_carries_the_peft_adapter(lora_dpo):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    config, _, result = lora_dpo
    out = export(config)
    with open(os.path.join(out, "adapter", "adapter_config.json")) as f:
        assert json.load(f)["r"] == LORA["rank"]
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor(TOKENS)).logits.numpy()
    np.testing.assert_allclose(logits(result.model), theirs, atol=1e-4)
    assert np.max(np.abs(logits(result.model) - logits(from_pretrained(config.model.name)))) > 1e-3  # trained


# ---------------------------------------------------------------------------- a LoRA GRPO run
def _untied(toy_model, directory) -> str:
    """The toy model with its tied head written out as an LM head of its own (the same
    function: ``lm_head = embed``), so LoRA can adapt the head."""
    import shutil

    from alignax.models.hf import to_hf_state_dict
    from alignax.models.safetensors_io import write_safetensors

    hf_config, tensors = to_hf_state_dict(from_pretrained(toy_model))
    hf_config["tie_word_embeddings"] = False
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    os.makedirs(directory)
    write_safetensors(os.path.join(directory, "model.safetensors"), tensors)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config, f)
    for name in os.listdir(toy_model):
        if name.startswith(("tokenizer", "chat_template")):
            shutil.copy(os.path.join(toy_model, name), directory)
    return str(directory)


def test_lora_grpo_raises_the_mean_reward_with_the_adapters_off_reference(tmp_path, toy_model):
    """The toy task and model of the full-parameter GRPO test (tests/test_online.py), its head
    untied so that it gets an adapter too. (With the tied random embeddings frozen, the final
    norm bounds every logit gap below ~1.3 nats: adapters on the trunk alone cannot make
    "yes" likely, whatever they learn.)"""
    from tests.support.rl_toy import toy_config, toy_prompts

    model_dir = _untied(toy_model, tmp_path / "untied")
    config = toy_config(tmp_path / "run", model_dir, "grpo", steps=20, checkpoint={"enabled": False},
                        lora={**LORA, "targets": ["all", "lm_head"]}, optim={"learning_rate": 2e-2})
    trainer = build_trainer(config, records=toy_prompts(32))
    _, frozen = trainer.start()
    base_ids = {id(x) for x in jax.tree.leaves(frozen["base"])}
    ref_base, ref_adapters = nnx.split_state(frozen["reference"], nnx.Not(LoRAParam), ...)
    assert all(id(x) in base_ids for x in jax.tree.leaves(ref_base))  # no second copy of the weights
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(ref_adapters))
    result = train(config, records=toy_prompts(32))
    rewards = np.array([h["reward/total"] for h in result.history])
    assert rewards[-5:].mean() > rewards[:5].mean() + 0.3, rewards.round(3).tolist()
    # fresh adapters: the policy is the reference, up to float32 rounding (the policy and the
    # reference are separately compiled programs, and XLA may fuse the zero adapter term into
    # the base matmul differently; the bit-for-bit identity of a fresh adapter is asserted on
    # one program in test_fresh_adapter_is_the_base_bit_for_bit_and_merging_is_exact)
    assert abs(result.history[0]["kl/ref_seq"]) < 1e-6
    assert result.history[-1]["kl/ref_seq"] > 0.0
    assert [x.shape for x in jax.tree.leaves(result.loop.state.params)] == \
        [x.shape for x in jax.tree.leaves(nnx.state(result.model, LoRAParam))]


@pytest.mark.parametrize("recipe", ["sft-lora", pytest.param("grpo-lora", marks=pytest.mark.slow)])
def test_tiny_lora_recipes_run(tmp_path, recipe):
    """configs/tiny-{sft,grpo}-lora.yaml end to end (tiny-dpo-lora runs in the config-schema
    sweep): two steps, adapters alone in the train state, the loss finite."""
    result = train(tiny_config(tmp_path, recipe, steps=2, checkpoint={"enabled": False}))
    assert result.loop.last_step == 2 and all(np.isfinite(h["loss"]) for h in result.history)
    adapters = [x.shape for x in jax.tree.leaves(nnx.state(result.model, LoRAParam))]
    assert adapters and [x.shape for x in jax.tree.leaves(result.loop.state.params)] == adapters


def test_estimator_counts_adapters_and_one_frozen_base():
    from alignax import estimate as est
    from alignax.trainers.api import load_config

    config = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "dpo-lora.yaml"))
    model = ModelConfig.from_hf_config(HF)
    spec = LoraConfig(rank=4, alpha=8, targets=("all", "lm_head"))
    built = with_adapters(create_model(model), spec)
    assert est.adapter_parameter_count(model, spec) == count_adapter_params(built)
    shape = est.model_config_for(config, "llama-2-7b")
    adapters = est.adapter_parameter_count(shape, config.lora)
    # rank 16 on the 7 projections of Llama-2-7B: 16 * (4 * (4096 + 4096) + 3 * (4096 + 11008)) * 32 layers
    assert adapters == 16 * (4 * 8192 + 3 * 15104) * 32 == 39_976_960
    lora = est.estimate(config, model=shape, devices=1)
    full = est.estimate(dataclasses.replace(config, lora=None), model=shape, devices=1)
    P = full.parameters
    assert lora.items["policy weights"] == 4 * adapters and lora.items["policy optimizer moments"] == 8 * adapters
    assert lora.items["frozen base"] == 4 * P and lora.items["reference"] == 0.0
    assert full.items["reference"] == 4 * P and full.items["policy optimizer moments"] == 8 * P
    # no moments or reference for the base (12 bytes a parameter); the full run's gradients
    # and update (8 bytes) come after its 7.5 bytes a parameter of activations are freed
    assert lora.total < full.total - 12 * P


@pytest.mark.xdist_group("mesh-equality")
def test_lora_dpo_on_a_2x2x2_mesh_matches_one_device():
    from tests.fake_devices import mesh_equality

    out = mesh_equality("mesh_dpo_check:--lora")
    assert out["devices"] == 8
    np.testing.assert_allclose(out["loss_sharded"], out["loss_single"], rtol=1e-5)
    assert out["max_param_diff"] < 5e-5
    assert out["eval_accuracy_sharded"] == out["eval_accuracy_single"]
    # adapters shard like the kernels they adapt: q's A [embed, lora_rank] over fsdp, B's heads over tensor
    q_a = next(v for k, v in out["specs"].items() if "q_lora" in k and "'a'" in k)
    q_b = next(v for k, v in out["specs"].items() if "q_lora" in k and "'b'" in k)
    assert "fsdp" in q_a and "tensor" in q_b, (q_a, q_b)
    # QLoRA (NF4 base, block 64): two DPO steps on the mesh equal one device's
    np.testing.assert_allclose(out["qlora_loss_sharded"], out["qlora_loss_single"], rtol=1e-5)
    assert out["qlora_max_adapter_diff"] < 5e-5
    assert out["qlora_loss_sharded"][1] != out["loss_sharded"][1]  # the NF4 base, not the float one
