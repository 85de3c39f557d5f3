"""The one-line score of a mutmut run: ``mutation: killed K of N (P%)``.

Reads the results of the last ``mutmut run`` (``mutmut results --all true``, one
``name: status`` line per mutant) and the equivalent mutants listed in EQUIVALENT.md next
to this file (a line ``- `name`: reason``). A mutant counts as killed when a test failed
on it (``killed``), or when it hung or crashed the test process (``timeout``, ``segfault``:
the suite did not pass). Listed equivalents are left out of ``N``; every other survivor is
printed by name, for ``mutmut show NAME``. Exits 1 under ``--threshold`` percent, or when
EQUIVALENT.md lists a mutant that no longer exists or is now killed (a stale entry).

    python tools/mutation/summary.py [--mutmut .venv/bin/mutmut] [--threshold 95] [--module alignax.kl]

``--module`` scores only the mutants whose name starts with it (after ``mutmut run
"alignax.kl*"``); a mutant not run yet counts as not killed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

EQUIVALENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "EQUIVALENT.md")
DETECTED = {"killed", "timeout", "segfault"}
_RESULT = re.compile(r"^\s*(\S+): (.+)$")
_LISTED = re.compile(r"^- `([^`]+)`")


def mutmut_results(mutmut: str) -> dict[str, str]:
    """Mutant name -> status, from ``mutmut results --all true`` in the current directory."""
    out = subprocess.run([mutmut, "results", "--all", "true"], capture_output=True, text=True, check=True).stdout
    return {m.group(1): m.group(2).strip() for m in map(_RESULT.match, out.splitlines()) if m}


def listed_equivalents(path: str = EQUIVALENT) -> list[str]:
    with open(path, encoding="utf-8") as f:
        return [m.group(1) for m in map(_LISTED.match, f) if m]


def score(results: dict[str, str], equivalents: list[str]) -> tuple[int, int, list[str], list[str]]:
    """``(killed, counted, survivors, stale)`` over the mutants not listed as equivalent."""
    stale = [n for n in equivalents if results.get(n) in (None, *DETECTED)]
    counted = {n: s for n, s in results.items() if n not in set(equivalents)}
    killed = sum(s in DETECTED for s in counted.values())
    survivors = sorted(f"{n}: {s}" for n, s in counted.items() if s not in DETECTED)
    return killed, len(counted), survivors, stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutmut", default="mutmut", help="the mutmut executable")
    parser.add_argument("--threshold", type=float, default=95.0, help="lowest passing score, percent")
    parser.add_argument("--module", default="", help="score only mutants whose name starts with this")
    args = parser.parse_args(argv)
    results = {n: s for n, s in mutmut_results(args.mutmut).items() if n.startswith(args.module)}
    if not results:
        print("mutation: no results under mutants/; run `mutmut run` first", file=sys.stderr)
        return 1
    equivalents = [n for n in listed_equivalents() if n.startswith(args.module)]
    killed, counted, survivors, stale = score(results, equivalents)
    for line in survivors:
        print(f"survived  {line}")
    for name in stale:
        status = results.get(name, "no such mutant")
        print(f"stale     {name}: {status} (listed in {os.path.relpath(EQUIVALENT)}; remove it)")
    print(f"({len(equivalents)} equivalent mutants listed in {os.path.relpath(EQUIVALENT)} are not counted)")
    percent = 100.0 * killed / counted if counted else 0.0
    print(f"mutation: killed {killed} of {counted} ({percent:.1f}%)")
    return 0 if percent >= args.threshold and not stale else 1


if __name__ == "__main__":
    sys.exit(main())
