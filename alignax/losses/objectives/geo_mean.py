"""GMPO, geometric-mean policy optimisation (Zhao et al. 2025, arXiv 2507.20673; verl's
``geo_mean``).

GRPO averages token ratios arithmetically, so one outlying token ratio moves the objective
freely; GMPO maximises the geometric mean of the (clipped) token ratios instead, which an
outlier moves far less. Clipping is done on the log-ratio, per token, with the sign of the
advantage choosing the pessimistic side (as PPO's min):

    c_t = sgn(A_t) * min(sgn(A_t) * lr_t, sgn(A_t) * clip(lr_t, -eps_low, eps_high)),   lr_t = logps_t - old_logps_t
    s_i = exp( (1 / |y_i|) sum_{t in y_i} c_t )
    L_i = -A_i * s_i

The paper's clip range is ``(e^-0.4, e^0.4)``: ``clip_eps_low = clip_eps_high = 0.4`` (in
log space). It is written here in the GSPO-token form, per token
``l_t = -A_t * sg(s_i) * exp(c_t - sg(c_t))`` (value ``-A_t s_i``; ``d l_t / d logps_t =
-A_t s_i dc_t``), so that with sequence advantages and ``seq-mean-token-mean`` (the default)
the loss and its gradient are the paper's ``mean_i L_i`` over rows with a response token (verl
also averages in empty rows, which add 0), and the shared aggregation modes apply.
``clipfrac_high`` / ``clipfrac_low``: tokens whose clipped log-ratio was chosen with
``A > 0`` / ``A < 0``; ``ratio_*`` report ``s_i``.

Sources. Zhao et al. 2025, equation number not checked: the paper's text is not available
offline (the stored pages, https://arxiv.org/html/2507.20673v3,
https://www.sciencestack.ai/paper/2507.20673 and
https://en.papernotes.org/ICLR2026/reinforcement_learning/geometric-mean_policy_optimization/,
hold the abstract, figure 1 and the motivation only; the "eq. 4" this docstring used to cite was
never read in the paper). TRL's GMPO page (https://hfproxy.873968684.xyz/docs/trl/main/gmpo.md)
describes the same clip, unnumbered: "per token, in log space, and one-sided per the advantage
sign ... before the geometric mean is taken", range ``(exp(-0.4), exp(0.4))`` ("paper, Sec. 4"
in TRL's comment, not checked), which the formula above matches. The formula is verl's
``compute_policy_loss_geo_mean`` (``verl/trainer/ppo/core_algos.py``, adapted from the authors'
``train_zero_math_gmpo.py``), which alignax follows for the value and gradient. Where they
differ: verl takes a row's advantage as its token mean and averages over every row, empty ones
included; verl's clip metrics count tokens whose log-ratio is outside the band whatever side
``min`` took; and a rollout-correction weight multiplies each token here (so a row carries the
arithmetic mean of its token weights) where verl multiplies the row by their geometric mean.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from alignax import ops
from alignax.losses.objectives._base import Array, Objective, Surrogate, Tokens, check_nonnegative, run


def geo_mean_policy_loss(logps: Array, old_logps: Array, advantages: Array, mask: Array, *,
                         clip_eps_low: float = 0.4, clip_eps_high: float | None = None,
                         aggregation: str = "seq-mean-token-mean", **shared) -> tuple[Array, dict[str, Array]]:
    """GMPO (module docstring). Data ``[B, T]`` (advantages ``[B, T]`` or ``[B]``);
    ``clip_eps_high=None`` means ``clip_eps_low``; shared options as
    :mod:`alignax.losses.policy`'s. Returns ``(loss, metrics)``.

    Paper: Zhao et al. 2025 (arXiv:2507.20673), equation number not checked:
    the stored copies of the paper read here hold only its abstract and introduction."""
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    check_nonnegative(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)

    def surrogate(tok: Tokens) -> Surrogate:
        sg = jax.lax.stop_gradient
        sign = jnp.sign(tok.advantages)
        clamped = jnp.clip(tok.log_ratio, -clip_eps_low, eps_high)
        c = sign * jnp.minimum(sign * tok.log_ratio, sign * clamped)
        seq = jnp.exp(ops.masked_mean(c, tok.mask, axis=-1))[:, None]  # [B, 1] s_i
        per_token = -tok.advantages * sg(seq) * jnp.exp(c - sg(c))
        took_clip = tok.mask & (sign * clamped < sign * tok.log_ratio)
        ratio = jnp.broadcast_to(seq, tok.log_ratio.shape)
        return Surrogate(per_token, ratio, took_clip & (tok.advantages < 0), took_clip & (tok.advantages > 0), {})

    return run(surrogate, logps, old_logps, advantages, mask, aggregation=aggregation, **shared)


GEO_MEAN = Objective(geo_mean_policy_loss, ("clip_eps_low", "clip_eps_high"), clips=True)
