"""Issue 36's preference objectives against NumPy references written from their papers
(tests/support/preference_references.py): bco_pair, aot, aot_unpaired, discopop,
sigmoid_norm, MPO mixtures and RPO's NLL, f-divergence DPO, WPO weights and LD-DPO's
shared-length split. Values and gradients (central differences of the float64
reference), several batch sizes, weights that drop pairs, empty response rows."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alignax.losses.preference import (
    DPO_VARIANTS,
    F_DIVERGENCE_VARIANTS,
    dpo_loss,
    ld_sequence_logps,
    wpo_aligned_logps,
    wpo_weights,
)
from tests.support import preference_references as ref
from tests.support.references import finite_difference
from tests.test_preference_losses import PAIR_REFERENCE_VARIANTS, pairs

NEW_VARIANTS = ("bco_pair", "aot", "aot_unpaired", "discopop", "sigmoid_norm")
VALUE = dict(rtol=2e-5, atol=2e-6)
GRAD = dict(rtol=2e-3, atol=2e-5)


def batch(b, seed=0, drop=()):
    """test_preference_losses' pairs (sums over 3..9 tokens, float32) and weights with ``drop`` zeroed."""
    pc, pr, qc, qr, lc, lr = pairs(seed=seed, b=b)
    w = np.ones(b, np.float32)
    w[list(drop)] = 0.0
    return pc, pr, qc, qr, lc.astype(np.float32), lr.astype(np.float32), w


def check(names, b, seed, drop=(), ref_kw=None, **kw):
    """``dpo_loss`` equals the reference in value and in its gradient on both policy inputs."""
    pc, pr, qc, qr, lc, lr, w = batch(b, seed, drop)
    ref_kw = {**kw, **(ref_kw or {})}
    lib_kw = {k: v for k, v in kw.items() if k in ("loss_weights", "rpo_alpha", "beta")}
    lib_kw.update({{"eps": "label_smoothing", "tau": "discopop_tau", "f": "f_divergence"}.get(k, k): v
                   for k, v in kw.items() if k in ("eps", "tau", "f", "f_alpha", "bco_delta")})
    variant = names[0] if len(names) == 1 else list(names)

    def lib(c, r):
        return dpo_loss(c, r, qc, qr, lc, lr, variant=variant, weights=w, **lib_kw)[0]

    def reference(c, r):
        return ref.objective(list(c), list(r), list(qc), list(qr), list(lc), list(lr), list(w), names=names,
                             **ref_kw)

    np.testing.assert_allclose(float(jax.jit(lib)(pc, pr)), reference(pc, pr), **VALUE)
    if "bco_pair" in names and "bco_delta" not in kw:  # the batch's shift is a constant to the gradient
        ref_kw["bco_delta"] = ref.bco_batch_delta(pc, pr, qc, qr, w, beta=kw["beta"], f=kw.get("f", "reverse_kl"),
                                                  f_alpha=kw.get("f_alpha", 0.5))
    gc, gr = jax.grad(lib, argnums=(0, 1))(pc, pr)
    np.testing.assert_allclose(np.asarray(gc), finite_difference(lambda c: reference(c, pr), pc), **GRAD)
    np.testing.assert_allclose(np.asarray(gr), finite_difference(lambda r: reference(pc, r), pr), **GRAD)
    for i in drop:  # a dropped pair gets no gradient
        assert gc[i] == 0 and gr[i] == 0
    return gc, gr


SHAPES = [(1, 0, ()), (4, 1, (2,)), (7, 2, (0, 5))]


@pytest.mark.parametrize("b,seed,drop", SHAPES)
@pytest.mark.parametrize("variant", NEW_VARIANTS)
def test_new_variants_match_their_references(variant, b, seed, drop):
    eps = 0.1 if variant.startswith("aot") else 0.0
    check((variant,), b, seed, drop, beta=0.3, eps=eps, tau=0.5)


def test_every_variant_has_a_reference_somewhere():
    """The ten older variants are checked pair by pair in test_preference_losses.py; every
    other name of the table must be checked here."""
    assert set(DPO_VARIANTS) == set(PAIR_REFERENCE_VARIANTS) | set(NEW_VARIANTS)


def test_bco_delta_is_the_batch_mean_reward_and_can_be_given():
    """The default shift makes the loss blind to a common offset of every reward; a given
    delta is used as it is (and gets no gradient)."""
    pc, pr, qc, qr, lc, lr, w = batch(5, seed=3)
    loss = functools.partial(dpo_loss, variant="bco_pair", beta=0.5)
    base = float(loss(pc, pr, qc, qr)[0])
    shifted = float(loss(pc + 2.0, pr + 2.0, qc, qr)[0])  # every log-ratio +2: every reward +1
    np.testing.assert_allclose(shifted, base, rtol=1e-5)
    check(("bco_pair",), 5, 3, beta=0.5, bco_delta=0.7)
    assert abs(float(loss(pc, pr, qc, qr, bco_delta=0.7)[0]) - base) > 1e-3
    g = jax.grad(lambda d: loss(pc, pr, qc, qr, bco_delta=d)[0])(jnp.float32(0.7))
    assert float(g) == 0.0


def test_aot_pairs_sorted_quantiles_not_records():
    """aot_unpaired reads the two sets of log-ratios only: re-pairing the chosen responses
    with other pairs' rejected ones changes nothing, while sigmoid DPO changes."""
    pc, pr, qc, qr, lc, lr, w = batch(6, seed=4)
    perm = np.array([3, 0, 5, 1, 2, 4])
    for variant, same in (("aot_unpaired", True), ("sigmoid", False)):
        a = float(dpo_loss(pc, pr, qc, qr, variant=variant)[0])
        b = float(dpo_loss(pc, pr[perm], qc, qr[perm], variant=variant)[0])
        assert bool(np.isclose(a, b, rtol=1e-6)) is same, variant
    # a dropped pair is the same as a batch without it
    full = dpo_loss(pc, pr, qc, qr, variant="aot", weights=np.array([1, 1, 0, 1, 1, 1], np.float32))[0]
    keep = np.array([0, 1, 3, 4, 5])
    np.testing.assert_allclose(float(full), float(dpo_loss(pc[keep], pr[keep], qc[keep], qr[keep], variant="aot")[0]),
                               rtol=1e-6)


def test_sorting_variants_divide_their_kept_positions_by_a_global_num_pairs():
    """With ``num_pairs`` the sum over the kept sorted positions is divided by it (a shard of a
    larger batch), not by this batch's count of kept pairs."""
    pc, pr, qc, qr, lc, lr, w = batch(6, seed=5, drop=(2,))
    for variant in ("aot", "aot_unpaired"):
        local = float(dpo_loss(pc, pr, qc, qr, variant=variant, weights=w)[0])
        shard = float(dpo_loss(pc, pr, qc, qr, variant=variant, weights=w, num_pairs=20.0)[0])
        np.testing.assert_allclose(shard, local * 5 / 20, rtol=1e-6, err_msg=variant)


def test_discopop_stays_finite_far_from_zero():
    """exp(-z) sigma(z/tau) at z = -500 is 0 * inf computed naively; here it is 0 and so is its gradient."""
    c, r = jnp.array([-600.0, 400.0]), jnp.array([-100.0, -100.0])
    zero = jnp.zeros(2)
    fn = lambda c: dpo_loss(c, r, zero, zero, variant="discopop", beta=1.0)[0]  # noqa: E731
    value, grad = jax.value_and_grad(fn)(c)
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))
    # z = -500: the logistic part alone, 500 / 2 per pair; z = 500: both parts ~0
    np.testing.assert_allclose(float(value), 250.0, rtol=1e-6)


def test_sigmoid_norm_is_length_averaged_dpo_under_reverse_kl():
    pc, pr, qc, qr, lc, lr, w = batch(5, seed=5)
    a = dpo_loss(pc, pr, qc, qr, lc, lr, variant="sigmoid_norm", beta=0.4)[0]
    b = dpo_loss(pc, pr, qc, qr, lc, lr, variant="sigmoid", beta=0.4, length_normalize=True)[0]
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
    c = dpo_loss(pc, pr, qc, qr, lc, lr, variant="sigmoid", beta=0.4)[0]
    assert abs(float(a) - float(c)) > 1e-3  # the lengths are read


# ---------------------------------------------------------------------------- mixtures and RPO


@pytest.mark.parametrize("b,seed,drop", SHAPES)
def test_mpo_mixture_is_the_weighted_sum(b, seed, drop):
    check(("sigmoid", "bco_pair", "sft"), b, seed, drop, beta=0.2, loss_weights=[0.8, 0.2, 1.0])


def test_mixture_weights_and_rpo_change_the_loss():
    pc, pr, qc, qr, lc, lr, w = batch(4, seed=6)
    args = (pc, pr, qc, qr, lc, lr)
    mix = functools.partial(dpo_loss, *args, variant=["sigmoid", "sft"])
    a, b = float(mix(loss_weights=[1.0, 1.0])[0]), float(mix(loss_weights=[1.0, 0.0])[0])
    np.testing.assert_allclose(b, float(dpo_loss(*args)[0]), rtol=1e-6)
    np.testing.assert_allclose(a - b, ref.chosen_nll(list(pc), list(lc), [1.0] * 4), rtol=1e-5)
    check(("sigmoid",), 4, 6, (1,), beta=0.1, rpo_alpha=0.5)
    loss, metrics = dpo_loss(*args, rpo_alpha=0.5)
    np.testing.assert_allclose(float(loss) - float(dpo_loss(*args)[0]), 0.5 * float(metrics["nll_loss"]), rtol=1e-5)


def test_sft_term_shards_sum_with_global_normalisers():
    pc, pr, qc, qr, lc, lr, w = batch(6, seed=7)
    args = (pc, pr, qc, qr, lc, lr)
    kw = dict(variant=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0], bco_delta=0.1)
    full = dpo_loss(*args, **kw)[0]
    parts = [dpo_loss(*(a[s] for a in args), num_pairs=6.0, num_chosen_tokens=float(lc.sum()), **kw)[0]
             for s in (slice(0, 2), slice(2, 6))]
    np.testing.assert_allclose(float(parts[0] + parts[1]), float(full), rtol=1e-5)


# ---------------------------------------------------------------------------- f-divergences


@pytest.mark.parametrize("f", ["forward_kl", "js", "alpha"])
@pytest.mark.parametrize("variant", ["sigmoid", "bco_pair", "nca_pair", "discopop", "hinge"])
def test_f_divergence_scores_match_the_reference(f, variant):
    check((variant,), 5, 8, (3,), beta=0.5, f=f, f_alpha=0.3, tau=0.5, bco_delta=0.2)


def test_f_divergence_limits_and_differences():
    pc, pr, qc, qr, lc, lr, w = batch(5, seed=9)
    loss = lambda **kw: float(dpo_loss(pc, pr, qc, qr, beta=0.5, **kw)[0])  # noqa: E731
    dpo = loss()
    np.testing.assert_allclose(loss(f_divergence="alpha", f_alpha=1.0 - 1e-4), dpo, rtol=1e-3)
    np.testing.assert_allclose(loss(f_divergence="alpha", f_alpha=0.0), loss(f_divergence="forward_kl"), rtol=1e-6)
    assert len({round(v, 6) for v in (dpo, loss(f_divergence="forward_kl"), loss(f_divergence="js"))}) == 3


def test_alpha_divergence_caps_its_exponent_at_80():
    """``exp(min((alpha - 1) r, 80)) / (alpha - 1)``: a log-ratio of -400 at alpha 0.5 (exponent
    200, inf in float32) scores ``-2 exp(80)`` and the loss stays finite (TRL's cap)."""
    pc, qc = np.array([-400.0, -3.0], np.float32), np.array([0.0, -2.0], np.float32)
    pr, qr = np.array([-1.0, -4.0], np.float32), np.array([-1.0, -3.5], np.float32)
    loss = float(dpo_loss(pc, pr, qc, qr, beta=0.1, variant="hinge", f_divergence="alpha", f_alpha=0.5)[0])
    psi = [(-2.0 * math.exp(80.0), -2.0), (-2.0 * math.exp(0.5), -2.0 * math.exp(0.25))]
    want = sum(max(0.0, 1.0 - 0.1 * (c - r)) for c, r in psi) / 2
    assert math.isfinite(loss)
    np.testing.assert_allclose(loss, want, rtol=1e-5)


def test_f_divergence_scores_reach_sigmoid_norm_and_length_averaged_ratios():
    """The scores ``psi(r)`` where the variant divides by the lengths itself (``sigmoid_norm``)
    and where the log-probs are length-averaged first (``length_normalize=True``)."""
    pc, pr, qc, qr, lc, lr, w = batch(5, seed=16, drop=(1,))
    got = float(dpo_loss(pc, pr, qc, qr, lc, lr, beta=0.5, variant="sigmoid_norm", f_divergence="js", weights=w)[0])
    want = ref.variant_term("sigmoid_norm", pc, pr, qc, qr, lc, lr, w, beta=0.5, f="js")
    np.testing.assert_allclose(got, want, **VALUE)
    got = float(dpo_loss(pc, pr, qc, qr, lc, lr, beta=0.5, length_normalize=True, f_divergence="js", weights=w)[0])
    want = ref.variant_term("sigmoid", pc / lc, pr / lr, qc / lc, qr / lr, lc, lr, w, beta=0.5, f="js")
    np.testing.assert_allclose(got, want, **VALUE)


def test_sft_term_first_and_its_own_chosen_logps():
    """A mixture may name the SFT term first beside a length-averaged variant, and the SFT term
    reads ``chosen_nll_logps`` when given (LD-DPO's plain sums) instead of the policy's."""
    pc, pr, qc, qr, lc, lr, w = batch(4, seed=17, drop=(2,))
    got = float(dpo_loss(pc, pr, qc, qr, lc, lr, beta=0.5, variant=["sft", "ipo"], weights=w)[0])
    want = ref.chosen_nll(pc, lc, w) + ref.variant_term("ipo", pc / lc, pr / lr, qc / lc, qr / lr, lc, lr, w, beta=0.5)
    np.testing.assert_allclose(got, want, **VALUE)
    nll_pc = pc - 1.5
    got = float(dpo_loss(pc, pr, qc, qr, lc, lr, beta=0.5, variant=["sigmoid", "sft"], weights=w,
                         chosen_nll_logps=nll_pc)[0])
    want = ref.variant_term("sigmoid", pc, pr, qc, qr, lc, lr, w, beta=0.5) + ref.chosen_nll(nll_pc, lc, w)
    np.testing.assert_allclose(got, want, **VALUE)


def test_rpo_term_divides_by_a_global_token_count():
    """RPO's NLL over ``num_chosen_tokens`` when given (a shard), not this batch's tokens."""
    pc, pr, qc, qr, lc, lr, w = batch(4, seed=18)
    got = float(dpo_loss(pc, pr, qc, qr, lc, lr, beta=0.5, rpo_alpha=0.7, num_chosen_tokens=60.0)[0])
    want = ref.variant_term("sigmoid", pc, pr, qc, qr, lc, lr, w, beta=0.5) + 0.7 * ref.chosen_nll(pc, lc, w, 60.0)
    assert float(np.sum(lc)) != 60.0
    np.testing.assert_allclose(got, want, **VALUE)


def test_sft_first_beside_summed_variants_reports_the_local_weighted_nll():
    """``["sft", "sigmoid"]`` with weights and a global token count: the loss's NLL over
    ``num_chosen_tokens``, the ``nll_loss`` metric over this batch's own weighted tokens (the
    lengths are given), and the log-prob metrics the summed ones sigmoid reads."""
    pc, pr, qc, qr, lc, lr, w = batch(4, seed=19, drop=(1,))
    w[2] = 0.5
    loss, metrics = dpo_loss(pc, pr, qc, qr, lc, lr, beta=0.5, variant=["sft", "sigmoid"], weights=w,
                             num_chosen_tokens=60.0)
    want = ref.chosen_nll(pc, lc, w, 60.0) + ref.variant_term("sigmoid", pc, pr, qc, qr, lc, lr, w, beta=0.5)
    np.testing.assert_allclose(float(loss), want, **VALUE)
    np.testing.assert_allclose(float(metrics["nll_loss"]), ref.chosen_nll(pc, lc, w), **VALUE)
    np.testing.assert_allclose(float(metrics["logps/chosen"]), float(np.sum(w * pc) / np.sum(w)), **VALUE)


def test_f_divergence_refused_where_a_variant_reads_its_own_ratios():
    pc, pr, qc, qr, lc, lr, w = batch(3)
    with pytest.raises(ValueError, match="f_divergence=js maps the log-ratios of .*variant apo_zero reads"):
        dpo_loss(pc, pr, qc, qr, variant=["sigmoid", "apo_zero"], f_divergence="js")
    with pytest.raises(ValueError, match="f_alpha=1 is the reverse KL"):
        dpo_loss(pc, pr, qc, qr, f_divergence="alpha", f_alpha=1.0)
    with pytest.raises(ValueError, match="unknown f_divergence 'kl'"):
        dpo_loss(pc, pr, qc, qr, f_divergence="kl")
    assert "ipo" not in F_DIVERGENCE_VARIANTS and "sigmoid" in F_DIVERGENCE_VARIANTS


def test_mixture_errors_name_what_is_wrong():
    pc, pr, qc, qr, lc, lr, w = batch(3)
    with pytest.raises(ValueError, match="loss_weights has 1 entries for 2 variants"):
        dpo_loss(pc, pr, qc, qr, lc, lr, variant=["sigmoid", "sft"], loss_weights=[1.0])
    with pytest.raises(ValueError, match="unknown variant 'kto'"):
        dpo_loss(pc, pr, qc, qr, variant=["sigmoid", "kto"])
    with pytest.raises(ValueError, match="variant sft reads response lengths"):
        dpo_loss(pc, pr, qc, qr, variant=["sigmoid", "sft"])
    with pytest.raises(ValueError, match="aot and aot_unpaired sort the pairs"):
        dpo_loss(pc, pr, qc, qr, variant="aot", pair_scale=w)
    with pytest.raises(ValueError, match="variant sigmoid_norm divides the log-ratios by the lengths itself"):
        dpo_loss(pc, pr, qc, qr, lc, lr, variant="sigmoid_norm", length_normalize=True)


def test_smoothing_refused_without_a_smoothed_variant_names_the_variants():
    """The error names the variant as given: one name quoted, a mixture as its list."""
    pc, pr, qc, qr, lc, lr, w = batch(2)
    with pytest.raises(ValueError, match=r"label_smoothing=0.1 has no meaning for variant 'hinge';"):
        dpo_loss(pc, pr, qc, qr, variant="hinge", label_smoothing=0.1)
    with pytest.raises(ValueError, match=r"label_smoothing=0.1 has no meaning for variant \['hinge', 'ipo'\];"):
        dpo_loss(pc, pr, qc, qr, lc, lr, variant=["hinge", "ipo"], label_smoothing=0.1)


# ---------------------------------------------------------------------------- WPO


def test_wpo_weights_scale_pairs_not_the_normaliser():
    pc, pr, qc, qr, lc, lr, w = batch(5, seed=10, drop=(1,))
    rng = np.random.default_rng(10)
    ac, ar = (-rng.uniform(0, 1, 5) * lc).astype(np.float32), (-rng.uniform(0, 1, 5) * lr).astype(np.float32)
    scale = wpo_weights(ac, ar, lc, lr)
    np.testing.assert_allclose(np.asarray(scale), np.exp(ac / lc + ar / lr), rtol=1e-6)
    assert float(jax.grad(lambda a: wpo_weights(a, ar, lc, lr).sum())(ac).sum()) == 0.0
    got = dpo_loss(pc, pr, qc, qr, beta=0.3, weights=w, pair_scale=scale)[0]
    want = ref.variant_term("sigmoid", pc, pr, qc, qr, lc, lr, w, beta=0.3, scale=list(np.asarray(scale)))
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    gc = jax.grad(lambda c: dpo_loss(c, pr, qc, qr, beta=0.3, weights=w, pair_scale=scale)[0])(pc)
    fd = finite_difference(lambda c: ref.variant_term("sigmoid", c, pr, qc, qr, lc, lr, w, beta=0.3,
                                                      scale=list(np.asarray(scale))), pc)
    np.testing.assert_allclose(np.asarray(gc), fd, **GRAD)


def test_wpo_weights_clamp_lengths_to_one_token():
    """``|y| = max(|y|, 1)``: a one-token response divides by 1 (and an empty one too)."""
    ac, ar = np.array([-0.4, -0.2, -0.6], np.float32), np.array([-0.3, -0.8, -0.1], np.float32)
    lc, lr = np.array([1.0, 0.0, 1.0], np.float32), np.array([0.0, 1.0, 2.0], np.float32)
    want = np.exp(ac / np.maximum(lc, 1.0) + ar / np.maximum(lr, 1.0))
    np.testing.assert_allclose(np.asarray(wpo_weights(ac, ar, lc, lr)), want, rtol=1e-6)


@pytest.mark.parametrize("shape", [(1, 3, 5), (3, 6, 7)])
def test_wpo_aligned_logps_match_the_reference(shape):
    b, t, v = shape
    rng = np.random.default_rng(11)
    logits = rng.normal(scale=2.0, size=shape).astype(np.float32)
    targets = rng.integers(0, v, size=(b, t))
    mask = (rng.uniform(size=(b, t)) > 0.3).astype(np.float32)
    mask[0] = 0.0  # an empty row
    got = wpo_aligned_logps(logits, targets, mask)
    np.testing.assert_allclose(np.asarray(got), ref.wpo_aligned(logits, targets, mask), rtol=1e-5, atol=1e-6)
    assert float(got[0]) == 0.0
    # a token at the policy's own distribution's "typical" probability weighs ~1: uniform logits give a = 0
    flat = wpo_aligned_logps(np.zeros((1, 4, v), np.float32), np.zeros((1, 4), np.int32), np.ones((1, 4)))
    np.testing.assert_allclose(float(flat[0]), 0.0, atol=1e-5)


# ---------------------------------------------------------------------------- LD-DPO


@pytest.mark.parametrize("alpha", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("shape", [(1, 6), (4, 9)])
def test_ld_split_matches_the_reference(alpha, shape):
    rng = np.random.default_rng(12)
    lc_tok = rng.normal(-1.0, 0.5, size=shape).astype(np.float32)
    lr_tok = rng.normal(-1.0, 0.5, size=shape).astype(np.float32)
    mc = np.zeros(shape, np.float32)
    mr = np.zeros(shape, np.float32)
    for i in range(shape[0]):  # prompt then a response of random length (row 1: an empty rejected response)
        start = rng.integers(0, 3)
        mc[i, start:start + rng.integers(1, shape[1] - start + 1)] = 1
        if i != 1:
            mr[i, start:start + rng.integers(1, shape[1] - start + 1)] = 1
    c, r = ld_sequence_logps(lc_tok, mc, lr_tok, mr, alpha=alpha)
    np.testing.assert_allclose(np.asarray(c), ref.ld_logps(lc_tok, mc, mr, alpha), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(r), ref.ld_logps(lr_tok, mr, mc, alpha), rtol=1e-6, atol=1e-6)
    if alpha == 1.0:
        np.testing.assert_allclose(np.asarray(c), (lc_tok * mc).sum(-1), rtol=1e-6)
    gc = jax.grad(lambda x: ld_sequence_logps(x, mc, lr_tok, mr, alpha=alpha)[0].sum())(lc_tok)
    fd = finite_difference(lambda x: ref.ld_logps(x, mc, mr, alpha).sum(), lc_tok)
    np.testing.assert_allclose(np.asarray(gc), fd, rtol=1e-4, atol=1e-5)


def test_ld_alpha_outside_the_unit_interval_is_refused():
    x = np.zeros((1, 3), np.float32)
    with pytest.raises(ValueError, match=r"alpha must lie in \[0.0, 1.0\]"):
        ld_sequence_logps(x, x, x, x, alpha=1.5)


def test_an_sft_term_with_a_global_token_count_and_no_lengths_reports_its_nll():
    """``num_chosen_tokens`` given and no lengths: the SFT term's metric uses the same count
    as the loss (it read the lengths, which were not there)."""
    import jax.numpy as jnp

    from alignax.losses.preference import dpo_loss

    pc, pr, rc, rr = (jnp.asarray(v, jnp.float32) for v in ([-3.0, -4.0], [-5.0, -4.5], [-3.5, -4.2], [-4.0, -4.4]))
    loss, metrics = dpo_loss(pc, pr, rc, rr, beta=0.1, variant=["sigmoid", "sft"], num_chosen_tokens=7.0)
    plain, _ = dpo_loss(pc, pr, rc, rr, beta=0.1)
    assert float(metrics["nll_loss"]) == pytest.approx(7.0 / 7.0 * (3.0 + 4.0) / 7.0)
    assert float(loss) - float(plain) == pytest.approx(float(metrics["nll_loss"]), rel=1e-6)
