"""Value loss and explained variance against NumPy loops and hand-worked cases."""

from __future__ import annotations

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from alignax import ops
from alignax.losses.value import explained_variance, value_loss
from tests.support import references

MODES = references.AGGREGATION_MODES
TOL = dict(rtol=1e-6, atol=1e-6)
DATA_KEYS = ("values", "old_values", "returns", "mask")


def ref_value_loss(data, clip_eps, mode, normalisers=None):
    """PPO2 (OpenAI baselines) value loss and metrics by per-token loops, float64."""
    v, v_old, ret, mask = (np.asarray(data[k], np.float64) for k in DATA_KEYS)
    per_token = np.zeros(v.shape)
    clipped_count = 0
    tokens = [(i, t) for i in range(v.shape[0]) for t in range(v.shape[1]) if mask[i][t]]
    for i, t in tokens:
        unclipped = (v[i][t] - ret[i][t]) ** 2
        if clip_eps is None:
            per_token[i][t] = 0.5 * unclipped
            continue
        v_clip = v_old[i][t] + min(max(v[i][t] - v_old[i][t], -clip_eps), clip_eps)
        clipped = (v_clip - ret[i][t]) ** 2
        per_token[i][t] = 0.5 * max(unclipped, clipped)
        clipped_count += clipped > unclipped
    n = max(len(tokens), 1)
    r = [ret[i][t] for i, t in tokens]
    resid = [ret[i][t] - v[i][t] for i, t in tokens]
    metrics = {
        "vf_clipfrac": clipped_count / n,
        "explained_variance": ref_explained_variance(r, resid),
        "values_mean": sum(v[i][t] for i, t in tokens) / n,
        "returns_mean": sum(r) / n,
    }
    return references.aggregate(per_token, mask, mode, **(normalisers or {})), metrics


def ref_explained_variance(returns, residuals):
    """``1 - Var[R - V] / Var[R]`` (population variances); 0 when ``Var[R]`` is 0."""
    if references.variance(returns) == 0:
        return 0.0
    return 1.0 - references.variance(residuals) / references.variance(returns)


def make_data(seed=1):
    rng = np.random.default_rng(seed)
    mask = np.array(
        [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [0, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]],
        np.float32,
    )
    returns = rng.normal(0.5, 1.0, mask.shape)
    old_values = returns + rng.normal(0.0, 0.5, mask.shape)
    values = old_values + rng.normal(0.0, 0.3, mask.shape)
    off = mask == 0
    values[off], old_values[off], returns[off] = 40.0, -40.0, 1e4  # ignored garbage
    return {k: v.astype(np.float32) for k, v in dict(values=values, old_values=old_values, returns=returns, mask=mask).items()}


DATA = make_data()
CLIP = 0.2


def _run_all_modes(values, old_values, returns, mask, clip_eps, normalisers):
    out = {}
    for mode in MODES:
        def f(v, mode=mode):
            return value_loss(v, old_values, returns, mask, clip_eps=clip_eps, aggregation=mode, **normalisers)

        (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(values)
        out[mode] = (loss, metrics, grad)
    return out


_RUN_JIT = jax.jit(_run_all_modes, static_argnums=4)


def all_modes(data, *, clip_eps, normalisers=None, run=_RUN_JIT):
    """``run`` (``_run_all_modes``, jitted by default) on the data as jax arrays."""
    args = [jnp.asarray(data[k]) for k in DATA_KEYS]
    norms = {k: jnp.asarray(v, jnp.float32) for k, v in (normalisers or {}).items()}
    out = run(*args, clip_eps, norms)
    result = {}
    for mode, (loss, metrics, grad) in out.items():
        assert loss.dtype == jnp.float32 and loss.shape == ()
        assert all(v.dtype == jnp.float32 and v.shape == () for v in metrics.values())
        result[mode] = (float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad))
    return result


def test_fixture_exercises_the_clip():
    _, m = ref_value_loss(DATA, CLIP, "token-mean")
    assert 0 < m["vf_clipfrac"] < 1


class ValueLossVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(("unclipped", None), ("clipped", CLIP))
    def test_matches_reference_every_mode(self, clip_eps):
        """Loss and metrics against the loops; the gradient equals the shared jitted
        program's, which test_gradient_matches_finite_differences checks."""
        out = all_modes(DATA, clip_eps=clip_eps, run=self.variant(_run_all_modes, static_argnums=4))
        jitted = all_modes(DATA, clip_eps=clip_eps)
        for mode in MODES:
            want_loss, want_metrics = ref_value_loss(DATA, clip_eps, mode)
            loss, metrics, grad = out[mode]
            np.testing.assert_allclose(loss, want_loss, err_msg=mode, **TOL)
            assert set(metrics) == set(want_metrics)
            for key, want in want_metrics.items():
                np.testing.assert_allclose(metrics[key], want, err_msg=f"{mode} {key}", **TOL)
            np.testing.assert_allclose(grad, jitted[mode][2], err_msg=mode, **TOL)


@pytest.mark.parametrize("clip_eps", [None, CLIP])
def test_gradient_matches_finite_differences(clip_eps):
    v, v_old, mask = (DATA[k].astype(np.float64) for k in ("values", "old_values", "mask"))
    # stay clear of the clip edges and of ties between the two squared terms
    assert np.min(np.abs(np.abs(v - v_old) - CLIP)[mask > 0]) > 1e-4
    out = all_modes(DATA, clip_eps=clip_eps)
    for mode in MODES:
        def ref(values, mode=mode):
            return ref_value_loss(dict(DATA, values=values), clip_eps, mode)[0]

        want = references.finite_difference(ref, DATA["values"])
        np.testing.assert_allclose(out[mode][2], want, rtol=1e-5, atol=1e-6, err_msg=mode)
        assert np.all(out[mode][2][mask == 0] == 0.0)


def test_hand_worked_clip():
    # V_old = 0, eps = 0.2. Token 1: V = 1, R = 2: (1-2)^2 = 1 vs (0.2-2)^2 = 3.24 -> the
    # clipped term wins, 1.62, gradient 0. Token 2: V = 1, R = 0: 1 vs 0.04 -> 0.5,
    # gradient V - R = 1. token-mean: (1.62 + 0.5) / 2 = 1.06, grads [0, 0.5].
    v, v_old, ret, mask = (jnp.asarray([x], jnp.float32) for x in ([1.0, 1.0], [0.0, 0.0], [2.0, 0.0], [1.0, 1.0]))
    f = jax.jit(jax.value_and_grad(lambda x: value_loss(x, v_old, ret, mask, clip_eps=0.2), has_aux=True))
    (loss, m), grad = f(v)
    np.testing.assert_allclose(float(loss), 1.06, **TOL)
    np.testing.assert_allclose(np.asarray(grad), [[0.0, 0.5]], **TOL)
    assert float(m["vf_clipfrac"]) == 0.5
    # Without clipping: (1 + 1) / 2 / 2 = 0.5, gradient (V - R) / 2 = [-0.5, 0.5].
    (loss, m), grad = jax.value_and_grad(lambda x: value_loss(x, v_old, ret, mask), has_aux=True)(v)
    np.testing.assert_allclose(float(loss), 0.5, **TOL)
    np.testing.assert_allclose(np.asarray(grad), [[-0.5, 0.5]], **TOL)
    assert float(m["vf_clipfrac"]) == 0.0


def test_masked_garbage_and_all_masked():
    off = DATA["mask"] == 0
    garbage = dict(DATA)
    garbage["values"] = np.where(off, np.float32(np.inf), DATA["values"])
    garbage["old_values"] = np.where(off, np.float32(-1e30), DATA["old_values"])
    garbage["returns"] = np.where(off, np.float32(-np.inf), DATA["returns"])
    dirty, clean = all_modes(garbage, clip_eps=CLIP), all_modes(DATA, clip_eps=CLIP)
    for mode in MODES:
        np.testing.assert_allclose(dirty[mode][0], clean[mode][0], err_msg=mode, **TOL)
        assert np.all(np.isfinite(dirty[mode][2])) and np.all(dirty[mode][2][off] == 0.0)
        assert all(np.isfinite(x) for x in dirty[mode][1].values())
    empty = all_modes(dict(DATA, mask=np.zeros_like(DATA["mask"])), clip_eps=CLIP)
    for mode, (loss, metrics, grad) in empty.items():
        assert loss == 0.0 and all(v == 0.0 for v in metrics.values()) and np.all(grad == 0.0), mode


def test_micro_batches_with_global_normalisers_sum_to_full_batch():
    normalisers = dict(ops.aggregation_normalisers(jnp.asarray(DATA["mask"])), norm_length=8.0)
    full = all_modes(DATA, clip_eps=CLIP, normalisers=normalisers)
    parts = [all_modes({k: v[rows] for k, v in DATA.items()}, clip_eps=CLIP, normalisers=normalisers)
             for rows in (slice(0, 2), slice(2, 5))]
    for mode in MODES:
        np.testing.assert_allclose(sum(p[mode][0] for p in parts), full[mode][0], err_msg=mode, **TOL)
        np.testing.assert_allclose(np.concatenate([p[mode][2] for p in parts]), full[mode][2], err_msg=mode, **TOL)


def test_explained_variance_hand_worked_and_degenerate():
    mask = jnp.ones((1, 4))
    returns = jnp.asarray([[1.0, 2.0, 3.0, 4.0]])
    ev = jax.jit(explained_variance)
    assert float(ev(returns, returns, mask)) == 1.0  # perfect prediction
    np.testing.assert_allclose(float(ev(returns, jnp.full((1, 4), 2.5), mask)), 0.0, atol=1e-7)  # the mean
    # residuals [1, 1, -1, -1]: Var = 1; Var[R] = 1.25 -> 1 - 1 / 1.25 = 0.2
    np.testing.assert_allclose(float(ev(returns, returns - jnp.asarray([[1.0, 1.0, -1.0, -1.0]]), mask)), 0.2, **TOL)
    # Masked-out entries are ignored: a wild value under the mask changes nothing.
    half = jnp.asarray([[1.0, 1.0, 1.0, 0.0]])
    wild = returns.at[0, 3].set(1e6)
    np.testing.assert_allclose(float(ev(wild, returns * 0.5, half)),
                               ref_explained_variance([1, 2, 3], [0.5, 1.0, 1.5]), **TOL)
    # Zero-variance returns, one token, no token: 0, never NaN.
    for r, v, m in ((jnp.full((1, 4), 3.0), returns, mask), (returns, returns * 2, jnp.asarray([[0.0, 1.0, 0.0, 0.0]])),
                    (returns, returns * 2, jnp.zeros((1, 4)))):
        out = float(ev(r, v, m))
        assert out == 0.0 and not math.isnan(out)


def test_bad_inputs_name_the_argument():
    v, v_old, ret, mask = (jnp.asarray(DATA[k]) for k in DATA_KEYS)
    with pytest.raises(ValueError, match="values must have rank 2"):
        value_loss(v[0], v_old[0], ret[0], mask[0])
    with pytest.raises(ValueError, match=r"returns=\(5, 5\)"):
        value_loss(v, v_old, ret[:, :5], mask)
    with pytest.raises(ValueError, match=r"old_values=\(4, 6\)"):
        value_loss(v, v_old[:4], ret, mask)
    with pytest.raises(ValueError, match="unknown aggregation 'sum'"):
        value_loss(v, v_old, ret, mask, aggregation="sum")
    with pytest.raises(ValueError, match="clip_eps must be >= 0"):
        value_loss(v, v_old, ret, mask, clip_eps=-0.1)
    with pytest.raises(ValueError, match=r"values=\(5, 5\)"):
        explained_variance(ret, v[:, :5], mask)
