"""tools/mutation/summary.py decides `make mutation`'s verdict: its counting, its stale-entry
rule and its exit code are checked here on a stand-in `mutmut` that prints fixed results."""

from __future__ import annotations

import stat
import sys

import pytest

from tests.support.tools import load_tool


summary = load_tool("mutation/summary.py", "mutation_summary")


def _fake_mutmut(tmp_path, lines: list[str]) -> str:
    """An executable that answers `mutmut results --all true` with ``lines``."""
    path = tmp_path / "mutmut"
    body = "\n".join(lines)
    path.write_text(f"#!{sys.executable}\nimport sys\nassert sys.argv[1:] == ['results', '--all', 'true'], sys.argv\n"
                    f"print({body!r})\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_score_counts_killed_timeouts_and_segfaults_and_leaves_listed_equivalents_out():
    results = {"m.a__mutmut_1": "killed", "m.a__mutmut_2": "timeout", "m.a__mutmut_3": "segfault",
               "m.a__mutmut_4": "survived", "m.a__mutmut_5": "survived", "m.a__mutmut_6": "not checked"}
    killed, counted, survivors, stale = summary.score(results, ["m.a__mutmut_5"])
    assert (killed, counted) == (3, 5)
    assert survivors == ["m.a__mutmut_4: survived", "m.a__mutmut_6: not checked"]
    assert stale == []


def test_an_equivalent_that_is_now_killed_or_gone_is_stale():
    results = {"m.b__mutmut_1": "killed", "m.b__mutmut_2": "survived"}
    _, _, _, stale = summary.score(results, ["m.b__mutmut_1", "m.b__mutmut_2", "m.b__mutmut_9"])
    assert stale == ["m.b__mutmut_1", "m.b__mutmut_9"]


def test_listed_equivalents_reads_the_names_of_the_bullet_lines(tmp_path):
    page = tmp_path / "EQUIVALENT.md"
    page.write_text("# title\n\n- `x.y__mutmut_3`: why\nprose `x.y__mutmut_4`\n- `x.z__mutmut_1`: why\n")
    assert summary.listed_equivalents(str(page)) == ["x.y__mutmut_3", "x.z__mutmut_1"]


@pytest.mark.parametrize(("statuses", "threshold", "code"), [
    (["killed"] * 19 + ["survived"], 95.0, 0),   # 95.0% meets a 95% threshold
    (["killed"] * 18 + ["survived"] * 2, 95.0, 1),  # 90% does not
    (["killed"] * 18 + ["survived"] * 2, 90.0, 0),
])
def test_main_prints_the_one_line_score_and_exits_on_the_threshold(tmp_path, capsys, monkeypatch, statuses, threshold, code):
    lines = [f"    zz.f__mutmut_{i}: {s}" for i, s in enumerate(statuses, 1)]
    monkeypatch.setattr(summary, "listed_equivalents", lambda path=None: [])
    got = summary.main(["--mutmut", _fake_mutmut(tmp_path, lines), "--threshold", str(threshold)])
    out = capsys.readouterr().out
    killed = statuses.count("killed")
    assert f"mutation: killed {killed} of {len(statuses)} ({100 * killed / len(statuses):.1f}%)" in out
    assert got == code


def test_main_scores_one_module_and_fails_on_a_stale_entry(tmp_path, capsys, monkeypatch):
    lines = ["a.kl.f__mutmut_1: killed", "a.kl.f__mutmut_2: killed", "a.ops.g__mutmut_1: survived"]
    monkeypatch.setattr(summary, "listed_equivalents", lambda path=None: ["a.kl.f__mutmut_2"])
    got = summary.main(["--mutmut", _fake_mutmut(tmp_path, lines), "--module", "a.kl", "--threshold", "0"])
    out = capsys.readouterr().out
    assert "mutation: killed 1 of 1 (100.0%)" in out      # a.ops is not scored
    assert "stale     a.kl.f__mutmut_2: killed" in out
    assert got == 1


def test_main_with_no_results_says_to_run_mutmut_first(tmp_path, capsys):
    assert summary.main(["--mutmut", _fake_mutmut(tmp_path, ["nothing here"])]) == 1
    assert "run `mutmut run` first" in capsys.readouterr().err
