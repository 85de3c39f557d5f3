"""tools/mutation/baseline.py keeps the last mutation run's verdicts in the repository and
forgets those a changed test may flip: checked on a scratch project with mutmut's file
formats (its `*.py.meta` and `mutmut-stats.json`), no mutmut run."""

from __future__ import annotations

import json
import shutil

from tests.support.tools import load_tool

baseline = load_tool("mutation/baseline.py", "mutation_baseline")

TESTS = '''import pytest

SCALE = 2


def helper(x):
    return x * SCALE


def test_a():
    assert helper(1) == 2


def test_b():
    assert helper(2) == 4


class CaseTest:
    def test_c(self):
        assert True
'''

PYPROJECT = '''[tool.mutmut]
pytest_add_cli_args_test_selection = ["tests/test_m.py"]
pytest_add_cli_args = ["-x", "--deselect", "tests/test_m.py::test_slow"]
'''


def _project(tmp_path):
    """A project whose mutants of `m.f` test_a reaches, of `m.g` test_b; `m.h` by none."""
    (tmp_path / "tests").mkdir(parents=True)
    (tmp_path / "tests" / "test_m.py").write_text(TESTS)
    (tmp_path / "pyproject.toml").write_text(PYPROJECT)
    mutants = tmp_path / "mutants"
    (mutants / "alignax").mkdir(parents=True)
    stats = {"tests_by_mangled_function_name": {"m.x_f": ["tests/test_m.py::test_a[1]"],
                                                "m.x_g": ["tests/test_m.py::test_b", "tests/test_m.py::CaseTest::test_c_k1"]},
             "duration_by_test": {"tests/test_m.py::test_a[1]": 0.1, "tests/test_m.py::test_b": 0.2,
                                  "tests/test_m.py::CaseTest::test_c_k1": 0.3}}
    (mutants / "mutmut-stats.json").write_text(json.dumps(stats))
    verdicts = {"m.x_f__mutmut_1": 1, "m.x_f__mutmut_2": 0, "m.x_g__mutmut_1": 1, "m.x_g__mutmut_2": 0,
                "m.x_h__mutmut_1": 0}
    (mutants / "alignax" / "m.py.meta").write_text(json.dumps({"exit_code_by_key": verdicts}))
    return tmp_path


def _verdicts(root):
    return json.loads((root / "mutants" / "alignax" / "m.py.meta").read_text())["exit_code_by_key"]


def test_a_tests_hash_covers_its_source_and_its_files_helpers_but_not_other_tests(tmp_path):
    root = _project(tmp_path)
    path = root / "tests" / "test_m.py"
    before = baseline.test_hashes(path, root)
    assert set(before) == {"tests/test_m.py::test_a", "tests/test_m.py::test_b", "tests/test_m.py::CaseTest"}
    path.write_text(TESTS.replace("helper(2) == 4", "helper(2) > 3"))
    after = baseline.test_hashes(path, root)
    assert {k for k in before if before[k] != after[k]} == {"tests/test_m.py::test_b"}
    path.write_text(TESTS.replace("SCALE = 2", "SCALE = 3"))
    changed_helper = baseline.test_hashes(path, root)
    assert all(before[k] != changed_helper[k] for k in before)
    assert baseline.test_key("tests/test_m.py::test_a[1-x]") == "tests/test_m.py::test_a"
    assert baseline.test_key("tests/test_m.py::CaseTest::test_c_k1") == "tests/test_m.py::CaseTest"


def _measure(root, test, *functions):
    """What mutmut's first pass records for a test it runs (its duration, the functions it reaches)."""
    path = root / "mutants" / "mutmut-stats.json"
    stats = json.loads(path.read_text())
    stats["duration_by_test"][test] = 0.1
    for function in functions:
        stats["tests_by_mangled_function_name"].setdefault(function, []).append(test)
    path.write_text(json.dumps(stats))
    return stats


def test_a_changed_test_forgets_every_verdict_it_reached_and_is_measured_again_as_new(tmp_path):
    root = _project(tmp_path)
    assert "3 tests recorded" in baseline.invalidate(root)  # the first run's own tests
    assert _verdicts(root) == {"m.x_f__mutmut_1": 1, "m.x_f__mutmut_2": 0, "m.x_g__mutmut_1": 1,
                               "m.x_g__mutmut_2": 0, "m.x_h__mutmut_1": 0}
    (root / "tests" / "test_m.py").write_text(TESTS.replace("helper(1) == 2", "helper(1) >= 2"))
    message = baseline.invalidate(root)
    assert "1 tests changed or removed" in message and "2 verdicts forgotten" in message
    assert "1 tests wait for mutmut's first pass" in message
    assert _verdicts(root) == {"m.x_f__mutmut_1": None, "m.x_f__mutmut_2": None, "m.x_g__mutmut_1": 1,
                               "m.x_g__mutmut_2": 0, "m.x_h__mutmut_1": 0}
    stats = json.loads((root / "mutants" / "mutmut-stats.json").read_text())
    assert "tests/test_m.py::test_a[1]" not in stats["duration_by_test"]  # mutmut measures it as new
    assert stats["tests_by_mangled_function_name"]["m.x_f"] == []
    assert "0 verdicts forgotten; 1 tests wait" in baseline.invalidate(root)  # not yet measured
    _measure(root, "tests/test_m.py::test_a[1]", "m.x_f", "m.x_h")  # it now reaches h as well
    assert "1 new measured: 1 verdicts forgotten" in baseline.invalidate(root)
    assert _verdicts(root)["m.x_h__mutmut_1"] is None
    assert "0 verdicts forgotten" in baseline.invalidate(root)  # handled once
    assert "wait" not in baseline.invalidate(root)


def test_a_new_test_forgets_only_survivors_and_only_once_mutmut_has_measured_it(tmp_path):
    root = _project(tmp_path)
    baseline.invalidate(root)
    tests = root / "tests" / "test_m.py"
    tests.write_text(TESTS + "\n\ndef test_new():\n    assert helper(0) == 0\n\n\ndef test_slow():\n    pass\n")
    message = baseline.invalidate(root)
    assert "1 tests wait for mutmut's first pass" in message  # test_slow is deselected: never waits
    assert _verdicts(root)["m.x_h__mutmut_1"] == 0
    _measure(root, "tests/test_m.py::test_new", "m.x_h", "m.x_f")
    assert "1 new measured: 2 verdicts forgotten" in baseline.invalidate(root)
    assert _verdicts(root) == {"m.x_f__mutmut_1": 1, "m.x_f__mutmut_2": None, "m.x_g__mutmut_1": 1,
                               "m.x_g__mutmut_2": 0, "m.x_h__mutmut_1": None}


def test_save_then_seed_gives_a_fresh_clone_the_verdicts_and_the_handled_tests(tmp_path):
    root = _project(tmp_path / "run")
    store = tmp_path / "baseline"
    baseline.invalidate(root)
    assert "saved 1 result files" in baseline.save(root, store)
    clone = _project(tmp_path / "clone")
    shutil.rmtree(clone / "mutants")
    assert "a cold run" in baseline.seed(clone, tmp_path / "no-baseline")
    assert "seeded" in baseline.seed(clone, store)
    assert _verdicts(clone) == _verdicts(root)
    assert json.loads((clone / "mutants" / "tests.json").read_text()) == json.loads(
        (root / "mutants" / "tests.json").read_text())
    assert "kept" in baseline.seed(clone, store)
    assert "0 tests changed or removed" in baseline.invalidate(clone)


def test_a_mutants_tests_run_fastest_first_and_mutmuts_own_passes_keep_pytests_order(tmp_path, monkeypatch):
    from tests.support import mutation_order

    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    items = [Item("t::slow"), Item("t::unknown_1"), Item("t::fast"), Item("t::unknown_2"), Item("t::mid")]
    (tmp_path / "mutmut-stats.json").write_text(json.dumps({"duration_by_test": {"t::slow": 9.0, "t::fast": 0.1,
                                                                                 "t::mid": 1.0}}))
    monkeypatch.chdir(tmp_path)
    names = lambda: [item.nodeid for item in items]  # noqa: E731
    for who in ("", "stats", "list_all_tests"):  # mutmut's clean run and first pass
        monkeypatch.setenv("MUTANT_UNDER_TEST", who)
        mutation_order.pytest_collection_modifyitems(None, None, items)
        assert names() == ["t::slow", "t::unknown_1", "t::fast", "t::unknown_2", "t::mid"]
    monkeypatch.setenv("MUTANT_UNDER_TEST", "alignax.kl.x_kl_estimate__mutmut_3")
    mutation_order.pytest_collection_modifyitems(None, None, items)
    assert names() == ["t::fast", "t::mid", "t::slow", "t::unknown_1", "t::unknown_2"]


def test_mutmuts_first_pass_traces_each_tests_calls_again(monkeypatch):
    """In the first pass (MUTANT_UNDER_TEST=stats) a jitted program traced by an earlier test
    is traced again, so mutmut sees the later test call the function; elsewhere the cache stays."""
    import jax
    import jax.numpy as jnp

    from tests.support import mutation_order

    traced = []

    @jax.jit
    def f(x):
        traced.append(1)
        return x + 1

    f(jnp.ones(2))
    for who, new_traces in (("", 0), ("alignax.kl.x_kl_estimate__mutmut_3", 0), ("stats", 1)):
        monkeypatch.setenv("MUTANT_UNDER_TEST", who)
        before = len(traced)
        mutation_order.pytest_runtest_setup(None)
        f(jnp.ones(2))
        f(jnp.ones(2))
        assert len(traced) - before == new_traces, who


def test_pending_names_the_mutants_without_a_verdict(tmp_path):
    root = _project(tmp_path)
    assert baseline.pending("", root) == []
    baseline.invalidate(root)  # records the tests
    (root / "tests" / "test_m.py").write_text(TESTS.replace("helper(1) == 2", "helper(1) >= 2"))
    baseline.invalidate(root)  # test_a changed: f's verdicts forgotten
    assert baseline.pending("", root) == ["m.x_f__mutmut_1", "m.x_f__mutmut_2"]
    assert baseline.pending("m.x_g", root) == []


def _fingerprint(root):
    return json.loads((root / "mutants" / "mutmut-stats.json").read_text())["config_fingerprint"]


def test_a_file_added_to_the_selection_or_a_test_deselected_keeps_the_other_verdicts(tmp_path):
    """mutmut resets every verdict when its selection or pytest options change; the baseline
    gives its stats the new fingerprints when only tests changed (files, --deselect), and
    forgets what those tests touch. Another pytest option is left to mutmut's reset."""
    root = _project(tmp_path)
    stats_path = root / "mutants" / "mutmut-stats.json"
    stats = json.loads(stats_path.read_text())
    stats["config_fingerprint"] = {k: v for k, v in baseline.selection_record(root).items() if k != "other_pytest_args"}
    stats_path.write_text(json.dumps(stats))
    baseline.invalidate(root)  # mutmut's stats are of this configuration: recorded
    assert json.loads((root / "mutants" / "selection.json").read_text()) == baseline.selection_record(root)
    (root / "tests" / "test_n.py").write_text("def test_n():\n    assert True\n")
    (root / "pyproject.toml").write_text(PYPROJECT.replace('"tests/test_m.py"]', '"tests/test_m.py", "tests/test_n.py"]')
                                         .replace('"tests/test_m.py::test_slow"', '"tests/test_m.py::test_slow", '
                                                  '"--deselect", "tests/test_m.py::test_b"'))
    message = baseline.invalidate(root)
    assert "1 tests changed or removed" in message and "2 verdicts forgotten" in message  # test_b reached g
    assert "1 tests wait for mutmut's first pass" in message  # test_n
    assert _fingerprint(root) == {k: v for k, v in baseline.selection_record(root).items() if k != "other_pytest_args"}
    assert _verdicts(root) == {"m.x_f__mutmut_1": 1, "m.x_f__mutmut_2": 0, "m.x_g__mutmut_1": None,
                               "m.x_g__mutmut_2": None, "m.x_h__mutmut_1": 0}
    before = _fingerprint(root)
    (root / "pyproject.toml").write_text(PYPROJECT.replace('["-x", ', '["-x", "-p", "plugin", '))
    baseline.invalidate(root)  # another option: mutmut must see its change and reset
    assert _fingerprint(root)["test_execution"] == before["test_execution"] != \
        baseline.selection_record(root)["test_execution"]


def test_a_functions_earlier_killers_run_first_and_the_baseline_keeps_them(tmp_path, monkeypatch):
    from tests.support import mutation_order

    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    class Report:
        def __init__(self, nodeid, failed):
            self.nodeid, self.failed = nodeid, failed

    root = _project(tmp_path)
    mutants = root / "mutants"
    monkeypatch.chdir(mutants)
    (mutants / "mutmut-stats.json").write_text(json.dumps({"duration_by_test": {"t::slow": 9.0, "t::fast": 0.1,
                                                                                 "t::mid": 1.0}}))
    (mutants / "killers.json").write_text(json.dumps({"m.x_f": {"t::mid": 1}}))  # an earlier run's
    monkeypatch.setenv("MUTANT_UNDER_TEST", "m.x_f__mutmut_1")
    for nodeid, failed in (("t::fast", False), ("t::slow", True)):
        mutation_order.pytest_runtest_logreport(Report(nodeid, failed))
    mutation_order.pytest_runtest_logreport(Report("t::slow", True))
    with (mutants / "killers.jsonl").open("a") as out:
        out.write('{"function": "m.x_f", "te')  # a worker killed mid-line
    items = [Item("t::slow"), Item("t::fast"), Item("t::mid"), Item("t::other")]
    mutation_order.pytest_collection_modifyitems(None, None, items)
    assert [item.nodeid for item in items] == ["t::slow", "t::mid", "t::fast", "t::other"]
    monkeypatch.setenv("MUTANT_UNDER_TEST", "m.x_g__mutmut_1")  # another function: fastest first
    mutation_order.pytest_collection_modifyitems(None, None, items)
    assert [item.nodeid for item in items] == ["t::fast", "t::mid", "t::slow", "t::other"]
    monkeypatch.chdir(tmp_path)
    store = tmp_path / "baseline"
    baseline.save(root, store)
    assert json.loads((store / "killers.json").read_text()) == {"m.x_f": {"t::mid": 1, "t::slow": 2}}
    assert not (mutants / "killers.jsonl").exists()
    shutil.rmtree(mutants)
    baseline.seed(root, store)
    assert mutation_order.kill_counts("m.x_f", mutants) == {"t::mid": 1, "t::slow": 2}


def test_a_survivor_mutmut_ran_after_measuring_a_new_test_is_not_run_again_for_it(tmp_path):
    """mutmut's first pass measures new tests before any mutant runs: a survivor that was
    without a verdict at the last invalidate, and so ran in between, already faced them."""
    root = _project(tmp_path)
    baseline.invalidate(root)
    (root / "tests" / "test_m.py").write_text(TESTS + "\n\ndef test_new():\n    assert helper(0) == 0\n")
    meta = root / "mutants" / "alignax" / "m.py.meta"
    data = json.loads(meta.read_text())
    data["exit_code_by_key"]["m.x_h__mutmut_1"] = None  # a changed function: mutmut will run it
    meta.write_text(json.dumps(data))
    baseline.invalidate(root)  # before the run: test_new waits
    _measure(root, "tests/test_m.py::test_new", "m.x_h", "m.x_f")  # the run measures it, then runs h 1
    data["exit_code_by_key"]["m.x_h__mutmut_1"] = 0
    meta.write_text(json.dumps(data))
    assert "1 new measured: 1 verdicts forgotten" in baseline.invalidate(root)  # f's survivor only
    assert _verdicts(root)["m.x_h__mutmut_1"] == 0 and _verdicts(root)["m.x_f__mutmut_2"] is None
