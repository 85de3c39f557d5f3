"""Decoders against transformers' PyTorch models on the same random weights.

One tiny random model per family (Llama with llama3 RoPE and biases, Qwen2 with q/k/v
biases and tied embeddings, Qwen3 with q/k norms, GPT-2 with Conv1D weights and learned
positions; Mistral, Phi-3, Gemma 2 and Gemma 3 with sliding windows shorter than the
sequences, more of them in tests/test_model_families.py). Every parameter is perturbed away
from its init so biases and norm scales are not trivially zero/one
(tests/support/hf_reference.py). References are transformers' own forward passes.
"""

from __future__ import annotations

import numpy as np
import pytest

import transformers
from flax import nnx

import jax
import jax.numpy as jnp

from alignax import ops
from alignax.models import (
    ModelConfig,
    from_hf_state_dict,
    from_pretrained,
    positions_from_mask,
    save_pretrained,
    to_hf_state_dict,
    token_logprobs_from_hidden,
)

from tests.support.compiled import jitted
from tests.support.hf_reference import perturbed_families, torch_logits
from tests.support.model_families import COMMON, CONFIGS

torch = pytest.importorskip("torch", reason="the PyTorch reference (pinned test extras; not in `make test-latest`)")

TOL = 1e-4

FAMILIES = list(CONFIGS)


@pytest.fixture(scope="module")
def families():
    return perturbed_families(FAMILIES)


def batch(T: int = 8, B: int = 3, V: int = 64, seed: int = 0):
    """Row 0 full, row 1 left-padded by 3, row 2 left-padded by 5."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(0, V, (B, T))
    mask = np.ones((B, T), np.int64)
    mask[1, :3] = 0
    mask[2, :5] = 0
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    return tokens, mask, positions


@nnx.jit
def jit_forward(model, tokens, positions, mask):
    return model(tokens, positions, mask).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(families, family):
    cfg, hf, sd = families[family]
    model = from_hf_state_dict(cfg, sd)
    tokens, mask, positions = batch()
    ref = torch_logits(hf, tokens, mask, positions)
    ours = np.asarray(jit_forward(model, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)))
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    real = mask.astype(bool)
    assert np.abs(ours - ref)[real].max() <= TOL
    # Unpadded: every row full length (transformers without mask or positions).
    with torch.no_grad():
        ref_full = hf(input_ids=torch.tensor(tokens)).logits.numpy()
    ours_full = np.asarray(jitted(model)(jnp.asarray(tokens)).logits)  # positions and mask left to the model
    assert np.abs(ours_full - ref_full).max() <= TOL
    # A left-padded row equals the same tokens run alone, unpadded.
    alone = tokens[2:, 5:]
    ones = jnp.ones(alone.shape, jnp.int32)
    alone_logits = np.asarray(jit_forward(model, jnp.asarray(alone), positions_from_mask(ones), ones))[0]
    assert np.abs(ours[2, 5:] - alone_logits).max() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_export_loads_in_transformers(families, family, tmp_path):
    cfg, hf, sd = families[family]
    model = from_hf_state_dict(cfg, sd)
    save_pretrained(model, tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(hf)
    tokens, mask, positions = batch(seed=1)
    ours = np.asarray(jit_forward(model, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)))
    theirs = torch_logits(loaded, tokens, mask, positions)
    assert np.abs(ours - theirs)[mask.astype(bool)].max() <= TOL
    # and back: our loader reads what we wrote, bit for bit
    again = from_pretrained(tmp_path)
    a, b = nnx.state(model), nnx.state(again)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_scan_equals_loop_and_remat_gradients(families):
    cfg, _, sd = families["llama"]
    loop = from_hf_state_dict(cfg, sd)
    scan = from_hf_state_dict(cfg, sd, scan_layers=True, remat=True)
    q_kernel = nnx.state(scan)["model"]["layers"]["attn"]["q_kernel"]
    assert q_kernel.get_value().shape[0] == 2
    assert q_kernel.get_metadata()["out_sharding"] == ("layers", "embed", "heads", "head_dim")
    tokens, mask, positions = (jnp.asarray(x) for x in batch())
    a = jit_forward(loop, tokens, positions, mask)
    b = jit_forward(scan, tokens, positions, mask)
    assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-5

    def loss(model):
        logps = token_logprobs_from_hidden(
            model(tokens, positions, mask, return_logits=False).hidden[:, :-1], model, tokens[:, 1:], chunk_size=3
        )
        return -jnp.sum(logps * mask[:, 1:])

    grad = nnx.jit(nnx.grad(loss))
    ga = grad(loop)
    gb = grad(scan)
    g_loop = np.stack([np.asarray(ga["model"]["layers"][i]["mlp"]["down_kernel"][...]) for i in range(2)])
    g_scan = np.asarray(gb["model"]["layers"]["mlp"]["down_kernel"][...])
    assert np.abs(g_loop).max() > 0
    np.testing.assert_allclose(g_scan, g_loop, atol=1e-5, rtol=1e-4)


def test_token_logprobs_from_hidden_matches_full_logits(families):
    cfg, hf, sd = families["qwen2"]  # tied embeddings: unembedding through embed
    model = from_hf_state_dict(cfg, sd)
    tokens, mask, positions = batch(T=9)
    ref_logits = torch_logits(hf, tokens, mask, positions)[:, :-1].astype(np.float64)
    targets = tokens[:, 1:]
    ref = np.zeros(targets.shape)
    for b in range(targets.shape[0]):
        for t in range(targets.shape[1]):
            row = ref_logits[b, t]
            ref[b, t] = row[targets[b, t]] - (row.max() + np.log(np.exp(row - row.max()).sum()))
    hidden = jitted(model)(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask), return_logits=False).hidden
    real = (mask[:, :-1] * mask[:, 1:]).astype(bool)  # a pad position's prediction is garbage in both
    for chunk in (None, 3, 8):
        got = jax.jit(lambda h, t, chunk=chunk: token_logprobs_from_hidden(h, model, t, chunk_size=chunk))(
            hidden[:, :-1], jnp.asarray(targets))
        assert got.dtype == jnp.float32
        assert np.abs(np.asarray(got) - ref)[real].max() <= TOL
    logps, ent = jax.jit(
        lambda h, t: token_logprobs_from_hidden(h, model, t, chunk_size=3, with_entropy=True)
    )(hidden[:, :-1], jnp.asarray(targets))
    full = jax.jit(model.logits)(hidden[:, :-1])
    np.testing.assert_allclose(np.asarray(ent), np.asarray(jax.jit(ops.entropy_from_logits)(full)), atol=1e-5)
    np.testing.assert_allclose(np.asarray(logps), np.asarray(jax.jit(ops.token_logprobs)(full, jnp.asarray(targets))),
                               atol=1e-5)


def test_bfloat16_policy_keeps_float32_scores(families):
    cfg, hf, sd = families["llama"]
    model = from_hf_state_dict(cfg, sd, param_dtype="bfloat16", dtype="bfloat16")
    assert nnx.state(model)["lm_head"].get_value().dtype == jnp.bfloat16
    tokens, mask, positions = batch()
    out = jitted(model)(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))
    assert out.logits.dtype == jnp.float32 and out.hidden.dtype == jnp.bfloat16
    ref = torch_logits(hf, tokens, mask, positions)
    err = np.abs(np.asarray(out.logits) - ref)[mask.astype(bool)]
    assert err.max() < 0.25 * np.abs(ref).max()  # bf16 rounding, not a wiring error
    mixed = from_hf_state_dict(cfg, sd, param_dtype="float32", dtype="bfloat16")
    assert nnx.state(mixed)["lm_head"].get_value().dtype == jnp.float32


def test_rope_inv_freq_matches_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from alignax.models import rope_inv_freq

    for rope in (
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ):
        cfg = dict(COMMON, model_type="llama", hidden_size=256, num_attention_heads=2, rope_parameters=dict(rope))
        hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
        ref, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg)
        ours = rope_inv_freq(ModelConfig.from_hf_config(cfg))
        np.testing.assert_allclose(ours, ref.numpy(), rtol=1e-6)
    # legacy layout: rope_scaling + top-level rope_theta
    legacy = dict(COMMON, model_type="llama", rope_theta=123.0, rope_scaling={"type": "linear", "factor": 3.0})
    c = ModelConfig.from_hf_config(legacy)
    assert (c.rope_type, c.rope_theta, c.rope_factor) == ("linear", 123.0, 3.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trip(family):
    c = ModelConfig.from_hf_config(CONFIGS[family])
    assert ModelConfig.from_hf_config(c.to_hf_config()) == c
    assert positions_from_mask(jnp.array([[0, 0, 1, 1, 1]])).tolist() == [[0, 0, 0, 1, 2]]


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_match_transformers(families, family):
    """Every parameter's gradient of a masked sequence log-likelihood equals PyTorch
    autograd's on the same weights (our backward pass is hand-written for the matmuls)."""
    cfg, hf, sd = families[family]
    model = from_hf_state_dict(cfg, sd)
    tokens, mask, positions = batch(seed=2)
    loss_mask = (mask[:, :-1] * mask[:, 1:]).astype(np.float32)

    hf.zero_grad()
    logits = hf(
        input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(positions)
    ).logits[:, :-1]
    logps = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(tokens[:, 1:, None])).squeeze(-1)
    (-(logps * torch.tensor(loss_mask, dtype=torch.float64)).sum()).backward()
    ref = {name: p.grad.numpy() for name, p in hf.named_parameters() if p.grad is not None}

    def loss(model):
        hidden = model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask), return_logits=False).hidden
        lp = token_logprobs_from_hidden(hidden[:, :-1], model, jnp.asarray(tokens[:, 1:]), chunk_size=3)
        return -jnp.sum(lp * loss_mask)

    grads = nnx.jit(nnx.grad(loss))(model)
    graphdef, _ = nnx.split(model)
    _, ours = to_hf_state_dict(nnx.merge(graphdef, grads))
    compared = 0
    for name, g in ours.items():
        if name not in ref:  # a tied lm_head appears once in PyTorch's parameters
            continue
        scale = max(np.abs(ref[name]).max(), 1.0)
        assert np.abs(g - ref[name]).max() <= 1e-4 * scale, name
        compared += 1
    assert compared == len(ref), sorted(set(ref) - set(ours))
