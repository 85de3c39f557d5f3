"""Offline preference losses: the DPO family, SimPO, CPO, ORPO and KTO.

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
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from alignax import ops
from alignax._checks import check_choice, check_interval, is_concrete_number
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
    """A batch of pairs as a DPO variant reads it, each ``[B]`` float32 (length-averaged when
    asked): ``chosen`` / ``rejected`` the policy-minus-reference log-ratios ``r_c``, ``r_r``;
    ``policy_chosen`` / ``ref_chosen`` the two log-probs of the chosen response (DPOP)."""

    chosen: Array
    rejected: Array
    policy_chosen: Array
    ref_chosen: Array


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


@dataclasses.dataclass(frozen=True)
class DPOVariant:
    """A DPO variant: ``per_pair(r: LogRatios, beta, eps, dpop_lambda) -> [B]`` (formulas in
    :func:`dpo_loss`), the interval ``(low, high, high_open)`` of the ``label_smoothing`` it
    takes (closed below; ``None``: it takes none, eps must be 0), and whether it averages
    log-probs over response tokens by default (IPO)."""

    per_pair: Callable[..., Array]
    smoothing: tuple[float, float, bool] | None = None
    length_normalize: bool = False


# Adding a variant: its per-pair function above and one entry here (the config's
# ``preference.variant`` accepts every name of this table).
DPO_VARIANT_TABLE: dict[str, DPOVariant] = {
    "sigmoid": DPOVariant(_sigmoid, smoothing=(0.0, 0.5, False)),
    "hinge": DPOVariant(_hinge),
    "ipo": DPOVariant(_ipo, length_normalize=True),
    "robust": DPOVariant(_robust, smoothing=(0.0, 0.5, True)),
    "dpop": DPOVariant(_dpop),
    "exo_pair": DPOVariant(_exo_pair, smoothing=(0.0, 1.0, True)),
    "nca_pair": DPOVariant(_nca_pair),
    "sppo_hard": DPOVariant(_sppo_hard),
    "apo_zero": DPOVariant(_apo_zero),
    "apo_down": DPOVariant(_apo_down),
}
DPO_VARIANTS = tuple(DPO_VARIANT_TABLE)
SMOOTHED_VARIANTS = tuple(name for name, v in DPO_VARIANT_TABLE.items() if v.smoothing is not None)


def dpo_loss(
    policy_chosen_logps: Array,
    policy_rejected_logps: Array,
    ref_chosen_logps: Array,
    ref_rejected_logps: Array,
    chosen_lengths: Array | None = None,
    rejected_lengths: Array | None = None,
    *,
    beta: float | Array = 0.1,
    variant: str = "sigmoid",
    label_smoothing: float | Array = 0.0,
    dpop_lambda: float | Array = 50.0,
    length_normalize: bool | None = None,
    weights: Array | None = None,
    num_pairs: Array | float | None = None,
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

    ``s`` is the logistic sigmoid and ``b = beta``. The loss is ``sum_i w_i l_i / N``
    (module docstring). Gradients flow into the policy log-probs; the reference
    log-probs are stop-gradiented here.

    Args:
      policy_chosen_logps, policy_rejected_logps: ``[B]`` summed response log-probs under
        the policy.
      ref_chosen_logps, ref_rejected_logps: ``[B]`` the same under the frozen reference.
      chosen_lengths, rejected_lengths: ``[B]`` response token counts; needed when
        log-probs are length-averaged (``ipo`` by default).
      beta: ``> 0``, the KL-regularisation strength (inverse temperature).
      variant: one of ``DPO_VARIANTS``.
      label_smoothing: ``eps`` of ``sigmoid``, ``robust``, ``exo_pair``; must be 0 for
        the other variants.
      dpop_lambda: DPOP's ``lambda`` (``dpop`` only).
      length_normalize: divide every log-prob by its response length first (``None``:
        ``True`` for ``ipo``, ``False`` otherwise).
      weights: optional ``[B]`` per-pair weights >= 0.
      num_pairs: optional global normaliser ``N`` (see the module docstring).

    Returns ``(loss, metrics)``; metrics (TRL names, local weighted means):
    ``rewards/chosen`` ``b r_c``, ``rewards/rejected`` ``b r_r``, ``rewards/accuracies``
    (fraction with ``r_c > r_r``), ``rewards/margins``, ``logps/chosen``,
    ``logps/rejected`` (the policy log-probs as the loss used them, i.e. averaged when
    length-normalised). A worked value: ``h = 0`` under ``sigmoid`` gives ``log 2``.
    """
    check_choice("variant", variant, tuple(DPO_VARIANT_TABLE))
    check_vectors(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
        chosen_lengths=chosen_lengths,
        rejected_lengths=rejected_lengths,
        weights=weights,
    )
    check_scalar(num_pairs=num_pairs)
    check_interval("beta", beta, 0.0, math.inf, low_open=True, high_open=True)
    spec = DPO_VARIANT_TABLE[variant]
    if spec.smoothing is not None:
        low, high, high_open = spec.smoothing
        check_interval("label_smoothing", label_smoothing, low, high, low_open=False, high_open=high_open)
    elif is_concrete_number(label_smoothing) and label_smoothing != 0:
        raise ValueError(
            f"label_smoothing={label_smoothing} has no meaning for variant {variant!r}; "
            f"it is used by {', '.join(SMOOTHED_VARIANTS)} only (set it to 0)"
        )
    if length_normalize is None:
        length_normalize = spec.length_normalize

    pol_c, pol_r = f32(policy_chosen_logps), f32(policy_rejected_logps)
    ref_c = jax.lax.stop_gradient(f32(ref_chosen_logps))
    ref_r = jax.lax.stop_gradient(f32(ref_rejected_logps))
    if length_normalize:
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError(
                f"variant {variant!r} with length_normalize=True averages log-probs over response "
                "tokens (as TRL does for ipo); pass chosen_lengths and rejected_lengths [B], or set "
                "length_normalize=False for summed log-probs"
            )
        len_c = jnp.maximum(f32(chosen_lengths), 1.0)
        len_r = jnp.maximum(f32(rejected_lengths), 1.0)
        pol_c, ref_c = pol_c / len_c, ref_c / len_c
        pol_r, ref_r = pol_r / len_r, ref_r / len_r

    beta = f32(beta)
    chosen_logratio = pol_c - ref_c
    rejected_logratio = pol_r - ref_r
    ratios = LogRatios(chosen_logratio, rejected_logratio, pol_c, ref_c)
    per_pair = spec.per_pair(ratios, beta, f32(label_smoothing), f32(dpop_lambda))

    loss = batch_mean(per_pair, weights, num_pairs)
    metrics = _pair_metrics(beta * chosen_logratio, beta * rejected_logratio, pol_c, pol_r, weights)
    return loss, metrics


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
