"""KL to the reference policy: per-token estimators, placement, and coefficient controllers.

Estimators follow J. Schulman, "Approximating KL Divergence" (2020). With tokens sampled
from the policy ``pi`` and the log-ratio ``r = log pi(a|s) - log pi_ref(a|s)``:

- ``k1 = r``                      unbiased for KL(pi || ref), high variance, can be < 0;
- ``k2 = r**2 / 2``               biased, low variance, >= 0;
- ``k3 = exp(-r) - 1 + r``        unbiased for KL(pi || ref), low variance, >= 0 (GRPO);
- ``abs = |r|``                   >= 0.

The log-ratio is clamped to ``[-clamp, clamp]`` before the estimator so ``exp(-r)`` cannot
overflow when the policy has drifted far from the reference on one token.

Placement: PPO (Ziegler et al. 2019; Ouyang et al. 2022) subtracts ``beta * KL`` from the
per-token reward (:func:`kl_penalty`); GRPO (Shao et al. 2024) adds ``beta * KL`` to the
loss (:func:`kl_loss`). :func:`sequence_kl` sums the estimate over each response, the
per-sequence KL that controllers and monitors read. Coefficients come from :class:`FixedKLController` or
:class:`AdaptiveKLController`, both pure state updates usable inside ``jax.jit``.

Off-policy samples (:func:`importance_weighted_kl`): the estimators above are unbiased only
for tokens sampled from ``pi`` itself. A loss that updates ``pi_theta`` on tokens sampled by
an older ``pi_old`` (several epochs over a rollout, the sampler's log-probs as the old ones,
asynchronous rollouts) estimates ``E_{pi_old}[k]`` instead. Multiplying each token's
estimate by ``w = pi_theta / pi_old`` (DeepSeek-AI 2025, "DeepSeek-V3.2", the unbiased KL
estimate; TRL's ``use_bias_correction_kl``) restores ``E_{pi_old}[w k] = E_{pi_theta}[k]``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from alignax import ops
from alignax._checks import check_choice, check_rank, check_same_shape

Array = jax.Array

KL_KINDS = ("k1", "k2", "k3", "abs")
KLKind = Literal["k1", "k2", "k3", "abs"]
KL_WEIGHTS = ("none", "ratio", "detached_ratio")
KLWeight = Literal["none", "ratio", "detached_ratio"]


def kl_estimate(logps: Array, ref_logps: Array, *, kind: KLKind = "k3", clamp: float | None = 20.0) -> Array:
    """Per-token KL(pi || ref) estimate from log-probs of the sampled tokens.

    Args:
      logps: ``[...]`` log pi(a_t | s_t) of the sampled tokens (float32 recommended).
      ref_logps: same shape, log pi_ref(a_t | s_t).
      kind: ``k1`` | ``k2`` | ``k3`` | ``abs`` (see the module docstring).
      clamp: the log-ratio is clipped to ``[-clamp, clamp]``; ``None`` disables it.

    Returns the per-token estimate, float32, same shape. Gradients flow into both inputs;
    stop-gradient ``ref_logps`` yourself if the reference is not frozen already.
    """
    check_same_shape(logps=logps, ref_logps=ref_logps)
    check_choice("kl kind", kind, KL_KINDS)
    log_ratio = jnp.asarray(logps, jnp.float32) - jnp.asarray(ref_logps, jnp.float32)
    if clamp is not None:
        log_ratio = jnp.clip(log_ratio, -clamp, clamp)
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * jnp.square(log_ratio)
    if kind == "k3":
        return jnp.expm1(-log_ratio) + log_ratio
    return jnp.abs(log_ratio)


def importance_weighted_kl(
    logps: Array, ref_logps: Array, old_logps: Array, *, kind: KLKind = "k3", weight: KLWeight = "ratio",
    clamp: float | None = 20.0,
) -> Array:
    """Per-token KL(pi_theta || ref) estimate from tokens sampled by ``pi_old``: ``w_t * k_t``.

        k_t = kl_estimate(logps_t, ref_logps_t, kind)
        w_t = exp(logps_t - sg(old_logps_t))            (pi_theta / pi_old of the token)

    ``E_{a ~ pi_old}[w k] = E_{a ~ pi_theta}[k]``, so with ``k3`` the weighted estimate is
    unbiased for KL(pi_theta || ref) whichever older policy sampled the tokens (DeepSeek-V3.2,
    eq. 8). ``weight`` says what the gradient sees:

    - ``ratio``: ``w`` is differentiated, as in DeepSeek-V3.2's formula and TRL's
      ``use_bias_correction_kl``. Then ``E_{pi_old}[grad(w k3)]`` is the exact gradient of
      KL(pi_theta || ref) (the score-function term ``k3 grad log pi_theta`` included), even
      on-policy, where the value is unchanged (``w = 1``) but the gradient is not.
    - ``detached_ratio``: ``w`` is a constant. ``E_{pi_old}[w grad k3] = E_{pi_theta}[grad k3]``,
      the gradient the unweighted loss has on-policy (that of KL(ref || pi_theta)); so the
      value and the gradient equal the on-policy loss's in expectation, and on-policy
      (``logps == old_logps``) they are identical to the unweighted ones.
    - ``none``: ``k_t`` unweighted (``old_logps`` unused).

    Args:
      logps: ``[...]`` log pi_theta of the sampled tokens (differentiable).
      ref_logps: same shape, log pi_ref (gradient flows as in :func:`kl_estimate`).
      old_logps: same shape, log pi_old, the policy that sampled the tokens (constant).
      kind, clamp: as in :func:`kl_estimate`; ``clamp`` also bounds ``log w``.

    Returns the per-token weighted estimate, float32, same shape.
    """
    check_same_shape(logps=logps, ref_logps=ref_logps, old_logps=old_logps)
    check_choice("kl importance weight", weight, KL_WEIGHTS)
    kl = kl_estimate(logps, ref_logps, kind=kind, clamp=clamp)
    if weight == "none":
        return kl
    log_w = jnp.asarray(logps, jnp.float32) - jax.lax.stop_gradient(jnp.asarray(old_logps, jnp.float32))
    if clamp is not None:
        log_w = jnp.clip(log_w, -clamp, clamp)
    w = jnp.exp(log_w)
    if weight == "detached_ratio":
        w = jax.lax.stop_gradient(w)
    return w * kl


def kl_penalty(
    logps: Array, ref_logps: Array, mask: Array, *, beta: Array | float, kind: KLKind = "k1",
    clamp: float | None = 20.0,
) -> Array:
    """Per-token penalty ``beta * KL_t`` on response tokens, 0 elsewhere; ``[B, T]`` float32.

    The PPO convention subtracts it from the per-token reward
    (:func:`alignax.advantages.token_rewards`). No gradient flows through it: rewards
    are data. Worked case: log-ratios [0.1, 0.2, -0.05], k1, beta 0.04 -> penalties sum
    to 0.04 * 0.25 = 0.01.
    """
    check_rank(logps=(logps, 2))
    check_same_shape(logps=logps, ref_logps=ref_logps, mask=mask)
    kl = kl_estimate(jax.lax.stop_gradient(logps), jax.lax.stop_gradient(ref_logps), kind=kind, clamp=clamp)
    return jnp.where(mask.astype(bool), beta * kl, 0.0)


def kl_loss(
    logps: Array, ref_logps: Array, mask: Array, *, kind: KLKind = "k3",
    aggregation: ops.AggregationMode = "token-mean", clamp: float | None = 20.0,
    num_tokens: Array | float | None = None, num_seqs: Array | float | None = None,
    norm_length: Array | float | None = None,
) -> Array:
    """KL(pi || ref) as a loss term (GRPO convention), aggregated like the policy loss.

    Gradient flows into ``logps`` only; the reference is treated as constant. Multiply by
    the coefficient yourself (the policy losses take ``kl_coef``). Masked tokens get
    exactly zero gradient even with ``clamp=None``: their log-ratio is set to 0 before
    the estimator, so a huge log-ratio on padding cannot turn ``0 * inf`` into NaN.
    """
    check_rank(logps=(logps, 2))
    check_same_shape(logps=logps, ref_logps=ref_logps, mask=mask)
    ref_logps = jax.lax.stop_gradient(ref_logps)
    logps = jnp.where(jnp.asarray(mask).astype(bool), logps, ref_logps)
    kl = kl_estimate(logps, ref_logps, kind=kind, clamp=clamp)
    return ops.aggregate(
        kl, mask, mode=aggregation, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length
    )


def sequence_kl(
    logps: Array, ref_logps: Array, mask: Array, *, kind: KLKind = "k1", clamp: float | None = 20.0
) -> Array:
    """Per-sequence KL(pi || ref): the per-token estimate summed over each row's response.

        KL_i = sum_{t : mask_it > 0} k(logps_it - ref_logps_it)

    with ``k`` the estimator ``kind`` (:func:`kl_estimate`; Schulman 2020). With ``k1`` and
    tokens sampled from ``pi`` this is the single-sample estimate of the sequence-level
    ``KL(pi(.|x) || pi_ref(.|x))`` that Ziegler et al. 2019 (§2.2) feed to the adaptive
    controller; monitors log its batch mean.

    Args:
      logps: ``[B, T]`` log pi(a_t | s_t) of the sampled tokens.
      ref_logps: ``[B, T]`` log pi_ref(a_t | s_t).
      mask: ``[B, T]``, counted where ``mask > 0`` (response tokens).
      kind, clamp: as in :func:`kl_estimate`.

    Returns ``[B]`` float32; a row with no response token gives 0. Both inputs are set to 0
    on masked positions before the estimator, so garbage there (even ``-inf``) reaches
    neither the value nor the gradient, which flows into both inputs as in :func:`kl_estimate`.
    """
    check_rank(logps=(logps, 2))
    check_same_shape(logps=logps, ref_logps=ref_logps, mask=mask)
    keep = jnp.asarray(mask) > 0
    logps = jnp.where(keep, jnp.asarray(logps, jnp.float32), 0.0)
    ref_logps = jnp.where(keep, jnp.asarray(ref_logps, jnp.float32), 0.0)
    kl = kl_estimate(logps, ref_logps, kind=kind, clamp=clamp)
    return jnp.sum(jnp.where(keep, kl, 0.0), axis=-1)


class KLControllerState(NamedTuple):
    """The current KL coefficient (a float32 scalar), carried in the train state."""

    coef: Array


@dataclasses.dataclass(frozen=True)
class FixedKLController:
    """A constant coefficient ``beta``; ``update`` returns the state unchanged."""

    coef: float

    def init(self) -> KLControllerState:
        return KLControllerState(coef=jnp.asarray(self.coef, jnp.float32))

    def update(self, state: KLControllerState, current_kl: Array, num_samples: Array | int) -> KLControllerState:
        del current_kl, num_samples
        return state


@dataclasses.dataclass(frozen=True)
class AdaptiveKLController:
    """Ziegler et al. 2019 ("Fine-Tuning LMs from Human Preferences", §2.2) controller.

    ``e = clip(KL / target - 1, -0.2, 0.2)``; ``beta <- beta * (1 + e * n / horizon)``
    where ``n`` is the number of samples (or steps) since the last update and ``KL`` the
    measured mean sequence KL. The coefficient rises when KL overshoots the target and
    falls when it undershoots, by at most 20% per horizon.
    """

    init_coef: float
    target: float
    horizon: float
    max_error: float = 0.2

    def __post_init__(self):
        if self.target <= 0 or self.horizon <= 0:
            raise ValueError(f"AdaptiveKLController needs target > 0 and horizon > 0; got {self.target}, {self.horizon}")

    def init(self) -> KLControllerState:
        return KLControllerState(coef=jnp.asarray(self.init_coef, jnp.float32))

    def update(self, state: KLControllerState, current_kl: Array, num_samples: Array | int) -> KLControllerState:
        error = jnp.clip(jnp.asarray(current_kl, jnp.float32) / self.target - 1.0, -self.max_error, self.max_error)
        multiplier = 1.0 + error * jnp.asarray(num_samples, jnp.float32) / self.horizon
        return KLControllerState(coef=state.coef * multiplier)
