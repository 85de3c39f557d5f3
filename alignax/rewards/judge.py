"""An LLM judge as a reward (RLAIF): a local language model reads a rubric filled with the
prompt and the completion, and the reward is the log-probability it gives its verdict.

No text is generated or parsed. The judge's input is the rubric as a user turn through the
judge's chat template with the generation prompt (its own tokenizer: it need not share the
policy's), followed by a verdict's tokens; the score of a verdict is the sum of those
tokens' log-probabilities (teacher-forced, one forward pass for every completion and
verdict). With verdicts ``(positive, negative)``:

- ``logp``: ``log p(positive | rubric)``, in (-inf, 0];
- ``normalized``: ``p(positive) / (p(positive) + p(negative))``, in [0, 1] (the verdict
  probability renormalised over the two answers, as in Zheng et al. 2023's and Lee et al.
  2023's RLAIF preference labels).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from alignax import models

DEFAULT_RUBRIC = ("Question: {prompt}\nAnswer: {completion}\n"
                  "Is the answer correct and well reasoned? Reply with yes or no.")
JUDGE_SCORES = ("logp", "normalized")


def _prompt_text(reference: Mapping[str, Any]) -> str:
    prompt = reference.get("prompt", reference.get("question", ""))
    if isinstance(prompt, list):  # chat messages: the last user turn is the question
        users = [m.get("content", "") for m in prompt if isinstance(m, Mapping) and m.get("role") == "user"]
        return users[-1] if users else ""
    return str(prompt)


@functools.partial(jax.jit, static_argnums=0)
def _sequence_logps(graphdef, state, tokens, attention, target_mask):
    """``sum_t log p(tokens[t] | tokens[:t])`` over ``target_mask`` ``[B]``."""
    model = nnx.merge(graphdef, state)
    positions = jnp.maximum(jnp.cumsum(attention, axis=-1) - 1, 0)
    hidden = model(tokens, positions, attention, return_logits=False).hidden
    logps = models.token_logprobs_from_hidden(hidden[:, :-1], model, tokens[:, 1:])
    return jnp.sum(jnp.where(target_mask[:, 1:] > 0, logps, 0.0), axis=-1)


class Judge:
    """A frozen judge model and its tokenizer.

    Args:
      model: a registry name (``smollm2-135m-instruct``) or a local Hugging Face folder.
      rubric: ``str.format`` template with ``{prompt}`` and ``{completion}``.
      verdicts: ``(positive, negative)`` answer texts, e.g. ``("yes", "no")``.
      score: ``logp`` or ``normalized`` (module docstring).
      bucket: sequences are right-padded to a multiple of this many tokens (fewer compiles).
      param_dtype: the judge's weights (a run's ``precision.frozen_dtype``); it computes in
        float32 whatever they are.
    """

    def __init__(self, model: str, *, rubric: str = DEFAULT_RUBRIC, verdicts: Sequence[str] = ("yes", "no"),
                 score: str = "logp", mesh=None, bucket: int = 64, param_dtype: str = "float32"):
        if "{completion}" not in rubric:
            raise ValueError(f"rewards.judge_rubric must contain {{completion}}; got {rubric!r}")
        if len(verdicts) != 2 or not all(v.strip() for v in verdicts) or verdicts[0] == verdicts[1]:
            raise ValueError(f"rewards.judge_verdicts must be two different non-empty texts; got {list(verdicts)}")
        if score not in JUDGE_SCORES:
            raise ValueError(f"rewards.judge_score {score!r}; valid: {', '.join(JUDGE_SCORES)}")
        module, self.tokenizer = models.load(model, mesh=mesh, key="rewards.judge_model",
                                            param_dtype=param_dtype)
        self.graphdef, self.state = nnx.split(module)
        self.rubric, self.verdicts, self.score_kind, self.bucket = rubric, tuple(verdicts), score, bucket
        self.verdict_ids = [self.tokenizer.encode(v, add_special_tokens=False) for v in self.verdicts]

    def judge_prompt_ids(self, prompt: str, completion: str) -> list[int]:
        """The judge's input before the verdict: the filled rubric as a user turn (chat
        template with the generation prompt when the tokenizer has one)."""
        return self.turn_ids(self.rubric.format(prompt=prompt, completion=completion))

    def turn_ids(self, text: str) -> list[int]:
        """``text`` as the judge's user turn, ready for a verdict: through the chat template
        with the generation prompt when the tokenizer has one, else as it is."""
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(text)

    def verdict_logps(self, prompts: Sequence[str], completions: Sequence[str]) -> np.ndarray:
        """``[R, 2]``: ``log p(verdict | judge prompt)`` of the positive and negative verdict."""
        return self.verdict_logps_of([self.judge_prompt_ids(p, c) for p, c in zip(prompts, completions)])

    def verdict_logps_of(self, heads: Sequence[Sequence[int]]) -> np.ndarray:
        """``[R, 2]``: the two verdicts' log-probs after each judge input ``heads[r]`` (token ids)."""
        rows, targets = [], []
        for head in heads:
            head = list(head)
            for ids in self.verdict_ids:
                rows.append(head + ids)
                targets.append(len(ids))
        width = -(-max(map(len, rows)) // self.bucket) * self.bucket
        tokens = np.zeros((len(rows), width), np.int32)
        attention = np.zeros_like(tokens)
        target_mask = np.zeros_like(tokens)
        for i, (row, n) in enumerate(zip(rows, targets)):
            tokens[i, :len(row)], attention[i, :len(row)] = row, 1
            target_mask[i, len(row) - n:len(row)] = 1
        out = _sequence_logps(self.graphdef, self.state, tokens, attention, target_mask)
        return np.asarray(out, np.float64).reshape(-1, 2)

    def score(self, completions: Sequence[str], references: Sequence[Mapping[str, Any]]) -> np.ndarray:
        """One reward per completion ``[R]`` (``logp`` or ``normalized``)."""
        logps = self.verdict_logps([_prompt_text(r) for r in references], completions)
        if self.score_kind == "logp":
            return logps[:, 0].astype(np.float32)
        return np.exp(logps[:, 0] - np.logaddexp(logps[:, 0], logps[:, 1])).astype(np.float32)
