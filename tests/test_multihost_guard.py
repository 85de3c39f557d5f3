"""The monitor's decision in a two-process job (real local JAX processes, gloo collectives on
CPU; tests/multihost_guard_check.py): an alarm raised on one process's figures acts on both.
A stop ends both processes with exit status 3 and the same one line; a rollback restores the
same gold-best checkpoint on both; the KL budget's raise of beta happens on both. Without the
agreement the quiet process would train on (stop) or the other would wait in the checkpoint's
collective restore alone (rollback)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.fake_devices import json_objects, subprocess_env
from tests.test_multihost import free_port

pytestmark = pytest.mark.xdist_group("multihost")

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> list[tuple[int, dict[str, dict], str]]:
    """The check's two processes, once for both tests: each one's (exit status, its result of
    each action, stderr). A process still running after 240 s (a hang) fails the tests,
    both processes killed."""
    env, port = subprocess_env(1, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1"), str(free_port())
    output_dir = tmp_path_factory.mktemp("guard")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_guard_check.py"), str(p), "2", port,
                               str(output_dir)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in range(2)]
    out = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=240)
            results = {r["action"]: r for r in json_objects(stdout) if "action" in r}
            assert set(results) == {"rollback", "raise_beta", "stop"}, f"status {proc.returncode}:\n{stderr[-3000:]}"
            out.append((proc.returncode, results, stderr))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail("the job hung: a process was still running after 240 s")
    return out


def test_a_stop_raised_on_one_process_stops_both_with_one_line(job):
    (status0, first, _), (status1, second, _) = job
    first, second = first["stop"], second["stop"]
    assert status0 == status1 == 3 and first["exit"] == second["exit"] == 3
    assert first["stopped"] == second["stopped"]  # the same reason: process 0's
    assert first["stopped"].startswith("monitor.entropy_collapse.action=stop: step 2: ")
    assert "\n" not in first["stopped"]
    assert "the run stops at step 2" in first["stopped"]


def test_a_rollback_raised_on_one_process_restores_the_same_checkpoint_on_both(job):
    for process, (_, results, _) in enumerate(job):
        result = results["rollback"]
        assert result["process"] == process
        assert result["restored_steps"] == [1] and result["rollbacks"] == 1 and result["lr_factors"] == [0.5]
        # step 1's state (parameters filled with 1.0), not step 2's that the rollback replaced
        assert result["params"] == {"w": [[1.0] * 4] * 3, "b": [0.0, 1.0, 2.0, 3.0]}


def test_the_kl_budget_over_on_one_process_raises_beta_on_both(job):
    for process, (_, results, _) in enumerate(job):
        result = results["raise_beta"]
        assert result["process"] == process and result["kl_coef"] == pytest.approx(0.2)  # 0.1 x beta_factor 2
        assert result["params"]["w"] == [[2.0] * 4] * 3 and result["rollbacks"] == 0  # no rollback: step 2's state
