"""The calculator tool and the arithmetic environment that lends it to the model.

:func:`evaluate_arithmetic` evaluates arithmetic only: Python's ``ast`` parses the text
and a walker computes numbers, ``+ - * / // % **`` and unary signs over int and float
literals (parentheses by the grammar). Nothing else parses — no names, calls,
attributes, subscripts, comparisons, strings — and nothing is ever ``eval``-ed. Size
limits keep a hostile input cheap: at most ``max_chars`` characters and ``max_nodes``
syntax nodes, integers of at most ``max_digits`` digits (checked *before* a ``*`` or
``**`` computes: ``9**9**9`` is refused, not computed), exponents at most
``max_exponent`` in size; division by zero, overflow and non-finite results are errors.
Every refusal is a :class:`~alignax.envs.tools.ToolError` whose message the model reads.

:class:`CalculatorEnv` poses a reasoning-gym arithmetic question (a prompt record with
``answer`` and ``task``) with the calculator available; a turn with tool calls gets their
results back, a turn without one is the final answer, scored by the task's own scorer
(:func:`alignax.rewards.verifiers.answer_reward`).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Mapping
from typing import Any

from alignax.envs.base import Step
from alignax.envs.tools import Tool, ToolError, has_tool_call, run_tool_calls

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_LOG2_10 = math.log2(10)


def evaluate_arithmetic(expression: str, *, max_chars: int = 200, max_nodes: int = 100, max_digits: int = 100,
                        max_exponent: int = 1000) -> int | float:
    """The value of an arithmetic ``expression``; :class:`ToolError` for anything else."""
    if not isinstance(expression, str):
        raise ToolError(f"expression must be a string; got {type(expression).__name__}")
    if len(expression) > max_chars:
        raise ToolError(f"expression too long: {len(expression)} characters; the limit is {max_chars}")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as err:
        raise ToolError(f"not an arithmetic expression: {err.__class__.__name__}") from None
    nodes = sum(1 for _ in ast.walk(tree))
    if nodes > max_nodes:
        raise ToolError(f"expression too complex: {nodes} syntax nodes; the limit is {max_nodes}")
    max_bits = max_digits * _LOG2_10

    def check(value):
        if isinstance(value, int) and value.bit_length() > max_bits:
            raise ToolError(f"number too large: more than {max_digits} digits")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("the result is not a finite number")
        return value

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            op = type(node.op)
            if op is ast.Pow:
                if abs(right) > max_exponent:
                    raise ToolError(f"exponent too large: {right}; the limit is {max_exponent}")
                if isinstance(left, int) and isinstance(right, int) and right > 0 and \
                        max(left.bit_length() - 1, 0) * right > max_bits:
                    raise ToolError(f"number too large: more than {max_digits} digits")
                if left == 0 and right < 0:
                    raise ToolError("division by zero")
            if op is ast.Mult and isinstance(left, int) and isinstance(right, int) and \
                    left.bit_length() + right.bit_length() > max_bits + 1:
                raise ToolError(f"number too large: more than {max_digits} digits")
            if op in (ast.Div, ast.FloorDiv, ast.Mod) and right == 0:
                raise ToolError("division by zero")
            try:
                value = _BINARY[op](left, right)
            except (OverflowError, ZeroDivisionError, ValueError) as err:
                raise ToolError(f"arithmetic error: {err}") from None
            if isinstance(value, complex):
                raise ToolError("the result is not a real number")
            return check(value)
        raise ToolError(f"only numbers and + - * / // % ** are allowed; found {type(node).__name__}")

    return walk(tree)


def format_number(value: int | float) -> str:
    """A result as the model reads it: integers plainly, whole floats without ``.0``."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def calculator_tool(**limits: int) -> Tool:
    """The ``calculator`` tool: ``{"expression": str}`` -> the value, as text."""
    def run(expression: str) -> str:
        return format_number(evaluate_arithmetic(expression, **limits))

    return Tool(name="calculator",
                description="Evaluate arithmetic: + - * / // % ** and parentheses, e.g. 12 * (3 + 4)",
                parameters={"type": "object", "properties": {"expression": {"type": "string"}},
                            "required": ["expression"]},
                fn=run)


INSTRUCTION = "Use the calculator, then give the final answer in <answer></answer> tags."


class CalculatorEnv:
    """A reasoning-gym question with the calculator; the final answer is scored by the task.

    Args (``env.kwargs``):
      instruction: appended to the question (``null``: :data:`INSTRUCTION`).
      system_prompt: a system message before the question (``null``: none).
      answer_tag / task: as ``rewards.answer_tag`` / ``rewards.task`` for the scorer.
      max_digits: the calculator's integer size limit.

    Reward: the task's score of the final answer (0 to 1), on the last step. ``info``:
    the tool counts of :func:`run_tool_calls` on tool turns; ``correct`` on the final one.
    """

    def __init__(self, *, instruction: str | None = None, system_prompt: str | None = None,
                 answer_tag: str = "answer", task: str | None = None, max_digits: int = 100):
        self.instruction = INSTRUCTION if instruction is None else instruction
        self.system_prompt = system_prompt
        self.answer_tag, self.task = answer_tag, task
        self.tools = (calculator_tool(max_digits=max_digits),)
        self.record: Mapping[str, Any] | None = None

    def reset(self, record: Mapping[str, Any]) -> list[dict[str, str]]:
        if "prompt" not in record or "answer" not in record:
            raise ValueError(f"CalculatorEnv needs records with 'prompt' and 'answer'; got keys {sorted(record)}")
        self.record = record
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        question = f"{record['prompt']}\n{self.instruction}" if self.instruction else str(record["prompt"])
        return messages + [{"role": "user", "content": question}]

    def final_score(self, text: str) -> float:
        from alignax.rewards.verifiers import answer_reward

        scores, _ = answer_reward([text], [self.record], tag=self.answer_tag, task=self.task)
        return float(scores[0])

    def step(self, assistant_message: Mapping[str, Any]) -> Step:
        text = assistant_message["content"]
        if has_tool_call(text):
            messages, counts = run_tool_calls(text, self.tools)
            return Step(messages, 0.0, False, dict(counts))
        score = self.final_score(text)
        return Step([], score, True, {"correct": float(score >= 1.0)})
