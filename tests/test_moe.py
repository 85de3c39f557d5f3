"""Qwen3-MoE (alignax.models.moe) against transformers' Qwen3MoeForCausalLM on the same weights.

A tiny random mixture (4 experts, top 2, two layers), every parameter perturbed away from
its init (q/k/v/o biases, norm scales, router, experts), a batch with left padding:

- logits within 1e-4 of transformers', with ``norm_topk_prob`` on and off, looped and
  scanned layers;
- the load-balancing loss equal to transformers' ``aux_loss`` (padding excluded), and to
  the hand value ``k`` when the router is uniform;
- safetensors written by transformers' ``save_pretrained`` load here, and ours load in
  transformers with the same logits and the same tensor names (one ``Linear`` per expert);
- decode through the KV cache routes every token as the full forward does;
- the train step's loss is the task loss plus ``router_aux_loss_coef * aux``, equal to the
  loss transformers computes with ``labels`` (fails if the term were dropped), and a
  frozen reference's routing adds nothing.
"""

from __future__ import annotations

import json

import numpy as np
import optax
import pytest
import transformers
from flax import nnx

import jax
import jax.numpy as jnp

from alignax import models, ops
from alignax.models import from_hf_state_dict, from_pretrained, save_pretrained
from alignax.models.cache import init_cache
from alignax.models.moe import frozen_forward, load_balancing_loss
from alignax.trainers.engine.step import init_train_state, make_train_step
from tests.fake_devices import run_check
from tests.support import hf_reference
from tests.support.hf_reference import state_dict
from tests.support.model_families import MOE_CONFIGS

torch = pytest.importorskip("torch", reason="the PyTorch reference (pinned test extras)")

TOL = 1e-4
CONFIG = MOE_CONFIGS["qwen3_moe"]
COEF = CONFIG["router_aux_loss_coef"]  # 0.05: larger than transformers' 0.001, so the term shows in a float32 loss


def hf_model(seed: int = 0, **overrides):
    return hf_reference.hf_model("qwen3_moe", seed=seed, **overrides)


@pytest.fixture(scope="module")
def reference():
    cfg, hf = hf_model()
    return cfg, hf, state_dict(hf)


def batch(T: int = 8, B: int = 3, seed: int = 0):
    """Row 0 full, row 1 left-padded by 3, row 2 by 5."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, CONFIG["vocab_size"], (B, T))
    mask = np.ones((B, T), np.int64)
    mask[1, :3] = 0
    mask[2, :5] = 0
    return tokens, mask, np.maximum(np.cumsum(mask, 1) - 1, 0)


def torch_forward(model, tokens, mask, positions, **kwargs):
    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(positions), output_router_logits=True, **kwargs)


@nnx.jit
def forward(model, tokens, positions, mask):
    return model(tokens, positions, mask)


def ours(model, tokens, mask, positions):
    return forward(model, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))


@pytest.mark.parametrize("norm_topk_prob,scan", [(True, False), (False, True)], ids=["normalised", "raw-scan"])
def test_logits_match_transformers(norm_topk_prob, scan):
    cfg, hf = hf_model(seed=1, norm_topk_prob=norm_topk_prob, attention_bias=norm_topk_prob)
    model = from_hf_state_dict(cfg, state_dict(hf), scan_layers=scan)
    assert model.config.num_experts == 4 and model.config.norm_topk_prob is norm_topk_prob
    tokens, mask, positions = batch()
    ref = torch_forward(hf, tokens, mask, positions)
    out = ours(model, tokens, mask, positions)
    real = mask.astype(bool)
    assert np.abs(np.asarray(out.logits) - ref.logits.numpy())[real].max() <= TOL
    # the routing itself: transformers' router logits per layer [B*T, E] -> our probabilities
    theirs = np.stack([torch.softmax(r, -1).numpy().reshape(*tokens.shape, -1) for r in ref.router_logits])
    assert np.abs(np.asarray(out.router_probs) - theirs)[:, real].max() <= 1e-5


def test_aux_loss_matches_transformers_and_the_uniform_router(reference):
    cfg, hf, sd = reference
    model = from_hf_state_dict(cfg, sd)
    tokens, mask, positions = batch(seed=2)
    labels = np.where(mask > 0, tokens, -100)
    ref = torch_forward(hf, tokens, mask, positions, labels=torch.tensor(labels))
    out = ours(model, tokens, mask, positions)
    np.testing.assert_allclose(float(out.router_aux_loss), float(ref.aux_loss), rtol=1e-5)
    # padding is excluded: the same loss unmasked differs (pad tokens route too)
    unmasked = load_balancing_loss(out.router_probs, jnp.ones(mask.shape), top_k=2)
    assert abs(float(unmasked) - float(out.router_aux_loss)) > 1e-4
    # a zero router routes uniformly: f sums to k, P_e = 1/E, so aux = E * k / E = k
    for layer in model.model.layers:
        layer.mlp.router[...] = jnp.zeros_like(layer.mlp.router[...])
    assert float(ours(model, tokens, mask, positions).router_aux_loss) == pytest.approx(2.0, abs=1e-6)


def test_safetensors_round_trip_with_transformers(reference, tmp_path):
    cfg, hf, _ = reference
    hf.save_pretrained(tmp_path / "hf")
    model = from_pretrained(tmp_path / "hf")
    tokens, mask, positions = batch(seed=3)
    real = mask.astype(bool)
    ref = torch_forward(hf, tokens, mask, positions).logits.numpy()
    mine = np.asarray(ours(model, tokens, mask, positions).logits)
    assert np.abs(mine - ref)[real].max() <= TOL
    save_pretrained(model, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 4
    assert config["router_aux_loss_coef"] == COEF and config["norm_topk_prob"] is True
    from safetensors.numpy import load_file

    theirs = load_file(tmp_path / "hf" / "model.safetensors")
    written = load_file(tmp_path / "ours" / "model.safetensors")
    assert set(written) == set(theirs) and "model.layers.1.mlp.experts.3.down_proj.weight" in written
    for name in theirs:
        np.testing.assert_array_equal(written[name], theirs[name], err_msg=name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert type(loaded) is transformers.Qwen3MoeForCausalLM
    assert np.abs(torch_forward(loaded, tokens, mask, positions).logits.numpy() - mine)[real].max() <= TOL


def test_decode_through_the_cache_routes_as_the_full_forward(reference):
    cfg, _, sd = reference
    model = from_hf_state_dict(cfg, sd)
    tokens, mask, positions = batch(T=10, seed=4)
    full = ours(model, tokens, mask, positions)
    prompt = 6
    step = nnx.jit(lambda m, t, p, a, c: m(t, p, a, cache=c))
    cache = init_cache(model.config, batch=tokens.shape[0], max_len=tokens.shape[1])
    out = step(model, jnp.asarray(tokens[:, :prompt]), jnp.asarray(positions[:, :prompt]),
               jnp.asarray(mask[:, :prompt]), cache)
    logits, probs = [out.logits], [out.router_probs]
    for t in range(prompt, tokens.shape[1]):
        out = step(model, jnp.asarray(tokens[:, t:t + 1]), jnp.asarray(positions[:, t:t + 1]),
                   jnp.asarray(mask[:, t:t + 1]), out.cache)
        logits.append(out.logits)
        probs.append(out.router_probs)
    assert out.router_aux_loss is None  # a cached pass trains nothing
    logits, probs = np.concatenate(logits, axis=1), np.concatenate(probs, axis=2)  # [B, T, V], [L, B, T, E]
    real = mask.astype(bool)
    assert np.abs(logits - np.asarray(full.logits))[real].max() <= 1e-5
    assert np.abs(probs - np.asarray(full.router_probs))[:, real].max() <= 1e-6
    # the same experts chosen for every real token in every layer
    chosen = np.argsort(-probs, axis=-1)[..., :2]
    want = np.argsort(-np.asarray(full.router_probs), axis=-1)[..., :2]
    assert (np.sort(chosen, -1) == np.sort(want, -1))[:, real].all()


def _sft_loss(graphdef, rest):
    def loss_fn(params, frozen, batch, normalisers, rng):
        del normalisers, rng
        model = nnx.merge(graphdef, params, rest)
        logits = model(batch["tokens"], batch["positions"], batch["mask"]).logits[:, :-1]
        # a target counts where it and its predecessor are real (a pad query's logits are garbage)
        target_mask = (batch["mask"][:, 1:] * batch["mask"][:, :-1]).astype(jnp.float32)
        logps = ops.token_logprobs(logits, batch["tokens"][:, 1:])
        loss = -jnp.sum(logps * target_mask) / jnp.sum(target_mask)
        if frozen:  # a frozen twin's forward pass, as a live reference runs
            with frozen_forward():
                nnx.merge(graphdef, frozen, rest)(batch["tokens"], batch["positions"], batch["mask"])
        return loss, {"nll": loss}

    return loss_fn


@pytest.mark.parametrize("with_reference", [False, True], ids=["policy", "policy+frozen-reference"])
def test_train_step_adds_the_coefficient_times_aux(reference, with_reference):
    """The step's loss equals transformers' loss with labels (mean NLL + coef * aux_loss), a
    frozen twin's routing adding nothing; its update is not the NLL's alone (the aux term
    is differentiated, not only logged)."""
    cfg, hf, sd = reference
    model = from_hf_state_dict(cfg, sd)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens, mask, positions = batch(seed=5)
    data = {"tokens": jnp.asarray(tokens), "positions": jnp.asarray(positions), "mask": jnp.asarray(mask)}
    loss_fn = _sft_loss(graphdef, rest)
    frozen = jax.tree.map(lambda x: x * 1.5, params) if with_reference else {}
    sgd = optax.sgd(1.0)  # the update is minus the gradient
    step = jax.jit(make_train_step(loss_fn, sgd, normalisers_fn=lambda b: {}))
    state, out = step(init_train_state(params, sgd, jax.random.key(0)), frozen, data)
    scored = (mask > 0) & (np.roll(mask, 1, axis=1) > 0)  # transformers shifts: label t is predicted at t - 1
    labels = np.where(scored, tokens, -100)
    ref = torch_forward(hf, tokens, mask, positions, labels=torch.tensor(labels))
    metrics = {k: float(v) for k, v in out.metrics.items()}
    np.testing.assert_allclose(metrics["moe/aux_loss"], float(ref.aux_loss), rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"], float(ref.loss), rtol=1e-5)
    np.testing.assert_allclose(metrics["loss"] - metrics["nll"], COEF * float(ref.aux_loss), rtol=1e-3)
    if with_reference:
        return
    nll_grads = jax.jit(jax.grad(lambda p: loss_fn(p, {}, data, {}, None)[0]))(params)  # no record open

    def router(tree):
        return np.asarray(tree["model"]["layers"][0]["mlp"]["router"][...])

    update = router(state.params) - router(params)
    assert np.abs(update + router(nll_grads)).max() > 1e-4 * np.abs(update).max()


def test_expert_weights_shard_over_the_expert_axis():
    """tests/moe_mesh_check.py on 8 fake devices: the compiled train step takes each expert
    kernel ``[L, E, D, F]`` split 8 ways, its experts over ``expert`` x ``fsdp`` on a
    (1, 2, 4, 1) mesh and over ``fsdp`` on the trainers' (1, 8, 1) mesh, and gives the
    single-device loss (measured: equal to the last bit on both)."""
    result = run_check("moe_mesh_check.py", devices=8)
    want = {"expert": "P(None, ('expert', 'fsdp'), None, 'tensor')", "fsdp": "P(None, 'fsdp', None, 'tensor')"}
    assert result["aux_loss"] > 0
    for mesh, spec in want.items():
        found = result[mesh]
        assert found["expert_kernel_spec"] == spec, found
        assert found["expert_bytes_per_device"] * 8 == found["expert_bytes"], found
        assert abs(found["loss"] - result["single_device_loss"]) <= 1e-5, found


def test_model_router_aux_loss_coef_overrides_the_checkpoint(toy_moe_model, toy_model):
    """``model.router_aux_loss_coef`` is the coefficient the built model (and so the train
    step above) uses; on a dense model it is an error naming the key."""
    from alignax.config import ConfigError
    from alignax.trainers.config import ModelSpec
    from alignax.trainers.engine.setup import build_model

    assert build_model(ModelSpec(name=toy_moe_model)).config.router_aux_loss_coef == 0.01  # the checkpoint's
    assert build_model(ModelSpec(name=toy_moe_model, router_aux_loss_coef=0.5)).config.router_aux_loss_coef == 0.5
    with pytest.raises((ValueError, ConfigError), match=r"model\.router_aux_loss_coef=0\.5 is for mixture-of-experts"):
        build_model(ModelSpec(name=toy_model, router_aux_loss_coef=0.5))
    with pytest.raises(ValueError, match=r"model\.router_aux_loss_coef must be >= 0"):
        ModelSpec(router_aux_loss_coef=-1.0)


def test_config_errors_name_the_field():
    base = {k: v for k, v in CONFIG.items()}
    for change, message in (({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
                            ({"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\]"),
                            ({"num_experts_per_tok": 5}, r"num_experts_per_tok must be in \[1, num_experts=4\]")):
        with pytest.raises(ValueError, match=message):
            models.ModelConfig.from_hf_config({**base, **change})
    # transformers writes num_experts as num_local_experts (its attribute map); both read
    assert models.ModelConfig.from_hf_config({**{k: v for k, v in base.items() if k != "num_experts"},
                                              "num_local_experts": 6}).num_experts == 6


def test_parameter_count_matches_transformers(reference):
    from alignax.estimate import parameter_count

    cfg, hf, _ = reference
    assert parameter_count(models.ModelConfig.from_hf_config(cfg)) == sum(p.numel() for p in hf.parameters())


def test_scanned_remat_layers_give_the_looped_gradients(reference):
    """The router probabilities leave a scanned, rematerialised layer stack as the scan's
    outputs: loss and gradients (load-balancing term included) equal the plain loop's."""
    cfg, _, sd = reference
    tokens, mask, positions = batch(seed=6)
    data = {"tokens": jnp.asarray(tokens), "positions": jnp.asarray(positions), "mask": jnp.asarray(mask)}

    def loss_and_router_grad(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        step = jax.jit(make_train_step(_sft_loss(graphdef, rest), optax.sgd(1.0), normalisers_fn=lambda b: {}))
        state, out = step(init_train_state(params, optax.sgd(1.0), jax.random.key(0)), {}, data)
        update = jax.tree.map(lambda new, old: np.asarray(new - old), state.params, params)
        return float(out.metrics["loss"]), update["model"]["layers"]

    loop_loss, loop = loss_and_router_grad(from_hf_state_dict(cfg, sd))
    scan_loss, scan = loss_and_router_grad(from_hf_state_dict(cfg, sd, scan_layers=True, remat="full"))
    assert scan_loss == pytest.approx(loop_loss, rel=1e-6)
    for name in ("router", "gate_kernel", "down_kernel"):
        stacked = np.stack([loop[i]["mlp"][name][...] for i in range(2)])
        np.testing.assert_allclose(scan["mlp"][name][...], stacked, rtol=1e-4, atol=1e-7, err_msg=name)


def test_gradient_accumulation_logs_the_mean_aux_and_adds_it_once(reference):
    """Two micro-batches: ``moe/aux_loss`` is the mean of their aux losses, and the loss holds
    ``coef x`` that mean once (each micro-batch adds its share / 2)."""
    cfg, _, sd = reference
    model = from_hf_state_dict(cfg, sd)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens, mask, positions = batch(B=4, seed=7)
    mask[3, :2] = 0
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    data = {"tokens": jnp.asarray(tokens), "positions": jnp.asarray(positions), "mask": jnp.asarray(mask)}
    step = jax.jit(make_train_step(_sft_loss(graphdef, rest), optax.sgd(0.0), normalisers_fn=lambda b: {},
                                   grad_accum_steps=2))
    _, out = step(init_train_state(params, optax.sgd(0.0), jax.random.key(0)), {}, data)
    halves = [ours(model, tokens[s], mask[s], positions[s]) for s in (slice(0, 2), slice(2, 4))]
    aux = [float(h.router_aux_loss) for h in halves]
    assert aux[0] != pytest.approx(aux[1])
    assert float(out.metrics["moe/aux_loss"]) == pytest.approx(np.mean(aux), rel=1e-5)
    nll = float(out.metrics["nll"])  # the micro-batches' mean (the loss function's own metric)
    # each micro-batch's NLL is its own mean here (no global normalisers), so the loss sums them
    losses = []
    for s in (slice(0, 2), slice(2, 4)):
        part = {k: v[s] for k, v in data.items()}
        losses.append(float(jax.jit(lambda p, b: _sft_loss(graphdef, rest)(p, {}, b, {}, None)[0])(params, part)))
    assert nll == pytest.approx(np.mean(losses), rel=1e-5)
    assert float(out.metrics["loss"]) == pytest.approx(sum(losses) + COEF * np.mean(aux), rel=1e-5)


def test_lora_on_a_mixture_adapts_attention_and_refuses_expert_targets():
    """A mixture's experts take no adapters: ``all`` adapts q k v o only (counted by hand:
    2 layers x r (D + N H + 2 (D + K H) + N H + D) = 2 x 4 x 224 = 1,792 weights), the
    estimator counts the same and QLoRA quantises those four alone (the experts stay
    float: the frozen base's bytes equal the built model's); ``gate`` named apart is refused."""
    from alignax.estimate import _frozen_base_bytes, parameter_count
    from alignax.models.lora import LoRAParam, LoraConfig, adapter_parameter_count, count_adapter_params, with_adapters

    config = models.ModelConfig.from_hf_config(CONFIG)
    base = models.create_model(config, seed=0)
    spec = LoraConfig(rank=4, targets=("all",), quantize="nf4", quant_block_size=8)
    model = with_adapters(base, spec)
    assert count_adapter_params(model) == 2 * 4 * (32 + 32 + 2 * (32 + 16) + 32 + 32) == 1792
    assert adapter_parameter_count(config, spec) == 1792
    frozen = nnx.state(model, nnx.Not(LoRAParam))
    built = sum(x.nbytes for x in jax.tree.leaves(frozen))
    assert _frozen_base_bytes(config, spec, parameter_count(config), 4) == built
    for targets in (("gate",), ("q", "up", "down")):
        with pytest.raises(ValueError, match=r"lora\.targets names (gate|up down), but this qwen3_moe model's MLPs "
                                             r"are 4 experts"):
            with_adapters(models.create_model(config, seed=0), LoraConfig(rank=4, targets=targets))


def test_the_estimate_of_a_mixture_step_is_within_15_percent_of_the_compiled_step(tmp_path, toy_moe_model):
    """SFT on the toy mixture grown to 16 experts of width 96 (E x F = 1,536 against D = 32:
    the experts' [tokens, E, F] arrays dominate), remat none, one device, compiled and never
    run: the estimate's activations use E x moe_intermediate_size and the router
    probabilities (measured 1.02x the compiled step; 0.15x when the dense F was counted;
    remat full 1.12x)."""
    from alignax.estimate import estimate, model_config_for
    from alignax.trainers import api
    from tests.support.trainer_helpers import sft_conversations, tiny_config

    config = tiny_config(tmp_path, "sft", steps=1, model_dir=toy_moe_model,
                         overrides=("model.remat=none", "model.scan_layers=true", "data.batch_size=8"),
                         model={"random_init": {"num_experts": 16, "moe_intermediate_size": 96,
                                                "num_hidden_layers": 2}},
                         data={"eval_fraction": 0.0, "max_length": 64})
    trainer = api.build_trainer(config, records=sft_conversations(32))
    state, frozen = trainer.start()
    compiled = trainer.step.lower(state, frozen, trainer.placer(next(trainer.data.iterator("train")))).compile()
    memory = compiled.memory_analysis()
    peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes)
    result = estimate(config, model=model_config_for(config), devices=1, mesh=(1, 1, 1))
    assert sum(result.update_step_items().values()) == pytest.approx(peak, rel=0.15), (result.update_step_items(), peak)
