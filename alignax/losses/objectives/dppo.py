"""DPPO's binary trust regions (arXiv 2602.04879, "Rethinking the Trust Region in LLM RL";
verl's ``dppo_tv`` and ``dppo_kl``).

PPO's ratio clip bounds ``pi_theta / pi_old``, which is loose for likely tokens and tight
for unlikely ones. DPPO bounds a divergence between the two Bernoulli distributions "this
token / any other token" under ``pi_old`` and ``pi_theta`` instead, with ``p = pi_theta(y_t)``
and ``q = pi_old(y_t)``:

    TV:  D_t = p - q                                          (signed, total variation)
    KL:  D_t = q log(q / p) + (1 - q) log((1 - q) / (1 - p))  (binary KL(pi_old || pi_theta))

A token keeps its gradient only while the update has not pushed it past the region in the
direction its advantage asks for (binary mask ``m_t``, stop-gradient):

    TV:  m_t = [p - q <= eps_high]  if A_t > 0,   [p - q >= -eps_low]  otherwise
    KL:  m_t = [D_t <= eps_high or p <= q]  if A_t > 0,   [D_t <= eps_low or p >= q]  otherwise

and the per-token loss is the truncated-IS policy gradient ("Section 5.4" in verl's comment,
not checked: no dual clip, a large cap instead)

    l_t = -A_t * sg(min(r_t, c)) * m_t * logps_t,    r_t = exp(logps_t - old_logps_t)

``clip_eps_low`` / ``clip_eps_high`` are the divergence thresholds (verl reuses its
``clip_ratio`` keys for them; 0.2 by default, verl's), ``dppo_ratio_cap`` is ``c`` (20: the
fallback in verl's code and a "large threshold" as Section 5.4 asks; verl's actor config
carries ``clip_ratio_c: 3.0``, which its DPPO then reads, so a verl run caps at 3 unless set). Metrics: ``clipfrac_high`` / ``clipfrac_low``: tokens
masked with ``A > 0`` / ``A <= 0``; ``ratio_capped``: tokens whose weight was truncated.

Sources. Qi et al. 2026, arXiv:2602.04879, equation number not checked: the paper's text is not
available offline (the stored pages, https://arxiv.org/html/2602.04879v1 and the authors' README
https://github.com/sail-sg/Stable-RL, hold the abstract, figure captions and usage only: "a mask
based on a direct approximation of policy divergence (e.g., Total Variation)", with no formula).
"Section 5.4" is the citation in verl's code comment, not checked against the paper. The masks,
the binary KL (with its ``1e-8``) and the loss above are verl's ``compute_policy_loss_dppo_tv``
/ ``compute_policy_loss_dppo_kl`` (``verl/trainer/ppo/core_algos.py``), followed exactly; only
the metrics are named differently (verl's ``pg_clipfrac`` is our ``clipfrac_low +
clipfrac_high``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from alignax.losses.objectives._base import Array, Objective, Surrogate, Tokens, check_nonnegative, run

# the 1e-8 of verl's binary KL: 1 - p is 0 for a token of probability 1
_EPS = 1e-8


def binary_kl(old_logps: Array, logps: Array) -> Array:
    """``q log(q / p) + (1 - q) log((1 - q) / (1 - p))`` with ``q = exp(old_logps)``,
    ``p = exp(logps)`` (nats, ``[B, T]``), as verl computes it (``+1e-8`` in the second log).

    ``1 - q`` is ``-expm1(old_logps)`` (exact near ``q = 1``): written ``1 - q + 1e-8``, XLA
    folds it under ``jit`` into ``(1 + 1e-8) - q``, which is ``1 - q`` in float32, and the
    divergence of a token of probability 1 under both policies was ``0 * log(0 / 0) = NaN``."""
    q = jnp.exp(old_logps)
    not_q, not_p = -jnp.expm1(old_logps), -jnp.expm1(logps)
    return q * (old_logps - logps) + not_q * jnp.log((not_q + _EPS) / (not_p + _EPS))


def _dppo(divergence: str, clip_eps_low, clip_eps_high, dppo_ratio_cap):
    check_nonnegative(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high, dppo_ratio_cap=dppo_ratio_cap)

    def surrogate(tok: Tokens) -> Surrogate:
        sg = jax.lax.stop_gradient
        logps, old = sg(tok.logps), tok.old_logps
        p, q = jnp.exp(logps), jnp.exp(old)
        if divergence == "tv":
            up_ok, down_ok = p - q <= clip_eps_high, p - q >= -clip_eps_low
        else:
            d = binary_kl(old, logps)
            up_ok, down_ok = (d <= clip_eps_high) | (p <= q), (d <= clip_eps_low) | (p >= q)
        positive = tok.advantages > 0
        valid = jnp.where(positive, up_ok, down_ok)
        ratio = jnp.exp(tok.log_ratio)
        weight = sg(jnp.minimum(ratio, dppo_ratio_cap))
        per_token = -tok.advantages * weight * jnp.where(valid, 1.0, 0.0) * tok.logps
        return Surrogate(per_token, ratio, ~valid & ~positive, ~valid & positive,
                         {"ratio_capped": ratio > dppo_ratio_cap})

    return surrogate


def dppo_tv_policy_loss(logps: Array, old_logps: Array, advantages: Array, mask: Array, *,
                        clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dppo_ratio_cap: float = 20.0,
                        aggregation: str = "token-mean", **shared) -> tuple[Array, dict[str, Array]]:
    """DPPO-Binary-TV (module docstring). Data ``[B, T]`` (advantages ``[B, T]`` or ``[B]``);
    the shared options (aggregation, KL, entropy, TIS / rejection, masks) as
    :mod:`alignax.losses.policy`'s. Returns ``(loss, metrics)``.

    Paper: Qi et al. 2026 (arXiv:2602.04879), equation number not checked:
    the stored copies of the paper read here hold only its abstract and introduction."""
    return run(_dppo("tv", clip_eps_low, clip_eps_high, dppo_ratio_cap), logps, old_logps, advantages, mask,
               aggregation=aggregation, **shared)


def dppo_kl_policy_loss(logps: Array, old_logps: Array, advantages: Array, mask: Array, *,
                        clip_eps_low: float = 0.2, clip_eps_high: float = 0.2, dppo_ratio_cap: float = 20.0,
                        aggregation: str = "token-mean", **shared) -> tuple[Array, dict[str, Array]]:
    """DPPO-Binary-KL (module docstring); arguments as :func:`dppo_tv_policy_loss`.

    Paper: Qi et al. 2026 (arXiv:2602.04879), equation number not checked:
    the stored copies of the paper read here hold only its abstract and introduction."""
    return run(_dppo("kl", clip_eps_low, clip_eps_high, dppo_ratio_cap), logps, old_logps, advantages, mask,
               aggregation=aggregation, **shared)


_KEYS = ("clip_eps_low", "clip_eps_high", "dppo_ratio_cap")
DPPO_TV = Objective(dppo_tv_policy_loss, _KEYS, clips=True)
DPPO_KL = Objective(dppo_kl_policy_loss, _KEYS, clips=True)
