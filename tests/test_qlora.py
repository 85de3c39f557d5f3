"""QLoRA (alignax.models.quant, ``lora.quantize``).

- The NF4 codebook is the QLoRA paper's construction (normal quantiles, bitsandbytes'
  offset) and its points quantise back to themselves exactly.
- int8 and NF4 codes and dequantised weights equal an independent NumPy implementation
  written from the paper (flatten, blocks of ``block_size``, absmax, nearest code), and the
  error is bounded per block: int8 ``absmax / 127 / 2``, NF4 ``absmax * max half-gap``.
- The quantised projection's forward and its gradient equal ``dense`` on the dequantised
  kernel; the codes carry the kernel's logical axes; merging (export) dequantises.
- A QLoRA DPO step on the toy model (NF4) is within a stated tolerance of the float32
  LoRA step; only the adapters change, the quantised base is bitwise unchanged; the
  estimator's frozen-base bytes equal the stored arrays' nbytes; resuming re-derives the
  quantised base bit for bit and repeats the next step exactly.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from alignax.models import ModelConfig, create_model, from_pretrained
from alignax.models.dense import dense
from alignax.models.lora import LoRAParam, LoraConfig, count_adapter_params, merge_adapters, with_adapters
from alignax.models.quant import (NF4, QuantizedKernel, QuantizedParam, block_axes, dequantize, max_error, project,
                                  quantize, quantized_bytes)
from tests.support.compiled import jitted
from tests.test_lora import _perturbed
from tests.support.trainer_helpers import CONFIGS, separable_pairs, tiny_config

HF = dict(model_type="llama", vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=64, rms_norm_eps=1e-5,
          tie_word_embeddings=False)
TOKENS = np.array([[1, 17, 3, 12, 9, 4, 22], [5, 6, 7, 8, 2, 30, 31]])


# ---------------------------------------------------------------------------- NumPy reference (the paper)
def paper_nf4() -> np.ndarray:
    """NF4 as QLoRA builds it (bitsandbytes ``create_normal_map``, offset 0.9677083): 8
    positive and 7 negative quantiles of N(0, 1) from evenly spaced probabilities, an
    exact 0, normalised to [-1, 1]."""
    from scipy.stats import norm

    offset = 0.9677083
    positive = norm.ppf(np.linspace(offset, 0.5, 9, dtype=np.float32)[:-1])
    negative = -norm.ppf(np.linspace(offset, 0.5, 8, dtype=np.float32)[:-1])
    values = np.sort(np.concatenate([positive, [0.0], negative]))
    return values / values.max()


def numpy_quantize(w: np.ndarray, kind: str, block_size: int):
    """``(indices, dequantised)`` by the paper's recipe: the tensor flattened row-major into
    blocks of ``block_size``, each divided by its absmax, rounded to the nearest int8 step
    or the nearest NF4 value (argmin of the distance), multiplied back."""
    blocks = w.astype(np.float64).reshape(-1, block_size)
    absmax = np.abs(blocks).max(axis=1, keepdims=True)
    unit = blocks / np.where(absmax == 0, 1, absmax)
    if kind == "int8":
        index = np.round(unit * 127)
        deq = index / 127 * absmax
    else:
        index = np.argmin(np.abs(unit[..., None] - paper_nf4()), axis=-1)
        deq = paper_nf4()[index] * absmax
    return index.reshape(w.shape), deq.reshape(w.shape), absmax[:, 0]


def test_nf4_codebook_is_the_papers_and_round_trips_exactly():
    np.testing.assert_allclose(NF4, paper_nf4(), atol=1e-6)
    assert NF4[7] == 0.0 and NF4[0] == -1.0 and NF4[-1] == 1.0 and np.all(np.diff(NF4) > 0)
    # every codebook point, times a block absmax of 2**-3, comes back exactly; the 1.0 in
    # each block makes that block's absmax the scale
    w = np.concatenate([NF4, NF4[::-1], NF4[np.random.default_rng(0).permutation(16)], NF4]).reshape(2, 32) * 0.125
    codes, scales = quantize(jnp.asarray(w), "nf4", 32, 1)
    assert codes.dtype == jnp.uint8 and codes.shape == (2, 16) and scales.shape == (2, 1)
    np.testing.assert_array_equal(np.asarray(dequantize(codes, scales, "nf4", 32)), w)
    # two codes a byte: element 2i in the high nibble, 2i + 1 in the low one
    assert np.asarray(codes)[0, 0] == (0 << 4 | 1) and np.asarray(codes)[0, 8] == (15 << 4 | 14)


@pytest.mark.parametrize("kind", ["int8", "nf4"])
@pytest.mark.parametrize("shape, block_size", [((2, 24, 128), 64),  # stacked [L, in, out], along the last axis
                                               ((32, 4, 8), 64),  # head_dim 8: blocks span trailing axes
                                               ((6, 40), 16)])
def test_quantisation_matches_numpy_and_its_error_is_bounded_per_block(kind, shape, block_size):
    rng = np.random.default_rng(sum(shape))
    w = (rng.standard_t(4, size=shape) * 0.02).astype(np.float32)  # heavy tails: blocks of mixed absmax
    w.reshape(-1)[5] = 0.3  # one outlier
    codes, scales = quantize(jnp.asarray(w), kind, block_size, block_axes(shape, block_size))
    deq = np.asarray(dequantize(codes, scales, kind, block_size))
    index, want, absmax = numpy_quantize(w, kind, block_size)
    np.testing.assert_allclose(np.asarray(scales).reshape(-1), absmax, rtol=1e-7)
    codes = np.asarray(codes)
    if kind == "nf4":
        codes = np.stack([codes >> 4, codes & 0xF], axis=-1).reshape(shape)
    np.testing.assert_array_equal(codes.astype(np.int64), index)
    np.testing.assert_allclose(deq, want, rtol=1e-6, atol=1e-9)
    # the bound, per block: int8 absmax/127/2, NF4 absmax * the largest half-gap of the codebook
    bound = absmax / 127 / 2 if kind == "int8" else absmax * np.max(np.diff(paper_nf4())) / 2
    error = np.abs(w.astype(np.float64) - deq).reshape(-1, block_size).max(axis=1)
    assert np.all(error <= bound * (1 + 1e-5)), (error / bound).max()
    assert np.isclose(max_error(kind), 1 / 254 if kind == "int8" else np.max(np.diff(paper_nf4())) / 2, rtol=1e-6)
    assert (error / bound).max() > 0.5  # the bound is approached, not vacuous


def test_block_size_must_divide_the_kernel():
    with pytest.raises(ValueError, match="lora.quant_block_size=48"):
        with_adapters(create_model(ModelConfig.from_hf_config(HF)), LoraConfig(quantize="nf4", quant_block_size=48))
    with pytest.raises(ValueError, match="lora.quantize"):
        LoraConfig(quantize="int4")


def test_quantised_projection_and_its_gradient_are_dense_on_the_dequantised_kernel():
    rng = np.random.default_rng(0)
    kernel = QuantizedKernel(jnp.asarray(rng.normal(size=(4, 8, 64)).astype(np.float32)),
                             ("heads", "head_dim", "embed"), kind="nf4", block_size=64)
    w = kernel.dequantize()
    x = jnp.asarray(rng.normal(size=(3, 5, 4, 8)).astype(np.float32))
    cotangent = jnp.asarray(rng.normal(size=(3, 5, 64)).astype(np.float32))

    graphdef, state = nnx.split(kernel)

    @jax.jit
    def ours(x, state):
        return jnp.sum(project(x, nnx.merge(graphdef, state), in_axes=2) * cotangent)

    @jax.jit
    def theirs(x):
        return jnp.sum(dense(x, w, in_axes=2) * cotangent)

    np.testing.assert_allclose(ours(x, state), theirs(x), rtol=1e-5)
    dx, dstate = jax.jit(jax.grad(ours, argnums=(0, 1), allow_int=True))(x, state)
    np.testing.assert_allclose(np.asarray(dx), np.asarray(jax.jit(jax.grad(theirs))(x)), rtol=1e-5, atol=1e-5)
    dscales = dstate["scales"][...]
    assert not np.any(np.asarray(dscales))  # frozen


def test_qlora_model_stores_codes_with_the_kernels_axes_and_merging_dequantises():
    from alignax.parallel.sharding import logical_to_spec

    base = create_model(ModelConfig.from_hf_config(HF, scan_layers=True, remat=True), seed=0)
    base_flat = dict(nnx.to_flat_state(nnx.state(base, nnx.Param)))
    model = with_adapters(base, LoraConfig(rank=4, alpha=8, quantize="nf4"))
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    quantized = {p: v for p, v in flat.items() if isinstance(v, QuantizedParam)}
    assert len(quantized) == 2 * 7  # codes and scales of the seven projections
    assert not any(p in flat for p in base_flat if p[-1].endswith("_kernel"))  # no float copy of them
    assert ("lm_head",) in flat and ("model", "embed") in flat  # stay in the frozen dtype
    q = model.model.layers.attn.q_kernel  # [L, D, N, H] = [2, 32, 4, 8]: N H = 32 < 64, blocks span (D, N, H)
    assert q.codes[...].shape == (2, 32, 4, 4) and q.codes[...].dtype == jnp.uint8
    assert q.scales[...].shape == (2, 16) and q.scales[...].dtype == jnp.float32
    assert q.codes.get_metadata()["out_sharding"] == ("layers", "embed", "heads", "head_dim")
    assert q.scales.get_metadata()["out_sharding"] == ("layers", None)
    up = model.model.layers.mlp.up_kernel  # [L, D, F] = [2, 32, 64]: blocks along F
    assert up.scales.get_metadata()["out_sharding"] == ("layers", "embed", "mlp")
    mesh = type("Mesh", (), {"shape": {"data": 1, "fsdp": 2, "tensor": 2}})()
    assert logical_to_spec(up.codes.get_metadata()["out_sharding"], up.codes[...].shape, mesh) == \
        logical_to_spec(("layers", "embed", "mlp"), (2, 32, 64), mesh)  # codes shard as the kernel
    np.testing.assert_allclose(np.asarray(up.dequantize()), np.asarray(base_flat[("model", "layers", "mlp",
                                                                                  "up_kernel")][...]),
                               atol=float(np.abs(base_flat[("model", "layers", "mlp", "up_kernel")][...]).max())
                               * max_error("nf4") * 1.0001)
    _perturbed(model)
    graphdef, state = nnx.split(model)
    unmerged = np.asarray(nnx.merge(graphdef, state)(TOKENS).logits)
    merged = merge_adapters(model)
    assert merged.config.lora is None
    assert not any(isinstance(v, QuantizedParam) for _, v in nnx.to_flat_state(nnx.state(merged)))
    np.testing.assert_allclose(np.asarray(merged(TOKENS).logits), unmerged, atol=2e-5)


# ---------------------------------------------------------------------------- a QLoRA DPO step
LORA = {"rank": 4, "alpha": 8}


def _two_steps(tmp_path_factory, toy_model, quantize):
    from alignax.trainers.api import build_trainer

    config = tiny_config(tmp_path_factory.mktemp(f"qlora-{quantize}"), "dpo-lora", steps=2, model_dir=toy_model,
                         preference={"beta": 0.5}, lora={**LORA, "quantize": quantize}, optim={"learning_rate": 3e-2},
                         train={"save_every": 0})
    trainer = build_trainer(config, records=separable_pairs(32))
    state, frozen = trainer.start()
    reference = trainer.reference
    base_before = [np.array(x) for x in jax.tree.leaves(trainer.base)]
    adapters_before = [np.array(x) for x in jax.tree.leaves(state.params)]
    batches = trainer.data.iterator("train")
    metrics = []
    saved = {}
    for step in range(2):
        batch = trainer.placer(next(batches))
        if step == 1 and quantize != "none":  # a checkpoint of step 1, for the resume test
            from alignax.checkpoint import Checkpointer

            ckpt = Checkpointer(str(config.output_dir) + "/checkpoints", async_save=False)
            ckpt.save(1, state, {})
            abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
            saved = dict(ckpt=ckpt, abstract=abstract, batch=batch, reference=reference)
        state, out = trainer.step(state, frozen, batch)
        metrics.append({k: float(v) for k, v in jax.device_get(out.metrics).items()})
    return dict(config=config, trainer=trainer, state=state, metrics=metrics, base_before=base_before,
                adapters_before=adapters_before, **saved)


@pytest.fixture(scope="module")
def float_lora(tmp_path_factory, toy_model):
    return _two_steps(tmp_path_factory, toy_model, "none")


@pytest.fixture(scope="module")
def nf4_lora(tmp_path_factory, toy_model):
    return _two_steps(tmp_path_factory, toy_model, "nf4")


def test_qlora_dpo_step_is_within_tolerance_of_the_float32_lora_step(float_lora, nf4_lora):
    f, q = float_lora["metrics"], nf4_lora["metrics"]
    assert f[0]["loss"] == q[0]["loss"] == pytest.approx(np.log(2))  # fresh adapters: policy = reference
    # the policy's log-probs come from the NF4 base: close to the float base's, not equal
    gap = abs(q[0]["logps/chosen"] - f[0]["logps/chosen"])
    assert 0 < gap < 0.05, gap
    # the step: gradient norm within 10 %, the next loss within 0.01 nats (measured: 3 %, 0.005)
    assert q[0]["grad_norm"] == pytest.approx(f[0]["grad_norm"], rel=0.1)
    assert abs(q[1]["loss"] - f[1]["loss"]) < 0.01, (q[1]["loss"], f[1]["loss"])
    assert q[1]["loss"] < q[0]["loss"] - 0.05  # and it learns


def test_only_adapters_change_and_the_quantised_base_is_bitwise_unchanged(nf4_lora):
    trainer, state = nf4_lora["trainer"], nf4_lora["state"]
    base = jax.tree.leaves(trainer.base)
    assert any(x.dtype == jnp.uint8 for x in base)
    for before, now in zip(nf4_lora["base_before"], base, strict=True):
        np.testing.assert_array_equal(np.asarray(now), before)
    assert all(np.any(np.asarray(now) != before) for before, now
               in zip(nf4_lora["adapters_before"], jax.tree.leaves(state.params), strict=True)
               if before.ndim and not np.any(before))  # every B (zeros at the start) moved
    model = trainer.model_from(state.params)
    adapters = [x.shape for x in jax.tree.leaves(nnx.state(model, LoRAParam))]
    assert [x.shape for x in jax.tree.leaves(state.params)] == adapters  # no codes, no scales trained
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.nbytes for x in moments) == 8 * count_adapter_params(model)


def test_qlora_resume_rederives_the_base_and_is_bit_identical(nf4_lora):
    """A resumed QLoRA run quantises its base again from the base checkpoint (the codes are
    not saved): the same codes and scales bit for bit, and the step-1 checkpoint stepped on
    that base gives step 2's adapters, moments and loss exactly."""
    from alignax.trainers.api import build_trainer

    trainer, config = nf4_lora["trainer"], nf4_lora["config"]
    again = build_trainer(config, with_data=False)  # what a resumed run builds: the base re-quantised
    assert any(x.dtype == jnp.uint8 for x in jax.tree.leaves(again.base))
    for a, b in zip(jax.tree.leaves(trainer.base), jax.tree.leaves(again.base), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    restored, _ = nf4_lora["ckpt"].restore(nf4_lora["abstract"], 1)
    state, out = trainer.step(restored, again.frozen_inputs(nf4_lora["reference"]), nf4_lora["batch"])
    assert float(jax.device_get(out.metrics["loss"])) == nf4_lora["metrics"][1]["loss"]
    for a, b in zip(jax.tree.leaves(nf4_lora["state"]), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_estimator_frozen_base_is_the_stored_quantised_arrays(nf4_lora, toy_model):
    from alignax import estimate as est
    from alignax.trainers.api import load_config

    trainer, config = nf4_lora["trainer"], nf4_lora["config"]
    shape = from_pretrained(toy_model).config
    figure = est.estimate(config, model=shape, devices=1).items["frozen base"]
    assert figure == sum(x.nbytes for x in jax.tree.leaves(trainer.base))
    # 7B, NF4 at block 64: the projections at 0.5 + 4/64 bytes a weight, embeddings and LM head at bf16
    qlora = load_config(os.path.join(CONFIGS, "dpo-qlora.yaml"))
    assert qlora.lora.quantize == "nf4" and qlora.lora.quant_block_size == 64
    llama = est.model_config_for(qlora, "llama-2-7b")
    projections = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    P = est.parameter_count(llama)
    base = est.estimate(qlora, model=llama, devices=1).items["frozen base"]
    assert base == projections * 0.5625 + (P - projections) * 2
    assert quantized_bytes(projections, "nf4", 64) / projections == 0.5625
    bf16 = est.estimate(dataclasses.replace(qlora, lora=dataclasses.replace(qlora.lora, quantize="none")),
                        model=llama, devices=1).items["frozen base"]
    assert bf16 == 2 * P and bf16 - base == projections * (2 - 0.5625)  # 13.48 GB -> 4.17 GB


# ---------------------------------------------------------------------------- adapter dropout
def test_adapter_dropout_in_training_only_deterministic_and_exported(tmp_path):
    import json

    from alignax.models.lora import adapter_dropout, adapters_off, save_peft_adapter
    from alignax.trainers.engine.adapters import with_dropout

    spec = LoraConfig(rank=4, alpha=8, dropout=0.5)
    model = _perturbed(with_adapters(create_model(ModelConfig.from_hf_config(HF, scan_layers=True), seed=0), spec))
    graphdef, state = nnx.split(model)
    adapters, base = nnx.split_state(state, LoRAParam, ...)
    no_dropout = nnx.merge(nnx.split(with_adapters(create_model(ModelConfig.from_hf_config(HF, scan_layers=True),
                                                                seed=0), LoraConfig(rank=4, alpha=8)))[0], state)

    def loss(adapters, frozen, batch, normalisers, rng):  # a training loss of the engine's signature
        return jnp.mean(nnx.merge(graphdef, nnx.merge_state(adapters, base))(batch).logits ** 2)

    # (the dropout context is read at trace time: the loss must be traced inside it, as the
    # engine's step traces it, not reuse a trace jitted without it)
    train_loss = jax.jit(with_dropout(loss, spec))
    key = jax.random.key(0)
    plain = float(jax.jit(loss)(adapters, {}, TOKENS, {}, key))
    dropped = float(train_loss(adapters, {}, TOKENS, {}, key))
    assert abs(dropped - plain) > 1e-4 * abs(plain)  # dropout changes the training loss
    assert float(train_loss(adapters, {}, TOKENS, {}, key)) == dropped  # deterministic given the rng
    assert float(train_loss(adapters, {}, TOKENS, {}, jax.random.key(1))) != dropped
    assert with_dropout(loss, LoraConfig(rank=4)) is loss
    # outside training (eval, sampling): the dropout model's logits are the dropout-free model's
    np.testing.assert_array_equal(np.asarray(jitted(model)(TOKENS).logits),
                                  np.asarray(jitted(no_dropout)(TOKENS).logits))
    # the reference (adapters off) is the base whatever the dropout
    with adapter_dropout(key):  # (traced inside the context)
        ref = jitted(nnx.merge(graphdef, nnx.merge_state(adapters_off(adapters), base)))(TOKENS).logits
    base_model = create_model(ModelConfig.from_hf_config(HF, scan_layers=True), seed=0)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(jitted(base_model)(TOKENS).logits))
    save_peft_adapter(model, tmp_path)
    with open(tmp_path / "adapter_config.json") as f:
        assert json.load(f)["lora_dropout"] == 0.5
