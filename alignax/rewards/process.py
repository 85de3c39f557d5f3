"""Step-level (process) rewards for GRPO with process supervision.

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

from collections.abc import Mapping, Sequence

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
