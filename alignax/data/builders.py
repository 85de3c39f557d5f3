"""Real data that installs with the package: reasoning-gym tasks and champ-dataset.

- :func:`reasoning_gym_pairs`: preference pairs on a reasoning-gym task. ``chosen`` is
  the task's oracle answer and ``rejected`` a wrong answer (a nearby number, another
  question's answer, or a digit edit), both written in ``<answer>`` tags and both scored
  by the task's own ``score_answer`` on the tag's content, as a verifier would: chosen
  scores 1, rejected at most ``max_rejected_score`` (< 1).
- :func:`reasoning_gym_prompts`: prompts with reference answers for online RL.
- :func:`reasoning_gym_steps`: step-labelled solutions (format ``steps``) for process
  reward models: ``chain_sum`` worked term by term, some with a deliberate slip, every
  step labelled by a verifier (:func:`chain_sum_step_labels`).
- :func:`champ_pairs`: champ-dataset (Mao et al. 2024, "CHAMP: A Competition-level
  Dataset for Fine-Grained Analyses of LLMs' Mathematical Reasoning Capabilities"):
  model solutions that annotators marked as having no wrong step (chosen) versus ones
  with a first wrong step marked (rejected), for the same problem.

Everything is deterministic given ``seed``. Records come out in the formats of
:mod:`alignax.data.formats` and can be written with :func:`write_jsonl`, or named in
``DataConfig.paths`` as generator specs (:func:`generate`).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import random
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

ANSWER_TEMPLATE = "<answer>{answer}</answer>"
GENERATORS = ("reasoning_gym", "champ")


def _task_dataset(task: str, size: int, seed: int, task_options: Mapping[str, Any]):
    import reasoning_gym

    if task not in reasoning_gym.factory.DATASETS:
        names = ", ".join(sorted(reasoning_gym.factory.DATASETS))
        raise ValueError(f"unknown reasoning-gym task {task!r}; valid: {names}")
    return reasoning_gym.create_dataset(task, size=size, seed=seed, **dict(task_options))


def _unique_entries(dataset) -> list[dict]:
    """Entries in index order, each question once (a repeated question would leak into eval)."""
    seen, entries = set(), []
    for i in range(len(dataset)):
        entry = dataset[i]
        if entry["question"] not in seen:
            seen.add(entry["question"])
            entries.append(entry)
    return entries


def _score(dataset, completion: str, entry: Mapping) -> float:
    from reasoning_gym.utils import extract_answer

    return float(dataset.score_answer(extract_answer(completion), entry))


def _wrong_answers(answer: str, pool: list[str], rng: random.Random) -> Iterable[str]:
    """Candidate wrong answers, most plausible first (for numbers: small slips)."""
    try:
        value = Decimal(answer.replace(",", ""))
    except InvalidOperation:
        value = None
    if value is not None and value.is_finite():
        exponent = value.as_tuple().exponent
        unit = Decimal(1).scaleb(exponent) if isinstance(exponent, int) and exponent < 0 else Decimal(1)
        steps = [1, 2, 3, 10, 5, 100, 11, 9]
        rng.shuffle(steps)
        for step in steps:
            sign = rng.choice((-1, 1))
            for delta in (sign * step, -sign * step):
                yield str(value + delta * unit)
    others = [a for a in pool if a != answer]
    rng.shuffle(others)
    yield from others[:20]
    digits = [i for i, ch in enumerate(answer) if ch.isdigit()]
    for i in digits:
        yield answer[:i] + str((int(answer[i]) + rng.randint(1, 9)) % 10) + answer[i + 1 :]
    yield answer + " " + answer
    yield "no answer"


def reasoning_gym_pairs(
    task: str,
    *,
    size: int = 500,
    seed: int = 0,
    answer_template: str = ANSWER_TEMPLATE,
    max_rejected_score: float = 0.1,
    **task_options: Any,
) -> list[dict]:
    """Preference pairs on reasoning-gym ``task``: a verified-correct vs a wrong answer.

    Args:
      task: a registered reasoning-gym task (``chain_sum``, ``basic_arithmetic``, ...).
      size: entries generated (repeated questions are dropped, so at most this many pairs).
      seed: the task generator's seed and the wrong-answer RNG's.
      answer_template: how an answer is written; must contain ``{answer}`` inside the
        ``<answer>`` tags that reasoning-gym's ``extract_answer`` reads.
      max_rejected_score: the rejected answer's task score must be at most this (< 1;
        some scorers give a floor of partial credit, e.g. countdown 0.01-0.05).
      task_options: the task's config fields (e.g. ``min_terms=2, max_digits=2``).

    Returns records ``{"prompt", "chosen", "rejected", "answer", "task", "metadata",
    "chosen_score", "rejected_score"}``; ``prompt`` is the task's question. Entries whose
    oracle answer does not score 1 through the template, or with no wrong answer found,
    are left out.
    """
    if not 0.0 <= max_rejected_score < 1.0:
        raise ValueError(f"max_rejected_score must be in [0, 1); got {max_rejected_score}")
    if "{answer}" not in answer_template:
        raise ValueError(f"answer_template {answer_template!r} has no {{answer}} placeholder")
    dataset = _task_dataset(task, size, seed, task_options)
    entries = _unique_entries(dataset)
    pool = [e["answer"] for e in entries]
    records = []
    for entry in entries:
        chosen = answer_template.format(answer=entry["answer"])
        chosen_score = _score(dataset, chosen, entry)
        if chosen_score != 1.0:
            continue
        rng = random.Random(f"{seed}:{entry['metadata'].get('source_index', entry['question'])}")
        for wrong in _wrong_answers(entry["answer"], pool, rng):
            rejected = answer_template.format(answer=wrong)
            rejected_score = _score(dataset, rejected, entry)
            if rejected_score <= max_rejected_score:
                records.append(
                    {
                        "prompt": entry["question"],
                        "chosen": chosen,
                        "rejected": rejected,
                        "answer": entry["answer"],
                        "task": task,
                        "metadata": entry["metadata"],
                        "chosen_score": chosen_score,
                        "rejected_score": rejected_score,
                    }
                )
                break
    return records


def reasoning_gym_prompts(task: str, *, size: int = 500, seed: int = 0, **task_options: Any) -> list[dict]:
    """Prompts with reference answers on reasoning-gym ``task``, for online RL.

    Returns records ``{"prompt", "answer", "task", "metadata"}`` (repeated questions
    dropped); :mod:`alignax.rewards.verifiers` scores completions against them with the
    task's own scorer.
    """
    dataset = _task_dataset(task, size, seed, task_options)
    return [
        {"prompt": e["question"], "answer": e["answer"], "task": task, "metadata": e["metadata"]}
        for e in _unique_entries(dataset)
    ]


def reasoning_gym_sft(
    task: str, *, size: int = 500, seed: int = 0, answer_template: str = ANSWER_TEMPLATE, **task_options: Any
) -> list[dict]:
    """SFT conversations on reasoning-gym ``task``: the question, then the oracle answer
    written with ``answer_template`` — kept only when the task's scorer gives it 1."""
    dataset = _task_dataset(task, size, seed, task_options)
    records = []
    for entry in _unique_entries(dataset):
        reply = answer_template.format(answer=entry["answer"])
        if _score(dataset, reply, entry) == 1.0:
            records.append({
                "messages": [{"role": "user", "content": entry["question"]}, {"role": "assistant", "content": reply}],
                "answer": entry["answer"], "task": task,
            })
    return records


STEP_TASKS = ("chain_sum",)


def _chain_terms(expression: str) -> tuple[list[int], list[str]]:
    """``"4 - 1 + 7"`` -> ``([4, 1, 7], ["-", "+"])``."""
    parts = expression.split()
    if len(parts) < 3 or len(parts) % 2 == 0 or any(op not in "+-" for op in parts[1::2]):
        raise ValueError(f"not a chain_sum expression: {expression!r}")
    return [int(x) for x in parts[0::2]], parts[1::2]


_STEP = re.compile(r"^\s*(-?\d+)\s*([+-])\s*(-?\d+)\s*=\s*(-?\d+)\s*$")


def chain_sum_step_labels(expression: str, steps: list[str], answer_score: float) -> list[int]:
    """A verifier's labels of a chain_sum solution worked term by term.

    Step ``k < n-1`` must read ``x op y = z`` with ``op y`` the expression's next term and
    ``z`` the true value of the expression's first ``k + 2`` terms; the last step (the
    ``<answer>`` tag) is labelled by the task's score of it (``answer_score``). A step is
    good (1) when it and every step before it are; after the first bad step every label is
    0 (the solution can no longer reach the answer: Math-Shepherd's reading of a label).
    """
    terms, ops = _chain_terms(expression)
    labels, good, value = [], True, terms[0]
    for k, step in enumerate(steps[:-1]):
        match = _STEP.match(step)
        if k < len(ops):
            value = value + terms[k + 1] if ops[k] == "+" else value - terms[k + 1]
        ok = (match is not None and k < len(ops) and match.group(2) == ops[k]
              and int(match.group(3)) == terms[k + 1] and int(match.group(4)) == value)
        good = good and ok
        labels.append(int(good))
    labels.append(int(good and answer_score == 1.0))
    return labels


def reasoning_gym_steps(task: str = "chain_sum", *, size: int = 200, seed: int = 0, wrong_per_question: int = 1,
                        answer_template: str = ANSWER_TEMPLATE, min_terms: int = 3,
                        **task_options: Any) -> list[dict]:
    """Step-labelled solutions on reasoning-gym ``chain_sum`` (format ``steps``).

    Each question is worked term by term (``"4 - 1 = 3"``, ``"3 + 7 = 10"``, then the
    answer in ``answer_template``): one correct solution and ``wrong_per_question`` with a
    slip (one step's result off by 1, 2, 3 or 10, at a step drawn with ``seed``; the later
    steps carry the wrong value on, so the answer is wrong too). Labels come from a
    verifier (:func:`chain_sum_step_labels`, the task's own scorer for the answer), not from
    how the solution was made.

    Returns records ``{"prompt", "steps", "labels", "answer", "task", "metadata",
    "first_error"}`` (``first_error``: the index of the first step labelled 0, or None).
    """
    if task not in STEP_TASKS:
        raise ValueError(f"step-labelled solutions are built for {', '.join(STEP_TASKS)}; got task {task!r}")
    dataset = _task_dataset(task, size, seed, {"min_terms": min_terms, **task_options})
    records = []
    for entry in _unique_entries(dataset):
        expression = entry["metadata"]["expression"]
        terms, ops = _chain_terms(expression)
        rng = random.Random(f"{seed}:steps:{entry['metadata'].get('source_index', entry['question'])}")
        slips = [None] + [rng.randrange(len(ops)) for _ in range(wrong_per_question)]
        for slip in slips:
            steps, value = [], terms[0]
            for k, op in enumerate(ops):
                new = value + terms[k + 1] if op == "+" else value - terms[k + 1]
                if k == slip:
                    new += rng.choice((-1, 1)) * rng.choice((1, 2, 3, 10))
                steps.append(f"{value} {op} {terms[k + 1]} = {new}")
                value = new
            steps.append(answer_template.format(answer=value))
            labels = chain_sum_step_labels(expression, steps, _score(dataset, steps[-1], entry))
            records.append({
                "prompt": entry["question"], "steps": steps, "labels": labels, "answer": entry["answer"],
                "task": task, "metadata": entry["metadata"],
                "first_error": labels.index(0) if 0 in labels else None,
            })
    return records


def unpaired_from_pairs(pairs: Iterable[Mapping]) -> list[dict]:
    """KTO feedback from preference pairs: each chosen answer desirable, each rejected not."""
    records = []
    for pair in pairs:
        records.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
        records.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    return records


def champ_pairs(
    version: str = "v0",
    *,
    max_pairs_per_problem: int | None = None,
    seed: int = 0,
    prompt_template: str | None = None,
) -> list[dict]:
    """Preference pairs from champ-dataset's human first-wrong-step annotations.

    Each problem's ``fws_annotations`` maps a generation setting (``"GPT-4|0-Shot"``) to
    the model's solution text with the first wrong step marked by annotators
    (``start_idx is None``: no wrong step). Every correct solution is paired with every
    wrong one of the same problem (or ``max_pairs_per_problem`` of them, drawn with
    ``seed``).

    Args:
      version: the champ data file (``v0`` ships with champ-dataset 1.0.0).
      max_pairs_per_problem: cap on pairs per problem; ``None`` keeps all.
      seed: RNG seed for that draw.
      prompt_template: ``str.format`` template with ``{problem}``; default champ's own
        zero-shot prompt (``"Solve the following problem. ..."``).

    Returns records ``{"prompt", "chosen", "rejected", "answer", "problem_id",
    "category", "chosen_source", "rejected_source"}`` sorted by problem.
    """
    from champ_dataset import prompt as champ_prompt

    if prompt_template is None:
        prompt_template = champ_prompt.prompt_main.replace("{problem.text}", "{problem}")
    data = _champ_data(version)
    rng = random.Random(seed)
    records = []
    for pid in sorted(data.problems, key=_natural_key):
        problem = data.problems[pid]
        annotations = problem.fws_annotations or {}
        correct = [(k, a.text) for k, a in sorted(annotations.items()) if a.start_idx is None and a.text]
        wrong = [(k, a.text) for k, a in sorted(annotations.items()) if a.start_idx is not None and a.text]
        pairs = list(itertools.product(correct, wrong))
        if max_pairs_per_problem is not None and len(pairs) > max_pairs_per_problem:
            pairs = sorted(rng.sample(pairs, max_pairs_per_problem))
        for (c_key, c_text), (r_key, r_text) in pairs:
            records.append(
                {
                    "prompt": prompt_template.format(problem=problem.text),
                    "chosen": c_text,
                    "rejected": r_text,
                    "answer": problem.answer,
                    "problem_id": pid,
                    "category": problem.category,
                    "chosen_source": c_key,
                    "rejected_source": r_key,
                }
            )
    return records


@functools.lru_cache(maxsize=2)
def _champ_data(version: str):
    """The parsed champ file (a 70 MB JSON; parsed once per process, never modified)."""
    import champ_dataset

    return champ_dataset.load(version)


def _natural_key(text: str) -> list:
    """``P_Algebra_10`` after ``P_Algebra_9``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def write_jsonl(records: Iterable[Mapping], path: str | os.PathLike) -> None:
    """Write records one JSON object per line (UTF-8; tuples become lists)."""
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def is_generator_spec(path: str) -> bool:
    """Whether a ``DataConfig.paths`` entry names a generator rather than a file."""
    name = str(path).split(":", 1)[0].split("?", 1)[0]
    return name in GENERATORS and not os.path.exists(path)


def _parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_generator_spec(spec: str) -> tuple[str, str | None, dict[str, Any]]:
    """``"reasoning_gym:chain_sum?size=100&seed=3"`` -> ``("reasoning_gym", "chain_sum", {...})``."""
    head, _, query = spec.partition("?")
    generator, _, target = head.partition(":")
    if generator not in GENERATORS:
        raise ValueError(f"unknown generator {generator!r} in {spec!r}; valid: {', '.join(GENERATORS)}")
    pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    options = {key: _parse_value(value) for key, value in pairs}
    return generator, target or None, options


def generate(spec: str, format: str) -> list[dict]:
    """The records of a generator spec for a data format.

    ``reasoning_gym:<task>?size=..&seed=..&<task options>``: pairs for ``preference``,
    prompts for ``prompt``, verified answers for ``sft`` (and, as one plain text of
    question and answer, for ``text``), chosen/rejected answers as desirable/undesirable
    for ``unpaired``, step-labelled solutions for ``steps`` (``chain_sum`` only). ``champ[:<version>]?max_pairs_per_problem=..&seed=..``:
    pairs for ``preference`` (and ``unpaired``).
    """
    generator, target, options = parse_generator_spec(spec)
    if generator == "reasoning_gym":
        if target is None:
            raise ValueError(f"{spec!r} names no task; write reasoning_gym:<task>, e.g. reasoning_gym:chain_sum")
        if format == "preference":
            return reasoning_gym_pairs(target, **options)
        if format == "prompt":
            return reasoning_gym_prompts(target, **options)
        if format == "sft":
            return reasoning_gym_sft(target, **options)
        if format == "text":
            return [{"text": "\n".join(m["content"] for m in r["messages"]), "answer": r["answer"], "task": r["task"]}
                    for r in reasoning_gym_sft(target, **options)]
        if format == "unpaired":
            return unpaired_from_pairs(reasoning_gym_pairs(target, **options))
        if format == "steps":
            return reasoning_gym_steps(target, **options)
        raise ValueError(f"generator {spec!r} gives formats preference, unpaired, sft, prompt, text, steps; "
                         f"data.format is {format!r}")
    if format not in ("preference", "unpaired"):
        raise ValueError(f"generator {spec!r} gives formats preference, unpaired; data.format is {format!r}")
    pairs = champ_pairs(target or "v0", **options)
    return pairs if format == "preference" else unpaired_from_pairs(pairs)
