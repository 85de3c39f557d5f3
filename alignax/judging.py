"""``alignax judge``: an LLM judge (:class:`alignax.rewards.judge.Judge`) over a JSONL file.

    alignax judge JUDGE_MODEL FILE.jsonl --mode pointwise|pairwise [--out FILE] [--rubric TEXT]
                  [--verdicts yes,no] [--answers a,b]

**Pointwise**: each record holds ``prompt`` and ``completion`` as text (``alignax generate``'s
lines do for text prompts; a prompt given as chat messages is refused, naming the line); the output is the record with ``judge_logp`` (``log p(positive verdict | rubric)``) and
``judge_p`` (that verdict's probability renormalised over the two verdicts), the two scores
``rewards.judge_score`` offers in training.

**Pairwise**: each record holds ``prompt`` and two answers (``--answers``, default the fields
``a`` and ``b``), or the file is ``alignax generate --num-samples 2`` output (two lines per
``record``). The judge reads both orders of the pair (answer A first, then B first) with
verdicts ``A``/``B`` by default, and the probability that the first field's answer is better
is the mean of its two renormalised verdict probabilities, so a judge that favours a
position gains nothing from it (Zheng et al. 2023, "Judging LLM-as-a-Judge", position bias).
Each output line is a preference record ``{prompt, chosen, rejected, judge_p_chosen}``:
``algorithm: dpo`` trains on the file as it is (RLAIF).

The output is written whole or not at all; a record without a field the mode needs is an
error naming the record (its line) and the field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from alignax import paths
from alignax.config import ConfigError

JUDGE_MODES = ("pointwise", "pairwise")
PAIRWISE_RUBRIC = ("Question: {prompt}\n\nAnswer A: {first}\n\nAnswer B: {second}\n\n"
                   "Which answer is better? Reply with A or B.")
PAIRWISE_VERDICTS = ("A", "B")


def read_records(path: str) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, each line one; a bad line named by number."""
    records = []
    for number, line in enumerate(paths.as_path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}, line {number}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{path}, line {number}: a record is a JSON object; got {type(record).__name__}")
        records.append({**record, "_line": number})
    if not records:
        raise ConfigError(f"{path}: no records")
    return records


def _field(record: Mapping[str, Any], name: str, path: str) -> str:
    value = record.get(name)
    if not isinstance(value, str) or not value:
        got = "missing" if name not in record else f"{type(value).__name__} {value!r}"[:80]
        raise ConfigError(f"{path}, line {record['_line']}: field {name!r} must be a non-empty string ({got})")
    return value


def _normalised(logps: np.ndarray) -> np.ndarray:
    """``p(first verdict)`` renormalised over the two: ``[R, 2]`` log-probs -> ``[R]``."""
    return np.exp(logps[:, 0] - np.logaddexp(logps[:, 0], logps[:, 1]))


def pointwise(judge, records: Sequence[Mapping[str, Any]], path: str, *, batch: int = 16) -> list[dict]:
    prompts = [_field(r, "prompt", path) for r in records]
    completions = [_field(r, "completion", path) for r in records]
    logps = np.concatenate([judge.verdict_logps(prompts[i:i + batch], completions[i:i + batch])
                            for i in range(0, len(records), batch)])
    p = _normalised(logps)
    return [{**{k: v for k, v in r.items() if k != "_line"}, "judge_logp": float(logps[i, 0]), "judge_p": float(p[i])}
            for i, r in enumerate(records)]


def pairs(records: Sequence[Mapping[str, Any]], answers: tuple[str, str], path: str) -> list[tuple[str, str, str]]:
    """``(prompt, first answer, second answer)`` of each pair: from the ``answers`` fields, or
    from ``alignax generate`` lines (``record``/``sample``/``completion``), two per record."""
    if all(a in records[0] for a in answers) or "record" not in records[0]:
        return [(_field(r, "prompt", path), _field(r, answers[0], path), _field(r, answers[1], path))
                for r in records]
    groups: dict[int, list[Mapping[str, Any]]] = {}
    for r in records:
        if "record" not in r:
            raise ConfigError(f"{path}, line {r['_line']}: field 'record' is missing (the first line is alignax "
                              f"generate output, which pairs samples by record; or give every line {answers[0]!r} "
                              f"and {answers[1]!r})")
        groups.setdefault(r["record"], []).append(r)
    out = []
    for key, group in groups.items():
        if len(group) != 2:
            raise ConfigError(f"{path}: record {key} has {len(group)} samples (lines "
                              f"{', '.join(str(g['_line']) for g in group)}); pairwise judging of generate's output "
                              "needs --num-samples 2")
        group = sorted(group, key=lambda g: g.get("sample", 0))
        out.append((_field(group[0], "prompt", path), _field(group[0], "completion", path),
                    _field(group[1], "completion", path)))
    return out


def pairwise(judge, records: Sequence[Mapping[str, Any]], path: str, *, answers: tuple[str, str] = ("a", "b"),
             rubric: str = PAIRWISE_RUBRIC, batch: int = 16) -> list[dict]:
    for name in ("{prompt}", "{first}", "{second}"):
        if name not in rubric:
            raise ConfigError(f"--rubric: a pairwise rubric needs {name}; got {rubric!r}")
    items = pairs(records, answers, path)
    heads = []
    for prompt, a, b in items:  # both orders: a first, then b first
        heads.append(judge.turn_ids(rubric.format(prompt=prompt, first=a, second=b)))
        heads.append(judge.turn_ids(rubric.format(prompt=prompt, first=b, second=a)))
    logps = np.concatenate([judge.verdict_logps_of(heads[i:i + batch]) for i in range(0, len(heads), batch)])
    first_wins = _normalised(logps)
    p_a = 0.5 * (first_wins[0::2] + (1.0 - first_wins[1::2]))
    out = []
    for (prompt, a, b), p in zip(items, p_a):
        chosen, rejected, p_chosen = (a, b, p) if p >= 0.5 else (b, a, 1.0 - p)
        out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "judge_p_chosen": float(p_chosen)})
    return out


def run(model: str, path: str, out: str | None, *, mode: str, rubric: str | None = None,
        verdicts: Sequence[str] | None = None, answers: tuple[str, str] = ("a", "b")) -> str:
    """Judge ``path`` with the judge ``model`` and write the results to ``out`` (default
    ``<path>.judged.jsonl``); returns the path written."""
    from alignax.rewards.judge import DEFAULT_RUBRIC, Judge

    if mode not in JUDGE_MODES:
        raise ConfigError(f"--mode {mode!r}: valid: {', '.join(JUDGE_MODES)}")
    records = read_records(path)
    pair = mode == "pairwise"
    default_verdicts = PAIRWISE_VERDICTS if pair else ("yes", "no")
    # the Judge checks a pointwise rubric for {completion}; a pairwise one is checked here
    try:
        judge = Judge(model, rubric=DEFAULT_RUBRIC if pair or rubric is None else rubric,
                      verdicts=tuple(verdicts or default_verdicts))
    except ValueError as err:  # the Judge names its training keys; here they are flags
        message = str(err).replace("rewards.judge_rubric", "--rubric").replace("rewards.judge_verdicts", "--verdicts")
        raise ConfigError(message.replace("rewards.judge_model", "JUDGE_MODEL")) from None
    results = (pairwise(judge, records, path, answers=answers, rubric=rubric or PAIRWISE_RUBRIC) if pair
               else pointwise(judge, records, path))
    out = out or f"{os.path.splitext(path)[0]}.judged.jsonl"
    paths.write_text(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results))
    return out


__all__ = ["JUDGE_MODES", "PAIRWISE_RUBRIC", "PAIRWISE_VERDICTS", "pairs", "pairwise", "pointwise", "read_records",
           "run"]
