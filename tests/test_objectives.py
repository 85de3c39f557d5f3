"""The policy objectives of alignax.losses.objectives against NumPy loops written from each
paper's formula (float64, no alignax code), and verl's rollout correction.

Each reference gives the per-token loss ``l_t`` and the per-token gradient coefficient
``g_t = d l_t / d logps_t`` (the paper's gradient; for the surrogate-gradient objectives,
DPPO and VESPO, the stop-gradient weight times ``-A_t``). Every aggregation mode is linear in
the per-token values, so the reference loss is ``agg(l)`` and the reference gradient at
``t`` is ``g_t * agg(e_t)``. Where the loss value is a true objective of ``logps`` (DRO,
KL-Cov, Clip-Cov, GMPO with sequence advantages) central differences of the reference check
``g`` too. The fixture has a prompt, padding, a row with no response token and garbage
(huge log-probs) under the mask.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alignax.losses import objectives
from alignax.losses.objectives import OBJECTIVES
from alignax.losses.policy import REJECTION_DIVERGENCES, pg_loss, sampler_correction
from tests.support import references

MODES = references.AGGREGATION_MODES
TOL = dict(rtol=2e-5, atol=2e-6)
B, T = 5, 6


def make_data(seed=0, per_sequence=False):
    rng = np.random.default_rng(seed)
    mask = np.ones((B, T))
    mask[0, :2] = 0  # a prompt
    mask[2] = 0  # no response token at all
    mask[3, 4:] = 0  # padding
    logps = -rng.uniform(0.1, 2.0, (B, T))
    old = np.minimum(logps + rng.uniform(-0.45, 0.45, (B, T)), -0.05)  # probabilities below 1
    sampler = np.minimum(old + rng.uniform(-0.4, 0.4, (B, T)), -0.05)
    adv = rng.normal(size=B) if per_sequence else rng.normal(size=(B, T)) * 1.5
    off = mask == 0
    logps[off], old[off], sampler[off] = 50.0, -60.0, 40.0  # garbage under the mask
    if not per_sequence:
        adv[off] = 1e4
    return dict(logps=logps, old_logps=old, advantages=adv, mask=mask, sampler_logps=sampler)


def _per_token_adv(data):
    adv = np.asarray(data["advantages"], np.float64)
    return np.broadcast_to(adv[:, None], (B, T)) if adv.ndim == 1 else adv


def _loss_args(data):
    """``([logps, old_logps, advantages, mask], sampler_logps)`` of ``data`` as float32 arrays."""
    f = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    return [f(data[k]) for k in ("logps", "old_logps", "advantages", "mask")], f(data["sampler_logps"])


def _weighted_reinforce_matches(data, want, on, **correction):
    """``pg_loss`` (REINFORCE, token-sum) with the sampler correction ``correction`` on ``data``
    equals ``-sum(w * A * logp)`` over the counted tokens ``on`` with the expected weights
    ``want``; returns the loss's metrics."""
    args, sampler = _loss_args(data)
    loss, metrics = pg_loss(*args, sampler_logps=sampler, aggregation="token-sum", **correction)
    np.testing.assert_allclose(float(loss), -(want * _per_token_adv(data) * data["logps"])[on].sum(), rtol=1e-5)
    return metrics


# ---------------------------------------------------------------------------------------
# References: (l [B, T], g [B, T]) from the papers' formulas
# ---------------------------------------------------------------------------------------


def ref_dppo(data, divergence, eps_low, eps_high, cap):
    lp, old, adv, mask = data["logps"], data["old_logps"], _per_token_adv(data), data["mask"]
    loss, grad = np.zeros((B, T)), np.zeros((B, T))
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            p, q, a = math.exp(lp[i, t]), math.exp(old[i, t]), adv[i, t]
            if divergence == "tv":
                valid = (p - q <= eps_high) if a > 0 else (p - q >= -eps_low)
            else:  # binary KL(pi_old || pi_theta) of "this token / any other"
                d = q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
                valid = (d <= eps_high or p <= q) if a > 0 else (d <= eps_low or p >= q)
            w = min(math.exp(lp[i, t] - old[i, t]), cap)
            loss[i, t] = -a * w * valid * lp[i, t]
            grad[i, t] = -a * w * valid
    return loss, grad


def _cov(data):
    """(A_t - mean A)(logp_t - mean logp) over the response tokens."""
    lp, adv, mask = data["logps"], _per_token_adv(data), data["mask"] > 0
    mean_a, mean_lp = adv[mask].mean(), lp[mask].mean()
    return np.where(mask, (adv - mean_a) * (lp - mean_lp), 0.0)


def ref_clip_cov(data, eps, ratio, lb, ub, eps_high=None):
    """With ``ratio * N`` at least the number of candidates every candidate is dropped. PPO-clip's
    band is ``(1 - eps, 1 + eps_high)``, ``eps_high`` defaulting to ``eps``."""
    eps_high = eps if eps_high is None else eps_high
    lp, old, adv, mask = data["logps"], data["old_logps"], _per_token_adv(data), data["mask"]
    cov = _cov(data)
    loss, grad, chosen = np.zeros((B, T)), np.zeros((B, T)), np.zeros((B, T), bool)
    for i in range(B):
        for t in range(T):
            if not mask[i, t]:
                continue
            a, r = adv[i, t], math.exp(lp[i, t] - old[i, t])
            clipped = -a * min(max(r, 1 - eps), 1 + eps_high) > -a * r
            if not clipped and lb < cov[i, t] < ub:
                chosen[i, t] = True
                continue  # l_t = 0, no gradient
            loss[i, t] = max(-a * r, -a * min(max(r, 1 - eps), 1 + eps_high))
            grad[i, t] = 0.0 if clipped else -a * r
    assert math.floor(ratio * mask.sum()) >= chosen.sum() > 0  # the fixture selects, deterministically
    return loss, grad, chosen


def ref_kl_cov(data, ratio, coef):
    lp, old, adv, mask = data["logps"], data["old_logps"], _per_token_adv(data), data["mask"]
    cov = _cov(data)
    k = max(math.floor(ratio * mask.sum()), 1)
    order = sorted(((cov[i, t], i, t) for i in range(B) for t in range(T) if mask[i, t]), reverse=True)
    top = {(i, t) for _, i, t in order[:k]}
    loss, grad = np.zeros((B, T)), np.zeros((B, T))
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                lr = lp[i, t] - old[i, t]
                loss[i, t] = -adv[i, t] * math.exp(lr) + (coef * abs(lr) if (i, t) in top else 0.0)
                grad[i, t] = -adv[i, t] * math.exp(lr) + (coef * math.copysign(1, lr) if (i, t) in top else 0.0)
    return loss, grad, top


def ref_geo_mean(data, eps_low, eps_high):
    """GMPO eq. 4: s_i = exp(mean_t c_t), c_t the sign-pessimistic clipped log-ratio; every
    token carries -A_t s_i, and d/dlogp_t = -A_t s_i [c_t unclipped]."""
    lp, old, adv, mask = data["logps"], data["old_logps"], _per_token_adv(data), data["mask"]
    loss, grad = np.zeros((B, T)), np.zeros((B, T))
    for i in range(B):
        cs, free = [], []
        for t in range(T):
            if mask[i, t]:
                lr, sgn = lp[i, t] - old[i, t], np.sign(adv[i, t])
                clamped = min(max(lr, -eps_low), eps_high)
                c = sgn * min(sgn * lr, sgn * clamped)
                cs.append(c)
                free.append(sgn * lr <= sgn * clamped)
        s = math.exp(sum(cs) / len(cs)) if cs else 1.0
        j = 0
        for t in range(T):
            if mask[i, t]:
                loss[i, t] = -adv[i, t] * s
                grad[i, t] = -adv[i, t] * s * free[j]
                j += 1
    return loss, grad


def ref_geo_mean_clipfrac(data, eps_low, eps_high):
    """GMPO's clip fractions ``(low, high)``: the share of response tokens where the clipped
    log-ratio is the pessimistic one, i.e. the log-ratio is beyond the band on the side the
    advantage pushes (``A < 0``: below ``-eps_low``; ``A > 0``: above ``eps_high``)."""
    lr, adv, mask = data["logps"] - data["old_logps"], _per_token_adv(data), data["mask"] > 0
    low = mask & (adv < 0) & (lr < -eps_low)
    high = mask & (adv > 0) & (lr > eps_high)
    return low.sum() / mask.sum(), high.sum() / mask.sum()


def ref_dro(data, beta):
    lp, old, adv, mask = data["logps"], data["old_logps"], _per_token_adv(data), data["mask"]
    loss = np.where(mask > 0, -(lp * adv - 0.5 * beta * (lp - old) ** 2), 0.0)
    grad = np.where(mask > 0, -adv + beta * (lp - old), 0.0)
    return loss, grad


def ref_vespo_phi(data, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0, seq_extra=None):
    """``(phi [B, T], W [B])``: phi(W) = W^k exp(lambda (1 - W)), W the sequence ratio clipped to
    ``[1e-8, e^20]`` (TRL 1.16's get_gamma_weights); phi is 0 off the mask."""
    lp, old, adv, mask = data["logps"], data["old_logps"], _per_token_adv(data), data["mask"]
    phi, ws = np.zeros((B, T)), np.zeros(B)
    for i in range(B):
        log_w = sum(lp[i, t] - old[i, t] for t in range(T) if mask[i, t])
        log_w += 0.0 if seq_extra is None else seq_extra[i]
        log_w = min(max(log_w, math.log(1e-8)), 20.0)
        ws[i] = w = math.exp(log_w)
        for t in range(T):
            if mask[i, t]:
                k, lam = (k_pos, lam_pos) if adv[i, t] >= 0 else (k_neg, lam_neg)
                phi[i, t] = w ** k * math.exp(lam * (1 - w))
    return phi, ws


def ref_vespo(data, *args, **kw):
    """``(l, g)``: ``l_t = -phi A_t logps_t``, ``g_t = -phi A_t`` (:func:`ref_vespo_phi`)."""
    phi, _ = ref_vespo_phi(data, *args, **kw)
    adv = _per_token_adv(data)
    return -phi * adv * data["logps"], -phi * adv


def agg_weights(mask, mode):
    """``agg(e_t)`` for every token: the aggregation is linear in the per-token values."""
    out = np.zeros((B, T))
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                e = np.zeros((B, T))
                e[i, t] = 1.0
                out[i, t] = references.aggregate(e, mask, mode)
    return out


def run_loss(fn, data, mode, **kw):
    args = [jnp.asarray(data[k], jnp.float32) for k in ("logps", "old_logps", "advantages", "mask")]
    f = jax.jit(lambda lp: fn(lp, *args[1:], aggregation=mode, **kw))
    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(args[0])
    return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad, np.float64)


def assert_matches(fn, data, ref_loss, ref_grad, modes=MODES, **kw):
    for mode in modes:
        loss, metrics, grad = run_loss(fn, data, mode, **kw)
        np.testing.assert_allclose(loss, references.aggregate(ref_loss, data["mask"], mode), err_msg=mode, **TOL)
        np.testing.assert_allclose(grad, ref_grad * agg_weights(data["mask"], mode), err_msg=mode, **TOL)
        assert np.all(grad[2] == 0) and np.all(grad[data["mask"] == 0] == 0), mode  # empty row, garbage
    return metrics


def assert_true_gradient(name, ref_loss_of, data, mode, **kw):
    """The loss value is a function of logps (no surrogate gradient): the gradient equals central
    differences of the reference loss ``ref_loss_of(data) -> l [B, T]``, aggregated by ``mode``."""
    f = lambda lp: references.aggregate(ref_loss_of({**data, "logps": lp}), data["mask"], mode)  # noqa: E731
    _, _, got = run_loss(OBJECTIVES[name].loss, data, mode, **kw)
    np.testing.assert_allclose(got, references.finite_difference(f, data["logps"]), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------
# Each objective against its reference
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("divergence", ["tv", "kl"])
def test_dppo_matches_the_binary_trust_region(divergence):
    data = make_data(1)
    eps_low, eps_high, cap = (0.08, 0.05, 1.2) if divergence == "tv" else (0.02, 0.015, 1.2)
    loss, grad = ref_dppo(data, divergence, eps_low, eps_high, cap)
    fn = OBJECTIVES[f"dppo_{divergence}"].loss
    metrics = assert_matches(fn, data, loss, grad, clip_eps_low=eps_low, clip_eps_high=eps_high, dppo_ratio_cap=cap)
    # not vacuous: some tokens are masked on each side and some weights are capped
    assert metrics["clipfrac_high"] > 0 and metrics["clipfrac_low"] > 0 and metrics["ratio_capped"] > 0
    assert metrics["clipfrac_high"] + metrics["clipfrac_low"] < 0.8


def test_dppo_defaults_are_verls():
    """Thresholds 0.2 each side and the truncation cap 20, each binding on a token of row 1:
    ``(pi_old, pi_theta, A)`` = (0.2, 0.7, +) moved up too far (TV 0.5, binary KL 0.53), (0.7,
    0.3, -) down too far (TV -0.4, KL 0.34), (0.02, 0.6, -) inside both regions with its ratio
    30 capped; the rest of the batch has ratios near 1 and is not masked."""
    data = make_data(2)
    for t, (q, p, a) in enumerate([(0.2, 0.7, 1.0), (0.7, 0.3, -1.0), (0.02, 0.6, -1.0), (0.7, 0.3, 0.0)]):
        data["old_logps"][1, t], data["logps"][1, t], data["advantages"][1, t] = math.log(q), math.log(p), a
    for name in ("dppo_tv", "dppo_kl"):
        loss, grad = ref_dppo(data, name[-2:], 0.2, 0.2, 20.0)
        metrics = assert_matches(OBJECTIVES[name].loss, data, loss, grad, modes=("token-mean",))
        n = data["mask"].sum()
        # clipfrac_low counts the tokens masked with A <= 0: the one moved down too far with A = 0 too
        assert metrics["clipfrac_high"] == pytest.approx(1 / n) and metrics["clipfrac_low"] == pytest.approx(2 / n)
        assert metrics["ratio_capped"] == pytest.approx(1 / n), name


def test_dppo_keeps_a_token_the_update_did_not_move():
    """Tokens of probability 1 left where they were (``logps = old_logps = 0``, so ``p - q = 0``
    exactly whatever the rounding of ``exp``) keep their gradient at thresholds 0, either sign of
    ``A``: the TV region is closed (verl's ``p - q <= eps_high`` and ``>= -eps_low``), and the KL
    region takes every token not moved up (``p <= q``) when ``A > 0`` and not moved down
    (``p >= q``) when ``A < 0``. Their ratio is exactly 1: at a cap of 1 it is not counted as
    capped (``ratio_capped`` is ``r > cap``)."""
    data = make_data(13)
    for t, a in enumerate((1.0, -1.0)):
        data["old_logps"][1, t], data["logps"][1, t], data["advantages"][1, t] = 0.0, 0.0, a
    f32 = lambda k: data[k].astype(np.float32)  # noqa: E731
    above = ((f32("logps") - f32("old_logps") > 0) & (data["mask"] > 0)).sum() / data["mask"].sum()
    for name in ("dppo_tv", "dppo_kl"):
        _, metrics, grad = run_loss(OBJECTIVES[name].loss, data, "token-sum", clip_eps_low=0.0, clip_eps_high=0.0,
                                    dppo_ratio_cap=1.0)
        np.testing.assert_allclose(grad[1, :2], [-1.0, 1.0], rtol=1e-6, err_msg=name)  # -A r, r = 1
        assert metrics["ratio_capped"] == pytest.approx(above, abs=1e-6), name


def test_dppo_kl_keeps_a_token_that_moved_away_from_its_advantage_by_less_than_float32_shows():
    """DPPO-KL, clip_eps 0: a token that moved against its advantage's direction stays in the
    gradient whatever its binary KL. Moved by 2e-8 in log-prob at probability 1, ``p == q == 1``
    in float32 while verl's KL is positive (``2e-8`` for ``(pi_old, pi_theta)`` = (1, 1 - 2e-8);
    ``a log(1 + a / 1e-8) - a`` for (1 - a, 1), the ``+1e-8``): ``p <= q`` (``p >= q``) keeps it, not ``d <= 0``."""
    data = make_data(13)
    for t, (old, new, a) in enumerate(((0.0, -2e-8, 1.0), (-2e-8, 0.0, -1.0))):
        data["old_logps"][1, t], data["logps"][1, t], data["advantages"][1, t] = old, new, a
    _, _, grad = run_loss(OBJECTIVES["dppo_kl"].loss, data, "token-sum", clip_eps_low=0.0, clip_eps_high=0.0)
    np.testing.assert_allclose(grad[1, :2], [-1.0, 1.0], rtol=1e-6)  # -A r, r = 1 in float32


def test_binary_kl_keeps_verls_1e_8_for_a_token_of_probability_one():
    """``q log(q / p) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8))``: finite where ``p`` or
    ``q`` is 1 (a log-prob of 0, common for a near-greedy token), where ``1 - p`` alone is 0,
    eager and under ``jit`` (where XLA folded ``1 - q + 1e-8`` into ``(1 + 1e-8) - q``, ``1 - q``
    in float32, and the divergence at ``p = q = 1`` was NaN)."""
    from alignax.losses.objectives.dppo import binary_kl

    pairs = [(0.3, 1.0), (1.0, 0.5), (0.3, 0.6), (0.9, 0.05), (1.0, 1.0)]  # (q = pi_old, p = pi_theta)
    old, new = (jnp.log(jnp.asarray(v, jnp.float32)) for v in zip(*pairs))
    want = [q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8)) for q, p in pairs]
    np.testing.assert_allclose(binary_kl(old, new), want, rtol=1e-5)
    np.testing.assert_allclose(jax.jit(binary_kl)(old, new), want, rtol=1e-5)


def test_clip_cov_drops_the_outlying_covariance_tokens():
    data = make_data(3)
    loss, grad, chosen = ref_clip_cov(data, 0.2, 0.9, 0.0, 5.0)
    kw = dict(clip_eps_low=0.2, clip_cov_ratio=0.9, clip_cov_lb=0.0, clip_cov_ub=5.0)
    metrics = assert_matches(OBJECTIVES["clip_cov"].loss, data, loss, grad, **kw)
    assert metrics["cov_selected"] == pytest.approx(chosen.sum() / data["mask"].sum(), abs=1e-6)
    # the loss value is a function of logps away from the clip edges and selection: differences agree
    assert_true_gradient("clip_cov", lambda d: ref_clip_cov(d, 0.2, 0.9, 0.0, 5.0)[0], data, "token-mean", **kw)


def test_clip_cov_defaults_and_its_upper_clip():
    """verl's band ``(1, 5)`` and clip 0.2 by default, on advantages doubled so that candidates
    sit just inside the band's lower end and just past its upper end; ``clip_eps_high``, when
    given, is PPO-clip's upper bound in the loss and in excluding the tokens PPO-clip clips."""
    data = make_data(35)
    data["advantages"] = np.where(data["mask"] > 0, 2 * data["advantages"], data["advantages"])
    loss, grad, chosen = ref_clip_cov(data, 0.2, 0.9, 1.0, 5.0)
    # not vacuous: a band (2, 5) or (1, 6) would select differently
    narrower, wider = ref_clip_cov(data, 0.2, 0.9, 2.0, 5.0)[2], ref_clip_cov(data, 0.2, 0.9, 1.0, 6.0)[2]
    assert narrower.sum() < chosen.sum() < wider.sum()
    assert_matches(OBJECTIVES["clip_cov"].loss, data, loss, grad, modes=("token-mean",), clip_cov_ratio=0.9)
    data = make_data(15)
    loss, grad, chosen = ref_clip_cov(data, 0.2, 0.9, 1.0, 5.0, eps_high=0.3)
    assert not np.allclose(loss, ref_clip_cov(data, 0.2, 0.9, 1.0, 5.0)[0])
    assert ref_clip_cov(data, 0.2, 0.9, 1.0, 5.0, eps_high=math.inf)[2].sum() > chosen.sum()  # PPO-clip excludes some
    assert_matches(OBJECTIVES["clip_cov"].loss, data, loss, grad, modes=("token-mean",), clip_eps_low=0.2,
                   clip_eps_high=0.3, clip_cov_ratio=0.9)


def test_clip_cov_band_is_open():
    """With every advantage equal, ``Cov_t = 0`` exactly: bands ``(0, 5)`` and ``(-1, 0)`` have
    it on an open end and select nothing (the loss is PPO-clip's)."""
    data = make_data(3)
    data["advantages"] = np.where(data["mask"] > 0, 0.5, data["advantages"])  # a mean exact in float32
    fn = OBJECTIVES["clip_cov"].loss
    none, _, _ = run_loss(fn, data, "token-sum", clip_cov_lb=10.0, clip_cov_ub=20.0, clip_cov_ratio=0.9)
    for lb, ub in ((0.0, 5.0), (-1.0, 0.0)):
        loss, metrics, _ = run_loss(fn, data, "token-sum", clip_cov_lb=lb, clip_cov_ub=ub, clip_cov_ratio=0.9)
        assert metrics["cov_selected"] == 0.0 and loss == none, (lb, ub)


def test_clip_cov_draws_exactly_k_candidates_with_the_key():
    """With fewer slots than candidates, k = max(floor(ratio N), 1) of them are drawn; which
    ones depends on the key, and all are candidates."""
    data = make_data(3)
    _, _, candidates = ref_clip_cov(data, 0.2, 0.9, 0.0, 5.0)
    n = data["mask"].sum()
    ratio = 2.0 / n  # k = 2
    fn = OBJECTIVES["clip_cov"].loss
    drawn = []
    for seed in range(4):
        kw = dict(clip_eps_low=0.2, clip_cov_ratio=ratio, clip_cov_lb=0.0, clip_cov_ub=5.0,
                  key=jax.random.key(seed))
        _, metrics, grad = run_loss(fn, data, "token-sum", **kw)
        assert metrics["cov_selected"] == pytest.approx(2 / n, abs=1e-6)
        dropped = (grad == 0) & (data["mask"] > 0) & candidates
        assert dropped.sum() == 2
        drawn.append(tuple(np.flatnonzero(dropped)))
        if seed == 0:
            grad0 = grad
    assert len(set(drawn)) > 1 and drawn[0] != drawn[1]
    # no key: the draw of jax.random.key(0)
    _, _, grad = run_loss(fn, data, "token-sum", clip_eps_low=0.2, clip_cov_ratio=ratio, clip_cov_lb=0.0,
                          clip_cov_ub=5.0)
    np.testing.assert_array_equal(grad, grad0)
    # the paper's default 2e-4 of ~20 tokens still drops one (k >= 1)
    _, metrics, _ = run_loss(fn, data, "token-sum", clip_cov_lb=0.0)
    assert metrics["cov_selected"] == pytest.approx(1 / n, abs=1e-6)


def test_kl_cov_penalises_the_top_covariance_tokens():
    data = make_data(4)
    loss, grad, top = ref_kl_cov(data, 0.2, 1.5)
    metrics = assert_matches(OBJECTIVES["kl_cov"].loss, data, loss, grad, kl_cov_ratio=0.2, kl_cov_coef=1.5)
    assert metrics["cov_selected"] == pytest.approx(len(top) / data["mask"].sum(), abs=1e-6) and len(top) >= 3
    assert_true_gradient("kl_cov", lambda d: ref_kl_cov(d, 0.2, 1.5)[0], data, "seq-mean-token-mean",
                         kl_cov_ratio=0.2, kl_cov_coef=1.5)


def test_kl_cov_counts_response_tokens_and_takes_a_traced_ratio():
    """``k = max(floor(ratio N), 1)`` with ``N`` the 20 response tokens, not the 30 entries of the
    padded batch (ratio 1/15: k = 1, not 2); a traced ratio (a schedule under ``jit``) selects
    the same tokens as the concrete one."""
    data = make_data(4)
    args = [jnp.asarray(data[k], jnp.float32) for k in ("logps", "old_logps", "advantages", "mask")]
    fn = OBJECTIVES["kl_cov"].loss
    traced = jax.jit(lambda r: fn(*args, kl_cov_ratio=r, kl_cov_coef=1.5)[0])
    for ratio, k in ((1 / 15, 1), (0.2, 4)):
        loss, grad, top = ref_kl_cov(data, ratio, 1.5)
        assert len(top) == k
        assert_matches(fn, data, loss, grad, modes=("token-mean",), kl_cov_ratio=ratio, kl_cov_coef=1.5)
        want = references.aggregate(loss, data["mask"], "token-mean")
        np.testing.assert_allclose(float(traced(jnp.float32(ratio))), want, err_msg=str(ratio), **TOL)


def test_kl_cov_at_ratio_one_penalises_every_token_of_a_full_batch():
    """``kl_cov_ratio = 1`` with no padding: ``k = N`` is every entry, the smallest covariance
    included."""
    data = make_data(4)
    data["mask"] = np.ones((B, T))
    for key in ("logps", "old_logps"):  # the garbage is now counted: give it log-probs
        data[key] = np.where(data[key] > 0, -0.5, np.maximum(data[key], -1.5))
    data["advantages"] = np.clip(data["advantages"], -3.0, 3.0)
    loss, grad, top = ref_kl_cov(data, 1.0, 1.5)
    assert len(top) == B * T
    got, metrics, got_grad = run_loss(OBJECTIVES["kl_cov"].loss, data, "token-sum", kl_cov_ratio=1.0, kl_cov_coef=1.5)
    np.testing.assert_allclose(got, loss.sum(), **TOL)
    np.testing.assert_allclose(got_grad, grad, **TOL)
    assert metrics["cov_selected"] == 1.0


def test_an_unknown_keyword_is_named():
    data = make_data(4)
    with pytest.raises(TypeError, match=r"unknown policy-loss keyword\(s\) \['tis_capp'\]; the shared ones are"):
        run_loss(OBJECTIVES["dro"].loss, data, "token-mean", dro_beta=0.1, tis_capp=2.0)


def test_token_covariance_is_the_centred_product_and_zero_off_the_mask():
    from alignax.losses.objectives.cov import token_covariance

    data = make_data(4)
    got = token_covariance(*(jnp.asarray(data[k], jnp.float32) for k in ("logps", "advantages", "mask")))
    np.testing.assert_allclose(got, _cov(data), rtol=1e-5, atol=1e-5)


def test_kl_cov_defaults_are_verls():
    """Ratio 2e-4 (k = 1 of ~20 tokens) and coefficient 1, verl's fallback ``ppo_kl_coef``."""
    data = make_data(4)
    loss, grad, top = ref_kl_cov(data, 2e-4, 1.0)
    metrics = assert_matches(OBJECTIVES["kl_cov"].loss, data, loss, grad, modes=("token-mean",))
    assert len(top) == 1 and metrics["cov_selected"] == pytest.approx(1 / data["mask"].sum(), abs=1e-6)


def test_geo_mean_is_the_clipped_geometric_mean_ratio():
    data = make_data(5)
    data["old_logps"][1, 0], data["advantages"][1, 0] = data["logps"][1, 0] - 0.35, 0.5  # clipped high, 0 < A < 1
    loss, grad = ref_geo_mean(data, 0.2, 0.3)
    metrics = assert_matches(OBJECTIVES["geo_mean"].loss, data, loss, grad, clip_eps_low=0.2, clip_eps_high=0.3)
    low, high = ref_geo_mean_clipfrac(data, 0.2, 0.3)
    assert low > 0 and high > 0
    assert metrics["clipfrac_low"] == pytest.approx(low, abs=1e-6)
    assert metrics["clipfrac_high"] == pytest.approx(high, abs=1e-6)
    # sequence advantages, GRPO's mean over sequences: the value is the paper's mean_i -A_i s_i and
    # the gradient is its derivative (central differences of the reference)
    seq = make_data(5, per_sequence=True)
    loss, grad = ref_geo_mean(seq, 0.2, 0.3)
    assert_matches(OBJECTIVES["geo_mean"].loss, seq, loss, grad, clip_eps_low=0.2, clip_eps_high=0.3)
    assert_true_gradient("geo_mean", lambda d: ref_geo_mean(d, 0.2, 0.3)[0], seq, "seq-mean-token-mean",
                         clip_eps_low=0.2, clip_eps_high=0.3)


def test_geo_mean_default_band_is_the_papers_e_to_the_0_4():
    data = make_data(6)
    loss, grad = ref_geo_mean(data, 0.4, 0.4)
    assert_matches(OBJECTIVES["geo_mean"].loss, data, loss, grad, modes=("seq-mean-token-mean",))
    # clip_eps_high left out is clip_eps_low, on a batch where the upper bound binds
    data = make_data(5)
    loss, grad = ref_geo_mean(data, 0.2, 0.2)
    metrics = assert_matches(OBJECTIVES["geo_mean"].loss, data, loss, grad, modes=("token-mean",), clip_eps_low=0.2)
    high = ref_geo_mean_clipfrac(data, 0.2, 0.2)[1]
    assert high > 0 and metrics["clipfrac_high"] == pytest.approx(high, abs=1e-6)


def test_dro_is_reinforce_with_a_squared_log_ratio():
    data = make_data(7)
    loss, grad = ref_dro(data, 0.3)
    assert_matches(OBJECTIVES["dro"].loss, data, loss, grad, dro_beta=0.3)
    assert_true_gradient("dro", lambda d: ref_dro(d, 0.3)[0], data, "token-mean", dro_beta=0.3)
    with pytest.raises(ValueError, match="dro_beta must be > 0"):
        run_loss(OBJECTIVES["dro"].loss, data, "token-mean", dro_beta=0.0)


@pytest.mark.parametrize("per_sequence", [False, True])
def test_vespo_is_the_gamma_weighted_policy_gradient(per_sequence):
    data = make_data(8, per_sequence=per_sequence)
    loss, grad = ref_vespo(data)
    metrics = assert_matches(OBJECTIVES["vespo"].loss, data, loss, grad)
    assert 0 < metrics["vespo_phi_mean"] and metrics["clipfrac_high"] == 0
    loss, grad = ref_vespo(data, 1.0, 0.5, 4.0, 1.5)
    assert_matches(OBJECTIVES["vespo"].loss, data, loss, grad, modes=("token-mean",), vespo_k_pos=1.0,
                   vespo_lambda_pos=0.5, vespo_k_neg=4.0, vespo_lambda_neg=1.5)


def test_vespo_phi_metric_and_the_clipped_sequence_ratio():
    """``vespo_phi_mean`` is the mean of phi over the response tokens, a token with ``A = 0``
    taking the positive pair (``A >= 0``); ``W`` is clipped to ``[1e-8, e^20]``: a sequence far
    below keeps ``phi(1e-8)`` (tiny, checked relatively), one far above reports ``W = e^20``."""
    data = make_data(8)
    data["advantages"][1, 0] = 0.0
    data["old_logps"][3, :4] = data["logps"][3, :4] + 6.0  # log W = -24 < log 1e-8
    data["old_logps"][4] = data["logps"][4] - 5.0  # log W = 30 > 20
    kw = dict(vespo_k_pos=1.0, vespo_lambda_pos=0.5, vespo_k_neg=4.0, vespo_lambda_neg=1.5)
    phi, ws = ref_vespo_phi(data, 1.0, 0.5, 4.0, 1.5)
    _, metrics, grad = run_loss(OBJECTIVES["vespo"].loss, data, "token-sum", **kw)
    mask = data["mask"] > 0
    assert metrics["vespo_phi_mean"] == pytest.approx(phi[mask].mean(), rel=1e-5)
    np.testing.assert_allclose(grad[3, :4], -phi[3, :4] * data["advantages"][3, :4], rtol=1e-4, atol=0)
    assert metrics["ratio_max"] == pytest.approx(ws.max(), rel=1e-5) and ws.max() == pytest.approx(math.exp(20))


def test_vespo_gamma_weight_counts_an_overflowing_phi_as_zero():
    """``phi = exp(lambda + k log W - lambda W)`` overflows for a large ``k`` at ``W = e^20``
    (``lambda`` floored at 1e-4): a non-finite phi is 0, not inf and not 1."""
    from alignax.losses.objectives.vespo import gamma_weight

    phi = gamma_weight(jnp.asarray([20.0, 0.0]), jnp.asarray([1.0, 1.0]), k_pos=1e4, lambda_pos=0.0, k_neg=1.0,
                       lambda_neg=1.0)
    np.testing.assert_array_equal(phi, [0.0, 1.0])  # and phi(1) = 1


def test_vespo_phi_is_one_on_policy_and_fades_far_off_it():
    """phi(1) = 1: on-policy VESPO is REINFORCE; a sequence ratio of e^3 gets almost nothing."""
    data = make_data(9)
    on = {**data, "old_logps": np.where(data["mask"] > 0, data["logps"], data["old_logps"])}
    a, b, c, _ = (jnp.asarray(on[k], jnp.float32) for k in ("logps", "old_logps", "advantages", "mask"))
    mask = jnp.asarray(on["mask"], jnp.float32)
    got = OBJECTIVES["vespo"].loss(a, b, c, mask)[0]
    np.testing.assert_allclose(float(got), float(pg_loss(a, b, c, mask)[0]), rtol=1e-6)
    far = OBJECTIVES["vespo"].loss(a, b - 3.0 / 6, c, mask)[1]["vespo_phi_mean"]
    assert float(far) < 0.05


def test_vespo_folds_the_sampler_correction_into_its_ratio():
    """TRL: log W = sum lr + sum log(min(pi_old / pi_sampler, cap)); the loss is not multiplied again."""
    data = make_data(10)
    mask = data["mask"] > 0
    log_w = np.where(mask, np.minimum(data["old_logps"] - data["sampler_logps"], math.log(1.3)), 0.0).sum(1)
    loss, grad = ref_vespo(data, seq_extra=log_w)
    assert_matches(OBJECTIVES["vespo"].loss, data, loss, grad, sampler_logps=jnp.asarray(data["sampler_logps"],
                                                                                          jnp.float32), tis_cap=1.3)


def test_gpg_is_the_plain_policy_gradient():
    """GPG's objective is -A logp (Chu et al. 2025, eq. 4: no ratio, no clip); its own part
    is its advantage, an estimator."""
    assert OBJECTIVES["gpg"].loss is pg_loss and OBJECTIVES["gpg"].ratio is False
    data = make_data(11)
    adv = _per_token_adv(data)
    ref = np.where(data["mask"] > 0, -adv * data["logps"], 0.0)
    assert_matches(OBJECTIVES["gpg"].loss, data, ref, np.where(data["mask"] > 0, -adv, 0.0))


# ---------------------------------------------------------------------------------------
# The shared options reach every new objective
# ---------------------------------------------------------------------------------------

NEW = ("dppo_tv", "dppo_kl", "clip_cov", "kl_cov", "geo_mean", "dro", "vespo")
HP = {"dro": dict(dro_beta=0.2), "clip_cov": dict(clip_cov_lb=0.0, clip_cov_ratio=0.9)}


@pytest.mark.parametrize("name", NEW)
def test_kl_entropy_and_tis_options_apply(name):
    """loss(KL, entropy, TIS) = agg(w l) - c_H agg(H) + c_KL agg(k3), w = min(pi_old / pi_s, cap)
    (VESPO folds w into its ratio instead: its policy term is not multiplied)."""
    data = make_data(12)
    f = lambda k: jnp.asarray(data[k], jnp.float32)  # noqa: E731
    args = [f(k) for k in ("logps", "old_logps", "advantages", "mask")]
    rng = np.random.default_rng(0)
    ref = data["logps"] + rng.uniform(-0.3, 0.3, (B, T))
    entropy = rng.uniform(0.0, 2.0, (B, T))
    fn, hp = OBJECTIVES[name].loss, HP.get(name, {})
    for mode in ("token-mean", "seq-mean-token-mean"):
        base, bm = fn(*args, aggregation=mode, **hp)
        full, fm = fn(*args, aggregation=mode, ref_logps=jnp.asarray(ref, jnp.float32), kl_coef=0.3,
                      entropy=jnp.asarray(entropy, jnp.float32), entropy_coef=0.05, **hp)
        k3 = np.exp(ref - data["logps"]) - (ref - data["logps"]) - 1
        want = float(base) + 0.3 * references.aggregate(k3, data["mask"], mode) - 0.05 * references.aggregate(
            entropy, data["mask"], mode)
        np.testing.assert_allclose(float(full), want, rtol=1e-5, err_msg=mode)
        assert fm["pg_loss"] == bm["pg_loss"] and "kl" in fm and "entropy" in fm
    _, tm = fn(*args, sampler_logps=f("sampler_logps"), tis_cap=1.1, **hp)
    _, bm = fn(*args, **hp)
    assert 0 < float(tm["tis_weight_mean"]) < 1.1 and float(tm["pg_loss"]) != float(bm["pg_loss"])


# ---------------------------------------------------------------------------------------
# verl's rollout correction (sampler_correction) and bypass mode
# ---------------------------------------------------------------------------------------


def ref_correction(log_rho, mask, cap, level, rejection, lo, hi):
    weight, keep = np.ones((B, T)), np.ones((B, T))
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        seq = sum(log_rho[i, t] for t in toks)
        geo = seq / len(toks) if toks else 0.0
        for t in toks:
            rho = math.exp(log_rho[i, t]) if level == "token" else math.exp(seq)
            weight[i, t] = 1.0 if cap is None else min(rho, cap)
            stat = {"token": math.exp(log_rho[i, t]), "sequence": math.exp(seq), "geometric": math.exp(geo),
                    None: 1.0}[rejection]
            keep[i, t] = float(lo <= stat <= hi)
    return weight, keep


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("rejection", [None, "token", "sequence", "geometric"])
def test_sampler_correction_matches_verls_definitions(level, rejection):
    data = make_data(13)
    mask = data["mask"]
    log_rho = np.where(mask > 0, data["old_logps"] - data["sampler_logps"], 123.0)
    lo, hi = (0.95, 1.05) if rejection == "geometric" else (0.7, 1.3)
    for cap in (None, 1.2):
        got = sampler_correction(jnp.asarray(log_rho, jnp.float32), jnp.asarray(mask), tis_cap=cap, tis_level=level,
                                 rejection=rejection, rejection_bounds=(lo, hi))
        weight, keep = ref_correction(log_rho, mask, cap, level, rejection, lo, hi)
        np.testing.assert_allclose(np.asarray(got.weight)[mask > 0], weight[mask > 0], rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(got.keep)[mask > 0], keep[mask > 0])
        if rejection is not None:
            assert 0 < keep[mask > 0].mean() < 1  # the bounds cut somewhere, not everywhere


def ref_batch_normalized(log_rho, mask, cap, level):
    """verl's ``rollout_is_batch_normalize`` (``rollout_corr_helper.py``,
    ``compute_rollout_correction_weights``): the truncated weights over their mean, token level
    over every response token, sequence level over the rows' weights (each a row's mean over
    its tokens) of the rows with a token; a mean <= 1e-8 leaves them. Returns (weights, mean)."""
    weight, _ = ref_correction(log_rho, mask, cap, level, None, 0.0, 1.0)
    rows = [i for i in range(B) if mask[i].sum() > 0]
    if level == "token":
        mean = sum(weight[i, t] for i in rows for t in range(T) if mask[i, t]) / mask.sum()
    else:
        mean = sum(sum(weight[i, t] for t in range(T) if mask[i, t]) / mask[i].sum() for i in rows) / len(rows)
    return (weight / mean if mean > 1e-8 else weight), (mean if mean > 1e-8 else 1.0)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalized_weights_match_verls_definition(level):
    """The weights average 1 after ``tis_batch_normalize``, divided by verl's mean (rejected
    tokens and the empty row 2 as verl counts them: the first in, the second out); the row's
    log-weight (VESPO's) moves with them; the loss's policy term and metric follow."""
    data = make_data(19)
    mask, log_rho = data["mask"], _log_rho(data)
    assert mask[2].sum() == 0  # the empty row
    cap = 1.1 if level == "token" else 1.5
    x, m = jnp.asarray(log_rho, jnp.float32), jnp.asarray(mask)
    got = sampler_correction(x, m, tis_cap=cap, tis_level=level, rejection="token", rejection_bounds=(0.9, 1.1),
                             batch_normalize=True)
    want, mean = ref_batch_normalized(log_rho, mask, cap, level)
    on = mask > 0
    assert abs(mean - 1.0) > 1e-2  # the factor is not 1, so dividing by it shows
    np.testing.assert_allclose(float(got.norm_factor), mean, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got.weight)[on], want[on], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.weight)[~on], 1.0)
    assert 0 < 1 - np.asarray(got.keep)[on].mean() < 1  # the rejection cuts, and does not change the mean
    rows = [i for i in range(B) if on[i].any()]
    # the log of the weight a row carries: the sum of its tokens' logs, or its one weight's log
    per_row = [np.log(want[i][on[i]]).sum() if level == "token" else np.log(want[i][on[i]][0]) for i in rows]
    np.testing.assert_allclose(np.asarray(got.seq_log_weight)[rows], per_row, rtol=1e-5, atol=1e-6)
    plain = sampler_correction(x, m, tis_cap=cap, tis_level=level)
    assert float(plain.norm_factor) == 1.0
    # all masked: no mean to take, the weights stay
    empty = sampler_correction(x, jnp.zeros_like(m), tis_cap=cap, tis_level=level, batch_normalize=True)
    assert float(empty.norm_factor) == 1.0
    # through a loss: REINFORCE with the normalised weights
    metrics = _weighted_reinforce_matches(data, want, on, tis_cap=cap, tis_level=level, tis_batch_normalize=True)
    np.testing.assert_allclose(float(metrics["tis_batch_norm_factor"]), mean, rtol=1e-5)
    with pytest.raises(ValueError, match="tis_batch_normalize=True needs sampler_logps= and a tis_cap"):
        pg_loss(*_loss_args(data)[0], sampler_logps=_loss_args(data)[1], tis_cap=None, tis_batch_normalize=True)


def test_a_weight_mean_of_exactly_1e_8_leaves_the_weights():
    """``m <= 1e-8`` leaves the weights as they are, ``m = 1e-8`` included: every ratio above a
    cap of 1e-8 is truncated to the cap, so the token-level mean over the two tokens is float32
    1e-8 exactly (``2c / 2``) and the factor stays 1; a cap twice that is divided out."""
    log_rho, mask = jnp.asarray([[0.1, -0.2, 0.0]], jnp.float32), jnp.asarray([[1.0, 1.0, 0.0]])
    at = sampler_correction(log_rho, mask, tis_cap=1e-8, batch_normalize=True)
    assert float(at.norm_factor) == 1.0
    np.testing.assert_array_equal(np.asarray(at.weight), np.float32([[1e-8, 1e-8, 1.0]]))
    above = sampler_correction(log_rho, mask, tis_cap=2e-8, batch_normalize=True)
    assert float(above.norm_factor) == np.float32(2e-8)
    np.testing.assert_allclose(np.asarray(above.weight), [[1.0, 1.0, 1.0]], rtol=1e-6)


def ref_icepop(log_rho, mask, lower, upper, level):
    """verl's IcePop (``rollout_corr_helper.py``, ``compute_rollout_correction_weights``,
    ``rollout_is_threshold: "lower_upper"``): the raw weight (the token's ratio, or the row's
    product of them clamped to exp(+-20)) where ``lower <= w <= upper``, else 0."""
    weight = np.zeros((B, T))
    for i in range(B):
        seq = sum(log_rho[i, t] for t in range(T) if mask[i, t])
        for t in range(T):
            if mask[i, t]:
                raw = math.exp(log_rho[i, t] if level == "token" else max(-20.0, min(20.0, seq)))
                weight[i, t] = raw if lower <= raw <= upper else 0.0
    return weight


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_icepop_weights_match_verls_definition(level):
    """``tis_lower`` with ``tis_cap``: the ratio inside the bounds, 0 outside (not truncated, not
    a mask: ``keep`` stays 1); the empty row and off-mask positions weigh 1; batch normalisation
    counts the zeros; a row's log-weight stays finite; the loss and its out-of-bounds fraction."""
    data = make_data(20)
    mask, log_rho = data["mask"], _log_rho(data)
    lower, upper = (0.9, 1.1) if level == "token" else (0.8, 1.25)
    x, m = jnp.asarray(log_rho, jnp.float32), jnp.asarray(mask)
    got = sampler_correction(x, m, tis_cap=upper, tis_lower=lower, tis_level=level)
    want = ref_icepop(log_rho, mask, lower, upper, level)
    on = mask > 0
    assert 0 < (want[on] == 0).mean() < 1  # the bounds zero some weights, not all
    np.testing.assert_allclose(np.asarray(got.weight)[on], want[on], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.weight)[~on], 1.0)
    np.testing.assert_array_equal(np.asarray(got.keep), 1.0)
    assert np.all(np.isfinite(np.asarray(got.seq_log_weight)))
    truncated = sampler_correction(x, m, tis_cap=upper, tis_level=level)
    assert np.all(np.asarray(truncated.weight)[on] > 0)  # without tis_lower: min(rho, cap), never 0
    normed = sampler_correction(x, m, tis_cap=upper, tis_lower=lower, tis_level=level, batch_normalize=True)
    rows = [i for i in range(B) if on[i].any()]
    mean = want[on].mean() if level == "token" else np.mean([want[i][on[i]][0] for i in rows])
    np.testing.assert_allclose(float(normed.norm_factor), mean, rtol=1e-5)
    metrics = _weighted_reinforce_matches(data, want, on, tis_cap=upper, tis_lower=lower, tis_level=level)
    np.testing.assert_allclose(float(metrics["tis_out_of_bounds"]), (want[on] == 0).mean(), rtol=1e-6)
    with pytest.raises(ValueError, match="tis_lower must be 0 < tis_lower <= tis_cap"):
        sampler_correction(x, m, tis_cap=1.0, tis_lower=1.5)
    with pytest.raises(ValueError, match="tis_lower=0.5 needs sampler_logps= and a tis_cap"):
        pg_loss(*_loss_args(data)[0], sampler_logps=_loss_args(data)[1], tis_cap=None, tis_lower=0.5)
    with pytest.raises(ValueError, match="tis_lower=0.5 needs sampler_logps= and a tis_cap"):
        pg_loss(*_loss_args(data)[0], tis_lower=0.5)
    with pytest.raises(ValueError, match="tis_lower=0.5 needs a tis_cap"):
        sampler_correction(x, m, tis_cap=None, tis_lower=0.5)


def test_a_rows_product_is_clamped_to_exp_20_and_its_log_weight_is_its_weights_log():
    """Sequence level (verl clamps the log of a row's product to +-20 before ``exp``): a row of
    log-ratios summing to 24 weighs ``e^20`` and one summing to -24 ``e^-20`` (a cap of 1e9 above
    ``e^20`` does not cut the first), and ``seq_log_weight`` (VESPO's) is the log of each row's
    weight: truncated, and IcePop's, where a zeroed row carries ``log 1e-30``."""
    log_rho = jnp.asarray([[8.0, 8.0, 8.0], [-8.0, -8.0, -8.0], [0.1, 0.2, 0.0]], jnp.float32)
    mask = jnp.asarray([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    got = sampler_correction(log_rho, mask, tis_cap=1e9, tis_level="sequence")
    want = np.array([20.0, -20.0, 0.3])
    np.testing.assert_allclose(np.asarray(got.weight)[:, 0], np.exp(want), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got.seq_log_weight), want, rtol=1e-5, atol=1e-6)
    # IcePop on [1, 1e9]: the first row in the band, the second below it, the third in it
    ice = sampler_correction(log_rho, mask, tis_cap=1e9, tis_lower=1.0, tis_level="sequence")
    np.testing.assert_allclose(np.asarray(ice.weight)[:, 0], [math.exp(20.0), 0.0, math.exp(0.3)], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(ice.seq_log_weight), [20.0, math.log(1e-30), 0.3], rtol=1e-5)
    ice = sampler_correction(log_rho, mask, tis_cap=1.5, tis_lower=1.0, tis_level="sequence")  # first row above
    np.testing.assert_allclose(np.asarray(ice.seq_log_weight), [math.log(1e-30)] * 2 + [0.3], rtol=1e-5)


def test_a_tokens_log_ratio_is_clipped_to_20_and_the_default_cap_is_2():
    """Token level: ``log rho`` is clipped to +-20 before anything reads it (a cap of 1e9 above
    ``e^20`` does not cut the first token; the divergences see the clipped value too), and without
    ``tis_cap`` a ratio of ``e`` is truncated at the documented default, 2."""
    log_rho, mask = jnp.asarray([[30.0, -30.0, 1.0]], jnp.float32), jnp.ones((1, 3))
    got = sampler_correction(log_rho, mask, tis_cap=1e9, rejection_divergences={"token_k2": 250.0})
    np.testing.assert_allclose(np.asarray(got.weight), [[math.exp(20.0), math.exp(-20.0), math.e]], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got.keep), [[1.0, 1.0, 1.0]])  # k2 = 200 <= 250, not 450
    default = sampler_correction(log_rho, mask)
    np.testing.assert_allclose(np.asarray(default.weight), [[2.0, math.exp(-20.0), 2.0]], rtol=1e-5)


def test_icepop_keeps_a_ratio_on_either_bound():
    """IcePop keeps ``rho`` where ``tis_lower <= rho <= tis_cap``: a ratio of exactly 1 (log 0)
    on the lower bound 1 and on the cap 1 weighs 1, as the one inside does."""
    log_rho, mask = jnp.zeros((1, 2), jnp.float32), jnp.ones((1, 2))
    for lower, cap in ((1.0, 2.0), (0.5, 1.0), (1.0, 1.0)):
        got = sampler_correction(log_rho, mask, tis_cap=cap, tis_lower=lower)
        np.testing.assert_array_equal(np.asarray(got.weight), [[1.0, 1.0]], err_msg=f"{lower}, {cap}")


def test_bypass_reinforce_takes_the_current_policys_weight():
    """Bypass mode, REINFORCE: old_logps are the sampler's; l_t = -min(sg(pi_theta)/pi_s, cap) A_t logp_t,
    and a rejected sequence (geometric mean outside the bounds) loses its policy term."""
    data = make_data(14)
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    lp, s, adv, mask = (f(data[k]) for k in ("logps", "sampler_logps", "advantages", "mask"))
    kw = dict(sampler_logps=s, tis_cap=1.5, tis_ratio="current", rejection="geometric", rejection_bounds=(0.8, 1.25),
              aggregation="token-sum")
    (loss, metrics), grad = jax.value_and_grad(lambda x: pg_loss(x, s, adv, mask, **kw), has_aux=True)(lp)
    m = data["mask"]
    log_rho = np.where(m > 0, data["logps"] - data["sampler_logps"], 0.0)
    weight, keep = ref_correction(log_rho, m, 1.5, "token", "geometric", 0.8, 1.25)
    a = _per_token_adv(data)
    want = -(weight * keep * a * np.where(m > 0, data["logps"], 0.0))[m > 0].sum()
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad)[m > 0], (-(weight * keep * a))[m > 0], rtol=1e-5)
    assert 0 < metrics["rejected"] < 1
    # tis_ratio="old" would weigh by pi_old / pi_sampler = 1 here: the option is what makes it REINFORCE with IS
    plain = pg_loss(lp, s, adv, mask, **{**kw, "tis_ratio": "old", "rejection": None})[0]
    np.testing.assert_allclose(float(plain), -(a * np.where(m > 0, data["logps"], 0.0))[m > 0].sum(), rtol=1e-5)


def test_rejection_without_the_samplers_logps_is_refused():
    data = make_data(15)
    args = [jnp.asarray(data[k], jnp.float32) for k in ("logps", "old_logps", "advantages", "mask")]
    with pytest.raises(ValueError, match="rejection='token' needs sampler_logps="):
        pg_loss(*args, rejection="token")
    with pytest.raises(ValueError, match="unknown rejection 'seq'"):
        sampler_correction(args[0], args[3], rejection="seq")
    with pytest.raises(ValueError, match="rejection_bounds must be 0 < lo <= hi"):
        sampler_correction(args[0], args[3], rejection="token", rejection_bounds=(2.0, 0.5))


def test_sampler_correction_refuses_a_log_rho_that_is_not_b_t():
    """The rows' products, means and maxima are over the last axis of ``[B, T]``: a ``[B, T, K]``
    ``log_rho`` (which would broadcast into weights of nonsense) or a ``[T]`` one is refused."""
    for shape in ((2, 3, 3), (3,)):
        with pytest.raises(ValueError, match=rf"log_rho must have rank 2; got shape \({shape[0]},"):
            sampler_correction(jnp.zeros(shape), jnp.ones(shape), tis_cap=2.0, rejection_divergences={"seq_max_k2": 1.0})


def test_ratio_bounds_keep_a_ratio_on_either_bound_and_geometric_is_per_token():
    """``lo <= rho <= hi`` keeps a ratio of exactly 1 (log 0) with ``lo = 1`` or ``hi = 1``;
    ``geometric`` divides a row's log-product by its number of response tokens, 1 for a
    one-token row: ``e^0.6 = 1.82`` is outside ``[0.5, 1.5]`` (halved, ``e^0.3``, it would be in)."""
    log_rho, mask = jnp.zeros((1, 2), jnp.float32), jnp.ones((1, 2))
    for bounds in ((1.0, 2.0), (0.5, 1.0), (1.0, 1.0)):
        got = sampler_correction(log_rho, mask, tis_cap=None, rejection="token", rejection_bounds=bounds)
        np.testing.assert_array_equal(np.asarray(got.keep), [[1.0, 1.0]], err_msg=str(bounds))
    one = sampler_correction(jnp.asarray([[0.6, 0.0], [0.2, 0.4]], jnp.float32), jnp.asarray([[1.0, 0.0], [1.0, 1.0]]),
                             tis_cap=None, rejection="geometric", rejection_bounds=(0.5, 1.5))
    np.testing.assert_array_equal(np.asarray(one.keep), [[0.0, 1.0], [1.0, 1.0]])


def test_sampler_correction_stays_float32_with_x64_on():
    """``SamplerCorrection`` is documented float32: the masks too under ``jax.enable_x64``."""
    with jax.enable_x64(True):
        got = sampler_correction(np.array([[0.1, -0.3, 0.0]]), np.array([[1.0, 1.0, 0.0]]), tis_cap=2.0,
                                 rejection="token", rejection_divergences={"token_k2": 0.01})
    dtypes = {"weight": got.weight.dtype, "keep": got.keep.dtype, "seq_log_weight": got.seq_log_weight.dtype,
              **{name: kept.dtype for name, kept in got.kept_by.items()}}
    assert all(dtype == jnp.float32 for dtype in dtypes.values()), dtypes
    np.testing.assert_array_equal(np.asarray(got.keep), [[1.0, 0.0, 1.0]])  # k2(-0.3) = 0.045 > 0.01


def ref_divergence_stat(log_rho, mask, criterion):
    """verl's rollout_rs statistic of ``criterion`` per token position (a row's on each of its
    tokens), from the definitions: k2 = (log rho)^2 / 2, k3 = rho - 1 - log rho; sum, mean or
    max over the row's response tokens. ``None`` off the mask; an empty row has no position."""
    level, k = criterion.rsplit("_", 1)
    div = (lambda x: 0.5 * x * x) if k == "k2" else (lambda x: math.exp(x) - 1.0 - x)
    stat = np.full((B, T), np.nan)
    for i in range(B):
        toks = [t for t in range(T) if mask[i, t]]
        per = [div(float(log_rho[i, t])) for t in toks]
        row = {"token": None, "seq_sum": sum(per), "seq_mean": sum(per) / len(per) if per else 0.0,
               "seq_max": max(per, default=0.0)}[level]
        for j, t in enumerate(toks):
            stat[i, t] = per[j] if level == "token" else row
    return stat


def _log_rho(data):
    return np.where(data["mask"] > 0, data["old_logps"] - data["sampler_logps"], 123.0)  # garbage off the mask


@pytest.mark.parametrize("criterion", REJECTION_DIVERGENCES)
def test_each_divergence_criterion_matches_verls_definition(criterion):
    """Each criterion keeps a token (a row) where its divergence is <= the bound; the bound is
    set between observed values so it cuts somewhere; the empty row and positions off the
    mask are kept; the k1 mask and the weight are untouched."""
    data = make_data(16)
    mask, log_rho = data["mask"], _log_rho(data)
    stat = ref_divergence_stat(log_rho, mask, criterion)
    values = np.unique(stat[mask > 0])
    bound = float(np.median(values))
    got = sampler_correction(jnp.asarray(log_rho, jnp.float32), jnp.asarray(mask), tis_cap=1.2,
                             rejection_divergences={criterion: bound})
    want = (stat <= bound).astype(float)
    np.testing.assert_array_equal(np.asarray(got.keep)[mask > 0], want[mask > 0])
    np.testing.assert_array_equal(np.asarray(got.kept_by[criterion]), np.asarray(got.keep))
    assert 0 < want[mask > 0].mean() < 1
    assert np.all(np.asarray(got.keep)[mask == 0] == 1)  # the empty row (2) and the prompt / padding
    plain = sampler_correction(jnp.asarray(log_rho, jnp.float32), jnp.asarray(mask), tis_cap=1.2)
    np.testing.assert_array_equal(np.asarray(got.weight), np.asarray(plain.weight))
    jitted = jax.jit(lambda x, m: sampler_correction(x, m, tis_cap=1.2, rejection_divergences={criterion: bound}))(
        jnp.asarray(log_rho, jnp.float32), jnp.asarray(mask))
    np.testing.assert_array_equal(np.asarray(jitted.kept_by[criterion]), np.asarray(got.kept_by[criterion]))


def test_seq_mean_of_a_one_token_row_is_that_tokens_divergence():
    """``seq_mean_kN`` divides a row's sum by its number of response tokens, 1 for a one-token
    row: k2 of ``log rho = 0.6`` is 0.18, over the bound 0.12 (rejected; halved it would be
    kept), while the two-token row of k2 0.02 and 0.18 has mean 0.1 (kept); the empty row is kept."""
    log_rho = jnp.asarray([[0.6, 0.0, 0.0], [0.2, -0.6, 0.0], [0.0, 0.0, 0.0]], jnp.float32)
    mask = jnp.asarray([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    got = sampler_correction(log_rho, mask, tis_cap=None, rejection_divergences={"seq_mean_k2": 0.12})
    np.testing.assert_array_equal(np.asarray(got.keep), [[0.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])


def test_divergence_criteria_chain_with_each_other_and_the_ratio_bounds():
    """verl's comma-separated rollout_rs: a token is kept only where every criterion keeps it,
    the k1 ratio bounds (rollout.rejection) included; the loss's ``rejected`` counts the union
    and ``rejected_<criterion>`` each one."""
    data = make_data(17)
    mask, log_rho = data["mask"], _log_rho(data)
    bounds = {"token_k3": 0.028, "seq_max_k2": 0.045}
    got = sampler_correction(jnp.asarray(log_rho, jnp.float32), jnp.asarray(mask), tis_cap=None,
                             rejection="token", rejection_bounds=(0.8, 1.3), rejection_divergences=bounds)
    keeps = {name: ref_divergence_stat(log_rho, mask, name) <= bound for name, bound in bounds.items()}
    ratio_keep = (np.exp(log_rho) >= 0.8) & (np.exp(log_rho) <= 1.3)
    want = ratio_keep & keeps["token_k3"] & keeps["seq_max_k2"]
    on = mask > 0
    np.testing.assert_array_equal(np.asarray(got.keep)[on], want[on])
    # each part cuts something the others keep, so dropping any one of them would change the mask
    for name in bounds:
        others = ratio_keep & np.logical_and.reduce([keeps[n] for n in bounds if n != name])
        assert np.any(others[on] & ~keeps[name][on]), name
    assert np.any((keeps["token_k3"] & keeps["seq_max_k2"])[on] & ~ratio_keep[on])
    # through a loss: the policy term of the dropped tokens is gone, the metrics say how many
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    args = [f(data[k]) for k in ("logps", "old_logps", "advantages", "mask")]
    loss, metrics = pg_loss(*args, sampler_logps=f(data["sampler_logps"]), tis_cap=None, rejection="token",
                            rejection_bounds=(0.8, 1.3), rejection_divergences=bounds, aggregation="token-sum")
    a, lp = _per_token_adv(data), data["logps"]
    np.testing.assert_allclose(float(loss), -(want * a * lp)[on].sum(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["rejected"]), 1 - want[on].mean(), rtol=1e-6)
    for name in bounds:
        np.testing.assert_allclose(float(metrics[f"rejected_{name}"]), 1 - keeps[name][on].mean(), rtol=1e-6)


def test_divergence_criteria_are_checked():
    data = make_data(18)
    args = [jnp.asarray(data[k], jnp.float32) for k in ("logps", "old_logps", "advantages", "mask")]
    with pytest.raises(ValueError, match=r"rejection_divergences has unknown criteria \['seq_k2', 'token_k1'\]; "
                                         r"valid: token_k2, token_k3, seq_sum_k2"):
        sampler_correction(args[0], args[3], rejection_divergences={"seq_k2": 1.0, "token_k1": 2.0})
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="rejection_divergences.seq_max_k3 must be > 0"):
            sampler_correction(args[0], args[3], rejection_divergences={"seq_max_k3": bad})
    with pytest.raises(TypeError, match="rejection_divergences.token_k2 must be a number"):
        sampler_correction(args[0], args[3], rejection_divergences={"token_k2": "2.0"})
    with pytest.raises(TypeError, match="rejection_divergences must map criterion names"):
        sampler_correction(args[0], args[3], rejection_divergences=["token_k2"])
    with pytest.raises(ValueError, match="needs sampler_logps="):
        pg_loss(*args, rejection_divergences={"token_k2": 1.0})


def ref_verl_k1_keep(log_rho, mask, options, thresholds):
    """verl's ``compute_rollout_rejection_mask`` for its k1 options (``rollout_corr_helper.py``
    at 1dda039), written from its code: ``log_ratio = log pi - log pi_sampler`` clamped to
    +-20, ``token_k1 = -log_ratio``; ``token_k1`` keeps a token, ``seq_sum_k1`` /
    ``seq_mean_k1`` a row (masked sum / ``sum / (count + 1e-8)``), when ``log lo <= stat <=
    log hi`` for the option's ``"lo_hi"`` threshold; a token survives only if every option
    keeps it (the product of the masks), and off the response mask it is 0."""
    safe = np.clip(log_rho, -20.0, 20.0)
    k1 = np.where(mask > 0, -safe, 0.0)
    keep = np.ones((B, T))
    for option, spec in zip(options.split(","), thresholds.split(",")):
        lo, hi = (math.log(float(x)) for x in spec.split("_"))
        stat = {"token_k1": k1, "seq_sum_k1": k1.sum(1, keepdims=True),
                "seq_mean_k1": k1.sum(1, keepdims=True) / (mask.sum(1, keepdims=True) + 1e-8)}[option]
        keep = keep * np.broadcast_to((stat >= lo) & (stat <= hi), (B, T))
    return keep * mask


def test_chained_ratio_bounds_match_verls_chained_k1_options():
    """rejection as a mapping: verl's ``rollout_rs: "token_k1,seq_mean_k1"`` with
    ``rollout_rs_threshold: "0.7_1.25,0.96_1.04"``. verl's k1 bounds the inverse ratio
    ``pi_sampler / pi``, so its ``lo_hi`` is ``[1/hi, 1/lo]`` on ours. Each criterion drops
    tokens the other keeps; the empty row (2) and positions off the mask are kept; the
    scalar form is the one-entry mapping; the loss drops the union and logs each part."""
    data = make_data(19)
    mask, log_rho = data["mask"], _log_rho(data)
    on = mask > 0
    want = ref_verl_k1_keep(log_rho, mask, "token_k1,seq_mean_k1", "0.7_1.25,0.96_1.04") > 0
    token = ref_verl_k1_keep(log_rho, mask, "token_k1", "0.7_1.25") > 0
    geometric = ref_verl_k1_keep(log_rho, mask, "seq_mean_k1", "0.96_1.04") > 0
    # both bind, on different tokens: dropping either criterion would change the mask
    assert np.any(token[on] & ~geometric[on]) and np.any(geometric[on] & ~token[on])
    bounds = {"token": (1 / 1.25, 1 / 0.7), "geometric": (1 / 1.04, 1 / 0.96)}
    x, m = jnp.asarray(log_rho, jnp.float32), jnp.asarray(mask)
    got = sampler_correction(x, m, tis_cap=None, rejection=bounds)
    np.testing.assert_array_equal(np.asarray(got.keep)[on], want[on])
    np.testing.assert_array_equal(np.asarray(got.kept_by["token"])[on], token[on])
    np.testing.assert_array_equal(np.asarray(got.kept_by["geometric"])[on], geometric[on])
    assert np.all(np.asarray(got.keep)[~on] == 1)  # the empty row and the prompt / padding
    jitted = jax.jit(lambda x, m: sampler_correction(x, m, tis_cap=None, rejection=bounds))(x, m)
    np.testing.assert_array_equal(np.asarray(jitted.keep), np.asarray(got.keep))
    for name, kept in (("token", token), ("geometric", geometric)):
        one = sampler_correction(x, m, tis_cap=None, rejection=name, rejection_bounds=bounds[name])
        np.testing.assert_array_equal(np.asarray(one.keep)[on], kept[on])
        np.testing.assert_array_equal(np.asarray(sampler_correction(x, m, tis_cap=None, rejection={
            name: bounds[name]}).keep), np.asarray(one.keep))
    f = lambda v: jnp.asarray(v, jnp.float32)  # noqa: E731
    args = [f(data[k]) for k in ("logps", "old_logps", "advantages", "mask")]
    loss, metrics = pg_loss(*args, sampler_logps=f(data["sampler_logps"]), tis_cap=None, rejection=bounds,
                            aggregation="token-sum")
    np.testing.assert_allclose(float(loss), -(want * _per_token_adv(data) * data["logps"])[on].sum(), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["rejected"]), 1 - want[on].mean(), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["rejected_token"]), 1 - token[on].mean(), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["rejected_geometric"]), 1 - geometric[on].mean(), rtol=1e-6)


def test_chained_ratio_bounds_are_checked():
    x, m = jnp.zeros((B, T)), jnp.ones((B, T))
    with pytest.raises(ValueError, match=r"rejection has unknown criteria \['seq_mean_k1'\]; valid: token, "):
        sampler_correction(x, m, rejection={"seq_mean_k1": (0.9, 1.1)})
    with pytest.raises(ValueError, match=r"rejection.geometric must be 0 < lo <= hi on the ratio"):
        sampler_correction(x, m, rejection={"token": (0.5, 2.0), "geometric": (1.1, 0.9)})
    with pytest.raises(TypeError, match=r"rejection.token must be \[lo, hi\]"):
        sampler_correction(x, m, rejection={"token": 2.0})
    with pytest.raises(TypeError, match="rejection must be one of token, sequence, geometric or map them"):
        sampler_correction(x, m, rejection=["token", "geometric"])
    with pytest.raises(ValueError, match=r"rejection maps no criterion; name one .* or set null"):
        sampler_correction(x, m, rejection={})
    with pytest.raises(TypeError, match=r"rejection.token must be \[lo, hi\], two numbers"):
        sampler_correction(x, m, rejection={"token": ("a", "b")})


# ---------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------


def test_every_entry_reads_keys_its_loss_takes_and_the_config_has():
    import inspect

    from alignax.trainers.config import GRPOSection

    fields = set(GRPOSection.__dataclass_fields__)
    for name, entry in OBJECTIVES.items():
        params = inspect.signature(entry.loss).parameters
        assert set(entry.keys) <= set(params), (name, entry.keys)
        assert set(entry.keys) <= fields, (name, set(entry.keys) - fields)
        assert ("key" in params) == entry.rng, name
    assert set(NEW) | {"gpg"} <= set(OBJECTIVES)
    from alignax.losses import POLICY_LOSSES

    # policy.py's five losses are the registry's entries of the same names, not copies
    assert all(OBJECTIVES[name].loss is fn for name, fn in POLICY_LOSSES.items())
    assert objectives.readers("dro_beta") == ("dro",)
    with pytest.raises(ValueError, match="unknown policy loss 'nope'"):
        objectives.objective("nope")


def test_keys_are_every_key_read_once_in_the_registrys_order():
    """``keys()`` (the rows of the key table): each key some entry reads, once, in the order the
    registry first reads it, and each has a reader."""
    read = [k for entry in OBJECTIVES.values() for k in entry.keys]
    got = objectives.keys()
    assert set(got) == set(read) and len(got) == len(set(got)) and "dro_beta" in got
    assert list(got) == sorted(got, key=read.index)
    assert all(objectives.readers(k) for k in got)


# ---------------------------------------------------------------------------------------
# Adding an objective: its module and one entry
# ---------------------------------------------------------------------------------------

TOY_MODULE = '''\
"""A toy objective: the log-ratio itself, l_t = -A_t * clip(logps_t - old_logps_t, -eps, eps)."""

import jax.numpy as jnp

from alignax.losses.objectives._base import Objective, Surrogate, run


def toy_policy_loss(logps, old_logps, advantages, mask, *, clip_eps_low=0.5, aggregation="token-mean", **shared):
    def surrogate(tok):
        never = jnp.zeros(tok.mask.shape, bool)
        per_token = -tok.advantages * jnp.clip(tok.log_ratio, -clip_eps_low, clip_eps_low)
        return Surrogate(per_token, jnp.exp(tok.log_ratio), never, never, {})

    return run(surrogate, logps, old_logps, advantages, mask, aggregation=aggregation, **shared)


TOY = Objective(toy_policy_loss, ("clip_eps_low",))
'''

TOY_CHECK = '''\
import jax.numpy as jnp
import pytest
from alignax.config import ConfigError
from alignax.estimate import estimate, model_config_for
from alignax.trainers.api import load_config
from alignax.trainers.online import grpo

data = {"algorithm": "grpo", "data": {"format": "prompt"}, "grpo": {"policy_loss": "toy", "clip_eps_low": 0.1}}
config = load_config(data=data)
objective = grpo.build_algorithm(config).objective
assert objective.loss_fn.__name__ == "toy_policy_loss" and dict(objective.keywords) == {"clip_eps_low": 0.1}
lp = jnp.asarray([[-1.0, -0.5]])
loss, _ = objective.loss_fn(lp, lp - jnp.asarray([[0.05, 0.3]]), jnp.asarray([2.0]), jnp.ones((1, 2)),
                            **objective.keywords, aggregation="token-sum")
assert abs(float(loss) - (-2.0 * (0.05 + 0.1))) < 1e-6, float(loss)
with pytest.raises(ConfigError, match="grpo.dual_clip_c applies to grpo.policy_loss=ppo only; got grpo.policy_loss=toy"):
    load_config(data={**data, "grpo": {"policy_loss": "toy", "dual_clip_c": 3.0}})
result = estimate(config, model=model_config_for(config, "llama-2-7b"), devices=1, mesh=(1, 1, 1))
assert result.online
print("toy objective ok")
'''


def test_a_new_objective_is_one_module_and_one_entry(tmp_path):
    """A toy objective copied into a scratch copy of the package touches its module and the
    registry's file only (an import and one entry), and is then selectable from YAML,
    validated through the map (its keys, others refused), built by the trainer and estimated."""
    from tests.support.scratch_package import run_against_copy, scratch_copy

    touched = scratch_copy(tmp_path, new_files={"losses/objectives/toy.py": TOY_MODULE}, edits={
        "losses/objectives/__init__.py": ("import cov, dppo, dro, geo_mean, vespo",
                                          "import cov, dppo, dro, geo_mean, toy, vespo")})
    registry = tmp_path / "alignax" / "losses" / "objectives" / "__init__.py"
    registry.write_text(registry.read_text().replace('    "vespo": vespo.VESPO,\n',
                                                     '    "vespo": vespo.VESPO,\n    "toy": toy.TOY,\n'))
    assert touched == ["losses/objectives/__init__.py", "losses/objectives/toy.py"]
    run_against_copy(tmp_path, TOY_CHECK, "toy objective ok")


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_alignax_estimate_takes_every_objective(name):
    """``alignax estimate`` validates and estimates a run of each objective (the policy loss adds
    no model or activation of its own: the estimate equals the default's)."""
    from alignax.estimate import estimate, model_config_for
    from alignax.trainers.api import load_config

    def run_estimate(grpo):
        config = load_config(data={"algorithm": "grpo", "data": {"format": "prompt"}, "grpo": grpo})
        return estimate(config, model=model_config_for(config, "llama-2-7b"), devices=1, mesh=(1, 1, 1))

    result = run_estimate({"policy_loss": name, **({"dro_beta": 0.1} if name == "dro" else {})})
    assert result.online and result.items == run_estimate({}).items


def test_adaptive_entropy_keys_need_the_target():
    from alignax.config import ConfigError
    from alignax.trainers.api import load_config

    base = {"algorithm": "grpo", "data": {"format": "prompt"}}
    with pytest.raises(ConfigError, match="grpo.entropy_coef_delta applies to grpo.target_entropy"):
        load_config(data={**base, "grpo": {"entropy_coef_delta": 0.01}})
    config = load_config(data={**base, "grpo": {"target_entropy": 0.3, "entropy_coef_max": 0.5}})
    from alignax.trainers.online import grpo

    control = grpo.build_algorithm(config).objective.entropy_control
    assert (control.target, control.max_coef, control.delta) == (0.3, 0.5, 0.005)
    state = control.init()
    assert float(control.applied(state)) == 0.0  # grpo.entropy_coef's default 0
    state = control.update(state, 0.1)  # below the target: up by delta
    assert float(state.coef) == pytest.approx(0.005) and float(control.applied(state)) == pytest.approx(0.005)
    state = control.update(state, 0.4)  # above: down, and off
    assert float(state.coef) == 0.0 and float(control.applied(state)) == 0.0


# ---------------------------------------------------------------------------------------
# docs/migrating-from-verl.md, the policy-loss and rollout-correction tables
# ---------------------------------------------------------------------------------------


def _verl_rows():
    import os

    page = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "migrating-from-verl.md")
    text = open(page, encoding="utf-8").read()
    mine = text.split("## Policy losses", 1)[1].split("\n## ", 2)
    section = mine[0] + mine[1]  # the policy-loss and the rollout-correction sections
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and cells[0] not in ("verl", "---"):
            rows.append((cells[0], cells[1]))
    return rows


def test_the_verl_tables_cover_every_objective_and_their_keys_load():
    import re

    import yaml

    from alignax.trainers.api import load_config
    from alignax.trainers.validation import schema_keys

    rows = _verl_rows()
    key = re.compile(r"`((grpo|rollout)\.[a-z_]+)(?::\s*([a-z_0-9.]+|\{[^}]*\}))?`")
    named = {(m.group(1), m.group(3)) for _, alignax in rows for m in key.finditer(alignax)}
    valid = set(schema_keys())
    # what a value needs beside it to load (the keys it depends on)
    companions = {("grpo.policy_loss", "dro"): {"grpo": {"dro_beta": 0.1}}}
    for k, value in named:
        assert k in valid, f"docs/migrating-from-verl.md names {k}, which the run config lacks"
        if value is None:
            continue
        section, field = k.split(".")
        raw = {"algorithm": "grpo", "data": {"format": "prompt"}, "grpo": {}, "rollout": {}}
        for sec, extra in companions.get((k, value), {}).items():
            raw[sec].update(extra)
        if field in ("tis_level", "tis_lower", "tis_batch_normalize"):  # options of the truncated weight
            raw["rollout"]["tis_cap"] = 2.0
        if value.startswith("{"):  # a mapping (rollout.rejection_divergences, rollout.rejection), as YAML reads it
            mapping = yaml.safe_load(value)
            raw[section][field] = mapping
            got = getattr(getattr(load_config(data=raw), section), field)
            assert {n: list(v) if isinstance(v, tuple) else v for n, v in got.items()} == mapping, (k, value)
            continue
        if value in ("true", "false"):
            raw[section][field] = value == "true"
            assert getattr(getattr(load_config(data=raw), section), field) is (value == "true"), (k, value)
            continue
        raw[section][field] = value
        config = load_config(data=raw)
        assert str(getattr(getattr(config, section), field)) == value, (k, value)
    listed = {v for k, v in named if k == "grpo.policy_loss"}
    assert set(OBJECTIVES) - {"pg"} <= listed | {"pg"} and "pg" in listed
    verl_modes = {m for verl, _ in rows for m in re.findall(r"loss_mode: ([a-z_]+)", verl)}
    assert verl_modes >= {"vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean",
                          "dro", "cispo", "bypass_mode"}
    for _, alignax in rows:
        assert key.search(alignax) or alignax.startswith(("not yet", "not supported")), alignax


def test_the_registry_says_which_objectives_clip():
    """``Objective.clips`` (what monitor.clip_fraction is refused by) against each loss's own
    clip fractions: ratios e and 1/e, a whole row each way, with advantages of both signs,
    leave tokens at a bound for every objective that has one; the others log 0."""
    rng = np.random.default_rng(0)
    logps = -rng.uniform(0.1, 2.0, (6, 5))
    old = logps - np.where(np.arange(6) % 2 == 0, 1.0, -1.0)[:, None]
    advantages = np.where(np.arange(6) % 3 == 0, 1.0, -1.0)[:, None] * np.ones((6, 5))
    for name, entry in OBJECTIVES.items():
        kw = {**{k: 0.1 for k in entry.required}, **({"key": jax.random.key(0)} if entry.rng else {})}
        _, metrics = entry.loss(logps, old, advantages, np.ones((6, 5)), aggregation="token-mean", **kw)
        clipped = float(metrics["clipfrac_low"] + metrics["clipfrac_high"])
        assert (clipped > 0) == entry.clips, (name, clipped)
    assert set(objectives.clipping()) == {"ppo", "gspo", "cispo", "dppo_tv", "dppo_kl", "clip_cov", "geo_mean"}
