"""Policy-gradient losses for online RL: PPO-clip, GSPO, CISPO, SAPO and plain REINFORCE.

Every loss takes per-token data positionally and hyper-parameters keyword-only:

- ``logps``      ``[B, T]`` log pi_theta(a_t | s_t) of the sampled tokens under the policy
  being trained (differentiable);
- ``old_logps``  ``[B, T]`` the same under the behaviour policy pi_old that the advantages
  were computed for (constant; the trainer's own forward pass before the update);
- ``advantages`` ``[B, T]``, or ``[B]`` broadcast over ``T`` (outcome rewards, GRPO);
- ``mask``       ``[B, T]``, 1 on response tokens, 0 on prompt and padding.

and returns ``(loss, metrics)``: a float32 scalar and a flat dict of stop-gradiented
float32 scalars, so ``jax.value_and_grad(loss_fn, has_aux=True)`` works directly.

Options shared by every loss (one private driver, :func:`_policy_loss`, applies them):

- ``aggregation``, ``num_tokens``, ``num_seqs``, ``norm_length``: how the per-token loss
  becomes a scalar (:func:`alignax.ops.aggregate`). With the full batch's normalisers
  (:func:`alignax.ops.aggregation_normalisers`) the losses of micro-batches sum to the
  full-batch loss for every mode. The entropy and KL terms are aggregated the same way.
- ``sampler_logps`` ``[B, T]`` with ``tis_cap``: truncated importance sampling for the
  mismatch between the inference engine that sampled the tokens and the trainer that
  computed ``old_logps`` (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
  You Off-Policy RL Training"): each token's policy loss is multiplied by
  ``w_t = sg(min(exp(old_logps - sampler_logps), tis_cap))``.
- ``tis_level`` (``token`` | ``sequence``), ``tis_ratio``, ``rejection`` /
  ``rejection_bounds`` and ``rejection_divergences`` (with ``sampler_logps``): verl's rollout correction
  (:func:`sampler_correction`). ``tis_ratio="old"`` weighs by ``pi_old / pi_sampler`` (the
  decoupled mode above); ``"current"`` by ``sg(pi_theta) / pi_sampler``, verl's bypass mode
  for objectives without a ratio of their own (``old_logps`` are then the sampler's:
  REINFORCE with explicit IS weights). ``tis_cap=None`` applies no weight (rejection alone).
  A rejected token loses its policy term; entropy and KL keep every token.
  ``tis_lower`` (with ``tis_cap``): IcePop's weight, ``rho`` inside ``[tis_lower, tis_cap]`` and 0
  outside, in place of the truncation (verl's ``rollout_is_threshold: "lower_upper"``).
  ``tis_batch_normalize`` (with ``tis_cap``): the weights divided by their mean over the arrays
  given (with micro-batches, each micro-batch's), verl's ``rollout_is_batch_normalize``.
- ``entropy`` ``[B, T]`` with ``entropy_coef``: ``loss -= entropy_coef * agg(entropy)``.
- ``top_entropy_quantile`` ``rho`` (with ``entropy``): only the tokens whose entropy is in
  the top ``rho`` fraction of the batch's response tokens keep their policy term (Wang et
  al. 2025, "Beyond the 80/20 Rule"; TRL's ``top_entropy_quantile``;
  :func:`high_entropy_mask`). ``1`` keeps every token.
- ``off_policy_mask_threshold`` ``delta``: off-policy sequence masking (DeepSeek-AI 2025,
  "DeepSeek-V3.2", eq. 9; TRL's ``off_policy_mask_threshold``): the policy term of a token
  with a negative advantage is dropped when its sequence has drifted, on average per token,
  more than ``delta`` nats from ``old_logps`` (:func:`off_policy_sequence_mask`). The
  entropy and KL terms keep every token. ``delta = 0`` is allowed here but refused in a
  config: on-policy, ``old_logps`` from a separate pricing pass equal ``logps`` only to
  float32 rounding, so 0 would mask on that rounding.
- ``ref_logps`` ``[B, T]`` with ``kl_coef`` and ``kl_kind``: ``loss += kl_coef *
  agg(KL_t)`` with ``KL_t = kl_estimate(logps, sg(ref_logps), kind=kl_kind)`` — the GRPO
  placement of the KL term (Shao et al. 2024); ``k3`` by default. ``kl_importance_weight``
  (``none`` by default) multiplies ``KL_t`` by the token's ``pi_theta / pi_old``, which
  makes the estimate unbiased when the tokens came from an older policy (several epochs,
  the sampler's log-probs as ``old_logps``): ``ratio`` differentiates the weight (TRL's
  ``use_bias_correction_kl``, DeepSeek-V3.2), ``detached_ratio`` does not
  (:func:`alignax.kl.importance_weighted_kl` says what each gradient estimates).

So for every loss: ``loss = agg(w_t * l_t) - entropy_coef * agg(H_t) + kl_coef * agg(KL_t)``
where ``l_t`` is the per-token policy loss of the variant.

Masked tokens: every per-token input is replaced by a neutral value (log-ratio 0,
advantage 0, ...) with ``where`` before any nonlinearity, so garbage under the mask
(huge or infinite log-probs) cannot reach the loss, and its gradient there is exactly 0.

Metrics (all over masked-in tokens; 0 when the mask is empty):

- ``pg_loss``: ``agg(w_t * l_t)``, the policy term alone.
- ``clipfrac_low`` / ``clipfrac_high``: fraction of tokens whose lower / upper clip is
  active. For the PPO-style objectives (PPO, GSPO) a clip is active only where it cuts the
  gradient, which depends on the sign of the advantage (the DAPO / verl convention):
  low = ``A < 0 and r < 1 - eps_low``, high = ``A > 0 and r > 1 + eps_high``. For CISPO,
  which clips the weight rather than the objective, a clip is active wherever the weight
  is clipped: low = ``r < 1 - eps_low``, high = ``r > 1 + eps_high``. :func:`pg_loss`
  has no clip and reports 0, so every loss has the same keys.
- ``approx_kl``: mean of the k3 estimator of KL(pi_old || pi_theta) from tokens sampled by
  pi_old, ``(r - 1) - log r`` (Schulman 2020, "Approximating KL Divergence"); >= 0 and 0
  exactly on the first step of an update.
- ``ratio_mean`` / ``ratio_min`` / ``ratio_max``: the importance ratio the loss uses
  (``pi_theta / pi_old`` per token; GSPO's sequence ratio ``s_i`` on each of its tokens).
- ``entropy`` (only when ``entropy`` is given): masked mean entropy.
- ``kl`` (only when ``ref_logps`` is given): masked mean of ``KL_t`` to the reference
  (weighted by ``pi_theta / pi_old`` under ``kl_importance_weight``).
- ``tis_weight_mean`` (only when ``sampler_logps`` is given with a ``tis_cap``): masked mean of ``w_t``.
- ``tis_out_of_bounds`` (only with ``tis_lower``): the fraction of tokens whose IcePop weight is 0
  (verl's ``rollout_is_oob_ratio``).
- ``tis_batch_norm_factor`` (only with ``tis_batch_normalize``): the mean the weights were divided by.
- ``rejected`` (only with ``rejection`` or ``rejection_divergences``): the fraction of tokens
  the rejection masks dropped, all criteria together; ``rejected_<criterion>`` (one per
  criterion of ``rejection`` and per entry of ``rejection_divergences``, e.g.
  ``rejected_geometric``, ``rejected_seq_max_k2``): the fraction that criterion drops.
- ``entropy_masked`` (only with ``top_entropy_quantile``): the fraction of tokens whose
  policy term the entropy mask dropped.
- ``off_policy_masked`` (only with ``off_policy_mask_threshold``): the fraction of tokens
  whose policy term the sequence mask dropped.
- ``dual_clipfrac`` (PPO only, only when ``dual_clip_c`` is set): fraction of tokens where
  the dual-clip bound is active, ``A < 0 and r > c``.

The log-ratio ``log pi_theta - log pi_old`` is clipped to ``[-20, 20]`` before ``exp`` (as
in verl), so one far-drifted token cannot overflow float32.

:data:`POLICY_LOSSES` maps a config name (``ppo``, ``gspo``, ``cispo``, ``sapo``, ``pg``) to its loss,
and :func:`policy_loss_clip_keywords` says which clip keywords each one takes. These are the
losses defined in this module; the trainer reads the registry of every objective,
:data:`alignax.losses.objectives.OBJECTIVES`, which holds these five under the same names and
the objectives of its own modules (whose surrogates run through :func:`_policy_loss` too).
"""

from __future__ import annotations

import inspect
import math
import types
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp

from alignax import kl as kl_lib
from alignax import ops
from alignax._checks import check_choice, check_interval, check_rank, check_same_shape, is_concrete_number

Array = jax.Array
Scalar = Array | float

LOG_RATIO_CLAMP = 20.0


class _Tokens(NamedTuple):
    """Validated float32 inputs, neutralised on masked-out tokens."""

    logps: Array  # [B, T], differentiable, 0 where mask is 0
    log_ratio: Array  # [B, T], logps - old_logps clipped to +-LOG_RATIO_CLAMP, 0 off-mask
    advantages: Array  # [B, T], 0 off-mask
    mask: Array  # [B, T] bool
    # [B] log of the sampler correction each row carries (0 without sampler_logps): the sum of
    # the token weights' logs, or the sequence weight's log; VESPO folds it into its ratio
    seq_correction: Array | None = None
    old_logps: Array | None = None  # [B, T] constant, 0 off-mask (unclipped, for variants that read pi_old itself)


class _Surrogate(NamedTuple):
    """What a variant contributes: per-token loss, ratio and clip indicators."""

    per_token: Array  # [B, T] l_t
    ratio: Array  # [B, T] the ratio reported in the metrics
    clipped_low: Array  # [B, T] bool
    clipped_high: Array  # [B, T] bool
    indicators: dict[str, Array]  # extra bool [B, T] whose masked means become metrics
    # the variant folds the sampler correction into its own weight (VESPO): the driver does not
    # multiply the per-token loss by it again
    absorbs_correction: bool = False


def _f32(x) -> Array:
    return jnp.asarray(x, jnp.float32)


def _check_nonnegative(**named) -> None:
    for name, value in named.items():
        if value is not None and is_concrete_number(value) and value < 0:
            raise ValueError(f"{name} must be >= 0; got {value}")


def _masked_min_max(x: Array, mask: Array) -> tuple[Array, Array]:
    """Min and max over masked-in entries; 0 and 0 when the mask is empty."""
    any_in = jnp.any(mask)
    lo = jnp.min(jnp.where(mask, x, jnp.inf))
    hi = jnp.max(jnp.where(mask, x, -jnp.inf))
    return jnp.where(any_in, lo, 0.0), jnp.where(any_in, hi, 0.0)


def _ppo_clip(
    ratio: Array, advantages: Array, *, clip_eps_low: Scalar, clip_eps_high: Scalar
) -> tuple[Array, Array, Array]:
    """Per-token ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))`` and clip indicators."""
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    per_token = jnp.maximum(unclipped, clipped)
    clipped_low = (advantages < 0) & (ratio < 1.0 - clip_eps_low)
    clipped_high = (advantages > 0) & (ratio > 1.0 + clip_eps_high)
    return per_token, clipped_low, clipped_high


def off_policy_sequence_mask(logps: Array, old_logps: Array, advantages: Array, mask: Array, *,
                             threshold: Scalar) -> Array:
    """Off-policy sequence masking (DeepSeek-V3.2, eq. 9): which tokens keep their policy term.

        D_i    = (1 / |y_i|) sum_{t in y_i} (old_logps_it - logps_it)   (k1 KL(pi_old || pi_theta) per token)
        keep_it = 1 if A_it >= 0 or D_i <= threshold, else 0

    A sequence that the current policy has moved away from (``D_i > threshold`` nats per token)
    no longer pushes its negative-advantage tokens down: the paper finds those updates the
    ones that destabilise training once samples are off-policy.

    Args:
      logps, old_logps: ``[B, T]`` log pi_theta (no gradient is taken through the mask) and
        log pi_old of the sampled tokens.
      advantages: ``[B, T]``; mask: ``[B, T]``, response tokens where ``> 0``.
      threshold: ``delta`` >= 0 (TRL's example: 0.5).

    Returns ``[B, T]`` float32, 1 to keep and 0 to drop; a row with no response token has
    ``D_i = 0``, and positions off the mask are 1 (the caller's mask drops them anyway).
    """
    check_rank(logps=(logps, 2))  # the row means are over the last axis of [B, T]
    check_same_shape(logps=logps, old_logps=old_logps, advantages=advantages, mask=mask)
    keep = jnp.asarray(mask) > 0
    drift = jnp.where(keep, _f32(old_logps) - jax.lax.stop_gradient(_f32(logps)), 0.0)
    per_seq = jnp.sum(drift, axis=-1) / jnp.maximum(jnp.sum(keep, axis=-1), 1)  # [B]
    kept = (jnp.asarray(advantages) >= 0) | (per_seq <= threshold)[:, None]
    return jnp.where(keep, kept, True).astype(jnp.float32)


def high_entropy_mask(entropy: Array, mask: Array, *, quantile: Scalar) -> Array:
    """Which tokens are among the ``quantile`` fraction of highest entropy ("Beyond the 80/20
    Rule", Wang et al. 2025: the forking tokens carry the learning signal; the paper keeps 0.2).

        tau    = Q_{1 - quantile}({H_it : mask_it > 0})     (linear interpolation, as np.quantile)
        keep_it = 1 if H_it >= tau else 0

    The quantile is over every response token of the arrays given (with micro-batches, of
    each micro-batch, as in TRL). No gradient flows through the mask.

    Args:
      entropy: ``[B, T]`` per-token entropy (nats); mask: ``[B, T]``, counted where ``> 0``.
      quantile: ``rho`` in ``(0, 1]``; 1 keeps every token.

    Returns ``[B, T]`` float32, 1 to keep; all ones when the mask is empty.
    """
    check_same_shape(entropy=entropy, mask=mask)
    if is_concrete_number(quantile) and not 0.0 < quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in (0, 1]; got {quantile}")
    keep = jnp.asarray(mask) > 0
    entropy = jax.lax.stop_gradient(_f32(entropy))
    tau = jnp.nanquantile(jnp.where(keep, entropy, jnp.nan), 1.0 - quantile)
    return jnp.where(jnp.any(keep), entropy >= tau, True).astype(jnp.float32)


TIS_LEVELS = ("token", "sequence")
TIS_RATIOS = ("old", "current")
REJECTIONS = ("token", "sequence", "geometric")
# verl's rollout_rs divergence criteria, ``<level>_<estimator>``: each bounds a divergence from above
REJECTION_DIVERGENCES = tuple(f"{level}_{k}" for level in ("token", "seq_sum", "seq_mean", "seq_max")
                              for k in ("k2", "k3"))


class SamplerCorrection(NamedTuple):
    """What :func:`sampler_correction` returns (all stop-gradiented float32)."""

    weight: Array  # [B, T] the truncated IS weight on each token's policy term (1 without a cap)
    keep: Array  # [B, T] 1 where every rejection criterion keeps the token, else 0
    seq_log_weight: Array  # [B] log of the weight each row carries (token level: the sum of the logs)
    # [B, T] 1 where the criterion of that name keeps the token (each of rejection and of rejection_divergences);
    # a plain dict, so that the tuple stays a pytree (jit can return it)
    kept_by: dict[str, Array]
    # the weights' mean the weights were divided by (batch_normalize), else 1
    norm_factor: Array | float = 1.0


def check_rejection_divergences(divergences: Mapping[str, Scalar] | None, *, key: str = "rejection_divergences"
                                ) -> dict[str, Scalar]:
    """The ``{criterion: upper bound}`` mapping as a dict, checked: every name one of
    :data:`REJECTION_DIVERGENCES` (an unknown one is an error listing them) and every
    concrete bound a number > 0 (a divergence is >= 0, so a bound of 0 rejects nearly
    everything). ``key`` names the option in the errors (the trainer passes its config key).
    ``None`` is no criterion."""
    if divergences is None:
        return {}
    if not isinstance(divergences, Mapping):
        raise TypeError(f"{key} must map criterion names to upper bounds, e.g. {{'seq_max_k2': 2.5}}; "
                        f"got {divergences!r}")
    unknown = sorted(set(divergences) - set(REJECTION_DIVERGENCES))
    if unknown:
        raise ValueError(f"{key} has unknown criteria {unknown}; valid: {', '.join(REJECTION_DIVERGENCES)}")
    for name, bound in divergences.items():
        # an array may be traced: its value is not checked
        if not (is_concrete_number(bound) or isinstance(bound, jax.Array)):
            raise TypeError(f"{key}.{name} must be a number (an upper bound on the divergence); got {bound!r}")
        if is_concrete_number(bound) and not bound > 0:  # also refuses NaN
            raise ValueError(f"{key}.{name} must be > 0 (an upper bound on a divergence >= 0); got {bound}")
    return dict(divergences)


def check_rejection(rejection: str | Mapping[str, tuple[Scalar, Scalar]] | None,
                    bounds: tuple[Scalar, Scalar] = (0.5, 2.0), *, key: str = "rejection",
                    bounds_key: str = "rejection_bounds") -> dict[str, tuple[Scalar, Scalar]]:
    """verl's k1 criteria as ``{criterion: (lo, hi)}``, checked. A name (one of
    :data:`REJECTIONS`) is that criterion with ``bounds``; a mapping names each criterion with
    its own ``[lo, hi]`` (verl's chained ``rollout_rs: "token_k1,seq_mean_k1"`` with one
    ``rollout_rs_threshold`` each), ``bounds`` unused. Every concrete pair is ``0 < lo <= hi``
    on the ratio. ``key`` / ``bounds_key`` name the options in the errors. ``None``: none."""
    if rejection is None:
        return {}
    if isinstance(rejection, str):
        check_choice(key, rejection, REJECTIONS)
        criteria, where = {rejection: bounds}, {rejection: bounds_key}
    elif isinstance(rejection, Mapping):
        unknown = sorted(set(rejection) - set(REJECTIONS))
        if unknown:
            raise ValueError(f"{key} has unknown criteria {unknown}; valid: {', '.join(REJECTIONS)}")
        if not rejection:
            raise ValueError(f"{key} maps no criterion; name one ({', '.join(REJECTIONS)}) or set null (no rejection)")
        criteria, where = dict(rejection), {name: f"{key}.{name}" for name in rejection}
    else:
        raise TypeError(f"{key} must be one of {', '.join(REJECTIONS)} or map them to [lo, hi] bounds, e.g. "
                        f"{{'token': [0.5, 2.0], 'geometric': [0.9, 1.1]}}; got {rejection!r}")
    for name, pair in criteria.items():
        if isinstance(pair, (str, bytes)) or not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise TypeError(f"{where[name]} must be [lo, hi], bounds on the ratio pi / pi_sampler; got {pair!r}")
        lo, hi = pair
        if not all(is_concrete_number(b) or isinstance(b, jax.Array) for b in pair):  # an array may be traced
            raise TypeError(f"{where[name]} must be [lo, hi], two numbers bounding the ratio pi / pi_sampler; "
                            f"got {pair!r}")
        if is_concrete_number(lo) and is_concrete_number(hi) and not 0 < lo <= hi:  # also refuses NaN
            raise ValueError(f"{where[name]} must be 0 < lo <= hi on the ratio pi / pi_sampler; got {tuple(pair)}")
    return {name: tuple(pair) for name, pair in criteria.items()}


def _divergence_keep(log_rho: Array, mask: Array, name: str, bound: Scalar) -> Array:
    """``[B, T]`` bool: where the criterion ``name`` (``token|seq_sum|seq_mean|seq_max`` x
    ``k2|k3``) keeps the token, its divergence ``<= bound``. ``log_rho`` is 0 off the mask."""
    level, estimator = name.rsplit("_", 1)
    if estimator == "k2":
        per_token = 0.5 * jnp.square(log_rho)
    else:  # k3 = rho - 1 - log rho; expm1 keeps its small values exact
        per_token = jnp.expm1(log_rho) - log_rho
    per_token = jnp.where(mask, per_token, 0.0)  # both are >= 0: a max over a row ignores the zeros off it
    stat = {
        "token": lambda: per_token,
        "seq_sum": lambda: jnp.sum(per_token, axis=-1, keepdims=True),
        "seq_mean": lambda: jnp.sum(per_token, axis=-1, keepdims=True)
        / jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1),
        "seq_max": lambda: jnp.max(per_token, axis=-1, keepdims=True),
    }[level]()
    return jnp.broadcast_to(stat <= bound, log_rho.shape)


def sampler_correction(log_rho: Array, mask: Array, *, tis_cap: Scalar | None = 2.0, tis_level: str = "token",
                       rejection: str | Mapping[str, tuple[Scalar, Scalar]] | None = None,
                       rejection_bounds: tuple[Scalar, Scalar] = (0.5, 2.0),
                       rejection_divergences: Mapping[str, Scalar] | None = None, tis_lower: Scalar | None = None,
                       batch_normalize: bool = False) -> SamplerCorrection:
    """Importance weights and rejection masks for the sampler/trainer mismatch (verl's rollout
    correction, ``verl/trainer/ppo/rollout_corr_helper.py``; Yao et al. 2025 for TIS).

    With ``log_rho [B, T]`` the per-token ``log(pi_target / pi_sampler)`` (clipped to +-20):

    - ``tis_level="token"``: ``w_t = min(rho_t, tis_cap)`` (truncated IS, biased, low variance);
      ``"sequence"``: ``w_t = min(prod_t rho_t, tis_cap)`` on every token of the row (unbiased,
      high variance). ``tis_cap=None``: ``w_t = 1`` (rejection alone).
    - ``tis_lower`` (with ``tis_cap``): IcePop's weight instead of the truncated one, verl's
      ``rollout_is_threshold: "lower_upper"``: ``w_t = rho`` (the token's or the row's, as
      ``tis_level`` says) where ``tis_lower <= rho <= tis_cap``, else 0. Unlike ``rejection`` it
      is a weight, not a mask: it counts in ``batch_normalize``'s mean as a 0, and a row's
      log-weight (VESPO's) is ``log 1e-30`` per zeroed weight rather than ``-inf``.
    - ``rejection`` with ``rejection_bounds = (lo, hi)`` on the ratio (verl's ``rollout_rs`` k1
      options ``token_k1``, ``seq_sum_k1``, ``seq_mean_k1``): ``token`` keeps a token when
      ``lo <= rho_t <= hi``; ``sequence`` keeps a row when ``lo <= prod_t rho_t <= hi``;
      ``geometric`` when ``lo <= exp(mean_t log rho_t) <= hi`` (the per-token geometric mean,
      which does not grow with length). A mapping ``{criterion: (lo, hi)}`` chains several,
      each with its own bounds (``rejection_bounds`` unused), e.g. ``{"token": (0.5, 2.0),
      "geometric": (0.9, 1.1)}`` (verl's ``"token_k1,seq_mean_k1"``). ``None``: keep everything.
    - ``rejection_divergences``, ``{criterion: bound}``: verl's ``rollout_rs`` divergence
      criteria, each an upper bound on a divergence of the sampler from the target, per token
      ``k2_t = (log rho_t)^2 / 2`` or ``k3_t = rho_t - 1 - log rho_t`` (both >= 0 and 0 at
      ``rho_t = 1``; ``E_sampler[k3] = KL(pi_sampler || pi_target)``, Schulman 2020): ``token_kN``
      keeps a token when ``kN_t <= bound``; ``seq_sum_kN``, ``seq_mean_kN``, ``seq_max_kN`` keep
      a row when the sum, the mean or the max of ``kN_t`` over its response tokens is ``<= bound``.
      ``kept_by`` holds each criterion's mask, the k1 ones' (under their ``rejection`` names) too.
    - ``batch_normalize`` (verl's ``rollout_is_batch_normalize``): the truncated weights are
      divided by their mean, ``w_t / m``, so that they average 1: at the token level ``m`` is the
      mean of ``w_t`` over every response token of the arrays given; at the sequence level the
      mean of the rows' weights over the rows with a response token (one weight per row). The
      mean is before rejection (a rejected token's weight counts, as verl's IS weights are
      computed on the response mask before ``rollout_rs``); ``m <= 1e-8`` leaves the weights
      as they are. ``norm_factor`` is ``m`` (verl's ``rollout_is_batch_norm_factor``), 1 without.

    Criteria chain as verl's comma-separated ``rollout_rs``: ``keep`` is 1 only where every one
    of them (and ``rejection``) keeps the token. Off the mask ``log_rho`` counts as 0; a row with
    no response token has ratio 1 and divergences 0 (kept).
    """
    check_rank(log_rho=(log_rho, 2))  # the rows' sums, means and maxima are over the last axis of [B, T]
    check_same_shape(log_rho=log_rho, mask=mask)
    check_choice("tis_level", tis_level, TIS_LEVELS)
    if tis_lower is not None and tis_cap is None:
        raise ValueError(f"tis_lower={tis_lower} needs a tis_cap: the two bound IcePop's weight")
    if is_concrete_number(tis_lower) and is_concrete_number(tis_cap) and not 0 < tis_lower <= tis_cap:
        raise ValueError(f"tis_lower must be 0 < tis_lower <= tis_cap (IcePop's bounds on the ratio); got "
                         f"tis_lower={tis_lower}, tis_cap={tis_cap}")
    criteria = check_rejection(rejection, rejection_bounds)
    divergences = check_rejection_divergences(rejection_divergences)
    keep_in = jnp.asarray(mask) > 0
    log_rho = jax.lax.stop_gradient(jnp.where(keep_in, jnp.clip(_f32(log_rho), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0))
    seq_sum = jnp.sum(log_rho, axis=-1)  # [B] log prod_t rho_t
    weight, seq_log_weight, norm_factor = _importance_weights(log_rho, seq_sum, keep_in, tis_cap=tis_cap,
                                                              tis_level=tis_level, tis_lower=tis_lower,
                                                              batch_normalize=batch_normalize)
    log_stat = {"token": log_rho, "sequence": seq_sum[:, None],
                "geometric": (seq_sum / jnp.maximum(jnp.sum(keep_in, axis=-1), 1))[:, None]}
    kept_by = {name: jnp.broadcast_to((log_stat[name] >= jnp.log(lo)) & (log_stat[name] <= jnp.log(hi)),
                                      log_rho.shape) for name, (lo, hi) in criteria.items()}
    kept_by |= {name: _divergence_keep(log_rho, keep_in, name, bound) for name, bound in divergences.items()}
    kept_by = {name: jnp.where(keep_in, kept, True).astype(jnp.float32) for name, kept in kept_by.items()}
    keep = jnp.ones_like(log_rho)
    for criterion in kept_by.values():
        keep = keep * criterion
    return SamplerCorrection(weight, keep, seq_log_weight, kept_by, norm_factor)


def _importance_weights(log_rho: Array, seq_sum: Array, keep_in: Array, *, tis_cap, tis_level, tis_lower,
                        batch_normalize) -> tuple[Array, Array, Array]:
    """:func:`sampler_correction`'s weights: per token ``[B, T]`` (1 off the mask), the log of
    each row's weight ``[B]`` and the batch-normalisation factor (1 without)."""
    level_log = log_rho if tis_level == "token" else jnp.broadcast_to(
        jnp.clip(seq_sum, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)[:, None], log_rho.shape)
    if tis_cap is None:
        weight = jnp.ones_like(log_rho)
    elif tis_lower is None:
        weight = jnp.minimum(jnp.exp(level_log), tis_cap)
    else:  # IcePop
        raw = jnp.exp(level_log)
        weight = jnp.where((raw >= tis_lower) & (raw <= tis_cap), raw, 0.0)
    norm_factor = _weight_mean(weight, keep_in, tis_level) if batch_normalize else jnp.float32(1.0)
    scaled = weight / norm_factor  # at the sequence level a row's weight on every column of it
    weight = jnp.where(keep_in, scaled, 1.0)
    # the log of a row's weight; an IcePop zero counts as 1e-30, not -inf
    if tis_level == "token" or tis_cap is None:
        seq_log_weight = jnp.sum(jnp.log(jnp.maximum(weight, 1e-30)), axis=-1)  # 0 where the weight is 1 (off the mask)
    elif tis_lower is None:
        seq_log_weight = jnp.minimum(jnp.clip(seq_sum, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP),
                                     jnp.log(tis_cap)) - jnp.log(norm_factor)
    else:
        seq_log_weight = jnp.log(jnp.maximum(scaled[:, 0], 1e-30))
    return weight, seq_log_weight, norm_factor


def _weight_mean(weight: Array, mask: Array, tis_level: str) -> Array:
    """The mean ``batch_normalize`` divides by: of the token weights over the response tokens,
    or (sequence level) of the rows' weights over the rows with one; 1 where it is <= 1e-8
    (no response token, or every weight ~0)."""
    if tis_level == "token":
        mean = ops.masked_mean(weight, mask)
    else:
        mean = ops.masked_mean(weight[:, 0], jnp.any(mask, axis=-1))
    return jnp.where(mean > 1e-8, mean, 1.0)


def _check_policy_inputs(logps, old_logps, advantages, mask, *, aggregation, entropy, ref_logps, kl_kind,
                         kl_importance_weight, off_policy_mask_threshold, top_entropy_quantile, sampler_logps,
                         tis_cap, tis_ratio, rejection, rejection_divergences, tis_lower,
                         tis_batch_normalize) -> Array:
    """Every policy loss's argument checks (shapes, choices, options that need another argument);
    returns ``advantages`` as ``[B, T]`` (a ``[B]`` per-sequence advantage broadcast over its row)."""
    check_rank(logps=(logps, 2), mask=(mask, 2), advantages=(advantages, (1, 2)))
    check_same_shape(logps=logps, old_logps=old_logps, mask=mask)
    advantages = jnp.asarray(advantages)
    if advantages.ndim == 1:
        if advantages.shape[0] != logps.shape[0]:
            raise ValueError(
                f"advantages of shape {advantages.shape} must be [B]={logps.shape[:1]} or "
                f"[B, T]={logps.shape}"
            )
        advantages = jnp.broadcast_to(advantages[:, None], logps.shape)
    check_same_shape(logps=logps, advantages=advantages)
    optional = {"entropy": entropy, "ref_logps": ref_logps, "sampler_logps": sampler_logps}
    for name, value in optional.items():
        if value is not None:
            check_same_shape(logps=logps, **{name: value})
    check_choice("aggregation", aggregation, ops.AGGREGATION_MODES)
    check_choice("kl_kind", kl_kind, kl_lib.KL_KINDS)
    check_choice("kl_importance_weight", kl_importance_weight, kl_lib.KL_WEIGHTS)
    check_choice("tis_ratio", tis_ratio, TIS_RATIOS)
    if rejection is not None and sampler_logps is None:
        raise ValueError(f"rejection={rejection!r} needs sampler_logps= (the sampler's log-probs [B, T]) to measure "
                         "the ratio it bounds")
    if rejection_divergences and sampler_logps is None:
        raise ValueError(f"rejection_divergences={dict(rejection_divergences)!r} needs sampler_logps= (the sampler's "
                         "log-probs [B, T]) to measure the divergences it bounds")
    if tis_cap is not None and is_concrete_number(tis_cap) and tis_cap <= 0:
        raise ValueError(f"tis_cap must be > 0; got {tis_cap}")
    if tis_lower is not None and (sampler_logps is None or tis_cap is None):
        raise ValueError(f"tis_lower={tis_lower} needs sampler_logps= and a tis_cap: the two bound IcePop's weight "
                         "of the ratio to the sampler")
    if tis_batch_normalize and (sampler_logps is None or tis_cap is None):
        raise ValueError("tis_batch_normalize=True needs sampler_logps= and a tis_cap: it rescales the truncated "
                         "importance weights to mean 1")
    _check_nonnegative(off_policy_mask_threshold=off_policy_mask_threshold)
    if top_entropy_quantile is not None and entropy is None:
        raise ValueError("top_entropy_quantile needs entropy= (the per-token entropy [B, T]) to rank the tokens by")
    return advantages


def _selected_tokens(sur: _Surrogate, correction: SamplerCorrection | None, tokens: _Tokens, entropy: Array | None,
                     *, tis_cap, tis_lower, tis_batch_normalize, off_policy_mask_threshold,
                     top_entropy_quantile) -> tuple[Array, dict[str, Array]]:
    """The surrogate's per-token loss after the sampler correction (TIS weight, rejection masks),
    the off-policy sequence mask and the high-entropy token selection, with their figures."""
    keep = tokens.mask
    per_token = sur.per_token
    metrics: dict[str, Array] = {}
    if correction is not None:
        if not sur.absorbs_correction:
            per_token = per_token * correction.weight
        if tis_cap is not None:
            metrics["tis_weight_mean"] = ops.masked_mean(correction.weight, keep)
        if tis_lower is not None:
            metrics["tis_out_of_bounds"] = ops.masked_mean(correction.weight == 0, keep)
        if tis_batch_normalize:
            metrics["tis_batch_norm_factor"] = correction.norm_factor
        if correction.kept_by:
            per_token = per_token * correction.keep
            metrics["rejected"] = ops.masked_mean(1.0 - correction.keep, keep)
        for name, kept in correction.kept_by.items():
            metrics[f"rejected_{name}"] = ops.masked_mean(1.0 - kept, keep)
    if off_policy_mask_threshold is not None:
        kept = off_policy_sequence_mask(tokens.logps, tokens.old_logps, tokens.advantages, keep,
                                        threshold=off_policy_mask_threshold)
        per_token = per_token * kept
        metrics["off_policy_masked"] = ops.masked_mean(1.0 - kept, keep)
    if top_entropy_quantile is not None:
        high = high_entropy_mask(entropy, keep, quantile=top_entropy_quantile)
        per_token = per_token * high
        metrics["entropy_masked"] = ops.masked_mean(1.0 - high, keep)
    return per_token, metrics


def _ratio_metrics(sur: _Surrogate, old_logps: Array, logps: Array, keep: Array, *, pg: Array) -> dict[str, Array]:
    """The update's figures every policy loss logs: its policy-gradient term, clip fractions,
    approximate KL to the old policy, the ratio's mean and range, the surrogate's indicators."""
    sg = jax.lax.stop_gradient
    ratio = sg(sur.ratio)
    ratio_min, ratio_max = _masked_min_max(ratio, keep)
    # k3 of KL(pi_old || pi_theta): samples come from pi_old, so the log-ratio is old - new.
    approx_kl = kl_lib.kl_estimate(old_logps, sg(logps), kind="k3")
    metrics = dict(
        pg_loss=pg,
        clipfrac_low=ops.masked_mean(sur.clipped_low, keep),
        clipfrac_high=ops.masked_mean(sur.clipped_high, keep),
        approx_kl=ops.masked_mean(approx_kl, keep),
        ratio_mean=ops.masked_mean(ratio, keep),
        ratio_min=ratio_min,
        ratio_max=ratio_max,
    )
    for name, indicator in sur.indicators.items():
        metrics[name] = ops.masked_mean(indicator, keep)
    return metrics


def _policy_loss(
    surrogate: Callable[[_Tokens], _Surrogate],
    logps: Array,
    old_logps: Array,
    advantages: Array,
    mask: Array,
    *,
    aggregation: ops.AggregationMode,
    num_tokens: Scalar | None,
    num_seqs: Scalar | None,
    norm_length: Scalar | None,
    entropy: Array | None,
    entropy_coef: Scalar,
    ref_logps: Array | None,
    kl_coef: Scalar,
    kl_kind: kl_lib.KLKind,
    kl_importance_weight: kl_lib.KLWeight,
    off_policy_mask_threshold: Scalar | None,
    top_entropy_quantile: Scalar | None,
    sampler_logps: Array | None,
    tis_cap: Scalar | None,
    tis_level: str = "token",
    tis_ratio: str = "old",
    rejection: str | Mapping[str, tuple[Scalar, Scalar]] | None = None,
    rejection_bounds: tuple[Scalar, Scalar] = (0.5, 2.0),
    rejection_divergences: Mapping[str, Scalar] | None = None,
    tis_lower: Scalar | None = None,
    tis_batch_normalize: bool = False,
) -> tuple[Array, dict[str, Array]]:
    """The part every policy loss shares: checks, masking, TIS, aggregation, entropy, KL, metrics."""
    advantages = _check_policy_inputs(
        logps, old_logps, advantages, mask, aggregation=aggregation, entropy=entropy, ref_logps=ref_logps,
        kl_kind=kl_kind, kl_importance_weight=kl_importance_weight, off_policy_mask_threshold=off_policy_mask_threshold,
        top_entropy_quantile=top_entropy_quantile, sampler_logps=sampler_logps, tis_cap=tis_cap, tis_ratio=tis_ratio,
        rejection=rejection, rejection_divergences=rejection_divergences, tis_lower=tis_lower,
        tis_batch_normalize=tis_batch_normalize)
    keep = jnp.asarray(mask).astype(bool)

    def on_mask(x):
        # Neutralise masked-out entries before any nonlinearity: the value there becomes 0
        # and the cotangent flowing back through `where` is exactly 0.
        return jnp.where(keep, _f32(x), 0.0)

    logps = on_mask(logps)
    old_logps = jax.lax.stop_gradient(on_mask(old_logps))
    log_ratio = jnp.clip(logps - old_logps, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    sg = jax.lax.stop_gradient
    correction = None
    if sampler_logps is not None:
        # pi_target / pi_sampler: the old policy's (decoupled: old_logps recomputed by the
        # trainer), or the current one's in bypass mode (old_logps are the sampler's own)
        target = old_logps if tis_ratio == "old" else sg(logps)
        correction = sampler_correction(target - sg(on_mask(sampler_logps)), keep, tis_cap=tis_cap,
                                        tis_level=tis_level, rejection=rejection, rejection_bounds=rejection_bounds,
                                        rejection_divergences=rejection_divergences, tis_lower=tis_lower,
                                        batch_normalize=tis_batch_normalize)
    tokens = _Tokens(
        logps=logps, log_ratio=log_ratio,
        advantages=jax.lax.stop_gradient(on_mask(advantages)), mask=keep,
        seq_correction=None if correction is None else correction.seq_log_weight, old_logps=old_logps,
    )
    sur = surrogate(tokens)

    agg = dict(mode=aggregation, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length)

    per_token, metrics = _selected_tokens(sur, correction, tokens, entropy, tis_cap=tis_cap, tis_lower=tis_lower,
                                          tis_batch_normalize=tis_batch_normalize,
                                          off_policy_mask_threshold=off_policy_mask_threshold,
                                          top_entropy_quantile=top_entropy_quantile)
    pg = ops.aggregate(per_token, keep, **agg)
    loss = pg

    if entropy is not None:
        entropy = on_mask(entropy)
        loss = loss - entropy_coef * ops.aggregate(entropy, keep, **agg)
        metrics["entropy"] = ops.masked_mean(entropy, keep)
    if ref_logps is not None:
        kl_tokens = kl_lib.importance_weighted_kl(logps, sg(on_mask(ref_logps)), old_logps, kind=kl_kind,
                                                  weight=kl_importance_weight)
        loss = loss + kl_coef * ops.aggregate(kl_tokens, keep, **agg)
        metrics["kl"] = ops.masked_mean(kl_tokens, keep)

    metrics |= _ratio_metrics(sur, old_logps, logps, keep, pg=pg)
    metrics = {k: sg(_f32(v)) for k, v in metrics.items()}
    return _f32(loss), metrics


def ppo_policy_loss(
    logps: Array,
    old_logps: Array,
    advantages: Array,
    mask: Array,
    *,
    clip_eps_low: Scalar = 0.2,
    clip_eps_high: Scalar | None = None,
    dual_clip_c: Scalar | None = None,
    aggregation: ops.AggregationMode = "token-mean",
    num_tokens: Scalar | None = None,
    num_seqs: Scalar | None = None,
    norm_length: Scalar | None = None,
    entropy: Array | None = None,
    entropy_coef: Scalar = 0.0,
    ref_logps: Array | None = None,
    kl_coef: Scalar = 0.0,
    kl_kind: kl_lib.KLKind = "k3",
    kl_importance_weight: kl_lib.KLWeight = "none",
    off_policy_mask_threshold: Scalar | None = None,
    top_entropy_quantile: Scalar | None = None,
    sampler_logps: Array | None = None,
    tis_cap: Scalar | None = 2.0,
    tis_level: str = "token",
    tis_ratio: str = "old",
    rejection: str | Mapping[str, tuple[Scalar, Scalar]] | None = None,
    rejection_bounds: tuple[Scalar, Scalar] = (0.5, 2.0),
    rejection_divergences: Mapping[str, Scalar] | None = None,
    tis_lower: Scalar | None = None,
    tis_batch_normalize: bool = False,
) -> tuple[Array, dict[str, Array]]:
    """PPO clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms").

    Per token, with ``r_t = exp(logps - old_logps)``:

        l_t = max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high))

    ``clip_eps_high`` defaults to ``clip_eps_low``; setting it larger is DAPO's
    clip-higher (Yu et al. 2025, "DAPO", which uses 0.2 / 0.28): low-probability tokens
    with positive advantage may then grow further before their gradient is cut.

    ``dual_clip_c`` (> 1; Ye et al. 2020, "Mastering Complex Control in MOBA Games with
    Deep RL", dual-clip PPO) bounds the loss of negative-advantage tokens whose ratio has
    exploded: for ``A_t < 0``, ``l_t = min(l_t, -c A_t)``, so the loss is at most
    ``c |A_t|`` and its gradient is 0 once ``r_t > c``. Positive advantages are unchanged.

    Args:
      logps, old_logps, mask: ``[B, T]``; advantages: ``[B, T]`` or ``[B]``.
      clip_eps_low, clip_eps_high, dual_clip_c: as above.
      The shared options (aggregation, TIS, entropy, KL) are described in the module
      docstring.

    Returns ``(loss, metrics)``; the metric keys are listed in the module docstring, plus
    ``dual_clipfrac`` when ``dual_clip_c`` is set.
    """
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    _check_nonnegative(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)
    if dual_clip_c is not None and is_concrete_number(dual_clip_c) and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (Ye et al. 2020 use 3); got {dual_clip_c}")

    def surrogate(tok: _Tokens) -> _Surrogate:
        ratio = jnp.exp(tok.log_ratio)
        per_token, clipped_low, clipped_high = _ppo_clip(
            ratio, tok.advantages, clip_eps_low=clip_eps_low, clip_eps_high=eps_high
        )
        indicators = {}
        if dual_clip_c is not None:
            negative = tok.advantages < 0
            per_token = jnp.where(negative, jnp.minimum(per_token, -dual_clip_c * tok.advantages), per_token)
            indicators["dual_clipfrac"] = negative & (ratio > dual_clip_c)
        return _Surrogate(per_token, ratio, clipped_low, clipped_high, indicators)

    return _policy_loss(
        surrogate, logps, old_logps, advantages, mask,
        aggregation=aggregation, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length,
        entropy=entropy, entropy_coef=entropy_coef, ref_logps=ref_logps, kl_coef=kl_coef,
        kl_kind=kl_kind, kl_importance_weight=kl_importance_weight,
        off_policy_mask_threshold=off_policy_mask_threshold, top_entropy_quantile=top_entropy_quantile,
        sampler_logps=sampler_logps, tis_cap=tis_cap, tis_level=tis_level, tis_ratio=tis_ratio,
        rejection=rejection, rejection_bounds=rejection_bounds, rejection_divergences=rejection_divergences,
        tis_lower=tis_lower, tis_batch_normalize=tis_batch_normalize,
    )


def gspo_policy_loss(
    logps: Array,
    old_logps: Array,
    advantages: Array,
    mask: Array,
    *,
    clip_eps_low: Scalar = 3e-4,
    clip_eps_high: Scalar | None = 4e-4,
    aggregation: ops.AggregationMode = "seq-mean-token-mean",
    num_tokens: Scalar | None = None,
    num_seqs: Scalar | None = None,
    norm_length: Scalar | None = None,
    entropy: Array | None = None,
    entropy_coef: Scalar = 0.0,
    ref_logps: Array | None = None,
    kl_coef: Scalar = 0.0,
    kl_kind: kl_lib.KLKind = "k3",
    kl_importance_weight: kl_lib.KLWeight = "none",
    off_policy_mask_threshold: Scalar | None = None,
    top_entropy_quantile: Scalar | None = None,
    sampler_logps: Array | None = None,
    tis_cap: Scalar | None = 2.0,
    tis_level: str = "token",
    tis_ratio: str = "old",
    rejection: str | Mapping[str, tuple[Scalar, Scalar]] | None = None,
    rejection_bounds: tuple[Scalar, Scalar] = (0.5, 2.0),
    rejection_divergences: Mapping[str, Scalar] | None = None,
    tis_lower: Scalar | None = None,
    tis_batch_normalize: bool = False,
) -> tuple[Array, dict[str, Array]]:
    """GSPO, sequence-level clipped ratio (Zheng et al. 2025, "Group Sequence Policy Optimization").

    The importance ratio is the length-normalised sequence likelihood ratio

        s_i = exp( (1 / |y_i|) sum_{t in y_i} (logps_it - old_logps_it) )

    over the response tokens ``y_i`` of row ``i`` (``|y_i| = sum_t mask_it``; a row with no
    response token has ``s_i = 1``). This is the GSPO-token form: per token,

        s_it = sg(s_i) * pi_theta(y_it) / sg(pi_theta(y_it))       (value s_i, d s_it / d logps_it = s_i)
        l_t  = max(-A_it s_it, -A_it clip(s_it, 1 - eps_low, 1 + eps_high))

    which allows per-token advantages. When the advantages are per sequence (``[B]``, or
    constant along each row) and ``aggregation="seq-mean-token-mean"`` (the default), the
    loss and its gradient equal sequence-level GSPO,
    ``mean_i max(-A_i s_i, -A_i clip(s_i, 1 - eps_low, 1 + eps_high))``: each token then
    carries the same value ``l_i`` and the gradient ``-A_i s_i grad logps_it / |y_i|`` that
    ``d s_i`` gives. Whole sequences are clipped together, since ``s_it = s_i``.

    The clip range is small because ``s_i`` is a per-token geometric mean: the paper uses
    ``eps_low = 3e-4`` and ``eps_high = 4e-4`` (the defaults; ``clip_eps_high=None`` means
    ``eps_low``).

    Args and returns as :func:`ppo_policy_loss` (no dual clip). ``ratio_*`` metrics report
    ``s_i`` on each response token.
    """
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    _check_nonnegative(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)

    def surrogate(tok: _Tokens) -> _Surrogate:
        seq_log_ratio = ops.masked_mean(tok.log_ratio, tok.mask, axis=-1)  # [B]
        seq_ratio = jax.lax.stop_gradient(jnp.exp(seq_log_ratio))[:, None]
        ratio = seq_ratio * jnp.exp(tok.logps - jax.lax.stop_gradient(tok.logps))
        per_token, clipped_low, clipped_high = _ppo_clip(
            ratio, tok.advantages, clip_eps_low=clip_eps_low, clip_eps_high=eps_high
        )
        return _Surrogate(per_token, ratio, clipped_low, clipped_high, {})

    return _policy_loss(
        surrogate, logps, old_logps, advantages, mask,
        aggregation=aggregation, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length,
        entropy=entropy, entropy_coef=entropy_coef, ref_logps=ref_logps, kl_coef=kl_coef,
        kl_kind=kl_kind, kl_importance_weight=kl_importance_weight,
        off_policy_mask_threshold=off_policy_mask_threshold, top_entropy_quantile=top_entropy_quantile,
        sampler_logps=sampler_logps, tis_cap=tis_cap, tis_level=tis_level, tis_ratio=tis_ratio,
        rejection=rejection, rejection_bounds=rejection_bounds, rejection_divergences=rejection_divergences,
        tis_lower=tis_lower, tis_batch_normalize=tis_batch_normalize,
    )


def cispo_policy_loss(
    logps: Array,
    old_logps: Array,
    advantages: Array,
    mask: Array,
    *,
    clip_eps_low: Scalar | None = None,
    clip_eps_high: Scalar = 0.28,
    aggregation: ops.AggregationMode = "token-mean",
    num_tokens: Scalar | None = None,
    num_seqs: Scalar | None = None,
    norm_length: Scalar | None = None,
    entropy: Array | None = None,
    entropy_coef: Scalar = 0.0,
    ref_logps: Array | None = None,
    kl_coef: Scalar = 0.0,
    kl_kind: kl_lib.KLKind = "k3",
    kl_importance_weight: kl_lib.KLWeight = "none",
    off_policy_mask_threshold: Scalar | None = None,
    top_entropy_quantile: Scalar | None = None,
    sampler_logps: Array | None = None,
    tis_cap: Scalar | None = 2.0,
    tis_level: str = "token",
    tis_ratio: str = "old",
    rejection: str | Mapping[str, tuple[Scalar, Scalar]] | None = None,
    rejection_bounds: tuple[Scalar, Scalar] = (0.5, 2.0),
    rejection_divergences: Mapping[str, Scalar] | None = None,
    tis_lower: Scalar | None = None,
    tis_batch_normalize: bool = False,
) -> tuple[Array, dict[str, Array]]:
    """CISPO: clipped, stop-gradient IS weight times log-prob (MiniMax 2025, "MiniMax-M1", eq. 4).

    Per token, with ``r_t = exp(logps - old_logps)``:

        l_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A_t * logps_t

    Unlike PPO no token's gradient is dropped: the weight is clipped, and the gradient
    ``-w_t A_t grad logps_t`` flows through ``logps`` only. The loss value itself is not a
    surrogate objective (it scales with ``logps``); read ``pg_loss`` as a gradient carrier.

    Defaults: MiniMax-M1 imposes no lower bound in practice ("we did not impose a lower
    bound on the IS weight by setting eps_low to a large value; instead, we only tuned
    eps_high"), so ``clip_eps_low=None`` (no lower clip) is the default. The paper does not
    publish its eps_high; 0.28 (DAPO's clip-higher value, also Trinity-RFT's CISPO
    default) is ours. The paper aggregates per token over the batch, ``token-mean``.

    Args and returns as :func:`ppo_policy_loss` (no dual clip). ``clipfrac_low`` /
    ``clipfrac_high`` count tokens whose weight is clipped, whatever the sign of ``A``.
    """
    _check_nonnegative(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)

    def surrogate(tok: _Tokens) -> _Surrogate:
        ratio = jnp.exp(tok.log_ratio)
        lower = -jnp.inf if clip_eps_low is None else 1.0 - clip_eps_low
        weight = jax.lax.stop_gradient(jnp.clip(ratio, lower, 1.0 + clip_eps_high))
        per_token = -weight * tok.advantages * tok.logps
        clipped_low = ratio < lower
        clipped_high = ratio > 1.0 + clip_eps_high
        return _Surrogate(per_token, ratio, clipped_low, clipped_high, {})

    return _policy_loss(
        surrogate, logps, old_logps, advantages, mask,
        aggregation=aggregation, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length,
        entropy=entropy, entropy_coef=entropy_coef, ref_logps=ref_logps, kl_coef=kl_coef,
        kl_kind=kl_kind, kl_importance_weight=kl_importance_weight,
        off_policy_mask_threshold=off_policy_mask_threshold, top_entropy_quantile=top_entropy_quantile,
        sampler_logps=sampler_logps, tis_cap=tis_cap, tis_level=tis_level, tis_ratio=tis_ratio,
        rejection=rejection, rejection_bounds=rejection_bounds, rejection_divergences=rejection_divergences,
        tis_lower=tis_lower, tis_batch_normalize=tis_batch_normalize,
    )


def pg_loss(
    logps: Array,
    old_logps: Array,
    advantages: Array,
    mask: Array,
    *,
    aggregation: ops.AggregationMode = "token-mean",
    num_tokens: Scalar | None = None,
    num_seqs: Scalar | None = None,
    norm_length: Scalar | None = None,
    entropy: Array | None = None,
    entropy_coef: Scalar = 0.0,
    ref_logps: Array | None = None,
    kl_coef: Scalar = 0.0,
    kl_kind: kl_lib.KLKind = "k3",
    kl_importance_weight: kl_lib.KLWeight = "none",
    off_policy_mask_threshold: Scalar | None = None,
    top_entropy_quantile: Scalar | None = None,
    sampler_logps: Array | None = None,
    tis_cap: Scalar | None = 2.0,
    tis_level: str = "token",
    tis_ratio: str = "old",
    rejection: str | Mapping[str, tuple[Scalar, Scalar]] | None = None,
    rejection_bounds: tuple[Scalar, Scalar] = (0.5, 2.0),
    rejection_divergences: Mapping[str, Scalar] | None = None,
    tis_lower: Scalar | None = None,
    tis_batch_normalize: bool = False,
) -> tuple[Array, dict[str, Array]]:
    """Plain policy gradient ``l_t = -A_t * logps_t`` (Williams 1992, REINFORCE).

    The loss of on-policy REINFORCE-style methods whose variance reduction lives in the
    advantage: RLOO (Ahmadian et al. 2024), ReMax (Li et al. 2023), REINFORCE++ (Hu 2025).
    There is no ratio in the loss and so no correction for ``logps`` drifting from
    ``old_logps`` (use it for one update per batch); ``old_logps`` feeds the ``ratio_*`` /
    ``approx_kl`` metrics and, with ``sampler_logps``, the TIS weight. On-policy, pass
    ``jax.lax.stop_gradient(logps)``. ``clipfrac_*`` are always 0 (no clip).

    Args and returns as :func:`ppo_policy_loss`.
    """

    def surrogate(tok: _Tokens) -> _Surrogate:
        never = jnp.zeros(tok.mask.shape, bool)
        per_token = -tok.advantages * tok.logps
        return _Surrogate(per_token, jnp.exp(tok.log_ratio), never, never, {})

    return _policy_loss(
        surrogate, logps, old_logps, advantages, mask,
        aggregation=aggregation, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length,
        entropy=entropy, entropy_coef=entropy_coef, ref_logps=ref_logps, kl_coef=kl_coef,
        kl_kind=kl_kind, kl_importance_weight=kl_importance_weight,
        off_policy_mask_threshold=off_policy_mask_threshold, top_entropy_quantile=top_entropy_quantile,
        sampler_logps=sampler_logps, tis_cap=tis_cap, tis_level=tis_level, tis_ratio=tis_ratio,
        rejection=rejection, rejection_bounds=rejection_bounds, rejection_divergences=rejection_divergences,
        tis_lower=tis_lower, tis_batch_normalize=tis_batch_normalize,
    )


def sapo_policy_loss(
    logps: Array,
    old_logps: Array,
    advantages: Array,
    mask: Array,
    *,
    sapo_temperature_pos: Scalar = 1.0,
    sapo_temperature_neg: Scalar = 1.05,
    aggregation: ops.AggregationMode = "token-mean",
    num_tokens: Scalar | None = None,
    num_seqs: Scalar | None = None,
    norm_length: Scalar | None = None,
    entropy: Array | None = None,
    entropy_coef: Scalar = 0.0,
    ref_logps: Array | None = None,
    kl_coef: Scalar = 0.0,
    kl_kind: kl_lib.KLKind = "k3",
    kl_importance_weight: kl_lib.KLWeight = "none",
    off_policy_mask_threshold: Scalar | None = None,
    top_entropy_quantile: Scalar | None = None,
    sampler_logps: Array | None = None,
    tis_cap: Scalar | None = 2.0,
    tis_level: str = "token",
    tis_ratio: str = "old",
    rejection: str | Mapping[str, tuple[Scalar, Scalar]] | None = None,
    rejection_bounds: tuple[Scalar, Scalar] = (0.5, 2.0),
    rejection_divergences: Mapping[str, Scalar] | None = None,
    tis_lower: Scalar | None = None,
    tis_batch_normalize: bool = False,
) -> tuple[Array, dict[str, Array]]:
    """SAPO, a soft gate in place of the clip (Gao et al. 2025, "Soft Adaptive Policy
    Optimization"; TRL's ``loss_type="sapo"``).

    Per token, with ``r_t = exp(logps - old_logps)`` and ``tau = tau_pos`` if ``A_t > 0``
    else ``tau_neg``:

        l_t = -(4 / tau) sigmoid(tau (r_t - 1)) A_t

    Its gradient ``-4 s (1 - s) r_t A_t grad logps`` (``s = sigmoid(tau (r_t - 1))``) equals
    PPO's ``-A_t`` at ``r_t = 1`` and fades smoothly as the ratio moves far from 1 (faster for
    larger ``tau``), where PPO-clip cuts it to 0 at the clip edge. The paper sets ``tau_neg > tau_pos``: negative
    advantages, which spread probability over the vocabulary, are damped harder. Defaults are
    TRL's, 1.0 and 1.05. The loss value is ``2 / tau`` times PPO's on-policy.

    Args and returns as :func:`ppo_policy_loss` (no clip: ``clipfrac_*`` are 0).
    """
    for name, tau in (("sapo_temperature_pos", sapo_temperature_pos), ("sapo_temperature_neg", sapo_temperature_neg)):
        check_interval(name, tau, 0.0, math.inf, low_open=True)  # 4 / tau: a temperature of 0 is NaN

    def surrogate(tok: _Tokens) -> _Surrogate:
        never = jnp.zeros(tok.mask.shape, bool)
        ratio = jnp.exp(tok.log_ratio)
        tau = jnp.where(tok.advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token = -(4.0 / tau) * jax.nn.sigmoid(tau * (ratio - 1.0)) * tok.advantages
        return _Surrogate(per_token, ratio, never, never, {})

    return _policy_loss(
        surrogate, logps, old_logps, advantages, mask,
        aggregation=aggregation, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length,
        entropy=entropy, entropy_coef=entropy_coef, ref_logps=ref_logps, kl_coef=kl_coef,
        kl_kind=kl_kind, kl_importance_weight=kl_importance_weight,
        off_policy_mask_threshold=off_policy_mask_threshold, top_entropy_quantile=top_entropy_quantile,
        sampler_logps=sampler_logps, tis_cap=tis_cap, tis_level=tis_level, tis_ratio=tis_ratio,
        rejection=rejection, rejection_bounds=rejection_bounds, rejection_divergences=rejection_divergences,
        tis_lower=tis_lower, tis_batch_normalize=tis_batch_normalize,
    )


PolicyLoss = Callable[..., tuple[Array, dict[str, Array]]]

# Read-only: a loss is added here, next to its definition, not registered from elsewhere.
POLICY_LOSSES: Mapping[str, PolicyLoss] = types.MappingProxyType(
    {"ppo": ppo_policy_loss, "gspo": gspo_policy_loss, "cispo": cispo_policy_loss, "sapo": sapo_policy_loss,
     "pg": pg_loss}
)

# SAPO's temperatures shape its soft gate the way the clip keywords shape the clip
_CLIP_KEYWORDS = ("clip_eps_low", "clip_eps_high", "dual_clip_c", "sapo_temperature_pos", "sapo_temperature_neg")


def policy_loss_clip_keywords(name: str) -> tuple[str, ...]:
    """The clip keywords the policy loss ``name`` accepts, read off its signature.

    ``ppo``: ``clip_eps_low, clip_eps_high, dual_clip_c``; ``gspo`` and ``cispo``:
    ``clip_eps_low, clip_eps_high``; ``sapo``: ``sapo_temperature_pos,
    sapo_temperature_neg``; ``pg``: none. A trainer passes only these, so each
    loss keeps its own default for the others.
    """
    check_choice("policy loss", name, POLICY_LOSSES)
    accepted = inspect.signature(POLICY_LOSSES[name]).parameters
    return tuple(keyword for keyword in _CLIP_KEYWORDS if keyword in accepted)
