"""A pytest plugin for mutation runs: mutmut's first pass sees every call of every test,
and a mutant's tests run fastest first.

mutmut's first pass runs every test once, in one process, and maps each test to the
functions it sees called; a mutant then runs only its function's tests. A test whose jitted
program an earlier test of that process had already traced calls nothing (jax runs the
compiled program), so it was never mapped, and never run against the mutants it would kill
(found in session 15: ``_masked_min_max``'s empty-mask mutants survived a test that fails on
them). In that pass (``MUTANT_UNDER_TEST=stats``) this plugin clears jax's caches before
each test, so each traces what it calls, as it does in a mutant's fresh worker.

Then, for each mutant, mutmut runs the tests that reach the mutated function with ``-x``: the
first failing test ends the run and the mutant counts as killed. It passes them to pytest
as a set, so their order is the set's (arbitrary) one, and a mutant that the first quick
test would kill often waits for slower tests first. With this plugin (``-p
tests.support.mutation_order`` in ``[tool.mutmut] pytest_add_cli_args``) the tests run in
the order of the durations mutmut measured in its first pass (``mutants/mutmut-stats.json``,
the worker's working directory is ``mutants/``): the expected time to the first failure is
then the smallest for a given set of tests, whichever of them kills the mutant. A surviving
mutant runs every test either way, so its time does not change.

Before that order comes what killed the function's other mutants: a mutant worker appends
the test that failed to ``mutants/killers.jsonl`` (one line per kill, the function's name and
the test's id), and the next mutant of that function runs those tests first, the most
frequent killer first. Mutants of one function mostly die by the same few tests, which
fastest-first alone may reach late (a loss's metrics path, an option's branch): session 16
measured ``losses.policy._policy_loss``'s mutants at 30 to 60 s each fastest first. The order
changes what a mutant costs, never its verdict (``-x`` stops at any failure; a survivor runs
them all). ``tools/mutation/baseline.py`` keeps the counts with the verdicts
(``killers.json``), so a changed function's mutants start from its old killers.

Only a worker running a mutant is reordered (mutmut names the mutant in
``MUTANT_UNDER_TEST``, ``module.x_function__mutmut_N``); mutmut's own passes (the clean
run, the first pass that measures the durations) keep pytest's order. A test mutmut has no
duration for runs last, in pytest's order.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

STATS = Path("mutmut-stats.json")
KILLS = Path("killers.jsonl")  # this run's kills, appended by the workers
KILLERS = Path("killers.json")  # earlier runs' kills, {function: {test: count}} (the baseline's)


def fastest_first(items: list, durations: dict[str, float], kills: dict[str, int] | None = None) -> list:
    """``items`` sorted by how many of the function's mutants each killed (most first), then by
    their recorded duration; unknown ones last, their order kept."""
    kills = kills or {}
    return sorted(items, key=lambda item: (-kills.get(item.nodeid, 0), durations.get(item.nodeid, math.inf)))


def _function(mutant: str) -> str:
    return mutant.split("__mutmut_")[0]


def kill_counts(function: str, directory: Path = Path()) -> dict[str, int]:
    """test id -> how many mutants of ``function`` it killed, earlier runs' and this run's."""
    counts: dict[str, int] = {}
    if (directory / KILLERS).is_file():
        counts.update(json.loads((directory / KILLERS).read_text()).get(function, {}))
    for killed, test in appended_kills(directory / KILLS):
        if killed == function:
            counts[test] = counts.get(test, 0) + 1
    return counts


def appended_kills(path: Path):
    """``(function, test)`` for each whole line of a ``killers.jsonl``."""
    if not path.is_file():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            kill = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a worker killed while writing it
            continue
        yield kill["function"], kill["test"]


def _mutant() -> str:
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    return mutant if "__mutmut_" in mutant else ""


def pytest_collection_modifyitems(session, config, items) -> None:
    mutant = _mutant()
    if not mutant or not STATS.is_file():
        return
    durations = json.loads(STATS.read_text()).get("duration_by_test", {})
    items[:] = fastest_first(items, durations, kill_counts(_function(mutant)))


def pytest_runtest_logreport(report) -> None:
    mutant = _mutant()
    if mutant and report.failed:
        line = json.dumps({"function": _function(mutant), "test": report.nodeid}) + "\n"
        with KILLS.open("a", encoding="utf-8") as out:  # one short append: whole lines from two workers
            out.write(line)


def pytest_runtest_setup(item) -> None:
    if os.environ.get("MUTANT_UNDER_TEST") == "stats":
        import jax

        jax.clear_caches()
