"""Offline preference losses: the DPO family, SimPO, CPO, ORPO and KTO.

The DPO family (:func:`dpo_loss`): the variants of ``DPO_VARIANT_TABLE``, weighted
mixtures of them and an SFT term (MPO, RPO), f-divergence scores (f-DPO) and per-pair
factors (WPO's :func:`wpo_weights`); LD-DPO's sequence log-probs come from
:func:`ld_sequence_logps`.

Inputs are sequence log-probs: for each response, the sum over its response tokens of
``log pi(y_t | x, y_<t)``, shape ``[B]`` (one entry per pair, or per example for KTO).
Losses that normalise by length also take ``chosen_lengths`` / ``rejected_lengths``
``[B]``, the number of response tokens of each sequence.

Every loss returns ``(loss, metrics)``: a float32 scalar and a flat dict of
stop-gradiented float32 scalars (TRL's metric names), so
``jax.value_and_grad(fn, has_aux=True)`` works directly.

Batch reduction and global normalisers. A loss is ``sum_i w_i l_i / N``: ``w_i`` the
optional per-pair ``weights`` (default 1; 0 drops a pair, e.g. padding; data, so no
gradient reaches them) and ``N`` the optional global ``num_pairs`` (default
``sum_i w_i`` of this batch). When a batch is
split over data-parallel shards or gradient-accumulation micro-batches, pass the
full batch's ``num_pairs`` to every piece: the pieces' losses then *sum* to the
full-batch loss (and so do their gradients). NLL terms (CPO, ORPO) take the matching
``num_chosen_tokens``. Metrics always describe the local batch (weighted means with
local denominators); average them across pieces for logging.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp

from alignax import ops
from alignax._checks import check_choice, check_interval, check_rank, check_same_shape, is_concrete_number
from alignax.losses._pairwise import batch_mean, check_scalar, check_vectors, f32, weighted_means

Array = jax.Array

# EXO needs a label distribution strictly inside (0, 1); TRL uses this when eps is 0.
_EXO_DEFAULT_EPS = 1e-3
# ORPO's log(1 - p) diverges as the mean token log-prob -> 0. Values above this ceiling
# are below float32 resolution of a log-softmax anyway (its rounding error is ~1e-7 *
# |logit|), so they are clamped to it: log(1 - p) >= log(1e-6) ~ -13.8, always finite.
_ORPO_LOGP_CEILING = -1e-6


def _pair_metrics(chosen_rewards, rejected_rewards, chosen_logps, rejected_logps, weights) -> dict[str, Array]:
    values = {
        "rewards/chosen": chosen_rewards,
        "rewards/rejected": rejected_rewards,
        "rewards/accuracies": f32(chosen_rewards > rejected_rewards),
        "rewards/margins": chosen_rewards - rejected_rewards,
        "logps/chosen": chosen_logps,
        "logps/rejected": rejected_logps,
    }
    return weighted_means(values, weights)


def _smoothed_sigmoid_loss(z: Array, label_smoothing) -> Array:
    """``-(1 - eps) log sigma(z) - eps log sigma(-z)``: BCE against a soft label ``1 - eps``."""
    return -(1.0 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)


# ---------------------------------------------------------------------------- the DPO variants
class LogRatios(NamedTuple):
    """A batch of pairs as a DPO variant reads it, each ``[B]`` (length-averaged when asked).

    ``chosen`` / ``rejected``: the scores ``psi(r_c)``, ``psi(r_r)`` of the log-ratios
    ``r = log pi(y) - log pi_ref(y)`` under the f-divergence (:data:`F_DIVERGENCES`;
    ``psi(r) = r`` for ``reverse_kl``, plain DPO); ``policy_chosen`` / ``ref_chosen`` /
    ``policy_rejected`` / ``ref_rejected``: the four log-probs (DPOP, AOT);
    ``chosen_lengths`` / ``rejected_lengths``: response token counts, >= 1 (``sigmoid_norm``;
    ones when the caller gave none); ``keep``: bool, the pairs of weight > 0 (AOT sorts these
    only)."""

    chosen: Array
    rejected: Array
    policy_chosen: Array
    ref_chosen: Array
    policy_rejected: Array
    ref_rejected: Array
    chosen_lengths: Array
    rejected_lengths: Array
    keep: Array


def _sigmoid(r: LogRatios, beta, eps, dpop_lambda) -> Array:
    return _smoothed_sigmoid_loss(beta * (r.chosen - r.rejected), eps)


def _hinge(r: LogRatios, beta, eps, dpop_lambda) -> Array:
    return jax.nn.relu(1.0 - beta * (r.chosen - r.rejected))


def _ipo(r: LogRatios, beta, eps, dpop_lambda) -> Array:
    return jnp.square(r.chosen - r.rejected - 1.0 / (2.0 * beta))


def _robust(r: LogRatios, beta, eps, dpop_lambda) -> Array:
    z = beta * (r.chosen - r.rejected)
    return (-(1.0 - eps) * jax.nn.log_sigmoid(z) + eps * jax.nn.log_sigmoid(-z)) / (1.0 - 2.0 * eps)


def _dpop(r: LogRatios, beta, eps, dpop_lambda) -> Array:
    penalty = jax.nn.relu(r.ref_chosen - r.policy_chosen)
    return -jax.nn.log_sigmoid(beta * (r.chosen - r.rejected - dpop_lambda * penalty))


def _exo_pair(r: LogRatios, beta, eps, dpop_lambda) -> Array:
    z = beta * (r.chosen - r.rejected)
    eps = jnp.where(eps == 0, _EXO_DEFAULT_EPS, eps)
    return jax.nn.sigmoid(z) * (jax.nn.log_sigmoid(z) - jnp.log1p(-eps)) + jax.nn.sigmoid(-z) * (
        jax.nn.log_sigmoid(-z) - jnp.log(eps)
    )


def _nca_pair(r: LogRatios, beta, eps, dpop_lambda) -> Array:
    zc, zr = beta * r.chosen, beta * r.rejected
    return -jax.nn.log_sigmoid(zc) - 0.5 * jax.nn.log_sigmoid(-zc) - 0.5 * jax.nn.log_sigmoid(-zr)


def _sppo_hard(r: LogRatios, beta, eps, dpop_lambda) -> Array:
    half_eta = 0.5 / beta
    return jnp.square(r.chosen - half_eta) + jnp.square(r.rejected + half_eta)


def _apo_zero(r: LogRatios, beta, eps, dpop_lambda) -> Array:
    return 1.0 - jax.nn.sigmoid(beta * r.chosen) + jax.nn.sigmoid(beta * r.rejected)


def _apo_down(r: LogRatios, beta, eps, dpop_lambda) -> Array:
    return jax.nn.sigmoid(beta * r.chosen) + 1.0 - jax.nn.sigmoid(beta * (r.chosen - r.rejected))


def _bco_pair(r: LogRatios, beta, eps, dpop_lambda, *, bco_delta) -> Array:
    return (-jax.nn.log_sigmoid(beta * r.chosen - bco_delta)
            - jax.nn.log_sigmoid(-(beta * r.rejected - bco_delta)))


# A dropped pair's value while sorting: above every real one, so the kept pairs fill the
# first positions of both sorted arrays and the dropped ones pair with each other (delta 0).
_SORT_FILLER = 3.0e38


def _sorted_kept(x: Array, keep: Array) -> Array:
    return jnp.sort(jnp.where(keep, x, _SORT_FILLER))


def _aot(r: LogRatios, beta, eps, dpop_lambda) -> Array:
    delta = (_sorted_kept(r.policy_chosen - r.policy_rejected, r.keep)
             - _sorted_kept(r.ref_chosen - r.ref_rejected, r.keep))
    return _smoothed_sigmoid_loss(beta * delta, eps)


def _aot_unpaired(r: LogRatios, beta, eps, dpop_lambda) -> Array:
    delta = _sorted_kept(r.chosen, r.keep) - _sorted_kept(r.rejected, r.keep)
    return _smoothed_sigmoid_loss(beta * delta, eps)


def _discopop(r: LogRatios, beta, eps, dpop_lambda, *, discopop_tau) -> Array:
    z = beta * (r.chosen - r.rejected)
    # sigma(z/tau) exp(-z) as one exp of a sum: for z << 0 the two factors are 0 and inf apart
    exp_part = jnp.exp(jax.nn.log_sigmoid(z / discopop_tau) - z)
    return -jax.nn.log_sigmoid(z) * jax.nn.sigmoid(-z / discopop_tau) + exp_part


def _sigmoid_norm(r: LogRatios, beta, eps, dpop_lambda) -> Array:
    return -jax.nn.log_sigmoid(beta * (r.chosen / r.chosen_lengths - r.rejected / r.rejected_lengths))


@dataclasses.dataclass(frozen=True)
class DPOVariant:
    """A DPO variant: ``per_pair(r: LogRatios, beta, eps, dpop_lambda, **reads) -> [B]``
    (formulas in :func:`dpo_loss`; ``reads``: the further hyper-parameters it takes as
    keywords, ``discopop_tau`` or ``bco_delta``), the interval ``(low, high, high_open)`` of the ``label_smoothing`` it
    takes (closed below; ``None``: it takes none, eps must be 0), whether it averages
    log-probs over response tokens by default (IPO), whether it reads the response lengths
    (``sigmoid_norm``), whether it reads the pair through the f-divergence's scores
    (``f_divergence``; the others read log-ratios or log-probs themselves) and whether it
    sorts the batch (AOT: the loss at sorted position ``k`` belongs to no one pair, so the
    pair weights only say which pairs are kept)."""

    per_pair: Callable[..., Array]
    smoothing: tuple[float, float, bool] | None = None
    length_normalize: bool = False
    needs_lengths: bool = False
    f_divergence: bool = False
    sorts: bool = False
    reads: tuple[str, ...] = ()


# Adding a variant: its per-pair function above and one entry here (the config's
# ``preference.variant`` accepts every name of this table).
DPO_VARIANT_TABLE: dict[str, DPOVariant] = {
    "sigmoid": DPOVariant(_sigmoid, smoothing=(0.0, 0.5, False), f_divergence=True),
    "hinge": DPOVariant(_hinge, f_divergence=True),
    "ipo": DPOVariant(_ipo, length_normalize=True),
    "robust": DPOVariant(_robust, smoothing=(0.0, 0.5, True), f_divergence=True),
    "dpop": DPOVariant(_dpop),
    "exo_pair": DPOVariant(_exo_pair, smoothing=(0.0, 1.0, True), f_divergence=True),
    "nca_pair": DPOVariant(_nca_pair, f_divergence=True),
    "sppo_hard": DPOVariant(_sppo_hard, f_divergence=True),
    "apo_zero": DPOVariant(_apo_zero),
    "apo_down": DPOVariant(_apo_down),
    "bco_pair": DPOVariant(_bco_pair, f_divergence=True, reads=("bco_delta",)),
    "aot": DPOVariant(_aot, smoothing=(0.0, 0.5, False), sorts=True),
    "aot_unpaired": DPOVariant(_aot_unpaired, smoothing=(0.0, 0.5, False), sorts=True),
    "discopop": DPOVariant(_discopop, f_divergence=True, reads=("discopop_tau",)),
    "sigmoid_norm": DPOVariant(_sigmoid_norm, needs_lengths=True, f_divergence=True),
}
DPO_VARIANTS = tuple(DPO_VARIANT_TABLE)
SMOOTHED_VARIANTS = tuple(name for name, v in DPO_VARIANT_TABLE.items() if v.smoothing is not None)
F_DIVERGENCE_VARIANTS = tuple(name for name, v in DPO_VARIANT_TABLE.items() if v.f_divergence)
# The term a mixture may add beside the variants: the token-mean NLL of the chosen responses
# (MPO's "sft"; RPO's term is the same one at weight ``rpo_alpha``).
SFT_TERM = "sft"
MIXTURE_TERMS = (*DPO_VARIANTS, SFT_TERM)


def _forward_kl(r: Array, alpha) -> Array:
    return -jnp.exp(-r)


def _js(r: Array, alpha) -> Array:
    return jax.nn.log_sigmoid(r)


def _alpha(r: Array, alpha) -> Array:
    # exp((alpha - 1) r) / (alpha - 1), capped at exp(80) as TRL does (finite in float32)
    return jnp.exp(jnp.minimum((alpha - 1.0) * r, 80.0)) / (alpha - 1.0)


# f-DPO's scores psi(r) = f'(pi/pi_ref) with the constant dropped (Wang et al. 2023, "Beyond
# Reverse KL: Generalizing Direct Preference Optimization with Diverse Divergence Constraints",
# Table 1 and eq. 12).
F_DIVERGENCES: dict[str, Callable[[Array, Array], Array] | None] = {
    "reverse_kl": None,
    "forward_kl": _forward_kl,
    "js": _js,
    "alpha": _alpha,
}


def _terms(variant, loss_weights) -> tuple[tuple[str, ...], tuple[float, ...]]:
    names = (variant,) if isinstance(variant, str) else tuple(variant)
    if not names:
        raise ValueError(f"variant is empty; name one or more of {', '.join((*DPO_VARIANT_TABLE, SFT_TERM))}")
    for name in names:  # the table as it is now (a variant may be added after import)
        check_choice("variant", name, (*DPO_VARIANT_TABLE, SFT_TERM))
    weights = (1.0,) * len(names) if loss_weights is None else tuple(loss_weights)
    if len(weights) != len(names):
        raise ValueError(f"loss_weights has {len(weights)} entries for {len(names)} variants {list(names)}; give "
                         "one weight per variant")
    return names, weights


def _shown(names) -> str:
    return repr(names[0]) if len(names) == 1 else str(list(names))


def _check_smoothing(names, label_smoothing) -> None:
    smoothed = [n for n in names if n != SFT_TERM and DPO_VARIANT_TABLE[n].smoothing is not None]
    for name in smoothed:
        low, high, high_open = DPO_VARIANT_TABLE[name].smoothing
        check_interval("label_smoothing", label_smoothing, low, high, low_open=False, high_open=high_open)
    if not smoothed and is_concrete_number(label_smoothing) and label_smoothing != 0:
        raise ValueError(
            f"label_smoothing={label_smoothing} has no meaning for variant {_shown(names)}; "
            f"it is used by {', '.join(SMOOTHED_VARIANTS)} only (set it to 0)"
        )


def _check_f_divergence(names, f_divergence, f_alpha) -> None:
    check_choice("f_divergence", f_divergence, tuple(F_DIVERGENCES))
    if f_divergence == "reverse_kl":
        return
    others = [n for n in names if n != SFT_TERM and not DPO_VARIANT_TABLE[n].f_divergence]
    if others:
        raise ValueError(f"f_divergence={f_divergence} maps the log-ratios of {', '.join(F_DIVERGENCE_VARIANTS)}; "
                         f"variant {', '.join(others)} reads log-ratios or log-probs of its own (use reverse_kl)")
    if f_divergence == "alpha" and is_concrete_number(f_alpha) and f_alpha == 1:
        raise ValueError("f_alpha=1 is the reverse KL's limit; set f_divergence=reverse_kl (or f_alpha != 1)")


def _ratios(pol_c, pol_r, ref_c, ref_r, len_c, len_r, keep, normalise: bool, psi, f_alpha) -> LogRatios:
    if normalise:
        pol_c, ref_c, pol_r, ref_r = pol_c / len_c, ref_c / len_c, pol_r / len_r, ref_r / len_r
    chosen, rejected = pol_c - ref_c, pol_r - ref_r
    if psi is not None:
        chosen, rejected = psi(chosen, f_alpha), psi(rejected, f_alpha)
    return LogRatios(chosen, rejected, pol_c, ref_c, pol_r, ref_r, len_c, len_r, keep)


def dpo_loss(
    policy_chosen_logps: Array,
    policy_rejected_logps: Array,
    ref_chosen_logps: Array,
    ref_rejected_logps: Array,
    chosen_lengths: Array | None = None,
    rejected_lengths: Array | None = None,
    *,
    beta: float | Array = 0.1,
    variant: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    label_smoothing: float | Array = 0.0,
    dpop_lambda: float | Array = 50.0,
    discopop_tau: float | Array = 0.05,
    f_divergence: str = "reverse_kl",
    f_alpha: float | Array = 0.5,
    rpo_alpha: float | Array | None = None,
    bco_delta: Array | float | None = None,
    length_normalize: bool | None = None,
    pair_scale: Array | None = None,
    chosen_nll_logps: Array | None = None,
    weights: Array | None = None,
    num_pairs: Array | float | None = None,
    num_chosen_tokens: Array | float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Direct Preference Optimisation and its pairwise variants, reference-anchored.

    With implicit rewards ``r_c = log pi(y_c) - log pi_ref(y_c)`` and
    ``r_r = log pi(y_r) - log pi_ref(y_r)`` (log-ratios, unscaled), the margin
    ``h = r_c - r_r`` and ``eps = label_smoothing``, the per-pair losses are:

    - ``sigmoid``: ``-(1-eps) log s(b h) - eps log s(-b h)``. ``eps = 0`` is DPO
      (Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model is
      Secretly a Reward Model", eq. 7); ``eps > 0`` is conservative DPO (Mitchell 2023,
      "A note on DPO with noisy preferences"), ``eps`` in ``[0, 0.5]``.
    - ``hinge``: ``max(0, 1 - b h)``. SLiC's calibration loss (Zhao et al. 2023,
      "SLiC-HF") with the reference-normalised margin of Liu et al. 2024 ("Statistical
      Rejection Sampling Improves Preference Optimization"); ``1/b`` is SLiC's margin.
    - ``ipo``: ``(h - 1/(2b))^2`` (Azar et al. 2023, "A General Theoretical Paradigm to
      Understand Learning from Human Preferences", eq. 17, ``b`` their ``tau``).
      **Length-averaged by default**: as TRL does for IPO, all four log-probs are
      divided by the number of response tokens before ``h`` is formed, so the target
      margin ``1/(2b)`` is in nats per token; pass ``chosen_lengths`` and
      ``rejected_lengths``. ``length_normalize=False`` gives the paper's summed form.
    - ``robust``: ``[(1-eps)(-log s(b h)) - eps(-log s(-b h))] / (1 - 2 eps)``: rDPO
      (Chowdhury et al. 2024, "Provably Robust DPO"), unbiased under preference labels
      flipped with rate ``eps`` in ``[0, 0.5)``.
    - ``dpop``: ``-log s(b (h - lambda max(0, log pi_ref(y_c) - log pi(y_c))))``:
      DPO-Positive (Pal et al. 2024, "Smaug: Fixing Failure Modes of Preference
      Optimisation with DPO-Positive", eq. 3), ``lambda = dpop_lambda`` (paper: 50);
      penalises the chosen response's likelihood falling below the reference's.
    - ``exo_pair``: ``KL(p_theta || p_label)`` over the pair, ``p_theta = (s(b h), s(-b h))``
      and ``p_label = (1-eps, eps)`` (Ji et al. 2024, "Towards Efficient Exact
      Optimization of Language Model Alignment", EXO with K = 2); ``eps = 0`` is replaced
      by 1e-3 as in TRL, ``eps`` in ``[0, 1)``.
    - ``nca_pair``: ``-log s(b r_c) - 0.5 log s(-b r_c) - 0.5 log s(-b r_r)`` (Chen et al.
      2024, "Noise Contrastive Alignment of Language Models with Explicit Rewards").
    - ``sppo_hard``: ``(r_c - 1/(2b))^2 + (r_r + 1/(2b))^2``: SPPO (Wu et al. 2024,
      "Self-Play Preference Optimization") with hard win probabilities 1 and 0, ``eta = 1/b``.
    - ``apo_zero``: ``1 - s(b r_c) + s(b r_r)``; ``apo_down``:
      ``s(b r_c) + 1 - s(b (r_c - r_r))`` (D'Oosterlinck et al. 2024, "Anchored
      Preference Optimization and Contrastive Revisions", eq. 7-8, offset to be >= 0).
    - ``bco_pair``: ``-log s(b r_c - delta) - log s(-(b r_r - delta))`` (Jung et al. 2024,
      "Binary Classifier Optimization for Large Language Model Alignment", eq. 8: the
      chosen response a positive, the rejected a negative example of a binary classifier
      with logit ``b r``). ``delta`` is the paper's reward shift, a mean of past rewards
      (TRL <= 1.9 kept a running mean; TRL 1.10 on sets it to 0): here ``bco_delta`` when
      given (e.g. a mean kept by the caller), else this batch's weighted mean of
      ``b r_c`` and ``b r_r`` (``(mean_i b r_c,i + mean_i b r_r,i) / 2``, no gradient): a
      running mean with a window of one batch, which makes the loss invariant to a common
      shift of every reward. Under gradient accumulation each micro-batch shifts by its own
      mean (pass ``bco_delta`` for one shift).
    - ``aot``: ``-(1-eps) log s(b d_k) - eps log s(-b d_k)`` at each sorted position
      ``k``, ``d = sort_i(log pi(y_c,i) - log pi(y_r,i)) - sort_i(log pi_ref(y_c,i) -
      log pi_ref(y_r,i))``; ``aot_unpaired``: ``d = sort_i(r_c,i) - sort_i(r_r,i)`` (Melnyk
      et al. 2024, "Distributional Preference Alignment of LLMs via Optimal Transport",
      the one-dimensional transport plan of the sorted quantiles, as TRL's). Only the pairs
      of weight > 0 are sorted, and each kept sorted position counts 1 (a position is no
      one pair, so weights act as keep / drop).
    - ``discopop``: ``-log s(z) (1 - s(z/tau)) + exp(-z) s(z/tau)``, ``z = b h``,
      ``tau = discopop_tau`` (Lu et al. 2024, "Discovering Preference Optimization
      Algorithms with and for Large Language Models", eq. 5, the log-ratio modulated loss;
      the paper's tau 0.05). ``exp(-z) s(z/tau)`` is computed as one exponential so a
      very negative ``z`` gives 0, not ``inf * 0``.
    - ``sigmoid_norm``: ``-log s(b (r_c/|y_c| - r_r/|y_r|))``: DPO on per-token log-ratios,
      as TRL defines it (needs the lengths).

    **Mixtures** (Wang et al. 2024, "Enhancing the Reasoning Ability of Multimodal Large
    Language Models via Mixed Preference Optimization", MPO): ``variant`` a list of names,
    each a variant above or ``"sft"``, and ``loss_weights`` one weight each (default 1);
    the loss is ``sum_k w_k L_k``. ``"sft"`` is the token-mean NLL of the chosen responses,
    ``-sum_i w_i log pi(y_c,i) / sum_i w_i |y_c,i|`` (``num_chosen_tokens`` for shards),
    the NLL term of CPO and ORPO. ``rpo_alpha`` adds that term at weight ``alpha``: RPO
    (Pang et al. 2024, "Iterative Reasoning Preference Optimization", eq. 1).

    **f-divergences** (Wang et al. 2023, "Beyond Reverse KL: Generalizing Direct
    Preference Optimization with Diverse Divergence Constraints", eq. 12): the variants of
    :data:`F_DIVERGENCE_VARIANTS` read ``psi(r) = f'(pi/pi_ref)`` in place of each
    log-ratio ``r`` (constants dropped, as TRL): ``reverse_kl`` ``r`` (DPO),
    ``forward_kl`` ``-exp(-r)``, ``js`` ``log s(r)``, ``alpha``
    ``exp((alpha - 1) r) / (alpha - 1)`` with ``alpha = f_alpha`` (TRL's
    ``f_alpha_divergence_coef``: the paper's ``u^-alpha'`` family with ``alpha' = 1 - alpha``;
    ``alpha -> 1`` is the reverse KL, ``alpha = 0`` the forward KL; the exponent is capped
    at 80 as TRL's). The reward metrics stay ``b r``.

    ``s`` is the logistic sigmoid and ``b = beta``. The loss is ``sum_i w_i c_i l_i / N``
    (module docstring) with ``c_i = pair_scale`` (default 1; e.g. WPO's weights,
    :func:`wpo_weights`), factors that, unlike ``weights``, do not count in ``N``; they scale
    the pair terms, not the SFT term, and the sorting variants refuse them. Gradients flow
    into the policy log-probs; the reference log-probs, ``pair_scale`` and ``bco_delta``
    are stop-gradiented here.

    Args:
      policy_chosen_logps, policy_rejected_logps: ``[B]`` summed response log-probs under
        the policy (LD-DPO's: :func:`ld_sequence_logps`).
      ref_chosen_logps, ref_rejected_logps: ``[B]`` the same under the frozen reference.
      chosen_lengths, rejected_lengths: ``[B]`` response token counts; needed when
        log-probs are length-averaged (``ipo`` by default), by ``sigmoid_norm``, and by the
        SFT term without ``num_chosen_tokens``.
      beta: ``> 0``, the KL-regularisation strength (inverse temperature).
      variant: one of ``DPO_VARIANTS``, or a list of ``MIXTURE_TERMS``; ``loss_weights``
        one weight per entry.
      label_smoothing: ``eps`` of ``sigmoid``, ``robust``, ``exo_pair``, ``aot``,
        ``aot_unpaired``; must be 0 when no variant takes it.
      dpop_lambda: DPOP's ``lambda``; discopop_tau: DiscoPOP's ``tau`` (> 0).
      f_divergence, f_alpha: above (``F_DIVERGENCES``).
      rpo_alpha: RPO's NLL weight (``None``: no NLL term).
      bco_delta: ``bco_pair``'s reward shift, a scalar (``None``: this batch's mean).
      length_normalize: divide every log-prob by its response length first (``None``:
        each variant's default, ``True`` for ``ipo``).
      pair_scale: optional ``[B]`` factors >= 0 on each pair's loss (not in ``N``).
      chosen_nll_logps: ``[B]`` the chosen log-probs the SFT term reads (default
        ``policy_chosen_logps``; the plain sums when LD-DPO reweighted those).
      weights: optional ``[B]`` per-pair weights >= 0.
      num_pairs, num_chosen_tokens: optional global normalisers (module docstring).

    Returns ``(loss, metrics)``; metrics (TRL names, local weighted means):
    ``rewards/chosen`` ``b r_c``, ``rewards/rejected`` ``b r_r``, ``rewards/accuracies``
    (fraction with ``r_c > r_r``), ``rewards/margins``, ``logps/chosen``,
    ``logps/rejected`` (the policy log-probs as the first variant used them, i.e. averaged
    when length-normalised), and ``nll_loss`` with an SFT term. A worked value: ``h = 0``
    under ``sigmoid`` gives ``log 2``.
    """
    names, term_weights = _terms(variant, loss_weights)
    check_vectors(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
        chosen_lengths=chosen_lengths,
        rejected_lengths=rejected_lengths,
        pair_scale=pair_scale,
        chosen_nll_logps=chosen_nll_logps,
        weights=weights,
    )
    check_scalar(num_pairs=num_pairs, num_chosen_tokens=num_chosen_tokens, bco_delta=bco_delta)
    check_interval("beta", beta, 0.0, math.inf, low_open=True, high_open=True)
    _check_smoothing(names, label_smoothing)
    _check_f_divergence(names, f_divergence, f_alpha)
    if "discopop" in names:
        check_interval("discopop_tau", discopop_tau, 0.0, math.inf, low_open=True, high_open=True)
    variants = [n for n in names if n != SFT_TERM]
    normalise = {n: DPO_VARIANT_TABLE[n].length_normalize if length_normalize is None else length_normalize
                 for n in variants}
    _check_lengths(names, normalise, length_normalize, pair_scale, rpo_alpha, num_chosen_tokens,
                   chosen_lengths is not None and rejected_lengths is not None)

    pol_c, pol_r = f32(policy_chosen_logps), f32(policy_rejected_logps)
    ref_c = jax.lax.stop_gradient(f32(ref_chosen_logps))
    ref_r = jax.lax.stop_gradient(f32(ref_rejected_logps))
    ones = jnp.ones_like(pol_c)
    len_c = ones if chosen_lengths is None else jnp.maximum(f32(chosen_lengths), 1.0)
    len_r = ones if rejected_lengths is None else jnp.maximum(f32(rejected_lengths), 1.0)
    keep = (ones if weights is None else f32(weights)) > 0
    psi, f_alpha = F_DIVERGENCES[f_divergence], f32(f_alpha)
    plain = {flag: _ratios(pol_c, pol_r, ref_c, ref_r, len_c, len_r, keep, flag, None, f_alpha)
             for flag in {*normalise.values(), bool(normalise.get(names[0], False))}}
    scored = {flag: r if psi is None else _ratios(pol_c, pol_r, ref_c, ref_r, len_c, len_r, keep, flag, psi, f_alpha)
              for flag, r in plain.items()}
    beta = f32(beta)
    scale = ones if pair_scale is None else jax.lax.stop_gradient(f32(pair_scale))
    nll_logps = pol_c if chosen_nll_logps is None else f32(chosen_nll_logps)

    loss = jnp.zeros((), jnp.float32)
    for name, term_weight in zip(names, term_weights):
        if name == SFT_TERM:
            term = _chosen_nll(nll_logps, chosen_lengths, weights, num_chosen_tokens)
        else:
            term = _variant_term(DPO_VARIANT_TABLE[name], scored[normalise[name]], beta, scale, label_smoothing,
                                 dpop_lambda, discopop_tau, bco_delta, weights, num_pairs)
        loss = loss + f32(term_weight) * term
    if rpo_alpha is not None:
        loss = loss + f32(rpo_alpha) * _chosen_nll(nll_logps, chosen_lengths, weights, num_chosen_tokens)

    shown_ratios = plain[bool(normalise.get(names[0], False))]
    metrics = _pair_metrics(beta * shown_ratios.chosen, beta * shown_ratios.rejected, shown_ratios.policy_chosen,
                            shown_ratios.policy_rejected, weights)
    if SFT_TERM in names or rpo_alpha is not None:
        # this batch's own token count where the lengths are given; else the loss term's normaliser
        metrics["nll_loss"] = jax.lax.stop_gradient(_chosen_nll(
            nll_logps, chosen_lengths, weights, None if chosen_lengths is not None else num_chosen_tokens))
    return loss, metrics


def _check_lengths(names, normalise, length_normalize, pair_scale, rpo_alpha, num_chosen_tokens, have_lengths):
    """The lengths are given where a term reads them; the sorting variants take no ``pair_scale``."""
    if length_normalize and "sigmoid_norm" in names:
        raise ValueError("variant sigmoid_norm divides the log-ratios by the lengths itself; leave "
                         "length_normalize unset (or False)")
    if pair_scale is not None and any(DPO_VARIANT_TABLE[n].sorts for n in normalise):
        raise ValueError(f"pair_scale (WPO weighting) with variant {'+'.join(names)}: aot and aot_unpaired sort "
                         "the pairs, so a per-pair factor has no position to go to (as TRL refuses it)")
    readers = [n for n in normalise if normalise[n] or DPO_VARIANT_TABLE[n].needs_lengths]
    if (SFT_TERM in names or rpo_alpha is not None) and num_chosen_tokens is None:
        readers.append(SFT_TERM)
    if readers and not have_lengths:
        raise ValueError(
            f"variant {', '.join(readers)} reads response lengths (length-averaged log-probs as TRL does for ipo, "
            "sigmoid_norm's per-token ratios, the SFT term's token count); pass chosen_lengths and "
            "rejected_lengths [B], or set length_normalize=False for summed log-probs"
        )


def _variant_term(spec: DPOVariant, r: LogRatios, beta, scale, label_smoothing, dpop_lambda, discopop_tau,
                  bco_delta, weights, num_pairs) -> Array:
    """One variant's ``sum_i w_i c_i l_i / N`` (a sorting variant: over its kept sorted positions)."""
    if bco_delta is None and "bco_delta" in spec.reads:  # the batch's mean reward, both responses
        bco_delta = 0.5 * (batch_mean(beta * r.chosen, weights) + batch_mean(beta * r.rejected, weights))
    extra = {"discopop_tau": lambda: f32(discopop_tau), "bco_delta": lambda: jax.lax.stop_gradient(f32(bco_delta))}
    per_pair = spec.per_pair(r, beta, f32(label_smoothing), f32(dpop_lambda),
                             **{k: extra[k]() for k in spec.reads})
    if spec.sorts:
        kept_positions = f32(jnp.arange(per_pair.shape[0]) < jnp.sum(r.keep))
        return batch_mean(per_pair, kept_positions, num_pairs)
    return batch_mean(scale * per_pair, weights, num_pairs)


def wpo_weights(chosen_aligned_logps: Array, rejected_aligned_logps: Array, chosen_lengths: Array,
                rejected_lengths: Array) -> Array:
    """WPO's pair weights ``exp(a_c / |y_c|) exp(a_r / |y_r|)``, no gradient (Zhou et al. 2024,
    "WPO: Enhancing RLHF with Weighted Preference Optimization", eq. 2 with the weight
    alignment of section 3.2, as TRL's ``use_weighting``).

    ``a = sum_t [log pi(y_t | x, y_<t) - log sum_v pi(v | x, y_<t)^2]``: each token's
    log-prob self-normalised by the probability the policy puts on its own samples, so a
    response the policy would generate itself weighs about 1 whatever its entropy
    (:func:`wpo_aligned_logps` from logits). Inputs ``[B]``; lengths are response token
    counts (clamped to >= 1). Returns ``[B]`` for ``dpo_loss(pair_scale=...)``.
    """
    check_vectors(chosen_aligned_logps=chosen_aligned_logps, rejected_aligned_logps=rejected_aligned_logps,
                  chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
    mean_c = f32(chosen_aligned_logps) / jnp.maximum(f32(chosen_lengths), 1.0)
    mean_r = f32(rejected_aligned_logps) / jnp.maximum(f32(rejected_lengths), 1.0)
    return jax.lax.stop_gradient(jnp.exp(mean_c + mean_r))


def ld_sequence_logps(chosen_token_logps: Array, chosen_mask: Array, rejected_token_logps: Array,
                      rejected_mask: Array, *, alpha: float | Array) -> tuple[Array, Array]:
    """LD-DPO's sequence log-probs of a pair (Liu et al. 2024, "LD-DPO: Length Desensitization
    in Direct Preference Optimization", eq. 9): each response's token log-probs summed over
    its first ``l_s = min(|y_c|, |y_r|)`` response tokens, plus ``alpha`` times the sum over
    the rest, ``alpha`` in ``[0, 1]`` (1: plain sums, DPO; 0: the tail is dropped).

    Token log-probs and masks ``[B, T]`` (mask 1 on response tokens; a row may be empty);
    the ``k``-th response token is the ``k``-th position where the mask is 1, as TRL counts.
    Returns the chosen and rejected ``[B]`` float32; apply it to the reference's log-probs
    too. Gradients flow into the token log-probs.
    """
    check_interval("alpha", alpha, 0.0, 1.0, low_open=False, high_open=False)
    check_rank(chosen_token_logps=(chosen_token_logps, 2), rejected_token_logps=(rejected_token_logps, 2))
    check_same_shape(chosen_token_logps=chosen_token_logps, chosen_mask=chosen_mask)
    check_same_shape(rejected_token_logps=rejected_token_logps, rejected_mask=rejected_mask)
    mask_c, mask_r = f32(chosen_mask) > 0, f32(rejected_mask) > 0
    shared = jnp.minimum(jnp.sum(mask_c, axis=-1), jnp.sum(mask_r, axis=-1))[:, None]
    alpha = f32(alpha)

    def weighted(logps, mask):
        position = jnp.cumsum(mask, axis=-1)  # 1 at the first response token
        factor = jnp.where(position <= shared, 1.0, alpha)
        return jnp.sum(jnp.where(mask, factor * f32(logps), 0.0), axis=-1)

    return weighted(chosen_token_logps, mask_c), weighted(rejected_token_logps, mask_r)


def wpo_aligned_logps(logits: Array, targets: Array, mask: Array) -> Array:
    """``a = sum_t mask_t [log p(y_t) - log sum_v p(v)^2]`` of each row, no gradient (WPO's
    aligned log-probs, :func:`wpo_weights`); ``log sum_v p_v^2 = logsumexp(2 z) - 2 logsumexp(z)``.

    ``logits [B, T, V]`` scoring ``targets [B, T]`` (shifted already), ``mask [B, T]``.
    Returns ``[B]`` float32. The per-token terms are :func:`wpo_token_terms` (which a trainer
    computes a chunk of positions at a time, never holding the ``[B, T, V]`` logits).
    """
    check_rank(logits=(logits, 3), targets=(targets, 2))
    return jnp.sum(jnp.where(f32(mask) > 0, wpo_token_terms(logits, targets), 0.0), axis=-1)


def wpo_token_terms(logits: Array, targets: Array) -> Array:
    """``log p(y_t) - log sum_v p(v)^2`` at each position, float32 ``[...]``, no gradient:
    :func:`wpo_aligned_logps`'s terms before the masked sum (``logits [..., V]``, ``targets [...]``)."""
    z = jax.lax.stop_gradient(f32(logits))
    lse = jax.nn.logsumexp(z, axis=-1)
    log_sq_norm = jax.nn.logsumexp(2.0 * z, axis=-1) - 2.0 * lse
    logp = jnp.take_along_axis(z, jnp.asarray(targets)[..., None].astype(jnp.int32), axis=-1)[..., 0] - lse
    return logp - log_sq_norm


def simpo_loss(
    policy_chosen_logps: Array,
    policy_rejected_logps: Array,
    chosen_lengths: Array,
    rejected_lengths: Array,
    *,
    beta: float | Array = 2.0,
    gamma: float | Array = 0.5,
    label_smoothing: float | Array = 0.0,
    weights: Array | None = None,
    num_pairs: Array | float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """SimPO: reference-free, length-normalised preference loss with a target margin.

    ``l = -(1-eps) log s(z) - eps log s(-z)``, ``z = b/|y_c| log pi(y_c) - b/|y_r| log pi(y_r) - gamma``
    (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free
    Reward", eq. 6; ``eps = label_smoothing`` as in TRL's CPO trainer, 0 in the paper).

    ``gamma`` is the paper's target reward margin ``gamma`` (in reward units, the same as
    TRL's ``simpo_gamma``, which TRL divides by ``beta`` internally), not the
    ``gamma_beta_ratio`` of the SimPO repository: that ratio ``r`` corresponds to
    ``gamma = r * beta``.

    Shapes: log-probs and lengths ``[B]`` (lengths = response token counts, clamped to
    >= 1). Loss ``sum_i w_i l_i / N`` (module docstring). Metrics: ``rewards/chosen``
    ``b log pi(y_c)/|y_c|``, ``rewards/rejected``, ``rewards/accuracies``,
    ``rewards/margins``, ``logps/chosen`` and ``logps/rejected`` (length-averaged).
    """
    check_vectors(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        chosen_lengths=chosen_lengths,
        rejected_lengths=rejected_lengths,
        weights=weights,
    )
    check_scalar(num_pairs=num_pairs)
    check_interval("beta", beta, 0.0, math.inf, low_open=True, high_open=True)
    check_interval("label_smoothing", label_smoothing, 0.0, 0.5, low_open=False, high_open=False)
    avg_c = f32(policy_chosen_logps) / jnp.maximum(f32(chosen_lengths), 1.0)
    avg_r = f32(policy_rejected_logps) / jnp.maximum(f32(rejected_lengths), 1.0)
    beta = f32(beta)
    z = beta * (avg_c - avg_r) - f32(gamma)
    per_pair = _smoothed_sigmoid_loss(z, f32(label_smoothing))
    loss = batch_mean(per_pair, weights, num_pairs)
    return loss, _pair_metrics(beta * avg_c, beta * avg_r, avg_c, avg_r, weights)


def _chosen_nll(policy_chosen_logps, chosen_lengths, weights, num_chosen_tokens) -> Array:
    """Token-mean NLL of the chosen responses: ``-sum_i w_i log pi(y_c,i) / sum_i w_i |y_c,i|``."""
    w = jnp.ones_like(f32(policy_chosen_logps)) if weights is None else jax.lax.stop_gradient(f32(weights))
    tokens = jnp.sum(w * f32(chosen_lengths)) if num_chosen_tokens is None else f32(num_chosen_tokens)
    total = ops.masked_sum(-w * f32(policy_chosen_logps), w)
    return total / jnp.where(tokens > 0, tokens, 1.0)


def cpo_loss(
    policy_chosen_logps: Array,
    policy_rejected_logps: Array,
    chosen_lengths: Array,
    *,
    beta: float | Array = 0.1,
    alpha: float | Array = 1.0,
    label_smoothing: float | Array = 0.0,
    weights: Array | None = None,
    num_pairs: Array | float | None = None,
    num_chosen_tokens: Array | float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Contrastive Preference Optimisation: reference-free DPO term plus chosen NLL.

    ``L = mean_i [-(1-eps) log s(z_i) - eps log s(-z_i)] + alpha * NLL``,
    ``z_i = b (log pi(y_c,i) - log pi(y_r,i))`` on summed log-probs (Xu et al. 2024,
    "Contrastive Preference Optimization: Pushing the Boundaries of LLM Performance in
    Machine Translation"; ``alpha`` as TRL's ``cpo_alpha``, 1 in the paper).

    NLL normalisation (TRL's): the token-mean over all chosen response tokens of the
    batch, ``NLL = -sum_i w_i log pi(y_c,i) / sum_i w_i |y_c,i|``; for shards pass the full
    batch's ``num_chosen_tokens`` (= ``sum_i w_i |y_c,i|``) together with ``num_pairs``.

    Shapes ``[B]``. Metrics: ``rewards/chosen`` ``b log pi(y_c)``, ``rewards/rejected``,
    ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``, ``logps/rejected``,
    ``nll_loss``.
    """
    check_vectors(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        chosen_lengths=chosen_lengths,
        weights=weights,
    )
    check_scalar(num_pairs=num_pairs, num_chosen_tokens=num_chosen_tokens)
    check_interval("beta", beta, 0.0, math.inf, low_open=True, high_open=True)
    check_interval("label_smoothing", label_smoothing, 0.0, 0.5, low_open=False, high_open=False)
    pol_c, pol_r = f32(policy_chosen_logps), f32(policy_rejected_logps)
    beta = f32(beta)
    per_pair = _smoothed_sigmoid_loss(beta * (pol_c - pol_r), f32(label_smoothing))
    nll = _chosen_nll(pol_c, chosen_lengths, weights, num_chosen_tokens)
    loss = batch_mean(per_pair, weights, num_pairs) + f32(alpha) * nll
    metrics = _pair_metrics(beta * pol_c, beta * pol_r, pol_c, pol_r, weights)
    metrics["nll_loss"] = jax.lax.stop_gradient(_chosen_nll(pol_c, chosen_lengths, weights, None))
    return loss, metrics


def log1mexp(x: Array) -> Array:
    """``log(1 - exp(x))`` for ``x < 0``, accurate everywhere (Maechler 2012).

    ``log(-expm1(x))`` near 0, ``log1p(-exp(x))`` below ``-log 2``. Each branch sees only
    inputs where it is finite, so the unused branch cannot put a NaN in the gradient.
    ``x = 0`` gives ``-inf``; callers clamp below 0 first.
    """
    x = f32(x)
    near_zero = x > -math.log(2.0)
    safe_near = jnp.where(near_zero, x, -math.log(2.0))
    safe_far = jnp.where(near_zero, -math.log(2.0), x)
    return jnp.where(near_zero, jnp.log(-jnp.expm1(safe_near)), jnp.log1p(-jnp.exp(safe_far)))


def orpo_loss(
    policy_chosen_logps: Array,
    policy_rejected_logps: Array,
    chosen_lengths: Array,
    rejected_lengths: Array,
    *,
    beta: float | Array = 0.1,
    weights: Array | None = None,
    num_pairs: Array | float | None = None,
    num_chosen_tokens: Array | float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Odds-Ratio Preference Optimisation: chosen NLL plus an odds-ratio penalty.

    ``L = NLL + beta * mean_i -log s(log odds(y_c,i) - log odds(y_r,i))`` (Hong et al.
    2024, "ORPO: Monolithic Preference Optimization without Reference Model", eq. 6-7;
    ``beta`` is the paper's ``lambda``, named as TRL's ``ORPOConfig.beta``).
    ``log odds(y) = log p - log(1 - p)`` with ``log p = log pi(y)/|y|`` the length-averaged
    log-prob; ``log(1 - p)`` is :func:`log1mexp`, and ``log p`` is clamped to at most
    ``-1e-6`` (below float32 resolution of a log-softmax) so neither the loss nor its
    gradient is ever inf/NaN, even for responses the model is certain of.

    NLL normalisation as in TRL: token-mean over the chosen response tokens of the
    batch, ``-sum_i w_i log pi(y_c,i) / sum_i w_i |y_c,i|`` (``num_chosen_tokens`` for
    shards).

    Shapes ``[B]``. Metrics (TRL names): ``rewards/chosen`` ``beta log p_c``,
    ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``, ``logps/chosen``
    and ``logps/rejected`` (length-averaged), ``nll_loss``, ``log_odds_ratio``
    (mean ``log s(.)``), ``log_odds_chosen`` (mean log odds difference).
    """
    check_vectors(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        chosen_lengths=chosen_lengths,
        rejected_lengths=rejected_lengths,
        weights=weights,
    )
    check_scalar(num_pairs=num_pairs, num_chosen_tokens=num_chosen_tokens)
    check_interval("beta", beta, 0.0, math.inf, low_open=False, high_open=True)
    pol_c = f32(policy_chosen_logps)
    avg_c = pol_c / jnp.maximum(f32(chosen_lengths), 1.0)
    avg_r = f32(policy_rejected_logps) / jnp.maximum(f32(rejected_lengths), 1.0)
    avg_c_safe = jnp.minimum(avg_c, _ORPO_LOGP_CEILING)
    avg_r_safe = jnp.minimum(avg_r, _ORPO_LOGP_CEILING)
    log_odds = (avg_c_safe - log1mexp(avg_c_safe)) - (avg_r_safe - log1mexp(avg_r_safe))
    log_sig = jax.nn.log_sigmoid(log_odds)
    beta = f32(beta)
    nll = _chosen_nll(pol_c, chosen_lengths, weights, num_chosen_tokens)
    loss = nll + beta * batch_mean(-log_sig, weights, num_pairs)
    metrics = _pair_metrics(beta * avg_c, beta * avg_r, avg_c, avg_r, weights)
    metrics.update(weighted_means({"log_odds_ratio": log_sig, "log_odds_chosen": log_odds}, weights))
    metrics["nll_loss"] = jax.lax.stop_gradient(_chosen_nll(pol_c, chosen_lengths, weights, None))
    return loss, metrics


def kto_reference_point(kl_policy_logps: Array, kl_ref_logps: Array, *, weights: Array | None = None) -> Array:
    """KTO's reference point ``z_ref = max(0, mean_j [log pi(y'_j|x_j) - log pi_ref(y'_j|x_j)])``.

    ``y'_j`` are completions paired with a *mismatched* prompt ``x_j`` (Ethayarajh et al.
    2024: shift the completions of the micro-batch by one), so the mean is a
    biased but low-variance estimate of ``KL(pi || pi_ref)``. Inputs ``[B']``; returns a
    stop-gradiented float32 scalar for ``kto_loss(kl_ref_point=...)``. Under data
    parallelism, average across shards before passing it (TRL gathers it globally).
    """
    check_vectors(kl_policy_logps=kl_policy_logps, kl_ref_logps=kl_ref_logps, weights=weights)
    kl = batch_mean(f32(kl_policy_logps) - f32(kl_ref_logps), weights)
    return jax.lax.stop_gradient(jnp.maximum(kl, 0.0))


def kto_loss(
    policy_logps: Array,
    ref_logps: Array,
    labels: Array,
    *,
    beta: float | Array = 0.1,
    desirable_weight: float | Array = 1.0,
    undesirable_weight: float | Array = 1.0,
    kl_ref_point: Array | float | None = None,
    weights: Array | None = None,
    num_examples: Array | float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Kahneman-Tversky Optimisation on unpaired desirable / undesirable examples.

    With ``r = log pi(y|x) - log pi_ref(y|x)`` and reference point ``z``:
    ``l = lambda_D (1 - s(b (r - z)))`` for desirable ``y`` and
    ``l = lambda_U (1 - s(b (z - r)))`` for undesirable ``y`` (Ethayarajh et al. 2024,
    "KTO: Model Alignment as Prospect Theoretic Optimization": the per-example
    ``lambda_y - v(x, y)``; as TRL). The paper suggests
    ``lambda_D n_D / (lambda_U n_U)`` in ``[1, 4/3]``.

    Reference point ``z``: a detached estimate of ``KL(pi || pi_ref)``, clamped >= 0, so
    no gradient reaches it. Either pass ``kl_ref_point`` (e.g. from
    :func:`kto_reference_point` on mismatched prompt/completion pairs, the paper's
    estimator, averaged over all devices), or leave it ``None`` to estimate it from this
    batch as ``max(0, mean_i r_i)`` over its own (matched) examples, a cheaper estimator
    that costs no extra forward pass. Pass ``0.0`` for no reference point. For exact
    shard sums, pass one global ``kl_ref_point`` and ``num_examples``.

    Args:
      policy_logps, ref_logps: ``[B]`` summed response log-probs.
      labels: ``[B]`` 1 (or True) desirable, 0 undesirable.
      weights, num_examples: per-example weights and global normaliser; the loss is
        ``sum_i w_i l_i / N``, ``N`` defaulting to ``sum_i w_i`` (TRL's mean over the batch).

    Metrics: ``rewards/chosen`` and ``rewards/rejected`` (mean ``b r`` over desirable /
    undesirable examples, 0 if none), ``logps/chosen``, ``logps/rejected``, ``kl`` (``z``).
    """
    check_vectors(policy_logps=policy_logps, ref_logps=ref_logps, labels=labels, weights=weights)
    check_scalar(kl_ref_point=kl_ref_point, num_examples=num_examples)
    check_interval("beta", beta, 0.0, math.inf, low_open=True, high_open=True)
    logratio = f32(policy_logps) - jax.lax.stop_gradient(f32(ref_logps))
    if kl_ref_point is None:
        kl_ref_point = batch_mean(logratio, weights)
    z = jax.lax.stop_gradient(jnp.maximum(f32(kl_ref_point), 0.0))
    beta = f32(beta)
    desirable = jnp.asarray(labels).astype(bool)
    per_example = jnp.where(
        desirable,
        f32(desirable_weight) * (1.0 - jax.nn.sigmoid(beta * (logratio - z))),
        f32(undesirable_weight) * (1.0 - jax.nn.sigmoid(beta * (z - logratio))),
    )
    loss = batch_mean(per_example, weights, num_examples)
    w = jnp.ones_like(logratio) if weights is None else f32(weights)
    w_chosen = w * f32(desirable)
    w_rejected = w * f32(~desirable)
    rewards = beta * logratio
    logps = f32(policy_logps)
    metrics = {
        "rewards/chosen": batch_mean(rewards, w_chosen),
        "rewards/rejected": batch_mean(rewards, w_rejected),
        "logps/chosen": batch_mean(logps, w_chosen),
        "logps/rejected": batch_mean(logps, w_rejected),
        "kl": z,
    }
    return loss, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
