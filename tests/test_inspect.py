"""alignax.inspect on a tiny random Llama: token gradients against the trainers' own
composition and finite differences, the signs DPO and GRPO must give, group norms that
partition the global norm, one optimiser step, and the HTML rendering.

Finite differences run in float32 (the model's log-probs are float32 whatever the compute
dtype), central, with steps chosen so rounding stays near 1e-4 of the measured slope: the
tolerance is 2% relative.
"""

from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from alignax import advantages, inspect
from alignax.losses import dpo_loss, ppo_policy_loss, sft_loss, value_loss
from alignax.models import ModelConfig, RewardModel, create_model
from alignax.trainers.engine.optim import OptimConfig
from alignax.trainers.engine.setup import response_logps, sequence_logps
from tests.data.tiny_tokenizer import bpe_tokenizer

VOCAB, B, T, PROMPT = 32, 4, 10, 4
FD = dict(rtol=2e-2)


@functools.cache
def tiny(*, tied=True, scan=True, kind="causal_lm"):
    """One model per setting for the module (each compiles its forward and backward once)."""
    hf = dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=64,
              rms_norm_eps=1e-5, tie_word_embeddings=tied, eos_token_id=1, pad_token_id=1)
    return create_model(ModelConfig.from_hf_config(hf, scan_layers=scan), kind=kind, seed=0)


@functools.cache
def make_rows():
    """Four rows of one 4-token prompt; responses of 6, 3, 5 and 2 tokens, then padding.
    Token 31 appears once (row 0, position 6), so its table row is that position's input."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, VOCAB - 1, (B, T)).astype(np.int32)
    tokens[:, :PROMPT] = tokens[0, :PROMPT]
    tokens[0, 6] = VOCAB - 1
    lengths = np.array([6, 3, 5, 2])
    attention = (np.arange(T)[None] < PROMPT + lengths[:, None]).astype(np.int32)
    tokens = np.where(attention > 0, tokens, 1)
    response = attention * (np.arange(T)[None] >= PROMPT)
    return dict(tokens=tokens, attention_mask=attention, response_mask=response.astype(np.int32))


@pytest.fixture
def rows():
    return make_rows()


def mask_of(rows):
    return jnp.asarray(rows["response_mask"][:, 1:], jnp.float32)


def trainer_vjp(model, rows):
    """``(params, jitted (params, dL/d logps) -> (logps, dL/d params))`` with the log-probs
    the trainers compute (``response_logps``), independent of alignax.inspect."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    positions = jnp.maximum(jnp.cumsum(rows["attention_mask"], axis=1) - 1, 0)

    def logps_of(params):
        policy = nnx.merge(graphdef, params, rest)
        return response_logps(policy, rows["tokens"], positions, rows["attention_mask"], rows["response_mask"])[0]

    @jax.jit
    def run(params, cotangent):
        logps, vjp = jax.vjp(logps_of, params)
        return logps, vjp(cotangent)[0]

    return params, run


def grpo_loss(rows, rewards, *, old_logps=None, ref_logps=None, kl_coef=0.0):
    """GRPO's objective as the online trainer calls it: group advantages on every response
    token, PPO-clip, ``seq-mean-token-mean``; old log-probs = the policy's, gradient stopped
    (one update per rollout), unless given."""
    mask = mask_of(rows)
    adv = advantages.group_advantages(jnp.asarray([rewards], jnp.float32), method="grpo")[0][:, None] * mask

    def loss_fn(logps, values=None):
        old = jax.lax.stop_gradient(logps) if old_logps is None else old_logps
        kl = {} if ref_logps is None else dict(ref_logps=ref_logps, kl_coef=kl_coef, kl_kind="k3")
        return ppo_policy_loss(logps, old, adv, mask, aggregation="seq-mean-token-mean", **kl)

    return loss_fn, adv


def kl_grpo_loss(model, rows):
    """GRPO with the k3 KL in the loss against a reference 0.3 nats away per token, and
    constant old log-probs (finite differences cannot see a stop_gradient)."""
    logps, _ = inspect.forward_logps(model, rows["tokens"], rows["attention_mask"])
    old = np.asarray(logps)
    ref = old - 0.3 * np.random.default_rng(1).standard_normal(old.shape).astype(np.float32)
    return grpo_loss(rows, [1.0, 0.0, 0.0, 1.0], old_logps=old, ref_logps=ref, kl_coef=0.5)[0], logps


def test_logps_and_parameter_gradients_match_the_trainers_composition(rows):
    model = tiny()
    mask = mask_of(rows)
    logps, values = inspect.forward_logps(model, rows["tokens"], rows["attention_mask"])
    assert values is None
    params, run = trainer_vjp(model, rows)
    dlogps = jax.grad(lambda lp: sft_loss(lp, mask)[0])(logps)
    want_logps, want_grads = run(params, dlogps)
    np.testing.assert_allclose(logps, want_logps, rtol=1e-5, atol=1e-6)

    result = inspect.token_gradients(model, rows["tokens"], rows["attention_mask"],
                                     lambda lp, v: sft_loss(lp, mask), parameters=True)
    np.testing.assert_allclose(result.loss, sft_loss(want_logps, mask)[0], rtol=1e-6)
    for got, ref in zip(jax.tree.leaves(result.grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-7)
    # SFT token-mean: every response token pushed up by 1 / (number of response tokens), others 0.
    want_signal = np.zeros((B, T), np.float32)
    want_signal[:, 1:] = np.asarray(mask) / float(mask.sum())
    np.testing.assert_allclose(result.signal, want_signal, rtol=1e-6)
    np.testing.assert_allclose(result.logps[:, 1:], logps, rtol=1e-6)


def test_embedding_gradients_add_up_to_the_untied_table_gradient(rows):
    """With an untied LM head the table feeds only the input: its gradient's row ``v`` is
    the sum of the input-embedding gradients at the positions holding token ``v``."""
    model = tiny(tied=False)
    loss_fn, logps = kl_grpo_loss(model, rows)
    dlogps = jax.grad(lambda lp: loss_fn(lp)[0])(logps)
    _, dembed = inspect.logps_vjp(model, rows["tokens"], rows["attention_mask"], dlogps, parameters=False)
    params, run = trainer_vjp(model, rows)
    table_grad = np.asarray(run(params, dlogps)[1]["model"]["embed"].get_value())
    want = np.zeros_like(table_grad)
    np.add.at(want, rows["tokens"].reshape(-1), np.asarray(dembed).reshape(-1, dembed.shape[-1]))
    np.testing.assert_allclose(table_grad, want, rtol=1e-4, atol=1e-7)


def test_embedding_gradient_norm_matches_finite_differences(rows):
    """Token 31 sits at row 0, position 6 only: moving its (untied) table row by ``eps u``
    moves that one input embedding; the loss's slope along ``u`` is ``g . u`` (``|g|``
    along ``g``), with ``g`` the embedding gradient at that position."""
    model = tiny(tied=False)
    loss_fn, _ = kl_grpo_loss(model, rows)
    result = inspect.token_gradients(model, rows["tokens"], rows["attention_mask"], loss_fn)
    logps, _ = inspect.forward_logps(model, rows["tokens"], rows["attention_mask"])
    dlogps = jax.grad(lambda lp: loss_fn(lp)[0])(logps)
    _, dembed = inspect.logps_vjp(model, rows["tokens"], rows["attention_mask"], dlogps, parameters=False)
    g = np.asarray(dembed[0, 6], np.float64)
    assert np.linalg.norm(g) == pytest.approx(result.embedding_grad_norm[0, 6], rel=1e-5)

    params, run = trainer_vjp(model, rows)
    zero = jnp.zeros_like(dlogps)
    table = params["model"]["embed"].get_value()
    eps = 3e-3 * float(jnp.linalg.norm(table[VOCAB - 1]))
    for direction in (g, np.random.default_rng(2).standard_normal(g.shape)):
        direction = direction / np.linalg.norm(direction)
        losses = []
        for sign in (1.0, -1.0):
            moved = jax.tree.map(lambda x: x, params)
            moved["model"]["embed"].set_value(table.at[VOCAB - 1].add(sign * eps * jnp.asarray(direction, table.dtype)))
            losses.append(float(loss_fn(run(moved, zero)[0])[0]))
        np.testing.assert_allclose((losses[0] - losses[1]) / (2 * eps), g @ direction, **FD)


def test_signal_matches_finite_differences_of_the_log_probs(rows):
    """Nudging one token's log-prob input by ``±eps`` moves the loss by ``∓ 2 eps signal``
    (GRPO with the k3 KL in the loss: not linear in the log-probs)."""
    model = tiny()
    loss_fn, logps = kl_grpo_loss(model, rows)
    result = inspect.token_gradients(model, rows["tokens"], rows["attention_mask"], loss_fn)
    eps = 1e-2
    for b, t in [(0, PROMPT), (1, PROMPT + 1), (2, PROMPT + 4), (3, PROMPT)]:  # t indexes tokens
        bumped = [float(loss_fn(logps.at[b, t - 1].add(s * eps))[0]) for s in (1.0, -1.0)]
        np.testing.assert_allclose(-(bumped[0] - bumped[1]) / (2 * eps), result.signal[b, t], rtol=1e-2, atol=1e-5)
    assert np.all(result.signal[rows["response_mask"] == 0] == 0)


def test_dpo_pushes_chosen_tokens_up_and_rejected_down(rows):
    """Pairs (row 0 chosen, row 1 rejected) and (row 2, row 3). Every token of a response
    gets the same push: ``beta * sigmoid(-beta h) / num_pairs`` (Rafailov et al. 2023)."""
    model = tiny()
    mask = mask_of(rows)
    beta = 0.1
    logps, _ = inspect.forward_logps(model, rows["tokens"], rows["attention_mask"])
    ref_seq, _ = sequence_logps(logps + 0.05 * jnp.arange(B)[:, None], mask)  # a reference that differs

    def loss_fn(logps, values):
        seq, lengths = sequence_logps(logps, mask)
        return dpo_loss(seq[0::2], seq[1::2], ref_seq[0::2], ref_seq[1::2], lengths[0::2], lengths[1::2], beta=beta)

    result = inspect.token_gradients(model, rows["tokens"], rows["attention_mask"], loss_fn)
    response = rows["response_mask"] > 0
    seq = np.asarray(sequence_logps(logps, mask)[0], np.float64)
    h = (seq[0::2] - np.asarray(ref_seq[0::2])) - (seq[1::2] - np.asarray(ref_seq[1::2]))
    push = beta / (1 + np.exp(beta * h)) / 2
    for pair in range(2):
        chosen, rejected = result.signal[2 * pair], result.signal[2 * pair + 1]
        np.testing.assert_allclose(chosen[response[2 * pair]], push[pair], rtol=1e-5)
        np.testing.assert_allclose(rejected[response[2 * pair + 1]], -push[pair], rtol=1e-5)
    assert np.all(result.signal[~response] == 0)
    assert np.all(result.embedding_grad_norm[rows["attention_mask"] > 0][:-1] >= 0)


@pytest.mark.parametrize("rewards", [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.5, 0.2]])
def test_grpo_signal_follows_the_advantage_sign(rows, rewards):
    model = tiny()
    loss_fn, adv = grpo_loss(rows, rewards)
    result = inspect.token_gradients(model, rows["tokens"], rows["attention_mask"], loss_fn)
    response = rows["response_mask"] > 0
    adv_by_token = np.zeros((B, T), np.float32)
    adv_by_token[:, 1:] = np.asarray(adv)
    np.testing.assert_array_equal(np.sign(result.signal[response]), np.sign(adv_by_token[response]))
    # seq-mean-token-mean at ratio 1: A_i / (|response_i| * number of rows), per token.
    lengths = response.sum(1, keepdims=True)
    np.testing.assert_allclose(result.signal[response], (adv_by_token / lengths / B)[response], rtol=1e-5)


def test_value_loss_reaches_the_trunk_not_the_signal(rows):
    """A ``policy_value`` model: ``dL/d values`` flows into the embeddings; the signal
    (``-dL/d log pi``) is the policy loss's alone."""
    model = tiny(kind="policy_value")
    mask = mask_of(rows)
    logps, values = inspect.forward_logps(model, rows["tokens"], rows["attention_mask"])
    np.testing.assert_array_equal(values, 0.0)  # the value head starts at zero
    scores = jnp.array([1.0, 0.0, 0.0, 1.0])
    adv, returns = advantages.gae(advantages.token_rewards(scores, mask), values, mask, gamma=1.0, lam=0.95)

    def policy_only(logps, values):
        return ppo_policy_loss(logps, jax.lax.stop_gradient(logps), adv, mask)

    def with_critic(logps, values):
        loss, metrics = policy_only(logps, values)
        v_loss, _ = value_loss(values, jax.lax.stop_gradient(values), returns, mask, clip_eps=0.2)
        return loss + 0.5 * v_loss, metrics

    plain = inspect.token_gradients(model, rows["tokens"], rows["attention_mask"], policy_only, parameters=True)
    both = inspect.token_gradients(model, rows["tokens"], rows["attention_mask"], with_critic, parameters=True)
    np.testing.assert_allclose(plain.signal, both.signal, rtol=1e-6)
    assert inspect.group_norms(plain.grads)["heads"] == 0.0
    assert inspect.group_norms(both.grads)["heads"] > 0.0
    # The zero-initialised value head passes no gradient into the trunk yet.
    np.testing.assert_allclose(plain.embedding_grad_norm, both.embedding_grad_norm, rtol=1e-6)


@functools.cache
def sft_grads(scan):
    rows = make_rows()
    mask = mask_of(rows)
    result = inspect.token_gradients(tiny(scan=scan), rows["tokens"], rows["attention_mask"],
                                     lambda lp, v: sft_loss(lp, mask), parameters=True)
    return result.grads


@pytest.mark.parametrize("by", inspect.NORM_KEYS)
def test_group_norms_partition_the_global_norm_scanned_or_not(by):
    """The same weights scanned or not give the same per-layer numbers under the same names."""
    norms = []
    for scan in (False, True):
        grads = sft_grads(scan)
        groups = inspect.group_norms(grads, by=by)
        total = float(optax.tree.norm(grads))
        assert np.sqrt(sum(v * v for v in groups.values())) == pytest.approx(total, rel=1e-5)
        norms.append(groups)
    assert norms[0].keys() == norms[1].keys()
    for name in norms[0]:
        assert norms[1][name] == pytest.approx(norms[0][name], rel=1e-4, abs=1e-9), name
    if by == "layer_group":
        assert {(0, "attention"), (1, "mlp"), (None, "embeddings"), (None, "norms")} <= set(norms[0])


def test_parameter_groups_by_path_names():
    group = inspect.parameter_group
    assert group(("model", "embed")) == group(("model", "pos_embed")) == "embeddings"
    assert group(("model", "layers", 3, "attn", "q_kernel")) == "attention"
    assert group(("model", "layers", 3, "attn", "q_norm", "scale")) == "norms"
    assert group(("model", "layers", "mlp_norm", "scale")) == group(("model", "final_norm", "scale")) == "norms"
    assert group(("model", "layers", 0, "mlp", "down_kernel")) == "mlp"
    assert group(("model", "layers", 0, "attn", "q_lora_a")) == "lora"
    assert group(("lm_head",)) == group(("value_head",)) == group(("score",)) == "heads"
    assert group(("something",)) == "other"
    with pytest.raises(ValueError, match="by"):
        inspect.group_norms({}, by="module")


def test_optimiser_updates_and_update_to_weight_ratios(rows):
    model = tiny()
    params = nnx.state(model, nnx.Param)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.01), params)
    sgd = OptimConfig(name="sgd", learning_rate=0.5, schedule="constant", max_grad_norm=None)
    updates = inspect.optimiser_updates(params, grads, sgd)
    for u, g in zip(jax.tree.leaves(updates), jax.tree.leaves(grads)):
        np.testing.assert_allclose(u, -0.5 * g, rtol=1e-6)
    ratios = inspect.update_to_weight_ratios(params, updates, by="group")
    u, w = inspect.group_norms(updates, by="group"), inspect.group_norms(params, by="group")
    assert ratios == pytest.approx({k: u[k] / w[k] for k in w})
    # AdamW's first step moves every weight by about the learning rate (m / sqrt(v) = sign(g)).
    adam = inspect.optimiser_updates(params, grads, OptimConfig(learning_rate=1e-3, max_grad_norm=None))
    for leaf in jax.tree.leaves(adam):
        np.testing.assert_allclose(leaf, -1e-3, rtol=1e-3)


def test_only_models_with_an_lm_head():
    config = ModelConfig.from_hf_config(dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                             intermediate_size=64))
    reward_model = nnx.eval_shape(lambda: RewardModel(config, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match="causal_lm or policy_value"):
        inspect.forward_logps(reward_model, np.zeros((1, 4), np.int32))
    with pytest.raises(ValueError, match=r"expected \[B, T-1\]"):
        inspect.logps_vjp(tiny(), np.zeros((2, 5), np.int32), None, np.zeros((2, 5), np.float32))


def test_completion_rows_share_the_prompt_and_train_the_end_of_turn():
    tokenizer = bpe_tokenizer()
    rows = inspect.completion_rows(tokenizer, "what is 2 + 2?", ["<answer>4</answer>", "it is 5"])
    prompt = np.argmax(rows["response_mask"] > 0, axis=1)
    assert prompt[0] == prompt[1]
    np.testing.assert_array_equal(rows["tokens"][0, : prompt[0]], rows["tokens"][1, : prompt[1]])
    for b in range(2):
        last = rows["attention_mask"][b].sum() - 1
        assert rows["tokens"][b, last] == tokenizer.eos_token_id and rows["response_mask"][b, last] == 1
    assert rows["attention_mask"].sum(1).max() == rows["tokens"].shape[1]
    wide = inspect.completion_rows(tokenizer, "what is 2 + 2?", ["4"], max_length=128)
    assert wide["tokens"].shape == (1, 128)
    text = "".join(inspect.token_strings(tokenizer, rows["tokens"][0][rows["attention_mask"][0] > 0]))
    assert "<answer>4</answer>" in text and "what is 2 + 2?" in text


def test_tokens_html_escapes_and_colours():
    out = inspect.tokens_html(["<b>", "a&b", "\n", "x", "pad"], [1.0, -0.5, 0.0, -2.0, 9.0],
                              mask=[1, 1, 1, 1, 0], label="DPO <rejected>")
    assert "<b>" not in out.replace('<div style="font-weight:bold">', "")
    assert "&lt;b&gt;" in out and "a&amp;b" in out and "DPO &lt;rejected&gt;" in out
    spans = out.split("<span")[1:]
    assert len(spans) == 5
    # scale = max |value| under the mask = 2: +1 is half-way to blue, -0.5 a quarter to red, -2 full red.
    assert "background:rgb(144, 179, 214)" in spans[0] and 'title="+1"' in spans[0]
    assert "background:rgb(236, 197, 202)" in spans[1]
    assert "background:rgb(255, 255, 255)" in spans[2]
    assert "background:rgb(178, 24, 43)" in spans[3] and "color:#fff" in spans[3]
    assert "background" not in spans[4] and "color:#999" in spans[4]  # masked: uncoloured
    assert "scale ±2" in out
    fixed = inspect.tokens_html(["a"], [1.0], scale=4.0)
    assert "rgb(200, 217, 234)" in fixed
    with pytest.raises(ValueError, match="must agree"):
        inspect.tokens_html(["a", "b"], [1.0])


def test_plot_helpers_draw():
    import matplotlib

    matplotlib.use("Agg")
    ax = inspect.plot_token_values(["a", "\n", "c"], {"chosen": [1, 2, 3], "rejected": [-1, 0, 1]}, title="t")
    assert len(ax.patches) == 6
    ax = inspect.plot_layer_norms({(0, "attention"): 1.0, (1, "attention"): 2.0, (None, "embeddings"): 3.0})
    assert len(ax.lines) == 2
