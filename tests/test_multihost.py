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

from tests.fake_devices import json_objects, subprocess_env

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(num_processes: int, jobs: list[dict], *, devices: int) -> list[dict]:
    """Run tests/multihost_check.py as ``num_processes`` processes; each one's results."""
    env = subprocess_env(devices, HF_HUB_OFFLINE="1")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_check.py"), str(p), str(num_processes),
                               port, json.dumps(jobs)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in range(num_processes)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, out[-2000:] + err[-4000:]
        results.append([r for r in json_objects(out) if "job" in r])
    return results


def assert_close(got, want, name):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.xdist_group("multihost")
def test_two_processes_train_like_one(tmp_path, toy_model):
    """DPO (precomputed reference), GRPO and PPO (both with a live reference for the KL):
    2 processes x 4 devices against 1 x 8 on the same global batches — losses, final
    parameters, evaluation figures — with each step's metrics written once, and the DPO run
    saved by the two resumed by one."""
    def job(name, recipe, steps, out, reference="live"):
        return {"name": name, "recipe": recipe, "model_dir": toy_model, "output_dir": str(tmp_path / out),
                "dpo_reference": reference, "steps": steps}

    # online: 8 prompts x 2 samples; each process samples, scores and updates on its own
    # prompts' rows, and the figures and evaluations are over all of them
    two = launch(2, [job("pre", "dpo", 2, "split", "precomputed"), job("grpo", "grpo", 2, "grpo2"),
                     job("ppo", "ppo", 2, "ppo2")], devices=4)
    # one process: the uninterrupted runs, then the two processes' DPO run resumed (one
    # launch for both, as an interpreter start and its compiles cost more than the steps)
    *single, resumed = launch(1, [job("pre", "dpo", 4, "pre1", "precomputed"), job("grpo", "grpo", 2, "grpo1"),
                                  job("ppo", "ppo", 2, "ppo1"), job("resumed", "dpo", 4, "split", "precomputed")],
                              devices=8)[0]
    one = {r["job"]: r for r in single}
    for process, results in enumerate(two):
        assert [r["process"] for r in results] == [process] * 3
        assert {(r["processes"], r["devices"], r["local_devices"]) for r in results} == {(2, 8, 4)}
        for r in results:
            want = one[r["job"]]
            # the whole global batch every step (a dropped half would move the loss and parameters)
            assert_close(r["losses"], want["losses"][:len(r["losses"])], r["job"])
            if r["job"] != "pre":
                assert_close(r["digest"], want["digest"], r["job"])
                assert r["metric_steps"] == want["metric_steps"]  # each step once, by process 0
            assert [e["step"] for e in r["eval"]] == [e["step"] for e in want["eval"]]
            for got, expected in zip(r["eval"], want["eval"]):
                assert got.keys() == expected.keys()
                assert_close([got[k] for k in sorted(got)], [expected[k] for k in sorted(expected)], r["job"])
    assert one["grpo"]["eval"] and one["ppo"]["eval"]  # the online runs evaluated (at start and end)
    # saved by two processes on (1, 8, 1), resumed by one: the uninterrupted run's last steps
    assert resumed["steps"] == [3, 4] and resumed["layout_changed"]
    assert_close(resumed["losses"], one["pre"]["losses"][2:], "resumed")
    assert_close(resumed["digest"], one["pre"]["digest"], "resumed")
    assert resumed["metric_steps"] == [1, 2, 3, 4]


def test_one_process_needs_no_keys_and_a_cluster_is_detected(monkeypatch):
    from alignax.parallel import multihost

    for name in ("SLURM_JOB_ID", "JAX_COORDINATOR_ADDRESS", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert not multihost._cluster_detected()
    assert multihost.initialize(None) is False  # no keys, no cluster: a single-process run
    srun = {"SLURM_JOB_ID": "42", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
            "SLURM_LOCALID": "0"}
    for name, value in srun.items():
        monkeypatch.setenv(name, value)
    assert multihost._cluster_detected()  # a task of `srun`, as jax.distributed.initialize() joins it
    with pytest.raises(ValueError, match=r"distributed.process_id=2 is not in \[0, distributed.num_processes=2\)"):
        multihost.DistributedConfig(num_processes=2, process_id=2)
