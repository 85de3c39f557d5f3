"""alignax.kl: estimators against NumPy formulas (Schulman 2020), placement, controllers."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from alignax import kl
from tests.support import references

TOL = dict(rtol=1e-6, atol=1e-6)


def _logps(seed=0, shape=(3, 5)):
    rng = np.random.default_rng(seed)
    logps = -rng.uniform(0.1, 3.0, size=shape).astype(np.float32)
    ref_logps = (logps + rng.normal(scale=0.5, size=shape)).astype(np.float32)
    mask = np.zeros(shape, np.float32)
    mask[0, 1:4] = 1
    mask[1, :] = 1
    mask[2, 3:] = 1  # further rows, if any: no response token
    return logps, ref_logps, mask


class KLVariantsTest(chex.TestCase):
    """Estimators, placement, sequence sums and the controller, jitted and not (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters((kind, kind) for kind in kl.KL_KINDS)
    def test_estimators_match_formulas(self, kind):
        logps, ref_logps, _ = _logps()
        out = self.variant(functools.partial(kl.kl_estimate, kind=kind))(logps, ref_logps)
        chex.assert_type(out, jnp.float32)
        chex.assert_shape(out, logps.shape)
        np.testing.assert_allclose(out, references.kl_estimate(logps, ref_logps, kind), **TOL)

    @chex.variants(with_jit=True, without_jit=True)
    def test_kl_penalty_hand_case(self):
        # Log-ratios [0.1, 0.2, -0.05], beta 0.04, k1: per token [.004, .008, -.002], sum .01.
        logps = np.array([[-1.0, -2.0, -0.5, -7.0]], np.float32)
        ref_logps = logps - np.array([[0.1, 0.2, -0.05, 3.0]], np.float32)
        mask = np.array([[1, 1, 1, 0]], np.float32)
        penalty = self.variant(functools.partial(kl.kl_penalty, beta=0.04, kind="k1"))(logps, ref_logps, mask)
        np.testing.assert_allclose(penalty, [[0.004, 0.008, -0.002, 0.0]], **TOL)
        np.testing.assert_allclose(jnp.sum(penalty), 0.01, **TOL)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("k1", "k1"), ("k3", "k3"))
    def test_kl_loss_value_and_gradients(self, kind):
        logps, ref_logps, mask = _logps(seed=3)
        # Garbage on masked positions (padding log-probs far from the reference).
        logps = np.where(mask > 0, logps, -500.0).astype(np.float32)
        fn = functools.partial(kl.kl_loss, kind=kind, aggregation="token-mean")
        value = self.variant(fn)(logps, ref_logps, mask)
        want = references.kl_estimate(logps, ref_logps, kind)
        np.testing.assert_allclose(value, (want * mask).sum() / mask.sum(), **TOL)

        grad_fn = self.variant(jax.grad(lambda a, b: fn(a, b, mask), argnums=(0, 1)))
        g_logps, g_ref = grad_fn(jnp.asarray(logps), jnp.asarray(ref_logps))
        g_logps, g_ref = np.asarray(g_logps), np.asarray(g_ref)
        assert np.all(g_ref == 0.0)  # the reference is constant
        assert np.all(g_logps[mask == 0] == 0.0)  # masked tokens get exactly zero gradient
        # On response tokens: d/dr of the estimator, divided by the token count.
        r = logps.astype(np.float64) - ref_logps
        dk = np.ones_like(r) if kind == "k1" else 1.0 - np.exp(-r)
        np.testing.assert_allclose(g_logps[mask > 0], (dk / mask.sum())[mask > 0], **TOL)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters((kind, kind) for kind in kl.KL_KINDS)
    def test_sequence_kl_matches_row_loop(self, kind):
        logps, ref_logps, mask = _logps(seed=5, shape=(4, 5))  # row 3: no response token
        out = self.variant(functools.partial(kl.sequence_kl, kind=kind))(logps, ref_logps, mask)
        chex.assert_type(out, jnp.float32)
        chex.assert_shape(out, (4,))
        np.testing.assert_allclose(out, references.sequence_kl(logps, ref_logps, mask, kind), **TOL)
        assert float(out[3]) == 0.0

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        # target 6, horizon 10,000, n = 256; coef 0.1.
        ("clip_up", 9.0, 0.1 * (1 + 0.2 * 256 / 10_000)),  # 9/6 - 1 = 0.5 -> clipped to +0.2: 0.100512
        ("clip_down", 3.0, 0.1 * (1 - 0.2 * 256 / 10_000)),  # 3/6 - 1 = -0.5 -> clipped to -0.2: 0.099488
        ("inside", 6.6, 0.1 * (1 + 0.1 * 256 / 10_000)),  # 0.1 inside the clip: 0.100256
    )
    def test_adaptive_controller_ziegler_update(self, current_kl, expected):
        controller = kl.AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10_000)
        state = self.variant(controller.update)(controller.init(), jnp.float32(current_kl), 256)
        np.testing.assert_allclose(state.coef, expected, rtol=1e-6)


def test_k3_and_k2_nonnegative_k1_signed():
    logps, ref_logps, _ = _logps(seed=1)
    assert np.all(np.asarray(kl.kl_estimate(logps, ref_logps, kind="k3")) >= 0)
    assert np.all(np.asarray(kl.kl_estimate(logps, ref_logps, kind="k2")) >= 0)
    k1 = np.asarray(kl.kl_estimate(logps, ref_logps, kind="k1"))
    assert k1.min() < 0 < k1.max()


def test_kl_penalty_is_data_without_gradient():
    logps, ref_logps, mask = _logps(seed=2)
    grads = jax.grad(lambda a, b: jnp.sum(kl.kl_penalty(a, b, mask, beta=0.1, kind="k3")), argnums=(0, 1))(
        jnp.asarray(logps), jnp.asarray(ref_logps)
    )
    assert all(np.all(np.asarray(g) == 0.0) for g in grads)
    penalty = kl.kl_penalty(logps, ref_logps, mask, beta=0.1, kind="k3")
    np.testing.assert_allclose(penalty, 0.1 * references.kl_estimate(logps, ref_logps, "k3") * mask, **TOL)


def test_clamp_keeps_k3_finite():
    logps = np.array([-1000.0, -1.0], np.float32)  # policy far below the reference: r = -999
    ref_logps = np.array([-1.0, -1000.0], np.float32)  # and far above: r = +999
    unclamped = kl.kl_estimate(logps, ref_logps, kind="k3", clamp=None)
    assert np.isinf(np.asarray(unclamped)[0])  # exp(999) overflows float32
    clamped = kl.kl_estimate(logps, ref_logps, kind="k3", clamp=20.0)
    assert np.all(np.isfinite(np.asarray(clamped)))
    np.testing.assert_allclose(clamped, [np.exp(20.0) - 1.0 - 20.0, np.exp(-20.0) - 1.0 + 20.0], rtol=1e-6)
    grad = jax.grad(lambda a: jnp.sum(kl.kl_estimate(a, ref_logps, kind="k3")))(jnp.asarray(logps))
    assert np.all(np.isfinite(np.asarray(grad)))


@pytest.mark.parametrize("garbage", [-500.0, -np.inf], ids=["huge", "inf"])
def test_kl_loss_masked_garbage_without_clamp_gives_zero_gradient(garbage):
    # With clamp=None, exp(500) overflows on a padding token; 0 * inf must not become NaN.
    logps, ref_logps, mask = _logps(seed=4)
    logps = np.where(mask > 0, logps, garbage).astype(np.float32)
    value, g_logps = jax.value_and_grad(lambda a: kl.kl_loss(a, ref_logps, mask, kind="k3", clamp=None))(
        jnp.asarray(logps)
    )
    want = references.kl_estimate(np.where(mask > 0, logps, ref_logps), ref_logps, "k3")
    np.testing.assert_allclose(value, (want * mask).sum() / mask.sum(), **TOL)
    g_logps = np.asarray(g_logps)
    assert np.all(np.isfinite(g_logps))
    assert np.all(g_logps[mask == 0] == 0.0)


def test_fixed_controller_unchanged():
    controller = kl.FixedKLController(coef=0.05)
    state = controller.init()
    np.testing.assert_allclose(state.coef, 0.05, **TOL)
    new = jax.jit(controller.update)(state, jnp.float32(123.0), 1024)
    assert new.coef == state.coef


def test_errors_name_the_argument():
    logps, ref_logps, mask = _logps()
    with pytest.raises(ValueError, match="k1, k2, k3, abs"):
        kl.kl_estimate(logps, ref_logps, kind="k4")
    with pytest.raises(ValueError, match="ref_logps"):
        kl.kl_estimate(logps, ref_logps[:, :-1])
    with pytest.raises(ValueError, match="mask"):
        kl.kl_penalty(logps, ref_logps, mask[:, :-1], beta=0.1)
    with pytest.raises(ValueError, match="target > 0"):
        kl.AdaptiveKLController(init_coef=0.1, target=0.0, horizon=100)


def test_sequence_kl_ignores_masked_garbage_in_value_and_gradient():
    logps, ref_logps, mask = _logps(seed=6)
    clean = kl.sequence_kl(logps, ref_logps, mask, kind="k3", clamp=None)
    dirty_logps = np.where(mask > 0, logps, -np.inf).astype(np.float32)
    dirty_ref = np.where(mask > 0, ref_logps, np.inf).astype(np.float32)
    value, grad = jax.value_and_grad(
        lambda a: jnp.sum(kl.sequence_kl(a, dirty_ref, mask, kind="k3", clamp=None))
    )(jnp.asarray(dirty_logps))
    np.testing.assert_allclose(value, jnp.sum(clean), **TOL)
    grad = np.asarray(grad)
    assert np.all(np.isfinite(grad)) and np.all(grad[mask == 0] == 0.0)
    # k3's derivative in log pi is 1 - exp(-r) on response tokens.
    r = logps.astype(np.float64) - ref_logps
    np.testing.assert_allclose(grad[mask > 0], (1.0 - np.exp(-r))[mask > 0], **TOL)


@pytest.mark.parametrize(
    "fn",
    [
        functools.partial(kl.kl_penalty, beta=0.1),
        kl.kl_loss,
        kl.sequence_kl,
    ],
    ids=["kl_penalty", "kl_loss", "sequence_kl"],
)
def test_wrong_rank_raises_naming_the_argument(fn):
    logps, ref_logps, mask = _logps()
    with pytest.raises(ValueError, match="logps must have rank 2"):
        fn(logps[0], ref_logps[0], mask[0])
    with pytest.raises(ValueError, match="logps must have rank 2"):
        jax.jit(fn)(logps[None], ref_logps[None], mask[None])
    with pytest.raises(ValueError, match=r"mask=\(3, 4\)"):
        fn(logps, ref_logps, mask[:, :4])


# ---------------------------------------------------------------------------------------
# Importance-weighted KL (DeepSeek-V3.2 eq. 8; TRL's use_bias_correction_kl)
# ---------------------------------------------------------------------------------------


def test_importance_weighted_kl_matches_formula_and_gradient():
    """w k with w = pi_theta / pi_old; d/dlogps: w k + w dk ("ratio") or w dk ("detached_ratio")."""
    logps, ref_logps, _ = _logps(seed=3)
    old_logps = logps + np.random.default_rng(4).normal(scale=0.4, size=logps.shape).astype(np.float32)
    x = logps.astype(np.float64) - ref_logps
    w = np.exp(logps.astype(np.float64) - old_logps)
    k3, dk3 = np.expm1(-x) + x, 1.0 - np.exp(-x)
    for weight, value, grad in (("none", k3, dk3), ("detached_ratio", w * k3, w * dk3),
                                ("ratio", w * k3, w * k3 + w * dk3)):
        def total(lp, weight=weight):
            return jnp.sum(kl.importance_weighted_kl(lp, ref_logps, old_logps, kind="k3", weight=weight))

        out = kl.importance_weighted_kl(logps, ref_logps, old_logps, kind="k3", weight=weight)
        np.testing.assert_allclose(np.asarray(out), value, rtol=1e-5, atol=1e-6, err_msg=weight)
        np.testing.assert_allclose(np.asarray(jax.grad(total)(logps)), grad, rtol=1e-5, atol=1e-6, err_msg=weight)
    with pytest.raises(ValueError, match="kl importance weight"):
        kl.importance_weighted_kl(logps, ref_logps, old_logps, weight="sequence")


def _weighted_k3(logps, ref_logps, old_logps, clamp, detached=False):
    """NumPy: value and d/dlogps of exp(clip(lp - old)) * k3(clip(ref - lp)), float64."""
    lp, ref, old = (np.asarray(a, np.float64) for a in (logps, ref_logps, old_logps))
    d, log_w = ref - lp, lp - old
    d_in, w_in = np.abs(d) < clamp, np.abs(log_w) < clamp  # the clip passes a gradient inside only
    d, w = np.clip(d, -clamp, clamp), np.exp(np.clip(log_w, -clamp, clamp))
    k3, dk3 = np.expm1(d) - d, -np.expm1(d) * d_in
    return w * k3, w * dk3 + (0.0 if detached else w * w_in * k3)


def test_importance_weighted_kl_defaults_are_k3_ratio_and_a_clamp_of_20_that_bounds_both_logs():
    """Called with its defaults it is k3 weighted by the differentiated ratio, both log-ratios
    clamped at +-20 (value and gradient against NumPy, on tokens whose log-ratios sit past 20
    and 21); a given clamp bounds the estimate's log-ratio as well as log w."""
    logps = np.array([[-1.0, -0.5, -30.0, -2.0, -3.0]], np.float32)
    ref_logps = np.array([[-1.5, -25.5, -2.0, -2.5, -3.4]], np.float32)  # ref - logps: -0.5, -25, 28, -0.5, -0.4
    old_logps = np.array([[-1.2, -0.7, -0.1, -22.5, -3.3]], np.float32)  # logps - old: 0.2, 0.2, -29.9, 20.5, 0.3

    def total(lp, **options):
        return jnp.sum(kl.importance_weighted_kl(lp, ref_logps, old_logps, **options))

    for options, clamp in (({}, 20.0), ({"clamp": 5.0}, 5.0)):
        value, grad = _weighted_k3(logps, ref_logps, old_logps, clamp)
        out = kl.importance_weighted_kl(logps, ref_logps, old_logps, **options)
        np.testing.assert_allclose(np.asarray(out), value, rtol=1e-5, err_msg=str(options))
        np.testing.assert_allclose(np.asarray(jax.grad(total)(logps, **options)), grad, rtol=1e-5, atol=1e-6,
                                   err_msg=str(options))
    # The inputs tell the defaults apart: a detached weight's gradient, a clamp of 21's value.
    ratio_value, ratio_grad = _weighted_k3(logps, ref_logps, old_logps, 20.0)
    assert not np.allclose(_weighted_k3(logps, ref_logps, old_logps, 20.0, detached=True)[1], ratio_grad, rtol=1e-3)
    assert not np.allclose(_weighted_k3(logps, ref_logps, old_logps, 21.0)[0], ratio_value, rtol=1e-3)


def _categorical(seed=0, size=6):
    """Logits of pi_theta, pi_old (a drifted older policy) and pi_ref over ``size`` tokens."""
    rng = np.random.default_rng(seed)
    theta = rng.normal(scale=1.0, size=size)
    return (jnp.asarray(theta, jnp.float32), jnp.asarray(theta + rng.normal(scale=0.8, size=size), jnp.float32),
            jnp.asarray(theta + rng.normal(scale=0.6, size=size), jnp.float32))


def test_importance_weighted_k3_is_unbiased_under_an_older_policy():
    """Monte Carlo (fixed seed) over tokens drawn from pi_old, the policy loss's KL term alone
    (A = 0, kl_coef 1, token-mean): the unweighted k3 misses KL(pi_theta || pi_ref), the
    weighted one matches the exact value by enumeration within 4 standard errors; so do the
    gradients (w.r.t. pi_theta's logits) of the two weightings, each to what it estimates:
    ``ratio`` the exact grad KL(pi_theta || ref), ``detached_ratio`` the expected on-policy
    gradient of the unweighted k3 loss, E_{pi_theta}[grad k3] (= grad KL(ref || pi_theta))."""
    from alignax.losses import ppo_policy_loss

    theta, old_logits, ref_logits = _categorical()
    n = 200_000
    p_old = np.exp(np.asarray(old_logits, np.float64))
    samples = np.random.default_rng(0).choice(theta.shape[0], size=n, p=p_old / p_old.sum())
    samples = jnp.asarray(samples.reshape(200, n // 200))
    old = jax.nn.log_softmax(old_logits)[samples]
    ref = jax.nn.log_softmax(ref_logits)[samples]
    zero, ones = jnp.zeros(samples.shape, jnp.float32), jnp.ones(samples.shape, jnp.float32)

    def per_sample(logits, weight):  # the per-token terms whose mean is the loss
        logps = jax.nn.log_softmax(logits)[samples]
        return kl.importance_weighted_kl(logps, ref, old, kind="k3", weight=weight)

    def loss(logits, weight):
        logps = jax.nn.log_softmax(logits)[samples]
        return ppo_policy_loss(logps, old, zero, ones, ref_logps=ref, kl_coef=1.0, kl_kind="k3",
                               kl_importance_weight=weight, aggregation="token-mean")[0]

    def exact_kl(logits):  # KL(pi_theta || pi_ref) by enumeration
        p, ref_p = jax.nn.log_softmax(logits), jax.nn.log_softmax(ref_logits)
        return jnp.sum(jnp.exp(p) * (p - ref_p))

    def on_policy_k3_grad(logits):  # E_{a ~ pi_theta}[grad k3(a)], the sampling distribution held fixed
        p = jax.nn.log_softmax(logits)
        k3 = jnp.expm1(jax.nn.log_softmax(ref_logits) - p) - (jax.nn.log_softmax(ref_logits) - p)
        return jnp.sum(jax.lax.stop_gradient(jnp.exp(p)) * k3)

    exact = float(exact_kl(theta))
    for weight in ("none", "ratio", "detached_ratio"):
        terms = np.asarray(per_sample(theta, weight), np.float64)
        assert float(loss(theta, weight)) == pytest.approx(terms.mean(), rel=1e-4)
        stderr = terms.std() / np.sqrt(n)
        if weight == "none":  # biased: many standard errors away
            assert abs(terms.mean() - exact) > 20 * stderr, (terms.mean(), exact, stderr)
        else:
            assert abs(terms.mean() - exact) < 4 * stderr, (weight, terms.mean(), exact, stderr)

    # per-sample gradients w.r.t. the logits: d term / d logps(a) times d logps(a) / d logits = onehot(a) - pi
    logps = jax.nn.log_softmax(theta)[samples]
    score = np.eye(theta.shape[0])[np.asarray(samples).reshape(-1)] - np.asarray(jax.nn.softmax(theta), np.float64)
    jac = {}
    for w in ("ratio", "detached_ratio"):
        def total(lp, w=w):
            return jnp.sum(kl.importance_weighted_kl(lp, ref, old, kind="k3", weight=w))

        d_logps = jax.grad(total)(logps)
        jac[w] = np.asarray(d_logps, np.float64).reshape(-1, 1) * score
    targets = {"ratio": np.asarray(jax.grad(exact_kl)(theta)),
               "detached_ratio": np.asarray(jax.grad(on_policy_k3_grad)(theta))}
    for weight, other in (("ratio", "detached_ratio"), ("detached_ratio", "ratio")):
        grad = np.asarray(jax.grad(loss)(theta, weight), np.float64)
        np.testing.assert_allclose(grad, jac[weight].mean(0), rtol=1e-3, atol=1e-6)
        stderr = jac[weight].std(0) / np.sqrt(n)
        assert np.all(np.abs(grad - targets[weight]) < 4 * stderr + 1e-6), (weight, grad, targets[weight], stderr)
        # and not the other weighting's target: the test tells the two apart
        assert np.max(np.abs(grad - targets[other]) / (stderr + 1e-9)) > 10, (weight, grad, targets[other], stderr)


# Found by mutation testing (docs/mutation-testing.md): defaults, the clamp on every path,
# the global normalisers of kl_loss, and the controller's argument bounds.


def test_defaults_are_k1_for_penalty_and_sequence_k3_for_loss_and_clamp_20():
    """A log-ratio of 20.5 sits between a clamp of 20 and one of 21: every path clamps at 20."""
    logps = jnp.asarray([[-0.5, -1.0, -0.2]])
    ref = jnp.asarray([[-21.0, -0.7, -0.2]])
    mask = jnp.asarray([[1.0, 1.0, 0.0]])
    explicit = functools.partial(kl.kl_estimate, clamp=20.0)
    np.testing.assert_array_equal(kl.kl_estimate(logps, ref), explicit(logps, ref, kind="k3"))
    np.testing.assert_array_equal(
        kl.kl_penalty(logps, ref, mask, beta=0.5), 0.5 * mask * explicit(logps, ref, kind="k1")
    )
    np.testing.assert_allclose(
        kl.sequence_kl(logps, ref, mask), [20.0 + (-1.0 + 0.7)], rtol=1e-6
    )
    k3 = references.kl_estimate(np.asarray(logps), np.asarray(ref), "k3", clamp=20.0)
    np.testing.assert_allclose(kl.kl_loss(logps, ref, mask), references.aggregate(k3, mask, "token-mean"), rtol=1e-6)


@pytest.mark.parametrize("mode", references.AGGREGATION_MODES)
def test_kl_loss_passes_mode_and_global_normalisers_to_the_aggregation(mode):
    logps, ref_logps, mask = _logps(4)
    counts = dict(num_tokens=23.0, num_seqs=7.0, norm_length=11.0)
    got = kl.kl_loss(logps, ref_logps, mask, kind="k2", aggregation=mode, **counts)
    per_token = references.kl_estimate(logps, ref_logps, "k2", clamp=20.0)
    np.testing.assert_allclose(got, references.aggregate(per_token, mask, mode, **counts), rtol=1e-5)


def test_controller_state_is_float32_whatever_the_input_dtype():
    """bfloat16 KL and sample counts are computed with in float32: bf16 arithmetic on
    ``KL / target - 1`` (KL = 6.59375, bf16's 6.6) would round it to 8 bits."""
    controller = kl.AdaptiveKLController(init_coef=0.1, target=6.0, horizon=10_000)
    kl_bf16, n_bf16 = jnp.bfloat16(6.6), jnp.bfloat16(256)
    state = controller.update(controller.init(), kl_bf16, n_bf16)
    expected = 0.1 * (1 + (float(kl_bf16) / 6.0 - 1.0) * float(n_bf16) / 10_000)
    assert state.coef.dtype == jnp.float32
    np.testing.assert_allclose(state.coef, expected, rtol=1e-7)


@pytest.mark.parametrize(("target", "horizon", "ok"), [(0.5, 0.5, True), (0.0, 1.0, False), (1.0, 0.0, False)])
def test_adaptive_controller_needs_positive_target_and_horizon(target, horizon, ok):
    if ok:
        kl.AdaptiveKLController(init_coef=0.1, target=target, horizon=horizon)
    else:
        with pytest.raises(ValueError, match="target > 0 and horizon > 0"):
            kl.AdaptiveKLController(init_coef=0.1, target=target, horizon=horizon)


def test_estimates_and_coefficients_are_float32_even_with_x64_on():
    """float64 inputs under ``jax.enable_x64`` still give the documented float32."""
    logps, ref_logps, mask = (np.asarray(a, np.float64) for a in _logps(5))
    with jax.enable_x64(True):
        assert kl.kl_estimate(logps, ref_logps).dtype == jnp.float32
        assert kl.kl_estimate(logps.astype(np.float32), ref_logps).dtype == jnp.float32
        assert kl.sequence_kl(logps, ref_logps, mask).dtype == jnp.float32
        assert kl.sequence_kl(logps.astype(np.float32), ref_logps, mask).dtype == jnp.float32
        for weight in ("ratio", "detached_ratio"):  # float64 log w, from either side, would make it float64
            assert kl.importance_weighted_kl(logps, ref_logps, logps - 0.1, weight=weight).dtype == jnp.float32
            assert kl.importance_weighted_kl(logps.astype(np.float32), ref_logps, logps - 0.1,
                                             weight=weight).dtype == jnp.float32
        assert kl.FixedKLController(0.1).init().coef.dtype == jnp.float32
        adaptive = kl.AdaptiveKLController(0.1, target=6.0, horizon=10.0)
        assert adaptive.init().coef.dtype == jnp.float32
        assert adaptive.update(adaptive.init(), np.float64(6.6), np.float64(2.0)).coef.dtype == jnp.float32


@pytest.mark.parametrize("clamp", [None, 5.0])
def test_a_given_clamp_reaches_the_estimator_on_every_path(clamp):
    """Log-ratio 30 (k1): the penalty, the loss and the sequence sum read 30 unclamped, 5 at 5."""
    logps, ref = jnp.asarray([[-0.5, -1.0]]), jnp.asarray([[-30.5, -1.0]])
    mask = jnp.asarray([[1.0, 1.0]])
    expected = 30.0 if clamp is None else clamp
    np.testing.assert_allclose(kl.kl_penalty(logps, ref, mask, beta=1.0, clamp=clamp), [[expected, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(kl.kl_loss(logps, ref, mask, kind="k1", clamp=clamp), expected / 2, rtol=1e-6)
    np.testing.assert_allclose(kl.sequence_kl(logps, ref, mask, clamp=clamp), [expected], rtol=1e-6)
