"""``model.remat`` policies and ``model.attention`` implementations.

- Every remat policy gives the gradient of the model without remat, and each keeps what it
  says in the compiled step: ``none`` the most temporary memory and no recomputed matmul;
  ``full`` the least and every matmul recomputed; ``dots_saveable`` no recomputed matmul with
  less memory than ``none``; ``dots_with_no_batch_dims_saveable`` recomputes the attention
  products only; ``offload_dots`` moves the projection outputs to pinned host memory.
- ``attention: splash`` runs the Pallas kernel (interpreted on CPU): values and gradients
  equal the dense attention's with left and right padding.
- ``attention: cudnn`` routes full forward passes through ``jax.nn.dot_product_attention``
  with causal + sequence lengths and no dense mask (passes into a KV cache stay on the
  materialised path); on CPU the same call with XLA's implementation gives the materialised
  attention's logits and gradient on left-, right- and both-padded rows; lowered for CUDA,
  the step holds cuDNN's kernels and no ``[T, T]`` tensor; shared-prompt packing is refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from alignax.models import CausalLM, ModelConfig, create_model, init_cache, layers
from alignax.models.config import REMAT_POLICIES
from alignax.models.splash import splash_attention
from alignax.trainers.config import ModelSpec
from alignax.trainers.engine.setup import attention_implementation
from tests.support.compiled import jitted

BASE = dict(model_type="llama", vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16, intermediate_size=128, norm_eps=1e-5, max_position_embeddings=128)


def _batch(B=2, T=32, seed=0):
    rng = np.random.RandomState(seed)
    tokens = jnp.asarray(rng.randint(1, 64, (B, T)), jnp.int32)
    return tokens, jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.ones((B, T), jnp.int32)


def test_each_remat_policy_keeps_what_it_names_and_the_gradient_is_unchanged():
    tokens, positions, mask = _batch()
    state0 = nnx.state(create_model(ModelConfig(**BASE, scan_layers=True)))
    figures, grads = {}, {}
    for policy in REMAT_POLICIES:
        config = ModelConfig(**BASE, scan_layers=True, remat=policy)
        graphdef = nnx.graphdef(nnx.eval_shape(lambda config=config: CausalLM(config, rngs=nnx.Rngs(0))))

        def loss(state, graphdef=graphdef):
            return jnp.mean(nnx.merge(graphdef, state)(tokens, positions, mask).logits ** 2)

        grad = jax.grad(loss)
        compiled = jax.jit(grad).lower(state0).compile()
        text = compiled.as_text()
        to_host = str(jax.make_jaxpr(grad)(state0)).count("<host>")
        figures[policy] = (compiled.memory_analysis().temp_size_in_bytes, text.count(" dot("), to_host)
        grads[policy] = jax.tree.leaves(compiled(state0))
    for policy in REMAT_POLICIES:
        for got, want in zip(grads[policy], grads["none"]):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7, err_msg=policy)
    memory = {p: f[0] for p, f in figures.items()}
    dots = {p: f[1] for p, f in figures.items()}
    host = {p: f[2] for p, f in figures.items()}
    assert memory["full"] < memory["dots_with_no_batch_dims_saveable"] < memory["dots_saveable"] < memory["none"], figures
    assert dots["dots_saveable"] == dots["none"], figures
    assert dots["dots_with_no_batch_dims_saveable"] == dots["none"] + 2, figures  # the attention products, once
    assert dots["full"] > dots["dots_with_no_batch_dims_saveable"], figures  # the projections recomputed too
    assert host["offload_dots"] > 0 and all(host[p] == 0 for p in REMAT_POLICIES if p != "offload_dots"), host


def test_remat_reads_true_and_false_and_refuses_other_words():
    assert ModelSpec(remat=True).remat == "full" and ModelSpec(remat=False).remat == "none"
    assert ModelConfig(**BASE, remat=True).remat == "full"
    with pytest.raises(ValueError, match="remat must be one of"):
        ModelConfig(**BASE, remat="some")


def _xla_instead_of_cudnn(monkeypatch):
    """The cuDNN route with XLA's implementation of the same call (CPU has no cuDNN)."""
    calls = []
    fused = layers.fused_attention

    def on_cpu(*args, implementation, **kwargs):
        calls.append(implementation)
        return fused(*args, implementation="xla", **kwargs)

    monkeypatch.setattr(layers, "fused_attention", on_cpu)
    return calls


def _padded_rows(B, T):
    """``[B, T]`` masks with every padding the decoder meets: left (a rollout's prompt),
    right (the data pipeline's rows) and both at once, plus a hole (a masked token inside)."""
    mask = np.ones((B, T), bool)
    mask[0, :4] = False
    mask[1, -5:] = False
    mask[2, :3], mask[2, -2:] = False, False
    mask[3, 7] = False
    return mask


def test_fused_attention_without_a_dense_mask_equals_a_reference_with_one():
    """``fused_attention`` (real tokens gathered to the front, causal + sequence lengths) with
    XLA's implementation, against softmax over ``causal & real key`` written out here; values
    at real queries and all three gradients, two query heads per key/value head."""
    B, T, K, G, H = 4, 16, 2, 2, 8
    rng = np.random.RandomState(0)
    q, k, v = (jnp.asarray(rng.randn(B, T, n, H), jnp.float32) for n in (K * G, K, K))
    mask = _padded_rows(B, T)
    weights = jnp.asarray(rng.randn(B, T, K * G, H), jnp.float32) * jnp.asarray(mask)[:, :, None, None]
    allowed = np.tril(np.ones((T, T), bool))[None] & mask[:, None, :]

    def reference(q, k, v):
        s = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, G, axis=2)) * H**-0.5
        p = jax.nn.softmax(jnp.where(allowed[:, None], s, -1e30), axis=-1)
        return jnp.einsum("bnts,bsnh->btnh", p, jnp.repeat(v, G, axis=2))

    def fused(q, k, v):
        return layers.fused_attention(q, k, v, jnp.asarray(mask), scale=H**-0.5, implementation="xla")

    got = np.asarray(jax.jit(fused)(q, k, v))
    np.testing.assert_allclose(got[mask], np.asarray(reference(q, k, v))[mask], atol=1e-5)
    assert np.all(got[~mask] == 0)  # pad queries: zeros, never NaN
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(fused(*a) * weights), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(lambda *a: jnp.sum(reference(*a) * weights), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip("qkv", grads, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=name)


def test_the_cudnn_route_equals_the_materialised_one_and_keeps_caches_materialised(monkeypatch):
    calls = _xla_instead_of_cudnn(monkeypatch)
    materialised = create_model(ModelConfig(**BASE), seed=1)
    fused = create_model(ModelConfig(**BASE, attention="cudnn"), seed=1)
    B, T = 4, 24
    tokens, _, _ = _batch(B, T, seed=2)
    mask = _padded_rows(B, T)
    positions = jnp.asarray(np.maximum(np.cumsum(mask, 1) - 1, 0))
    response = jnp.asarray(mask & (np.arange(T) >= 12))  # a response's tokens score the loss

    def loss(model):  # a masked log-likelihood: its gradient reaches every parameter
        logits = model(tokens, positions, jnp.asarray(mask, jnp.int32)).logits
        logps = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), tokens[:, 1:, None], -1)[..., 0]
        return jnp.sum(logps * response[:, 1:]) / jnp.sum(response[:, 1:]), logits

    (want_loss, want), want_grad = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(materialised)
    (got_loss, got), got_grad = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(fused)
    np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(want)[mask], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(nnx.state(got_grad)), jax.tree.leaves(nnx.state(want_grad))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-4)
    assert calls == ["cudnn"] * BASE["num_layers"]  # one trace, once per layer
    # passes into a KV cache (a prefill, then decode steps) stay on the materialised path
    calls.clear()
    prompt, step = _batch(B, 8, seed=3)[0], _batch(B, 1, seed=4)[0]
    outs = {}
    for name, model in (("materialised", jitted(materialised)), ("fused", jitted(fused))):
        cache = init_cache(ModelConfig(**BASE), B, 16)
        pos = jnp.broadcast_to(jnp.arange(8), (B, 8))
        first = model(prompt, pos, jnp.ones((B, 8), jnp.int32), cache=cache)
        second = model(step, jnp.full((B, 1), 8), jnp.ones((B, 1), jnp.int32), cache=first.cache)
        outs[name] = (first.logits, second.logits)
    for got, want in zip(outs["fused"], outs["materialised"]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    assert calls == []


def test_cudnn_refuses_shared_prompt_packing_in_one_line_and_packing_steps_aside():
    """Packed rows need a prefix every continuation sees, beyond causal + lengths: the decoder
    refuses ``segment_ids`` under ``cudnn`` (nothing is computed with segments merged), and
    the packing decisions leave rows unpacked (``auto``) or name the key (``on``)."""
    from types import SimpleNamespace

    from alignax.trainers.engine import packing

    fused = jitted(create_model(ModelConfig(**BASE, attention="cudnn"), seed=1))
    tokens, positions, mask = _batch(2, 10)
    with pytest.raises(ValueError, match=r"^model.attention=cudnn cannot run shared-prompt packing"):
        fused(tokens, positions, mask, segment_ids=jnp.zeros((2, 10), jnp.int32))
    assert not packing.pair_packs("cudnn", row_length=64, window=16)
    assert packing.pair_packs("xla", row_length=64, window=16)
    config = SimpleNamespace(
        rollout=SimpleNamespace(num_samples=4, pack_groups="on", max_new_tokens=16),
        data=SimpleNamespace(max_prompt_length=64, batch_size=4), train=SimpleNamespace(grad_accum_steps=1))
    with pytest.raises(ValueError, match="model.attention=cudnn cannot express"):
        packing.packed_group_size(config, ModelConfig(**BASE, attention="cudnn"), minibatches=1)
    config.rollout.pack_groups = "auto"
    assert packing.packed_group_size(config, ModelConfig(**BASE, attention="cudnn"), minibatches=1) == 1


def test_the_cudnn_program_lowered_for_a_gpu_has_no_dense_mask(monkeypatch):
    """A train step's gradient, lowered for CUDA on this CPU machine (StableHLO, what XLA's GPU
    compiler receives): cuDNN's fused forward and backward with its own padding-causal mask,
    and no ``[.., T, T]`` tensor anywhere (the mask this replaced was ``[B, 1, T, T]``). The
    lowering asks the installed cuDNN's version, which a CPU install lacks: a stand-in says 9.10."""
    import re
    from types import SimpleNamespace

    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "cuda_versions", SimpleNamespace(cudnn_get_version=lambda: 91000))
    B, T = 2, 24
    model = create_model(ModelConfig(**BASE, attention="cudnn", dtype="bfloat16"), seed=1)
    graphdef, state = nnx.split(model)
    tokens, positions, _ = _batch(B, T)
    mask = jnp.asarray(_padded_rows(4, T)[:B], jnp.int32)

    def loss(state):
        return jnp.mean(nnx.merge(graphdef, state)(tokens, positions, mask).logits ** 2)

    text = jax.jit(jax.grad(loss)).trace(state).lower(lowering_platforms=("cuda",)).as_text()
    assert "__cudnn$fmhaSoftmax" in text and "__cudnn$fmhaSoftmaxBackward" in text
    assert "PADDING_CAUSAL" in text
    assert not re.findall(rf"tensor<[0-9x]*{T}x{T}[x>]", text), set(re.findall(rf"tensor<[0-9x]*{T}x{T}\w*>", text))


def test_attention_choice_is_resolved_per_backend():
    assert attention_implementation("auto", "bfloat16", backend="gpu") == "cudnn"
    assert attention_implementation("auto", "float32", backend="gpu") == "xla"
    assert attention_implementation("auto", "bfloat16", backend="tpu") == "splash"
    assert attention_implementation("auto", "bfloat16", backend="cpu") == "xla"
    assert attention_implementation("xla", "float32", backend="cpu") == "xla"
    with pytest.raises(ValueError, match="model.attention=cudnn needs a GPU"):
        attention_implementation("cudnn", "bfloat16", backend="cpu")
    with pytest.raises(ValueError, match="model.attention=splash is the TPU kernel"):
        attention_implementation("splash", "float32", backend="cpu")
    with pytest.raises(ValueError, match="attention must be one of"):
        ModelConfig(**BASE, attention="flash")



def test_splash_kernel_equals_the_dense_attention_forward_and_backward():
    """The Pallas splash kernel, interpreted on CPU: one row left-padded, one right-padded,
    two query heads per key/value head; values and all three gradients. The forward and the
    gradient are two programs of one length (as a train step and an evaluation are): the
    second reuses the cached kernel built while tracing the first."""
    B, T, K, G, H = 2, 12, 1, 2, 8
    rng = np.random.RandomState(0)
    q, k, v = (jnp.asarray(rng.randn(B, T, n, H), jnp.float32) for n in (K * G, K, K))
    mask = np.ones((B, T), bool)
    mask[0, :4], mask[1, -3:] = False, False
    weights = jnp.asarray(rng.randn(B, T, K * G, H), jnp.float32) * jnp.asarray(mask)[:, :, None, None]
    allowed = jnp.tril(jnp.ones((T, T), bool))[None] & jnp.asarray(mask)[:, None, :]

    def dense(q, k, v):
        s = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, G, axis=2)) * H**-0.5
        p = jax.nn.softmax(jnp.where(allowed[:, None], s, -1e30), axis=-1)
        return jnp.einsum("bnts,bsnh->btnh", p, jnp.repeat(v, G, axis=2))

    def splash(q, k, v):
        return splash_attention(q, k, v, jnp.asarray(mask), scale=H**-0.5, interpret=True)

    # each side one compiled program (eagerly, the interpreted kernel compiles op by op)
    np.testing.assert_allclose(np.asarray(jax.jit(splash)(q, k, v))[mask], np.asarray(jax.jit(dense)(q, k, v))[mask],
                               atol=1e-5)
    got = jax.jit(jax.grad(lambda *a: jnp.sum(splash(*a) * weights), argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(lambda *a: jnp.sum(dense(*a) * weights), argnums=(0, 1, 2)))(q, k, v)
    for name, a, b in zip("qkv", got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, err_msg=name)


def test_the_decoder_routes_full_passes_to_splash_and_refuses_shared_prompt_packing(monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[3].shape)
        return splash_attention(*args, **kwargs, interpret=True)

    monkeypatch.setattr(layers, "splash_attention", counted)
    config = dict(BASE, num_layers=1)
    dense, splash = (jitted(create_model(ModelConfig(**config, attention=a), seed=5)) for a in ("xla", "splash"))
    tokens, _, _ = _batch(2, 10, seed=6)
    mask = np.ones((2, 10), np.int32)
    mask[0, :3] = 0
    positions = jnp.asarray(np.maximum(np.cumsum(mask, 1) - 1, 0))
    want = dense(tokens, positions, jnp.asarray(mask)).logits
    got = splash(tokens, positions, jnp.asarray(mask)).logits
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=1e-5, rtol=1e-5)
    assert calls == [(2, 10)]  # one layer, the key mask handed over
    one = splash(tokens[:, :1], positions[:, :1], jnp.ones((2, 1), jnp.int32)).logits  # a one-token full pass
    np.testing.assert_allclose(np.asarray(one), np.asarray(dense(tokens[:, :1], positions[:, :1],
                                                                 jnp.ones((2, 1), jnp.int32)).logits), atol=1e-5)
    with pytest.raises(ValueError, match="splash cannot run shared-prompt packing"):
        splash(tokens, positions, jnp.asarray(mask), segment_ids=jnp.zeros((2, 10), jnp.int32))
