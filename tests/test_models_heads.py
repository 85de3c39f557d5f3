"""Reward, value and policy+value heads: shapes, positions, and transformers parity.

The reward head is checked against ``LlamaForSequenceClassification`` on the same weights,
with right and left padding (transformers finds the last non-pad token through the pad
id; we find it through the mask).
"""

from __future__ import annotations

import numpy as np
import pytest

import transformers
from flax import nnx

import jax.numpy as jnp

from alignax.models import (
    CausalLM,
    PolicyValueModel,
    RewardModel,
    ValueModel,
    from_hf_state_dict,
    from_pretrained,
    last_token_index,
    save_pretrained,
    to_hf_state_dict,
)

torch = pytest.importorskip("torch", reason="the PyTorch reference (pinned test extras; not in `make test-latest`)")

PAD = 0
CFG = dict(
    model_type="llama",
    vocab_size=40,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
    pad_token_id=PAD,
    num_labels=1,
)


@pytest.fixture(scope="module")
def reward_checkpoint():
    torch.manual_seed(0)
    hf = transformers.LlamaForSequenceClassification(
        transformers.LlamaConfig(**{k: v for k, v in CFG.items() if k != "model_type"})
    ).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    sd = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    return hf, sd


def _padded(side: str):
    rng = np.random.RandomState(3)
    tokens = rng.randint(1, 40, (3, 7))  # never the pad id
    lengths = [7, 4, 2]
    mask = np.zeros((3, 7), np.int64)
    for b, n in enumerate(lengths):
        if side == "right":
            mask[b, :n] = 1
        else:
            mask[b, 7 - n :] = 1
    tokens = np.where(mask == 1, tokens, PAD)
    return tokens, mask


@pytest.mark.parametrize("side", ["right", "left"])
def test_reward_matches_transformers_sequence_classification(reward_checkpoint, side):
    hf, sd = reward_checkpoint
    rm = from_hf_state_dict(CFG, sd, kind="reward")
    assert isinstance(rm, RewardModel)
    tokens, mask = _padded(side)
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    with torch.no_grad():
        ref = hf(
            input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(positions)
        ).logits.numpy()[:, 0]
    out = nnx.jit(lambda m, t, p, a: m(t, p, a))(rm, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))
    assert out.rewards.shape == (3,) and out.rewards.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out.rewards), ref, atol=1e-4)
    want_last = [6, 3, 1] if side == "right" else [6, 6, 6]
    assert last_token_index(jnp.asarray(mask)).tolist() == want_last


def test_reward_export_loads_in_transformers(reward_checkpoint, tmp_path):
    _, sd = reward_checkpoint
    rm = from_hf_state_dict(CFG, sd, kind="reward")
    save_pretrained(rm, tmp_path)
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert type(loaded).__name__ == "LlamaForSequenceClassification"
    tokens, mask = _padded("right")
    with torch.no_grad():
        theirs = loaded(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask)).logits.numpy()[:, 0]
    ours = np.asarray(rm(jnp.asarray(tokens), None, jnp.asarray(mask)).rewards)
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


def test_value_heads(reward_checkpoint, tmp_path):
    _, sd = reward_checkpoint
    tokens, mask = _padded("left")
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)

    # critic initialised from the reward model: value at the last token is the reward
    rm = from_hf_state_dict(CFG, sd, kind="reward")
    rewards = rm(tokens, None, mask).rewards
    for critic in (ValueModel.from_reward_model(rm), from_hf_state_dict(CFG, sd, kind="value")):
        values = critic(tokens, None, mask).values
        assert values.shape == (3, 7) and values.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(values[:, -1]), np.asarray(rewards), atol=1e-5)
        assert np.abs(np.asarray(values[:, :-1])).max() > 0  # one value per token, not one per row

    # zero-initialised heads: every value is 0
    lm_sd = {k: v for k, v in sd.items() if k != "score.weight"}
    lm_sd["lm_head.weight"] = np.random.RandomState(0).randn(40, 32).astype(np.float32) * 0.05
    fresh = ValueModel(rm.config, rngs=nnx.Rngs(0))
    assert float(jnp.abs(fresh(tokens, None, mask).values).max()) == 0.0
    # a critic or a reward model started from an LM checkpoint: the LM head is dropped
    critic = from_hf_state_dict(CFG, lm_sd, kind="value")
    assert float(jnp.abs(critic(tokens, None, mask).values).max()) == 0.0
    with pytest.raises(ValueError, match="pass new_head=True for a fresh head"):
        from_hf_state_dict(CFG, lm_sd, kind="reward")
    new_rm = from_hf_state_dict(CFG, lm_sd, kind="reward", new_head=True, seed=3)
    np.testing.assert_array_equal(np.asarray(new_rm.model.embed[...]), lm_sd["model.embed_tokens.weight"])
    assert new_rm.score[...].shape == (32, 1) and 0 < float(jnp.std(new_rm.score[...])) < 0.5

    # policy + value on one trunk: logits are the plain LM's, the head is separate
    pv = from_hf_state_dict(CFG, lm_sd, kind="policy_value")
    lm = from_hf_state_dict(CFG, lm_sd)
    assert isinstance(pv, PolicyValueModel) and isinstance(lm, CausalLM)
    out = pv(tokens, None, mask)
    np.testing.assert_array_equal(np.asarray(out.logits), np.asarray(lm(tokens, None, mask).logits))
    assert out.values.shape == (3, 7) and float(jnp.abs(out.values).max()) == 0.0
    pv.init_value_head_from(rm)
    np.testing.assert_array_equal(np.asarray(pv.value_head[...]), np.asarray(rm.score[...]))
    h = pv(tokens, None, mask)
    np.testing.assert_allclose(
        np.asarray(h.values), np.asarray(jnp.einsum("btd,d->bt", h.hidden, rm.score[...][:, 0])), atol=1e-5
    )
    # saved policy+value comes back with its value head
    save_pretrained(pv, tmp_path)
    back = from_pretrained(tmp_path, kind="policy_value")
    np.testing.assert_array_equal(np.asarray(back.value_head[...]), np.asarray(pv.value_head[...]))
    assert "score.weight" not in to_hf_state_dict(lm)[1]
