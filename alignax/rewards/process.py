"""Step-level (process) rewards for GRPO with process supervision.

Step boundaries and rewards of sampled completions (:func:`step_boundaries`,
:func:`process_step_rewards`), and the built-in step reward functions.

A process reward function takes, for each completion, the text of its reasoning steps
(split by the trainer at ``grpo.step_delimiter``) and the record it answers, and returns
one reward per step::

    fn(steps: Sequence[Sequence[str]], references: Sequence[Mapping]) -> Sequence[Sequence[float]]

The trainer places each step's reward on the step's last token and turns them into dense
per-token advantages (:func:`alignax.advantages.process_advantages`, Shao et al. 2024,
DeepSeekMath §4.1.3). Name a function in the config as ``grpo.process_reward:
"package.module:function"``; a learned process reward model fits the same signature.

Built in:

- :func:`outcome_on_last_step`: the task verifier's score on the last step, 0 before it
  (outcome supervision expressed as step rewards);
- :func:`well_formed_steps`: every non-empty step earns ``1 / num_steps`` and the last
  step adds the verifier's score — a dense signal that rewards answering in steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from alignax.rewards.verifiers import answer_reward


def _outcomes(steps: Sequence[Sequence[str]], references: Sequence[Mapping]):
    completions = ["".join(parts) for parts in steps]
    scores, _ = answer_reward(completions, references)
    return scores


def outcome_on_last_step(steps: Sequence[Sequence[str]], references: Sequence[Mapping]) -> list[list[float]]:
    """``[0, ..., 0, score]`` per completion (``score`` from the reasoning-gym verifier)."""
    scores = _outcomes(steps, references)
    return [[0.0] * (len(parts) - 1) + [float(score)] for parts, score in zip(steps, scores)]


def well_formed_steps(steps: Sequence[Sequence[str]], references: Sequence[Mapping]) -> list[list[float]]:
    """``1/n`` for each non-empty step of ``n``, plus the verifier's score on the last."""
    scores = _outcomes(steps, references)
    out = []
    for parts, score in zip(steps, scores):
        n = max(len(parts), 1)
        rewards = [(1.0 / n) if part.strip() else 0.0 for part in parts]
        rewards[-1] += float(score)
        out.append(rewards)
    return out


def step_boundaries(tokenizer, tokens: np.ndarray, mask: np.ndarray, delimiter: str) -> tuple[np.ndarray, list[list[str]]]:
    """Where each completion's reasoning steps end, and the text of each step.

    A step ends at a response token whose decoded text contains ``delimiter`` and at the
    last response token. Returns ``(step_mask [R, N] int32, step texts per row)``.
    """
    step_mask = np.zeros(tokens.shape, np.int32)
    texts: list[list[str]] = []
    for r in range(tokens.shape[0]):
        length = int(mask[r].sum())
        pieces = [tokenizer.decode([int(t)]) for t in tokens[r, :length]]
        ends = [i for i, piece in enumerate(pieces) if delimiter in piece]
        if length and (not ends or ends[-1] != length - 1):
            ends.append(length - 1)
        step_mask[r, ends] = 1
        starts = [0] + [e + 1 for e in ends[:-1]]
        texts.append([tokenizer.decode(tokens[r, s : e + 1].tolist(), skip_special_tokens=True)
                      for s, e in zip(starts, ends)])
    return step_mask, texts


def process_step_rewards(fn: Callable, step_mask: np.ndarray, texts: list[list[str]],
                         references: Sequence[Mapping]) -> np.ndarray:
    """Step rewards ``[R, N]`` placed on the boundary tokens of ``step_mask``."""
    rewards_per_row = fn(texts, references)
    out = np.zeros(step_mask.shape, np.float32)
    for r, (ends, rewards) in enumerate(zip((np.flatnonzero(m) for m in step_mask), rewards_per_row)):
        rewards = np.asarray(rewards, np.float32)
        if rewards.shape != ends.shape:
            raise ValueError(f"process reward for completion {r}: {rewards.shape[0]} rewards for {ends.shape[0]} steps")
        if not np.all(np.isfinite(rewards)):
            raise ValueError(f"process reward for completion {r} is not finite: {rewards.tolist()}")
        out[r, ends] = rewards
    return out
