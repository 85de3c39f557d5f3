"""alignax.advantages against NumPy loops written from the papers' formulas, and hand cases."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from alignax import advantages as adv_lib
from tests.support import references

TOL = dict(rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- references


def process_reference(step_rewards, step_mask, mask, group_ids, eps=1e-6, ddof=1):
    """DeepSeekMath §4.1.3: normalise the pooled step rewards of a group, sum the later ones."""
    step_rewards, step_mask, mask = (np.asarray(a, np.float64) for a in (step_rewards, step_mask, mask))
    bsz, length = step_rewards.shape
    steps: dict[int, list[tuple[int, int]]] = {}
    for b in range(bsz):
        for t in range(length):
            if step_mask[b, t] and mask[b, t]:
                steps.setdefault(int(group_ids[b]), []).append((b, t))
    normed = {}
    for members in steps.values():
        xs = [step_rewards[b, t] for b, t in members]
        m, s = references.mean(xs), references.variance(xs, ddof) ** 0.5
        for (b, t), x in zip(members, xs):
            normed[(b, t)] = 0.0 if (len(xs) < 2 or max(xs) == min(xs)) else (x - m) / (s + eps)
    out = np.zeros((bsz, length))
    for b in range(bsz):
        for t in range(length):
            if mask[b, t]:
                out[b, t] = sum(v for (bb, tt), v in normed.items() if bb == b and tt >= t)
    return out


# --------------------------------------------------------------------------- fixtures


def _ragged_batch(seed=0):
    """Rows: prompt+response+padding, response from t=0, full row, one token, empty."""
    rng = np.random.default_rng(seed)
    mask = np.zeros((5, 9), np.float32)
    mask[0, 3:7] = 1  # prompt of 3 tokens, 4 response tokens, 2 padding
    mask[1, 0:5] = 1  # response from t = 0
    mask[2, :] = 1  # no padding at all
    mask[3, 8] = 1  # one response token at the very end
    # row 4: no response token
    rewards = rng.normal(size=mask.shape).astype(np.float32)
    values = rng.normal(size=mask.shape).astype(np.float32)
    return rewards, values, mask


# --------------------------------------------------------------------------- gae


class GAEVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("mc", 1.0, 1.0), ("gae", 0.99, 0.95), ("td", 0.9, 0.0))
    def test_gae_matches_backward_recursion(self, gamma, lam):
        rewards, values, mask = _ragged_batch()
        advantages, returns = self.variant(functools.partial(adv_lib.gae, gamma=gamma, lam=lam))(rewards, values, mask)
        ref_adv, ref_ret = references.gae(rewards, values, mask, gamma, lam)
        chex.assert_type([advantages, returns], jnp.float32)
        chex.assert_shape([advantages, returns], mask.shape)
        np.testing.assert_allclose(advantages, ref_adv, **TOL)
        np.testing.assert_allclose(returns, ref_ret, **TOL)
        assert np.all(np.asarray(advantages)[mask == 0] == 0.0)
        assert np.all(np.asarray(returns)[mask == 0] == 0.0)


def test_gae_hand_cases_td_error_and_return_minus_value():
    # One prompt token, 3 response tokens, 2 padding tokens; garbage off the response.
    mask = np.array([[0, 1, 1, 1, 0, 0]], np.float32)
    rewards = np.array([[9.0, 0.0, 0.0, 1.0, 5.0, -3.0]], np.float32)
    values = np.array([[7.0, 0.5, 0.6, 0.7, 4.0, 2.0]], np.float32)
    # lambda = 0: the TD error. 0 + .9*.6 - .5 = .04; 0 + .9*.7 - .6 = .03; 1 + .9*0 - .7 = .3
    advantages, returns = adv_lib.gae(rewards, values, mask, gamma=0.9, lam=0.0)
    np.testing.assert_allclose(advantages, [[0, 0.04, 0.03, 0.3, 0, 0]], **TOL)
    np.testing.assert_allclose(returns, [[0, 0.54, 0.63, 1.0, 0, 0]], **TOL)
    # gamma = lambda = 1: return-to-go (1 at every response token) minus value.
    advantages, returns = adv_lib.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(advantages, [[0, 0.5, 0.4, 0.3, 0, 0]], **TOL)
    np.testing.assert_allclose(returns, [[0, 1.0, 1.0, 1.0, 0, 0]], **TOL)


def test_gae_masked_positions_do_not_leak():
    rewards, values, mask = _ragged_batch(seed=1)
    clean_adv, clean_ret = adv_lib.gae(rewards, values, mask, gamma=0.97, lam=0.9)
    dirty_r = np.where(mask > 0, rewards, np.nan).astype(np.float32)
    dirty_v = np.where(mask > 0, values, 1e30).astype(np.float32)
    adv, ret = jax.jit(functools.partial(adv_lib.gae, gamma=0.97, lam=0.9))(dirty_r, dirty_v, mask)
    np.testing.assert_array_equal(adv, clean_adv)
    np.testing.assert_array_equal(ret, clean_ret)


def test_gae_skips_a_masked_gap_inside_the_response():
    # Multi-turn: tokens 3..4 are an observation (masked); the recursion jumps over them.
    mask = np.array([[1, 1, 1, 0, 0, 1, 1, 0]], np.float32)
    rng = np.random.default_rng(3)
    rewards = rng.normal(size=mask.shape).astype(np.float32)
    values = rng.normal(size=mask.shape).astype(np.float32)
    advantages, _ = adv_lib.gae(rewards, values, mask, gamma=0.95, lam=0.9)
    np.testing.assert_allclose(advantages, references.gae(rewards, values, mask, 0.95, 0.9)[0], **TOL)


def test_gae_traced_hyperparameters_and_no_gradient():
    rewards, values, mask = _ragged_batch(seed=2)

    @jax.jit
    def run(gamma, lam, values):
        return adv_lib.gae(rewards, values, mask, gamma=gamma, lam=lam)

    advantages, _ = run(jnp.float32(0.99), jnp.float32(0.95), values)
    np.testing.assert_allclose(advantages, references.gae(rewards, values, mask, 0.99, 0.95)[0], **TOL)
    # Advantages and returns are targets: no gradient reaches the critic through them.
    grad = jax.grad(lambda v: jnp.sum(run(0.99, 0.95, v)[1]))(jnp.asarray(values))
    assert np.all(np.asarray(grad) == 0.0)


def test_advantages_are_float32_with_x64_on_and_float64_inputs():
    """Under ``jax.enable_x64`` float64 inputs (and a float64 gamma and lambda) still give the
    documented float32: the inputs are cast, the scan's carry and the group counts are float32."""
    rewards, values, mask = (np.asarray(a, np.float64) for a in _ragged_batch(seed=4))
    with jax.enable_x64(True):
        advantages, returns = adv_lib.gae(rewards, values, mask, gamma=np.float64(0.9), lam=np.float64(0.8))
        scores = adv_lib.token_rewards(rewards[:, 0], mask, kl_penalty=values)
        groups = adv_lib.group_advantages(rewards[:4], method="grpo")
        steps = adv_lib.process_advantages(rewards, (values > 0).astype(np.float64), mask)
    for out in (advantages, returns, scores, groups, steps):
        assert out.dtype == jnp.float32
    np.testing.assert_allclose(advantages, references.gae(rewards, values, mask, 0.9, 0.8)[0], **TOL)


def test_gae_errors_name_the_argument():
    rewards, values, mask = _ragged_batch()
    with pytest.raises(ValueError, match="values"):
        adv_lib.gae(rewards, values[:, :-1], mask, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="rewards must have rank 2"):
        adv_lib.gae(rewards[0], values[0], mask[0], gamma=1.0, lam=1.0)
    with pytest.raises(TypeError):
        adv_lib.gae(rewards, values, mask, 1.0, 1.0)  # hyper-parameters are keyword-only


# --------------------------------------------------------------------------- token rewards


def token_rewards_reference(scores, mask, kl):
    out = np.zeros(mask.shape)
    for b in range(mask.shape[0]):
        idx = [t for t in range(mask.shape[1]) if mask[b, t]]
        for t in idx:
            out[b, t] -= 0.0 if kl is None else kl[b, t]
        if idx:
            out[b, idx[-1]] += scores[b]
    return out


class TokenRewardsVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_token_rewards(self):
        _, _, mask = _ragged_batch()
        rng = np.random.default_rng(4)
        scores = rng.normal(size=mask.shape[0]).astype(np.float32)
        kl = rng.normal(size=mask.shape).astype(np.float32)
        fn = self.variant(adv_lib.token_rewards)
        np.testing.assert_allclose(fn(scores, mask, kl_penalty=kl), token_rewards_reference(scores, mask, kl), **TOL)
        np.testing.assert_allclose(fn(scores, mask), token_rewards_reference(scores, mask, None), **TOL)
        assert np.all(np.asarray(fn(scores, mask, kl_penalty=kl))[4] == 0.0)  # the empty row


def test_token_rewards_errors():
    mask = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="scores"):
        adv_lib.token_rewards(np.ones(3, np.float32), mask)
    with pytest.raises(ValueError, match="kl_penalty"):
        adv_lib.token_rewards(np.ones(2, np.float32), mask, kl_penalty=np.ones((2, 4), np.float32))


# --------------------------------------------------------------------------- group advantages


def _pg_rewards():
    # 4 prompts x 6 samples: mixed, all-equal, all-ones, mixed. Six float32 copies of 0.9
    # average to 0.9 + 6e-8, so only an exact zero-variance rule gives exact zeros there.
    return np.array(
        [[1.0, 0.0, 1.0, 1.0, 0.0, 1.0], [0.9] * 6, [1.0] * 6, [0.3, -1.2, 2.5, 0.7, 0.0, 1.1]], np.float32
    )


METHOD_CASES = [
    ("grpo", {}),
    ("grpo", {"unbiased_std": False}),
    ("dr_grpo", {}),
    ("rloo", {}),
    ("reinforce_pp", {}),
    ("reinforce_pp", {"subtract_group_mean": True}),
]
NAMED_METHOD_CASES = [
    ("_".join([method, *(f"{k}_{v}" for k, v in kwargs.items())]), method, kwargs) for method, kwargs in METHOD_CASES
]


def _ref_kwargs(kwargs):
    return {"ddof": 0 if kwargs.get("unbiased_std") is False else 1,
            "subtract_group_mean": kwargs.get("subtract_group_mean", False)}


class GroupAdvantagesVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(NAMED_METHOD_CASES)
    def test_group_advantages_pg_layout(self, method, kwargs):
        rewards = _pg_rewards()
        out = self.variant(functools.partial(adv_lib.group_advantages, method=method, **kwargs))(rewards)
        ids = np.repeat(np.arange(4), 6)
        want = references.group_advantages(rewards.reshape(-1), ids, method, **_ref_kwargs(kwargs)).reshape(4, 6)
        chex.assert_type(out, jnp.float32)
        chex.assert_shape(out, rewards.shape)
        np.testing.assert_allclose(out, want, **TOL)
        if method != "reinforce_pp" or kwargs:
            # Zero-variance groups: exactly zero, not eps-noise.
            assert np.all(np.asarray(out)[1:3] == 0.0)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(NAMED_METHOD_CASES)
    def test_group_advantages_flat_unsorted_unequal_groups(self, method, kwargs):
        # Groups of sizes 3, 1, 4, 3 (and an empty group id 4), interleaved; group 3 is three
        # copies of 0.9, whose float32 mean is not 0.9.
        group_ids = np.array([2, 0, 3, 2, 1, 0, 2, 3, 0, 2, 3], np.int32)
        rewards = np.array([0.5, 1.0, 0.9, -0.3, 4.0, 0.0, 1.5, 0.9, 1.0, 0.9, 0.9], np.float32)
        fn = self.variant(functools.partial(adv_lib.group_advantages, method=method, num_groups=5, **kwargs))
        out = fn(rewards, group_ids=group_ids)
        want = references.group_advantages(rewards, group_ids, method, **_ref_kwargs(kwargs))
        np.testing.assert_allclose(out, want, **TOL)
        if method != "reinforce_pp":
            assert out[4] == 0.0  # the singleton group
            assert out[2] == 0.0 and out[7] == 0.0 and out[10] == 0.0  # group 3: equal rewards

    @chex.variants(with_jit=True, without_jit=True)
    def test_remax_hand_case(self):
        fn = self.variant(functools.partial(adv_lib.group_advantages, method="remax"))
        out = fn(np.array([1.0, 0.0], np.float32), baseline=np.array([0.6, 0.6], np.float32))
        np.testing.assert_allclose(out, [0.4, -0.6], **TOL)
        rewards = _pg_rewards()
        baseline = np.random.default_rng(6).normal(size=rewards.shape).astype(np.float32)
        np.testing.assert_allclose(fn(rewards, baseline=baseline), rewards.astype(np.float64) - baseline, **TOL)


@pytest.mark.parametrize("method,kwargs", METHOD_CASES, ids=lambda x: str(x))
def test_group_advantages_flat_shuffled_equals_pg_permuted(method, kwargs):
    rewards = _pg_rewards()
    pg = np.asarray(adv_lib.group_advantages(rewards, method=method, **kwargs)).reshape(-1)
    perm = np.random.default_rng(5).permutation(rewards.size)
    group_ids = np.repeat(np.arange(4), 6)[perm]
    flat = adv_lib.group_advantages(
        rewards.reshape(-1)[perm], method=method, group_ids=group_ids, num_groups=4, **kwargs
    )
    np.testing.assert_allclose(flat, pg[perm], **TOL)


def test_group_hand_cases():
    # GRPO on [1, 0, 1, 1]: mean .75, unbiased std .5 -> (.25/.5, -.75/.5) = (.5, -1.5).
    out = adv_lib.group_advantages(np.array([[1.0, 0.0, 1.0, 1.0]], np.float32), method="grpo", eps=0.0)
    np.testing.assert_allclose(out, [[0.5, -1.5, 0.5, 0.5]], **TOL)
    # RLOO: 1 - 2/3 = 1/3; 0 - 1 = -1.
    out = adv_lib.group_advantages(np.array([[1.0, 0.0, 1.0, 1.0]], np.float32), method="rloo")
    np.testing.assert_allclose(out, [[1 / 3, -1.0, 1 / 3, 1 / 3]], **TOL)
    # A group of two: the unbiased std divides by n - 1 = 1, sqrt(.5); RLOO's baseline is the
    # other sample, 2/1 * (r - mu).
    out = adv_lib.group_advantages(np.array([[1.0, 0.0]], np.float32), method="grpo", eps=0.0)
    np.testing.assert_allclose(out, [[0.5 / 0.5**0.5, -0.5 / 0.5**0.5]], **TOL)
    out = adv_lib.group_advantages(np.array([[1.0, 0.0]], np.float32), method="rloo")
    np.testing.assert_allclose(out, [[1.0, -1.0]], **TOL)
    # [P, G] with more prompts than samples: one group per row, P of them.
    out = adv_lib.group_advantages(np.array([[1.0, 0.0], [0.0, 2.0], [5.0, 1.0]], np.float32), method="dr_grpo")
    np.testing.assert_allclose(out, [[0.5, -0.5], [-1.0, 1.0], [2.0, -2.0]], **TOL)
    # Plain REINFORCE++ on flat rewards needs no groups: it whitens the whole batch.
    flat = _pg_rewards().reshape(-1)
    want = references.group_advantages(flat, np.zeros(flat.size, int), "reinforce_pp")
    np.testing.assert_allclose(adv_lib.group_advantages(flat, method="reinforce_pp"), want, **TOL)
    # Groups of one sample give 0 for grpo, dr_grpo and rloo (no NaN from n - 1 = 0).
    for method in ("grpo", "dr_grpo", "rloo"):
        out = adv_lib.group_advantages(np.array([[3.0], [-2.0]], np.float32), method=method)
        assert np.all(np.asarray(out) == 0.0)


def test_group_advantages_no_gradient_and_no_nan():
    rewards = jnp.full((3, 6), 0.9)  # every group has zero variance
    for method, kwargs in METHOD_CASES:
        out = adv_lib.group_advantages(rewards, method=method, **kwargs)
        assert np.all(np.asarray(out) == 0.0), method
        grad = jax.grad(lambda r, m=method, k=kwargs: jnp.sum(adv_lib.group_advantages(r, method=m, **k)))(
            _pg_rewards()
        )
        assert np.all(np.asarray(grad) == 0.0), method


def test_group_advantages_errors():
    rewards = _pg_rewards()
    with pytest.raises(ValueError, match="grpo, dr_grpo, rloo, reinforce_pp, remax"):
        adv_lib.group_advantages(rewards, method="ppo")
    with pytest.raises(ValueError, match="rewards must have rank 1 or 2"):
        adv_lib.group_advantages(rewards[None], method="grpo")
    with pytest.raises(ValueError, match="group_ids"):
        adv_lib.group_advantages(rewards.reshape(-1), method="grpo")
    with pytest.raises(ValueError, match=r"group_ids has shape \(5,\); it must be \[24\], one id per row of rewards"):
        adv_lib.group_advantages(rewards.reshape(-1), method="grpo", group_ids=np.zeros(5, np.int32), num_groups=1)
    with pytest.raises(ValueError, match="num_groups"):
        adv_lib.group_advantages(rewards.reshape(-1), method="grpo", group_ids=np.zeros(24, np.int32))
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="num_groups must be a static Python int >= 1"):
            adv_lib.group_advantages(rewards.reshape(-1), method="grpo", group_ids=np.zeros(24, np.int32),
                                     num_groups=bad)
    with pytest.raises(ValueError, match=r"group_ids must lie in \[0, num_groups\)"):
        adv_lib.group_advantages(rewards.reshape(-1), method="grpo", group_ids=np.full(24, 4, np.int32), num_groups=4)
    for extra in ({"group_ids": np.zeros(4, np.int32), "num_groups": 1}, {"group_ids": np.zeros(4, np.int32)},
                  {"num_groups": 4}):
        with pytest.raises(ValueError, match="group_ids/num_groups are for flat"):
            adv_lib.group_advantages(rewards, method="grpo", **extra)
    with pytest.raises(ValueError, match="baseline"):
        adv_lib.group_advantages(rewards, method="remax")
    with pytest.raises(ValueError, match="baseline"):
        adv_lib.group_advantages(rewards, method="remax", baseline=np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="baseline is only used by method 'remax'"):
        adv_lib.group_advantages(rewards, method="grpo", baseline=rewards)
    with pytest.raises(ValueError, match="subtract_group_mean"):
        adv_lib.group_advantages(rewards, method="grpo", subtract_group_mean=True)


# --------------------------------------------------------------------------- process supervision


def test_process_advantages_hand_case():
    # One group, two outputs; steps end at t=1 and t=3 (row 0) and t=2 (row 1); prompt at t=0.
    mask = np.array([[0, 1, 1, 1, 0], [0, 1, 1, 0, 0]], np.float32)
    step_mask = np.array([[0, 1, 0, 1, 0], [0, 0, 1, 0, 0]], np.float32)
    step_rewards = np.array([[0, 1.0, 0, 0.0, 0], [0, 0, 0.5, 0, 0]], np.float32)
    # R = {1, 0, .5}: mean .5, unbiased std .5 -> normalised {1, -1, 0}.
    out = adv_lib.process_advantages(step_rewards, step_mask, mask, eps=0.0)
    np.testing.assert_allclose(out, [[0, 0.0, -1.0, -1.0, 0], [0, 0.0, 0.0, 0, 0]], **TOL)


class ProcessAdvantagesVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("unbiased", True), ("population", False))
    def test_process_advantages_matches_reference(self, unbiased_std):
        rng = np.random.default_rng(7)
        _, _, mask = _ragged_batch()
        mask = np.concatenate([mask, mask[:3]])  # 8 rows
        step_mask = (rng.random(mask.shape) < 0.4).astype(np.float32)  # some fall off the response
        step_rewards = np.where(step_mask > 0, rng.normal(size=mask.shape), np.nan).astype(np.float32)
        group_ids = np.array([1, 0, 2, 1, 0, 2, 1, 3], np.int32)
        # Group 3 (row 7, a full-length response) gets three equal step rewards whose float32
        # mean is not exactly 0.9: exact zeros expected all the same.
        step_mask[7] = 0.0
        step_mask[7, [1, 4, 8]] = 1.0
        step_rewards[7] = np.where(step_mask[7] > 0, 0.9, np.nan)
        ddof = 1 if unbiased_std else 0
        fn = self.variant(functools.partial(adv_lib.process_advantages, num_groups=4, unbiased_std=unbiased_std))
        out = fn(step_rewards, step_mask, mask, group_ids=group_ids)
        want = process_reference(step_rewards, step_mask, mask, group_ids, ddof=ddof)
        assert np.all(np.isfinite(np.asarray(out)))
        np.testing.assert_allclose(out, want, **TOL)
        assert np.all(np.asarray(out)[7] == 0.0)
        # Without group_ids the whole batch is one group.
        whole = self.variant(functools.partial(adv_lib.process_advantages, unbiased_std=unbiased_std))(
            step_rewards, step_mask, mask
        )
        want = process_reference(step_rewards, step_mask, mask, np.zeros(8, int), ddof=ddof)
        np.testing.assert_allclose(whole, want, **TOL)


def test_process_advantages_errors():
    mask = np.ones((2, 3), np.float32)
    with pytest.raises(ValueError, match="step_mask"):
        adv_lib.process_advantages(mask, np.ones((2, 4), np.float32), mask)
    with pytest.raises(ValueError, match="num_groups"):
        adv_lib.process_advantages(mask, mask, mask, group_ids=np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"shape \(3,\); it must be \[2\], one id per row of step_rewards"):
        adv_lib.process_advantages(mask, mask, mask, group_ids=np.zeros(3, np.int32), num_groups=1)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda r, v, m: adv_lib.token_rewards(r[:, 0], m[0]), "mask must have rank 2"),
        (lambda r, v, m: adv_lib.token_rewards(r, m), "scores must have rank 1"),
        (lambda r, v, m: adv_lib.gae(r[None], v[None], m[None], gamma=1.0, lam=1.0), "rewards must have rank 2"),
        (lambda r, v, m: adv_lib.group_advantages(r[None], method="grpo"), "rewards must have rank 1 or 2"),
        (lambda r, v, m: adv_lib.group_advantages(r[:, 0], method="grpo", group_ids=m[:, :1].astype(int),
                                                  num_groups=1), "group_ids must have rank 1"),
        (lambda r, v, m: adv_lib.process_advantages(r[0], v[0], m[0]), "step_rewards must have rank 2"),
    ],
    ids=["token_rewards_mask", "token_rewards_scores", "gae", "group_advantages", "group_ids", "process_advantages"],
)
def test_wrong_rank_raises_naming_the_argument(call, message):
    rewards, values, mask = _ragged_batch()
    with pytest.raises(ValueError, match=message):
        call(rewards, values, mask)


def ref_scaled_grpo(rewards, ids, scale, unbiased=True, eps=1e-6):
    """TRL's scale_rewards by loops: (r - mean_group) / (std + eps), std of the group, of
    the whole batch of raw rewards, or 1; a constant group (or a group of one) gives 0."""
    rewards = np.asarray(rewards, np.float64)
    ddof = 1 if unbiased else 0
    batch_std = np.std(rewards, ddof=ddof)
    out = np.zeros(len(rewards))
    for g in set(ids):
        members = [i for i in range(len(rewards)) if ids[i] == g]
        values = rewards[members]
        if len(values) < 2 or values.max() == values.min():
            continue
        std = {"group": np.std(values, ddof=ddof), "batch": batch_std, "none": 1.0}[scale]
        for i in members:
            out[i] = (rewards[i] - values.mean()) / (std + (0.0 if scale == "none" else eps))
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("unbiased", [True, False])
def test_grpo_reward_scale_matches_reference(scale, unbiased):
    rng = np.random.default_rng(5)
    ids = np.array([2, 0, 1, 0, 2, 1, 1, 3, 0, 2, 4])  # unordered, unequal groups, one of one
    rewards = rng.normal(size=ids.shape) * np.array([1, 3, 0.1, 3, 1, 0.1, 0.1, 1, 3, 1, 1])
    rewards[[7]] = 2.0
    rewards[ids == 1] = 0.5  # a constant group
    got = adv_lib.group_advantages(jnp.asarray(rewards, jnp.float32), method="grpo", group_ids=jnp.asarray(ids),
                                   num_groups=5, scale=scale, unbiased_std=unbiased)
    np.testing.assert_allclose(np.asarray(got), ref_scaled_grpo(rewards, ids, scale, unbiased), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got)[ids == 1] == 0)
    jitted = jax.jit(functools.partial(adv_lib.group_advantages, method="grpo", num_groups=5, scale=scale,
                                       unbiased_std=unbiased))
    np.testing.assert_allclose(jitted(jnp.asarray(rewards, jnp.float32), group_ids=jnp.asarray(ids)), got, **TOL)
    if scale == "none":
        dr = adv_lib.group_advantages(jnp.asarray(rewards, jnp.float32), method="dr_grpo",
                                      group_ids=jnp.asarray(ids), num_groups=5)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(dr))
    # [P, G] layout: batch is every reward of the array
    pg = rng.normal(size=(3, 4)) * np.array([[0.1], [1.0], [5.0]])
    got = adv_lib.group_advantages(jnp.asarray(pg, jnp.float32), method="grpo", scale=scale, unbiased_std=unbiased)
    want = ref_scaled_grpo(pg.reshape(-1), np.repeat(np.arange(3), 4), scale, unbiased).reshape(3, 4)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_grpo_batch_scale_adds_eps_to_the_batch_std():
    # Batch [0, 2, 0, 2]: mean 1, population std 1; each row's mean is 1 too: (r - 1) / (1 + eps).
    out = adv_lib.group_advantages(np.array([[0.0, 2.0], [0.0, 2.0]], np.float32), method="grpo", scale="batch",
                                   unbiased_std=False, eps=1.0)
    np.testing.assert_allclose(out, [[-0.5, 0.5], [-0.5, 0.5]], **TOL)


def test_reward_scale_errors_name_the_argument():
    with pytest.raises(ValueError, match="scale"):
        adv_lib.group_advantages(jnp.ones((2, 2)), method="grpo", scale="prompt")
    with pytest.raises(ValueError, match="scale='batch' is only used by method 'grpo'"):
        adv_lib.group_advantages(jnp.ones((2, 2)), method="rloo", scale="batch")
