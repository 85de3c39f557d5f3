"""A multi-turn reasoning-gym environment with feedback between turns.

:class:`RetryEnv` asks a reasoning-gym question; a wrong final answer gets a user turn
saying so ("Your answer X is wrong. Try again.") until ``max_attempts`` answers were
given. A correct answer on attempt ``k`` (1-based) ends the trajectory with reward
``max(1 - turn_penalty * (k - 1), 0)``; running out of attempts ends it with 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from alignax.envs.base import Step
from alignax.envs.calculator import CalculatorEnv


class RetryEnv(CalculatorEnv):
    """Answer, hear "wrong, try again", answer again; see the module docstring.

    Args (``env.kwargs``): ``max_attempts`` (>= 1), ``turn_penalty`` (>= 0) and
    :class:`CalculatorEnv`'s ``instruction`` / ``system_prompt`` / ``answer_tag`` / ``task``.
    It has no tools.
    """

    INSTRUCTION = "Give the final answer in <answer></answer> tags."

    def __init__(self, *, max_attempts: int = 3, turn_penalty: float = 0.2, instruction: str | None = None,
                 **kwargs: Any):
        if int(max_attempts) != max_attempts or max_attempts < 1:
            raise ValueError(f"RetryEnv max_attempts must be an integer >= 1; got {max_attempts!r}")
        if not turn_penalty >= 0:
            raise ValueError(f"RetryEnv turn_penalty must be >= 0; got {turn_penalty!r}")
        super().__init__(instruction=self.INSTRUCTION if instruction is None else instruction, **kwargs)
        self.tools = ()
        self.max_attempts, self.turn_penalty = int(max_attempts), float(turn_penalty)
        self.attempts = 0

    def reset(self, record: Mapping[str, Any]) -> list[dict[str, str]]:
        self.attempts = 0
        return super().reset(record)

    def step(self, assistant_message: Mapping[str, Any]) -> Step:
        from alignax.rewards.verifiers import extract_answer

        self.attempts += 1
        text = assistant_message["content"]
        if self.final_score(text) >= 1.0:
            return Step([], max(1.0 - self.turn_penalty * (self.attempts - 1), 0.0), True, {"correct": 1.0})
        if self.attempts >= self.max_attempts:
            return Step([], 0.0, True, {"correct": 0.0})
        given = extract_answer(text, tag=self.answer_tag)
        said = "You gave no answer in <answer></answer> tags." if given is None else f"Your answer {given} is wrong."
        return Step([{"role": "user", "content": f"{said} Try again."}], 0.0, False, {})
