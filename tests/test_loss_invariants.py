"""Properties of the losses that no training run would show, found by mutation testing (issue 38).

Each test here was written against a hand-applied mutant of the functional core that the
rest of the suite let survive; the mutant is named in the test's docstring. The last
block is one invariant over every public loss: an argument documented as a constant
(reference / old / behaviour log-probs, returns, old values, advantages, weights, KTO's
reference point) receives exactly zero gradient.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alignax import kl as kl_lib
from alignax import losses
from alignax.losses import (
    DPO_VARIANTS,
    POLICY_LOSSES,
    bradley_terry_loss,
    cispo_policy_loss,
    cpo_loss,
    dpo_loss,
    gspo_policy_loss,
    kto_loss,
    kto_reference_point,
    orpo_loss,
    pg_loss,
    ppo_policy_loss,
    prm_loss,
    prm_step_counts,
    sft_loss,
    simpo_loss,
    value_loss,
)
from alignax.losses.preference import DPO_VARIANT_TABLE
from alignax.losses._pairwise import batch_mean
from tests.support import references

B, T = 3, 6


def _arrays(seed: int) -> dict[str, jax.Array]:
    """Per-token ``[B, T]`` and per-pair ``[B]`` inputs with every row partly masked in."""
    rng = np.random.default_rng(seed)
    mask = np.ones((B, T), np.float32)
    mask[0, :2] = 0.0  # a prompt
    mask[2, 4:] = 0.0  # padding
    logps = -rng.uniform(0.2, 2.0, (B, T))
    near = lambda x: x + rng.uniform(-0.3, 0.3, x.shape)  # noqa: E731 - a ratio near 1
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return dict(
        logps=f(logps), old_logps=f(near(logps)), ref_logps=f(near(logps)), sampler_logps=f(near(logps)),
        advantages=f(rng.normal(size=(B, T))), mask=f(mask),
        values=f(rng.normal(size=(B, T))), old_values=f(rng.normal(size=(B, T))),
        returns=f(rng.normal(size=(B, T))),
        chosen=f(-rng.uniform(5, 20, B)), rejected=f(-rng.uniform(5, 20, B)),
        ref_chosen=f(-rng.uniform(5, 20, B)), ref_rejected=f(-rng.uniform(5, 20, B)),
        chosen_lengths=f([4.0, 7.0, 5.0]), rejected_lengths=f([6.0, 3.0, 5.0]),
        weights=f([0.5, 2.0, 1.5]),  # neither 0 nor 1: a count of pairs is not their sum
    )


# ---------------------------------------------------------------------------------------
# The five gaps of issue 38
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_kl_term_of_a_policy_loss_treats_the_reference_as_constant(name):
    """Mutant: ``kl_estimate(logps, on_mask(ref_logps))`` without ``sg`` in ``_policy_loss``.

    The KL term adds ``kl_coef * mean_t k3'(logps_t - ref_t)`` to the gradient of
    ``logps`` (k3' = 1 - exp(ref - logps)) and nothing to ``ref_logps``."""
    a = _arrays(0)
    coef = 0.3
    base = dict(aggregation="token-mean")

    def loss(logps, ref_logps, kl_coef):
        return POLICY_LOSSES[name](
            logps, a["old_logps"], a["advantages"], a["mask"], ref_logps=ref_logps, kl_coef=kl_coef, **base
        )[0]

    d_logps, d_ref = jax.grad(loss, argnums=(0, 1))(a["logps"], a["ref_logps"], coef)
    np.testing.assert_array_equal(np.asarray(d_ref), np.zeros((B, T)))
    d_without = jax.grad(loss)(a["logps"], a["ref_logps"], 0.0)
    lp, ref, mask = (np.asarray(a[k], np.float64) for k in ("logps", "ref_logps", "mask"))
    expected = coef * mask * (1.0 - np.exp(ref - lp)) / mask.sum()
    np.testing.assert_allclose(np.asarray(d_logps - d_without), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_a_counted_token_far_from_the_old_policy_has_its_log_ratio_clamped_at_20(name):
    """Mutant: ``_policy_loss`` without ``jnp.clip(..., -20, 20)`` on the log-ratio.

    One counted token has ``log pi - log pi_old = 100`` and advantage -1, the other 0 and
    +1. With the clamp PPO's loss is ``(e^20 - 1) / 2`` and its gradient finite; without
    it ``e^100`` overflows float32 and loss and gradient are infinite. Every variant
    reports the clamped ratio (GSPO the geometric mean of the clamped ratios, ``e^10``)."""
    old = jnp.asarray([[-101.0, -1.0]])
    logps = jnp.asarray([[-1.0, -1.0]])
    advantages = jnp.asarray([[-1.0, 1.0]])
    mask = jnp.ones((1, 2))
    fn = lambda lp: POLICY_LOSSES[name](lp, old, advantages, mask, aggregation="token-mean")  # noqa: E731
    (value, metrics), grad = jax.value_and_grad(fn, has_aux=True)(logps)
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))
    expected_ratio = math.exp(10.0) if name == "gspo" else math.exp(20.0)
    np.testing.assert_allclose(float(metrics["ratio_max"]), expected_ratio, rtol=1e-5)
    if name == "ppo":
        # max(-A r, -A clip(r)) = e^20 on the far token (its gradient is cut: 0), -1 on the other.
        np.testing.assert_allclose(float(value), (math.exp(20.0) - 1.0) / 2.0, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(grad), [[0.0, -0.5]], atol=1e-7)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_a_counted_token_far_below_the_old_policy_has_its_log_ratio_clamped_at_minus_20(name):
    """Mutant: the clamp's lower bound dropped (``jnp.clip(..., None, 20)``).

    One counted token has ``log pi - log pi_old = -100``: every variant reports the clamped
    ratio ``e^-20`` as its smallest (GSPO the geometric mean of the clamped ratios, ``e^-10``);
    unclamped, ``e^-100`` is below float32's normal range (about 0 here)."""
    old = jnp.asarray([[-1.0, -1.0]])
    logps = jnp.asarray([[-101.0, -1.0]])
    advantages = jnp.asarray([[1.0, 1.0]])
    _, metrics = POLICY_LOSSES[name](logps, old, advantages, jnp.ones((1, 2)), aggregation="token-mean")
    expected_ratio = math.exp(-10.0) if name == "gspo" else math.exp(-20.0)
    np.testing.assert_allclose(float(metrics["ratio_min"]), expected_ratio, rtol=1e-5)


def _pair_losses(a, beta):
    """Per-pair DPO sigmoid and Bradley-Terry losses, float64 (Rafailov et al. 2023 eq. 7)."""
    c, r, rc, rr = (np.asarray(a[k], np.float64) for k in ("chosen", "rejected", "ref_chosen", "ref_rejected"))
    dpo = [-references.log_sigmoid(beta * ((c[i] - rc[i]) - (r[i] - rr[i]))) for i in range(B)]
    bt = [-references.log_sigmoid(c[i] - r[i]) for i in range(B)]
    return np.asarray(dpo), np.asarray(bt)


def test_pairwise_losses_are_weighted_means_with_the_sum_of_weights_as_normaliser():
    """Mutant: ``batch_mean`` dividing by the count of non-zero weights instead of their sum.

    Weights 0.5, 2, 1.5 sum to 4 but count 3; every weight elsewhere in the suite is 0
    or 1, where the two agree."""
    a = _arrays(1)
    w = np.asarray(a["weights"], np.float64)
    dpo_ref, bt_ref = _pair_losses(a, beta=0.1)
    dpo, dpo_metrics = dpo_loss(a["chosen"], a["rejected"], a["ref_chosen"], a["ref_rejected"], weights=a["weights"])
    bt, bt_metrics = bradley_terry_loss(a["chosen"], a["rejected"], weights=a["weights"])
    np.testing.assert_allclose(float(dpo), np.sum(w * dpo_ref) / np.sum(w), rtol=1e-6)
    np.testing.assert_allclose(float(bt), np.sum(w * bt_ref) / np.sum(w), rtol=1e-6)
    margins = np.asarray(a["chosen"], np.float64) - np.asarray(a["rejected"], np.float64)
    np.testing.assert_allclose(float(bt_metrics["margin"]), np.sum(w * margins) / np.sum(w), rtol=1e-6)
    chosen = np.asarray(a["chosen"], np.float64)
    np.testing.assert_allclose(float(dpo_metrics["logps/chosen"]), np.sum(w * chosen) / np.sum(w), rtol=1e-6)
    # KTO's in-batch reference point is the same weighted mean of its log-ratios.
    logratio = chosen - np.asarray(a["ref_chosen"], np.float64)
    point = kto_reference_point(a["chosen"] + 30.0, a["ref_chosen"], weights=a["weights"])
    np.testing.assert_allclose(float(point), np.sum(w * (logratio + 30.0)) / np.sum(w), rtol=1e-6)


def test_a_weighted_mean_over_a_normaliser_of_zero_is_zero():
    """``batch_mean`` with an explicit normaliser of 0 (no pair counted anywhere) is 0, value and
    gradient, even where this batch's weighted sum is not (mutant ``_pairwise.x_batch_mean__mutmut_31``
    divided by 0 there)."""
    values, weights = jnp.asarray([1.5, -2.0, 4.0]), jnp.asarray([1.0, 0.5, 0.0])
    value, grad = jax.value_and_grad(lambda v: batch_mean(v, weights, normaliser=0.0))(values)
    assert float(value) == 0.0
    np.testing.assert_array_equal(np.asarray(grad), np.zeros(3))
    np.testing.assert_allclose(float(batch_mean(values, weights, normaliser=2.0)), (1.5 - 1.0) / 2.0, rtol=1e-7)
    assert float(batch_mean(values, jnp.zeros(3))) == 0.0  # the weights' own sum of 0 too


@pytest.mark.parametrize("clip_eps", [None, 0.2])
def test_value_loss_treats_returns_and_old_values_as_constants(clip_eps):
    """Mutant: ``value_loss`` without ``sg`` on ``returns`` (or on ``old_values``).

    The gradient of ``values`` is the reference's; ``returns`` and ``old_values`` get 0."""
    a = _arrays(2)
    fn = lambda v, old, ret: value_loss(v, old, ret, a["mask"], clip_eps=clip_eps)[0]  # noqa: E731
    d_values, d_old, d_returns = jax.grad(fn, argnums=(0, 1, 2))(a["values"], a["old_values"], a["returns"])
    np.testing.assert_array_equal(np.asarray(d_old), np.zeros((B, T)))
    np.testing.assert_array_equal(np.asarray(d_returns), np.zeros((B, T)))
    v, old, ret, mask = (np.asarray(a[k], np.float64) for k in ("values", "old_values", "returns", "mask"))
    per_token = lambda v: 0.5 * np.maximum(  # noqa: E731 - PPO2's value clip, written out
        (v - ret) ** 2, (old + np.clip(v - old, -clip_eps, clip_eps) - ret) ** 2
    ) if clip_eps is not None else 0.5 * (v - ret) ** 2
    expected = references.finite_difference(lambda x: float(np.sum(per_token(x) * mask) / mask.sum()), v)
    np.testing.assert_allclose(np.asarray(d_values), expected, atol=1e-5)


def test_prm_metrics_count_a_label_of_exactly_one_half_as_a_good_step():
    """Mutant: ``labels >= 0.5`` becoming ``labels > 0.5`` in ``prm_step_counts``.

    Math-Shepherd's soft label c/K is exactly 0.5 whenever half of an even number of
    rollouts reach the answer (2 of 4 here). Row 0: two such steps, both predicted good
    (a score of exactly 0 is predicted good). Row 1: a 0.5 step, then a 0 step; the first
    error is step 2, as predicted."""
    soft = 2.0 / 4.0
    scores = jnp.asarray([[0.0, 1.5, 0.0], [0.7, -0.4, 0.0]])
    labels = jnp.asarray([[soft, soft, 0.0], [soft, 0.0, 0.0]])
    step_mask = jnp.asarray([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    counts = prm_step_counts(scores, labels, step_mask)
    assert {k: float(v) for k, v in counts.items()} == {
        "step_correct": 4.0, "steps": 4.0, "first_error_correct": 2.0, "solutions": 2.0,
    }
    _, metrics = prm_loss(scores, labels, step_mask)
    assert float(metrics["step_accuracy"]) == 1.0 and float(metrics["first_error_accuracy"]) == 1.0


# ---------------------------------------------------------------------------------------
# Zero gradient into every argument documented as a constant, over every public loss
# ---------------------------------------------------------------------------------------


def _policy_entry(fn, **options):
    args = lambda a: dict(  # noqa: E731
        logps=a["logps"], old_logps=a["old_logps"], advantages=a["advantages"], mask=a["mask"],
        ref_logps=a["ref_logps"], kl_coef=0.2, sampler_logps=a["sampler_logps"], tis_cap=5.0, **options,
    )
    return fn, args, ("old_logps", "advantages", "ref_logps", "sampler_logps")


def _dpo_entry(variant):
    args = lambda a: dict(  # noqa: E731
        policy_chosen_logps=a["chosen"], policy_rejected_logps=a["rejected"],
        ref_chosen_logps=a["ref_chosen"], ref_rejected_logps=a["ref_rejected"],
        chosen_lengths=a["chosen_lengths"], rejected_lengths=a["rejected_lengths"],
        variant=variant, weights=a["weights"],
    )
    # AOT's sorted positions are no one pair's: its weights only keep or drop pairs (all > 0 here)
    weights = () if DPO_VARIANT_TABLE[variant].sorts else ("weights",)
    return lambda **kw: dpo_loss(**kw), args, ("ref_chosen_logps", "ref_rejected_logps", *weights)


VOCAB = 5


def _logits(a, which: int) -> jax.Array:
    """``[B, T, V]`` logits made from the ``[B, T]`` inputs (``which`` picks a student or a teacher)."""
    base = a["logps"] if which == 0 else a["ref_logps"]
    return base[..., None] * jnp.arange(1.0, VOCAB + 1.0) + 0.3 * which * jnp.cos(jnp.arange(VOCAB * 1.0))


def _teacher_topk(a):
    return losses.distill.teacher_topk(_logits(a, 1), 3)


def _pairs(a, *keys):
    names = dict(chosen="policy_chosen_logps", rejected="policy_rejected_logps",
                 chosen_lengths="chosen_lengths", rejected_lengths="rejected_lengths", weights="weights")
    return {names[k]: a[k] for k in keys}


# The one list: a public loss (or a loss-side function) -> (function, its arguments from
# `_arrays`, the arguments its docstring calls constant). A new loss is covered by adding
# it here; `test_every_public_loss_is_listed` fails until it is.
CONSTANT_ARGUMENTS = {
    "ppo_policy_loss": _policy_entry(ppo_policy_loss, dual_clip_c=3.0),
    "gspo_policy_loss": _policy_entry(gspo_policy_loss, clip_eps_low=0.1, clip_eps_high=0.1),
    "cispo_policy_loss": _policy_entry(cispo_policy_loss),
    "pg_loss": _policy_entry(pg_loss),
    **{f"dpo_loss[{v}]": _dpo_entry(v) for v in DPO_VARIANTS},
    "dpo_loss[mpo+wpo]": (lambda **kw: dpo_loss(**kw), lambda a: dict(
        _dpo_entry("sigmoid")[1](a), variant=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0],
        rpo_alpha=0.5, pair_scale=a["weights"] + 0.5, bco_delta=jnp.float32(0.3),
    ), ("ref_chosen_logps", "ref_rejected_logps", "weights", "pair_scale", "bco_delta")),
    "dpo_loss[f_divergence]": (lambda **kw: dpo_loss(**kw), lambda a: dict(
        _dpo_entry("discopop")[1](a), f_divergence="alpha", f_alpha=0.3,
    ), ("ref_chosen_logps", "ref_rejected_logps", "weights")),
    "simpo_loss": (simpo_loss, lambda a: _pairs(a, "chosen", "rejected", "chosen_lengths", "rejected_lengths",
                                                 "weights"), ("weights",)),
    "cpo_loss": (cpo_loss, lambda a: _pairs(a, "chosen", "rejected", "chosen_lengths", "weights"), ("weights",)),
    "orpo_loss": (orpo_loss, lambda a: _pairs(a, "chosen", "rejected", "chosen_lengths", "rejected_lengths",
                                               "weights"), ("weights",)),
    "kto_loss": (kto_loss, lambda a: dict(
        policy_logps=a["chosen"], ref_logps=a["ref_chosen"], labels=jnp.asarray([1.0, 0.0, 1.0]),
        kl_ref_point=jnp.float32(0.5), weights=a["weights"],
    ), ("ref_logps", "kl_ref_point", "weights")),
    "kto_reference_point": (kto_reference_point, lambda a: dict(
        kl_policy_logps=a["chosen"] + 30.0, kl_ref_logps=a["ref_chosen"], weights=a["weights"],
    ), ("kl_policy_logps", "kl_ref_logps", "weights")),
    "bradley_terry_loss": (bradley_terry_loss, lambda a: dict(
        chosen_rewards=a["chosen"], rejected_rewards=a["rejected"], weights=a["weights"],
    ), ("weights",)),
    "value_loss": (value_loss, lambda a: dict(
        values=a["values"], old_values=a["old_values"], returns=a["returns"], mask=a["mask"], clip_eps=0.2,
    ), ("old_values", "returns")),
    "kl_loss": (kl_lib.kl_loss, lambda a: dict(logps=a["logps"], ref_logps=a["ref_logps"], mask=a["mask"]),
                ("ref_logps",)),
    "sapo_policy_loss": _policy_entry(losses.sapo_policy_loss),
    # the objectives registry's own modules (alignax.losses.objectives); a rejection mask and a
    # sequence-level weight on some, so the rollout-correction path is covered too
    "dppo_tv_policy_loss": _policy_entry(losses.dppo_tv_policy_loss, clip_eps_low=0.05, clip_eps_high=0.05),
    "dppo_kl_policy_loss": _policy_entry(losses.dppo_kl_policy_loss, rejection="token"),
    "clip_cov_policy_loss": _policy_entry(losses.clip_cov_policy_loss, clip_cov_lb=0.0, clip_cov_ratio=0.5),
    "kl_cov_policy_loss": _policy_entry(losses.kl_cov_policy_loss, kl_cov_ratio=0.3),
    "geo_mean_policy_loss": _policy_entry(losses.geo_mean_policy_loss, clip_eps_low=0.1,
                                          rejection_divergences={"seq_max_k2": 2.0, "token_k3": 1.0}),
    "dro_policy_loss": _policy_entry(losses.dro_policy_loss, dro_beta=0.5, tis_level="sequence"),
    "vespo_policy_loss": _policy_entry(losses.vespo_policy_loss, rejection="geometric", rejection_bounds=(0.8, 1.25),
                                       tis_batch_normalize=True),
    "distill_loss": (losses.distill_loss, lambda a: dict(
        student_logits=_logits(a, 0), teacher_logits=_logits(a, 1), mask=a["mask"], divergence="jsd",
    ), ("teacher_logits",)),
    "sparse_distill_loss": (losses.sparse_distill_loss, lambda a: dict(
        student_logits=_logits(a, 0), teacher_topk_logps=_teacher_topk(a)[0], teacher_topk_ids=_teacher_topk(a)[1],
        mask=a["mask"],
    ), ("teacher_topk_logps",)),
    # Every argument of these is trained or is a mask: nothing constant to check.
    "sft_loss": (sft_loss, None, ()),
    "prm_loss": (prm_loss, None, ()),
}

_CASES = [(name, arg) for name, (_, _, constants) in CONSTANT_ARGUMENTS.items() for arg in constants]


def _scalar(fn, kwargs):
    out = fn(**kwargs)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize(("name", "arg"), _CASES, ids=[f"{n}-{a}" for n, a in _CASES])
def test_an_argument_documented_as_constant_receives_exactly_zero_gradient(name, arg):
    fn, make_args, _ = CONSTANT_ARGUMENTS[name]
    kwargs = make_args(_arrays(3))

    def loss(x):
        return _scalar(fn, {**kwargs, arg: x})

    value, grad = jax.value_and_grad(loss)(kwargs[arg])
    np.testing.assert_array_equal(np.asarray(grad), np.zeros(np.shape(kwargs[arg])))
    # Not vacuous: the loss does read the argument (a different value, a different loss).
    assert float(loss(kwargs[arg] * 1.25 + 0.1)) != float(value), f"{name} ignores {arg}"


def test_every_public_loss_is_listed():
    public = {n for n in losses.__all__ if n.endswith("_loss")} | {"kl_loss", "kto_reference_point"}
    listed = {name.split("[")[0] for name in CONSTANT_ARGUMENTS}
    assert public <= listed, f"add {sorted(public - listed)} to CONSTANT_ARGUMENTS"
    assert {f"dpo_loss[{v}]" for v in DPO_VARIANTS} <= set(CONSTANT_ARGUMENTS)


# ---------------------------------------------------------------------------------------
# Found by mutation testing of _pairwise, sft and value (docs/mutation-testing.md)
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sft_loss", "value_loss"])
def test_per_token_losses_pass_every_global_normaliser_on(name):
    a = _arrays(4)
    counts = dict(num_tokens=23.0, num_seqs=7.0, norm_length=11.0)
    mode = "seq-mean-token-sum-norm"
    if name == "sft_loss":
        got = sft_loss(a["logps"], a["mask"], aggregation=mode, **counts)[0]
        per_token = -np.asarray(a["logps"], np.float64)
    else:
        got = value_loss(a["values"], a["old_values"], a["returns"], a["mask"], aggregation=mode, **counts)[0]
        per_token = 0.5 * (np.asarray(a["values"], np.float64) - np.asarray(a["returns"], np.float64)) ** 2
    expected = references.aggregate(per_token, np.asarray(a["mask"]), mode, **counts)
    np.testing.assert_allclose(float(got), expected, rtol=1e-6)


def test_sft_counts_tokens_in_float32_from_a_boolean_mask():
    a = _arrays(5)
    _, metrics = sft_loss(a["logps"], np.asarray(a["mask"]) > 0)
    assert metrics["num_tokens"].dtype == jnp.float32 and float(metrics["num_tokens"]) == float(np.sum(a["mask"]))


def test_pairwise_mean_with_weights_summing_to_zero_or_below_one():
    """Zero total weight gives 0 (not 0/0); a total of 0.5 is divided by, not floored at 1."""
    chosen, rejected = jnp.asarray([1.0, -2.0]), jnp.asarray([0.0, 1.0])
    zero, _ = bradley_terry_loss(chosen, rejected, weights=jnp.zeros(2))
    assert float(zero) == 0.0
    half, _ = bradley_terry_loss(chosen, rejected, weights=jnp.asarray([0.5, 0.0]))
    np.testing.assert_allclose(float(half), -references.log_sigmoid(1.0), rtol=1e-6)


def test_losses_and_metrics_stay_float32_with_x64_on():
    a = {k: np.asarray(v, np.float64) for k, v in _arrays(6).items()}
    with jax.enable_x64(True):
        loss, metrics = bradley_terry_loss(a["chosen"], a["rejected"], weights=a["weights"])
        assert loss.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in metrics.values())
        loss, metrics = value_loss(a["values"], a["old_values"], a["returns"], a["mask"], clip_eps=0.2)
        assert loss.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in metrics.values())


def test_prm_loss_metrics_and_step_counts_stay_float32_with_x64_on():
    a = {k: np.asarray(v, np.float64) for k, v in _arrays(6).items()}
    scores, labels = a["values"], np.clip(a["returns"], 0.0, 1.0)  # [B, T] logits and soft labels
    with jax.enable_x64(True):
        loss, metrics = prm_loss(scores, labels, a["mask"])
        assert loss.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in metrics.values())
        counts = prm_step_counts(scores, labels, a["mask"])
        assert all(v.dtype == jnp.float32 for v in counts.values()), {k: v.dtype for k, v in counts.items()}

def test_explained_variance_has_a_finite_gradient_when_the_returns_are_constant():
    a = _arrays(7)
    grad = jax.grad(lambda v: losses.explained_variance(jnp.ones((B, T)), v, a["mask"]))(a["values"])
    np.testing.assert_array_equal(np.asarray(grad), np.zeros((B, T)))
