"""The ``env`` section of a run config: which environment plays the non-model turns."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Multi-turn rollouts with an environment (:mod:`alignax.envs`).

    Fields:
      name: a built-in environment (``calculator``, ``retry``; :data:`alignax.envs.ENVIRONMENTS`)
        or a user's class as ``"package.module:Class"``; ``null``: single-turn rollouts.
      kwargs: keyword arguments of the environment's constructor.
      max_turns: model turns per trajectory; the trajectory ends after the last one.
      max_turn_tokens: generation budget of one model turn; ``null``: ``rollout.max_new_tokens``.
        With an environment, ``rollout.max_new_tokens`` is the budget of the whole
        trajectory after the prompt (model and observation tokens together).
      max_observation_tokens: the longest observation (tool results, feedback, the chat
        template's turn markers) appended between turns; a longer one ends the trajectory
        (counted as ``env/ended_observation_too_long``).
    """

    name: str | None = None
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_turns: int = 4
    max_turn_tokens: int | None = None
    max_observation_tokens: int = 64

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"env.max_turns must be >= 1; got {self.max_turns}")
        if self.max_turn_tokens is not None and self.max_turn_tokens < 1:
            raise ValueError(f"env.max_turn_tokens must be >= 1 (or null); got {self.max_turn_tokens}")
        if self.max_observation_tokens < 1:
            raise ValueError(f"env.max_observation_tokens must be >= 1; got {self.max_observation_tokens}")
