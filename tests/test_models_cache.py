"""KV cache: prefill + one-token decode steps inside ``lax.fori_loop`` equal the full forward.

The reference is the same model run once over prompt + continuation without a cache
(itself checked against transformers in test_models.py). Prompts are left-padded, as
the sampler builds them; positions are explicit.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

import jax
import jax.numpy as jnp

from alignax.models import KVCache, ModelConfig, create_model, init_cache
from tests.support.compiled import jitted

BASE = dict(vocab_size=50, num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=40)
CASES = {
    "llama-gqa-scan": (dict(BASE, model_type="llama", num_key_value_heads=2, tie_word_embeddings=False), True),
    "gpt2-loop": (dict(model_type="gpt2", vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=32), False),
}
P, N = 6, 4  # prompt slots, decode steps


def _data(seed=0):
    rng = np.random.RandomState(seed)
    prompt = rng.randint(0, 50, (3, P))
    prompt_mask = np.ones((3, P), np.int32)
    prompt_mask[1, :2] = 0
    prompt_mask[2, :4] = 0
    new = rng.randint(0, 50, (3, N))
    return prompt, prompt_mask, new


@jax.jit
def cached_logits(graphdef, state, prompt, prompt_mask, new):
    """Prefill the prompt, then feed ``new`` one token per step through the cache."""
    model = nnx.merge(graphdef, state)
    cache = init_cache(model.config, batch=prompt.shape[0], max_len=P + N)
    positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
    out = model(prompt, positions, prompt_mask, cache=cache)
    next_pos = positions[:, -1] + 1
    logits = jnp.zeros((prompt.shape[0], N + 1, model.config.vocab_size), jnp.float32)
    logits = logits.at[:, 0].set(out.logits[:, -1])

    def step(i, carry):
        cache, logits = carry
        m = nnx.merge(graphdef, state)
        tok = jax.lax.dynamic_slice_in_dim(new, i, 1, axis=1)
        o = m(tok, (next_pos + i)[:, None], jnp.ones_like(tok), cache=cache)
        return o.cache, logits.at[:, i + 1].set(o.logits[:, 0])

    cache, logits = jax.lax.fori_loop(0, N, step, (out.cache, logits))
    return logits, cache


@pytest.mark.parametrize("case", list(CASES))
def test_cached_decoding_equals_full_forward(case):
    hf_cfg, scan = CASES[case]
    config = ModelConfig.from_hf_config(hf_cfg, scan_layers=scan)
    model = create_model(config)
    prompt, prompt_mask, new = _data()
    graphdef, state = nnx.split(model)
    logits, cache = cached_logits(graphdef, state, jnp.asarray(prompt), jnp.asarray(prompt_mask), jnp.asarray(new))

    full_tokens = np.concatenate([prompt, new], axis=1)
    full_mask = np.concatenate([prompt_mask, np.ones_like(new)], axis=1)
    full = np.asarray(jitted(model)(jnp.asarray(full_tokens), None, jnp.asarray(full_mask)).logits)
    # prefill's last logits and each decode step's logits predict slots P .. P+N
    want = full[:, P - 1 : P + N]
    assert np.abs(np.asarray(logits[:, :N]) - want[:, :N]).max() <= 1e-5
    assert np.abs(np.asarray(logits[:, N])).max() > 0  # the last step ran too

    assert isinstance(cache, KVCache)
    assert int(cache.index) == P + N
    np.testing.assert_array_equal(np.asarray(cache.mask), full_mask.astype(bool))
    assert cache.k.shape == (config.num_layers, 3, P + N, config.num_kv_heads, config.head_dim)
    assert np.all(np.abs(np.asarray(cache.v)).sum(axis=(0, 3, 4)) > 0)  # every slot was written


def test_cache_errors():
    config = ModelConfig.from_hf_config(CASES["gpt2-loop"][0])
    model = create_model(config)
    cache = init_cache(config, batch=2, max_len=4)
    tokens = jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match="do not fit a cache of 4 slots"):
        model(tokens, jnp.zeros_like(tokens), jnp.ones_like(tokens), cache=cache)
    with pytest.raises(ValueError, match="positions are required with a cache"):
        model(tokens[:, :1], None, jnp.ones((2, 1)), cache=cache)
    with pytest.raises(ValueError, match=r"expected \[L=2, B=3"):
        model(jnp.zeros((3, 1), jnp.int32), jnp.zeros((3, 1), jnp.int32), jnp.ones((3, 1)), cache=cache)
    with pytest.raises(ValueError, match="max_len must be >= 1"):
        init_cache(config, batch=2, max_len=0)
