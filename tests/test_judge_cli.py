"""``alignax judge``: an LLM judge over a JSONL file, pointwise scores and pairwise preferences."""

from __future__ import annotations

import json

import numpy as np
import pytest

from alignax import cli
from alignax.data import write_jsonl
from alignax.rewards.judge import Judge

RECORDS = [{"prompt": "what is the cat", "a": "yes the cat", "b": "no dog"},
           {"prompt": "the dog ran", "a": "mat sat", "b": "yes yes ran"}]


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def judged(tmp_path, toy_model):
    def run(records, *flags):
        src = tmp_path / "in.jsonl"
        write_jsonl(records, src)
        out = tmp_path / "out.jsonl"
        assert cli.main(["judge", toy_model, str(src), "--out", str(out), *flags]) == 0
        return _lines(out)
    return run


def test_pointwise_scores_are_the_judges_verdict_log_probs(judged, toy_model):
    records = [{"prompt": r["prompt"], "completion": r["a"], "keep": i} for i, r in enumerate(RECORDS)]
    lines = judged(records)
    judge = Judge(toy_model)
    logps = judge.verdict_logps([r["prompt"] for r in records], [r["completion"] for r in records])
    for line, record, lp in zip(lines, records, logps):
        assert line["keep"] == record["keep"] and line["completion"] == record["completion"]  # the record kept
        assert line["judge_logp"] == pytest.approx(lp[0], abs=1e-5)
        assert line["judge_p"] == pytest.approx(np.exp(lp[0]) / (np.exp(lp[0]) + np.exp(lp[1])), abs=1e-5)


def test_pairwise_reads_both_orders_and_writes_preference_records(judged, toy_model):
    from alignax.judging import PAIRWISE_RUBRIC

    # the toy tokenizer knows words only: "A" and "B" are one unknown id; "yes"/"no" stand for them
    lines = judged(RECORDS, "--mode", "pairwise", "--verdicts", "yes,no")
    judge = Judge(toy_model, verdicts=("yes", "no"))
    for line, r in zip(lines, RECORDS):
        heads = [judge.turn_ids(PAIRWISE_RUBRIC.format(prompt=r["prompt"], first=x, second=y))
                 for x, y in ((r["a"], r["b"]), (r["b"], r["a"]))]
        lp = judge.verdict_logps_of(heads)
        first = np.exp(lp[:, 0] - np.logaddexp(lp[:, 0], lp[:, 1]))
        p_a = 0.5 * (first[0] + 1 - first[1])  # a as answer A, and a as answer B
        want = (r["a"], r["b"], p_a) if p_a >= 0.5 else (r["b"], r["a"], 1 - p_a)
        assert (line["prompt"], line["chosen"], line["rejected"]) == (r["prompt"], want[0], want[1])
        assert line["judge_p_chosen"] == pytest.approx(want[2], abs=1e-5) and line["judge_p_chosen"] >= 0.5
        # one order alone would differ: the position bias the two orders cancel
        assert abs(first[0] - (1 - first[1])) > 1e-4


def test_pairwise_pairs_generate_output_and_its_result_is_dpo_data(judged, tmp_path, toy_model):
    from alignax.data import DataConfig, prepare_dataset
    from alignax.models.registry import load_tokenizer

    samples = [{"record": i // 2, "sample": i % 2, "prompt": RECORDS[i // 2]["prompt"],
                "completion": RECORDS[i // 2]["ab"[i % 2]]} for i in range(4)]
    from_samples = judged(samples, "--mode", "pairwise", "--verdicts", "yes,no")
    from_fields = judged(RECORDS, "--mode", "pairwise", "--verdicts", "yes,no")
    assert from_samples == from_fields
    path = tmp_path / "pairs.jsonl"
    write_jsonl(from_samples, path)
    data = prepare_dataset(DataConfig(paths=(str(path),), format="preference", max_length=64, max_prompt_length=32,
                                      batch_size=2), load_tokenizer(toy_model))
    assert data.stats["kept"] == 2


@pytest.mark.parametrize(("records", "flags", "message"), [
    ([{"prompt": "x"}], [], "line 1: field 'completion' must be a non-empty string (missing)"),
    ([{"prompt": "x", "a": "y", "b": 3}], ["--mode", "pairwise"], "line 1: field 'b' must be a non-empty string"),
    ([{"prompt": "x", "completion": "y"}], ["--rubric", "no slots"], "--rubric must contain {completion}"),
    ([{"prompt": "x", "a": "y", "b": "z"}], ["--mode", "pairwise", "--rubric", "{prompt} {first}"],
     "--rubric: a pairwise rubric needs {second}"),
    ([{"prompt": "x", "completion": "y"}], ["--verdicts", "yes,yes"], "--verdicts must be two different"),
    ([{"record": 0, "sample": 0, "prompt": "x", "completion": "y"}], ["--mode", "pairwise"],
     "record 0 has 1 samples (lines 1)"),
])
def test_bad_records_and_flags_are_one_line_and_exit_2(tmp_path, toy_model, capsys, records, flags, message):
    src = tmp_path / "in.jsonl"
    write_jsonl(records, src)
    assert cli.main(["judge", toy_model, str(src), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_judge_takes_no_dotted_overrides(toy_model, tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["judge", toy_model, str(tmp_path / "x.jsonl"), "optim.learning_rate=1"])
