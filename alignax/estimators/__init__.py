"""The registry of advantage estimators: ``grpo.advantage`` names one of :data:`ESTIMATORS`.

One module per estimator under this package, holding its formula (a pure function on arrays,
with the paper and equation in its docstring) and its :class:`~alignax.estimators.base.Estimator`
entry (what the rollout must gather for it). Adding an estimator is its module and one line
in :data:`ENTRIES` below; the GRPO family (:mod:`alignax.trainers.online.grpo`), validation
(the ``grpo`` entry of :mod:`alignax.trainers.algorithms`) and the docs read the entry.

The arrays-in, arrays-out functions stay importable from :mod:`alignax.advantages` (``gae``,
``group_advantages``, ``process_advantages``) and from each module here
(``alignax.estimators.opo.opo_advantages``, ...).
"""

from __future__ import annotations

from alignax.estimators import (
    dr_grpo,
    gdpo,
    gpg,
    grpo,
    grpo_passk,
    opo,
    optimal_token_baseline,
    process,
    reinforce_plus_plus_baseline,
    reinforce_pp,
    remax,
    rloo,
    tir_optimal_token_baseline,
)
from alignax.estimators.base import Estimator

ENTRIES: tuple[Estimator, ...] = (
    grpo.ESTIMATOR,
    dr_grpo.ESTIMATOR,
    rloo.ESTIMATOR,
    reinforce_pp.ESTIMATOR,
    remax.ESTIMATOR,
    process.ESTIMATOR,
    grpo_passk.ESTIMATOR,
    reinforce_plus_plus_baseline.ESTIMATOR,
    opo.ESTIMATOR,
    gpg.ESTIMATOR,
    optimal_token_baseline.ESTIMATOR,
    tir_optimal_token_baseline.ESTIMATOR,
    gdpo.ESTIMATOR,
)

ESTIMATORS: dict[str, Estimator] = {e.name: e for e in ENTRIES}


def estimator(name: str) -> Estimator:
    """The entry of ``name``; an unknown name is an error listing the valid ones."""
    if name not in ESTIMATORS:
        raise ValueError(f"grpo.advantage={name} is not an advantage estimator; valid: {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name]


def effective_name(section) -> str:
    """The estimator a ``grpo:`` section runs: ``grpo.advantage``, or GDPO's under
    ``grpo.reward_aggregation: normalize_then_sum`` (TRL's spelling of the same estimator;
    the map accepts it with ``advantage: grpo`` only)."""
    if section.reward_aggregation == "normalize_then_sum":
        return gdpo.ESTIMATOR.name
    return section.advantage


__all__ = ["ENTRIES", "ESTIMATORS", "Estimator", "effective_name", "estimator"]
