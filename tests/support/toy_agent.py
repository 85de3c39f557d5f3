"""A toy tool-use task for multi-turn RL tests on a word-level model.

The toy model's vocabulary (tests/support/toy_model.py) plus ``tool`` and one token that *is* a
whole tool call, ``<tool_call>{"name": "lookup", "arguments": {}}</tool_call>``, so a
two-layer model can learn to call. :class:`LookupEnv`: the record's ``answer`` (a secret
word, not in the prompt) is only reachable through the ``lookup`` tool; the reward is 1
when the final answer's first word is the secret. The chat template renders tools (its
source names ``tools``) as a short system turn.
"""

from __future__ import annotations

import os
import random

from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from alignax.envs import Step, Tool, run_tool_calls
from alignax.envs.tools import has_tool_call
from alignax.models import ModelConfig, create_model, save_pretrained
from tests.data.tiny_tokenizer import IDS, SPECIALS

CALL = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
BAD_CALL = '<tool_call>{"name": "lookup", "arguments": </tool_call>'
SECRETS = ("yes", "no", "ok", "sure")
PROMPT_WORDS = ("hi", "there", "bye", "now", "what", "is", "two", "plus", "four")
AGENT_CHATML = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}{% for t in tools %}{{ t['function']['name'] }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def agent_tokenizer() -> PreTrainedTokenizerFast:
    vocab = dict(IDS)
    for word in ("tool", "lookup"):
        vocab[word] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(" ", behavior="removed"), pre_tokenizers.Split(Regex("\n"), behavior="isolated")])
    backend.add_special_tokens(SPECIALS)
    backend.add_tokens([CALL, BAD_CALL])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                   unk_token="[UNK]", chat_template=AGENT_CHATML)


def make_agent_model(directory, seed: int = 0, layers: int = 2) -> str:
    """Write the toy agent model (two layers, so that it can learn to call) and its
    tokenizer to ``directory``; ``layers=1`` for checks that need no learning (quicker to
    compile)."""
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    tok = agent_tokenizer()
    end, start = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|im_start|>")
    hf = dict(model_type="llama", vocab_size=32, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=256,
              rms_norm_eps=1e-5, tie_word_embeddings=True, eos_token_id=end, pad_token_id=end, bos_token_id=start)
    save_pretrained(create_model(ModelConfig.from_hf_config(hf), seed=seed), directory)
    tok.save_pretrained(directory)
    return directory


def lookup_records(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": " ".join(rng.choice(PROMPT_WORDS) for _ in range(2)), "answer": rng.choice(SECRETS)}
            for _ in range(n)]


def balanced_lookup_records() -> list[dict]:
    """16 prompts, each with every secret once: a policy that ignores the tool's result
    (it may read the prompt) is right on at most 1/4 of them."""
    return [{"prompt": f"{a} {b}", "answer": s} for a in PROMPT_WORDS[:4] for b in PROMPT_WORDS[4:8] for s in SECRETS]


def warm_start_reader(model_dir, out, records: list[dict], *, repeat: int, steps: int = 96,
                      learning_rate: float = 1e-2) -> str:
    """Teacher-forced warm start of the toy agent model on :class:`LookupEnv` trajectories,
    written to ``out``: cross-entropy on the first assistant token (the call on even rows,
    a guessed secret on odd rows, so the policy calls about half the time), on the answer
    after the tool's result (the secret), and on the end of turn after it. Adam, every
    step over all rows (full batch), the prompt rendered as the rollout renders it (tools
    included). Why not the SFT trainer: see docs/algorithms/agents.md."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from alignax.envs.chat import render
    from alignax.models import from_pretrained

    tok = agent_tokenizer()
    env = LookupEnv(repeat=repeat)
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    call, eos = tok.convert_tokens_to_ids(CALL), tok.eos_token_id
    rows, first, answer = [], [], []
    for i, record in enumerate(records):
        messages = env.reset(record)
        observation = {"role": "tool", "content": env.tools[0].fn()}
        start = len(ids(render(tok, messages, env.tools, add_generation_prompt=True)))
        text = render(tok, [*messages, {"role": "assistant", "content": CALL}, observation], env.tools,
                      add_generation_prompt=True)
        rows.append(ids(text) + [tok.convert_tokens_to_ids(record["answer"])])
        first.append(call if i % 2 == 0 else tok.convert_tokens_to_ids(SECRETS[(i // 2) % len(SECRETS)]))
        answer.append(rows[-1][-1])
    tokens, first, answer = jnp.asarray(rows), jnp.asarray(first), jnp.asarray(answer)
    graphdef, state = nnx.split(from_pretrained(str(model_dir)))
    opt = optax.adam(learning_rate)

    def loss(state, tokens, first, answer):
        logps = jax.nn.log_softmax(nnx.merge(graphdef, state)(tokens).logits, axis=-1)
        pick = lambda t, target: jnp.take_along_axis(logps[:, t], target[:, None], axis=1).mean()  # noqa: E731
        return -(pick(start - 1, first) + pick(-2, answer) + logps[:, -1, eos].mean()) / 3

    @jax.jit
    def step(state, opt_state, rows):
        grads = jax.grad(loss)(state, tokens[rows], first[rows], answer[rows])
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state

    opt_state = opt.init(state)
    everything = jnp.arange(len(rows))
    for _ in range(steps):
        state, opt_state = step(state, opt_state, everything)
    save_pretrained(nnx.merge(graphdef, state), str(out))
    tok.save_pretrained(str(out))
    return str(out)


class LookupEnv:
    """``lookup`` returns the record's secret; a turn without a call is the final answer,
    rewarded 1 when its first word is the secret.

    ``repeat``: the result writes the secret that many times (a long observation the random
    two-layer model learns to read in a few dozen SFT steps; one copy took over 60).
    ``hide``: the result is that word instead of the secret (a useless observation, the
    control arm of the learning test)."""

    def __init__(self, call_bonus: float = 0.0, repeat: int = 1, hide: str | None = None):
        self.call_bonus = call_bonus  # reward of the first well-formed call (shaping), once per trajectory
        self.called = False
        self.tools = (Tool("lookup", "the secret word", {"type": "object", "properties": {}},
                           fn=lambda: " ".join([hide or self.secret] * repeat)),)
        self.secret = None

    def reset(self, record):
        self.secret = record["answer"]
        return [{"role": "user", "content": record["prompt"]}]

    def step(self, message):
        text = message["content"]
        if has_tool_call(text):
            messages, counts = run_tool_calls(text, self.tools)
            bonus = self.call_bonus if not self.called and counts["malformed_calls"] == 0 else 0.0
            self.called = True
            return Step(messages, bonus, False, counts)
        words = text.split()
        correct = float(bool(words) and words[0] == self.secret)
        return Step([], correct, True, {"correct": correct})


class ChattyEnv(LookupEnv):
    """Never done: answers every turn with a user message; reports a malformed call and a
    tool error on each step, and 0.25 reward per step (the rollout sums them)."""

    def __init__(self, reply: str = "no"):
        super().__init__()
        self.reply = reply

    def step(self, message):
        return Step([{"role": "user", "content": self.reply}], 0.25, False,
                    {"tool_calls": 2, "malformed_calls": 1, "tool_errors": 1})


def agent_config(tmp_path, model_dir: str, *, steps: int, overrides=(), **sections):
    """configs/tiny-grpo-calculator.yaml on the toy agent model with :class:`LookupEnv`."""
    from tests.support.trainer_helpers import tiny_config

    base = {
        "data": {"max_prompt_length": 16, "batch_size": 4, "eval_fraction": 0.25},
        "rollout": {"max_new_tokens": 24},
        "env": {"name": "tests.support.toy_agent:LookupEnv", "max_turns": 3, "max_turn_tokens": 4,
                "max_observation_tokens": 12},
        "evaluation": {"max_prompts": 4},
        "checkpoint": {"enabled": False},
        "optim": {"learning_rate": 2e-2},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return tiny_config(tmp_path, "grpo-calculator", steps=steps, model_dir=model_dir, overrides=tuple(overrides),
                       **base)
