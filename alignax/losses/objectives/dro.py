"""DRO, direct reward optimisation (Richemond et al. 2024, "Offline Regularised Reinforcement
Learning for Large Language Models Alignment", arXiv:2405.19107, with ``pi_old`` in the reference's
place as verl's ``dro`` does; Kimi k1.5 (2025) uses the same squared log-ratio regulariser).

Per token, with ``lr_t = logps_t - old_logps_t``:

    l_t = -(logps_t * A_t - (beta / 2) * lr_t^2)

a REINFORCE term plus a quadratic pull back towards the policy that sampled (its gradient
``-A_t + beta lr_t`` per unit of ``grad logps_t``), in place of a clip. ``dro_beta`` has no
paper default that carries over (the paper's is for its own reward scale); like verl, it must
be set (> 0). The log-ratio is clipped to +-20 as everywhere in the policy losses.
``clipfrac_*`` are 0.

Sources. Richemond et al. 2024, equation number not checked: the paper's text is not available
offline (the stored pages for arXiv:2405.19107 hold its abstract only); the "eq. 8" this
docstring used to cite was never read in the paper and is removed. The same per-token objective,
unnumbered, is Tinker's DRO loss (https://tinker-docs.thinkingmachines.ai/tinker/losses/dro:
``E_{x~q}[log p_theta(x) A(x) - (1/2) beta (log p_theta(x) / q(x))^2]``, ``q`` the sampler),
which matches the loss above with ``pi_old`` as ``q`` (Tinker sums over tokens; the aggregation
here is the shared option). The loss is verl's ``compute_policy_loss_dro``
(``verl/trainer/ppo/core_algos.py``) and ``docs/algo/dro.md``, followed exactly except that verl
does not clip the log-ratio. Worked by hand, not read in the paper: if DRO's objective is
``(1/2) (r - V - tau log(pi / pi_ref))^2`` per sample, its gradient in ``theta`` is ``-tau (A -
tau lr) grad logps`` with ``A = r - V``, ``tau`` times the gradient of the loss above with
``beta = tau`` and ``pi_old`` for ``pi_ref``.
"""

from __future__ import annotations

import jax.numpy as jnp

from alignax._checks import is_concrete_number
from alignax.losses.objectives._base import Array, Objective, Surrogate, Tokens, run


def dro_policy_loss(logps: Array, old_logps: Array, advantages: Array, mask: Array, *, dro_beta: float,
                    aggregation: str = "token-mean", **shared) -> tuple[Array, dict[str, Array]]:
    """DRO (module docstring). Data ``[B, T]``; ``dro_beta`` > 0; shared options as
    :mod:`alignax.losses.policy`'s. Returns ``(loss, metrics)``.

    Paper: Richemond et al. 2024 (arXiv:2405.19107), equation number not checked:
    the stored copies of the paper read here hold only its abstract and introduction."""
    if dro_beta is None or (is_concrete_number(dro_beta) and dro_beta <= 0):
        raise ValueError(f"dro_beta must be > 0 (the weight of the squared log-ratio to pi_old); got {dro_beta}")

    def surrogate(tok: Tokens) -> Surrogate:
        never = jnp.zeros(tok.mask.shape, bool)
        per_token = -(tok.logps * tok.advantages - 0.5 * dro_beta * jnp.square(tok.log_ratio))
        return Surrogate(per_token, jnp.exp(tok.log_ratio), never, never, {})

    return run(surrogate, logps, old_logps, advantages, mask, aggregation=aggregation, **shared)


# REINFORCE-style (its logps term carries no ratio): in bypass mode it takes the explicit IS weight
DRO = Objective(dro_policy_loss, ("dro_beta",), ratio=False, required=("dro_beta",))
