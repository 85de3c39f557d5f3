"""Asynchronous rollouts over two JAX processes (gloo collectives on CPU, 4 fake devices
each; the sampler on the last 2 of each process, the learner on the first 2) against one
process with 8 (the sampler on the last 4, on its own thread): the same samples, figures
and parameters. On CPU the two processes sample inline, every program from the learner's
thread (docs/async-rollouts.md: XLA's CPU client runs a process's multi-device programs one
at a time in launch order, so two threads launching independently hung 1 run in 6). The runs
are tests/async_multihost_check.py's; a run that hangs fails at the timeout."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.fake_devices import json_objects, subprocess_env
from tests.test_multihost import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
# a run takes 1 to 3 minutes on 2 loaded cores; a hang (the fault this guards against) never ends
TIMEOUT_S = 600


def launch(num_processes: int, model_dir: str, out: str, *, devices: int, timeout_s: int = TIMEOUT_S) -> list[dict]:
    """tests/async_multihost_check.py as ``num_processes`` processes; each one's result. Past
    ``timeout_s`` every process is killed and the test fails naming the hang."""
    env = subprocess_env(devices, HF_HUB_OFFLINE="1")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "async_multihost_check.py"), str(p),
                               str(num_processes), port, model_dir, out], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for p in range(num_processes)]
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout_s)
            assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
            results.append([r for r in json_objects(stdout) if "history" in r][-1])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail(f"the {num_processes}-process asynchronous run did not end within {timeout_s} s (a hang)")
    return results


def params(out: str) -> list[np.ndarray]:
    with np.load(os.path.join(out, "params.npz")) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, toy_model):
    root = tmp_path_factory.mktemp("async-multihost")
    two = launch(2, toy_model, str(root / "two"), devices=4)
    one = launch(1, toy_model, str(root / "one"), devices=8)[0]
    return two, one, params(str(root / "two")), params(str(root / "one"))


# the samples (tokens, rewards, lengths) are the same; the figures the update computes and
# the parameters differ by float32 rounding: the gradient's sum across the two processes
# (gloo) adds in another order than one process's across its devices (measured: at most
# 2e-6 relative on a figure, 1.3e-7 on a parameter of magnitude <= 1.07; CPU, jax 0.10.2)
RTOL, PARAM_ATOL = 1e-5, 1e-6
SAMPLED = ("reward/", "response/", "eval/", "async/staleness")


def assert_figures_match(got: list[dict], want: list[dict], what: str) -> None:
    assert [sorted(g) for g in got] == [sorted(w) for w in want], what
    for g, w in zip(got, want):
        for key in w:
            if key.startswith(SAMPLED) or key == "step":
                assert g[key] == w[key], (what, g.get("step"), key)
            else:
                np.testing.assert_allclose(g[key], w[key], rtol=RTOL, atol=1e-7, err_msg=f"{what} {key}")


@pytest.mark.xdist_group("multihost")
def test_two_processes_train_asynchronously_like_one(runs):
    """Staleness 1 with 2 + 2 devices a process against 4 + 4 in one process: the same
    samples (every reward, length and evaluation figure equal), the update's figures within
    rtol 1e-5 and the final parameters within 1e-6 (see RTOL). The sampler and the learner
    ran on disjoint groups spanning both processes; the run checkpointed and evaluated at
    rollout 2 with rollout 3 in flight. The two processes sampled inline (CPU), the one
    process on the sampler's thread: the same rollouts from the same weights."""
    two, one, two_params, one_params = runs
    for process, r in enumerate(two):
        assert (r["process"], r["processes"], r["devices"]) == (process, 2, 8)
        assert r["learner_devices"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
        assert r["sampler_devices"] == [[0, 2], [0, 3], [1, 2], [1, 3]]
        assert_figures_match(r["history"], one["history"], f"process {process}")
        assert_figures_match(r["eval"], one["eval"], f"process {process} evaluation")
    assert one["learner_devices"] == [[0, i] for i in range(4)]
    assert one["sampler_devices"] == [[0, i] for i in range(4, 8)]
    assert [h["async/staleness"] for h in one["history"]] == [0.0, 1.0, 1.0, 1.0]
    assert [e["step"] for e in one["eval"]] == [0, 2, 4]
    assert min(h["grad_norm"] for h in one["history"]) > 0  # it trained
    for a, b in zip(two_params, one_params, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=PARAM_ATOL)
    # each kept checkpoint (steps 2 and 4) has its rollouts in flight in a file a process
    assert two[0]["in_flight_files"] == [f"step_{s}.in_flight.process_{p}.json" for s in (2, 4) for p in (0, 1)]


def _schedule_of(processes: int, monkeypatch, *, own_devices: bool, backend: str = "cpu", **sections):
    """``OnlineTrainer.start_schedule`` for a GRPO config at staleness 1 as if in one of
    ``processes`` processes on ``backend`` (the actors stand in: the sampler's devices or none)."""
    from types import SimpleNamespace

    import jax

    from alignax.trainers.api import load_config
    from alignax.trainers.online.trainer import OnlineTrainer

    raw = {"algorithm": "grpo", "data": {"format": "prompt"}, "output_dir": "unused",
           "rollout": {"old_logps": "sampler", "async": {"max_staleness": 1}}, **sections}
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    actors = SimpleNamespace(sampler_counterpart={"sampler": "learner"} if own_devices else None)
    trainer = SimpleNamespace(config=load_config(data=raw), actors=actors, collector=SimpleNamespace(actors=actors))
    schedule = OnlineTrainer.start_schedule(trainer)
    schedule.close()
    return schedule


@pytest.mark.parametrize("processes, own_devices, backend, inline", [
    (2, True, "cpu", True),    # XLA's CPU client: one multi-device program at a time, in launch order
    (2, False, "cpu", True),   # time-sliced: both threads on the same devices
    (2, False, "gpu", True),
    (2, True, "gpu", False),   # each thread on its own devices
    (1, True, "cpu", False),   # one process: nothing to keep in step
    (1, False, "cpu", False),
])
def test_which_runs_sample_on_the_learners_thread(monkeypatch, processes, own_devices, backend, inline):
    """Over several processes a schedule whose two threads would launch programs into one
    queue samples inline (every program from the learner's thread, in one order on every
    process); the two-process run above is such a run (CPU)."""
    assert _schedule_of(processes, monkeypatch, own_devices=own_devices, backend=backend).inline is inline


def test_reward_models_with_a_sampler_thread_over_several_processes_are_refused_naming_the_key(monkeypatch):
    from alignax.config import ConfigError

    rewards = {"rewards": {"reward_models": ["some/folder"]}}
    with pytest.raises(ConfigError, match=r"rewards\.reward_models with rollout\.async\.max_staleness=1 and "
                                          r"rollout\.async\.devices over 2 processes") as refused:
        _schedule_of(2, monkeypatch, own_devices=True, backend="gpu", **rewards)
    assert "\n" not in str(refused.value)
    assert _schedule_of(2, monkeypatch, own_devices=True, backend="cpu", **rewards).inline  # one thread: accepted
