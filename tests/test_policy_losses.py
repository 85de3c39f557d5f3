"""Policy losses against NumPy loops written from each paper's formula, plus hand-worked cases.

The references below loop over tokens in float64 and share no code with alignax: the
aggregation modes, the PPO / GSPO / CISPO / REINFORCE per-token losses, TIS weights, the
k3 estimator and the metrics are each re-derived from their definitions.
"""

from __future__ import annotations

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from alignax import ops
from alignax.losses.policy import (
    POLICY_LOSSES,
    cispo_policy_loss,
    gspo_policy_loss,
    pg_loss,
    policy_loss_clip_keywords,
    ppo_policy_loss,
    sapo_policy_loss,
)
from tests.support import references
from tests.support.references import clip

MODES = references.AGGREGATION_MODES
TOL = dict(rtol=1e-6, atol=1e-6)

# ---------------------------------------------------------------------------------------
# NumPy references (float64, per-token loops)
# ---------------------------------------------------------------------------------------


def ref_token_losses(kind, lp, old, adv, mask, hp):
    """Per-token policy loss l_t and the ratio each variant uses, from the papers."""
    batch, length = lp.shape
    loss = np.zeros((batch, length))
    ratio = np.ones((batch, length))
    for i in range(batch):
        if kind == "gspo":  # Zheng et al. 2025 eq. (7): length-normalised sequence ratio
            n = sum(mask[i])
            mean_log = sum(lp[i][t] - old[i][t] for t in range(length) if mask[i][t]) / max(n, 1)
            s_i = math.exp(mean_log)
        for t in range(length):
            if not mask[i][t]:
                continue
            a = adv[i][t]
            r = math.exp(lp[i][t] - old[i][t])
            if kind == "ppo":  # Schulman et al. 2017 eq. (7), DAPO clip-higher, dual clip
                l_t = references.ppo_clip(r, a, hp["clip_eps_low"], hp["clip_eps_high"])
                if hp.get("dual_clip_c") is not None and a < 0:
                    l_t = min(l_t, -hp["dual_clip_c"] * a)
            elif kind == "gspo":
                r = s_i
                l_t = references.ppo_clip(r, a, hp["clip_eps_low"], hp["clip_eps_high"])
            elif kind == "sapo":  # Gao et al. 2025: (4 / tau) sigmoid(tau (r - 1)), tau by the sign of A
                tau = hp["sapo_temperature_pos"] if a > 0 else hp["sapo_temperature_neg"]
                l_t = -(4.0 / tau) / (1.0 + math.exp(-tau * (r - 1.0))) * a
            elif kind == "cispo":  # MiniMax-M1 eq. (4)
                lo = -math.inf if hp.get("clip_eps_low") is None else 1 - hp["clip_eps_low"]
                w = clip(r, lo, 1 + hp["clip_eps_high"])
                l_t = -w * a * lp[i][t]
            else:  # REINFORCE
                l_t = -a * lp[i][t]
            loss[i][t] = l_t
            ratio[i][t] = r
    return loss, ratio


def ref_loss_and_metrics(kind, data, hp, opts, mode, normalisers=None):
    """The full loss of the module docstring and the metrics, by loops."""
    lp, old, adv, mask = (np.asarray(data[k], np.float64) for k in ("logps", "old_logps", "advantages", "mask"))
    if adv.ndim == 1:
        adv = np.repeat(adv[:, None], lp.shape[1], axis=1)
    batch, length = lp.shape
    normalisers = normalisers or {}
    agg = functools.partial(references.aggregate, mask=mask, mode=mode, **normalisers)
    per_token, ratio = ref_token_losses(kind, lp, old, adv, mask, hp)
    tis = np.ones((batch, length))
    if "sampler_logps" in opts:
        sampler = np.asarray(opts["sampler_logps"], np.float64)
        for i in range(batch):
            for t in range(length):
                tis[i][t] = min(math.exp(old[i][t] - sampler[i][t]), opts["tis_cap"])
    pg = agg(per_token * tis)
    loss = pg
    tokens = [(i, t) for i in range(batch) for t in range(length) if mask[i][t]]
    n = max(len(tokens), 1)
    metrics = {"pg_loss": pg}
    if "entropy" in opts:
        ent = np.asarray(opts["entropy"], np.float64)
        loss -= opts["entropy_coef"] * agg(ent)
        metrics["entropy"] = sum(ent[i][t] for i, t in tokens) / n
    if "ref_logps" in opts:
        ref = np.asarray(opts["ref_logps"], np.float64)
        k3 = np.zeros((batch, length))
        for i, t in tokens:
            k3[i][t] = references.kl_of_log_ratio(lp[i][t] - ref[i][t], "k3")
        loss += opts["kl_coef"] * agg(k3)
        metrics["kl"] = sum(k3[i][t] for i, t in tokens) / n
    if "sampler_logps" in opts:
        metrics["tis_weight_mean"] = sum(tis[i][t] for i, t in tokens) / n

    low = high = dual = 0
    for i, t in tokens:
        a, r = adv[i][t], ratio[i][t]
        if kind in ("ppo", "gspo"):
            low += a < 0 and r < 1 - hp["clip_eps_low"]
            high += a > 0 and r > 1 + hp["clip_eps_high"]
        elif kind == "cispo":
            low += hp.get("clip_eps_low") is not None and r < 1 - hp["clip_eps_low"]
            high += r > 1 + hp["clip_eps_high"]
        if hp.get("dual_clip_c") is not None:
            dual += a < 0 and r > hp["dual_clip_c"]
    token_ratio = [math.exp(lp[i][t] - old[i][t]) for i, t in tokens]
    metrics.update(
        clipfrac_low=low / n,
        clipfrac_high=high / n,
        # k3 of KL(pi_old || pi_theta) on tokens from pi_old: log-ratio log(pi_old / pi_theta).
        approx_kl=sum(references.kl_of_log_ratio(-math.log(r), "k3") for r in token_ratio) / n,
        ratio_mean=sum(ratio[i][t] for i, t in tokens) / n,
        ratio_min=min((ratio[i][t] for i, t in tokens), default=0.0),
        ratio_max=max((ratio[i][t] for i, t in tokens), default=0.0),
    )
    if hp.get("dual_clip_c") is not None:
        metrics["dual_clipfrac"] = dual / n
    return loss, metrics


def agg_weights(mask, mode, normalisers=None):
    """d aggregate / d x_it, read off the (linear) reference aggregation with one-hots."""
    w = np.zeros(mask.shape)
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            onehot = np.zeros(mask.shape)
            onehot[i, t] = 1.0
            w[i, t] = references.aggregate(onehot, mask, mode, **(normalisers or {}))
    return w


# ---------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------

# Hyper-parameters for the parity tests; GSPO's range is widened so some sequences are
# clipped and some are not on this data (the coverage test below checks it).
HPARAMS = {
    "ppo": dict(clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=3.0),
    "gspo": dict(clip_eps_low=0.03, clip_eps_high=0.06),
    "cispo": dict(clip_eps_low=0.2, clip_eps_high=0.28),
    "sapo": dict(sapo_temperature_pos=0.9, sapo_temperature_neg=1.4),
    "pg": dict(),
}


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    batch, length = 5, 6
    mask = np.array(
        [
            [1, 1, 1, 1, 0, 0],
            [1, 1, 1, 1, 1, 1],
            [0, 0, 0, 0, 0, 0],  # a row with no response token
            [0, 1, 1, 1, 0, 0],  # prompt, response, padding
            [1, 1, 0, 0, 0, 0],
        ],
        np.float32,
    )
    logps = -rng.uniform(0.1, 3.0, (batch, length))
    old_logps = logps + rng.normal(0.0, 0.25, (batch, length))
    old_logps[1, 2] = logps[1, 2] - 1.5  # ratio e^1.5 > 3 with A < 0: dual clip bites
    advantages = rng.normal(0.0, 1.0, (batch, length))
    advantages[1, 2] = -1.3
    data = dict(
        logps=logps, old_logps=old_logps, advantages=advantages, mask=mask,
    )
    opts = dict(
        entropy=rng.uniform(0.5, 2.0, (batch, length)),
        ref_logps=logps + rng.normal(0.0, 0.2, (batch, length)),
        sampler_logps=old_logps + rng.normal(0.0, 0.5, (batch, length)),
    )
    off = mask == 0  # moderate garbage under the mask; references never read it
    data["logps"][off] = 50.0
    data["advantages"][off] = -1e4
    opts["entropy"][off] = 1e6
    data = {k: v.astype(np.float32) for k, v in data.items()}
    opts = {k: v.astype(np.float32) for k, v in opts.items()}
    opts.update(entropy_coef=0.03, kl_coef=0.2, tis_cap=1.5)
    return data, opts


DATA, OPTS = make_data()
ARRAY_OPTS = ("entropy", "ref_logps", "sampler_logps")
DATA_KEYS = ("logps", "old_logps", "advantages", "mask")


def _run_all_modes(kind, logps, old_logps, advantages, mask, opts, normalisers):
    """Loss, metrics and d loss / d logps for every aggregation mode, in one program."""
    out = {}
    for mode in MODES:
        def f(lp, mode=mode):
            return POLICY_LOSSES[kind](
                lp, old_logps, advantages, mask, aggregation=mode, **HPARAMS[kind], **opts, **normalisers
            )

        (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(logps)
        out[mode] = (loss, metrics, grad)
    return out


# One compiled program per (kind, shapes, option keys): the parity, gradient, garbage,
# first-step and all-masked tests share it. The coefficients and the normalisers are
# traced arguments, so that path is exercised too.
_RUN_ALL_MODES_JIT = jax.jit(_run_all_modes, static_argnums=0)


def all_modes(kind, data, *, opts=None, normalisers=None, run=_RUN_ALL_MODES_JIT):
    """``run`` (``_run_all_modes``, jitted by default) on float32 copies of the inputs."""
    args = [jnp.asarray(data[k]) for k in DATA_KEYS]
    opts = {k: jnp.asarray(v, jnp.float32) for k, v in (opts or {}).items()}
    norms = {k: jnp.asarray(v, jnp.float32) for k, v in (normalisers or {}).items()}
    out = run(kind, *args, opts, norms)
    result = {}
    for mode, (loss, metrics, grad) in out.items():
        assert loss.dtype == jnp.float32 and loss.shape == ()
        assert all(v.dtype == jnp.float32 and v.shape == () for v in metrics.values())
        result[mode] = (float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad))
    return result


def assert_metrics(got, want, msg=""):
    assert set(got) == set(want), (sorted(got), sorted(want))
    for key in want:
        np.testing.assert_allclose(float(got[key]), want[key], err_msg=f"{msg} {key}", **TOL)


# ---------------------------------------------------------------------------------------
# Parity with the references
# ---------------------------------------------------------------------------------------


def test_fixture_exercises_every_branch():
    """The parity data must hit the clips, the dual clip and the TIS cap, or it proves little."""
    for kind in ("ppo", "gspo", "cispo"):
        _, m = ref_loss_and_metrics(kind, DATA, HPARAMS[kind], OPTS, "token-mean")
        assert m["clipfrac_low"] > 0 and m["clipfrac_high"] > 0, kind
        assert m["clipfrac_low"] + m["clipfrac_high"] < 1, kind
    _, m = ref_loss_and_metrics("ppo", DATA, HPARAMS["ppo"], OPTS, "token-mean")
    assert m["dual_clipfrac"] > 0
    mask = DATA["mask"] > 0
    tis = np.exp(DATA["old_logps"].astype(np.float64) - OPTS["sampler_logps"])[mask]
    assert (tis > OPTS["tis_cap"]).any() and (tis < OPTS["tis_cap"]).any()


KINDS = [(kind, kind) for kind in sorted(POLICY_LOSSES)]


def test_sapo_on_policy_gradient_is_ppos_and_never_cut():
    """SAPO's weight d l / d(-A logp) = 4 s (1 - s) r, s = sigmoid(tau (r - 1)): exactly 1 at
    r = 1 (PPO's gradient), positive at every ratio (no hard cut where PPO-clip gives 0)."""
    lp = jnp.log(jnp.asarray([[0.5, 0.8, 1.0, 1.25, 2.0, 4.0]], jnp.float32)) - 1.0
    old, mask = jnp.full(lp.shape, -1.0), jnp.ones(lp.shape)
    for a in (1.0, -1.0):
        adv = jnp.full(lp.shape, a)
        grad = jax.grad(lambda x: sapo_policy_loss(x, old, adv, mask, aggregation="seq-mean-token-sum-norm",
                                                   norm_length=1.0)[0])(lp)
        weight = np.asarray(grad)[0] / -a
        r = np.exp(np.asarray(lp - old, np.float64))[0]
        tau = 1.0 if a > 0 else 1.05
        sig = 1 / (1 + np.exp(-tau * (r - 1)))
        np.testing.assert_allclose(weight, 4 * sig * (1 - sig) * r, rtol=1e-5)
        assert weight[2] == pytest.approx(1.0, rel=1e-6) and np.all(weight[[0, 1, 3, 4, 5]] > 0)


class PolicyLossVariantsTest(chex.TestCase):
    """Parity with the references, jitted and not (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(KINDS)
    def test_matches_reference_all_options_every_mode(self, kind):
        """Every option on (clip-higher, dual clip, TIS, entropy, KL); the gradient equals the
        shared jitted program's, which the gradient tests below check against references."""
        out = all_modes(kind, DATA, opts=OPTS, run=self.variant(_run_all_modes, static_argnums=0))
        jitted = all_modes(kind, DATA, opts=OPTS)
        for mode in MODES:
            want_loss, want_metrics = ref_loss_and_metrics(kind, DATA, HPARAMS[kind], OPTS, mode)
            loss, metrics, grad = out[mode]
            np.testing.assert_allclose(loss, want_loss, err_msg=mode, **TOL)
            assert_metrics(metrics, want_metrics, mode)
            np.testing.assert_allclose(grad, jitted[mode][2], err_msg=mode, **TOL)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(KINDS)
    def test_matches_reference_defaults_and_sequence_advantages(self, kind):
        """Default hyper-parameters, no options, and advantages given per sequence ``[B]``."""
        defaults = {
            "ppo": dict(clip_eps_low=0.2, clip_eps_high=0.2),
            "gspo": dict(clip_eps_low=3e-4, clip_eps_high=4e-4),
            "cispo": dict(clip_eps_low=None, clip_eps_high=0.28),
            "sapo": dict(sapo_temperature_pos=1.0, sapo_temperature_neg=1.05),
            "pg": dict(),
        }[kind]
        mode = "seq-mean-token-mean" if kind == "gspo" else "token-mean"
        data = dict(DATA, advantages=np.array([0.7, -0.4, 5.0, -1.1, 0.3], np.float32))
        want_loss, want_metrics = ref_loss_and_metrics(kind, data, defaults, {}, mode)
        loss, metrics = self.variant(POLICY_LOSSES[kind])(*(jnp.asarray(data[k]) for k in DATA_KEYS))
        np.testing.assert_allclose(float(loss), want_loss, **TOL)
        assert_metrics(metrics, want_metrics)


# ---------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------


def assert_away_from_kinks(kind, data, hp):
    """Finite differences (and analytic branch choices) need no clip boundary within reach."""
    _, ratio = ref_token_losses(kind, *(np.asarray(data[k], np.float64) for k in DATA_KEYS), hp)
    ratio = ratio[data["mask"] > 0]
    edges = [1 - hp["clip_eps_low"], 1 + hp["clip_eps_high"], hp.get("dual_clip_c") or 10.0]
    assert min(abs(r - e) for r in ratio for e in edges) > 1e-4


def analytic_grad(kind, data, opts, mode):
    """d loss / d logps from the per-token derivatives of each paper's objective.

    GSPO-token: -A_t s_i where the clip is inactive, else 0. CISPO: -w_t A_t with w_t the
    clipped (constant) weight. PG: -A_t. The TIS weight scales the policy term, the k3 KL
    adds kl_coef * (1 - pi_ref / pi), and the aggregation weights each token.
    """
    hp = HPARAMS[kind]
    lp, old, adv, mask = (np.asarray(data[k], np.float64) for k in DATA_KEYS)
    _, ratio = ref_token_losses(kind, lp, old, adv, mask, hp)
    weights = agg_weights(mask, mode)
    grad = np.zeros(lp.shape)
    for i, t in zip(*np.nonzero(mask)):
        a, r = adv[i, t], ratio[i, t]
        if kind == "gspo":
            clipped = (a > 0 and r > 1 + hp["clip_eps_high"]) or (a < 0 and r < 1 - hp["clip_eps_low"])
            dpolicy = 0.0 if clipped else -a * r
        elif kind == "cispo":
            dpolicy = -clip(r, 1 - hp["clip_eps_low"], 1 + hp["clip_eps_high"]) * a
        else:
            dpolicy = -a
        tis = min(math.exp(old[i, t] - opts["sampler_logps"][i, t]), opts["tis_cap"])
        dkl = 1.0 - math.exp(opts["ref_logps"][i, t] - lp[i, t])
        grad[i, t] = weights[i, t] * (tis * dpolicy + opts["kl_coef"] * dkl)
    return grad


@pytest.mark.parametrize("kind", ["ppo", "sapo"])
def test_gradient_matches_finite_differences(kind):
    if kind == "ppo":
        assert_away_from_kinks("ppo", DATA, HPARAMS["ppo"])
    out = all_modes(kind, DATA, opts=OPTS)
    for mode in MODES:
        def ref(lp, mode=mode):
            return ref_loss_and_metrics(kind, dict(DATA, logps=lp), HPARAMS[kind], OPTS, mode)[0]

        want = references.finite_difference(ref, DATA["logps"])
        np.testing.assert_allclose(out[mode][2], want, rtol=1e-5, atol=1e-6, err_msg=mode)


@pytest.mark.parametrize("kind", ["gspo", "cispo", "pg"])
def test_stop_gradient_forms_match_analytic_gradient(kind):
    """GSPO-token, CISPO and PG use stop-gradients, so their gradient is not the derivative
    of their value: check it against the per-token derivative written from each paper."""
    assert_away_from_kinks(kind, DATA, {"clip_eps_low": 0.2, "clip_eps_high": 0.28, **HPARAMS[kind]})
    out = all_modes(kind, DATA, opts=OPTS)
    for mode in MODES:
        want = analytic_grad(kind, DATA, OPTS, mode)
        np.testing.assert_allclose(out[mode][2], want, rtol=1e-5, atol=1e-6, err_msg=mode)
        assert np.abs(want).max() > 1e-3


def test_gspo_equals_sequence_level_gspo_for_sequence_advantages():
    """Per-sequence advantages + seq-mean-token-mean: value and gradient of the paper's
    sequence objective mean_i max(-A_i s_i, -A_i clip(s_i)), with s_i a function of all
    the row's log-probs (differentiated by finite differences)."""
    hp = HPARAMS["gspo"]
    adv_seq = np.array([0.9, -0.6, 0.3, 1.1, -0.8], np.float32)
    mask = DATA["mask"]

    def sequence_gspo(lp):
        total, count = 0.0, 0
        for i in range(lp.shape[0]):
            toks = [t for t in range(lp.shape[1]) if mask[i, t]]
            if not toks:
                continue
            s_i = math.exp(sum(lp[i, t] - float(DATA["old_logps"][i, t]) for t in toks) / len(toks))
            a = float(adv_seq[i])
            total += max(-a * s_i, -a * clip(s_i, 1 - hp["clip_eps_low"], 1 + hp["clip_eps_high"]))
            count += 1
        return total / count

    def f(lp):
        return gspo_policy_loss(lp, DATA["old_logps"], adv_seq, mask, aggregation="seq-mean-token-mean", **hp)

    (loss, _), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(jnp.asarray(DATA["logps"]))
    np.testing.assert_allclose(float(loss), sequence_gspo(DATA["logps"].astype(np.float64)), **TOL)
    want = references.finite_difference(sequence_gspo, DATA["logps"])
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-5, atol=1e-6)
    assert np.abs(want).max() > 0.01  # some sequence is unclipped, so the check has teeth


# ---------------------------------------------------------------------------------------
# Invariants
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_first_step_ratio_is_exactly_one(kind):
    data = dict(DATA, old_logps=DATA["logps"].copy())
    for mode, (_, m, _) in all_modes(kind, data, opts=OPTS).items():
        for key in ("ratio_mean", "ratio_min", "ratio_max"):
            assert m[key] == 1.0, (mode, key)
        for key in ("clipfrac_low", "clipfrac_high", "approx_kl"):
            assert m[key] == 0.0, (mode, key)


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_masked_garbage_gets_exactly_zero_gradient(kind):
    """Huge and infinite values under the mask change nothing, and their gradient is 0."""
    off = DATA["mask"] == 0
    garbage = dict(DATA)
    garbage["logps"] = np.where(off, np.float32(1e30), DATA["logps"])
    garbage["logps"][0, 5] = np.inf
    garbage["old_logps"] = np.where(off, np.float32(-1e30), DATA["old_logps"])
    garbage["advantages"] = np.where(off, np.float32(np.inf), DATA["advantages"])
    opts = dict(OPTS)
    for key in ARRAY_OPTS:
        opts[key] = np.where(off, np.float32(-np.inf), OPTS[key])
    dirty = all_modes(kind, garbage, opts=opts)
    clean = all_modes(kind, DATA, opts=OPTS)
    for mode in MODES:
        loss, metrics, grad = dirty[mode]
        np.testing.assert_allclose(loss, clean[mode][0], err_msg=mode, **TOL)
        assert all(np.isfinite(v) for v in metrics.values()), mode
        assert np.all(np.isfinite(grad)) and np.all(grad[off] == 0.0), mode
        np.testing.assert_allclose(grad, clean[mode][2], err_msg=mode, **TOL)


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_all_masked_batch_is_finite_zero(kind):
    data = dict(DATA, mask=np.zeros_like(DATA["mask"]))
    for mode, (loss, metrics, grad) in all_modes(kind, data, opts=OPTS).items():
        assert loss == 0.0, mode
        assert all(v == 0.0 for v in metrics.values()), (mode, metrics)
        assert np.all(grad == 0.0), mode


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_all_masked_batch_metrics_are_zero_unjitted(kind):
    """The test above once more without ``jit``: its shared program is traced by an earlier test,
    so it makes no Python call into the loss, and mutmut (which maps a test to the functions it
    sees called when the tests are first run) never ran it against a mutant of, e.g., the empty
    mask's ``ratio_min`` / ``ratio_max`` (0 and 0)."""
    data = dict(DATA, mask=np.zeros_like(DATA["mask"]))
    loss, metrics = POLICY_LOSSES[kind](*(jnp.asarray(data[k]) for k in DATA_KEYS), **HPARAMS[kind], **OPTS)
    assert float(loss) == 0.0 and all(float(v) == 0.0 for v in metrics.values()), metrics


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_micro_batches_with_global_normalisers_sum_to_full_batch(kind):
    mask = DATA["mask"]
    normalisers = dict(ops.aggregation_normalisers(jnp.asarray(mask)), norm_length=8.0)
    full = all_modes(kind, DATA, opts=OPTS, normalisers=normalisers)
    parts = []
    for rows in (slice(0, 2), slice(2, 5)):
        data = {k: v[rows] for k, v in DATA.items()}
        opts = {k: (v[rows] if k in ARRAY_OPTS else v) for k, v in OPTS.items()}
        parts.append(all_modes(kind, data, opts=opts, normalisers=normalisers))
    counts = {"num_tokens": int(mask.sum()), "num_seqs": int((mask.sum(1) > 0).sum()), "norm_length": 8.0}
    for mode in MODES:
        np.testing.assert_allclose(sum(p[mode][0] for p in parts), full[mode][0], err_msg=mode, **TOL)
        np.testing.assert_allclose(np.concatenate([p[mode][2] for p in parts]), full[mode][2], err_msg=mode, **TOL)
        want, _ = ref_loss_and_metrics(kind, DATA, HPARAMS[kind], OPTS, mode, counts)
        np.testing.assert_allclose(full[mode][0], want, err_msg=mode, **TOL)


def test_value_and_grad_has_aux_and_metrics_carry_no_gradient():
    def total(lp):
        loss, metrics = ppo_policy_loss(lp, DATA["old_logps"], DATA["advantages"], DATA["mask"])
        return loss, metrics

    (loss, metrics), grad = jax.value_and_grad(total, has_aux=True)(jnp.asarray(DATA["logps"]))
    assert np.isfinite(float(loss)) and grad.shape == DATA["logps"].shape

    # A function of the metrics alone has zero gradient: they are stop-gradiented.
    def metric_sum(lp):
        _, m = ppo_policy_loss(lp, DATA["old_logps"], DATA["advantages"], DATA["mask"])
        return sum(m.values())

    assert np.all(np.asarray(jax.grad(metric_sum)(jnp.asarray(DATA["logps"]))) == 0.0)


# ---------------------------------------------------------------------------------------
# Hand-worked cases
# ---------------------------------------------------------------------------------------


def _row(*values):
    return jnp.asarray([values], jnp.float32)


def test_dual_clip_hand_worked():
    # Two tokens with r = e^1.5 = 4.4817: A = -1 -> standard loss 4.4817, capped at c|A| = 3;
    # A = +2 -> max(-8.96, -2 * 1.2) = -2.4, no dual clip. token-mean: (3 - 2.4) / 2 = 0.3.
    lp, old, adv, mask = _row(-1.0, -1.0), _row(-2.5, -2.5), _row(-1.0, 2.0), _row(1.0, 1.0)
    fn = functools.partial(ppo_policy_loss, clip_eps_low=0.2, dual_clip_c=3.0)
    (loss, m), grad = jax.jit(jax.value_and_grad(fn, has_aux=True))(lp, old, adv, mask)
    np.testing.assert_allclose(float(loss), 0.3, **TOL)
    np.testing.assert_allclose(np.asarray(grad), [[0.0, 0.0]], atol=1e-7)
    assert float(m["dual_clipfrac"]) == 0.5 and float(m["clipfrac_high"]) == 0.5
    assert float(m["clipfrac_low"]) == 0.0
    loss, m = jax.jit(ppo_policy_loss)(lp, old, adv, mask)
    np.testing.assert_allclose(float(loss), (math.exp(1.5) - 2.4) / 2, **TOL)
    assert "dual_clipfrac" not in m


def test_clip_higher_hand_worked():
    # r = 1.25, A = +1: with eps_high = 0.28 the ratio is inside, loss -1.25 and gradient
    # -r A = -1.25; with the symmetric 0.2 it is clipped: loss -1.2, gradient 0.
    # r = 0.75, A = -1: below 1 - 0.2, loss max(0.75, 0.8) = 0.8 and clipfrac_low = 1.
    lp, old, one = _row(math.log(1.25)), _row(0.0), _row(1.0)
    wide = jax.jit(jax.value_and_grad(
        functools.partial(ppo_policy_loss, clip_eps_low=0.2, clip_eps_high=0.28), has_aux=True))
    (loss, m), grad = wide(lp, old, one, one)
    np.testing.assert_allclose([float(loss), float(grad[0, 0])], [-1.25, -1.25], **TOL)
    assert float(m["clipfrac_high"]) == 0.0
    (loss, m), grad = jax.jit(jax.value_and_grad(ppo_policy_loss, has_aux=True))(lp, old, one, one)
    np.testing.assert_allclose([float(loss), float(grad[0, 0])], [-1.2, 0.0], **TOL)
    assert float(m["clipfrac_high"]) == 1.0
    (loss, m), grad = wide(_row(math.log(0.75)), old, _row(-1.0), one)
    np.testing.assert_allclose([float(loss), float(grad[0, 0])], [0.8, 0.0], **TOL)
    assert float(m["clipfrac_low"]) == 1.0 and float(m["clipfrac_high"]) == 0.0


def test_gspo_hand_worked():
    # Log-ratios 0.1 and 0.3 -> s = e^0.2 = 1.221403; A = 1. Inside (0.2, 0.28): each token
    # loses -s, the row mean is -s, and each token's gradient is -s / 2. With eps_high 0.2
    # the whole sequence is clipped: loss -1.2, gradient 0.
    lp, old, adv, mask = _row(-1.0, -2.0), _row(-1.1, -2.3), jnp.asarray([1.0]), _row(1.0, 1.0)
    s = math.exp(0.2)
    f = functools.partial(gspo_policy_loss, clip_eps_low=0.2, clip_eps_high=0.28)
    (loss, m), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(lp, old, adv, mask)
    np.testing.assert_allclose(float(loss), -s, **TOL)
    np.testing.assert_allclose(np.asarray(grad), [[-s / 2, -s / 2]], **TOL)
    np.testing.assert_allclose([float(m["ratio_min"]), float(m["ratio_max"])], [s, s], **TOL)
    f = functools.partial(gspo_policy_loss, clip_eps_low=0.2, clip_eps_high=0.2)
    (loss, m), grad = jax.value_and_grad(f, has_aux=True)(lp, old, adv, mask)
    np.testing.assert_allclose(float(loss), -1.2, **TOL)
    np.testing.assert_allclose(np.asarray(grad), [[0.0, 0.0]], atol=1e-7)
    assert float(m["clipfrac_high"]) == 1.0


def test_cispo_hand_worked():
    # r = 1.5, A = 1, logp = -2, eps_high 0.28: w = 1.28, loss = -1.28 * 1 * -2 = 2.56,
    # gradient -w A = -1.28 (the clip scales, it does not drop). r = 0.5, A = -1, logp = -1:
    # no lower clip -> w = 0.5, loss -0.5; with eps_low 0.2 -> w = 0.8, loss -0.8.
    lp, old, one = _row(-2.0), _row(-2.0 - math.log(1.5)), _row(1.0)
    (loss, m), grad = jax.value_and_grad(cispo_policy_loss, has_aux=True)(lp, old, one, one)
    np.testing.assert_allclose([float(loss), float(grad[0, 0])], [2.56, -1.28], **TOL)
    assert float(m["clipfrac_high"]) == 1.0
    lp, old, adv = _row(-1.0), _row(-1.0 - math.log(0.5)), _row(-1.0)
    loss, m = cispo_policy_loss(lp, old, adv, one)
    np.testing.assert_allclose(float(loss), -0.5, **TOL)
    assert float(m["clipfrac_low"]) == 0.0
    loss, m = cispo_policy_loss(lp, old, adv, one, clip_eps_low=0.2)
    np.testing.assert_allclose(float(loss), -0.8, **TOL)
    assert float(m["clipfrac_low"]) == 1.0


def test_dual_clipfrac_counts_negative_advantages_strictly_above_c():
    """``dual_clipfrac`` is ``A < 0 and r > c`` (verl counts ``-A r > -A c``): a zero
    advantage above ``c`` and a negative one at ``r = c`` exactly are not counted. ``c`` is
    the loss's own ``e^1.5`` (the ``ratio_min`` of an eager call; the same eager ``exp`` of
    the same array gives the same float32), where both bounds give the same loss."""
    lp, old, one = _row(1.5, 2.0, 2.0), _row(0.0, 0.0, 0.0), _row(1.0, 1.0, 1.0)
    adv = _row(-1.0, 0.0, -1.0)
    _, m = ppo_policy_loss(lp, old, adv, one)
    c = float(m["ratio_min"])
    assert c == pytest.approx(math.exp(1.5), rel=1e-6)
    loss, m = ppo_policy_loss(lp, old, adv, one, dual_clip_c=c)
    assert float(m["ratio_min"]) == c  # the first token's ratio is c itself
    np.testing.assert_allclose(float(loss), (c + 0.0 + c) / 3, **TOL)  # both capped at c |A|
    assert float(m["dual_clipfrac"]) == pytest.approx(1 / 3)


@pytest.mark.parametrize("kind", ["ppo", "gspo", "cispo"])
def test_a_ratio_on_the_band_edge_is_not_clipped(kind):
    """``clipfrac_low`` / ``clipfrac_high`` are strict, ``r < 1 - eps_low`` and ``r > 1 +
    eps_high``: with both epsilons 0 an on-policy ratio of exactly 1 sits on both edges and is
    counted by neither, for either sign of the advantage; the loss is the unclipped one."""
    lp = _row(-0.5, -1.0, -2.0)
    adv = _row(1.0, -1.0, 2.0)
    loss, m = POLICY_LOSSES[kind](lp, lp, adv, jnp.ones_like(lp), clip_eps_low=0.0, clip_eps_high=0.0)
    assert float(m["ratio_min"]) == float(m["ratio_max"]) == 1.0
    assert float(m["clipfrac_low"]) == 0.0 and float(m["clipfrac_high"]) == 0.0
    # PPO, GSPO: -A r with r = 1 (GSPO's row mean of the token values); CISPO: -w A logp, w = 1
    want = {"ppo": -2.0 / 3, "gspo": -2.0 / 3, "cispo": (0.5 - 1.0 + 4.0) / 3}[kind]
    np.testing.assert_allclose(float(loss), want, **TOL)


@pytest.mark.parametrize("kind", ["ppo", "gspo"])
def test_a_zero_advantage_is_never_clipped(kind):
    """For PPO and GSPO a clip counts only where it cuts the gradient, ``A < 0`` below the band
    and ``A > 0`` above it: rows with ``A = 0`` and ratios 0.5 and 2, far outside, count in neither."""
    lp = jnp.asarray([[math.log(0.5)] * 2, [math.log(2.0)] * 2], jnp.float32)
    loss, m = POLICY_LOSSES[kind](lp, jnp.zeros_like(lp), jnp.zeros((2,)), jnp.ones_like(lp))
    np.testing.assert_allclose([float(m["ratio_min"]), float(m["ratio_max"])], [0.5, 2.0], rtol=1e-6)
    assert float(m["clipfrac_low"]) == 0.0 and float(m["clipfrac_high"]) == 0.0
    assert float(loss) == 0.0


def test_tis_hand_worked():
    # PG, A = 1, logp = -1: per-token loss 1. old - sampler = log 3 -> weight min(3, 2) = 2;
    # log 0.5 -> 0.5. token-mean (2 + 0.5) / 2 = 1.25; gradient -w A / 2 = [-1, -0.25].
    lp, one2 = _row(-1.0, -1.0), _row(1.0, 1.0)
    sampler = _row(-1.0 - math.log(3.0), -1.0 - math.log(0.5))
    (loss, m), grad = jax.jit(jax.value_and_grad(
        lambda x: pg_loss(x, lp, one2, one2, sampler_logps=sampler, tis_cap=2.0), has_aux=True
    ))(lp)
    np.testing.assert_allclose(float(loss), 1.25, **TOL)
    np.testing.assert_allclose(np.asarray(grad), [[-1.0, -0.25]], **TOL)
    np.testing.assert_allclose(float(m["tis_weight_mean"]), 1.25, **TOL)
    _, m = jax.jit(pg_loss)(lp, lp, one2, one2)
    assert "tis_weight_mean" not in m and "entropy" not in m and "kl" not in m


def test_entropy_and_kl_terms_hand_worked():
    # A = 0 so the policy term is 0. Entropy [1, 3], coef 0.1: -0.1 * 2 = -0.2.
    # logps - ref = log 2: k3 = 1/2 - 1 + log 2 = 0.193147, coef 0.5: +0.0965736.
    # d/dlogps: 0.5 * (1 - 1/2) / 2 tokens = 0.125 each; d/dentropy: -0.1 / 2 = -0.05 each.
    lp, zero, one2 = _row(-1.0, -2.0), _row(0.0, 0.0), _row(1.0, 1.0)
    ref = lp - math.log(2.0)
    entropy = _row(1.0, 3.0)

    def f(x, ent):
        return ppo_policy_loss(x, x, zero, one2, entropy=ent, entropy_coef=0.1, ref_logps=ref, kl_coef=0.5)

    k3 = 0.5 - 1.0 + math.log(2.0)
    (loss, m), (g_lp, g_ent) = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(lp, entropy)
    np.testing.assert_allclose(float(loss), -0.2 + 0.5 * k3, **TOL)
    np.testing.assert_allclose(np.asarray(g_lp), [[0.125, 0.125]], **TOL)
    np.testing.assert_allclose(np.asarray(g_ent), [[-0.05, -0.05]], **TOL)
    np.testing.assert_allclose([float(m["entropy"]), float(m["kl"]), float(m["pg_loss"])], [2.0, k3, 0.0], **TOL)
    loss, _ = ppo_policy_loss(lp, lp, zero, one2, ref_logps=ref, kl_coef=0.5, kl_kind="k1")
    np.testing.assert_allclose(float(loss), 0.5 * math.log(2.0), **TOL)


# ---------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_bad_inputs_name_the_argument(kind):
    fn = POLICY_LOSSES[kind]
    lp, old, adv, mask = (jnp.asarray(DATA[k]) for k in ("logps", "old_logps", "advantages", "mask"))
    with pytest.raises(ValueError, match="logps must have rank 2"):
        fn(lp[0], old[0], adv[0], mask[0])
    with pytest.raises(ValueError, match=r"old_logps=\(5, 5\)"):
        fn(lp, old[:, :5], adv, mask)
    with pytest.raises(ValueError, match=r"mask=\(4, 6\)"):
        fn(lp, old, adv, mask[:4])
    with pytest.raises(ValueError, match="advantages"):
        fn(lp, old, adv[:4, 0], mask)
    with pytest.raises(ValueError, match="advantages must have rank 1 or 2"):
        fn(lp, old, adv[..., None], mask)
    with pytest.raises(ValueError, match="unknown aggregation 'mean'"):
        fn(lp, old, adv, mask, aggregation="mean")
    with pytest.raises(ValueError, match=r"entropy=\(5, 5\)"):
        fn(lp, old, adv, mask, entropy=lp[:, :5])
    with pytest.raises(ValueError, match="sampler_logps"):
        fn(lp, old, adv, mask, sampler_logps=lp[:3])
    with pytest.raises(ValueError, match="unknown kl_kind 'k4'"):
        fn(lp, old, adv, mask, ref_logps=lp, kl_kind="k4")
    with pytest.raises(ValueError, match="tis_cap must be > 0"):
        fn(lp, old, adv, mask, sampler_logps=lp, tis_cap=0.0)


@pytest.mark.parametrize("name", ["entropy", "ref_logps", "sampler_logps"])
def test_an_optional_inputs_shape_error_names_it_exactly(name):
    """The message names the optional argument as the caller spelt it (not a substring of
    another word, not another case)."""
    lp, old, adv, mask = (jnp.asarray(DATA[k]) for k in ("logps", "old_logps", "advantages", "mask"))
    with pytest.raises(ValueError, match=rf"(?<!\w){name}=\(5, 5\)"):
        POLICY_LOSSES["ppo"](lp, old, adv, mask, **{name: lp[:, :5]})


def test_bad_hyper_parameters_name_the_argument():
    lp, old, adv, mask = (jnp.asarray(DATA[k]) for k in ("logps", "old_logps", "advantages", "mask"))
    with pytest.raises(ValueError, match="dual_clip_c must be > 1"):
        ppo_policy_loss(lp, old, adv, mask, dual_clip_c=0.5)
    with pytest.raises(ValueError, match="clip_eps_high must be >= 0"):
        ppo_policy_loss(lp, old, adv, mask, clip_eps_high=-0.1)
    with pytest.raises(ValueError, match="clip_eps_low must be >= 0"):
        gspo_policy_loss(lp, old, adv, mask, clip_eps_low=-1e-4)
    with pytest.raises(ValueError, match="clip_eps_low must be >= 0"):
        cispo_policy_loss(lp, old, adv, mask, clip_eps_low=-0.2)
    for key in ("sapo_temperature_pos", "sapo_temperature_neg"):  # 4 / tau: 0 would give NaN
        for tau in (0.0, -1.0):
            with pytest.raises(ValueError, match=rf"{key} must lie in \(0\.0, inf\]; got {tau}"):
                sapo_policy_loss(lp, old, adv, mask, **{key: tau})


# ---------------------------------------------------------------------------------------
# The registry
# ---------------------------------------------------------------------------------------

# Each paper's clip band (eps_low, eps_high); None: that side is not clipped.
PAPER_CLIP_BANDS = {
    "ppo": (0.2, 0.2),  # Schulman et al. 2017: eps = 0.2
    "gspo": (3e-4, 4e-4),  # Zheng et al. 2025
    "cispo": (None, 0.28),  # MiniMax-M1: no lower bound; eps_high unpublished, 0.28 is DAPO's
    "sapo": (None, None),  # a soft gate, no clip
    "pg": (None, None),  # REINFORCE: no ratio to clip
}
STEP = 1e-4  # how far inside / outside a band edge the probing ratios sit


def clip_fractions(loss_fn, ratio, advantage):
    """``(clipfrac_low, clipfrac_high)`` of ``loss_fn`` with its defaults on one token with
    importance ratio ``ratio`` and advantage ``advantage``."""
    logps = jnp.asarray([[math.log(ratio)]], jnp.float32)
    _, metrics = loss_fn(logps, jnp.zeros_like(logps), jnp.asarray([advantage], jnp.float32), jnp.ones_like(logps))
    return float(metrics["clipfrac_low"]), float(metrics["clipfrac_high"])


def test_registry_is_exported_and_complete():
    import alignax.losses

    assert alignax.losses.POLICY_LOSSES is POLICY_LOSSES
    assert dict(POLICY_LOSSES) == {
        "ppo": ppo_policy_loss, "gspo": gspo_policy_loss, "cispo": cispo_policy_loss, "sapo": sapo_policy_loss,
        "pg": pg_loss,
    }
    assert set(PAPER_CLIP_BANDS) == set(POLICY_LOSSES)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_registry_defaults_clip_at_the_papers_band(name):
    """Probe each side of each band edge: the clip-fraction metric flips exactly there."""
    loss_fn = POLICY_LOSSES[name]
    eps_low, eps_high = PAPER_CLIP_BANDS[name]
    # Upper edge, positive advantage (the side a PPO-style objective clips).
    if eps_high is None:
        assert clip_fractions(loss_fn, 10.0, 1.0) == (0.0, 0.0)
    else:
        assert clip_fractions(loss_fn, 1 + eps_high - STEP, 1.0) == (0.0, 0.0)
        assert clip_fractions(loss_fn, 1 + eps_high + STEP, 1.0) == (0.0, 1.0)
    # Lower edge, negative advantage.
    if eps_low is None:
        assert clip_fractions(loss_fn, 0.01, -1.0) == (0.0, 0.0)  # however far below: no clip
    else:
        assert clip_fractions(loss_fn, 1 - eps_low + STEP, -1.0) == (0.0, 0.0)
        assert clip_fractions(loss_fn, 1 - eps_low - STEP, -1.0) == (1.0, 0.0)


def test_clip_keywords_follow_the_signatures():
    assert policy_loss_clip_keywords("ppo") == ("clip_eps_low", "clip_eps_high", "dual_clip_c")
    assert policy_loss_clip_keywords("gspo") == ("clip_eps_low", "clip_eps_high")
    assert policy_loss_clip_keywords("cispo") == ("clip_eps_low", "clip_eps_high")
    assert policy_loss_clip_keywords("sapo") == ("sapo_temperature_pos", "sapo_temperature_neg")
    assert policy_loss_clip_keywords("pg") == ()
    args = [jnp.asarray(DATA[k]) for k in DATA_KEYS]
    for name, loss_fn in POLICY_LOSSES.items():
        # The keywords named are the ones that set the band: a band wider than any ratio
        # in the data (at most e^1.5 here) clips nothing.
        keywords = policy_loss_clip_keywords(name)
        _, metrics = loss_fn(*args, **{k: 10.0 for k in keywords})
        assert float(metrics["clipfrac_low"]) == float(metrics["clipfrac_high"]) == 0.0, name
        assert float(metrics.get("dual_clipfrac", 0.0)) == 0.0, name
    with pytest.raises(TypeError):
        pg_loss(*args, clip_eps_low=0.2)
    with pytest.raises(ValueError, match="unknown policy loss 'dpo'; valid: ppo, gspo, cispo, sapo, pg"):
        policy_loss_clip_keywords("dpo")


# ---------------------------------------------------------------------------------------
# Importance-weighted KL term (kl_importance_weight)
# ---------------------------------------------------------------------------------------


def ref_weighted_kl(data, opts, weight, mode):
    """``kl_coef * agg(w_t k3_t)`` and its d/d logps, by loops (DeepSeek-V3.2 eq. 8):
    ``w = pi_theta / pi_old``; d(w k3) = w k3 + w (1 - pi_ref / pi_theta) when ``w`` is
    differentiated (``ratio``), w (1 - pi_ref / pi_theta) when it is not."""
    lp, old, mask = (np.asarray(data[k], np.float64) for k in ("logps", "old_logps", "mask"))
    ref = np.asarray(opts["ref_logps"], np.float64)
    value, d_value = np.zeros(lp.shape), np.zeros(lp.shape)
    for i, t in zip(*np.nonzero(mask)):
        x = lp[i, t] - ref[i, t]
        k3 = math.exp(-x) - 1.0 + x
        w = 1.0 if weight == "none" else math.exp(lp[i, t] - old[i, t])
        value[i, t] = w * k3
        d_value[i, t] = w * (1.0 - math.exp(-x)) + (w * k3 if weight == "ratio" else 0.0)
    coef = opts["kl_coef"]
    return (coef * references.aggregate(value, mask, mode), coef * agg_weights(mask, mode) * d_value,
            value[mask > 0].mean() if mask.any() else 0.0)


def _kl_terms(kind, data, weight, mode):
    args = [jnp.asarray(data[k]) for k in DATA_KEYS]

    def f(lp):
        return POLICY_LOSSES[kind](lp, *args[1:], aggregation=mode, **HPARAMS[kind], ref_logps=OPTS["ref_logps"],
                                   kl_coef=OPTS["kl_coef"], kl_importance_weight=weight)

    (loss, metrics), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(args[0])
    return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("weight", ["ratio", "detached_ratio"])
def test_importance_weighted_kl_off_policy_matches_reference(kind, weight):
    """Off-policy (ratios != 1, a row with no response token): the loss and its gradient
    move from the unweighted ones by exactly the reference's KL difference in every mode;
    the ``kl`` metric is the weighted masked mean."""
    for mode in MODES:
        base_loss, _, base_grad = _kl_terms(kind, DATA, "none", mode)
        loss, metrics, grad = _kl_terms(kind, DATA, weight, mode)
        want, d_want, kl_metric = ref_weighted_kl(DATA, OPTS, weight, mode)
        plain, d_plain, _ = ref_weighted_kl(DATA, OPTS, "none", mode)
        assert abs(want - plain) > 1e-4  # the weighting matters on this data
        np.testing.assert_allclose(loss - base_loss, want - plain, rtol=1e-4, atol=1e-6, err_msg=mode)
        np.testing.assert_allclose(grad - base_grad, d_want - d_plain, rtol=1e-4, atol=1e-6, err_msg=mode)
        np.testing.assert_allclose(metrics["kl"], kl_metric, rtol=1e-5, err_msg=mode)
        assert np.all(grad[DATA["mask"] == 0] == 0)


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_importance_weighted_kl_on_policy(kind):
    """On-policy (old_logps == logps, ratio 1): the loss is unchanged by either weighting;
    ``detached_ratio`` leaves the gradient unchanged too, ``ratio`` adds the score-function
    term ``kl_coef * agg-weight * k3_t`` (what makes its expected gradient that of
    KL(pi_theta || ref))."""
    data = {**DATA, "old_logps": DATA["logps"]}
    for mode in MODES:
        base_loss, base_metrics, base_grad = _kl_terms(kind, data, "none", mode)
        loss, metrics, grad = _kl_terms(kind, data, "detached_ratio", mode)
        assert loss == pytest.approx(base_loss, rel=1e-6, abs=1e-7)
        assert metrics["kl"] == pytest.approx(base_metrics["kl"])
        np.testing.assert_allclose(grad, base_grad, rtol=1e-6, atol=1e-7, err_msg=mode)
        loss, _, grad = _kl_terms(kind, data, "ratio", mode)
        assert loss == pytest.approx(base_loss, rel=1e-6, abs=1e-7)
        plain, _, _ = ref_weighted_kl(data, OPTS, "none", mode)
        lp, ref = np.asarray(data["logps"], np.float64), np.asarray(OPTS["ref_logps"], np.float64)
        k3 = np.where(data["mask"] > 0, np.expm1(ref - lp) - (ref - lp), 0.0)
        score = OPTS["kl_coef"] * agg_weights(data["mask"], mode) * k3
        assert np.max(np.abs(score)) > 1e-4
        np.testing.assert_allclose(grad - base_grad, score, rtol=1e-3, atol=1e-7, err_msg=mode)


def test_importance_weighted_kl_bad_name_is_named():
    lp, old, adv, mask = (jnp.asarray(DATA[k]) for k in DATA_KEYS)
    with pytest.raises(ValueError, match="kl_importance_weight"):
        ppo_policy_loss(lp, old, adv, mask, ref_logps=OPTS["ref_logps"], kl_coef=0.1, kl_importance_weight="token")


# ---------------------------------------------------------------------------------------
# Off-policy sequence masking (off_policy_mask_threshold)
# ---------------------------------------------------------------------------------------


def ref_off_policy_keep(lp, old, adv, mask, delta):
    """DeepSeek-V3.2 eq. 9 by loops: M_it = 0 iff A_it < 0 and mean_t(log pi_old - log pi_theta) > delta."""
    keep = np.ones(lp.shape)
    for i in range(lp.shape[0]):
        tokens = [t for t in range(lp.shape[1]) if mask[i][t]]
        drift = sum(old[i][t] - lp[i][t] for t in tokens) / max(len(tokens), 1)
        for t in tokens:
            keep[i][t] = 0.0 if (adv[i][t] < 0 and drift > delta) else 1.0
    return keep


def test_off_policy_sequence_mask_matches_reference():
    from alignax.losses import off_policy_sequence_mask

    dropped = kept = 0.0
    for seed, shape in ((0, (5, 6)), (1, (7, 3)), (2, (2, 9))):
        rng = np.random.default_rng(seed)
        lp = -rng.uniform(0.1, 3.0, shape)
        old = lp + rng.normal(0.0, 0.6, shape)
        adv = rng.normal(size=shape)
        mask = (rng.uniform(size=shape) > 0.3).astype(np.float32)
        mask[0] = 0  # a row with no response token
        for delta in (0.0, 0.1, 0.3):
            want = ref_off_policy_keep(lp, old, adv, mask, delta)
            got = np.asarray(off_policy_sequence_mask(jnp.asarray(lp, jnp.float32), jnp.asarray(old, jnp.float32),
                                                      jnp.asarray(adv, jnp.float32), mask, threshold=delta))
            np.testing.assert_array_equal(got * mask, want * mask, err_msg=f"{shape} {delta}")
            assert np.all(got[0] == 1)
            dropped, kept = dropped + ((1 - want) * mask).sum(), kept + (want * mask).sum()
    assert dropped > 0 and kept > 0


def test_off_policy_sequence_mask_hand_worked():
    """Eq. 9 on worked rows, threshold 0.15: a one-token row drifting 0.2 nats (mean over one
    token, not two) drops its negative-advantage token; a zero advantage is kept however far the
    row drifts (``A >= 0``); a row whose drifts cancel keeps its negative advantages."""
    from alignax.losses import off_policy_sequence_mask

    lp = np.array([[-1.0, -2.0, -2.0], [-1.0, -1.0, -2.0], [-1.0, -1.0, -1.0]])
    old = lp + np.array([[0.2, 5.0, 5.0], [0.3, 0.3, 5.0], [0.25, -0.25, 0.0]])  # off-mask drift is ignored
    adv = np.array([[-1.0, -1.0, -1.0], [0.0, -0.5, -1.0], [-1.0, -1.0, -1.0]])
    mask = np.array([[1, 0, 0], [1, 1, 0], [1, 1, 1]], np.float32)
    want = np.array([[0, 1, 1], [1, 0, 1], [1, 1, 1]], np.float32)
    # threshold 0: the last row's drift is exactly 0 (binary fractions), kept as D <= delta says
    for delta in (0.15, 0.0):
        np.testing.assert_array_equal(ref_off_policy_keep(lp, old, adv, mask, delta) * mask, want * mask)
        got = off_policy_sequence_mask(jnp.asarray(lp, jnp.float32), jnp.asarray(old, jnp.float32),
                                       jnp.asarray(adv, jnp.float32), mask, threshold=delta)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=str(delta))
    cube = jnp.zeros((2, 3, 3))  # [B, T, K] would broadcast into a mask of nonsense: refused
    with pytest.raises(ValueError, match=r"logps must have rank 2; got shape \(2, 3, 3\)"):
        off_policy_sequence_mask(cube, cube, cube, cube, threshold=0.15)


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_defaults_add_no_entropy_or_kl_term_and_cap_the_tis_weight_at_2(kind):
    """The documented defaults: ``entropy`` or ``ref_logps`` alone change nothing (both
    coefficients 0), and ``sampler_logps`` alone truncates ``rho = e`` at ``tis_cap=2``."""
    loss_fn, data = POLICY_LOSSES[kind], {k: jnp.asarray(v) for k, v in DATA.items()}
    base, _ = loss_fn(**data)
    for name in ("entropy", "ref_logps"):
        got, _ = loss_fn(**data, **{name: jnp.asarray(OPTS[name])})
        np.testing.assert_array_equal(np.asarray(got), np.asarray(base), err_msg=name)
    sampler = data["old_logps"] - 1.0
    got, _ = loss_fn(**data, sampler_logps=sampler)
    capped, _ = loss_fn(**data, sampler_logps=sampler, tis_cap=2.0)
    looser, _ = loss_fn(**data, sampler_logps=sampler, tis_cap=3.0)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(capped))
    assert not np.isclose(float(got), float(looser))


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_rejection_drops_the_policy_term_of_the_rejected_tokens(kind):
    """``rejection`` (k1 bounds on ``rho = pi_old / pi_sampler``) and ``rejection_divergences``
    (``k2 = (log rho)^2 / 2``) reach every loss: the loss is the one whose rejected tokens
    carry no advantage, the denominators unchanged (keep from NumPy, not from the library)."""
    loss_fn, data = POLICY_LOSSES[kind], {k: jnp.asarray(v) for k, v in DATA.items()}
    rng = np.random.default_rng(5)
    sampler = DATA["old_logps"] + rng.normal(0.0, 0.5, DATA["mask"].shape).astype(np.float32)
    log_rho = DATA["old_logps"].astype(np.float64) - sampler
    cases = ((dict(rejection="token", rejection_bounds=(0.7, 1.4)), (log_rho >= np.log(0.7)) & (log_rho <= np.log(1.4))),
             (dict(rejection_divergences={"token_k2": 0.02}), 0.5 * log_rho**2 <= 0.02))
    for kw, keep in cases:
        on = DATA["mask"] > 0
        assert 0 < (keep & on).sum() < on.sum(), kw  # the criterion cuts some tokens, not all
        got, _ = loss_fn(**data, sampler_logps=jnp.asarray(sampler), tis_cap=None, **kw)
        want, _ = loss_fn(**{**data, "advantages": jnp.asarray(DATA["advantages"] * keep)})
        np.testing.assert_allclose(float(got), float(want), rtol=1e-6, atol=1e-7, err_msg=str(kw))


def ref_tis_weight(log_rho, mask, *, cap, level="token", lower=None, normalize=False):
    """verl's TIS weight by NumPy: ``min(rho, cap)`` (IcePop: ``rho`` in ``[lower, cap]``, else
    0) on the token's ratio or the row's product, divided by its masked mean if ``normalize``."""
    log_rho = np.where(mask > 0, log_rho, 0.0)
    if level == "sequence":
        log_rho = np.broadcast_to(log_rho.sum(axis=-1, keepdims=True), log_rho.shape)
    rho = np.exp(log_rho)
    weight = np.minimum(rho, cap) if lower is None else np.where((rho >= lower) & (rho <= cap), rho, 0.0)
    return weight / (weight * mask).sum() * mask.sum() if normalize else weight


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_tis_options_reach_every_loss(kind):
    """``tis_level``, ``tis_lower`` (IcePop), ``tis_batch_normalize`` and ``tis_ratio="current"``
    reach every loss: the loss is the one whose advantages carry the NumPy weight (each
    surrogate is positively homogeneous in the advantage)."""
    loss_fn, data = POLICY_LOSSES[kind], {k: jnp.asarray(v) for k, v in DATA.items()}
    rng = np.random.default_rng(6)
    mask = DATA["mask"]
    sampler = DATA["old_logps"] + rng.normal(0.0, 0.3, mask.shape).astype(np.float32)
    old_rho = DATA["old_logps"].astype(np.float64) - sampler
    cur_rho = DATA["logps"].astype(np.float64) - sampler
    cases = ((dict(tis_level="sequence"), ref_tis_weight(old_rho, mask, cap=1.5, level="sequence")),
             (dict(tis_lower=0.8), ref_tis_weight(old_rho, mask, cap=1.5, lower=0.8)),
             (dict(tis_batch_normalize=True), ref_tis_weight(old_rho, mask, cap=1.5, normalize=True)),
             (dict(tis_ratio="current"), ref_tis_weight(cur_rho, mask, cap=1.5)))
    for kw, weight in cases:
        assert not np.allclose(weight * mask, ref_tis_weight(old_rho, mask, cap=1.5) * mask), kw
        got, _ = loss_fn(**data, sampler_logps=jnp.asarray(sampler), tis_cap=1.5, **kw)
        want, _ = loss_fn(**{**data, "advantages": jnp.asarray(DATA["advantages"] * np.where(mask > 0, weight, 1.0))})
        np.testing.assert_allclose(float(got), float(want), rtol=2e-5, atol=1e-6, err_msg=str(kw))


def test_gspo_clip_eps_high_none_is_the_symmetric_band():
    """``clip_eps_high=None`` clips GSPO's sequence ratio at ``1 +- clip_eps_low``."""
    from alignax.losses import gspo_policy_loss

    data = {k: jnp.asarray(v) for k, v in DATA.items()}
    got, got_m = gspo_policy_loss(**data, clip_eps_low=0.01, clip_eps_high=None)
    want, want_m = gspo_policy_loss(**data, clip_eps_low=0.01, clip_eps_high=0.01)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert_metrics(got_m, want_m)


def test_token_masks_stay_float32_with_x64_on():
    """Both masks are documented ``[B, T]`` float32, float64 inputs under ``jax.enable_x64`` too."""
    from alignax.losses import high_entropy_mask, off_policy_sequence_mask

    rng = np.random.default_rng(3)
    lp, adv, entropy = -rng.uniform(0.1, 2.0, (2, 4)), rng.normal(size=(2, 4)), rng.uniform(0.0, 3.0, (2, 4))
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float64)
    with jax.enable_x64(True):
        off = off_policy_sequence_mask(lp, lp + 0.5, adv, mask, threshold=0.1)
        high = high_entropy_mask(entropy, mask, quantile=0.5)
    assert off.dtype == jnp.float32 and high.dtype == jnp.float32, (off.dtype, high.dtype)
    np.testing.assert_array_equal(np.asarray(high) * mask, ref_high_entropy_keep(entropy, mask, 0.5) * mask)


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_off_policy_mask_drops_the_policy_term_of_the_masked_tokens(kind):
    """The loss with the mask is the reference's per-token loss times M (every mode), its
    gradient the unmasked one times M on the policy term, and ``off_policy_masked`` the
    dropped fraction; the KL term keeps every token."""
    delta = 0.02  # drops the negative-advantage token of row 3 (drift 0.039 nats per token)
    lp, old, adv, mask = (np.asarray(DATA[k], np.float64) for k in DATA_KEYS)
    keep = ref_off_policy_keep(lp, old, adv, mask, delta)
    assert 0 < (keep * mask).sum() < mask.sum()
    args = [jnp.asarray(DATA[k]) for k in DATA_KEYS]
    for mode in MODES:
        def f(x, threshold, mode=mode):
            extra = {} if threshold is None else {"off_policy_mask_threshold": threshold}
            return POLICY_LOSSES[kind](x, *args[1:], aggregation=mode, **HPARAMS[kind], **extra)

        (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(args[0], delta)
        _, plain_grad = jax.value_and_grad(f, has_aux=True)(args[0], None)
        per_token, _ = ref_token_losses(kind, lp, old, adv, mask, HPARAMS[kind])
        np.testing.assert_allclose(float(loss), references.aggregate(per_token * keep, mask, mode),
                                   rtol=1e-5, atol=1e-6, err_msg=mode)
        np.testing.assert_allclose(np.asarray(grad), np.asarray(plain_grad) * keep, rtol=1e-5, atol=1e-7)
        assert float(metrics["off_policy_masked"]) == pytest.approx(1 - (keep * mask).sum() / mask.sum(), rel=1e-6)
    # the KL term is not masked: with A = 0 nothing is dropped whatever the drift
    zero = jnp.zeros_like(args[2])
    with_mask, _ = POLICY_LOSSES[kind](args[0], args[1], zero, args[3], ref_logps=OPTS["ref_logps"], kl_coef=0.2,
                                       off_policy_mask_threshold=0.0, **HPARAMS[kind])
    without, _ = POLICY_LOSSES[kind](args[0], args[1], zero, args[3], ref_logps=OPTS["ref_logps"], kl_coef=0.2,
                                     **HPARAMS[kind])
    assert float(with_mask) == pytest.approx(float(without), rel=1e-6)
    with pytest.raises(ValueError, match="off_policy_mask_threshold"):
        POLICY_LOSSES[kind](*args, off_policy_mask_threshold=-0.1)


def test_two_sided_ratio_cap_delta_is_the_dual_clip():
    """INTELLECT-2's two-sided clipping (TRL ``delta``): ``l = -min(min(r, delta) A,
    clip(r, 1 - eps_low, 1 + eps_high) A)``. For ``delta > 1 + eps_high`` it equals PPO-clip
    with ``dual_clip_c = delta`` in value and gradient, so the migration table maps
    ``delta`` to ``dual_clip_c``; ratios on both sides of delta, both signs of A."""
    ratios = np.array([0.5, 0.9, 1.1, 1.3, 2.0, 2.9, 3.5, 6.0])
    adv = np.array([[1.0] * 8, [-1.0] * 8, [0.7, -0.4, 1.3, -2.0, 0.5, -0.6, 1.1, -0.9]])
    lp = np.log(np.tile(ratios, (3, 1))) - 1.0
    old = np.full(lp.shape, -1.0)
    mask = np.ones(lp.shape)
    for delta in (1.5, 3.0):
        def trl(x):
            r = jnp.exp(x - old)
            per_token = -jnp.minimum(jnp.minimum(r, delta) * adv, jnp.clip(r, 0.8, 1.28) * adv)
            return jnp.mean(per_token)

        def ours(x):
            return ppo_policy_loss(x, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32), mask,
                                   clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=delta)[0]

        x = jnp.asarray(lp, jnp.float32)
        np.testing.assert_allclose(float(ours(x)), float(trl(x)), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(jax.grad(ours)(x)), np.asarray(jax.grad(trl)(x)), rtol=1e-6, atol=1e-8)
        plain = ppo_policy_loss(x, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32), mask,
                                clip_eps_low=0.2, clip_eps_high=0.28)[0]
        assert float(plain) != pytest.approx(float(trl(x)))  # the cap acts on this data


# ---------------------------------------------------------------------------------------
# High-entropy token selection (top_entropy_quantile)
# ---------------------------------------------------------------------------------------


def ref_high_entropy_keep(entropy, mask, rho):
    """"Beyond the 80/20 Rule": keep H_it >= the (1 - rho) quantile of the response tokens' H."""
    values = [entropy[i][t] for i in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[i][t]]
    if not values:
        return np.ones(mask.shape)
    tau = np.quantile(np.asarray(values, np.float64), 1.0 - rho)
    return np.where(np.asarray(entropy, np.float64) >= tau, 1.0, 0.0)


def test_high_entropy_mask_matches_reference():
    from alignax.losses import high_entropy_mask

    for seed, shape in ((0, (5, 6)), (1, (7, 3)), (2, (2, 9))):
        rng = np.random.default_rng(seed)
        entropy = rng.uniform(0.0, 3.0, shape).astype(np.float32)
        mask = (rng.uniform(size=shape) > 0.3).astype(np.float32)
        mask[0] = 0  # a row with no response token
        entropy[mask == 0] = 1e6  # garbage off the mask must not move the quantile
        for rho in (0.2, 0.5, 1.0):
            want = ref_high_entropy_keep(entropy, mask, rho)
            got = np.asarray(high_entropy_mask(jnp.asarray(entropy), mask, quantile=rho))
            np.testing.assert_array_equal(got * mask, want * mask, err_msg=f"{shape} {rho}")
            kept = (got * mask).sum() / mask.sum()
            assert kept == 1.0 if rho == 1.0 else abs(kept - rho) <= 1.0 / mask.sum() + 1e-6
    empty = np.zeros((2, 3), np.float32)
    assert np.all(np.asarray(high_entropy_mask(jnp.ones((2, 3)), empty, quantile=0.2)) == 1)
    with pytest.raises(ValueError, match="top_entropy_quantile must be in"):
        high_entropy_mask(jnp.ones((2, 3)), empty, quantile=0.0)


@pytest.mark.parametrize("kind", sorted(POLICY_LOSSES))
def test_top_entropy_quantile_keeps_the_policy_term_of_high_entropy_tokens(kind):
    """The policy term is the reference's per-token loss times the entropy mask, in every
    mode; the entropy bonus still sees every token; ``entropy_masked`` reports the share."""
    rho = 0.4
    lp, old, adv, mask = (np.asarray(DATA[k], np.float64) for k in DATA_KEYS)
    entropy = np.asarray(OPTS["entropy"], np.float64)
    keep = ref_high_entropy_keep(np.where(mask > 0, entropy, 0.0), mask, rho)
    per_token, _ = ref_token_losses(kind, lp, old, adv, mask, HPARAMS[kind])
    args = [jnp.asarray(DATA[k]) for k in DATA_KEYS]
    for mode in MODES:
        def f(x, mode=mode, **extra):
            return POLICY_LOSSES[kind](x, *args[1:], aggregation=mode, **HPARAMS[kind], entropy=OPTS["entropy"],
                                       entropy_coef=0.03, **extra)

        (loss, metrics), grad = jax.value_and_grad(lambda x: f(x, top_entropy_quantile=rho), has_aux=True)(args[0])
        (_, plain_metrics), plain_grad = jax.value_and_grad(f, has_aux=True)(args[0])
        want = references.aggregate(per_token * keep, mask, mode) - 0.03 * references.aggregate(entropy, mask, mode)
        np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-6, err_msg=mode)
        np.testing.assert_allclose(float(metrics["pg_loss"]), references.aggregate(per_token * keep, mask, mode),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(grad), np.asarray(plain_grad) * keep, rtol=1e-5, atol=1e-7)
        assert float(metrics["entropy_masked"]) == pytest.approx(1 - (keep * mask).sum() / mask.sum(), rel=1e-6)
        assert float(metrics["entropy"]) == pytest.approx(plain_metrics["entropy"])
    with pytest.raises(ValueError, match="top_entropy_quantile needs entropy="):
        POLICY_LOSSES[kind](*args, top_entropy_quantile=0.2)


def test_luspo_is_gspo_with_seq_mean_token_sum():
    """LUSPO as TRL 1.16 defines it (Length-Unbiased Sequence Policy Optimization; TRL's
    ``loss_type="luspo"`` with ``importance_sampling_level="sequence"``): the GSPO sequence
    loss times the sequence's length, averaged over sequences,
    ``mean_i |y_i| max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high))``. GSPO with
    ``aggregation="seq-mean-token-sum"`` is that, value and gradient, when no row is empty
    (TRL's mean also counts empty rows as 0; alignax's ``seq-mean`` skips them)."""
    rng = np.random.default_rng(7)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0], [1, 0, 0, 0, 0]], np.float32)
    old = -rng.uniform(0.5, 2.0, mask.shape)
    lp = old + np.array([[5e-4], [1e-4], [-5e-4], [-4e-4]]) + rng.normal(0.0, 1e-5, mask.shape)
    adv = np.array([0.8, -1.1, 0.4, -0.3])  # row 0 clipped above, row 3 clipped below, rows 1-2 not
    eps_low, eps_high = 3e-4, 4e-4

    def trl(x):
        n = mask.sum(1)
        s = jnp.exp(jnp.sum((x - old) * mask, 1) / n)
        per_seq = -jnp.minimum(s * adv, jnp.clip(s, 1 - eps_low, 1 + eps_high) * adv)
        return jnp.mean(per_seq * n)

    def ours(x):
        return gspo_policy_loss(x, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32), mask,
                                aggregation="seq-mean-token-sum", clip_eps_low=eps_low, clip_eps_high=eps_high)[0]

    x = jnp.asarray(lp, jnp.float32)
    s = np.exp(((lp - old) * mask).sum(1) / mask.sum(1))
    assert np.any(s > 1 + eps_high) and np.any((s < 1 + eps_high) & (s > 1 - eps_low))  # clipped and not
    np.testing.assert_allclose(float(ours(x)), float(trl(x)), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.grad(ours)(x)), np.asarray(jax.grad(trl)(x)), rtol=1e-5, atol=1e-7)
