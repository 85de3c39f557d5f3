"""The registry of policy objectives: the ``grpo.policy_loss`` values, each with its loss and
the facts the trainer and the validator read (:class:`Objective`).

Adding an objective: its own module here (its surrogate, its public loss through
:func:`alignax.losses.objectives._base.run`, its :class:`Objective` entry) and one line in
:data:`OBJECTIVES`; new config keys it reads are fields of ``GRPOSection``
(``alignax/trainers/config.py``). The trainer (``alignax.trainers.online.grpo``), the key
table's rows (``alignax.trainers.algorithms``) and the docs read the entry, nothing else.

======== ============================================ =====================================
name     objective                                    module
======== ============================================ =====================================
ppo      PPO-clip, clip-higher, dual clip             :mod:`alignax.losses.policy`
gspo     sequence-level clipped ratio                 :mod:`alignax.losses.policy`
cispo    clipped IS weight x log-prob                 :mod:`alignax.losses.policy`
sapo     soft gate                                    :mod:`alignax.losses.policy`
pg       REINFORCE                                    :mod:`alignax.losses.policy`
gpg      GPG: REINFORCE (its own part is the advantage) :mod:`alignax.losses.policy`
dppo_tv  DPPO binary TV trust region                  :mod:`.dppo`
dppo_kl  DPPO binary KL trust region                  :mod:`.dppo`
clip_cov Clip-Cov                                     :mod:`.cov`
kl_cov   KL-Cov                                       :mod:`.cov`
geo_mean GMPO                                         :mod:`.geo_mean`
dro      DRO                                          :mod:`.dro`
vespo    VESPO                                        :mod:`.vespo`
======== ============================================ =====================================
"""

from __future__ import annotations

import types
from collections.abc import Mapping

from alignax._checks import check_choice
from alignax.losses import policy
from alignax.losses.objectives import cov, dppo, dro, geo_mean, vespo
from alignax.losses.objectives._base import Objective

_CLIP = ("clip_eps_low", "clip_eps_high")

# Read-only: an objective is added here, one line, beside its module.
OBJECTIVES: Mapping[str, Objective] = types.MappingProxyType({
    "ppo": Objective(policy.ppo_policy_loss, (*_CLIP, "dual_clip_c"), clips=True),
    "gspo": Objective(policy.gspo_policy_loss, _CLIP, clips=True),
    "cispo": Objective(policy.cispo_policy_loss, _CLIP, clips=True),
    "sapo": Objective(policy.sapo_policy_loss, ("sapo_temperature_pos", "sapo_temperature_neg")),
    "pg": Objective(policy.pg_loss, ratio=False),
    # GPG (Chu et al. 2025, arXiv 2504.02546; equation number not checked: paper text
    # unavailable): the plain policy gradient -A logp, no ratio and no clip, as verl's
    # compute_policy_loss_gpg; what differs from REINFORCE is its advantage (grpo.advantage)
    "gpg": Objective(policy.pg_loss, ratio=False),
    "dppo_tv": dppo.DPPO_TV,
    "dppo_kl": dppo.DPPO_KL,
    "clip_cov": cov.CLIP_COV,
    "kl_cov": cov.KL_COV,
    "geo_mean": geo_mean.GEO_MEAN,
    "dro": dro.DRO,
    "vespo": vespo.VESPO,
})


def objective(name: str) -> Objective:
    """The entry of ``name``; an unknown name is an error listing the valid ones."""
    check_choice("policy loss", name, OBJECTIVES)
    return OBJECTIVES[name]


def readers(key: str) -> tuple[str, ...]:
    """The objectives that read the config key ``key`` (``grpo.<key>``)."""
    return tuple(name for name, entry in OBJECTIVES.items() if key in entry.keys)


def clipping() -> tuple[str, ...]:
    """The objectives that hold the ratio to a bound (:attr:`Objective.clips`)."""
    return tuple(name for name, entry in OBJECTIVES.items() if entry.clips)


def keys() -> tuple[str, ...]:
    """Every config key some objective reads, in first-seen order."""
    return tuple(dict.fromkeys(k for entry in OBJECTIVES.values() for k in entry.keys))


__all__ = ["OBJECTIVES", "Objective", "clipping", "keys", "objective", "readers"]
