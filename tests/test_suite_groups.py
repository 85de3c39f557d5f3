"""The suite relies on ``xdist_group`` to run tests that share an expensive fixture or
subprocess (a trained run, the mesh equalities, the multi-process launches) on one worker.
pytest 9.2 with pytest-xdist 3.8 ignores the mark silently (xdist writes the group into
``item._nodeid``, which pytest 9.2 no longer reads) and every shared fixture is built twice:
this test runs a two-worker session and checks that a group stays on one worker."""

import os
import subprocess
import sys


def test_an_xdist_group_runs_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(
        "import os, pytest\n"
        "pytestmark = pytest.mark.xdist_group('one')\n"
        "@pytest.mark.parametrize('i', range(6))\n"
        "def test_a(i):\n"
        "    open(os.path.join(os.path.dirname(__file__), f'worker-{i}'), 'w').write(os.environ['PYTEST_XDIST_WORKER'])\n")
    (tmp_path / "test_free.py").write_text(
        "import pytest\n@pytest.mark.parametrize('i', range(6))\ndef test_b(i):\n    pass\n")
    # xdist alone (no other plugin's import in the session and its two workers)
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "xdist", "-n", "2", "--dist", "loadgroup", "-q",
                           "-p", "no:cacheprovider", str(tmp_path)], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    workers = {(tmp_path / f"worker-{i}").read_text() for i in range(6)}
    assert len(workers) == 1, f"the group ran on {sorted(workers)}"
