"""Two JAX processes (gloo collectives on CPU, 4 fake devices each) against one process
with 8: the same global batches, the same losses and parameters, files written once, and
a run saved by two processes resumed by one."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.fake_devices import json_objects, subprocess_env

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(num_processes: int, jobs: list[dict], *, devices: int, exits: list | None = None) -> list[dict]:
    """Run tests/multihost_check.py as ``num_processes`` processes; each one's results.
    ``exits`` gets, for each process, its stderr and the seconds from the last process's
    end of work to this process's exit."""
    env = subprocess_env(devices, HF_HUB_OFFLINE="1")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_check.py"), str(p), str(num_processes),
                               port, json.dumps(jobs)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in range(num_processes)]

    def wait(proc):
        out, err = proc.communicate(timeout=900)
        return out, err, time.time()

    with ThreadPoolExecutor(num_processes) as pool:  # each exit timed as it happens
        ended = list(pool.map(wait, procs))
    results, finished = [], []
    for proc, (out, err, _) in zip(procs, ended):
        assert proc.returncode == 0, out[-2000:] + err[-4000:]
        objects = json_objects(out)
        results.append([r for r in objects if "job" in r])
        finished += [r["finished"] for r in objects if "finished" in r]
    if exits is not None:
        exits += [(err, at - max(finished)) for _, err, at in ended]
    return results


def assert_close(got, want, name):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


def job(tmp_path, toy_model, name, recipe, steps, out, reference="live", **extra):
    return {"name": name, "recipe": recipe, "model_dir": toy_model, "output_dir": str(tmp_path / out),
            "dpo_reference": reference, "steps": steps, **extra}


def assert_runs_match(two: list[list[dict]], one: dict, jobs: int) -> None:
    """Each process's runs of ``two`` against the one-process runs ``one`` (by job name):
    the same losses, parameters, metric rows and evaluations."""
    for process, results in enumerate(two):
        assert [r["process"] for r in results] == [process] * jobs
        assert {(r["processes"], r["devices"], r["local_devices"]) for r in results} == {(2, 8, 4)}
        for r in results:
            want = one[r["job"]]
            # GRPO's own over the 4 training devices (4 are its reference's), else the training mesh
            sampler_mesh = [2, 1, 2] if r["job"] == "grpo" else [1, 8, 1]
            assert r["sampler_mesh"] == want["sampler_mesh"] == sampler_mesh
            if r["job"] == "grpo":  # the reference on 4 devices, none of training's: the last 2 of each process
                layout = ("reference_devices", "reference_local_devices", "reference_on_training_devices")
                assert [r[k] for k in layout] == [4, 2, False] and [want[k] for k in layout] == [4, 4, False]
            # the whole global batch every step (a dropped half would move the loss and parameters)
            assert_close(r["losses"], want["losses"][:len(r["losses"])], r["job"])
            if r["job"] != "pre":
                assert_close(r["digest"], want["digest"], r["job"])
                assert r["metric_steps"] == want["metric_steps"]  # each step once, by process 0
            assert [e["step"] for e in r["eval"]] == [e["step"] for e in want["eval"]]
            for got, expected in zip(r["eval"], want["eval"]):
                assert got.keys() == expected.keys()
                assert_close([got[k] for k in sorted(got)], [expected[k] for k in sorted(expected)], r["job"])


GRPO_LAYOUT = {"rollout_mesh": [-1, 1, 2], "placement": {"reference": "submesh", "submesh": [1, 4, 1]}}


@pytest.mark.xdist_group("multihost")
def test_two_processes_train_like_one(tmp_path, toy_model):
    """DPO (precomputed reference) and GRPO (with a live reference for the KL): 2 processes
    x 4 devices against 1 x 8 on the same global batches — losses, final parameters,
    evaluation figures — with each step's metrics written once, and the DPO run saved by
    the two resumed by one. GRPO's reference lies on devices of its own (placement.submesh
    [1, 4, 1]: the last 2 of each process; its log-probs come back through each process's
    rows) and it trains on the other 4, sampling on a mesh of its own (rollout.mesh
    (-1, 1, 2) over those 4: prompts split across the processes, heads within each). The two processes export the DPO run
    with `alignax export` and leave the job in order at exit (multihost.leave). PPO, whose
    multi-process path is GRPO's plus a critic, runs the same comparison in the slow
    test_two_processes_train_ppo_like_one (its critic on a mesh: tests/mesh_ppo_check.py)."""
    # online: 8 prompts x 2 samples; each process samples, scores and updates on its own
    # prompts' rows, and the figures and evaluations are over all of them
    exits: list = []
    export = {"name": "export", "cli": ["export", str(tmp_path / "split" / "config.yaml"), "--out",
                                        str(tmp_path / "export2")]}
    refused = {"name": "refused", "check": "batch_per_process"}  # after a run: the processes have joined
    two = launch(2, [job(tmp_path, toy_model, "pre", "dpo", 2, "split", "precomputed"), refused,
                     job(tmp_path, toy_model, "grpo", "grpo", 2, "grpo2", **GRPO_LAYOUT), export],
                 devices=4, exits=exits)
    # 4 rows on 8 batch devices: one process places them whole on each device; two cannot
    # give each process rows of its own, and say what to change
    for process, (_, check, *_) in enumerate(two):
        assert check["process"] == process and "does not split over the mesh's 8 batch devices" in check["error"]
        assert "data.batch_size" in check["error"] and "a multiple of 8" in check["error"]
    two = [[pre, *rest] for pre, _, *rest in two]
    # one process: the uninterrupted runs, then the two processes' DPO run resumed (one
    # launch for both, as an interpreter start and its compiles cost more than the steps)
    *single, resumed = launch(1, [job(tmp_path, toy_model, "pre", "dpo", 4, "pre1", "precomputed"),
                                  job(tmp_path, toy_model, "grpo", "grpo", 2, "grpo1", **GRPO_LAYOUT),
                                  job(tmp_path, toy_model, "resumed", "dpo", 4, "split", "precomputed")],
                              devices=8)[0]
    one = {r["job"]: r for r in single}
    # `alignax export` in both processes: they gather the weights, process 0 writes
    for *_, exported in two:
        assert exported["rc"] == 0 and exported["stdout"].strip() == str(tmp_path / "export2")
    assert_runs_match([results for *results, _ in two], one, jobs=2)
    assert one["grpo"]["eval"]  # the online run evaluated (at start and end)
    # saved by two processes on (1, 8, 1), resumed by one: the uninterrupted run's last steps
    assert resumed["steps"] == [3, 4] and resumed["layout_changed"]
    assert_close(resumed["losses"], one["pre"]["losses"][2:], "resumed")
    assert_close(resumed["digest"], one["pre"]["digest"], "resumed")
    assert resumed["metric_steps"] == [1, 2, 3, 4]
    # the exported weights are the two processes' trained DPO params (each tensor's sum
    # against the digest's per-leaf sums; the export's names and layout are HF's)
    weights = load_file(str(tmp_path / "export2" / "model.safetensors"))
    leaf_sums = two[0][0]["digest"][: len(two[0][0]["digest"]) // 2]
    assert_close(sorted(float(w.astype(np.float64).sum()) for w in weights.values()), sorted(leaf_sums), "export")
    # the job left at exit (multihost.leave): each process past the barrier, then shut down
    # in moments, and out (jax's own exit-time shutdown was seen to hang a process 150 s)
    for process, (err, lag) in enumerate(exits):
        finished = err.find(f"process {process} of 2: every process finished; leaving the job")
        left = re.search(rf"process {process} of 2: left the job \(jax.distributed shut down\) ([0-9.]+) s", err)
        assert left and -1 < finished < left.start(), err[-3000:]
        assert float(left.group(1)) < 30, left.group(0)
        # the interpreter's own teardown follows: 4 s at load 7, 60 s measured at load 17 on 2 cores
        assert lag < 120, (process, lag)


@pytest.mark.slow
@pytest.mark.xdist_group("multihost")
def test_two_processes_train_ppo_like_one(tmp_path, toy_model):
    """PPO (separate critic, live reference for the KL): 2 processes x 4 devices against
    1 x 8, as test_two_processes_train_like_one does for DPO and GRPO."""
    two = launch(2, [job(tmp_path, toy_model, "ppo", "ppo", 2, "ppo2")], devices=4)
    one = {r["job"]: r for r in launch(1, [job(tmp_path, toy_model, "ppo", "ppo", 2, "ppo1")], devices=8)[0]}
    assert_runs_match(two, one, jobs=1)
    assert one["ppo"]["eval"]


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
