"""Rule-based rewards on decoded completions: reasoning-gym answer scorers and format checks.

Plain Python/NumPy, run on the host after decoding; each returns float32 ``[N]`` for
``N`` completions. A completion is paired with a *reference*: the record it answers (as
carried in a ``prompt``-format batch's ``references``), with at least ``answer`` and the
reasoning-gym task, given as ``task`` or as ``metadata["source_dataset"]`` (what
reasoning-gym puts in every entry), plus whatever the task's scorer reads from
``metadata`` (e.g. countdown's ``numbers`` and ``target``).

- :func:`extract_answer`: the content of the last ``<answer>...</answer>`` (reasoning-gym's
  own extractor).
- :func:`answer_reward`: the task's ``score_answer(extracted, reference)`` in [0, 1]; a
  missing answer tag scores what the scorer gives ``None`` (0 for most tasks).
- :func:`format_reward`: 1 when the answer tag is present (``strict``: and the completion is
  only an optional ``<think>...</think>`` followed by one answer block).
- :func:`verifier_rewards`: a weighted sum of those, with every component returned.
- :func:`numeric_closeness`: a graded reward for tasks with a numeric answer,
  ``1 / (1 + |answer - truth|)`` (a ``rewards.functions`` entry, e.g. the dense gold reward
  of ``tools/studies/overoptimisation.py``).
- :func:`length_closeness`: ``1 / (1 + |len(completion) - len(answer)|)`` in characters, a
  reward every completion earns some of (the tiny recipes' random models never write an
  answer tag or a digit, so the verifiers give them all 0 and nothing trains).

The answer format follows reasoning-gym's system prompts (``reasoning_gym.utils.SYSTEM_PROMPTS``)
and DeepSeek-R1's ``<think>``/``<answer>`` convention (DeepSeek-AI 2025).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
EXTRACTIONS = ("tag", "tag_or_last_number")


def extract_answer(completion: str, *, tag: str = "answer", extraction: str = "tag") -> str | None:
    """The answer a completion gives, or ``None``.

    ``tag``: the stripped content of the last ``<tag>...</tag>`` (reasoning-gym's own
    extractor). ``tag_or_last_number``: that, or when there is no tag the last number in
    the text (``"... so 4 + 3 = 7."`` -> ``"7"``) — for small models that answer
    arithmetic in prose; the format reward still tells the two apart.
    """
    from reasoning_gym.utils import extract_answer as rg_extract

    if extraction not in EXTRACTIONS:
        raise ValueError(f"unknown answer extraction {extraction!r}; valid: {', '.join(EXTRACTIONS)}")
    answer = rg_extract(completion, tag_name=tag, strip=True)
    if answer is None and extraction == "tag_or_last_number":
        numbers = _NUMBER.findall(completion)
        answer = numbers[-1] if numbers else None
    return answer


def check_task(task: str) -> str:
    """``task`` when it names a reasoning-gym task; else ``ValueError`` with the closest
    names and every valid one."""
    import difflib

    import reasoning_gym

    if task not in reasoning_gym.factory.DATASETS:
        names = sorted(reasoning_gym.factory.DATASETS)
        close = difflib.get_close_matches(str(task), names, n=3)
        hint = f" (did you mean {' or '.join(map(repr, close))}?)" if close else ""
        raise ValueError(f"unknown reasoning-gym task {task!r}{hint}; valid: {', '.join(names)}")
    return task


@functools.lru_cache(maxsize=None)
def task_scorer(task: str) -> Callable[[str | None, Mapping[str, Any]], float]:
    """reasoning-gym's ``score_answer`` for ``task`` (one scorer instance per task, cached)."""
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(check_task(task))


def _check_lengths(completions: Sequence[str], references: Sequence[Mapping]) -> None:
    if isinstance(completions, str):
        raise TypeError("completions must be a sequence of strings, not one string")
    if len(completions) != len(references):
        raise ValueError(
            f"{len(completions)} completions but {len(references)} references; repeat each reference "
            "once per sampled completion (e.g. G times per prompt for group methods)"
        )


def with_task(references: Sequence[Mapping], task: str | None) -> list[Mapping]:
    """``references`` where each record that names no task (neither ``task`` nor
    ``metadata['source_dataset']``) gets ``task`` (``rewards.task``), for scorers — the
    process rewards among them — that read the task from the record."""
    if task is None:
        return list(references)

    def named(r: Mapping) -> bool:
        return bool(r.get("task")) or (isinstance(r.get("metadata"), Mapping) and bool(r["metadata"].get("source_dataset")))

    return [r if named(r) else {**r, "task": task} for r in references]


def _task_of(reference: Mapping, index: int, default: str | None) -> str:
    if not isinstance(reference, Mapping):
        raise TypeError(f"reference {index} must be a mapping (a record), got {type(reference).__name__}")
    task = reference.get("task")
    if task is None and isinstance(reference.get("metadata"), Mapping):
        task = reference["metadata"].get("source_dataset")
    task = task or default
    if task is None:
        raise ValueError(
            f"reference {index} names no reasoning-gym task: give it 'task' or metadata['source_dataset'], "
            "or set rewards.task (the task of records that name none)"
        )
    if "answer" not in reference:
        keys = ", ".join(sorted(map(str, reference))) or "none"
        raise ValueError(f"reference {index} (task {task!r}) has no 'answer', which the scorer needs; keys: {keys}")
    return task


def answer_reward(
    completions: Sequence[str],
    references: Sequence[Mapping],
    *,
    tag: str = "answer",
    task: str | None = None,
    extraction: str = "tag",
) -> tuple[np.ndarray, np.ndarray]:
    """Task score of each completion's extracted answer, and which scorers failed.

    ``r_i = score_answer_{task_i}(extract_answer(c_i), ref_i)`` in [0, 1].

    Args:
      completions: ``N`` decoded completions (response text only).
      references: ``N`` records with ``answer`` and the task (see the module docstring).
      tag: the answer tag.
      task: the task for references that name none.
      extraction: how the answer is read (:func:`extract_answer`).

    Returns ``(scores [N] float32, scorer_errors [N] float32)``: a scorer that raises on a
    completion (malformed model output) scores 0 and is flagged with 1. A reference
    lacking something its scorer reads raises ``ValueError`` naming the reference, the
    task and the missing key.
    """
    _check_lengths(completions, references)
    scores = np.zeros((len(completions),), np.float32)
    errors = np.zeros((len(completions),), np.float32)
    for i, (completion, reference) in enumerate(zip(completions, references)):
        name = _task_of(reference, i, task)
        scorer = task_scorer(name)
        answer = extract_answer(completion, tag=tag, extraction=extraction)
        try:
            score = scorer(answer, reference)
        except KeyError as e:
            raise ValueError(
                f"reference {i} (task {name!r}) lacks {e.args[0]!r}, which the {name} scorer reads "
                "(keep the task's 'metadata' in the prompt records)"
            ) from None
        except Exception:  # the scorer choked on model output: no reward, but visible
            score, errors[i] = 0.0, 1.0
        scores[i] = float(score)
    return scores, errors


_STRICT = {}


def format_reward(completions: Sequence[str], *, tag: str = "answer", strict: bool = False) -> np.ndarray:
    """1.0 for a completion in answer format, else 0.0; float32 ``[N]``.

    Lenient (default): an ``<tag>...</tag>`` with non-empty content is present.
    ``strict``: the whole completion is ``[<think>...</think>] <tag>...</tag>`` with exactly
    one answer block and nothing else (whitespace aside).
    """
    if isinstance(completions, str):
        raise TypeError("completions must be a sequence of strings, not one string")
    if tag not in _STRICT:
        t = re.escape(tag)
        _STRICT[tag] = re.compile(rf"\s*(?:<think>.*?</think>\s*)?<{t}>(?:(?!<{t}>|</{t}>).)*?</{t}>\s*", re.DOTALL)
    pattern = _STRICT[tag]
    out = np.zeros((len(completions),), np.float32)
    for i, completion in enumerate(completions):
        answer = extract_answer(completion, tag=tag)
        ok = bool(answer)
        if strict:
            ok = ok and pattern.fullmatch(completion) is not None
        out[i] = float(ok)
    return out


def verifier_rewards(
    completions: Sequence[str],
    references: Sequence[Mapping],
    *,
    answer_weight: float = 1.0,
    format_weight: float = 0.0,
    strict_format: bool = False,
    tag: str = "answer",
    task: str | None = None,
    extraction: str = "tag",
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Weighted verifier reward with its components.

    ``r_i = answer_weight * answer_i + format_weight * format_i``.

    Returns ``(rewards [N] float32, components)`` with components ``answer`` (task score),
    ``format`` (0/1), ``correct`` (1 where the task score is 1) and ``scorer_error``
    (1 where the scorer raised), each float32 ``[N]``; log their means.
    """
    answer, errors = answer_reward(completions, references, tag=tag, task=task, extraction=extraction)
    fmt = format_reward(completions, tag=tag, strict=strict_format)
    rewards = (np.float32(answer_weight) * answer + np.float32(format_weight) * fmt).astype(np.float32)
    components = {
        "answer": answer,
        "format": fmt,
        "correct": (answer >= 1.0).astype(np.float32),
        "scorer_error": errors,
    }
    return rewards, components


def numeric_closeness(completions: Sequence[str], references: Sequence[Mapping], *, tag: str = "answer",
                      extraction: str = "tag_or_last_number") -> np.ndarray:
    """How close each completion's numeric answer is to the reference's: float32 ``[N]``.

    ``r_i = 1 / (1 + |a_i - y_i|)`` with ``a_i`` the extracted answer (:func:`extract_answer`,
    last number by default) read as a number and ``y_i = float(reference['answer'])``; 1 for
    the exact answer, falling with the error; 0 when no number is given. Unlike a task's
    0/1 score it tells a near miss from a wild guess, so two wrong samples of a prompt still
    order (a dense gold for reward-model studies). A reference without a numeric ``answer``
    raises ``ValueError`` naming it.
    """
    _check_lengths(completions, references)
    out = np.zeros((len(completions),), np.float32)
    for i, (completion, reference) in enumerate(zip(completions, references)):
        try:
            truth = float(reference["answer"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"reference {i} has no numeric 'answer' (got {reference.get('answer')!r}); "
                             "numeric_closeness needs one") from None
        answer = extract_answer(completion, tag=tag, extraction=extraction)
        match = _NUMBER.search(answer) if answer is not None else None
        if match is not None:
            out[i] = 1.0 / (1.0 + abs(float(match.group()) - truth))
    return out


def length_closeness(completions: Sequence[str], references: Sequence[Mapping]) -> np.ndarray:
    """How close each completion's length is to its reference answer's, in characters:
    float32 ``[N]``, ``r_i = 1 / (1 + |len(c_i) - len(str(y_i))|)`` with ``y_i =
    reference['answer']``. 1 for a completion exactly as long as the answer, falling with
    every character more or less; never 0, and different for completions of different
    lengths, so even a random policy's samples get rewards that vary (a ``rewards.functions``
    entry of ``configs/tiny-ppo.yaml``). A reference without an ``answer`` raises
    ``ValueError`` naming it."""
    _check_lengths(completions, references)
    out = np.zeros((len(completions),), np.float32)
    for i, (completion, reference) in enumerate(zip(completions, references)):
        if not isinstance(reference, Mapping) or reference.get("answer") is None:
            raise ValueError(f"reference {i} has no 'answer' (got {reference!r}); length_closeness needs one")
        out[i] = 1.0 / (1.0 + abs(len(completion) - len(str(reference["answer"]))))
    return out
