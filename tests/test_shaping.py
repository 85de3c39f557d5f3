"""alignax.rewards.shaping against per-sequence Python loops of the stated formulas."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alignax.rewards import shaping

TOL = dict(rtol=1e-6, atol=1e-6)
JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


def _maybe_jit(fn, jit, **static):
    bound = functools.partial(fn, **static)
    return jax.jit(bound) if jit else bound


LENGTHS = np.array([0, 5, 10, 11, 14, 15, 16, 17, 19, 20, 21, 100], np.int32)


@JIT
@pytest.mark.parametrize("mode", ["beyond", "around"])
def test_length_penalty(jit, mode):
    fn = _maybe_jit(shaping.length_penalty, jit, target_length=12, coef=0.01, mode=mode)
    out = fn(LENGTHS)
    ref = []
    for length in LENGTHS.tolist():
        if mode == "beyond":
            ref.append(-0.01 * (length - 12) if length > 12 else 0.0)
        else:
            ref.append(-0.01 * abs(length - 12))
    assert out.dtype == jnp.float32 and out.shape == LENGTHS.shape
    np.testing.assert_allclose(out, ref, **TOL)


def test_length_penalty_hand_case_and_errors():
    np.testing.assert_allclose(
        shaping.length_penalty(np.array([8, 10, 13]), target_length=10, coef=0.5), [0.0, 0.0, -1.5], **TOL
    )
    np.testing.assert_allclose(
        shaping.length_penalty(np.array([8, 10, 13]), target_length=10, coef=0.5, mode="around"),
        [-1.0, 0.0, -1.5],
        **TOL,
    )
    with pytest.raises(ValueError, match="beyond, around"):
        shaping.length_penalty(LENGTHS, target_length=10, coef=0.1, mode="below")
    with pytest.raises(ValueError, match="coef"):
        shaping.length_penalty(LENGTHS, target_length=10, coef=-0.1)
    with pytest.raises(ValueError, match="lengths must have rank 1"):
        shaping.length_penalty(LENGTHS[None], target_length=10, coef=0.1)


@JIT
def test_missing_eos_penalty(jit):
    eos = 2  # pad and EOS share the id, as in SmolLM2's tokenizer
    tokens = np.array(
        [
            [7, 8, 9, 4, 2, 2, 2],  # prompt 7 8, response 9 4 <eos>, then padding (also 2)
            [7, 8, 9, 4, 5, 6, 3],  # truncated: no EOS in the response
            [7, 8, 9, 2, 2, 2, 2],  # pad-id tokens only after the response: still missing
            [7, 8, 1, 0, 0, 0, 0],  # ends with the other stop id (1)
            [2, 2, 2, 2, 2, 2, 2],  # no response token at all
        ],
        np.int32,
    )
    mask = np.array(
        [
            [0, 0, 1, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 1, 1],
            [0, 0, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0, 0],
            [0, 0, 0, 0, 0, 0, 0],
        ],
        np.float32,
    )
    ref = []
    for b in range(tokens.shape[0]):
        response = [tokens[b, t] for t in range(tokens.shape[1]) if mask[b, t]]
        ref.append(0.0 if any(tok in (eos,) for tok in response) else -1.5)
    fn = _maybe_jit(shaping.missing_eos_penalty, jit, stop_token_ids=eos, penalty=1.5)
    np.testing.assert_allclose(fn(tokens, mask), ref, **TOL)
    np.testing.assert_allclose(fn(tokens, mask), [0.0, -1.5, -1.5, -1.5, -1.5], **TOL)
    several = _maybe_jit(shaping.missing_eos_penalty, jit, stop_token_ids=[eos, 1], penalty=1.5)
    np.testing.assert_allclose(several(tokens, mask), [0.0, -1.5, -1.5, 0.0, -1.5], **TOL)


def test_missing_eos_penalty_errors():
    tokens = np.zeros((2, 3), np.int32)
    with pytest.raises(ValueError, match="mask"):
        shaping.missing_eos_penalty(tokens, np.ones((2, 4)), stop_token_ids=2, penalty=1.0)
    with pytest.raises(ValueError, match="stop_token_ids"):
        shaping.missing_eos_penalty(tokens, np.ones((2, 3)), stop_token_ids=[], penalty=1.0)
    with pytest.raises(ValueError, match="penalty"):
        shaping.missing_eos_penalty(tokens, np.ones((2, 3)), stop_token_ids=2, penalty=-1.0)


def overlong_reference(length, max_length, cache_length):
    """DAPO eq. 13, case by case."""
    if length <= max_length - cache_length:
        return 0.0
    if length <= max_length:
        return ((max_length - cache_length) - length) / cache_length
    return -1.0


@JIT
def test_overlong_penalty(jit):
    fn = _maybe_jit(shaping.overlong_penalty, jit, max_length=20, cache_length=4)
    out = fn(LENGTHS)
    np.testing.assert_allclose(out, [overlong_reference(x, 20, 4) for x in LENGTHS.tolist()], **TOL)
    # Hand values: 16 -> 0, 17 -> -1/4, 19 -> -3/4, 20 -> -1, 21 -> -1.
    np.testing.assert_allclose(np.asarray(out)[[6, 7, 8, 9, 10]], [0.0, -0.25, -0.75, -1.0, -1.0], **TOL)
    scaled = _maybe_jit(shaping.overlong_penalty, jit, max_length=20, cache_length=4, scale=0.5)
    np.testing.assert_allclose(scaled(LENGTHS), 0.5 * np.asarray(out), **TOL)


def test_overlong_penalty_errors():
    with pytest.raises(ValueError, match="cache_length"):
        shaping.overlong_penalty(LENGTHS, max_length=20, cache_length=0)
    with pytest.raises(ValueError, match="cache_length"):
        shaping.overlong_penalty(LENGTHS, max_length=20, cache_length=21)


@JIT
def test_clip_rewards(jit):
    rewards = np.array([-3.0, -1.0, 0.2, 1.0, 7.5], np.float32)
    out = _maybe_jit(shaping.clip_rewards, jit, low=-1.0, high=1.0)(rewards)
    np.testing.assert_allclose(out, [-1.0, -1.0, 0.2, 1.0, 1.0], **TOL)
    with pytest.raises(ValueError, match="low <= high"):
        shaping.clip_rewards(rewards, low=1.0, high=-1.0)


@JIT
def test_composite_reward(jit):
    components = {
        "correct": np.array([1.0, 0.0, 1.0], np.float32),
        "format": np.array([1.0, 1.0, 0.0], np.float32),
        "overlong": np.array([0.0, -0.25, -1.0], np.float32),
    }
    weights = {"correct": 1.0, "format": 0.1, "overlong": 0.5}
    fn = jax.jit(shaping.composite_reward) if jit else shaping.composite_reward
    total, parts = fn(components, weights)
    ref = [sum(weights[k] * float(components[k][b]) for k in components) for b in range(3)]
    np.testing.assert_allclose(total, ref, **TOL)
    np.testing.assert_allclose(total, [1.1, -0.025, 0.5], **TOL)  # by hand
    assert set(parts) == set(components)
    np.testing.assert_allclose(parts["format"], [0.1, 0.1, 0.0], **TOL)


def test_composite_reward_errors_name_components():
    components = {"correct": np.ones(3, np.float32), "format": np.ones(3, np.float32)}
    with pytest.raises(ValueError, match="components without a weight: format"):
        shaping.composite_reward(components, {"correct": 1.0})
    with pytest.raises(ValueError, match="weights for absent components: lenght"):
        shaping.composite_reward(components, {"correct": 1.0, "format": 1.0, "lenght": 0.1})
    with pytest.raises(ValueError, match="format"):
        shaping.composite_reward({"correct": np.ones(3), "format": np.ones(4)}, {"correct": 1.0, "format": 1.0})
    with pytest.raises(ValueError, match="rank 1"):
        shaping.composite_reward({"correct": np.ones((3, 2))}, {"correct": 1.0})
