"""Clip-Cov and KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models", arXiv:2505.22617; verl's ``clip_cov`` and ``kl_cov``).

The paper shows the policy's entropy falls in proportion to the covariance, over tokens,
between a token's log-prob and its advantage, and that a tiny fraction of tokens with
outlying covariance drives the collapse. Per response token, with batch means over the
response tokens of the arrays given (stop-gradient):

    Cov_t = (A_t - mean(A)) * (logps_t - mean(logps))

- **Clip-Cov**: among the tokens PPO-clip did not already clip whose ``Cov_t`` lies
  in ``(clip_cov_lb, clip_cov_ub)``, draw ``k = max(floor(clip_cov_ratio * N), 1)`` at random
  (``N`` response tokens) and drop them from the loss (their gradient, and as in verl their
  value: ``l_t = 0``); the rest keep PPO-clip's
  ``max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``.
- **KL-Cov**: the ``k = max(floor(kl_cov_ratio * N), 1)`` tokens of largest
  ``Cov_t`` get a KL penalty, ``l_t = -A_t r_t + kl_cov_coef * |logps_t - old_logps_t|``;
  every other token ``l_t = -A_t r_t`` (no clip). Ties at the k-th value are all penalised.

Defaults are verl's: ratio 2e-4, bounds (1, 5), the clip band 0.2, and the KL-Cov
coefficient 1 (the fallback in verl's code, ``ppo_kl_coef``; verl's generated YAML sets 0.1,
so ``grpo.kl_cov_coef: 0.1`` matches a default verl run). Clip-Cov's draw needs ``key=`` (a ``jax.random`` key;
the trainer passes the step's); without it the draw uses ``jax.random.key(0)``.
Metrics: ``cov_selected``: the fraction of tokens chosen (Clip-Cov: detached; KL-Cov:
penalised); Clip-Cov's ``clipfrac_*`` are PPO-clip's.

Sources. Cui et al. 2025, equation number not checked:
the stored copies of the paper read here hold only its abstract and introduction
(the stored pages, https://arxiv.org/html/2505.22617v1 and its mirrors, hold the abstract and
author list only; the abstract says the entropy change "is driven by the covariance between
action probability and the change in logits, which is proportional to its advantage", with no
formula). The section and equation numbers this docstring used to give (Section 4, eqs. 11-13)
were never read in the paper and are removed. The formulas are verl's
``compute_policy_loss_clip_cov`` / ``compute_policy_loss_kl_cov``
(``verl/trainer/ppo/core_algos.py``, adapted from the authors' PRIME-RL/Entropy-Mechanism-of-RL
code), which alignax follows: the same covariance, band, PPO-clip exclusion (verl: where the
clipped branch is strictly larger), ``max(floor(ratio N), 1)`` and random draw for Clip-Cov,
``-A r + coef |log r|`` on the top ``k`` for KL-Cov. One difference: verl's ``topk`` penalises
exactly ``k`` tokens, alignax every token tied with the ``k``-th.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from alignax import ops
from alignax._checks import is_concrete_number
from alignax.losses.objectives._base import Array, Objective, Surrogate, Tokens, check_nonnegative, run
from alignax.losses.policy import _ppo_clip  # noqa: PLC2701 - PPO-clip's one definition


def token_covariance(logps: Array, advantages: Array, mask: Array) -> Array:
    """``(A_t - mean A) (logps_t - mean logps)`` over the masked-in tokens (``Cov_t`` in the
    module docstring), ``[B, T]``, stop-gradient; 0 off the mask."""
    sg = jax.lax.stop_gradient
    logps, advantages = sg(logps), sg(advantages)
    cov = (advantages - ops.masked_mean(advantages, mask)) * (logps - ops.masked_mean(logps, mask))
    return jnp.where(mask, cov, 0.0)


def _count(ratio, mask: Array) -> Array:
    """``max(floor(ratio * N), 1)`` for ``N`` masked-in tokens."""
    return jnp.maximum(jnp.floor(ratio * jnp.sum(mask)), 1.0).astype(jnp.int32)


def _top(score: Array, eligible: Array, k: Array, ratio) -> Array:
    """The (at most) ``k`` eligible entries of largest ``score`` (all eligible ones when fewer).

    ``k = max(floor(ratio N), 1)`` is at most ``max(floor(ratio * size), 1)``: with a concrete
    ``ratio`` only that many largest entries are found (``lax.top_k``), not a sort of all of them."""
    flat = jnp.where(eligible, score, -jnp.inf).ravel()
    if is_concrete_number(ratio):
        bound = max(min(int(ratio * flat.shape[0]), flat.shape[0]), 1)
        ranked = jax.lax.top_k(flat, bound)[0]
    else:
        ranked = jnp.sort(flat)[::-1]
    kth = ranked[jnp.clip(k - 1, 0, ranked.shape[0] - 1)]
    return eligible & (score >= kth)


def _check_ratio(name, value):
    if is_concrete_number(value) and not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1] (a fraction of the response tokens; the paper uses 2e-4); "
                         f"got {value}")


def clip_cov_policy_loss(logps: Array, old_logps: Array, advantages: Array, mask: Array, *,
                         clip_eps_low: float = 0.2, clip_eps_high: float | None = None,
                         clip_cov_ratio: float = 2e-4, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0,
                         key: Array | None = None, aggregation: str = "token-mean",
                         **shared) -> tuple[Array, dict[str, Array]]:
    """Clip-Cov (module docstring). Data ``[B, T]``; shared options as
    :mod:`alignax.losses.policy`'s. Returns ``(loss, metrics)``.

    Paper: Cui et al. 2025 (arXiv:2505.22617), equation number not checked:
    the stored copies of the paper read here hold only its abstract and introduction."""
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    check_nonnegative(clip_eps_low=clip_eps_low, clip_eps_high=clip_eps_high)
    _check_ratio("clip_cov_ratio", clip_cov_ratio)
    key = jax.random.key(0) if key is None else key

    def surrogate(tok: Tokens) -> Surrogate:
        ratio = jnp.exp(tok.log_ratio)
        per_token, low, high = _ppo_clip(ratio, tok.advantages, clip_eps_low=clip_eps_low, clip_eps_high=eps_high)
        clipped_by_ppo = -tok.advantages * jnp.clip(ratio, 1 - clip_eps_low, 1 + eps_high) > -tok.advantages * ratio
        cov = token_covariance(tok.logps, tok.advantages, tok.mask)
        eligible = tok.mask & ~clipped_by_ppo & (cov > clip_cov_lb) & (cov < clip_cov_ub)
        chosen = _top(jax.random.uniform(key, cov.shape), eligible, _count(clip_cov_ratio, tok.mask), clip_cov_ratio)
        per_token = jnp.where(chosen, 0.0, per_token)
        return Surrogate(per_token, ratio, low, high, {"cov_selected": chosen})

    return run(surrogate, logps, old_logps, advantages, mask, aggregation=aggregation, **shared)


def kl_cov_policy_loss(logps: Array, old_logps: Array, advantages: Array, mask: Array, *,
                       kl_cov_ratio: float = 2e-4, kl_cov_coef: float = 1.0, aggregation: str = "token-mean",
                       **shared) -> tuple[Array, dict[str, Array]]:
    """KL-Cov (module docstring). Data ``[B, T]``; shared options as
    :mod:`alignax.losses.policy`'s (``clipfrac_*`` are 0: no clip). Returns ``(loss, metrics)``.

    Paper: Cui et al. 2025 (arXiv:2505.22617), equation number not checked:
    the stored copies of the paper read here hold only its abstract and introduction."""
    _check_ratio("kl_cov_ratio", kl_cov_ratio)
    check_nonnegative(kl_cov_coef=kl_cov_coef)

    def surrogate(tok: Tokens) -> Surrogate:
        ratio = jnp.exp(tok.log_ratio)
        cov = token_covariance(tok.logps, tok.advantages, tok.mask)
        chosen = _top(cov, tok.mask, _count(kl_cov_ratio, tok.mask), kl_cov_ratio)
        penalty = jnp.where(chosen, kl_cov_coef * jnp.abs(tok.log_ratio), 0.0)
        never = jnp.zeros(tok.mask.shape, bool)
        return Surrogate(-tok.advantages * ratio + penalty, ratio, never, never, {"cov_selected": chosen})

    return run(surrogate, logps, old_logps, advantages, mask, aggregation=aggregation, **shared)


CLIP_COV = Objective(clip_cov_policy_loss, ("clip_eps_low", "clip_eps_high", "clip_cov_ratio", "clip_cov_lb",
                                            "clip_cov_ub"), rng=True, clips=True)
KL_COV = Objective(kl_cov_policy_loss, ("kl_cov_ratio", "kl_cov_coef"))
