"""The environment protocol of multi-turn RL: what a rollout asks of an environment.

An environment plays every turn that is not the model's. One instance serves one
trajectory (the rollout makes a fresh one per row from the factory a config names):

- ``reset(record) -> messages``: the conversation the model starts from (chat messages,
  ``{"role": ..., "content": ...}``), built from one prompt record of the data.
- ``step(assistant_message) -> (new_messages, reward, done, info)``: the model's turn as a
  message; the environment answers with the messages that follow it (tool results, user
  feedback), the reward of this step, whether the trajectory is over, and counts in
  ``info`` (keys of :data:`INFO_COUNTS` are summed per trajectory for monitoring;
  ``info["correct"]`` on the last step is the trajectory's verdict for accuracy).

A trajectory's reward is the sum of its step rewards (per-step rewards and a final one
are both just step rewards; sequence-level advantages see the sum). ``tools`` lists the
tools the environment executes (:class:`alignax.envs.tools.Tool`); the rollout renders
their schemas into the prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

from alignax.config import ConfigError

Message = dict[str, Any]

# Per-step counts an environment may report in ``info``; the rollout sums them per trajectory.
INFO_COUNTS = ("tool_calls", "malformed_calls", "tool_errors")


class Step(NamedTuple):
    """What :meth:`Environment.step` returns (a plain 4-tuple works as well)."""

    messages: list[Message]
    reward: float
    done: bool
    info: dict[str, Any]


@runtime_checkable
class Environment(Protocol):
    """One trajectory's environment; see the module docstring."""

    tools: Sequence[Any]

    def reset(self, record: Mapping[str, Any]) -> list[Message]:
        ...

    def step(self, assistant_message: Message) -> tuple[list[Message], float, bool, dict[str, Any]]:
        ...


class EnvError(ConfigError):
    """An environment's ``reset`` raised, or returned what is not a conversation: the run
    cannot build that record's prompt. The message names ``env.name`` and the record; the
    environment's exception is chained (``__cause__``). (A failing ``step`` only ends its
    trajectory: ``env_error``.)"""


def check_messages(messages: Any, *, where: str) -> list[Message]:
    """``messages`` as a list of ``{"role": str, "content": str}`` dicts, or a ``TypeError``
    naming ``where`` (the environment method that returned them) and the bad entry."""
    if not isinstance(messages, (list, tuple)):
        raise TypeError(f"{where} must return a list of chat messages; got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise TypeError(f"{where}: message {i} must be a mapping with string 'role' and 'content'; got {m!r}")
    return [dict(m) for m in messages]
