"""``alignax eval MODEL_OR_RECIPE --suite NAME[,NAME...]``: accuracy and pass@k of a policy
on benchmark suites whose problems ship inside PyPI packages (reasoning-gym's procedural
tasks), with a JSON report, a Markdown table and one JSONL record per problem.

A *suite* is a few named tasks (:data:`SUITES`, or ``reasoning_gym:<task>?<option>=...``
for any single reasoning-gym task); a task is a reasoning-gym generator with fixed options,
``problems`` distinct questions drawn with ``seed`` (the same seed gives the same problems),
a response budget, and a verifier: the task's own ``score_answer`` on the answer the
completion gives (:func:`alignax.rewards.verifiers.verifier_rewards`; correct when it scores
1). Each question is one user turn after the system prompt (reasoning-gym's answer-format
instructions, ``--system-prompt``), rendered with the model's own chat template.

Per task:

- ``accuracy``: the share of problems whose greedy (temperature 0) completion is correct;
- with ``pass_k``: ``n`` samples a problem (``num_samples``, default ``max(pass_k)``) at
  ``temperature``, ``pass@k`` for each k by the unbiased estimator of Chen et al. 2021
  (:func:`alignax.evaluation.pass_at_k`, ``1 - C(n-c, k) / C(n, k)`` averaged over
  problems) and ``sampled_accuracy`` (``c / n`` averaged: pass@1 from all ``n`` samples).

Loading is :func:`alignax.generate.load_policy` (a model name or folder, or a recipe's
checkpoint) and decoding :func:`alignax.generate.completions`, as ``alignax generate``.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from alignax import paths
from alignax.config import ConfigError

log = logging.getLogger(__name__)

# ``verify(completions, references) -> bool [N]``: which completions answer their problem.
Verifier = Callable[[Sequence[str], Sequence[Mapping]], np.ndarray]


@dataclasses.dataclass(frozen=True)
class SuiteTask:
    """One task of a suite: reasoning-gym ``task`` with ``options`` (its config fields),
    reported as ``name``, answered within ``max_new_tokens``."""

    name: str
    task: str
    options: tuple[tuple[str, Any], ...] = ()
    max_new_tokens: int = 64


# The named suites. Budgets fit what the task asks: a number (64 tokens) or a worked word
# problem (256).
SUITES: dict[str, tuple[SuiteTask, ...]] = {
    "arithmetic": (
        SuiteTask("chain_sum", "chain_sum", (("min_terms", 2), ("max_terms", 2), ("min_digits", 1), ("max_digits", 2))),
        SuiteTask("basic_arithmetic", "basic_arithmetic",
                  (("min_terms", 2), ("max_terms", 2), ("min_digits", 1), ("max_digits", 1))),
    ),
    "counting": (
        SuiteTask("letter_counting", "letter_counting"),
        SuiteTask("leg_counting", "leg_counting"),
    ),
    "math": (
        SuiteTask("gsm_symbolic", "gsm_symbolic", max_new_tokens=256),
        SuiteTask("simple_equations", "simple_equations"),
        SuiteTask("gcd", "gcd"),
    ),
}


@dataclasses.dataclass(frozen=True)
class SuiteOptions:
    """How a suite is run (``alignax eval --suite``'s flags)."""

    problems: int = 50
    seed: int = 0
    pass_k: tuple[int, ...] = ()
    num_samples: int | None = None  # default max(pass_k)
    temperature: float = 1.0
    max_new_tokens: int | None = None  # default: each task's own
    batch_size: int = 16
    system_prompt: str | None = "direct"  # a reasoning-gym SYSTEM_PROMPTS name, literal text, or None
    extraction: str = "tag_or_last_number"

    @property
    def samples(self) -> int:
        """``n``: samples a problem for pass@k (0 without pass_k)."""
        if self.num_samples is not None:
            return self.num_samples if self.pass_k else 0
        return max(self.pass_k, default=0)


def check_options(options: SuiteOptions) -> None:
    """Each flag refused in one line naming it."""
    from alignax.rewards.verifiers import EXTRACTIONS

    for flag, value in (("--problems", options.problems), ("--batch-size", options.batch_size),
                        ("--num-samples", options.num_samples), ("--max-new-tokens", options.max_new_tokens)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} {value}: expected a positive integer")
    bad = [k for k in options.pass_k if k < 1]
    if bad:
        raise ConfigError(f"--pass-k {','.join(map(str, options.pass_k))}: each k must be a positive integer")
    if options.num_samples is not None and not options.pass_k:
        raise ConfigError(f"--num-samples {options.num_samples} needs --pass-k (the k of the sampled pass@k)")
    n = options.samples
    over = [k for k in options.pass_k if k > n]
    if over:
        raise ConfigError(f"--pass-k {max(over)} exceeds --num-samples {n}: pass@k needs k <= n samples a problem")
    if options.pass_k and not options.temperature > 0:
        raise ConfigError(f"--temperature {options.temperature:g}: pass@k samples need a temperature > 0")
    if options.extraction not in EXTRACTIONS:
        raise ConfigError(f"--extraction {options.extraction!r}: valid: {', '.join(EXTRACTIONS)}")


def resolve(names: str) -> dict[str, tuple[SuiteTask, ...]]:
    """``"arithmetic,reasoning_gym:gcd?min_value=2"`` -> the suites it names, in order;
    an unknown name refused with every valid one."""
    from alignax.data.builders import parse_generator_spec
    from alignax.rewards.verifiers import check_task

    out: dict[str, tuple[SuiteTask, ...]] = {}
    for name in (part.strip() for part in names.split(",")):
        if name in SUITES:
            out[name] = SUITES[name]
            continue
        if name.startswith("reasoning_gym:"):
            try:
                _, task, options = parse_generator_spec(name)
                check_task(task or "")
            except ValueError as err:
                raise ConfigError(f"--suite {name!r}: {err}") from None
            spec = SuiteTask(task, task, tuple(sorted(options.items())))
            try:  # the options now, in one line, rather than after the model has loaded
                problems(spec, 1, 0)
            except (TypeError, ValueError, AssertionError) as err:
                raise ConfigError(f"--suite {name!r}: reasoning-gym's {task} refuses these options: {err}") from None
            out[name] = (spec,)
            continue
        raise ConfigError(f"--suite: unknown suite {name!r}; known: {', '.join(SUITES)}, or "
                          "reasoning_gym:<task>[?option=value&...] for any reasoning-gym task")
    return out


def problems(task: SuiteTask, count: int, seed: int) -> list[dict]:
    """The first ``count`` distinct questions of ``task`` drawn with ``seed``: prompt records
    ``{"prompt", "answer", "task", "metadata"}`` (fewer when the task has fewer questions)."""
    from alignax.data.builders import reasoning_gym_prompts

    size = count
    while True:  # repeated questions are dropped: draw more until there are enough
        records = reasoning_gym_prompts(task.task, size=size, seed=seed, **dict(task.options))
        if len(records) >= count or size >= 8 * count:
            return records[:count]
        size *= 2


def system_prompt(value: str | None) -> str | None:
    """A reasoning-gym system prompt by name (``default``, ``direct``, ...), or the text itself."""
    if value is None or value.lower() == "none":
        return None
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS.get(value, value)


def task_verifier(options: SuiteOptions) -> Verifier:
    """The task's own scorer on the extracted answer; correct when it scores 1."""
    from alignax.rewards.verifiers import verifier_rewards

    def verify(completions: Sequence[str], references: Sequence[Mapping]) -> np.ndarray:
        _, components = verifier_rewards(completions, references, extraction=options.extraction)
        return components["correct"] > 0

    return verify


def _decode(model, tokenizer, records: list[dict], options: SuiteOptions, *, budget: int, greedy: bool):
    """Completions of every record: ``[len(records)][samples]`` texts."""
    from alignax.data import DataConfig
    from alignax.generate import GenerateOptions, completions, prompt_rows, prompt_width

    samples = 1 if greedy else options.samples
    decode = GenerateOptions(num_samples=samples, greedy=greedy, temperature=options.temperature,
                             max_new_tokens=budget, batch_size=options.batch_size, seed=options.seed)
    width = prompt_width(decode, model.config.max_position_embeddings)
    base = DataConfig(system_prompt=system_prompt(options.system_prompt))
    out: list[list[str]] = [[""] * samples for _ in records]
    batches = prompt_rows("suite", tokenizer, decode, width, base, records=records)
    for line in completions(model, tokenizer, batches, decode):
        out[line["record"]][line["sample"]] = line["completion"]
    return out


def _verdicts(verify: Verifier, completions: Sequence[str], references: Sequence[Mapping], task: str) -> np.ndarray:
    """``verify``'s verdicts as bool ``[N]``, refused when it gave another shape."""
    verdicts = np.asarray(verify(completions, references))
    if verdicts.shape != (len(completions),):
        raise ValueError(f"task {task}: the verifier gave shape {verdicts.shape} for {len(completions)} completions; "
                         "expected one verdict each")
    return verdicts.astype(bool)


def run_task(model, tokenizer, task: SuiteTask, options: SuiteOptions, *,
             verify: Verifier | None = None) -> tuple[dict[str, Any], list[dict]]:
    """``(figures, per-problem records)`` of one task (the module docstring's figures)."""
    from alignax.evaluation import pass_at_k

    verify = verify or task_verifier(options)
    records = problems(task, options.problems, options.seed)
    if not records:
        raise ConfigError(f"task {task.name}: reasoning-gym's {task.task} gave no problems with {dict(task.options)}")
    budget = options.max_new_tokens or task.max_new_tokens
    greedy = [texts[0] for texts in _decode(model, tokenizer, records, options, budget=budget, greedy=True)]
    greedy_correct = _verdicts(verify, greedy, records, task.name)
    rows = [{"task": task.name, "index": i, "question": r["prompt"], "answer": r["answer"],
             "greedy_completion": text, "greedy_correct": bool(ok)}
            for i, (r, text, ok) in enumerate(zip(records, greedy, greedy_correct))]
    figures: dict[str, Any] = {"problems": len(records), "accuracy": float(np.mean(greedy_correct)),
                               "correct": int(np.sum(greedy_correct))}
    n = options.samples
    if n:
        sampled = _decode(model, tokenizer, records, options, budget=budget, greedy=False)
        flat = [text for texts in sampled for text in texts]
        correct = _verdicts(verify, flat, [r for r in records for _ in range(n)], task.name).reshape(len(records), n)
        counts = correct.sum(axis=1)
        for row, texts, oks in zip(rows, sampled, correct):
            row.update(sample_completions=texts, sample_correct=[bool(ok) for ok in oks], num_correct=int(oks.sum()))
        figures["num_samples"] = n
        figures["sampled_accuracy"] = float(np.mean(counts / n))
        for k in options.pass_k:
            figures[f"pass@{k}"] = float(np.mean(pass_at_k(n, counts, k)))
    figures.update(task=task.task, options=dict(task.options), max_new_tokens=budget)
    return figures, rows


def alignax_version() -> str:
    try:
        return importlib.metadata.version("alignax")
    except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH
        return "unknown"


def markdown_table(report: Mapping[str, Any]) -> str:
    """The report as a Markdown table: one row a task, greedy accuracy (correct/problems)
    and each pass@k, in percent."""
    ks = report["settings"]["pass_k"]
    head = ["suite", "task", "problems", "greedy accuracy", *(f"pass@{k} (n={report['settings']['num_samples']})"
                                                              for k in ks)]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for suite, tasks in report["suites"].items():
        for name, f in tasks.items():
            cells = [suite, name, str(f["problems"]), f"{f['correct']}/{f['problems']} ({100 * f['accuracy']:.1f}%)",
                     *(f"{100 * f[f'pass@{k}']:.1f}%" for k in ks)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def output_paths(out: str) -> tuple[str, str, str]:
    """``(report.json, table.md, records.jsonl)`` of ``--out`` (``X.json`` or ``X``)."""
    stem = out[:-5] if out.endswith(".json") else out
    return f"{stem}.json", f"{stem}.md", f"{stem}.records.jsonl"


def run(source: str, suites: str, out: str, options: SuiteOptions, *, step: int | None = None,
        overrides: Sequence[str] = (), verify: Verifier | None = None) -> dict[str, Any]:
    """Evaluate ``source`` (:func:`alignax.generate.load_policy`) on ``suites``
    (:func:`resolve`), write the report, the table and the records (:func:`output_paths`;
    rewritten whole after each task), and return the report."""
    from alignax.generate import load_policy, recipe_config

    check_options(options)
    chosen = resolve(suites)
    config = recipe_config(source, overrides)
    model, tokenizer = load_policy(source, step=step, overrides=overrides, config=config)
    report: dict[str, Any] = {
        "model": source if config is None else config.model.name, "source": source, "step": step,
        "alignax_version": alignax_version(),
        "settings": {**dataclasses.asdict(options), "pass_k": list(options.pass_k), "num_samples": options.samples,
                     "system_prompt_text": system_prompt(options.system_prompt), "greedy": "temperature 0 (argmax)"},
        "suites": {},
    }
    lines = []
    for suite, tasks in chosen.items():
        report["suites"][suite] = {}
        for task in tasks:
            start = time.perf_counter()
            figures, rows = run_task(model, tokenizer, task, options, verify=verify)
            log.info("%s/%s: %d problems, greedy accuracy %.3f%s (%.0f s)", suite, task.name, figures["problems"],
                     figures["accuracy"], "".join(f", pass@{k} {figures[f'pass@{k}']:.3f}" for k in options.pass_k),
                     time.perf_counter() - start)
            report["suites"][suite][task.name] = figures
            lines += [json.dumps({"suite": suite, **row}, ensure_ascii=False) + "\n" for row in rows]
            _write(out, report, lines)  # after every task: a stopped run keeps the tasks it finished
    return report


def _write(out: str, report: Mapping[str, Any], lines: Sequence[str]) -> None:
    json_path, md_path, records_path = output_paths(out)
    if os.path.dirname(json_path):
        paths.as_path(json_path).parent.mkdir(parents=True, exist_ok=True)
    paths.write_text(json_path, json.dumps(report, indent=2) + "\n")
    paths.write_text(md_path, markdown_table(report))
    paths.write_text(records_path, "".join(lines))


__all__ = ["SUITES", "SuiteOptions", "SuiteTask", "check_options", "markdown_table", "output_paths", "problems",
           "resolve", "run", "run_task"]
