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


def fastest_first(items: list, durations: dict[str, float]) -> list:
    """``items`` sorted by their recorded duration; unknown ones last, their order kept."""
    return sorted(items, key=lambda item: durations.get(item.nodeid, math.inf))


def pytest_collection_modifyitems(session, config, items) -> None:
    if "__mutmut_" not in os.environ.get("MUTANT_UNDER_TEST", "") or not STATS.is_file():
        return
    durations = json.loads(STATS.read_text()).get("duration_by_test", {})
    items[:] = fastest_first(items, durations)


def pytest_runtest_setup(item) -> None:
    if os.environ.get("MUTANT_UNDER_TEST") == "stats":
        import jax

        jax.clear_caches()
