"""Tool-use traces for SFT: conversations in which the model calls the calculator and then
answers, in the existing ``sft`` data format (a warm start before multi-turn RL).

A trace is ``{"messages": [...], "answer", "task"}``: the system message holding the tools
(:func:`alignax.envs.tools.tools_system_prompt`, the rendering the rollout uses for chat
templates that take no ``tools``, e.g. SmolLM2's), the environment's question, an assistant
turn with one ``<tool_call>``, the tool's result, and the final assistant answer. The
``sft`` format trains the two assistant turns only (their tokens up to and including each
end-of-turn token); the system prompt, the question and the tool's result are context with
loss mask 0 — the same masks a multi-turn rollout gives those tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

from alignax.envs.calculator import CalculatorEnv
from alignax.envs.chat import with_tools_prompt
from alignax.envs.tools import ToolError

_EXPRESSION = re.compile(r"([-+*/().\d\s]+?)\s*=\s*$")


def question_expression(question: str) -> str | None:
    """The arithmetic at the end of a reasoning-gym question (``"...: 12 + 7 ="`` -> ``"12 + 7"``)."""
    match = _EXPRESSION.search(question.strip())
    return match.group(1).strip() if match else None


def calculator_traces(records: Iterable[Mapping[str, Any]], env: CalculatorEnv | None = None) -> list[dict]:
    """SFT conversations for prompt ``records`` (``reasoning_gym_prompts``) whose question
    ends in an arithmetic expression: the call, the result, the answer. A record is kept
    only when the environment scores that answer 1 (the trace is right)."""
    env = env or CalculatorEnv()
    calculator = env.tools[0]
    out = []
    for record in records:
        expression = question_expression(str(record["prompt"]))
        if expression is None:
            continue
        try:
            result = calculator.fn(expression=expression)
        except ToolError:
            continue
        messages = with_tools_prompt(env.reset(record), env.tools)
        call = json.dumps({"name": calculator.name, "arguments": {"expression": expression}})
        answer = f"<answer>{result}</answer>"
        if env.final_score(answer) < 1.0:
            continue
        out.append({"messages": [*messages, {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                                 {"role": "tool", "content": result}, {"role": "assistant", "content": answer}],
                    "answer": record["answer"], "task": record.get("task")})
    return out
