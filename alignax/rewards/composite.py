"""The reward of each sampled completion for online RL, with every component kept.

Components (each ``[R]`` float32, logged as ``reward/<name>``):

- ``answer`` / ``format``: reasoning-gym verifiers on the decoded completion
  (:mod:`alignax.rewards.verifiers`), weighted by ``verifier_weight`` / ``format_weight``;
- ``fn/<module:function>``: user reward functions ``(completions, references) -> [R]``;
- ``reward_model``: trained reward models scoring prompt + completion, combined by an
  ensemble rule (:func:`alignax.losses.ensemble_rewards`);
- ``judge``: an LLM judge's verdict log-probability on a rubric (:mod:`alignax.rewards.judge`, RLAIF);
- ``prm``: a trained process reward model's step probabilities, reduced to one score a
  completion (:class:`alignax.rewards.process.ProcessRewardModel`, Lightman et al. 2023);
- ``length`` / ``missing_eos`` / ``overlong``: shaping terms (:mod:`alignax.rewards.shaping`).

``total = clip(sum of weighted components)``. A non-finite total is an error naming the
completion, never a silent NaN in the advantages.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from alignax import models
from alignax.config import ConfigError, load_callable
from alignax.losses import ensemble_rewards
from alignax.parallel.multihost import local_rows
from alignax.parallel.placement import to_device
from alignax.rewards import shaping
from alignax.rewards.judge import DEFAULT_RUBRIC, Judge
from alignax.rewards.process import ProcessRewardModel, aggregate_step_scores, step_boundaries
from alignax.rewards.verifiers import verifier_rewards


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """The reward of a completion: verifiers, reward models, shaping, in one weighted sum.

    Fields:
      verifier_weight: weight of the reasoning-gym answer score (0 disables it).
      format_weight: weight of the answer-tag format reward; ``strict_format``: the
        completion must be only ``<think>..</think>`` then one ``<answer>`` block.
      answer_tag: the tag the verifier reads the answer from; ``answer_extraction``:
        ``tag``, or ``tag_or_last_number`` (no tag: the last number in the text).
      task: the reasoning-gym task for records that name none (a record's own ``task`` or
        ``metadata["source_dataset"]`` wins); ``null``: every record must name its task.
        Checked against reasoning-gym's tasks when the config loads.
      functions: extra rule-based rewards, ``{"package.module:function": weight}``; each
        function maps ``(completions, references)`` to one float per completion. A
        function that raises is a :class:`RewardFunctionError` naming it and the first
        completion it fails on.
      reward_models: local HF folders of trained reward models (``alignax export`` of a
        reward run); ``reward_model_weight`` weighs their combined score, combined by
        ``ensemble`` (``mean`` | ``min`` | ``mean_minus_std`` | ``mean_minus_var``, with
        ``ensemble_k``).
      judge_model: an LLM judge (a registry name or a local causal-LM folder; its own
        tokenizer) scoring each completion by the log-probability of its verdict on
        ``judge_rubric`` (``{prompt}``, ``{completion}``), weighted by ``judge_weight``;
        ``judge_verdicts``: the (positive, negative) answers; ``judge_score``: ``logp``
        (log p(positive)) or ``normalized`` (p(positive) / (p(positive) + p(negative))).
      prm: a trained process reward model (``alignax export`` of a ``prm`` run, sharing the
        policy's tokenizer) scoring each step of the completion (split at
        ``step_delimiter``, as in its training), the step probabilities reduced to one score
        by ``prm_aggregation`` (``min``: the weakest step; ``product``: every step right;
        ``last``: the final step), weighted by ``prm_weight``.
      length_penalty_coef / length_target: ``-coef * max(0, L - target)`` tokens.
      missing_eos_penalty: added to completions that never emitted a stop token.
      overlong_buffer: DAPO's soft overlong punishment over the last ``buffer`` tokens of
        ``max_new_tokens`` (``null``: off), scaled by ``overlong_scale``.
      clip: clip the total reward to ``[low, high]``.
      mask_truncated: completions that hit ``max_new_tokens`` get no loss (DAPO's
        overlong filtering).
    """

    verifier_weight: float = 1.0
    format_weight: float = 0.0
    strict_format: bool = False
    answer_tag: str = "answer"
    answer_extraction: Literal["tag", "tag_or_last_number"] = "tag"
    task: str | None = None
    functions: dict[str, float] = dataclasses.field(default_factory=dict)
    reward_models: tuple[str, ...] = ()
    reward_model_weight: float = 1.0
    ensemble: Literal["mean", "min", "mean_minus_std", "mean_minus_var"] = "mean"
    ensemble_k: float = 1.0
    judge_model: str | None = None
    judge_weight: float = 1.0
    judge_rubric: str = DEFAULT_RUBRIC
    judge_verdicts: tuple[str, str] = ("yes", "no")
    judge_score: Literal["logp", "normalized"] = "logp"
    prm: str | None = None
    prm_weight: float = 1.0
    prm_aggregation: Literal["min", "product", "last"] = "min"
    step_delimiter: str = "\n"
    length_penalty_coef: float = 0.0
    length_target: int = 0
    missing_eos_penalty: float | None = None
    overlong_buffer: int | None = None
    overlong_scale: float = 1.0
    clip: tuple[float, float] | None = None
    mask_truncated: bool = False

    def component_weights(self) -> dict[str, float]:
        """The weight of each component :meth:`RewardScorer.score` sums, by its name there
        (``answer``, ``format``, ``fn/<spec>``, ``reward_model``, ``judge``, ``prm``; the shaping terms
        carry their coefficients inside and weigh 1). A component's value before its weight is
        its score divided by this (GDPO normalises the unweighted components,
        :mod:`alignax.estimators.gdpo`)."""
        return {"answer": self.verifier_weight, "format": self.format_weight,
                **{f"fn/{spec}": weight for spec, weight in self.functions.items()},
                "reward_model": self.reward_model_weight, "judge": self.judge_weight, "prm": self.prm_weight,
                "length": 1.0, "missing_eos": 1.0, "overlong": 1.0}


def _function_identity(spec: str) -> str:
    """The function a ``functions`` entry names, however spelt (an alias, a re-export): its
    defining module and qualified name where that name finds this very object, else the
    object itself (two closures of one factory share a qualified name but are different
    functions; an instance has none); the spec when it does not load (the scorer reports that
    when it is built)."""
    try:
        fn = load_callable(spec)
    except ConfigError:
        return f"the function {spec}"
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    found = sys.modules.get(module) if module else None
    for part in (name or "").split(".") if found is not None else ():
        found = getattr(found, part, None)
    if module and name and found is fn:
        return f"the function {module}:{name}"
    label = f"{module}:{name}" if module and name else type(fn).__qualname__
    return f"the object {label} at {id(fn):#x}"


def scorers(section: RewardConfig) -> list[tuple[str, str]]:
    """``(key, identity)`` of each scorer ``section`` weighs (a non-zero weight): the key
    under ``rewards`` that names it, and what it is whatever its name — the task verifier,
    the format check, a function by its definition, a reward model or judge by its folder
    (:func:`alignax.models.registry.model_identity`). Two reward configs sharing an
    identity share a scorer; the shaping terms (length, EOS, overlong) are no scorers."""
    model_identity = models.registry.model_identity
    out = []
    if section.verifier_weight != 0:
        out.append(("verifier_weight", "the reasoning-gym answer verifier"))
    if section.format_weight != 0:
        out.append(("format_weight", "the answer-tag format check"))
    out += [(f"functions entry {spec!r}", _function_identity(spec)) for spec, w in section.functions.items() if w != 0]
    if section.reward_model_weight != 0:
        out += [(f"reward_models entry {path!r}", f"the model {model_identity(path)}")
                for path in section.reward_models]
    if section.judge_model and section.judge_weight != 0:
        out.append((f"judge_model {section.judge_model!r}", f"the model {model_identity(section.judge_model)}"))
    if section.prm and section.prm_weight != 0:
        out.append((f"prm {section.prm!r}", f"the model {model_identity(section.prm)}"))
    return out


class NonFiniteRewardError(ValueError):
    """A reward component came out NaN or infinite."""


class RewardFunctionError(ConfigError):
    """A ``rewards.functions`` entry raised while scoring; the message names the entry, the
    first completion it fails on (alone), the exception and the completion's start. The
    original exception is chained (``__cause__``)."""


def _call_reward_function(spec: str, fn, completions: Sequence[str], references: Sequence[Any]):
    """``fn(completions, references)``; an exception becomes :class:`RewardFunctionError`,
    after calling ``fn`` on each completion alone to find the first one it fails on."""
    try:
        return fn(completions, references)
    except Exception as err:  # noqa: BLE001 - any user-code failure is reported the same way
        for i in range(len(completions)):
            try:
                fn([completions[i]], [references[i]])
            except Exception as alone:  # noqa: BLE001
                raise RewardFunctionError(
                    f"rewards.functions entry {spec!r} raised {type(alone).__name__}: {alone} on completion {i} "
                    f"(of {len(completions)}); completion starts {completions[i][:80]!r}"
                ) from err
        raise RewardFunctionError(
            f"rewards.functions entry {spec!r} raised {type(err).__name__}: {err} on the batch of "
            f"{len(completions)} completions, but on none of them alone"
        ) from err


def _reward_values(spec: str, returned: Any, count: int) -> np.ndarray:
    """What a reward function returned, as ``[count]`` float32; anything else (strings,
    ``None``, another length) is a :class:`RewardFunctionError` naming the entry."""
    try:
        raw = np.asarray(returned)
    except ValueError as err:  # ragged nesting
        raise RewardFunctionError(f"rewards.functions entry {spec!r} returned a ragged {type(returned).__name__}; "
                                  f"expected {count} numbers, one per completion") from err
    if raw.dtype.kind not in "biuf":  # numeric strings too: a score is a number, not its text
        first = raw.flat[0] if raw.size else None
        first = first.item() if isinstance(first, np.generic) else first  # the Python value returned
        raise RewardFunctionError(f"rewards.functions entry {spec!r} returned {type(returned).__name__} of "
                                  f"{type(first).__name__} (first: {str(first)[:40]!r}); expected {count} numbers, "
                                  "one float per completion")
    if raw.shape != (count,):
        raise RewardFunctionError(f"rewards.functions entry {spec!r} returned shape {raw.shape}; expected "
                                  f"({count},), one float per completion")
    return raw.astype(np.float32)


@dataclasses.dataclass
class RewardModels:
    """Frozen reward models scoring full sequences; all share one tokenizer with the policy."""

    graphdefs: list[nnx.GraphDef]
    states: list[nnx.State]

    @classmethod
    def load(cls, paths: Sequence[str], *, mesh=None, vocab_size: int, param_dtype: str = "float32") -> RewardModels:
        """The reward models in ``paths``, their weights read straight into ``param_dtype``
        (a run's ``precision.frozen_dtype``); they compute in float32 whatever it is."""
        graphdefs, states = [], []
        for path in paths:
            model = models.from_pretrained(path, kind="reward", mesh=mesh, param_dtype=param_dtype)
            if model.config.vocab_size != vocab_size:
                raise ValueError(
                    f"reward model {path} has vocab_size {model.config.vocab_size}; the policy has {vocab_size} "
                    "(reward models must share the policy's tokenizer)"
                )
            graphdef, state = nnx.split(model)
            graphdefs.append(graphdef)
            states.append(state)
        return cls(graphdefs, states)

    def score_fn(self):
        """A jitted ``(states, tokens, positions, attention_mask) -> [K, R]``. Each model's
        weights are moved into device memory right before its forward pass (a no-op where
        they already are; ``placement.reward_models: host`` holds them in host memory)."""
        graphdefs = self.graphdefs

        def score(states, tokens, positions, attention_mask):
            return jnp.stack([
                nnx.merge(g, to_device(s))(tokens, positions, attention_mask).rewards for g, s in zip(graphdefs, states)
            ])

        return jax.jit(score)


class RewardScorer:
    """Scores a rollout: ``score(completions, references, tokens, response_mask, ...)``.

    ``prm``: the :class:`~alignax.rewards.process.ProcessRewardModel` of ``section.prm``
    (built by the caller, which places it); it needs ``tokenizer`` to find the steps."""

    def __init__(self, section: RewardConfig, *, max_new_tokens: int, stop_token_ids: Sequence[int],
                 reward_models: RewardModels | None = None, frozen_dtype: str = "float32",
                 prm: ProcessRewardModel | None = None, tokenizer=None):
        if (prm is None) != (section.prm is None) or (prm is not None and tokenizer is None):
            raise ValueError("rewards.prm needs its ProcessRewardModel and the policy's tokenizer (to find the steps)")
        self.section, self.prm, self.tokenizer = section, prm, tokenizer
        self.max_new_tokens = max_new_tokens
        self.stop_token_ids = tuple(stop_token_ids)
        self.reward_models = reward_models
        self._score_rm = reward_models.score_fn() if reward_models is not None else None
        self.functions = {spec: (load_callable(spec), weight) for spec, weight in section.functions.items()}
        self.judge = (Judge(section.judge_model, rubric=section.judge_rubric, verdicts=section.judge_verdicts,
                            score=section.judge_score, param_dtype=frozen_dtype) if section.judge_model else None)
        if section.overlong_buffer is not None and not 0 < section.overlong_buffer <= max_new_tokens:
            raise ValueError(
                f"rewards.overlong_buffer must be in (0, rollout.max_new_tokens={max_new_tokens}]; "
                f"got {section.overlong_buffer}"
            )
        uses_verifier = section.verifier_weight != 0 or section.format_weight != 0
        if not uses_verifier and reward_models is None and not self.functions and self.judge is None and prm is None:
            raise ValueError("no reward source: set rewards.verifier_weight/format_weight, rewards.functions, "
                             "rewards.reward_models, rewards.judge_model or rewards.prm")

    def score(
        self,
        completions: Sequence[str],
        references: Sequence[Mapping[str, Any]],
        response_tokens: np.ndarray,
        response_mask: np.ndarray,
        full_sequences: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """``(total [R], components)``; components include ``correct`` for accuracy."""
        s = self.section
        weighted: dict[str, np.ndarray] = {}
        extra: dict[str, np.ndarray] = {}
        if s.verifier_weight != 0 or s.format_weight != 0:
            _, parts = verifier_rewards(completions, references, answer_weight=s.verifier_weight,
                                        format_weight=s.format_weight, strict_format=s.strict_format, tag=s.answer_tag,
                                        task=s.task, extraction=s.answer_extraction)
            weighted["answer"] = s.verifier_weight * parts["answer"]
            weighted["format"] = s.format_weight * parts["format"]
            extra["correct"] = parts["correct"]
            extra["scorer_error"] = parts["scorer_error"]
        for spec, (fn, weight) in self.functions.items():
            values = _reward_values(spec, _call_reward_function(spec, fn, completions, references), len(completions))
            weighted[f"fn/{spec}"] = weight * values
        if self._score_rm is not None:
            tokens, positions, attention = full_sequences
            scores = self._score_rm(self.reward_models.states, tokens, positions, attention)  # [K, R]
            combined = ensemble_rewards(scores, method=s.ensemble, k=s.ensemble_k)
            weighted["reward_model"] = s.reward_model_weight * local_rows(combined)
            if scores.shape[0] > 1:
                extra["reward_model_std"] = local_rows(jnp.std(scores, axis=0))
        if self.judge is not None:
            weighted["judge"] = s.judge_weight * self.judge.score(completions, references)
        if self.prm is not None:
            weighted["prm"] = s.prm_weight * self._prm_scores(response_tokens, response_mask, full_sequences)
        lengths = response_mask.sum(axis=-1).astype(np.float32)
        if s.length_penalty_coef:
            weighted["length"] = np.asarray(shaping.length_penalty(lengths, target_length=s.length_target,
                                                                   coef=s.length_penalty_coef))
        if s.missing_eos_penalty is not None:
            weighted["missing_eos"] = np.asarray(shaping.missing_eos_penalty(
                response_tokens, response_mask, stop_token_ids=self.stop_token_ids, penalty=s.missing_eos_penalty))
        if s.overlong_buffer is not None:
            weighted["overlong"] = np.asarray(shaping.overlong_penalty(
                lengths, max_length=self.max_new_tokens, cache_length=s.overlong_buffer, scale=s.overlong_scale))
        total = np.sum(np.stack(list(weighted.values())), axis=0).astype(np.float32)
        if s.clip is not None:
            total = np.asarray(shaping.clip_rewards(total, low=s.clip[0], high=s.clip[1]))
        for name, values in {**weighted, "total": total}.items():
            bad = np.flatnonzero(~np.isfinite(values))
            if bad.size:
                i = int(bad[0])
                raise NonFiniteRewardError(
                    f"reward component {name!r} is {values[i]} for completion {i} "
                    f"(and {bad.size - 1} more); completion starts {completions[i][:80]!r}"
                )
        return total, {**{k: np.asarray(v, np.float32) for k, v in weighted.items()}, **extra}

    @property
    def reads_sequences(self) -> bool:
        """Whether :meth:`score` needs the full sequences (a reward model or a PRM reads them)."""
        return self.reward_models is not None or self.prm is not None

    def _prm_scores(self, response_tokens: np.ndarray, response_mask: np.ndarray, full_sequences) -> np.ndarray:
        """``[R]``: the PRM's step probabilities at the steps' end tokens, reduced by
        ``prm_aggregation`` (a completion without a step scores 0)."""
        tokens, positions, attention = full_sequences
        width = tokens.shape[1] - response_tokens.shape[1]
        probs = self.prm.sequence_probs(tokens, positions, attention, prompt_width=width)
        step_mask, _ = step_boundaries(self.tokenizer, response_tokens, response_mask, self.section.step_delimiter)
        return aggregate_step_scores(probs, step_mask, self.section.prm_aggregation).astype(np.float32)
