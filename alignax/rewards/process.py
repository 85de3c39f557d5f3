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

A trained process reward model (``alignax export`` of a ``prm`` run, sharing the policy's
tokenizer) scores the sampled tokens themselves: :class:`ProcessRewardModel`
(``grpo.process_reward_model``), each step's reward the PRM's probability that the step is
good, or one score per completion (:func:`aggregate_step_scores`: ``min``, ``product``,
``last``) on its last step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from alignax import models
from alignax.parallel.multihost import allgather_rows, local_rows
from alignax.rewards.verifiers import answer_reward

STEP_AGGREGATIONS = ("min", "product", "last")


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


def aggregate_step_scores(step_probs: np.ndarray, step_mask: np.ndarray, method: str) -> np.ndarray:
    """One score ``[R]`` from step probabilities ``[R, N]`` at ``step_mask`` positions:
    ``min`` (the weakest step, Lightman et al. 2023), ``product`` (every step right),
    ``last`` (the final step). A completion without a step scores 0."""
    mask = np.asarray(step_mask) > 0
    probs = np.asarray(step_probs, np.float64)
    has = mask.any(axis=1)
    if method == "min":
        out = np.where(mask, probs, np.inf).min(axis=1)
    elif method == "product":
        out = np.where(mask, probs, 1.0).prod(axis=1)
    elif method == "last":
        last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
        out = probs[np.arange(len(probs)), last]
    else:
        raise ValueError(f"unknown step aggregation {method!r}; valid: {', '.join(STEP_AGGREGATIONS)}")
    return np.where(has, out, 0.0)


@functools.partial(jax.jit, static_argnums=0)
def _per_token_scores(graphdef, state, tokens, positions, attention):
    return nnx.merge(graphdef, state)(tokens, positions, attention, per_token=True).values


class ProcessRewardModel:
    """A trained PRM scoring sampled completions step by step.

    ``path``: a reward-model folder trained by ``algorithm: prm``; it must share the policy's
    tokenizer (a token id beyond its vocabulary is an error); its weights are read at the
    first scoring. ``aggregation``: ``step`` (each step's own probability at its end
    token: dense process rewards) or one of :data:`STEP_AGGREGATIONS` (one score per
    completion, on its last step). ``param_dtype``: its weights (a run's
    ``precision.frozen_dtype``); it computes in float32 whatever they are.
    """

    def __init__(self, path: str, *, aggregation: str = "step", mesh=None, place: Callable | None = None,
                 param_dtype: str = "float32"):
        if aggregation not in ("step", *STEP_AGGREGATIONS):
            raise ValueError(f"unknown PRM aggregation {aggregation!r}; valid: step, {', '.join(STEP_AGGREGATIONS)}")
        self.path, self.aggregation, self.mesh, self.param_dtype = path, aggregation, mesh, param_dtype
        self.place = place or (lambda x: x)
        self._model = None

    def _load(self):
        if self._model is None:
            model = models.from_pretrained(self.path, kind="reward", mesh=self.mesh, param_dtype=self.param_dtype)
            self._model = (*nnx.split(model), model.config.vocab_size)
        return self._model

    def step_probs(self, groups) -> np.ndarray:
        """``sigmoid`` of the PRM's score at every response position ``[R, N]`` of sampled
        completions (:class:`alignax.sampling.scored.Groups`): at a step's end token, the
        probability that the prefix up to it is good."""
        tokens, positions, attention = (self.place(a) for a in groups.full_sequences())
        return self.sequence_probs(tokens, positions, attention, prompt_width=groups.prompt_tokens.shape[1])

    def sequence_probs(self, tokens, positions, attention, *, prompt_width: int) -> np.ndarray:
        """:meth:`step_probs` of full sequences ``[R, P + N]`` (prompt then response, as
        ``Groups.full_sequences``; placed already, or host arrays), this process's rows."""
        graphdef, state, vocab_size = self._load()
        # every process's largest token: a process raising alone would leave the others
        # waiting in the sharded forward below
        largest = int(np.max(allgather_rows(np.array([np.max(local_rows(tokens)) if tokens.size else -1]))))
        if largest >= vocab_size:
            raise ValueError(f"PRM {self.path} has vocab_size {vocab_size}; the completions hold token "
                             f"{largest} (a PRM must share the policy's tokenizer)")
        values = _per_token_scores(graphdef, state, tokens, positions, attention)
        return 1.0 / (1.0 + np.exp(-np.asarray(local_rows(values), np.float64)[:, prompt_width:]))

    def step_rewards(self, groups, step_mask: np.ndarray) -> np.ndarray:
        """Step rewards ``[R, N]`` on the ``step_mask`` tokens (:func:`step_boundaries`)."""
        probs = self.step_probs(groups)
        mask = np.asarray(step_mask) > 0
        if self.aggregation == "step":
            return np.where(mask, probs, 0.0).astype(np.float32)
        out = np.zeros(mask.shape, np.float32)
        rows = np.flatnonzero(mask.any(axis=1))
        last = mask.shape[1] - 1 - np.argmax(mask[rows, ::-1], axis=1)
        out[rows, last] = aggregate_step_scores(probs, mask, self.aggregation)[rows]
        return out
