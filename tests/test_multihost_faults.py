"""Faults of a multi-process job, with real local JAX processes (``jax.distributed`` on
localhost, gloo collectives on CPU) started through ``python -m alignax.cli`` as a launcher
would: SIGTERM delivered to one process only, and a job whose processes never all arrive.
Nothing here is simulated: the signal, the coordination service and the exit statuses are
the real ones (see docs/reliability.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from alignax.checkpoint import Checkpointer
from alignax.data import write_jsonl
from alignax.metrics import read_jsonl
from tests.fake_devices import subprocess_env
from tests.test_multihost import free_port
from tests.support.trainer_helpers import separable_pairs

pytestmark = pytest.mark.xdist_group("multihost")


def two_process_recipe(tmp_path, model_dir, out: str, total_steps: int):
    data_path = tmp_path / "pairs.jsonl"
    if not data_path.exists():
        write_jsonl(separable_pairs(64), data_path)
    recipe = {
        "algorithm": "dpo", "output_dir": str(tmp_path / out), "model": {"name": model_dir},
        "data": {"paths": [str(data_path)], "format": "preference", "max_length": 32, "max_prompt_length": 24,
                 "batch_size": 8, "eval_fraction": 0.0},
        "optim": {"schedule": "constant"},  # a longer resumed run keeps the schedule: no --allow-changes
        "train": {"total_steps": total_steps, "log_every": 1},
        "logging": {"console": False, "tensorboard": False},
        "mesh": {"shape": [1, -1, 1]},
        "distributed": {"shutdown_timeout_s": 60},
    }
    path = tmp_path / f"{out}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def start_job(recipe, *overrides, processes: int = 2, port: int | None = None) -> list[subprocess.Popen]:
    """``alignax train RECIPE`` as ``processes`` processes of one job (1 CPU device each)."""
    env = subprocess_env(1, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    port = port or free_port()
    return [subprocess.Popen([sys.executable, "-m", "alignax.cli", "train", str(recipe), *overrides,
                              f"distributed.coordinator=127.0.0.1:{port}", f"distributed.num_processes={processes}",
                              f"distributed.process_id={p}"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
            for p in range(processes)]


def finish(procs, timeout: float) -> list[tuple[int, str, float]]:
    """Each process's (exit status, stderr, seconds until it ended)."""
    start, out = time.time(), []
    for proc in procs:
        _, err = proc.communicate(timeout=max(1.0, timeout - (time.time() - start)))
        out.append((proc.returncode, err, time.time() - start))
    return out


def wait_for_step(procs, metrics, step: int) -> None:
    """Until ``metrics`` (a run's metrics.jsonl) has a loss row of ``step``: the job is
    in its loop, its signal handlers installed; every process must still be running."""
    deadline = time.time() + 240
    while not (metrics.exists() and any(r.get("step", 0) >= step and "loss" in r for r in read_jsonl(str(metrics)))):
        assert time.time() < deadline and all(p.poll() is None for p in procs), \
            [p.communicate(timeout=60)[1][-3000:] for p in procs]
        time.sleep(0.2)


def final_state(output_dir) -> tuple[int, dict]:
    """(latest step, its saved arrays as NumPy by leaf path) of a run's checkpoints."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    with Checkpointer(os.path.join(output_dir, "checkpoints")) as ckpt:
        step = ckpt.latest_step()
    path = epath.Path(output_dir) / "checkpoints" / str(step) / "state"
    here = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # saved over 2 processes, read whole here
    with ocp.StandardCheckpointer() as reader:
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=here),
                              reader.metadata(path).item_metadata.tree)
        tree = reader.restore(path, target)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return step, {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in leaves}


def test_sigterm_to_one_process_stops_both_and_resumes_bit_for_bit(tmp_path, toy_model):
    """A scheduler preempting one host: SIGTERM reaches process 1 only. Both processes
    learn of it at the next step boundary (the stop flag's allgather), save one checkpoint
    together, and exit 143 well within distributed.shutdown_timeout_s; resumed to two steps
    more, the run's saved state equals, bit for bit, that of a run never interrupted."""
    recipe = two_process_recipe(tmp_path, toy_model, "run", total_steps=100_000)
    procs = start_job(recipe)
    metrics = tmp_path / "run" / "metrics.jsonl"
    wait_for_step(procs, metrics, 2)
    procs[1].send_signal(signal.SIGTERM)  # the non-writer: process 0 writes the files and never sees it
    ended = finish(procs, timeout=120)
    for process, (code, err, seconds) in enumerate(ended):
        assert code == 143, f"process {process}: {err[-3000:]}"
        assert "stopped by SIGTERM at step" in err and "Traceback" not in err, err[-3000:]
        assert seconds < 60, f"process {process} took {seconds:.0f} s"  # the shutdown timeout never fired
    assert "received by another process" in ended[0][1]  # process 0 learned of it through the flag
    # the suite's compilation cache is off in the job: each process ran its own compile (a
    # cached step in process 0 only hung both in step 1's all-gathers on jaxlib 0.12.1;
    # the resumed and straight runs below would read the one this run compiled)
    assert all("persistent compilation cache" in err and "is off for this CPU job" in err for _, err, _ in ended)
    stopped_at, _ = final_state(tmp_path / "run")
    assert 2 <= stopped_at < 100_000
    assert f"stopped by SIGTERM at step {stopped_at}" in ended[0][1] and f"at step {stopped_at};" in ended[1][1]

    # resumed by the same command to two steps more, and a run to that step never stopped
    total = f"train.total_steps={stopped_at + 2}"
    for rerun, out in ((recipe, "run"), (two_process_recipe(tmp_path, toy_model, "straight", stopped_at + 2), None)):
        for process, (code, err, _) in enumerate(finish(start_job(rerun, total), timeout=240)):
            assert code == 0, f"{out or 'straight'} process {process}: {err[-3000:]}"
    rows = [r["step"] for r in read_jsonl(str(metrics)) if "loss" in r]
    assert rows[-2:] == [stopped_at + 1, stopped_at + 2] and rows.count(stopped_at + 1) == 1
    resumed_step, resumed = final_state(tmp_path / "run")
    straight_step, straight = final_state(tmp_path / "straight")
    assert resumed_step == straight_step == stopped_at + 2
    assert resumed.keys() == straight.keys() and any("params" in k for k in resumed)
    for key in resumed:
        np.testing.assert_array_equal(resumed[key], straight[key], err_msg=key)


@pytest.mark.parametrize("peer", ["killed", "frozen"])
def test_a_stopped_process_whose_peer_is_gone_exits_143_within_the_shutdown_timeout(tmp_path, toy_model, peer):
    """SIGTERM to process 0 while process 1 is killed (kill -9) or frozen (SIGSTOP: its
    sockets stay open, so the next collective hangs rather than fails): process 0 cannot
    save with it and must not wait for it (the job's leave() would wait
    distributed.initialization_timeout_s, and jax notices a dead peer only after its 100 s
    heartbeat timeout, then aborts natively). It exits 143 within
    distributed.shutdown_timeout_s (5 s here): at once when the collective fails, by the
    watchdog when it hangs, saying that nothing after the last complete checkpoint was
    saved. (Had process 0, which hosts jax's coordination service, died instead, jax's
    client aborts every other process at once: SIGABRT, not ours to catch.)"""
    recipe = two_process_recipe(tmp_path, toy_model, "run", total_steps=100_000)
    procs = start_job(recipe, "distributed.shutdown_timeout_s=5")
    metrics = tmp_path / "run" / "metrics.jsonl"
    wait_for_step(procs, metrics, 2)
    procs[1].send_signal(signal.SIGKILL if peer == "killed" else signal.SIGSTOP)
    if peer == "frozen":  # process 0 is now waiting in a step's collective for the frozen peer: its
        time.sleep(2)     # Python handler cannot run, and the signal-watch thread must arm the watchdog
    procs[0].send_signal(signal.SIGTERM)
    try:
        (code, err, seconds), = finish(procs[:1], timeout=120)
    finally:
        procs[1].kill()
        procs[1].communicate(timeout=60)
    assert code == 143, err[-3000:]
    assert seconds < 5 + 10, f"{seconds:.0f} s"  # the timeout, and the moments of a process's exit
    # a killed peer is noticed by whichever collective process 0 is in: the step's (the run
    # failed) or the stop-flag agreement's (could not be reached): the same exit either way
    whys = (("the run failed before it could save with the other processes",
             "the other processes could not be reached to save together") if peer == "killed"
            else ("the save and shutdown did not end within 5 s (distributed.shutdown_timeout_s)",))
    assert any(f"process 0 of 2: SIGTERM, and {why}" in err for why in whys), err[-3000:]
    assert "nothing after the last complete checkpoint is saved" in err
    assert "Check failure" not in err  # ended before jax's heartbeat check aborts the process
    if peer == "frozen":
        assert seconds > 4  # it waited the timeout for the frozen peer


def test_a_job_that_cannot_gather_ends_in_one_line_with_exit_2(tmp_path, toy_model):
    """distributed.num_processes=2 with process 0 alone, and process 1 pointed at a
    coordinator where nothing listens: each gives up after distributed.initialization_timeout_s
    with one line naming the coordinator, its process id and the timeout, and exit status
    2 (jax's coordination client used to end both natively: SIGABRT, exit 134, a C++ stack)."""
    recipe = two_process_recipe(tmp_path, toy_model, "run", total_steps=2)
    env = subprocess_env(1, HF_HUB_OFFLINE="1")
    alone, nobody = free_port(), free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "alignax.cli", "train", str(recipe),
                               f"distributed.coordinator=127.0.0.1:{port}", "distributed.num_processes=2",
                               f"distributed.process_id={process}", "distributed.initialization_timeout_s=3"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for process, port in ((0, alone), (1, nobody))]
    lines = []
    for (code, err, _), process, port in zip(finish(procs, timeout=120), (0, 1), (alone, nobody)):
        errors = [line for line in err.splitlines() if line.startswith("alignax:")]
        assert code == 2 and len(errors) == 1, err[-3000:]
        assert "Traceback" not in err and "Check failure" not in err, err[-3000:]
        assert (f"process {process} of 2 could not join the job at coordinator 127.0.0.1:{port} within 3 s "
                "(distributed.initialization_timeout_s)") in errors[0]
        lines.append(errors[0])
    assert "not all 2 processes joined" in lines[0] and f"nothing answers at 127.0.0.1:{nobody}" in lines[1]
