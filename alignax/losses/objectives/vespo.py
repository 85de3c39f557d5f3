"""VESPO, variational sequence-level soft policy optimisation (Shen et al. 2026, arXiv 2602.10693;
TRL 1.16's ``loss_type="vespo"``, ``GRPOTrainer.get_gamma_weights``).

In place of a clip, the gradient of each completion is scaled by a smooth, asymmetric
Gamma-shaped function of its sequence importance ratio ``W_i = pi_theta(y_i) / pi_sampler(y_i)``,
normalised so that ``phi(1) = 1`` and stop-gradiented:

    log W_i = clip( sum_{t in y_i} lr_t + log w^sampler_i, log 1e-8, 20 ),   lr_t = clip(logps_t - old_logps_t, +-20)
    phi(W)  = W^k * exp(lambda * (1 - W))                                  (k, lambda: c1, c2 of the paper)
    l_t     = -sg(phi(W_i)) * A_t * logps_t

with ``(k, lambda) = (vespo_k_pos, vespo_lambda_pos)`` where ``A_t >= 0`` and
``(vespo_k_neg, vespo_lambda_neg)`` otherwise (TRL's defaults 2, 3 and 3, 2; lambda is floored
at 1e-4, as TRL). ``log w^sampler_i``: with ``sampler_logps``, the row's truncated importance
correction ``pi_old / pi_sampler`` is folded into ``W`` (in log space, as TRL folds its
``importance_sampling_ratio``) instead of multiplying the loss. A non-finite ``phi`` counts
as 0. Default aggregation ``token-mean`` (TRL normalises VESPO by the token count).
Metrics: ``vespo_phi_mean``: the masked mean of ``phi``; ``clipfrac_*`` are 0.

Sources. Shen et al. 2026, equation number not checked: the paper's text is not available
offline (the stored pages, https://arxiv.org/html/2602.10693v1 and v3, hold the abstract and the
start of the introduction: "a closed-form reshaping kernel that operates directly on
sequence-level importance weights without length normalization", which the summed, not averaged,
log-ratios above agree with; the kernel's formula is not in them). The "Section 3.4" this
docstring used to cite was never read in the paper and is removed. verl has no VESPO; the
formula is TRL's ``GRPOTrainer.get_gamma_weights`` (``phi(W) = e^lambda W^k e^(-lambda W)``, the
summed token log-ratios clipped to ``[log 1e-8, 20]``, by the sign of ``A``), which alignax
follows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from alignax.losses.objectives._base import Array, Objective, Surrogate, Tokens, check_nonnegative, run

_LOG_FLOOR = math.log(1e-8)


def gamma_weight(log_w: Array, advantages: Array, *, k_pos, lambda_pos, k_neg, lambda_neg) -> Array:
    """``phi(W) = exp(lambda + k log W - lambda W)`` with ``(k, lambda)`` by the sign of the
    advantage (``A >= 0``: the positive pair); non-finite values become 0. Shapes broadcast."""
    positive = advantages >= 0
    k = jnp.where(positive, k_pos, k_neg)
    lam = jnp.maximum(jnp.where(positive, lambda_pos, lambda_neg), 1e-4)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return jnp.where(jnp.isfinite(phi), phi, 0.0)


def vespo_policy_loss(logps: Array, old_logps: Array, advantages: Array, mask: Array, *,
                      vespo_k_pos: float = 2.0, vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0,
                      vespo_lambda_neg: float = 2.0, aggregation: str = "token-mean",
                      **shared) -> tuple[Array, dict[str, Array]]:
    """VESPO (module docstring). Data ``[B, T]`` (advantages ``[B, T]`` or ``[B]``); shared
    options as :mod:`alignax.losses.policy`'s. Returns ``(loss, metrics)``.

    Paper: Shen et al. 2026 (arXiv:2602.10693), equation number not checked:
    the stored copies of the paper read here hold only its abstract and introduction."""
    check_nonnegative(vespo_k_pos=vespo_k_pos, vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg,
                      vespo_lambda_neg=vespo_lambda_neg)

    def surrogate(tok: Tokens) -> Surrogate:
        seq_log = jnp.sum(tok.log_ratio, axis=-1)
        if tok.seq_correction is not None:
            seq_log = seq_log + tok.seq_correction
        log_w = jnp.clip(seq_log, _LOG_FLOOR, 20.0)[:, None]
        phi = jax.lax.stop_gradient(gamma_weight(log_w, tok.advantages, k_pos=vespo_k_pos, lambda_pos=vespo_lambda_pos,
                                                 k_neg=vespo_k_neg, lambda_neg=vespo_lambda_neg))
        never = jnp.zeros(tok.mask.shape, bool)
        ratio = jnp.broadcast_to(jnp.exp(log_w), tok.log_ratio.shape)
        return Surrogate(-phi * tok.advantages * tok.logps, ratio, never, never,
                         {"vespo_phi_mean": jnp.broadcast_to(phi, tok.log_ratio.shape)}, absorbs_correction=True)

    return run(surrogate, logps, old_logps, advantages, mask, aggregation=aggregation, **shared)


VESPO = Objective(vespo_policy_loss, ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"))
