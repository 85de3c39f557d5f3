"""alignax.losses.preference against pair-by-pair loops written from the papers, jitted and not.

References run in float64 Python on the same float32 inputs; values worked by hand are
written out as numbers.
"""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from alignax.losses.preference import (
    cpo_loss,
    dpo_loss,
    kto_loss,
    kto_reference_point,
    log1mexp,
    orpo_loss,
    simpo_loss,
)
from tests.support.references import dpo_pair_loss, log_sigmoid, sigmoid

TOL = dict(rtol=1e-6, atol=1e-6)


def pairs(seed=0, b=5):
    """Sequence log-probs (sums over 3..9 tokens) for a small batch of pairs, float32."""
    rng = np.random.default_rng(seed)
    chosen_lengths = rng.integers(3, 10, size=b).astype(np.int32)
    rejected_lengths = rng.integers(3, 10, size=b).astype(np.int32)
    ref_c = (-rng.uniform(0.5, 2.0, size=b) * chosen_lengths).astype(np.float32)
    ref_r = (-rng.uniform(0.5, 2.0, size=b) * rejected_lengths).astype(np.float32)
    pol_c = (ref_c + rng.normal(scale=2.0, size=b)).astype(np.float32)
    pol_r = (ref_r + rng.normal(scale=2.0, size=b)).astype(np.float32)
    return pol_c, pol_r, ref_c, ref_r, chosen_lengths, rejected_lengths


def as_float(x):
    return [float(v) for v in np.asarray(x)]


def assert_metrics(metrics, expected):
    assert set(metrics) >= set(expected), set(expected) - set(metrics)
    for name, value in expected.items():
        got = metrics[name]
        assert got.shape == () and got.dtype == jnp.float32, name
        np.testing.assert_allclose(float(got), value, **TOL, err_msg=name)


# ---------------------------------------------------------------------------- DPO family


def ref_dpo(pol_c, pol_r, ref_c, ref_r, len_c, len_r, *, beta, variant, eps, lam, length_normalize):
    """One pair at a time, from each paper's per-example loss."""
    losses, rc_all, rr_all, acc, lc_all, lr_all = [], [], [], [], [], []
    for i in range(len(pol_c)):
        pc, pr, qc, qr = float(pol_c[i]), float(pol_r[i]), float(ref_c[i]), float(ref_r[i])
        if length_normalize:
            nc, nr = max(int(len_c[i]), 1), max(int(len_r[i]), 1)
            pc, qc, pr, qr = pc / nc, qc / nc, pr / nr, qr / nr
        rw = pc - qc  # log pi(y_w)/pi_ref(y_w)
        rl = pr - qr
        loss = dpo_pair_loss(variant, pc, pr, qc, qr, beta=beta, eps=eps, lam=lam)
        losses.append(loss)
        rc_all.append(beta * rw)
        rr_all.append(beta * rl)
        acc.append(1.0 if beta * rw > beta * rl else 0.0)
        lc_all.append(pc)
        lr_all.append(pr)
    n = len(losses)
    metrics = {
        "rewards/chosen": sum(rc_all) / n,
        "rewards/rejected": sum(rr_all) / n,
        "rewards/accuracies": sum(acc) / n,
        "rewards/margins": (sum(rc_all) - sum(rr_all)) / n,
        "logps/chosen": sum(lc_all) / n,
        "logps/rejected": sum(lr_all) / n,
    }
    return sum(losses) / n, metrics


SMOOTHING = {"sigmoid": 0.1, "robust": 0.2, "exo_pair": 0.05}
# The variants with a pair-by-pair reference (tests/support/references.py); the batch-level
# ones issue 36 added are checked in tests/test_preference_objectives.py, which also checks
# that the two lists cover the table.
PAIR_REFERENCE_VARIANTS = ("sigmoid", "hinge", "ipo", "robust", "dpop", "exo_pair", "nca_pair", "sppo_hard",
                           "apo_zero", "apo_down")


class DPOVariantsTest(chex.TestCase):
    """The DPO family against the loops, jitted and not (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters((variant, variant) for variant in PAIR_REFERENCE_VARIANTS)
    def test_dpo_variants_match_loops(self, variant):
        pol_c, pol_r, ref_c, ref_r, len_c, len_r = pairs(seed=1)
        hp = dict(beta=0.3, variant=variant, label_smoothing=SMOOTHING.get(variant, 0.0), dpop_lambda=5.0)
        loss, metrics = self.variant(functools.partial(dpo_loss, **hp))(pol_c, pol_r, ref_c, ref_r, len_c, len_r)
        want, want_metrics = ref_dpo(
            pol_c, pol_r, ref_c, ref_r, len_c, len_r, beta=0.3, variant=variant,
            eps=hp["label_smoothing"], lam=5.0, length_normalize=variant == "ipo",
        )
        assert loss.shape == () and loss.dtype == jnp.float32
        np.testing.assert_allclose(float(loss), want, **TOL)
        assert_metrics(metrics, want_metrics)

    @chex.variants(with_jit=True, without_jit=True)
    def test_dpo_length_normalize_switch(self):
        """IPO on summed log-probs (the paper's form) and length-averaged sigmoid DPO."""
        pol_c, pol_r, ref_c, ref_r, len_c, len_r = pairs(seed=2)
        for variant, flag in (("ipo", False), ("sigmoid", True)):
            fn = self.variant(functools.partial(dpo_loss, beta=0.2, variant=variant, length_normalize=flag))
            loss, metrics = fn(pol_c, pol_r, ref_c, ref_r, len_c, len_r)
            want, want_metrics = ref_dpo(
                pol_c, pol_r, ref_c, ref_r, len_c, len_r, beta=0.2, variant=variant, eps=0.0, lam=0.0,
                length_normalize=flag,
            )
            np.testing.assert_allclose(float(loss), want, **TOL)
            assert_metrics(metrics, want_metrics)

    @chex.variants(with_jit=True, without_jit=True)
    def test_dpo_zero_margin_is_log2(self):
        """Policy equal to the reference: every pair's loss is -log sigma(0) = log 2 = 0.693147."""
        x = jnp.array([-3.0, -11.5, -0.25], jnp.float32)
        y = jnp.array([-7.0, -2.0, -40.0], jnp.float32)
        loss, metrics = self.variant(functools.partial(dpo_loss, beta=0.1))(x, y, x, y)
        np.testing.assert_allclose(float(loss), 0.6931471805599453, **TOL)
        assert float(metrics["rewards/margins"]) == 0.0
        assert float(metrics["rewards/accuracies"]) == 0.0


def test_exo_zero_smoothing_uses_1e_3():
    pol_c, pol_r, ref_c, ref_r, _, _ = pairs(seed=3)
    loss, _ = dpo_loss(pol_c, pol_r, ref_c, ref_r, beta=0.1, variant="exo_pair")
    want, _ = ref_dpo(pol_c, pol_r, ref_c, ref_r, None, None, beta=0.1, variant="exo_pair", eps=0.0, lam=0.0,
                      length_normalize=False)
    np.testing.assert_allclose(float(loss), want, **TOL)


def test_dpo_gradient_by_hand():
    """dL/d logpi(y_c,i) = -beta sigma(-beta h_i) / B.

    beta = 0.1, margins h = [1, -2] (B = 2):
      sigma(-0.1) = 1 / (1 + e^0.1) = 0.4750208125, -> -0.1 * 0.4750208125 / 2 = -0.02375104063
      sigma( 0.2) = 1 / (1 + e^-0.2) = 0.5498339973, -> -0.1 * 0.5498339973 / 2 = -0.02749169987
    and the rejected log-probs get the opposite; the reference gets nothing.
    """
    pol_c = jnp.array([-5.0, -6.0])
    pol_r = jnp.array([-7.0, -4.0])
    ref_c = jnp.array([-6.0, -5.0])  # h = (pol_c - ref_c) - (pol_r - ref_r) = [1, -2]
    ref_r = jnp.array([-7.0, -5.0])
    grads = jax.grad(lambda *a: dpo_loss(*a, beta=0.1)[0], argnums=(0, 1, 2, 3))(pol_c, pol_r, ref_c, ref_r)
    hand = np.array([-0.02375104063, -0.02749169987])
    np.testing.assert_allclose(np.asarray(grads[0]), hand, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grads[1]), -hand, rtol=1e-6)
    assert np.all(np.asarray(grads[2]) == 0) and np.all(np.asarray(grads[3]) == 0)


def test_value_and_grad_with_aux_works():
    pol_c, pol_r, ref_c, ref_r, _, _ = pairs(seed=4)
    (loss, metrics), grads = jax.value_and_grad(lambda c: dpo_loss(c, pol_r, ref_c, ref_r), has_aux=True)(pol_c)
    assert np.isfinite(float(loss)) and grads.shape == pol_c.shape
    assert all(v.shape == () and v.dtype == jnp.float32 for v in metrics.values())


def test_weights_drop_pairs_and_shards_sum_to_full_batch():
    pol_c, pol_r, ref_c, ref_r, len_c, len_r = pairs(seed=5, b=6)
    args = (pol_c, pol_r, ref_c, ref_r, len_c, len_r)
    full, _ = dpo_loss(*args, beta=0.2, variant="ipo")
    parts = [dpo_loss(*(a[s] for a in args), beta=0.2, variant="ipo", num_pairs=6) for s in (slice(0, 2), slice(2, 6))]
    np.testing.assert_allclose(float(parts[0][0] + parts[1][0]), float(full), **TOL)
    # weight 0 on the last two pairs == the loss of the first four, whatever their values
    w = np.array([1, 1, 1, 1, 0, 0], np.float32)
    bad = [np.where(w > 0, a, np.inf).astype(a.dtype) if a.dtype.kind == "f" else a for a in args]
    dropped, metrics = dpo_loss(*bad, beta=0.2, variant="ipo", weights=w)
    first4, metrics4 = dpo_loss(*(a[:4] for a in args), beta=0.2, variant="ipo")
    np.testing.assert_allclose(float(dropped), float(first4), **TOL)
    for k in metrics4:
        np.testing.assert_allclose(float(metrics[k]), float(metrics4[k]), **TOL)


def test_dpo_length_averaging_clamps_lengths_to_one_token():
    """IPO's length-averaged log-probs divide by ``max(|y|, 1)``: one-token and empty
    responses divide by 1, against the loop."""
    pol_c, pol_r, ref_c, ref_r, len_c, len_r = pairs(seed=15)
    len_c, len_r = len_c.copy(), len_r.copy()
    len_c[0], len_r[1], len_c[2], len_r[3] = 1, 1, 0, 0
    loss, metrics = dpo_loss(pol_c, pol_r, ref_c, ref_r, len_c, len_r, beta=0.3, variant="ipo")
    want, want_metrics = ref_dpo(pol_c, pol_r, ref_c, ref_r, len_c, len_r, beta=0.3, variant="ipo", eps=0.0, lam=0.0,
                                 length_normalize=True)
    np.testing.assert_allclose(float(loss), want, **TOL)
    assert_metrics(metrics, want_metrics)


def test_discopop_tau_is_checked_only_where_discopop_reads_it():
    pol_c, pol_r, ref_c, ref_r, _, _ = pairs(seed=6)
    with pytest.raises(ValueError, match=r"discopop_tau must lie in \(0.0, inf\)"):
        dpo_loss(pol_c, pol_r, ref_c, ref_r, variant="discopop", discopop_tau=0.0)
    plain = dpo_loss(pol_c, pol_r, ref_c, ref_r)[0]
    np.testing.assert_allclose(float(dpo_loss(pol_c, pol_r, ref_c, ref_r, discopop_tau=0.0)[0]), float(plain), **TOL)


def test_dpo_bad_inputs_name_the_argument():
    pol_c, pol_r, ref_c, ref_r, len_c, len_r = pairs(seed=6)
    with pytest.raises(ValueError, match="unknown variant 'kto'; valid: sigmoid, hinge, ipo, robust, dpop"):
        dpo_loss(pol_c, pol_r, ref_c, ref_r, variant="kto")
    with pytest.raises(ValueError, match=r"shape mismatch: .*ref_rejected_logps=\(4,\)"):
        dpo_loss(pol_c, pol_r, ref_c, ref_r[:4])
    with pytest.raises(ValueError, match="policy_chosen_logps must have rank 1"):
        dpo_loss(pol_c[None], pol_r, ref_c, ref_r)
    with pytest.raises(ValueError, match="pass chosen_lengths and rejected_lengths"):
        dpo_loss(pol_c, pol_r, ref_c, ref_r, variant="ipo")
    with pytest.raises(ValueError, match=r"label_smoothing must lie in \[0.0, 0.5\)"):
        dpo_loss(pol_c, pol_r, ref_c, ref_r, variant="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="label_smoothing=0.1 has no meaning for variant 'hinge'"):
        dpo_loss(pol_c, pol_r, ref_c, ref_r, variant="hinge", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"beta must lie in \(0.0, inf\)"):
        dpo_loss(pol_c, pol_r, ref_c, ref_r, beta=0.0)


# ---------------------------------------------------------------------------- SimPO, CPO, ORPO


def ref_orpo(pol_c, pol_r, len_c, len_r, lam):
    nll_sum, tokens, ratio_terms, log_odds_all = 0.0, 0, [], []
    for i in range(len(pol_c)):
        lp_w = float(pol_c[i]) / int(len_c[i])
        lp_l = float(pol_r[i]) / int(len_r[i])
        odds_w = math.exp(lp_w) / (1.0 - math.exp(lp_w))  # Hong et al. eq. 4
        odds_l = math.exp(lp_l) / (1.0 - math.exp(lp_l))
        log_or = math.log(odds_w / odds_l)
        ratio_terms.append(log_sigmoid(log_or))
        log_odds_all.append(log_or)
        nll_sum += -float(pol_c[i])
        tokens += int(len_c[i])
    n = len(ratio_terms)
    loss = nll_sum / tokens - lam * sum(ratio_terms) / n
    return loss, {"nll_loss": nll_sum / tokens, "log_odds_ratio": sum(ratio_terms) / n,
                  "log_odds_chosen": sum(log_odds_all) / n}


class ReferenceFreeVariantsTest(chex.TestCase):
    """SimPO, CPO and ORPO against the loops, jitted and not."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_simpo_matches_loop(self):
        pol_c, pol_r, _, _, len_c, len_r = pairs(seed=7)
        beta, gamma, eps = 2.0, 0.5, 0.1
        fn = self.variant(functools.partial(simpo_loss, beta=beta, gamma=gamma, label_smoothing=eps))
        loss, metrics = fn(pol_c, pol_r, len_c, len_r)
        losses, rc, rr, acc = [], [], [], []
        for i in range(len(pol_c)):
            avg_w, avg_l = float(pol_c[i]) / int(len_c[i]), float(pol_r[i]) / int(len_r[i])
            z = beta * avg_w - beta * avg_l - gamma  # Meng et al. eq. 6: gamma is the reward margin
            losses.append(-(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z))
            rc.append(beta * avg_w)
            rr.append(beta * avg_l)
            acc.append(float(rc[-1] > rr[-1]))
        n = len(losses)
        np.testing.assert_allclose(float(loss), sum(losses) / n, **TOL)
        assert_metrics(metrics, {
            "rewards/chosen": sum(rc) / n, "rewards/rejected": sum(rr) / n, "rewards/accuracies": sum(acc) / n,
            "logps/chosen": sum(rc) / n / beta, "logps/rejected": sum(rr) / n / beta,
        })

    @chex.variants(with_jit=True, without_jit=True)
    def test_cpo_matches_loop(self):
        pol_c, pol_r, _, _, len_c, _ = pairs(seed=8)
        beta, alpha = 0.2, 0.7
        loss, metrics = self.variant(functools.partial(cpo_loss, beta=beta, alpha=alpha))(pol_c, pol_r, len_c)
        pref, nll_sum, tokens = 0.0, 0.0, 0
        for i in range(len(pol_c)):
            pref += -log_sigmoid(beta * (float(pol_c[i]) - float(pol_r[i])))
            nll_sum += -float(pol_c[i])
            tokens += int(len_c[i])
        n = len(pol_c)
        np.testing.assert_allclose(float(loss), pref / n + alpha * nll_sum / tokens, **TOL)
        want_metrics = {"nll_loss": nll_sum / tokens, "logps/chosen": float(np.mean(pol_c.astype(np.float64)))}
        assert_metrics(metrics, want_metrics)

    @chex.variants(with_jit=True, without_jit=True)
    def test_orpo_matches_loop(self):
        pol_c, pol_r, _, _, len_c, len_r = pairs(seed=9)
        loss, metrics = self.variant(functools.partial(orpo_loss, beta=0.25))(pol_c, pol_r, len_c, len_r)
        want, want_metrics = ref_orpo(pol_c, pol_r, len_c, len_r, 0.25)
        np.testing.assert_allclose(float(loss), want, **TOL)
        assert_metrics(metrics, want_metrics)


def weighted_mean(values, w):
    return sum(wi * v for wi, v in zip(w, values)) / sum(w)


def test_reference_free_losses_with_weights_and_short_responses():
    """SimPO, CPO and ORPO with pair weights (one dropped, fractional ones) and responses of
    0 and 1 tokens, loss and every metric against weighted loops: ``sum_i w_i l_i / sum_i w_i``,
    lengths clamped to >= 1 where a log-prob is averaged, the NLL over ``sum_i w_i |y_c,i|``."""
    pol_c, pol_r, _, _, len_c, len_r = pairs(seed=12, b=5)
    len_c, len_r = len_c.copy(), len_r.copy()
    len_c[0], len_r[2], len_c[3] = 1, 1, 0
    pol_c[3] = -0.5  # an empty chosen response's mean is its sum: keep it a probability
    w = np.array([1.0, 0.0, 0.5, 2.0, 1.0], np.float32)
    beta, gamma, eps, alpha = 1.5, 0.3, 0.1, 0.7
    avg_c = [float(pol_c[i]) / max(int(len_c[i]), 1) for i in range(5)]
    avg_r = [float(pol_r[i]) / max(int(len_r[i]), 1) for i in range(5)]
    nll = sum(-wi * float(c) for wi, c in zip(w, pol_c)) / sum(wi * int(n) for wi, n in zip(w, len_c))

    def smoothed(z):
        return -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)

    def pair_metrics(rc, rr, lc, lr):
        return {"rewards/chosen": weighted_mean(rc, w), "rewards/rejected": weighted_mean(rr, w),
                "rewards/accuracies": weighted_mean([float(a > b) for a, b in zip(rc, rr)], w),
                "rewards/margins": weighted_mean([a - b for a, b in zip(rc, rr)], w),
                "logps/chosen": weighted_mean(lc, w), "logps/rejected": weighted_mean(lr, w)}

    loss, metrics = simpo_loss(pol_c, pol_r, len_c, len_r, beta=beta, gamma=gamma, label_smoothing=eps, weights=w)
    want = weighted_mean([smoothed(beta * c - beta * r - gamma) for c, r in zip(avg_c, avg_r)], w)
    np.testing.assert_allclose(float(loss), want, **TOL)
    assert_metrics(metrics, pair_metrics([beta * c for c in avg_c], [beta * r for r in avg_r], avg_c, avg_r))

    loss, metrics = cpo_loss(pol_c, pol_r, len_c, beta=beta, alpha=alpha, label_smoothing=eps, weights=w)
    sums_c, sums_r = [float(c) for c in pol_c], [float(r) for r in pol_r]
    want = weighted_mean([smoothed(beta * (c - r)) for c, r in zip(sums_c, sums_r)], w) + alpha * nll
    np.testing.assert_allclose(float(loss), want, **TOL)
    assert_metrics(metrics, {**pair_metrics([beta * c for c in sums_c], [beta * r for r in sums_r], sums_c, sums_r),
                             "nll_loss": nll})

    loss, metrics = orpo_loss(pol_c, pol_r, len_c, len_r, beta=beta, weights=w)
    log_odds = [(c - math.log(-math.expm1(c))) - (r - math.log(-math.expm1(r))) for c, r in zip(avg_c, avg_r)]
    want = nll - beta * weighted_mean([log_sigmoid(x) for x in log_odds], w)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    assert_metrics(metrics, {**pair_metrics([beta * c for c in avg_c], [beta * r for r in avg_r], avg_c, avg_r),
                             "nll_loss": nll})
    np.testing.assert_allclose(float(metrics["log_odds_chosen"]), weighted_mean(log_odds, w), rtol=1e-5)
    np.testing.assert_allclose(float(metrics["log_odds_ratio"]), weighted_mean([log_sigmoid(x) for x in log_odds], w),
                               rtol=1e-5)


def test_nll_term_of_an_all_dropped_batch_is_zero_and_a_fractional_token_count_divides():
    """The chosen NLL ``-sum_i w_i log pi(y_c,i) / sum_i w_i |y_c,i|``: a batch whose pairs are
    all dropped (a padding micro-batch) gives 0 and a zero gradient, not 0/0; a token count
    below 1 (fractional weights) divides like any other."""
    pol_c, pol_r = np.array([-3.0, -5.0], np.float32), np.array([-4.0, -4.5], np.float32)
    len_c = np.array([2, 4], np.int32)
    for fn, args in ((cpo_loss, (pol_c, pol_r, len_c)), (orpo_loss, (pol_c, pol_r, len_c, len_c))):
        (loss, metrics), grad = jax.value_and_grad(lambda c: fn(c, *args[1:], weights=np.zeros(2, np.float32)),
                                                   has_aux=True)(jnp.asarray(pol_c))
        assert float(loss) == 0.0 and float(metrics["nll_loss"]) == 0.0, fn.__name__
        assert np.all(np.asarray(grad) == 0.0), fn.__name__
        w = np.array([0.25, 0.0], np.float32)  # 0.25 * 2 = half a token
        _, metrics = fn(*args, weights=w)
        np.testing.assert_allclose(float(metrics["nll_loss"]), 0.25 * 3.0 / 0.5, **TOL, err_msg=fn.__name__)


def test_defaults_are_the_documented_hyper_parameters():
    """Each keyword left out is the value its docstring gives (the papers' and TRL's)."""
    pol_c, pol_r, ref_c, ref_r, len_c, len_r = pairs(seed=13)
    assert np.any(pol_c < ref_c)  # DPOP's penalty is active on some pair
    labels = np.array([1, 0, 1, 1, 0], np.int32)
    pair = (pol_c, pol_r, ref_c, ref_r)
    cases = [
        (functools.partial(dpo_loss, *pair), dict(beta=0.1)),
        (functools.partial(dpo_loss, *pair, variant="dpop"), dict(beta=0.1, dpop_lambda=50.0)),
        (functools.partial(dpo_loss, *pair, variant="discopop"), dict(beta=0.1, discopop_tau=0.05)),
        (functools.partial(dpo_loss, *pair, f_divergence="alpha"), dict(beta=0.1, f_alpha=0.5)),
        (functools.partial(simpo_loss, pol_c, pol_r, len_c, len_r), dict(beta=2.0, gamma=0.5)),
        (functools.partial(cpo_loss, pol_c, pol_r, len_c), dict(beta=0.1, alpha=1.0)),
        (functools.partial(orpo_loss, pol_c, pol_r, len_c, len_r), dict(beta=0.1)),
        (functools.partial(kto_loss, pol_c, ref_c, labels), dict(beta=0.1, desirable_weight=1.0,
                                                                  undesirable_weight=1.0)),
    ]
    for fn, documented in cases:
        default, default_metrics = fn()
        given, given_metrics = fn(**documented)
        np.testing.assert_allclose(float(default), float(given), rtol=1e-6, err_msg=str(documented))
        for name in given_metrics:
            np.testing.assert_allclose(float(default_metrics[name]), float(given_metrics[name]), rtol=1e-6,
                                       err_msg=f"{documented} {name}")


def test_orpo_near_certain_responses_stay_accurate_and_finite():
    # mean token log-probs -1e-4: log(1 - p) = log(9.9995e-5) needs expm1, not 1 - exp
    pol_c = np.array([-4e-4, -2.0], np.float32)
    pol_r = np.array([-3e-4, -1e-3], np.float32)
    lengths = np.array([4, 3], np.int32)
    loss, metrics = orpo_loss(pol_c, pol_r, lengths, lengths, beta=1.0)
    want, want_metrics = ref_orpo(pol_c, pol_r, lengths, lengths, 1.0)
    np.testing.assert_allclose(float(loss), want, rtol=2e-6)
    np.testing.assert_allclose(float(metrics["log_odds_chosen"]), want_metrics["log_odds_chosen"], rtol=2e-6)
    # at and beyond 0 (rounding can give +1e-8): finite loss and gradients
    for c, r in [(0.0, 0.0), (-1e-9, 0.0), (1e-8, -1e-30), (-3.0, 0.0)]:
        x = jnp.array([c, -1.0]), jnp.array([r, -2.0])
        (loss, _), grads = jax.value_and_grad(lambda a, b: orpo_loss(a, b, lengths, lengths), argnums=(0, 1),
                                              has_aux=True)(*x)
        assert np.isfinite(float(loss)), (c, r)
        assert np.all(np.isfinite(np.asarray(grads[0]))) and np.all(np.isfinite(np.asarray(grads[1]))), (c, r)


def test_log1mexp_both_branches():
    x = np.array([-1e-6, -1e-3, -0.5, -0.7, -2.0, -30.0], np.float32)
    # float64 reference; log(-expm1) loses digits for very negative x, log1p(-exp) near 0
    want = [math.log(-math.expm1(float(v))) if v > -1 else math.log1p(-math.exp(float(v))) for v in x]
    np.testing.assert_allclose(np.asarray(log1mexp(x)), want, rtol=1e-6)
    g = jax.grad(lambda v: jnp.sum(log1mexp(v)))(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(g), [-math.exp(v) / -math.expm1(v) for v in x.astype(np.float64)],
                               rtol=1e-5)


def test_reference_free_losses_shard_sum():
    pol_c, pol_r, _, _, len_c, len_r = pairs(seed=10, b=6)
    a, b = slice(0, 4), slice(4, 6)
    tokens = float(np.sum(len_c))
    cases = [
        (simpo_loss, (pol_c, pol_r, len_c, len_r), {}),
        (cpo_loss, (pol_c, pol_r, len_c), {"num_chosen_tokens": tokens}),
        (orpo_loss, (pol_c, pol_r, len_c, len_r), {"num_chosen_tokens": tokens}),
    ]
    for fn, args, extra in cases:
        full, _ = fn(*args)
        parts = [fn(*(x[s] for x in args), num_pairs=6, **extra)[0] for s in (a, b)]
        np.testing.assert_allclose(float(parts[0] + parts[1]), float(full), **TOL, err_msg=fn.__name__)


def test_reference_free_bad_inputs():
    pol_c, pol_r, _, _, len_c, len_r = pairs(seed=11)
    with pytest.raises(ValueError, match=r"rejected_lengths=\(3,\)"):
        simpo_loss(pol_c, pol_r, len_c, len_r[:3])
    with pytest.raises(ValueError, match="chosen_lengths must have rank 1"):
        cpo_loss(pol_c, pol_r, len_c[:, None])
    with pytest.raises(ValueError, match=r"shape mismatch: .*weights=\(2,\)"):
        orpo_loss(pol_c, pol_r, len_c, len_r, weights=np.ones(2))


# ---------------------------------------------------------------------------- KTO


def ref_kto(pol, ref, labels, beta, lam_d, lam_u, z):
    """Ethayarajh et al.: lambda_y - v(x, y), with v from the prospect-theoretic value function."""
    losses, r_des, r_und = [], [], []
    for i in range(len(pol)):
        r = float(pol[i]) - float(ref[i])
        if labels[i]:
            losses.append(lam_d - lam_d * sigmoid(beta * (r - z)))
            r_des.append(beta * r)
        else:
            losses.append(lam_u - lam_u * sigmoid(beta * (z - r)))
            r_und.append(beta * r)
    return sum(losses) / len(losses), {"rewards/chosen": sum(r_des) / len(r_des),
                                      "rewards/rejected": sum(r_und) / len(r_und), "kl": z}


def kto_batch(seed=12, b=6):
    rng = np.random.default_rng(seed)
    ref = (-rng.uniform(5, 20, size=b)).astype(np.float32)
    pol = (ref + rng.normal(loc=0.8, scale=1.5, size=b)).astype(np.float32)
    labels = np.array([1, 0, 1, 1, 0, 0][:b], np.int32)
    return pol, ref, labels


class KTOVariantsTest(chex.TestCase):
    """KTO against the loop, jitted and not."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_kto_matches_loop(self):
        pol, ref, labels = kto_batch()
        hp = dict(beta=0.3, desirable_weight=1.2, undesirable_weight=0.9)
        # reference point estimated from the batch: max(0, mean log-ratio)
        z_batch = max(0.0, sum(float(p) - float(q) for p, q in zip(pol, ref)) / len(pol))
        assert z_batch > 0
        loss, metrics = self.variant(functools.partial(kto_loss, **hp))(pol, ref, labels)
        want, want_metrics = ref_kto(pol, ref, labels, 0.3, 1.2, 0.9, z_batch)
        np.testing.assert_allclose(float(loss), want, **TOL)
        assert_metrics(metrics, want_metrics)
        # a given reference point, and a negative one clamped to 0
        for given, used in ((0.37, 0.37), (-2.0, 0.0)):
            loss, metrics = self.variant(functools.partial(kto_loss, kl_ref_point=given, **hp))(pol, ref, labels)
            want, want_metrics = ref_kto(pol, ref, labels, 0.3, 1.2, 0.9, used)
            np.testing.assert_allclose(float(loss), want, **TOL)
            assert_metrics(metrics, want_metrics)


def test_kto_with_weights_estimates_the_reference_point_and_metrics_over_kept_examples():
    """Weighted KTO (one example dropped): ``z = max(0, sum_i w_i r_i / sum_i w_i)``, the loss
    ``sum_i w_i l_i / sum_i w_i`` and each metric the weighted mean over its label's examples."""
    pol, ref, labels = kto_batch(seed=14)
    w = np.array([1.0, 0.0, 0.5, 2.0, 1.5, 1.0], np.float32)
    r = [float(p) - float(q) for p, q in zip(pol, ref)]
    z = max(0.0, weighted_mean(r, w))
    assert z > 0 and abs(z - max(0.0, sum(r) / len(r))) > 1e-3  # the weights move it
    beta, lam_d, lam_u = 0.3, 1.2, 0.9
    per_example = [lam_d * (1 - sigmoid(beta * (ri - z))) if y else lam_u * (1 - sigmoid(beta * (z - ri)))
                   for ri, y in zip(r, labels)]
    loss, metrics = kto_loss(pol, ref, labels, beta=beta, desirable_weight=lam_d, undesirable_weight=lam_u,
                             weights=w)
    np.testing.assert_allclose(float(loss), weighted_mean(per_example, w), **TOL)
    des, und = [i for i in range(6) if labels[i]], [i for i in range(6) if not labels[i]]

    def mean_over(values, idx):
        return weighted_mean([values[i] for i in idx], [w[i] for i in idx])

    assert_metrics(metrics, {"rewards/chosen": mean_over([beta * x for x in r], des),
                             "rewards/rejected": mean_over([beta * x for x in r], und),
                             "logps/chosen": mean_over([float(p) for p in pol], des),
                             "logps/rejected": mean_over([float(p) for p in pol], und), "kl": z})


def test_kto_reference_point_gets_no_gradient():
    pol, ref, labels = kto_batch()
    z = max(0.0, float(np.mean(pol.astype(np.float64) - ref)))
    g_batch = jax.grad(lambda p: kto_loss(p, ref, labels)[0])(jnp.asarray(pol))
    g_fixed = jax.grad(lambda p: kto_loss(p, ref, labels, kl_ref_point=z)[0])(jnp.asarray(pol))
    np.testing.assert_allclose(np.asarray(g_batch), np.asarray(g_fixed), rtol=1e-5, atol=1e-8)
    # and nothing reaches a passed-in reference point or the reference log-probs
    g_z, g_ref = jax.grad(lambda zz, rr: kto_loss(pol, rr, labels, kl_ref_point=zz)[0], argnums=(0, 1))(
        jnp.float32(0.4), jnp.asarray(ref))
    assert float(g_z) == 0.0 and np.all(np.asarray(g_ref) == 0)


def test_kto_reference_point_from_mismatched_pairs():
    kl_pol = np.array([-10.0, -12.5, -8.0], np.float32)
    kl_ref = np.array([-11.0, -12.0, -9.0], np.float32)
    z = kto_reference_point(kl_pol, kl_ref)
    np.testing.assert_allclose(float(z), (1.0 - 0.5 + 1.0) / 3, **TOL)
    assert float(kto_reference_point(kl_ref, kl_pol)) == 0.0  # negative mean clamps to 0
    assert float(jax.grad(lambda p: kto_reference_point(p, kl_ref))(jnp.asarray(kl_pol)).sum()) == 0.0


def test_kto_shard_sum_and_bad_inputs():
    pol, ref, labels = kto_batch()
    full, _ = kto_loss(pol, ref, labels, kl_ref_point=0.2)
    parts = [kto_loss(pol[s], ref[s], labels[s], kl_ref_point=0.2, num_examples=6)[0]
             for s in (slice(0, 3), slice(3, 6))]
    np.testing.assert_allclose(float(parts[0] + parts[1]), float(full), **TOL)
    with pytest.raises(ValueError, match=r"labels=\(5,\)"):
        kto_loss(pol, ref, labels[:5])
    with pytest.raises(ValueError, match="kl_ref_point must have rank 0"):
        kto_loss(pol, ref, labels, kl_ref_point=np.zeros(6))


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda c, r, n: dpo_loss(c[:, None], r, c, r), "policy_chosen_logps must have rank 1"),
        (lambda c, r, n: simpo_loss(c, r, n, n[:, None]), "rejected_lengths must have rank 1"),
        (lambda c, r, n: cpo_loss(c, r[None], n), "policy_rejected_logps must have rank 1"),
        (lambda c, r, n: orpo_loss(c, r, n, n, weights=n[None]), "weights must have rank 1"),
        (lambda c, r, n: kto_loss(c, r, n[:, None]), "labels must have rank 1"),
        (lambda c, r, n: kto_reference_point(c[None], r[None]), "kl_policy_logps must have rank 1"),
        (lambda c, r, n: dpo_loss(c, r, c, r, num_pairs=n), "num_pairs must have rank 0"),
    ],
    ids=["dpo", "simpo", "cpo", "orpo", "kto", "kto_reference_point", "num_pairs"],
)
def test_wrong_rank_raises_naming_the_argument(call, message):
    pol_c, pol_r, _, _, len_c, _ = pairs(seed=13)
    with pytest.raises(ValueError, match=message):
        call(pol_c, pol_r, len_c)
    with pytest.raises(ValueError, match=message):  # a static check: it fires while tracing
        jax.jit(call)(pol_c, pol_r, len_c)
