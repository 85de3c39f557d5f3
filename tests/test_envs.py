"""alignax.envs on the host: the calculator against hostile input, tool-call parsing and
execution, the environments, the registry and chat rendering (no model, no jit)."""

from __future__ import annotations

import json
import time

import pytest

from alignax.config import ConfigError
from alignax.envs import (CalculatorEnv, RetryEnv, Tool, ToolError, env_factory, evaluate_arithmetic,
                          parse_tool_calls, run_tool_calls, tools_system_prompt)
from alignax.envs.chat import observation_text, render, template_takes_tools
from tests.data.tiny_tokenizer import bpe_tokenizer
from tests.support.toy_agent import agent_tokenizer

CHAIN = {"prompt": "State the final answer: 123456789 + 987654321 =", "answer": "1111111110", "task": "chain_sum"}


def call(name, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


@pytest.mark.parametrize("expression, value", [
    ("123456789 + 987654321", 1111111110), ("2 * (3 + 4) - -1", 15), ("7 / 2", 3.5), ("7 // 2", 3), ("-7 % 3", 2),
    ("2 ** 10", 1024), ("1.5e3 + 0.5", 1500.5), ("+3", 3),
])
def test_calculator_computes_arithmetic(expression, value):
    assert evaluate_arithmetic(expression) == value  # Python's own arithmetic on the same literals


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('echo pwned')", "only numbers"),
    ("open('/etc/passwd').read()", "only numbers"),
    ("(1).__class__", "only numbers"),
    ("x + 1", "only numbers"),
    ("[1, 2][0]", "only numbers"),
    ("'a' * 3", "only numbers"),
    ("1 if 1 else 2", "only numbers"),
    ("lambda: 1", "only numbers"),
    ("True + 1", "only numbers"),
    ("1 < 2", "only numbers"),
    ("3j * 2", "only numbers"),
    ("9 ** 9 ** 9", "exponent too large"),
    ("10 ** 500", "number too large"),
    ("(10 ** 60) * (10 ** 60)", "number too large"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("1e308 * 10", "not a finite number"),
    ("(-8) ** 0.5", "not a real number"),
    ("(" * 150 + "1" + ")" * 150, "too long"),
    ("-" * 150 + "1", "too complex"),
    ("1 +", "not an arithmetic expression"),
    ("1" * 101, "number too large"),
])
def test_calculator_refuses_hostile_input_quickly(expression, message):
    start = time.perf_counter()
    with pytest.raises(ToolError, match=message):
        evaluate_arithmetic(expression)
    assert time.perf_counter() - start < 1.0  # refused before computing, not after


def test_tool_calls_parse_in_the_hermes_form():
    text = ('I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"3\\"}"}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": </tool_call>'
            '<tool_call>["calculator"]</tool_call><tool_call>{"name": "c", "arguments": [1]}</tool_call><tool_call>{')
    calls, errors = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "1+2"}),
                                                     ("calculator", {"expression": "3"})]
    assert len(errors) == 4
    assert "not valid JSON" in errors[0] and '{"name"' in errors[1] and "JSON object" in errors[2]
    assert "without a closing" in errors[3]


def test_run_tool_calls_turns_every_failure_into_an_observation():
    env = CalculatorEnv()
    text = (call("calculator", expression="6 * 7") + call("calculator", expression="1/0") + call("search", q="x")
            + call("calculator", expr="1") + call("calculator", expression=5) + "<tool_call>{oops</tool_call>")
    messages, counts = run_tool_calls(text, env.tools)
    contents = [m["content"] for m in messages]
    assert all(m["role"] == "tool" for m in messages)
    assert contents[0].startswith("error: malformed tool call")  # malformed first, then in call order
    assert contents[1] == "42"
    assert "division by zero" in contents[2]
    assert "unknown tool 'search'" in contents[3]
    assert "missing required argument(s) expression" in contents[4]
    assert "must be of JSON type string" in contents[5]
    assert counts == {"tool_calls": 6, "malformed_calls": 1, "tool_errors": 4}


def test_calculator_env_scores_the_final_answer_with_the_task():
    env = CalculatorEnv()
    messages = env.reset(CHAIN)
    assert messages[-1]["role"] == "user" and CHAIN["prompt"] in messages[-1]["content"]
    reply, reward, done, info = env.step({"role": "assistant",
                                          "content": call("calculator", expression="123456789 + 987654321")})
    assert reply == [{"role": "tool", "content": "1111111110"}] and reward == 0.0 and not done
    assert info == {"tool_calls": 1, "malformed_calls": 0, "tool_errors": 0}
    assert env.step({"role": "assistant", "content": "<answer>1111111110</answer>"}) == ([], 1.0, True,
                                                                                        {"correct": 1.0})
    assert env.step({"role": "assistant", "content": "<answer>1111111111</answer>"})[1:3] == (0.0, True)


def test_retry_env_gives_feedback_and_a_turn_penalty():
    env = RetryEnv(max_attempts=3, turn_penalty=0.25)
    env.reset(CHAIN)
    reply, reward, done, _ = env.step({"role": "assistant", "content": "<answer>5</answer>"})
    assert reply == [{"role": "user", "content": "Your answer 5 is wrong. Try again."}] and reward == 0 and not done
    reply, _, done, _ = env.step({"role": "assistant", "content": "no idea"})
    assert "no answer" in reply[0]["content"] and not done
    _, reward, done, info = env.step({"role": "assistant", "content": "<answer>1111111110</answer>"})
    assert (reward, done, info) == (1.0 - 2 * 0.25, True, {"correct": 1.0})  # third attempt
    env.reset(CHAIN)
    for _ in range(2):
        env.step({"role": "assistant", "content": "<answer>1</answer>"})
    assert env.step({"role": "assistant", "content": "<answer>1</answer>"})[1:] == (0.0, True, {"correct": 0.0})


def test_registry_names_builtins_and_user_classes_and_refuses_bad_ones():
    assert isinstance(env_factory("calculator")(), CalculatorEnv)
    assert env_factory("retry", {"max_attempts": 2})().max_attempts == 2
    assert type(env_factory("tests.support.toy_agent:LookupEnv")()).__name__ == "LookupEnv"
    with pytest.raises(ConfigError, match="not a built-in environment"):
        env_factory("calculater")
    with pytest.raises(ConfigError, match="env.kwargs"):
        env_factory("retry", {"max_attempts": 0})
    with pytest.raises(ConfigError, match="env.kwargs"):
        env_factory("calculator", {"colour": "red"})
    with pytest.raises(ConfigError, match="lacks reset and step"):
        env_factory("alignax.envs.tools:ToolCall", {"name": "x", "arguments": {}})


def test_tools_render_through_the_template_when_it_takes_them_else_in_the_system_prompt():
    tool = Tool("lookup", "the secret", {"type": "object", "properties": {}}, fn=lambda: "yes")
    agent = agent_tokenizer()  # its template renders tools (a system turn naming them)
    assert template_takes_tools(agent)
    assert render(agent, [{"role": "user", "content": "hi"}], [tool], add_generation_prompt=True) == (
        "<|im_start|>system\nlookup<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    plain = bpe_tokenizer()  # SmolLM2's template: no tools
    assert not template_takes_tools(plain)
    text = render(plain, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], [tool],
                  add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n" + tools_system_prompt([tool]) + "<|im_end|>\n")
    search = Tool("search", "find pages", {"type": "object", "properties": {"query": {"type": "string"}, "k": {
        "type": "integer", "description": "how many"}}, "required": ["query"]}, fn=lambda query, k=3: "")
    assert tools_system_prompt([tool, search]) == (  # the compact fallback, written out
        'Call a tool as <tool_call>{"name": <tool>, "arguments": <object>}</tool_call>. Tools:\n'
        '{"name": "lookup", "description": "the secret", "arguments": {}}\n'
        '{"name": "search", "description": "find pages", "arguments": {"query": "string", "k": "integer, optional"}}')


def test_observation_text_is_what_the_template_writes_between_model_turns():
    tok = bpe_tokenizer()
    history = [{"role": "user", "content": "hi"}]
    assistant = {"role": "assistant", "content": "call"}
    new = [{"role": "tool", "content": "42"}]
    full = render(tok, [*history, assistant, *new], add_generation_prompt=True)
    # the trajectory holds the prompt, the model's text and its EOS; the observation is the rest
    before = render(tok, history, add_generation_prompt=True) + "call<|im_end|>"
    observation = observation_text(tok, history, assistant, new, turn_ended_with_eos=True)
    assert before + observation == full
    assert observation == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    # a turn that ended on another stop token is closed by the observation
    assert observation_text(tok, history, assistant, new, turn_ended_with_eos=False) == "<|im_end|>" + observation


def test_calculator_traces_train_the_assistant_turns_with_the_rollouts_prompt():
    from alignax.data.builders import reasoning_gym_prompts
    from alignax.data.formats import Encoder
    from alignax.envs.traces import calculator_traces

    tok = bpe_tokenizer()  # SmolLM2's template: tools go into the system prompt
    records = reasoning_gym_prompts("chain_sum", size=4, seed=0)
    traces = calculator_traces(records)
    assert len(traces) == 4
    env = CalculatorEnv()
    encoder = Encoder(tok, format="sft", max_length=4096, max_prompt_length=2048)  # a 300-token BPE: long ids
    for record, trace in zip(records, traces):
        roles = [m["role"] for m in trace["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant"]
        result = trace["messages"][3]["content"]
        assert env.reset(record) and env.final_score(trace["messages"][4]["content"]) == 1.0
        assert float(result) == float(record["answer"])
        encoded = encoder.encode(trace)
        # the prompt is what the multi-turn rollout renders for the same record
        prompt = tok.encode(render(tok, env.reset(record), env.tools, add_generation_prompt=True),
                            add_special_tokens=False)
        assert encoded.prompt == prompt
        ids, mask = encoded.responses["response"]
        trained = tok.decode([i for i, m in zip(ids, mask) if m])
        context = tok.decode([i for i, m in zip(ids, mask) if not m])
        call, answer = trace["messages"][2]["content"], trace["messages"][4]["content"]
        assert trained == f"{call}<|im_end|>{answer}<|im_end|>"  # assistant turns and their end tokens only
        assert f"tool\n{result}" in context and result not in trained.replace(answer, "")
