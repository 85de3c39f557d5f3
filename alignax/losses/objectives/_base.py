"""What an objective module needs: the registry's entry type and the shared driver.

An objective module defines its surrogate (``alignax.losses.policy._Tokens ->
_Surrogate``), a public loss that hands it to :func:`run` with the shared options, and an
:class:`Objective` entry naming the config keys it reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from alignax.losses import policy

Array = jax.Array
Tokens = policy._Tokens  # noqa: SLF001 - the objectives package extends policy.py's driver
Surrogate = policy._Surrogate  # noqa: SLF001
f32 = policy._f32  # noqa: SLF001
check_nonnegative = policy._check_nonnegative  # noqa: SLF001

# The shared options every policy loss takes, with their defaults (alignax.losses.policy's
# module docstring describes them).
SHARED_DEFAULTS = dict(
    num_tokens=None, num_seqs=None, norm_length=None, entropy=None, entropy_coef=0.0, ref_logps=None, kl_coef=0.0,
    kl_kind="k3", kl_importance_weight="none", off_policy_mask_threshold=None, top_entropy_quantile=None,
    sampler_logps=None, tis_cap=2.0, tis_level="token", tis_ratio="old", rejection=None, rejection_bounds=(0.5, 2.0),
    rejection_divergences=None, tis_lower=None, tis_batch_normalize=False,
)


def run(surrogate: Callable[[Tokens], Surrogate], logps: Array, old_logps: Array, advantages: Array, mask: Array, *,
        aggregation: str, **shared) -> tuple[Array, dict[str, Array]]:
    """``alignax.losses.policy._policy_loss`` with ``shared`` over :data:`SHARED_DEFAULTS`;
    an unknown keyword is an error naming it and the valid ones."""
    unknown = sorted(set(shared) - set(SHARED_DEFAULTS))
    if unknown:
        raise TypeError(f"unknown policy-loss keyword(s) {unknown}; the shared ones are {sorted(SHARED_DEFAULTS)}")
    return policy._policy_loss(surrogate, logps, old_logps, advantages, mask,  # noqa: SLF001
                               aggregation=aggregation, **{**SHARED_DEFAULTS, **shared})


@dataclasses.dataclass(frozen=True)
class Objective:
    """An entry of the registry.

    Fields:
      loss: the pure loss, ``(logps, old_logps, advantages, mask, **keywords) -> (loss, metrics)``.
      keys: the ``grpo:`` keys it reads, each also a keyword of ``loss`` (a key set to
        ``null`` leaves the loss's own default, its paper's).
      ratio: its own ratio ``pi_theta / pi_old`` carries the importance correction. In
        verl's bypass mode (``rollout.old_logps: sampler``) such an objective takes no extra
        IS weight (it would count the correction twice); one without (REINFORCE-style) takes
        the explicit weight ``sg(pi_theta) / pi_sampler`` from ``rollout.tis_cap``.
      rng: it draws random numbers (its loss takes ``key=``, a ``jax.random`` key).
      required: keys that must be set (no paper default to fall back on).
      clips: it holds the ratio to a bound (a clip or a trust region), so its
        ``clipfrac_low`` / ``clipfrac_high`` count the tokens held there; an objective
        without one logs them as 0, and ``monitor.clip_fraction`` (an alarm on their sum)
        is refused for it.
    """

    loss: Callable[..., tuple[Array, dict[str, Array]]]
    keys: tuple[str, ...] = ()
    ratio: bool = True
    rng: bool = False
    required: tuple[str, ...] = ()
    clips: bool = False
