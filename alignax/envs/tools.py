"""Tool calling: tools declared with JSON schemas, calls parsed from the model's text,
results returned as observation messages.

Calls are written in the Hermes / Qwen2.5 form::

    <tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>

:func:`parse_tool_calls` finds every such block in an assistant turn; a block that is not
a JSON object with a string ``name`` and an object ``arguments`` (or a JSON string of
one), or an unclosed ``<tool_call>``, is a *malformed* call. :func:`run_tool_calls` runs
the well-formed ones and turns everything — results, malformed calls, unknown tools,
arguments that fail the schema, a tool's :class:`ToolError` — into ``tool`` messages
that say what happened, with counts for monitoring. Nothing a model writes crashes the
rollout.

Rendering: :func:`tool_schemas` gives the OpenAI-style list that Hugging Face chat
templates take as ``tools=`` (Qwen2.5/Qwen3 templates render it); for templates without
tool support :func:`tools_system_prompt` is the documented fallback, a compact one (see its
docstring).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


class ToolError(Exception):
    """Raised by a tool for a bad input it can explain; the message becomes the observation."""


@dataclasses.dataclass(frozen=True)
class Tool:
    """A tool: ``fn(**arguments) -> str`` described by a JSON schema of its arguments.

    ``parameters`` is a JSON-schema object (``{"type": "object", "properties": {...},
    "required": [...]}``); arguments are checked against its ``required`` keys, the
    ``properties`` it names (extra keys refused) and their primitive ``type``.
    """

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., str]

    def schema(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)}}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def tool_schemas(tools: Sequence[Tool]) -> list[dict[str, Any]]:
    return [t.schema() for t in tools]


def tools_system_prompt(tools: Sequence[Tool]) -> str:
    """The fallback rendering of tools for chat templates that do not take ``tools``.

    Compact, because every prompt carries it (79 SmolLM2 tokens for the calculator, against
    197 for the Hermes wording with whole JSON schemas): the call format, then one
    JSON line per tool with its ``name``, ``description`` and ``arguments`` (each argument's
    JSON type, ``"<type>, optional"`` when the schema does not require it)::

        Call a tool as <tool_call>{"name": <tool>, "arguments": <object>}</tool_call>. Tools:
        {"name": "calculator", "description": "...", "arguments": {"expression": "string"}}

    The rollout appends it to the conversation's system message (or adds a system message
    holding it); :func:`alignax.envs.chat.with_tools_prompt`."""
    lines = []
    for tool in tools:
        required = set(tool.parameters.get("required", ()))
        arguments = {name: str(spec.get("type", "any")) + ("" if name in required else ", optional")
                     for name, spec in tool.parameters.get("properties", {}).items()}
        lines.append(json.dumps({"name": tool.name, "description": tool.description, "arguments": arguments},
                                ensure_ascii=False))
    return ('Call a tool as <tool_call>{"name": <tool>, "arguments": <object>}</tool_call>. Tools:\n'
            + "\n".join(lines))


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """``(well-formed calls, one error text per malformed call)`` in the order written."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for body in _CALL.findall(text):
        try:
            payload = json.loads(body)
        except (json.JSONDecodeError, RecursionError) as err:
            errors.append(f"malformed tool call: the body is not valid JSON ({err.__class__.__name__}: {err})"[:300])
            continue
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            errors.append('malformed tool call: expected a JSON object {"name": <string>, "arguments": <object>}')
            continue
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            errors.append(f"malformed tool call to {payload['name']!r}: arguments must be a JSON object")
            continue
        calls.append(ToolCall(payload["name"], arguments))
    unclosed = text.count(TOOL_CALL_OPEN) - len(_CALL.findall(text))
    errors.extend(["malformed tool call: <tool_call> without a closing </tool_call>"] * max(unclosed, 0))
    return calls, errors


def has_tool_call(text: str) -> bool:
    return TOOL_CALL_OPEN in text


def check_arguments(tool: Tool, arguments: Mapping[str, Any]) -> str | None:
    """Why ``arguments`` do not fit ``tool``'s schema, or ``None``."""
    properties = tool.parameters.get("properties", {})
    missing = [k for k in tool.parameters.get("required", ()) if k not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(missing)} for tool {tool.name!r}"
    extra = [k for k in arguments if k not in properties]
    if extra:
        return f"unknown argument(s) {', '.join(extra)} for tool {tool.name!r}; it takes {', '.join(properties)}"
    for key, value in arguments.items():
        kind = properties[key].get("type")
        if kind in _JSON_TYPES and (not isinstance(value, _JSON_TYPES[kind]) or
                                    (isinstance(value, bool) and kind != "boolean")):
            return f"argument {key!r} of tool {tool.name!r} must be of JSON type {kind}; got {value!r}"[:300]
    return None


def run_tool_calls(text: str, tools: Sequence[Tool]) -> tuple[list[dict[str, str]], dict[str, int]]:
    """The ``tool`` messages answering every call in ``text``, and the counts
    ``{"tool_calls", "malformed_calls", "tool_errors"}`` (malformed calls count as calls)."""
    by_name = {t.name: t for t in tools}
    calls, malformed = parse_tool_calls(text)
    messages = [{"role": "tool", "content": f"error: {e}"} for e in malformed]
    errors = 0
    for call in calls:
        tool = by_name.get(call.name)
        problem = (f"unknown tool {call.name!r}; available: {', '.join(by_name)}" if tool is None
                   else check_arguments(tool, call.arguments))
        if problem is None:
            try:
                result = tool.fn(**call.arguments)
            except ToolError as err:
                problem = str(err)
            else:
                messages.append({"role": "tool", "content": str(result)})
                continue
        errors += 1
        messages.append({"role": "tool", "content": f"error: {problem}"})
    return messages, {"tool_calls": len(calls) + len(malformed), "malformed_calls": len(malformed),
                      "tool_errors": errors}
