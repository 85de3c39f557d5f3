"""What an advantage estimator is: :class:`Estimator`, one entry of :data:`alignax.estimators.ESTIMATORS`.

An estimator turns a rollout's rewards (and, for some, per-token statistics of the policy)
into per-token advantages ``[R, N]``. Its module holds the formula as a pure function on
arrays (the functional core: no trainer, model or file) and the entry that says what the
rollout must gather for it. The trainer reads the entry; nothing else spells its name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from alignax.advantages import _check_group_ids, _check_num_groups

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Estimator:
    """An entry of the estimator registry.

    Fields:
      name: the ``grpo.advantage`` value (and, where verl has it, the ``algorithm.adv_estimator``
        name it corresponds to: ``verl_name``, ``None`` when verl has no such estimator).
      advantages: ``(inputs, section, num_groups) -> [R, N]`` float32 advantages, 0 off the loss
        mask. ``inputs`` is the rollout's :class:`~alignax.trainers.online.algorithm.AdvantageInputs`
        (read by attribute), ``section`` the run's ``grpo:`` section, ``num_groups`` the static
        number of prompts of the rollout (``group_ids`` lie in ``[0, num_groups)``).
      summary: one line for the README's algorithm list and the docs (the paper it is from).
      min_group_size: the samples per prompt it needs (1: none compared).
      greedy_baseline: the rollout also decodes each prompt greedily (ReMax's baseline).
      step_rewards: the rollout scores each reasoning step (process supervision).
      reward_components: it reads each reward component of ``rewards:`` apart, with its weight
        (``inputs.reward_components [R, K]``, ``inputs.reward_weights [K]``).
      token_stats: it reads ``inputs.sum_pi_squared [R, N]``, ``sum_v pi(v)^2``, and
        ``inputs.stat_logps [R, N]``, ``log pi(y_t)``, both of the learner's policy when the
        rollout is priced (one more forward pass over the rollout).
    """

    name: str
    advantages: Callable[[Any, Any, int], Array]
    summary: str
    verl_name: str | None = None
    min_group_size: int = 2
    greedy_baseline: bool = False
    step_rewards: bool = False
    reward_components: bool = False
    token_stats: bool = False


def flat_groups(group_ids: Array, num_groups: int, rows: int, what: str = "rewards") -> Array:
    """``group_ids [rows]`` checked (integers in ``[0, num_groups)``, one per row) as int32."""
    return _check_group_ids(group_ids, _check_num_groups(num_groups), rows, what)


def segment(values: Array, ids: Array, num_groups: int) -> Array:
    """``[num_groups]`` sums of ``values`` by ``ids``, read back per element (``[len(ids)]``)."""
    return jax.ops.segment_sum(values, ids, num_segments=num_groups)[ids]


def per_token(sequence_advantages: Array, loss_mask: Array) -> Array:
    """``[R] -> [R, N]``: each row's advantage on its loss tokens, 0 elsewhere."""
    return jnp.asarray(sequence_advantages, jnp.float32)[:, None] * jnp.asarray(loss_mask, jnp.float32)
