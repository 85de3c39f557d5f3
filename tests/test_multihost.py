"""Two JAX processes (gloo collectives on CPU, 4 fake devices each) against one process
with 8: the same global batches, the same losses and parameters, files written once, and
a run saved by two processes resumed by one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(num_processes: int, jobs: list[dict], *, devices: int) -> list[dict]:
    """Run tests/multihost_check.py as ``num_processes`` processes; each one's results."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_check.py"), str(p), str(num_processes),
                               port, json.dumps(jobs)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in range(num_processes)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-2000:] + err[-4000:]
        results.append([json.loads(line) for line in out.splitlines() if line.startswith('{"job"')])
    return results


@pytest.mark.xdist_group("multihost")
def test_two_processes_train_like_one(tmp_path, toy_model):
    def job(name, reference, steps, out=None):
        return {"name": name, "model_dir": toy_model, "output_dir": str(tmp_path / (out or name)),
                "dpo_reference": reference, "steps": steps}

    [single] = launch(1, [job("live", "live", 4), job("pre", "precomputed", 4)], devices=8)
    two = launch(2, [job("live", "live", 4, out="live2"), job("pre", "precomputed", 2, out="split")], devices=4)
    [resumed] = launch(1, [job("pre", "precomputed", 4, out="split")], devices=8)
    one = {r["job"]: r for r in single}
    for process, results in enumerate(two):
        by_job = {r["job"]: r for r in results}
        assert {r["process"] for r in results} == {process}
        assert {(r["processes"], r["devices"], r["local_devices"]) for r in results} == {(2, 8, 4)}
        # the whole global batch every step (a dropped half would move the loss and parameters)
        np.testing.assert_allclose(by_job["live"]["losses"], one["live"]["losses"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(by_job["live"]["digest"], one["live"]["digest"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(by_job["pre"]["losses"], one["pre"]["losses"][:2], rtol=1e-5, atol=1e-6)
        # each step's metrics once, written by process 0 alone
        assert by_job["live"]["metric_steps"] == [1, 2, 3, 4]
    # saved by two processes on (1, 8, 1), resumed by one: the uninterrupted run's last steps
    [after] = resumed
    assert after["steps"] == [3, 4]
    np.testing.assert_allclose(after["losses"], one["pre"]["losses"][2:], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(after["digest"], one["pre"]["digest"], rtol=1e-5, atol=1e-5)
    assert after["metric_steps"] == [1, 2, 3, 4]
