"""Shared-prompt packing: one packed forward equals the unpacked rows it replaces."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from alignax.models import ModelConfig, create_model
from alignax.trainers.engine import packing
from alignax.trainers.engine.setup import response_logps, sequence_logps

V, T, WINDOW = 50, 16, 7
CONFIG = ModelConfig.from_hf_config(
    dict(model_type="llama", vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
         num_key_value_heads=2, head_dim=8, intermediate_size=48, max_position_embeddings=64, rms_norm_eps=1e-5,
         tie_word_embeddings=False)
)


@pytest.fixture(scope="module")
def model():
    return create_model(CONFIG, seed=3)


# Each computation below is one compiled program (eagerly, every jax operation of a forward
# pass compiles on its own, most of these tests' time).
pack = jax.jit(packing.pack, static_argnums=2)
sequence_logps = jax.jit(sequence_logps)


def reference_logps(model, row):
    """``response_logps`` of one unpacked row, in one program."""
    return jax.jit(lambda row: response_logps(model, row["tokens"], row["positions"], row["attention_mask"],
                                              row["response_mask"], window=WINDOW))(row)


def right_padded(prompts, responses, masks=None):
    """Rows ``prompt + response`` padded to T, as alignax.data builds them."""
    B = len(prompts)
    out = {k: np.zeros((B, T), np.int32) for k in ("tokens", "positions", "attention_mask", "response_mask")}
    out["tokens"][:] = 1  # the pad id
    for b, (p, r) in enumerate(zip(prompts, responses)):
        n = len(p) + len(r)
        out["tokens"][b, :n] = p + r
        out["positions"][b, :n] = np.arange(n)
        out["attention_mask"][b, :n] = 1
        out["response_mask"][b, len(p) : n] = 1 if masks is None else masks[b]
    return {k: jnp.asarray(v) for k, v in out.items()}


def sample_group(n_cont, seed):
    rng = np.random.default_rng(seed)
    lengths = [(9, [7, 2, 5]), (3, [1, 7, 6]), (1, [7, 7, 4]), (5, [4, 3, 7])]  # (prompt, continuations)
    prompts = [list(rng.integers(2, V, p)) for p, _ in lengths]
    rows = []
    for k in range(n_cont):
        responses = [list(rng.integers(2, V, ls[k])) for _, ls in lengths]
        # a multi-turn style hole in one response's loss mask
        masks = [None] * len(lengths)
        masks[1] = [1] * len(responses[1])
        if len(responses[1]) > 2:
            masks[1][1] = 0
        masks = [m if m is not None else [1] * len(r) for m, r in zip(masks, responses)]
        rows.append(right_padded(prompts, responses, masks))
    return rows, jnp.asarray([p for p, _ in lengths], jnp.int32)


def pack_reference(rows, prompt_length, window):
    """The module docstring's layout, row by row in loops: the prompt, then each
    continuation's tokens at positions restarting at ``p``, segment ``k``; continuation ``k``'s
    token ``i < window`` scored by the hidden state at ``p - 1`` (``i = 0``) or at its own
    previous column, its target column held inside the row, its weight the unpacked row's
    response mask at ``p + i`` (the last column past the row) where ``i`` is one of its tokens,
    the column is inside the row and some state precedes it."""
    B, T = np.asarray(rows[0]["tokens"]).shape
    n, width = len(rows), T + (len(rows) - 1) * window
    out = {k: np.zeros((B, width), np.int32) for k in ("tokens", "positions", "attention_mask", "segment_ids")}
    hidden, target, weight = (np.zeros((n, B, window), d) for d in (np.int32, np.int32, np.float32))
    fits = np.ones(B, bool)
    for b in range(B):
        p = int(prompt_length[b])
        out["tokens"][b, :p] = np.asarray(rows[0]["tokens"])[b, :p]
        out["positions"][b, :p] = np.arange(p)
        out["attention_mask"][b, :p] = 1
        start = p
        for k, row in enumerate(rows):
            length = int(np.asarray(row["attention_mask"])[b].sum()) - p
            fits[b] &= length <= window
            for c in range(start, min(start + length, width)):
                out["tokens"][b, c] = np.asarray(row["tokens"])[b, p + c - start]
                out["positions"][b, c], out["segment_ids"][b, c], out["attention_mask"][b, c] = p + c - start, k + 1, 1
            for i in range(window):
                hidden[k, b, i] = max(p - 1, 0) if i == 0 else start + i - 1
                target[k, b, i] = min(start + i, width - 1)
                scored = i < length and p + i >= 1 and start + i < width
                weight[k, b, i] = np.asarray(row["response_mask"])[b, min(p + i, T - 1)] if scored else 0.0
            start += length
    return out, hidden, target, weight, fits


@pytest.mark.parametrize("n_cont", [1, 2, 3])
def test_pack_equals_the_layout_written_out_in_loops(n_cont):
    """Every field of ``pack``, under x64 as well (its integer outputs stay int32), against
    :func:`pack_reference`, window 4, rows of 16: batch row 0's first continuation fills its
    row (13 + 3 tokens: its scored window reads past the row's last column), batch row 1's
    second is longer than the window (that row does not fit), batch row 1 has a one-token
    prompt."""
    prompts = [list(range(2, 15)), [7], [8, 9, 10]]
    responses = [[[11, 12, 13], [14], [15, 16]], [[17, 18], [19, 20, 21, 22, 31], [23]], [[24], [25, 26], [27, 28, 29]]]
    rows = [right_padded(prompts, [r[k] for r in responses]) for k in range(n_cont)]
    prompt_length = jnp.asarray([len(p) for p in prompts], jnp.int32)
    with jax.enable_x64(True):
        packed = packing.pack(rows, prompt_length, 4)
    out, hidden, target, weight, fits = pack_reference(rows, prompt_length, 4)
    real = out["attention_mask"].astype(bool)
    np.testing.assert_array_equal(np.where(real, np.asarray(packed.tokens), 0), np.where(real, out["tokens"], 0))
    for name in ("positions", "attention_mask", "segment_ids"):
        np.testing.assert_array_equal(getattr(packed, name), out[name], err_msg=name)
        assert getattr(packed, name).dtype == jnp.int32, name
    for name, want in (("score_hidden", hidden), ("score_target", target), ("score_mask", weight), ("fits", fits)):
        np.testing.assert_array_equal(getattr(packed, name), want, err_msg=name)
    assert packed.score_hidden.dtype == packed.score_target.dtype == jnp.int32
    assert fits.tolist() == ([True, True, True] if n_cont == 1 else [True, False, True])
    assert weight[0, 0].tolist() == [1, 1, 1, 0]  # the full row: nothing scored past its 3 tokens


@pytest.mark.parametrize("n_cont", [2, 3])
def test_packed_logps_equal_unpacked(model, n_cont):
    rows, prompt_length = sample_group(n_cont, seed=n_cont)
    packed = pack(rows, prompt_length, WINDOW)
    assert packed.tokens.shape == (4, packing.packed_width(T, n_cont, WINDOW))
    assert bool(jnp.all(packed.fits))
    logps, mask = jax.jit(lambda: packing.packed_response_logps(model, packed))()
    for k, row in enumerate(rows):
        ref, ref_mask = reference_logps(model, row)
        np.testing.assert_array_equal(np.asarray(mask[k]), np.asarray(ref_mask))
        np.testing.assert_allclose(np.asarray(logps[k] * mask[k]), np.asarray(ref * ref_mask), atol=2e-5)
        np.testing.assert_allclose(sequence_logps(logps[k], mask[k])[0], sequence_logps(ref, ref_mask)[0], atol=1e-4)
    # the packed row holds each token once: prompt, then every continuation in turn
    lengths = [int(np.sum(r["attention_mask"][0])) - 9 for r in rows]
    assert int(np.sum(packed.attention_mask[0])) == 9 + sum(lengths)
    np.testing.assert_array_equal(np.asarray(packed.segment_ids[0, :9]), 0)
    np.testing.assert_array_equal(np.asarray(packed.positions[0, 9 : 9 + lengths[0]]), np.arange(9, 9 + lengths[0]))
    second = 9 + lengths[0]
    np.testing.assert_array_equal(np.asarray(packed.positions[0, second : second + lengths[1]]),
                                  np.arange(9, 9 + lengths[1]))
    np.testing.assert_array_equal(np.asarray(packed.segment_ids[0, second : second + lengths[1]]), 2)


def test_the_packed_forward_scores_only_the_windows_and_chunks_them(model):
    """The LM head runs over the scored windows only, never over the packed row (``[B, W, V]``
    logits), and with ``chunk_size`` over one chunk of them at a time: read from the traced
    program, as an eager caller would run it."""
    rows, prompt_length = sample_group(2, seed=7)
    packed = packing.pack(rows, prompt_length, WINDOW)
    B, width = packed.tokens.shape
    program = lambda chunk: str(jax.make_jaxpr(  # noqa: E731
        lambda p: packing.packed_response_logps(model, p, chunk_size=chunk))(packed))
    whole_row, windows, chunk = f"f32[{B},{width},{V}]", f"f32[{B},{2 * WINDOW},{V}]", f"f32[{B},{WINDOW},{V}]"
    assert whole_row not in program(None) and windows in program(None)
    assert whole_row not in program(WINDOW) and windows not in program(WINDOW) and chunk in program(WINDOW)


def test_packed_gradients_equal_unpacked(model):
    rows, prompt_length = sample_group(2, seed=7)
    graphdef, params = nnx.split(model)

    def packed_loss(params):
        logps, mask = packing.packed_response_logps(nnx.merge(graphdef, params), packing.pack(rows, prompt_length, WINDOW))
        seq = sequence_logps(logps, mask)[0]
        return jnp.sum(jax.nn.log_sigmoid(seq[0] - seq[1]))

    def unpacked_loss(params):
        m = nnx.merge(graphdef, params)
        seq = [sequence_logps(*response_logps(m, r["tokens"], r["positions"], r["attention_mask"],
                                              r["response_mask"], window=WINDOW))[0] for r in rows]
        return jnp.sum(jax.nn.log_sigmoid(seq[0] - seq[1]))

    a, ga = jax.jit(jax.value_and_grad(packed_loss))(params)
    b, gb = jax.jit(jax.value_and_grad(unpacked_loss))(params)
    np.testing.assert_allclose(a, b, rtol=1e-5)
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-5, rtol=1e-4)


def test_a_continuation_longer_than_the_window_gives_nan(model):
    rows, prompt_length = sample_group(2, seed=1)
    packed = pack(rows, prompt_length, WINDOW - 1)  # row 0..3 hold 7-token continuations
    logps, mask = jax.jit(lambda: packing.packed_response_logps(model, packed))()
    fits = np.asarray(packed.fits)
    assert not fits.all() and fits.any()
    seq = np.asarray(sequence_logps(logps, mask)[0])
    assert np.isnan(seq[:, ~fits]).any(axis=0).all()
    assert np.isfinite(seq[:, fits]).all()


def test_segment_ids_refuse_a_cache(model):
    from alignax.models import init_cache

    cache = init_cache(CONFIG, 1, 8)
    tokens = jnp.ones((1, 2), jnp.int32)
    with pytest.raises(ValueError, match="segment_ids"):
        model(tokens, jnp.zeros((1, 2), jnp.int32), tokens, cache=cache, segment_ids=tokens)


def test_pack_groups_by_hand():
    """Two groups of two rows (prompt 2, responses 2): the prompt once, then each response;
    segment ids int32, 0 on the prompt and k on response k."""
    tokens = jnp.asarray([[1, 2, 10, 11], [1, 2, 12, 13], [3, 4, 20, 21], [3, 4, 22, 23]], jnp.int32)
    positions = jnp.asarray([[0, 1, 2, 3]] * 4, jnp.int32)
    mask = jnp.asarray([[1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 1, 1], [0, 1, 1, 1]], jnp.int32)
    packed_tokens, packed_positions, packed_mask, segments = packing.pack_groups(
        tokens, positions, mask, prompt_len=2, group=2)
    np.testing.assert_array_equal(packed_tokens, [[1, 2, 10, 11, 12, 13], [3, 4, 20, 21, 22, 23]])
    np.testing.assert_array_equal(packed_positions, [[0, 1, 2, 3, 2, 3]] * 2)
    np.testing.assert_array_equal(packed_mask, [[1, 1, 1, 0, 1, 1], [0, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(segments, [[0, 0, 1, 1, 2, 2]] * 2)
    assert segments.dtype == jnp.int32
    with pytest.raises(ValueError, match="3 rollout rows do not form groups of 2"):
        packing.pack_groups(tokens[:3], positions[:3], mask[:3], prompt_len=2, group=2)


@pytest.mark.parametrize("kind", ["causal_lm", "policy_value"])
def test_packed_groups_equal_unpacked_rollout_rows(kind):
    """Rollout rows (left-padded prompt, response window with stops and padding inside):
    one packed row per group gives the rows' own log-probs, entropies and values."""
    from alignax.trainers.online.rollout import response_forward

    model = create_model(CONFIG, kind=kind, seed=5)
    if kind == "policy_value":  # a non-zero value head, so values are compared for real
        model.value_head[...] = jax.random.normal(jax.random.key(0), model.value_head[...].shape) * 0.1
    rng = np.random.default_rng(0)
    P, N, G, prompts = 6, 5, 3, 2
    prompt_mask = np.ones((prompts, P), np.int32)
    prompt_mask[1, :4] = 0  # a 2-token prompt
    prompt = rng.integers(2, V, (prompts, P)) * prompt_mask
    response_mask = np.ones((prompts * G, N), np.int32)
    response_mask[1, 3:] = 0  # stopped early
    response_mask[4, 1:] = 0
    rows = np.repeat(np.concatenate([prompt, prompt_mask], 1), G, axis=0)
    tokens = np.concatenate([rows[:, :P], rng.integers(2, V, (prompts * G, N)) * response_mask], 1)
    attention = np.concatenate([rows[:, P:], response_mask], 1)
    positions = np.maximum(np.cumsum(attention, 1) - 1, 0)
    args = [jnp.asarray(a, jnp.int32) for a in (tokens, positions, attention)]
    run = lambda group: jax.jit(lambda *a: response_forward(model, *a, prompt_len=P, temperature=0.7,  # noqa: E731
                                                            chunk_size=None, group=group))(*args)
    ref, packed = run(1), run(G)
    real = response_mask.astype(bool)
    for name, a, b in zip(("logps", "entropy", "values"), packed, ref):
        if b is None:
            assert a is None and kind == "causal_lm"
            continue
        assert a.shape == (prompts * G, N), name
        np.testing.assert_allclose(np.asarray(a)[real], np.asarray(b)[real], atol=2e-5, err_msg=name)


def test_group_packing_pays_by_the_flop_count():
    smollm2 = ModelConfig.from_hf_config(
        dict(model_type="llama", vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, head_dim=64, intermediate_size=1536, max_position_embeddings=8192,
             rms_norm_eps=1e-5, tie_word_embeddings=True)
    )
    pays = lambda p, n, g: packing.group_packing_pays(smollm2, prompt_len=p, new_tokens=n, group=g)  # noqa: E731
    assert pays(64, 64, 2)  # the GRPO benchmark: 192 tokens instead of 256
    assert pays(64, 24, 6)  # the demo: 208 instead of 528
    assert not pays(256, 1024, 16)  # 16,640-token rows: attention would dominate
    assert not pays(0, 64, 4)  # no prompt to share


def _layer_weights(config):
    """One decoder layer's projection weights, counted from the created model's parameters."""
    model = nnx.eval_shape(lambda: create_model(config, seed=0))
    layer = nnx.state(model)["model"]["layers"][0]
    return sum(int(np.prod(leaf.shape)) for path, leaf in jax.tree_util.tree_flatten_with_path(layer)[0]
               if "kernel" in jax.tree_util.keystr(path))


def _packing_pays_reference(config, weights, prompt_len, new_tokens, group):
    """The docstring's rule, counted from the model itself: ``2 x`` one layer's projection
    weights (:func:`_layer_weights`) FLOPs per token, plus ``4 T H_q`` per
    token for the dense attention over ``T`` keys (scores and weighted values, ``2 T H_q``
    each); packing pays when its total is lower and its score matrix at most twice the
    unpacked rows' together."""
    q_width = config.num_heads * config.head_dim
    unpacked, packed = prompt_len + new_tokens, prompt_len + group * new_tokens
    total = lambda t: t * 2 * weights + t * t * 4 * q_width  # noqa: E731
    return total(packed) < group * total(unpacked) and packed * packed <= 2 * group * unpacked * unpacked


@pytest.mark.parametrize("gated", [True, False])
def test_group_packing_pays_exactly_where_the_flop_count_says(gated):
    """Every (prompt, response, group) of a grid that straddles both conditions: the FLOP
    comparison, which flips with prompt length (and is an equality at prompt = response = 60,
    group 3 for the gated MLP, 48 without the gate: packing must then not pay), and the
    score-matrix bound (an equality at prompt 4, response 3, group 8: 28^2 = 2 x 8 x 7^2)."""
    config = dataclasses.replace(CONFIG, gated_mlp=gated)
    cases = [(p, n, g) for p in (*range(0, 130, 4), 1, 2) for n in (1, 3, 8, 24, 48, 60, 64) for g in (2, 3, 8)]
    got = [packing.group_packing_pays(config, prompt_len=p, new_tokens=n, group=g) for p, n, g in cases]
    weights = _layer_weights(config)
    want = [_packing_pays_reference(config, weights, p, n, g) for p, n, g in cases]
    assert got == want, [c for c, a, b in zip(cases, got, want) if a != b]
    assert 0 < sum(want) < len(want)  # both answers occur
    assert _packing_pays_reference(config, weights, 4, 3, 8)  # the bound's equality case is a "pays"


def _run(pack_groups="auto", num_samples=4, prompt=64, new_tokens=16, prompts=8, accum=1):
    from types import SimpleNamespace

    return SimpleNamespace(
        rollout=SimpleNamespace(num_samples=num_samples, pack_groups=pack_groups, max_new_tokens=new_tokens),
        data=SimpleNamespace(max_prompt_length=prompt, batch_size=prompts), train=SimpleNamespace(grad_accum_steps=accum))


def test_packed_group_size_case_by_case():
    """Each reason ``packed_group_size`` has to leave the rows unpacked (1), to pack them (G,
    here 4, so a stray constant shows), or to refuse ``on``, one case each, worked by hand."""
    size = lambda run, minibatches=2, devices=1, attention="xla": packing.packed_group_size(  # noqa: E731
        run, dataclasses.replace(CONFIG, attention=attention), minibatches=minibatches, batch_devices=devices)
    assert packing.group_packing_pays(CONFIG, prompt_len=64, new_tokens=16, group=4)
    assert size(_run()) == 4 and size(_run("on")) == 4
    assert size(_run("off")) == 1  # off, though it would pay
    assert size(_run(num_samples=1)) == 1 and size(_run("on", num_samples=1)) == 1  # no group to share a prompt
    assert size(_run(), attention="cudnn") == 1  # a fused kernel: auto steps aside, on is refused
    with pytest.raises(ValueError, match="rollout.pack_groups=on needs a shared-prompt mask"):
        size(_run("on"), attention="cudnn")
    assert not packing.group_packing_pays(CONFIG, prompt_len=1, new_tokens=1024, group=4)
    assert size(_run(prompt=1, new_tokens=1024)) == 1  # it would not pay: auto leaves it,
    assert size(_run("on", prompt=1, new_tokens=1024)) == 4  # on packs anyway
    # 8 prompts x 4 samples over 2 minibatches x 4 micro-batches: 4 rows a micro-batch, one group
    assert size(_run(accum=4)) == 4
    # 8 prompts over 3 minibatches: no whole minibatches (though 8 x 4 // 3 // 1 = 10 rows)
    assert size(_run(), minibatches=3) == 1
    with pytest.raises(ValueError, match="needs whole groups of 4 in every minibatch and micro-batch; 8 prompts into "
                                         "3 minibatches x 1 micro-batches"):
        size(_run("on"), minibatches=3)
    # whole minibatches (4 prompts each) but micro-batches of 2 rows: half a group each
    assert size(_run(accum=8)) == 1
    with pytest.raises(ValueError, match="8 prompts into 2 minibatches x 8 micro-batches"):
        size(_run("on", accum=8))
    # 4 prompts in one minibatch: 4 packed rows (16 unpacked); on 8 devices only the unpacked split
    assert size(_run(prompts=4), minibatches=1, devices=8) == 1
    assert size(_run("on", prompts=4), minibatches=1, devices=8) == 4
    assert size(_run(prompts=4), minibatches=1, devices=4) == 4  # both split
    assert size(_run(prompts=4), minibatches=1, devices=32) == 4  # neither splits: packing still saves tokens


def test_packed_group_size_assumes_one_batch_device_unless_told():
    """Called without ``batch_devices``: one device. 1 prompt of 4 samples is 1 packed row (4
    unpacked), which packs on one device and not on two, where only the unpacked rows split."""
    run = _run(prompts=1)
    assert packing.packed_group_size(run, CONFIG, minibatches=1) == 4
    assert packing.packed_group_size(run, CONFIG, minibatches=1, batch_devices=2) == 1


def test_a_pair_packs_only_with_a_window_shorter_than_its_rows_and_a_maskable_attention():
    assert packing.pair_packs("xla", row_length=64, window=16)
    assert not packing.pair_packs("xla", row_length=64, window=64)  # no tokens saved
    assert packing.pair_packs("xla", row_length=64, window=63)
    assert not packing.pair_packs("xla", row_length=64, window=None)  # the head runs over every position
    assert not packing.pair_packs("splash", row_length=64, window=16)
    assert not packing.pair_packs("cudnn", row_length=64, window=16)


def test_groups_stay_unpacked_where_packed_rows_would_not_split_over_the_batch_devices():
    """``pack_groups: auto``: 8 prompts x 2 samples in 2 minibatches are 8 rows a minibatch,
    4 when packed. On 8 batch devices the 4 packed rows would run whole on every device
    (a row dimension that does not divide is not split), so the rows stay unpacked, one a
    device; on 4 devices (or 1) the packed rows split and packing stays. ``on`` packs
    regardless; and where neither divides, packing still saves tokens."""
    from alignax.trainers.api import load_config

    config = load_config("configs/tiny-ppo.yaml", ["data.batch_size=8"])
    model = ModelConfig.from_hf_config(
        dict(model_type="llama", vocab_size=49152, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=8192,
             rms_norm_eps=1e-5, tie_word_embeddings=True))

    def group(batch_devices, **rollout):
        c = config if not rollout else dataclasses.replace(config, rollout=dataclasses.replace(config.rollout,
                                                                                               **rollout))
        return packing.packed_group_size(c, model, minibatches=2, batch_devices=batch_devices)

    assert [group(n) for n in (1, 2, 4)] == [2, 2, 2]
    assert group(8) == 1
    assert group(8, pack_groups="on") == 2
    assert group(16) == 2  # 8 unpacked rows do not split over 16 either: packed, fewer tokens
