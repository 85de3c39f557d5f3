"""The results of the last whole-core mutation run, kept in the repository, and what
invalidates them.

A cold run of every mutant of the functional core takes hours on 2 cores (each mutant is a
process that compiles its tests' programs). mutmut keeps its results in ``mutants/``
(per source file, ``*.py.meta``: each mutant's verdict and a hash of each function; and
``mutmut-stats.json``: which test reaches which function, and how long each test took), and
on the next run tests again only the mutants of functions whose code changed. This tool
keeps a copy of those files in ``tools/mutation/baseline/``, so that ``make mutation`` on a
fresh clone starts from the last run's verdicts instead of from nothing:

    python tools/mutation/baseline.py seed        # mutants/ empty: copy the baseline in
    python tools/mutation/baseline.py invalidate  # forget verdicts that changed tests may flip
    python tools/mutation/baseline.py save        # copy mutants/ back, after a run
    python tools/mutation/baseline.py pending     # the mutants without a verdict, by name

mutmut itself re-tests a function when its code changes (and the functions that call it),
but not when a test changes. ``invalidate`` covers that: the baseline records a hash of
every test of the selection (its own source, with its file's module-level code, which
holds the file's helpers and fixtures); every verdict of a function that a changed or
removed test reached is forgotten, and a changed test is measured again as a new one; every
survivor of a function that a new test reaches is forgotten (a new test can kill a
survivor; it cannot revive a killed mutant). mutmut then runs those mutants again. What no hash here sees (a change in ``tests/support/`` or in a
library) is what ``make mutation-cold`` is for.

A change of the selection itself (a test file added to or removed from
``pytest_add_cli_args_test_selection``, a test deselected or no longer) is such a test
change, test by test. mutmut would reset every verdict on it (it hashes the selection and
``pytest_add_cli_args``); ``invalidate`` gives the stats the new selection's hashes instead,
when what changed is only the files and the ``--deselect`` options (recorded in
``selection.json``), so that only the verdicts those tests touch are run again.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.support.mutation_order import appended_kills  # noqa: E402 - the workers' format, read in one place
BASELINE = Path(__file__).resolve().parent / "baseline"
STATS = "mutmut-stats.json"
TEST_HASHES = "tests.json"
SELECTION = "selection.json"
KILLERS = "killers.json"  # {function: {test: kills}}: which tests killed its mutants (tests/support/mutation_order.py)
KILLS = "killers.jsonl"  # the kills a run's workers append
UNVERDICTED = "unverdicted.json"  # the mutants without a verdict when the last invalidate ended


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def test_hashes(path: Path, root: Path = ROOT) -> dict[str, str]:
    """``tests/test_x.py::test_name``, and ``tests/test_x.py::Class`` for a class of tests
    (its methods' names are made when it is built, by absl's parameterisation) -> a hash of
    that source and of the file's other module-level code (its helpers and fixtures)."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    tests: dict[str, str] = {}
    shared: list[str] = []
    for node in tree.body:
        text = "".join(ast.get_source_segment(source, d) or "" for d in getattr(node, "decorator_list", []))
        text += ast.get_source_segment(source, node, padded=True) or ""
        if _is_test(node) or (isinstance(node, ast.ClassDef) and any(_is_test(n) for n in node.body)):
            tests[node.name] = text
        else:
            shared.append(text)
    module = _digest(*shared)
    name = path.relative_to(root).as_posix()
    return {f"{name}::{key}": _digest(module, text) for key, text in tests.items()}


def _is_test(node: ast.AST) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test")


def selection_hashes(selection: tuple[list[str], set[str]], root: Path = ROOT) -> dict[str, str]:
    """:func:`test_hashes` over the selection's files, less the deselected tests (never run)."""
    files, deselected = selection
    return {k: v for f in files for k, v in test_hashes(root / f, root).items() if k not in deselected}


def test_key(nodeid: str) -> str:
    """The key of a pytest node id in :func:`test_hashes`: without its parameters, and a
    method of a class of tests as its class (``tests/t.py::Case::test_a_x`` -> ``tests/t.py::Case``)."""
    return "::".join(nodeid.split("[", 1)[0].split("::")[:2])


def changed_tests(old: dict[str, str], new: dict[str, str]) -> tuple[set[str], set[str]]:
    """``(changed or removed, new)`` test keys between two hash tables."""
    return {k for k in old if new.get(k) != old[k]}, set(new) - set(old)


def functions_reached(stats: dict, keys: set[str]) -> set[str]:
    """The mangled function names (``alignax.kl.x_kl_estimate``) that any test of ``keys`` reaches."""
    return {function for function, tests in stats.get("tests_by_mangled_function_name", {}).items()
            if any(test_key(t) in keys for t in tests)}


def forget(meta_files: list[Path], functions: set[str], only_survivors: bool, keep: set[str] = frozenset()) -> int:
    """Set the verdict of every mutant of ``functions`` (or only its survivors), except those
    of ``keep``, back to 'not checked' in mutmut's meta files; returns how many."""
    count = 0
    for path in meta_files if functions else []:
        data = json.loads(path.read_text())
        verdicts = data["exit_code_by_key"]
        chosen = [mutant for mutant, code in verdicts.items()
                  if code is not None and mutant.split("__mutmut_")[0] in functions and not (only_survivors and code != 0)
                  and mutant not in keep]
        for mutant in chosen:
            verdicts[mutant] = None
        if chosen:  # a file nothing was forgotten in is left as mutmut wrote it
            path.write_text(json.dumps(data, indent=4))
        count += len(chosen)
    return count


def _meta_files(mutants: Path) -> list[Path]:
    return sorted(mutants.rglob("*.py.meta"))


def _optional(path: Path) -> list[Path]:
    return [path] if path.exists() else []


def _mutmut_config(root: Path) -> dict:
    import tomllib

    return tomllib.loads((root / "pyproject.toml").read_text())["tool"]["mutmut"]


def _selection(root: Path) -> tuple[list[str], set[str]]:
    """The test files of ``[tool.mutmut]``'s selection and the tests it deselects."""
    config = _mutmut_config(root)
    args = config.get("pytest_add_cli_args", [])
    deselected = {args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--deselect"}
    return list(config["pytest_add_cli_args_test_selection"]), deselected


def _mutmut_hash(value: object) -> str:
    """mutmut's hash of a config field (``Config.config_fingerprint``)."""
    return hashlib.sha256(repr(value).encode()).hexdigest()[:12]


def _other_pytest_args(args: list[str]) -> list[str]:
    """``pytest_add_cli_args`` less its ``--deselect`` options (which only choose tests)."""
    kept, skip = [], False
    for arg in args:
        if skip or arg == "--deselect":
            skip = not skip
            continue
        kept.append(arg)
    return kept


def selection_record(root: Path) -> dict:
    """What ``selection.json`` records of the configuration: the fingerprints mutmut keeps in
    its stats for the selection and the pytest options, and the options other than
    ``--deselect``."""
    config = _mutmut_config(root)
    args = config.get("pytest_add_cli_args", [])
    return {"test_selection": _mutmut_hash(tuple(config["pytest_add_cli_args_test_selection"])),
            "test_execution": _mutmut_hash(tuple(args)), "other_pytest_args": _other_pytest_args(args)}


def adopt_selection(stats: dict, recorded: dict | None, current: dict) -> bool:
    """Give mutmut's stats the current selection's fingerprints where they differ only by
    tests (files of the selection, ``--deselect`` options), which :func:`invalidate` tracks
    one by one; a change of any other pytest option is left to mutmut (it resets every
    verdict: the option may change how each test runs). Returns whether the stats changed."""
    fingerprint = stats.get("config_fingerprint")
    if not fingerprint or recorded is None:
        return False
    changed = False
    if fingerprint.get("test_selection") == recorded["test_selection"] != current["test_selection"]:
        fingerprint["test_selection"] = current["test_selection"]
        changed = True
    if (fingerprint.get("test_execution") == recorded["test_execution"] != current["test_execution"]
            and recorded["other_pytest_args"] == current["other_pytest_args"]):
        fingerprint["test_execution"] = current["test_execution"]
        changed = True
    return changed


def seed(root: Path = ROOT, baseline: Path = BASELINE) -> str:
    mutants = root / "mutants"
    if (mutants / STATS).exists():
        return "mutants/ holds results already: kept"
    if not (baseline / STATS).exists():
        return f"no baseline in {baseline}: a cold run"
    for source in [baseline / STATS, baseline / TEST_HASHES, *_optional(baseline / SELECTION),
                   *_optional(baseline / KILLERS), *_meta_files(baseline)]:
        target = mutants / source.relative_to(baseline)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    return f"seeded mutants/ from {baseline}"


def invalidate(root: Path = ROOT, baseline: Path = BASELINE) -> str:
    """Forget the verdicts that tests changed since they were reached may flip; run before
    and after ``mutmut run``.

    A test changed or removed since ``mutants/tests.json`` recorded it: every verdict of a
    function its recorded version reached is forgotten, and it is taken out of mutmut's
    stats, so that mutmut's next first pass measures it again as a new test (mutmut maps
    only new test names to the functions they reach). A new test, once that pass has
    measured it: the survivors of the functions it reaches are forgotten (a new test can
    kill a survivor; it cannot revive a killed mutant). A test is recorded as handled in
    ``mutants/tests.json`` only then. A survivor that mutmut ran since the last invalidate
    (it was without a verdict then: ``mutants/unverdicted.json``) is kept: mutmut measures new
    tests before it runs any mutant, so it ran with them."""
    mutants = root / "mutants"
    handled = mutants / TEST_HASHES
    stats_path = mutants / STATS
    if not stats_path.exists():
        return "no results in mutants/: nothing to invalidate"
    new = selection_hashes(_selection(root), root)
    record_path = mutants / SELECTION
    current = selection_record(root)
    if not handled.exists():  # the results come from a cold run of these very tests
        handled.write_text(json.dumps(new, indent=1, sort_keys=True) + "\n")
        record_path.write_text(json.dumps(current, indent=1) + "\n")
        return f"{len(new)} tests recorded"
    old = json.loads(handled.read_text())
    stats = json.loads(stats_path.read_text())
    adopted = adopt_selection(stats, json.loads(record_path.read_text()) if record_path.exists() else None, current)
    fingerprint = stats.get("config_fingerprint", {})
    if all(fingerprint.get(k) == current[k] for k in ("test_selection", "test_execution")):
        record_path.write_text(json.dumps(current, indent=1) + "\n")  # mutmut's stats are of this configuration
    changed, _ = changed_tests(old, new)
    metas = _meta_files(mutants)
    forgotten = forget(metas, functions_reached(stats, changed), only_survivors=False)
    if changed:
        _drop_tests(stats, changed)
    if changed or adopted:
        stats_path.write_text(json.dumps(stats, indent=4))
    measured = {test_key(t) for t in stats.get("duration_by_test", {})}
    ready = {k for k in new if k not in old and k in measured}
    # mutmut measures new tests before it runs a mutant: a survivor it ran since the last
    # invalidate already had them among its tests, and is not run again for them
    ran = set(json.loads((mutants / UNVERDICTED).read_text())) if (mutants / UNVERDICTED).exists() else set()
    forgotten += forget(metas, functions_reached(stats, ready), only_survivors=True, keep=ran)
    (mutants / UNVERDICTED).write_text(json.dumps(pending("", root)) + "\n")
    recorded = {k: v for k, v in new.items() if (k in old and k not in changed) or k in ready}
    handled.write_text(json.dumps(recorded, indent=1, sort_keys=True) + "\n")
    waiting = len(new) - len(recorded)
    return (f"{len(changed)} tests changed or removed, {len(ready)} new measured: {forgotten} verdicts forgotten"
            + (f"; {waiting} tests wait for mutmut's first pass" if waiting else ""))


def _drop_tests(stats: dict, keys: set[str]) -> None:
    """Take the tests of ``keys`` out of mutmut's stats: its next run measures them as new."""
    stats["duration_by_test"] = {t: d for t, d in stats.get("duration_by_test", {}).items() if test_key(t) not in keys}
    stats["tests_by_mangled_function_name"] = {
        function: [t for t in tests if test_key(t) not in keys]
        for function, tests in stats.get("tests_by_mangled_function_name", {}).items()}


def save(root: Path = ROOT, baseline: Path = BASELINE) -> str:
    mutants = root / "mutants"
    if not (mutants / STATS).exists():
        raise SystemExit("mutation baseline: no mutants/mutmut-stats.json; run `mutmut run` first")
    if baseline.exists():
        shutil.rmtree(baseline)
    invalidate(root, baseline)  # a test changed after the last run is not saved as handled
    compact_kills(mutants)
    for source in [mutants / STATS, mutants / TEST_HASHES, *_optional(mutants / SELECTION),
                   *_optional(mutants / KILLERS), *_meta_files(mutants / "alignax")]:
        target = baseline / source.relative_to(mutants)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    return f"saved {len(_meta_files(baseline))} result files to {baseline}"


def compact_kills(mutants: Path) -> None:
    """Fold the kills this run's workers appended (``killers.jsonl``) into the counts kept
    with the verdicts (``killers.json``)."""
    appended = mutants / KILLS
    if not appended.exists():
        return
    counts = json.loads((mutants / KILLERS).read_text()) if (mutants / KILLERS).exists() else {}
    for function, test in appended_kills(appended):
        tests = counts.setdefault(function, {})
        tests[test] = tests.get(test, 0) + 1
    (mutants / KILLERS).write_text(json.dumps(counts, indent=1, sort_keys=True) + "\n")
    appended.unlink()


def pending(module: str = "", root: Path = ROOT) -> list[str]:
    """The mutants (of ``module``, a name prefix) that have no verdict in ``mutants/``."""
    return [mutant for path in _meta_files(root / "mutants")
            for mutant, code in json.loads(path.read_text())["exit_code_by_key"].items()
            if code is None and mutant.startswith(module)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["seed", "invalidate", "save", "pending"])
    parser.add_argument("--module", default="", help="pending: only the mutants whose name starts with this")
    args = parser.parse_args(argv)
    if args.action == "pending":  # the names, for `mutmut run NAME ...`; the count on stderr
        waiting = pending(args.module)
        print(f"mutation baseline: {len(waiting)} mutants without a verdict", file=sys.stderr)
        print("\n".join(waiting))
        return 0
    print(f"mutation baseline: {globals()[args.action]()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
