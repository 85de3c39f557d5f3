"""The house's rule that a new algorithm, objective or estimator touches only its own module
and one entry, checked on a scratch copy of the package: copy ``alignax/`` under a temporary
folder, add a toy module and its entry there, list what changed, and run a check program
against the copy in a fresh interpreter (tests/test_algorithm_map.py, test_objectives.py,
test_estimators_map.py)."""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def scratch_copy(tmp_path: Path, edits: Mapping[str, tuple[str, str]], new_files: Mapping[str, str]) -> list[str]:
    """Copy ``alignax/`` to ``tmp_path / "alignax"``, write ``new_files`` (path in the package ->
    text), apply ``edits`` (path -> (old text, new text), each replacing its first occurrence,
    which must be there), and return the package files that differ from the original."""
    copy = tmp_path / "alignax"
    shutil.copytree(ROOT / "alignax", copy, ignore=shutil.ignore_patterns("__pycache__"))
    for name, text in new_files.items():
        (copy / name).write_text(text)
    for name, (old, new) in edits.items():
        text = (copy / name).read_text()
        assert old in text, f"{name} no longer holds {old!r}: the test's edit must follow the file"
        (copy / name).write_text(text.replace(old, new, 1))
    return changed_files(ROOT / "alignax", copy)


def changed_files(left: Path, right: Path, prefix: str = "") -> list[str]:
    """Files that differ, or are only on one side, between two trees (relative paths, sorted)."""
    cmp = filecmp.dircmp(left, right, ignore=["__pycache__"])
    out = [prefix + n for n in cmp.diff_files + cmp.right_only + cmp.left_only]
    for sub in cmp.common_dirs:
        out += changed_files(left / sub, right / sub, f"{prefix}{sub}/")
    return sorted(out)


def run_against_copy(tmp_path: Path, program: str, expect: str) -> None:
    """Run ``program`` in a fresh interpreter importing the scratch copy; it must print ``expect``."""
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and expect in proc.stdout, proc.stderr[-3000:]
