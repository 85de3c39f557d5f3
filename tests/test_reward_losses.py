"""alignax.losses.reward against pair-by-pair loops, jitted and not."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from alignax.losses.reward import ENSEMBLE_METHODS, bradley_terry_loss, ensemble_rewards
from tests.support import references

TOL = dict(rtol=1e-6, atol=1e-6)


def rewards(seed=0, b=6):
    rng = np.random.default_rng(seed)
    return rng.normal(size=b).astype(np.float32) + 0.5, rng.normal(size=b).astype(np.float32)


def ref_bradley_terry(r_c, r_r, margins, center):
    """-log P(y_c > y_r) under Bradley-Terry with Llama 2's margin, plus TRL's centring term."""
    nll, centre, acc, diff = 0.0, 0.0, 0.0, 0.0
    for i in range(len(r_c)):
        c, r = float(r_c[i]), float(r_r[i])
        p_pref = math.exp(c - margins[i]) / (math.exp(c - margins[i]) + math.exp(r))
        nll += -math.log(p_pref)
        centre += (c + r) ** 2
        acc += 1.0 if c > r else 0.0
        diff += c - r
    n = len(r_c)
    return nll / n + center * centre / n, {"accuracy": acc / n, "margin": diff / n,
                                            "rewards/chosen": sum(map(float, r_c)) / n,
                                            "rewards/rejected": sum(map(float, r_r)) / n}


class BradleyTerryVariantsTest(chex.TestCase):
    """Bradley-Terry against the loop, jitted and not (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_bradley_terry_matches_loop(self):
        r_c, r_r = rewards()
        per_pair_margin = np.array([0.0, 1.0, 0.5, 0.0, 2.0, 1.0], np.float32)
        cases = [
            ({}, [0.0] * 6, 0.0),
            ({"margin": 0.3}, [0.3] * 6, 0.0),
            ({"center_coef": 0.01}, [0.0] * 6, 0.01),
        ]
        for kwargs, margins, center in cases:
            loss, metrics = self.variant(functools.partial(bradley_terry_loss, **kwargs))(r_c, r_r)
            want, want_metrics = ref_bradley_terry(r_c, r_r, margins, center)
            np.testing.assert_allclose(float(loss), want, **TOL, err_msg=str(kwargs))
            for k, v in want_metrics.items():
                assert metrics[k].shape == () and metrics[k].dtype == jnp.float32
                np.testing.assert_allclose(float(metrics[k]), v, **TOL, err_msg=k)
        # a per-pair margin array is data: pass it through jit as an argument
        fn = self.variant(lambda a, b, m: bradley_terry_loss(a, b, margin=m))
        loss, _ = fn(r_c, r_r, per_pair_margin)
        np.testing.assert_allclose(float(loss), ref_bradley_terry(r_c, r_r, per_pair_margin, 0.0)[0], **TOL)


def test_bradley_terry_hand_values_and_gradient():
    # equal rewards: -log sigma(0) = log 2; d/dr_c = -sigma(0)/B = -0.25 for B = 2
    (loss, metrics), g = jax.value_and_grad(lambda c: bradley_terry_loss(c, jnp.array([1.0, -2.0])), has_aux=True)(
        jnp.array([1.0, -2.0]))
    np.testing.assert_allclose(float(loss), 0.6931471805599453, **TOL)
    np.testing.assert_allclose(np.asarray(g), [-0.25, -0.25], **TOL)
    assert float(metrics["accuracy"]) == 0.0


def test_bradley_terry_shard_sum_and_weights():
    r_c, r_r = rewards(seed=1)
    full, _ = bradley_terry_loss(r_c, r_r, center_coef=0.05)
    parts = [bradley_terry_loss(r_c[s], r_r[s], center_coef=0.05, num_pairs=6)[0] for s in (slice(0, 1), slice(1, 6))]
    np.testing.assert_allclose(float(parts[0] + parts[1]), float(full), **TOL)
    w = np.array([1, 1, 1, 0, 0, 0], np.float32)
    np.testing.assert_allclose(float(bradley_terry_loss(r_c, r_r, weights=w)[0]),
                               float(bradley_terry_loss(r_c[:3], r_r[:3])[0]), **TOL)

    # the metrics are weighted means too: a pair of weight 0 is not in them
    _, metrics = bradley_terry_loss(r_c, r_r, weights=w)
    _, first_three = bradley_terry_loss(r_c[:3], r_r[:3])
    for k in ("accuracy", "margin", "rewards/chosen", "rewards/rejected"):
        np.testing.assert_allclose(float(metrics[k]), float(first_three[k]), **TOL, err_msg=k)
    _, want = ref_bradley_terry(r_c[:3], r_r[:3], [0.0] * 3, 0.0)
    np.testing.assert_allclose(float(metrics["margin"]), want["margin"], **TOL)


def test_bradley_terry_bad_inputs():
    r_c, r_r = rewards()
    with pytest.raises(ValueError, match=r"shape mismatch: chosen_rewards=\(6,\), rejected_rewards=\(5,\)"):
        bradley_terry_loss(r_c, r_r[:5])
    with pytest.raises(ValueError, match=r"margin=\(4,\)"):
        bradley_terry_loss(r_c, r_r, margin=np.ones(4))
    with pytest.raises(ValueError, match="center_coef must lie in"):
        bradley_terry_loss(r_c, r_r, center_coef=-1.0)
    with pytest.raises(ValueError, match="chosen_rewards must have rank 1"):
        bradley_terry_loss(r_c[:, None], r_r[:, None])
    with pytest.raises(ValueError, match="margin must have rank 0 or 1"):
        jax.jit(lambda a, b, m: bradley_terry_loss(a, b, margin=m))(r_c, r_r, np.ones((6, 1)))


def ref_ensemble(rs, method, k):
    """Coste et al. 2023, column by column: mean, min, and mean minus k std / k variance
    (population variance over the ensemble)."""
    out = []
    n_models, b = rs.shape
    for j in range(b):
        col = [float(rs[i, j]) for i in range(n_models)]
        mu, var = references.mean(col), references.variance(col)
        out.append({"mean": mu, "min": min(col), "mean_minus_std": mu - k * math.sqrt(var),
                    "mean_minus_var": mu - k * var}[method])
    return out


class EnsembleVariantsTest(chex.TestCase):
    """Ensembles against the loop, jitted and not (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters((method, method) for method in ENSEMBLE_METHODS)
    def test_ensemble_matches_loop(self, method):
        rs = np.random.default_rng(2).normal(size=(3, 5)).astype(np.float32)
        got = self.variant(functools.partial(ensemble_rewards, method=method, k=0.7))(rs)
        assert got.shape == (5,) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), ref_ensemble(rs, method, 0.7), **TOL)


def test_ensemble_hand_values_and_bad_inputs():
    rs = np.array([[1.0, 2.0], [3.0, 2.0]], np.float32)  # column 0: mean 2, std 1; column 1: identical
    np.testing.assert_allclose(np.asarray(ensemble_rewards(rs, method="mean_minus_std", k=2.0)), [0.0, 2.0])
    # identical members: std 0 with a finite (mean-only) gradient
    g = jax.grad(lambda r: ensemble_rewards(r, method="mean_minus_std").sum())(jnp.asarray(rs))
    np.testing.assert_allclose(np.asarray(g)[:, 1], [0.5, 0.5])
    # the defaults: the plain mean over the ensemble, and k = 1 for the lower bounds
    np.testing.assert_allclose(np.asarray(ensemble_rewards(rs)), [2.0, 2.0])
    np.testing.assert_allclose(np.asarray(ensemble_rewards(rs, method="mean_minus_std")), [1.0, 2.0])
    np.testing.assert_allclose(np.asarray(ensemble_rewards(rs, method="mean_minus_var")), [1.0, 2.0])
    # d/dr_k of mu - sigma for column 0 (members 1 and 3): 1/2 -+ (r_k - mu) / (K sigma) = 1/2 -+ 1/2
    np.testing.assert_allclose(np.asarray(g)[:, 0], [1.0, 0.0], atol=1e-6)
    with pytest.raises(ValueError, match="unknown method 'median'; valid: mean, min, mean_minus_std, mean_minus_var"):
        ensemble_rewards(rs, method="median")
    with pytest.raises(ValueError, match="rewards must have rank 2"):
        ensemble_rewards(rs[0])
