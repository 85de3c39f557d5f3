"""The on-device sampler on a tiny random Llama.

References: transformers' ``generate(do_sample=False)`` on the same weights (greedy
tokens), transformers' forward logits turned into the temperature/top-k/top-p
distribution by a float64 NumPy loop written from the definitions (sampling
frequencies and sampling log-probs), and our own full forward pass without a cache (the
trainer's recomputation of log-probs). Expensive generations are module-scoped and
shared between tests; every distinct ``SamplingConfig`` is one compilation.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import transformers
from flax import nnx

import jax
import jax.numpy as jnp

from alignax.models import CausalLM, from_hf_state_dict, positions_from_mask
from alignax.sampling import SamplingConfig, generate, left_pad, sampling_logprobs
from tests.support.compiled import jitted

torch = pytest.importorskip("torch", reason="the PyTorch reference (pinned test extras; not in `make test-latest`)")

V = 64
PAD = 0
HF_CONFIG = dict(
    model_type="llama",
    vocab_size=V,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=48,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
)
# Prompt lengths 1, 4, 7, 9: left padding of 8, 5, 2 and 0 slots.
PROMPTS = [[5], [17, 3, 40, 22], [9, 9, 31, 60, 2, 11, 48], [33, 7, 19, 52, 44, 1, 26, 38, 14]]
N = 12


@pytest.fixture(scope="module")
def tiny():
    """``(transformers model, our model, graphdef, state)`` on the same weights."""
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(**{k: v for k, v in HF_CONFIG.items() if k != "model_type"})
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # spread the logits: random init at std 0.02 is nearly uniform
        for p in hf.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    tensors = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    model = from_hf_state_dict(HF_CONFIG, tensors)
    graphdef, state = nnx.split(model)
    return hf, model, graphdef, state


@pytest.fixture(scope="module")
def prompts():
    return left_pad(PROMPTS, pad_id=PAD)


def hf_greedy(hf, tokens, mask, max_new_tokens, stop_ids):
    """transformers' greedy continuation ``[B, <= max_new_tokens]`` (pads after eos)."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor(tokens, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=list(stop_ids) or None,
            pad_token_id=PAD,
        )
    return out[:, tokens.shape[1] :].numpy()


@pytest.fixture(scope="module")
def greedy(tiny, prompts):
    """Greedy, no stop token: every row runs the full budget."""
    _, _, graphdef, state = tiny
    config = SamplingConfig(max_new_tokens=N, greedy=True, pad_id=PAD)
    return jax.device_get(generate(graphdef, state, *prompts, jax.random.key(0), config=config))


def first_stop_lengths(tokens, stop_ids):
    """Per row: index of the first stop token + 1, or the full width; by a plain loop."""
    lengths = []
    for row in tokens:
        length = len(row)
        for j, t in enumerate(row):
            if t in stop_ids:
                length = j + 1
                break
        lengths.append(length)
    return np.array(lengths)


# ------------------------------------------------------------------------ greedy


def test_greedy_equals_transformers(tiny, prompts, greedy):
    hf = tiny[0]
    ref = hf_greedy(hf, *prompts, N, ())
    np.testing.assert_array_equal(greedy.tokens, ref)
    assert greedy.response_mask.min() == 1 and (greedy.lengths == N).all()
    assert not greedy.stopped.any() and greedy.truncated.all() and int(greedy.num_steps) == N
    assert (greedy.sampling_logps == 0).all()  # a point mass
    np.testing.assert_array_equal(greedy.prompt_tokens, prompts[0])
    np.testing.assert_array_equal(greedy.prompt_mask, prompts[1])


def test_greedy_with_stop_tokens_equals_transformers_and_exits_early(tiny, prompts, greedy):
    _, _, graphdef, state = tiny
    base = greedy.tokens
    # Stop ids taken from early columns so every row stops before N (several ids).
    stop_ids = (int(base[0, 3]), int(base[1, 1]), int(base[2, 4]), int(base[3, 2]))
    lengths = first_stop_lengths(base, stop_ids)
    assert lengths.max() < N and len(set(lengths)) > 1
    config = SamplingConfig(max_new_tokens=N, greedy=True, pad_id=PAD, stop_token_ids=stop_ids)
    out = jax.device_get(generate(graphdef, state, *prompts, jax.random.key(0), config=config))

    ref = hf_greedy(tiny[0], *prompts, N, stop_ids)  # transformers stops when all rows did
    assert ref.shape[1] == lengths.max()
    np.testing.assert_array_equal(out.tokens[:, : ref.shape[1]], ref)
    for b, length in enumerate(lengths):
        np.testing.assert_array_equal(out.tokens[b, :length], base[b, :length])
        assert out.tokens[b, length - 1] in stop_ids  # the stop token is kept ...
        assert (out.tokens[b, length:] == PAD).all()  # ... and nothing real after it
        np.testing.assert_array_equal(out.response_mask[b], np.arange(N) < length)
        np.testing.assert_allclose(out.logps[b, :length], greedy.logps[b, :length], atol=1e-6)
        assert (out.logps[b, length:] == 0).all()
    np.testing.assert_array_equal(out.lengths, lengths)
    assert out.stopped.all() and not out.truncated.any()
    # the loop ended as soon as the last row stopped, not after N tokens
    assert int(out.num_steps) == lengths.max() < N


# ------------------------------------------------------------------------ log-probs


def full_forward_logprobs(model, out, temperature=1.0):
    """Trainer's view: one forward over prompt + response, no cache; ``[R, N, V]`` log-softmax."""
    tokens, attention_mask, _ = out.sequences()
    tokens, attention_mask = jnp.asarray(tokens), jnp.asarray(attention_mask)
    logits = jitted(model)(tokens, positions_from_mask(attention_mask), attention_mask).logits
    P = out.prompt_tokens.shape[1]
    return np.asarray(jax.nn.log_softmax(logits[:, P - 1 : -1] / temperature, axis=-1), np.float64)


@pytest.fixture(scope="module")
def sampled(tiny, prompts):
    """Temperature 1, no truncation, 3 samples per prompt, one stop id."""
    _, _, graphdef, state = tiny
    config = SamplingConfig(max_new_tokens=N, stop_token_ids=(7,), pad_id=PAD, num_samples=3)
    return config, jax.device_get(generate(graphdef, state, *prompts, jax.random.key(42), config=config))


def test_an_outputs_arrays_have_their_documented_dtypes(tiny, prompts):
    """Sampled here, not from a module fixture: mutmut maps a test to the functions it calls."""
    _, _, graphdef, state = tiny
    config = SamplingConfig(max_new_tokens=3, stop_token_ids=(7,), pad_id=PAD, num_samples=2)
    out = jax.device_get(generate(graphdef, state, *prompts, jax.random.key(1), config=config))
    dtypes = {name: np.asarray(getattr(out, name)).dtype for name in (
        "prompt_tokens", "prompt_mask", "tokens", "response_mask", "sampling_logps", "logps", "lengths", "stopped",
        "truncated", "group_ids", "num_steps")}
    assert dtypes == {"prompt_tokens": np.int32, "prompt_mask": np.int32, "tokens": np.int32,
                      "response_mask": np.int32, "sampling_logps": np.float32, "logps": np.float32,
                      "lengths": np.int32, "stopped": np.bool_, "truncated": np.bool_, "group_ids": np.int32,
                      "num_steps": np.int32}


def test_logps_equal_full_forward_at_temperature_one(tiny, sampled):
    _, out = sampled
    logp = full_forward_logprobs(tiny[1], out)
    want = np.take_along_axis(logp, out.tokens[..., None].astype(np.int64), axis=-1)[..., 0]
    m = out.response_mask.astype(bool)
    assert m.sum() > 40
    assert np.abs(out.logps - want)[m].max() <= 1e-5
    assert np.abs(out.sampling_logps - want)[m].max() <= 1e-5  # T = 1, nothing truncated
    assert (out.logps[~m] == 0).all() and (out.sampling_logps[~m] == 0).all()


def reference_logq(logits, temperature, top_k, top_p):
    """log q by the definitions, float64, one row at a time (top-k ties kept, nucleus by prefix mass)."""
    z = np.asarray(logits, np.float64) / temperature
    out = np.full(z.shape, -np.inf)
    for b, row in enumerate(z):
        keep = np.ones(len(row), bool)
        if top_k:
            kth = np.sort(row)[::-1][top_k - 1]
            keep &= row >= kth
        if top_p < 1:
            p = np.exp(row - row[keep].max()) * keep
            p /= p.sum()
            order = np.argsort(-row, kind="stable")
            before = 0.0
            nucleus = np.zeros(len(row), bool)
            for v in order:
                if not keep[v]:
                    continue
                if before < top_p:
                    nucleus[v] = True
                    # the test's own setup must not sit on a rounding edge
                    assert abs(before - top_p) > 1e-4
                before += p[v]
            keep &= nucleus
        kept = row[keep]
        lse = kept.max() + np.log(np.exp(kept - kept.max()).sum())
        out[b, keep] = row[keep] - lse
    return out


def test_tempered_truncated_logps(tiny, prompts):
    """T != 1 with top-k and top-p: ``logps`` stay untempered; ``sampling_logps`` are log q."""
    _, model, graphdef, state = tiny
    config = SamplingConfig(max_new_tokens=6, temperature=0.7, top_k=9, top_p=0.8, pad_id=PAD, num_samples=2)
    out = jax.device_get(generate(graphdef, state, *prompts, jax.random.key(3), config=config))
    logp = full_forward_logprobs(model, out)
    tok = out.tokens[..., None].astype(np.int64)
    m = out.response_mask.astype(bool)
    np.testing.assert_allclose(out.logps[m], np.take_along_axis(logp, tok, -1)[..., 0][m], atol=1e-5)
    R, T, _ = logp.shape
    logq = reference_logq(logp.reshape(R * T, V), 0.7, 9, 0.8).reshape(R, T, V)
    chosen = np.take_along_axis(logq, tok, -1)[..., 0]
    assert np.isfinite(chosen[m]).all()  # every sampled token is inside the kept set
    np.testing.assert_allclose(out.sampling_logps[m], chosen[m], atol=1e-5)


SAMPLES_PER_PROMPT = 6000
DISTRIBUTIONS = [
    dict(temperature=0.6),
    dict(temperature=1.4, top_k=5),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=0.8, top_k=12, top_p=0.6),
]


@pytest.mark.parametrize("kwargs", DISTRIBUTIONS, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_sampling_frequencies_match_adjusted_distribution(tiny, prompts, kwargs):
    """First-token frequencies over 6,000 samples per prompt (4 prompts, one call).

    Tolerance: every token's frequency within 5 binomial standard deviations
    ``sqrt(q (1 - q) / n)`` of its probability q (plus 1/n for tiny q), and exactly 0
    outside the kept set; the per-row sampling log-prob equals log q.
    """
    hf, _, graphdef, state = tiny
    tokens, mask = prompts
    config = SamplingConfig(max_new_tokens=1, pad_id=PAD, num_samples=SAMPLES_PER_PROMPT, **kwargs)
    out = jax.device_get(generate(graphdef, state, tokens, mask, jax.random.key(11), config=config))
    with torch.no_grad():
        positions = torch.tensor(np.maximum(np.cumsum(mask, 1) - 1, 0))
        logits = hf(torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask), position_ids=positions)
    logq = reference_logq(logits.logits[:, -1].double().numpy(), kwargs.get("temperature", 1.0),
                          kwargs.get("top_k", 0), kwargs.get("top_p", 1.0))
    q = np.exp(logq)
    n = SAMPLES_PER_PROMPT
    first = out.tokens[:, 0].reshape(len(PROMPTS), n)
    for b in range(len(PROMPTS)):
        freq = np.bincount(first[b], minlength=V) / n
        assert (freq[q[b] == 0] == 0).all()
        tol = 5 * np.sqrt(q[b] * (1 - q[b]) / n) + 1.0 / n
        assert (np.abs(freq - q[b]) <= tol).all(), np.abs(freq - q[b]).max()
        np.testing.assert_allclose(out.sampling_logps[b * n : (b + 1) * n, 0], logq[b, first[b]], atol=1e-5)
    if "top_k" in kwargs or "top_p" in kwargs:
        assert (q == 0).any(axis=1).all()  # truncation actually removed tokens


def test_sampling_logprobs_pieces():
    """Hand-worked: logits log([0.5, 0.3, 0.15, 0.05]) at T = 1."""
    p = np.array([[0.5, 0.3, 0.15, 0.05]])
    logits = jnp.asarray(np.log(p), jnp.float32)
    # top-p 0.7: mass before the tokens in order is 0, 0.5, 0.8, 0.95 -> keep {0, 1}.
    got = np.exp(np.asarray(sampling_logprobs(logits, top_p=0.7)))
    np.testing.assert_allclose(got, [[0.625, 0.375, 0, 0]], atol=1e-6)
    # top-k 3: renormalise over 0.95.
    got = np.exp(np.asarray(jax.jit(lambda x: sampling_logprobs(x, top_k=3))(logits)))
    np.testing.assert_allclose(got, [[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]], atol=1e-6)
    # T = 0.5 squares the probabilities before renormalising.
    got = np.exp(np.asarray(sampling_logprobs(logits, temperature=0.5)))
    np.testing.assert_allclose(got, p**2 / (p**2).sum(), atol=1e-6)


def test_sampling_logprobs_of_bf16_logits_are_computed_in_float32():
    logits = jnp.asarray([[1.5, -0.25, 3.0, 0.125]], jnp.bfloat16)
    got = sampling_logprobs(logits, temperature=0.7, top_p=0.9)
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(got, sampling_logprobs(logits.astype(jnp.float32), temperature=0.7, top_p=0.9))


def test_top_p_one_keeps_even_a_token_of_negligible_probability():
    """``top_p = 1`` keeps every token: a nucleus cut at 1 would drop one whose probability
    (e^-40) rounds the mass before it to 1 in float32."""
    logits = jnp.asarray([[0.0, 0.0, -40.0]])
    for got in (sampling_logprobs(logits), sampling_logprobs(logits, top_p=1.0)):
        assert np.all(np.isfinite(np.asarray(got)))


def test_top_p_keeps_a_token_only_while_the_mass_before_it_is_strictly_below():
    """At ``top_p`` equal to the mass before the third token (computed as the function does,
    in float32), the third token is dropped: the nucleus is the smallest prefix whose mass
    reaches ``top_p``."""
    logits = jnp.asarray([[2.0, 0.5, 1.0, -1.0]])
    ordered = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(ordered, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    got = np.asarray(sampling_logprobs(logits, top_p=float(mass_before[0, 2])))
    np.testing.assert_array_equal(np.isfinite(got), [[True, False, True, False]])  # 2.0 and 1.0 kept


# ------------------------------------------------------------------------ groups
# ------------------------------------------------------------------------ groups


def test_num_samples_groups(tiny, prompts, sampled, greedy):
    _, out = sampled
    B, G = len(PROMPTS), 3
    assert out.tokens.shape == (B * G, N)
    np.testing.assert_array_equal(out.group_ids, np.repeat(np.arange(B), G))
    np.testing.assert_array_equal(out.prompt_tokens, np.repeat(prompts[0], G, axis=0))
    groups = out.tokens.reshape(B, G, N)
    for b in range(B):  # samples of one prompt differ
        assert len({tuple(row) for row in groups[b]}) > 1
    # greedy samples of a group are identical and equal the single-sample run
    _, _, graphdef, state = tiny
    config = SamplingConfig(max_new_tokens=N, greedy=True, pad_id=PAD, num_samples=2)
    g2 = jax.device_get(generate(graphdef, state, *prompts, jax.random.key(0), config=config))
    np.testing.assert_array_equal(g2.tokens, np.repeat(greedy.tokens, 2, axis=0))
    np.testing.assert_allclose(g2.logps, np.repeat(greedy.logps, 2, axis=0), atol=1e-6)


def test_prefill_runs_once_per_prompt(tiny, prompts, monkeypatch):
    """The traced program calls the model once on the [B, P] prompts, then on [B * G, 1]."""
    _, _, graphdef, state = tiny
    calls = []
    original = CausalLM.__call__

    def spy(self, tokens, *args, **kwargs):
        calls.append(tuple(tokens.shape))
        return original(self, tokens, *args, **kwargs)

    monkeypatch.setattr(CausalLM, "__call__", spy)
    config = SamplingConfig(max_new_tokens=3, pad_id=PAD, num_samples=5)
    jax.eval_shape(lambda s, t, m: generate(graphdef, s, t, m, jax.random.key(0), config=config), state, *prompts)
    B, P = prompts[0].shape
    assert calls == [(B, P), (B * 5, 1)]


# ------------------------------------------------------------------------ errors, compiles


def test_context_full_errors(tiny):
    _, _, graphdef, state = tiny  # max_position_embeddings = 48
    key = jax.random.key(0)
    full = np.ones((2, 48), np.int32)
    with pytest.raises(ValueError, match=r"already fill the context: padded prompt length 48 >= .* 48"):
        generate(graphdef, state, full, full, key, config=SamplingConfig(max_new_tokens=1))
    long = np.ones((2, 40), np.int32)
    with pytest.raises(ValueError, match=r"prompt length 40 \+ max_new_tokens 9 = 49 exceeds .* 48"):
        generate(graphdef, state, long, long, key, config=SamplingConfig(max_new_tokens=9))
    with pytest.raises(ValueError, match="shape mismatch"):
        generate(graphdef, state, long, long[:, 1:], key, config=SamplingConfig(max_new_tokens=2))


def test_a_prompt_and_its_response_may_fill_the_context_exactly(tiny):
    """Prompt 40 + 8 new tokens = the 48 positions of the model: the last token drawn sits at
    position 47, inside the context (one more is the error above)."""
    _, _, graphdef, state = tiny
    prompt = np.ones((2, 40), np.int32)
    out = generate(graphdef, state, prompt, prompt, jax.random.key(0), config=SamplingConfig(max_new_tokens=8))
    assert out.tokens.shape == (2, 8)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_new_tokens=0), "max_new_tokens must be a positive integer; got 0"),
        (dict(max_new_tokens=4, temperature=0.0), "temperature must be > 0 when sampling; got 0.0"),
        (dict(max_new_tokens=4, top_k=-1), "top_k must be an integer >= 0"),
        (dict(max_new_tokens=4, top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(max_new_tokens=4, num_samples=0), "num_samples must be a positive integer"),
    ],
)
def test_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_config_is_hashable_and_normalises_stop_ids():
    a = SamplingConfig(max_new_tokens=4, stop_token_ids=[2, 5])
    b = SamplingConfig(max_new_tokens=4, stop_token_ids=(2, 5))
    assert a == b and hash(a) == hash(b)
    assert SamplingConfig(max_new_tokens=4, stop_token_ids=2).stop_token_ids == (2,)
    assert SamplingConfig(max_new_tokens=4, temperature=0.0, greedy=True).greedy


def test_recompiles_only_when_shapes_or_config_change(tiny, prompts, greedy, caplog):
    hf, _, graphdef, state = tiny
    config = SamplingConfig(max_new_tokens=N, greedy=True, pad_id=PAD)
    # Compilations are counted from the line jax logs (at DEBUG) each time it lowers a program to
    # compile it, not from ``generate._cache_size()``: that private count is of one LRU shared by
    # every jitted function of the process, and after ``jax.clear_caches()`` late in a long worker
    # it read -13 on CI. The caches are emptied first so every count below is this test's own.
    jax.clear_caches()
    caplog.set_level(logging.DEBUG, logger="jax._src.interpreters.pxla")

    def compiled(call) -> int:
        caplog.clear()
        call()
        # "Compiling jit(generate) with ..." (older jax releases name it jit_generate)
        return sum(re.match(r"Compiling jit[(_]generate\b", r.getMessage()) is not None for r in caplog.records)

    again = []
    assert compiled(lambda: again.append(generate(graphdef, state, *prompts, jax.random.key(0), config=config))) == 1
    np.testing.assert_array_equal(np.asarray(again[0].tokens), greedy.tokens)
    # new weights of the same structure (a second model built from other tensors), new
    # prompt values, new key: the compiled program is reused
    tensors = {k: v.detach().numpy() * 1.01 for k, v in hf.state_dict().items()}
    graphdef2, state2 = nnx.split(from_hf_state_dict(HF_CONFIG, tensors))
    other = left_pad([[1, 2], [3], [4, 5, 6], [7] * 9], pad_id=PAD)
    out = []
    assert compiled(lambda: out.append(generate(graphdef2, state2, *other, jax.random.key(1), config=config))) == 0
    assert not np.array_equal(np.asarray(out[0].tokens), greedy.tokens)
    # a new config or a new prompt length compiles again, once
    five = SamplingConfig(max_new_tokens=5, pad_id=PAD)
    assert compiled(lambda: generate(graphdef, state, *prompts, jax.random.key(0), config=five)) == 1
    longer = left_pad(PROMPTS, pad_id=PAD, length=10)
    assert compiled(lambda: generate(graphdef, state, *longer, jax.random.key(0), config=config)) == 1


def test_left_pad():
    tokens, mask = left_pad([[4, 5], [6]], pad_id=9, length=3)
    np.testing.assert_array_equal(tokens, [[9, 4, 5], [9, 9, 6]])
    np.testing.assert_array_equal(mask, [[0, 1, 1], [0, 0, 1]])
    with pytest.raises(ValueError, match="sequence 0 has 2 tokens; length is 1"):
        left_pad([[4, 5]], pad_id=0, length=1)
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        left_pad([[4], []], pad_id=0)


def test_left_pad_gives_int32_as_generate_takes_them():
    tokens, mask = left_pad([[4, 5], [6]], pad_id=9)
    assert tokens.dtype == np.int32 and mask.dtype == np.int32


def test_an_outputs_sequences_put_prompt_and_response_side_by_side():
    """``SamplingOutput.sequences``: tokens and attention mask concatenated, the response mask
    0 over the prompt columns (worked by hand)."""
    from alignax.sampling.sampler import SamplingOutput

    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    rows = SamplingOutput(
        prompt_tokens=i32([[0, 7], [8, 9]]), prompt_mask=i32([[0, 1], [1, 1]]), tokens=i32([[3, 0], [4, 5]]),
        response_mask=i32([[1, 0], [1, 1]]), sampling_logps=jnp.zeros((2, 2)), logps=jnp.zeros((2, 2)),
        lengths=i32([1, 2]), stopped=jnp.asarray([True, False]), truncated=jnp.asarray([False, True]),
        group_ids=i32([0, 1]), num_steps=i32(2))
    tokens, attention, response = (np.asarray(x) for x in rows.sequences())
    np.testing.assert_array_equal(tokens, [[0, 7, 3, 0], [8, 9, 4, 5]])
    np.testing.assert_array_equal(attention, [[0, 1, 1, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(response, [[0, 0, 1, 0], [0, 0, 1, 1]])


# ------------------------------------------------------------------------ mesh

MESH_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, numpy as np
    from flax import nnx
    from alignax.models import CausalLM, ModelConfig
    from alignax.parallel import batch_sharding, make_mesh, place_array, shard_model
    from alignax.sampling import SamplingConfig, generate, left_pad

    assert len(jax.devices()) == 8
    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, intermediate_size=48, norm_eps=1e-5,
                         max_position_embeddings=64)
    model = CausalLM(config, rngs=nnx.Rngs(3))
    state = jax.tree.map(lambda x: x * 6.0, nnx.state(model))  # spread the logits
    nnx.update(model, state)
    rng = np.random.RandomState(0)
    tokens, mask = left_pad([list(rng.randint(1, 64, n)) for n in (3, 8, 1, 5, 7, 2, 6, 4)], pad_id=0)
    key = jax.random.key(5)
    greedy = SamplingConfig(max_new_tokens=10, greedy=True, stop_token_ids=(3, 4), pad_id=0)
    sample = SamplingConfig(max_new_tokens=10, stop_token_ids=(3,), pad_id=0, num_samples=2)

    graphdef, state = nnx.split(model)
    single = {c: jax.device_get(generate(graphdef, state, tokens, mask, key, config=c)) for c in (greedy, sample)}

    mesh = make_mesh((2, 2, 2))
    shard_model(model, mesh)
    graphdef, state = nnx.split(model)
    kernel = nnx.state(model)["model"]["layers"][0]["attn"]["q_kernel"].get_value()
    assert len(kernel.sharding.device_set) == 8, kernel.sharding
    data = batch_sharding(mesh)
    t, m = place_array(tokens, data), place_array(mask, data)
    for c in (greedy, sample):
        with jax.set_mesh(mesh):
            out = generate(graphdef, state, t, m, key, config=c)
        for x in (out.tokens, out.logps, out.lengths):
            assert x.sharding.is_equivalent_to(batch_sharding(mesh, x.ndim), x.ndim), x.sharding
        results = [jax.device_get(out)]
        if c is greedy:  # without a mesh in context XLA propagates the input shardings
            results.append(jax.device_get(generate(graphdef, state, t, m, key, config=c)))
        ref = single[c]
        for got in results:
            np.testing.assert_array_equal(got.tokens, ref.tokens)
            np.testing.assert_array_equal(got.response_mask, ref.response_mask)
            # the tensor axis splits reductions: float32 sums in another order
            np.testing.assert_allclose(got.logps, ref.logps, atol=1e-4, rtol=1e-4)
            np.testing.assert_allclose(got.sampling_logps, ref.sampling_logps, atol=1e-4, rtol=1e-4)
    assert single[greedy].response_mask.sum() > 0
    print("OK", single[greedy].lengths.tolist(), single[sample].lengths.tolist())
    """
)


@pytest.mark.slow  # the GRPO mesh check (test_online_mesh.py) samples on the same fake mesh
def test_sharded_batch_equals_single_device():
    env = dict(os.environ, JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", MESH_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("OK"), proc.stdout


def test_first_argmax_and_gumbel_draw_equal_jax_argmax_and_categorical():
    from alignax.sampling.distribution import draw_from_logprobs, first_argmax

    rng = np.random.default_rng(0)
    ties = jnp.asarray(rng.integers(0, 4, (64, 37)).astype(np.float32))  # many ties: the first index wins
    np.testing.assert_array_equal(np.asarray(first_argmax(ties)), np.asarray(jnp.argmax(ties, axis=-1)))
    assert int(first_argmax(ties[0].at[3].set(jnp.nan))) == 36  # a NaN row: the last index, as documented
    logq = jnp.asarray(rng.normal(size=(16, 300)).astype(np.float32))
    logq = jnp.where(jnp.asarray(rng.random((16, 300)) < 0.7), -jnp.inf, logq)  # excluded tokens
    logq = logq.at[:, 0].set(0.0)  # every row keeps at least one token
    for seed in range(5):
        key = jax.random.key(seed)
        ours = np.asarray(jax.jit(draw_from_logprobs)(key, logq))
        np.testing.assert_array_equal(ours, np.asarray(jax.random.categorical(key, logq, axis=-1)))
        assert np.isfinite(np.asarray(logq)[np.arange(16), ours]).all()


def test_a_config_refuses_each_bound_on_its_own_edge():
    """top_p above 1; a negative stop id with a valid pad id; token id 0 is a valid stop id."""
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        SamplingConfig(max_new_tokens=4, top_p=1.5)
    SamplingConfig(max_new_tokens=4, top_p=1.0)
    with pytest.raises(ValueError, match=r"token ids must be >= 0; got stop_token_ids=\(3, -1\), pad_id=0"):
        SamplingConfig(max_new_tokens=4, stop_token_ids=(3, -1), pad_id=0)
    assert SamplingConfig(max_new_tokens=4, stop_token_ids=(0,), pad_id=0).stop_token_ids == (0,)
