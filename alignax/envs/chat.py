"""Conversations of a multi-turn rollout as text: the prompt with its tools, and the
observation that follows each model turn.

Tools go through the tokenizer's chat template when the template takes them (its source
mentions ``tools``: Qwen2.5, Qwen3, Llama 3.1+); otherwise :func:`alignax.envs.tools.tools_system_prompt`
is appended to the first system message, or added as one (the documented fallback).

Observation tokens are what the template writes between the end of the model's turn and
the start of its next one: :func:`observation_text` renders the conversation with and
without the new messages and takes the difference, so the trajectory holds exactly the
template's text and nothing is re-tokenised around the model's own tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from alignax.envs.tools import Tool, tool_schemas, tools_system_prompt


def template_takes_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(template, str) and "tools" in template


def with_tools_prompt(messages: Sequence[dict], tools: Sequence[Tool]) -> list[dict]:
    """``messages`` with :func:`~alignax.envs.tools.tools_system_prompt` appended to the first
    system message, or added as one: the rendering for templates that take no tools."""
    messages = [dict(m) for m in messages]
    if not tools:
        return messages
    text = tools_system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{text}"
    else:
        messages.insert(0, {"role": "system", "content": text})
    return messages


def _with_tools(tokenizer, messages: Sequence[dict], tools: Sequence[Tool]) -> tuple[list[dict], dict[str, Any]]:
    if tools and template_takes_tools(tokenizer):
        return [dict(m) for m in messages], {"tools": tool_schemas(tools)}
    return with_tools_prompt(messages, tools), {}


def render(tokenizer, messages: Sequence[dict], tools: Sequence[Tool] = (), *,
           add_generation_prompt: bool) -> str:
    """The conversation as the chat template writes it, tools included (module docstring)."""
    messages, extra = _with_tools(tokenizer, messages, tools)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **extra)


def observation_text(tokenizer, history: Sequence[dict], assistant: dict, new_messages: Sequence[dict],
                     tools: Sequence[Tool] = (), *, turn_ended_with_eos: bool) -> str:
    """The text after the model's turn ``assistant`` up to the generation prompt of its next
    turn: the template's end of the assistant turn, ``new_messages``, and the next
    assistant header.

    ``turn_ended_with_eos``: the model's last token was the tokenizer's EOS (the template's
    end of turn), which the trajectory already holds; otherwise (the turn ended on another
    stop token) the EOS text is part of the observation. Raises ``ValueError`` when the
    template does not render the longer conversation as an extension of the shorter one.
    """
    before = render(tokenizer, [*history, assistant], tools, add_generation_prompt=False)
    after = render(tokenizer, [*history, assistant, *new_messages], tools, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the chat template does not render a longer conversation as an extension of the shorter "
                         "one, so observations cannot be appended turn by turn")
    eos = tokenizer.eos_token
    end = before.rfind(eos) if eos else -1
    if end < 0:
        raise ValueError(f"the chat template does not close an assistant turn with the EOS token {eos!r}")
    closing = before[end + len(eos):]
    return ("" if turn_ended_with_eos else eos) + closing + after[len(before):]
