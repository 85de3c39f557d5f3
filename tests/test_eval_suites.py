"""``alignax eval --suite`` (alignax.eval_suites): the suite's problems are fixed by the seed;
the report's and the table's figures equal ones recomputed here from the per-problem
records (pass@k by Chen et al.'s binomial formula with math.comb); a verifier that accepts
everything gives 100%, the toy model (it never writes a number) 0% under the task's own
verifier, which accepts a right answer; one-line refusals of bad flags.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest

from alignax import cli, eval_suites
from alignax.eval_suites import SuiteOptions, SuiteTask

# The toy model's runs share one decoding (budget, batch, n, temperature): compiled once.
SCRIPTED = SuiteOptions(problems=6, seed=1, pass_k=(1, 2, 3), num_samples=4, temperature=1.5, max_new_tokens=5,
                        batch_size=4)
CHAIN_SUM = SuiteTask("chain_sum", "chain_sum", (("min_terms", 2), ("max_terms", 2), ("max_digits", 2)))


def _records(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _by_length(completions, references):
    """A verdict that varies with what the model wrote (and so with the seed): an even
    number of characters is 'correct'."""
    return np.array([len(c) % 2 == 0 for c in completions])


def test_a_suites_problems_are_fixed_by_its_seed():
    first = eval_suites.problems(CHAIN_SUM, 12, seed=3)
    assert first == eval_suites.problems(CHAIN_SUM, 12, seed=3)
    assert len(first) == 12 and len({r["prompt"] for r in first}) == 12
    other = eval_suites.problems(CHAIN_SUM, 12, seed=4)
    assert [r["prompt"] for r in first] != [r["prompt"] for r in other]
    # a task with few distinct questions: duplicates are drawn past, not repeated
    tiny = SuiteTask("one_digit", "chain_sum", (("min_terms", 2), ("max_terms", 2), ("max_digits", 1)))
    assert len({r["prompt"] for r in eval_suites.problems(tiny, 40, seed=0)}) == 40


def test_the_task_verifier_accepts_a_right_answer_and_refuses_a_wrong_one():
    record = eval_suites.problems(CHAIN_SUM, 1, seed=0)[0]
    verify = eval_suites.task_verifier(SuiteOptions(extraction="tag"))
    got = verify([f"<answer>{record['answer']}</answer>", f"<answer>{int(record['answer']) + 1}</answer>",
                  f"so it is {record['answer']}"], [record] * 3)
    assert got.tolist() == [True, False, False]
    prose = eval_suites.task_verifier(SuiteOptions(extraction="tag_or_last_number"))
    assert prose([f"so it is {record['answer']}"], [record]).tolist() == [True]


@pytest.fixture(scope="module")
def scripted_run(toy_model, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("suite") / "report.json")
    report = eval_suites.run(toy_model, "arithmetic", out, SCRIPTED, verify=_by_length)
    return report, out


def test_the_table_and_report_equal_figures_recomputed_from_the_records(scripted_run):
    report, out = scripted_run
    json_path, md_path, records_path = eval_suites.output_paths(out)
    with open(json_path, encoding="utf-8") as f:
        assert json.load(f) == report
    records = _records(records_path)
    table = open(md_path, encoding="utf-8").read().splitlines()
    assert table[0] == "| suite | task | problems | greedy accuracy | pass@1 (n=4) | pass@2 (n=4) | pass@3 (n=4) |"
    rows = {line.split(" | ")[1]: line for line in table[2:]}
    assert set(rows) == {"chain_sum", "basic_arithmetic"}
    mixed = 0
    for task, figures in report["suites"]["arithmetic"].items():
        mine = [r for r in records if r["task"] == task]
        assert [r["index"] for r in mine] == list(range(6)) and figures["problems"] == 6
        for r in mine:  # the verdicts are the verifier's on the written completions
            assert r["greedy_correct"] == (len(r["greedy_completion"]) % 2 == 0)
            assert r["sample_correct"] == [len(c) % 2 == 0 for c in r["sample_completions"]]
            assert r["num_correct"] == sum(r["sample_correct"])
        counts = [r["num_correct"] for r in mine]
        mixed += len(set(counts)) > 1
        greedy = sum(r["greedy_correct"] for r in mine)
        assert figures["correct"] == greedy and figures["accuracy"] == pytest.approx(greedy / 6)
        assert figures["sampled_accuracy"] == pytest.approx(np.mean(counts) / 4)
        cells = re.findall(r"[\d.]+%", rows[task])
        assert rows[task].split(" | ")[3].startswith(f"{greedy}/6 ")
        assert cells[0] == f"{100 * greedy / 6:.1f}%"
        for k, cell in zip((1, 2, 3), cells[1:]):
            want = np.mean([1 - math.comb(4 - c, k) / math.comb(4, k) for c in counts])
            assert figures[f"pass@{k}"] == pytest.approx(want, abs=1e-12)
            assert cell == f"{100 * want:.1f}%"
    assert mixed, "the scripted verdicts should differ between problems (else the check proves little)"
    settings = report["settings"]
    assert (settings["seed"], settings["pass_k"], settings["num_samples"], settings["temperature"]) == (1, [1, 2, 3],
                                                                                                       4, 1.5)
    assert report["model"] and report["alignax_version"]


def test_the_same_seed_gives_the_same_report(scripted_run, toy_model, tmp_path):
    report, _ = scripted_run
    again = eval_suites.run(toy_model, "arithmetic", str(tmp_path / "again.json"), SCRIPTED, verify=_by_length)
    assert again["suites"] == report["suites"]


def test_accept_everything_scores_100_and_a_model_that_never_answers_0(toy_model, tmp_path):
    options = dataclasses.replace(SCRIPTED, problems=3, pass_k=(2,))  # the same decoding: no new compile

    def accept_all(completions, references):
        return np.ones(len(completions), bool)

    everything = eval_suites.run(toy_model, "reasoning_gym:chain_sum", str(tmp_path / "all.json"), options,
                                 verify=accept_all)
    figures = everything["suites"]["reasoning_gym:chain_sum"]["chain_sum"]
    assert (figures["accuracy"], figures["pass@2"], figures["sampled_accuracy"]) == (1.0, 1.0, 1.0)
    # the task's own verifier: the toy model's words hold no number and no answer tag
    nothing = eval_suites.run(toy_model, "reasoning_gym:chain_sum", str(tmp_path / "none.json"), options)
    figures = nothing["suites"]["reasoning_gym:chain_sum"]["chain_sum"]
    assert (figures["accuracy"], figures["pass@2"], figures["sampled_accuracy"]) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="gave shape \\(1,\\) for 3 completions"):
        eval_suites.run(toy_model, "reasoning_gym:chain_sum", str(tmp_path / "bad.json"), options,
                        verify=lambda completions, references: np.ones(1, bool))


def test_the_cli_writes_the_report_table_and_records(toy_model, tmp_path, capsys):
    out = tmp_path / "cli.json"
    assert cli.main(["eval", toy_model, "--suite", "reasoning_gym:chain_sum?max_digits=1", "--problems", "2",
                     "--max-new-tokens", "5", "--batch-size", "4", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("| suite | task | problems | greedy accuracy |") and printed[-1] == str(out)
    report = json.loads(out.read_text())
    figures = report["suites"]["reasoning_gym:chain_sum?max_digits=1"]["chain_sum"]
    assert figures["problems"] == 2 and figures["options"] == {"max_digits": 1} and "pass@1" not in figures
    assert len(_records(tmp_path / "cli.records.jsonl")) == 2 and (tmp_path / "cli.md").exists()


@pytest.mark.parametrize("argv, message", [
    (["--suite", "arithmetic,gsm8k"], "unknown suite 'gsm8k'; known: arithmetic, counting, math"),
    (["--suite", "reasoning_gym:chain_summ"], "did you mean 'chain_sum'"),
    (["--suite", "reasoning_gym:chain_sum?bogus=1"], "unexpected keyword argument 'bogus'"),
    (["--suite", "arithmetic", "--pass-k", "1,8", "--num-samples", "4"], "--pass-k 8 exceeds --num-samples 4"),
    (["--suite", "arithmetic", "--num-samples", "4"], "--num-samples 4 needs --pass-k"),
    (["--suite", "arithmetic", "--pass-k", "0"], "--pass-k 0: each k must be a positive integer"),
    (["--suite", "arithmetic", "--pass-k", "four"], "--pass-k 'four': expected comma-separated positive integers"),
    (["--suite", "arithmetic", "--problems", "0"], "--problems 0: expected a positive integer"),
    (["--suite", "arithmetic", "--extraction", "regex"], "--extraction 'regex': valid: tag, tag_or_last_number"),
    (["--pass-k", "4"], "--pass-k apply to --suite"),
])
def test_bad_flags_are_refused_in_one_line(argv, message, capsys):
    assert cli.main(["eval", "some-model", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_help_names_the_suites(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["eval", "--help"])
    assert stop.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--suite NAME[,NAME...]" in text and "arithmetic, counting, math" in text and "--pass-k" in text


def test_without_suite_eval_is_still_the_recipes_own_evaluation(monkeypatch, capsys):
    from alignax.trainers import api

    seen = []
    monkeypatch.setattr(api, "evaluate", lambda config, step=None: seen.append((config.algorithm, step)) or {"x": 1.0})
    assert cli.main(["eval", "configs/tiny-dpo.yaml", "--step", "3"]) == 0
    assert seen == [("dpo", 3)] and json.loads(capsys.readouterr().out) == {"x": 1.0}
