"""An asynchronous run (``max_staleness: 1``, the sampler on devices of its own) over two
JAX processes (gloo collectives on CPU, 4 fake devices each: 2 learner + 2 sampler devices
in each) against the same run in one process with 8 devices (4 + 4). Both through
tests/async_multihost_check.py."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.fake_devices import json_objects, subprocess_env
from tests.test_multihost import free_port

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(processes: int, devices: int, model_dir: str, output_dir) -> list[dict]:
    """Each process's result of the check, in process order."""
    env, port = subprocess_env(devices, HF_HUB_OFFLINE="1"), str(free_port())
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "async_multihost_check.py"), str(p), str(processes),
                               port, model_dir, str(output_dir)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for p in range(processes)]
    outs = [proc.communicate(timeout=900) for proc in procs]
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, out[-2000:] + err[-4000:]
    return [[o for o in json_objects(out) if "history" in o][-1] for out, _ in outs]


@pytest.mark.xdist_group("multihost")
def test_an_async_run_over_two_processes_equals_one_process(tmp_path, toy_model):
    """The same samples (rewards and lengths equal), staleness 0, 1, 1, and the same losses,
    figures and final parameter sums within float32 noise (rtol 1e-5, atol 1e-6: the
    learner's reductions cross the processes in another order)."""
    two = launch(2, 4, toy_model, tmp_path / "two")
    one, = launch(1, 8, toy_model, tmp_path / "one")
    assert [(r["process"], r["processes"], r["devices"], r["local_devices"]) for r in two] == [(0, 2, 8, 4),
                                                                                             (1, 2, 8, 4)]
    assert (one["processes"], one["devices"]) == (1, 8)
    for r in two:
        assert [h["async/staleness"] for h in r["history"]] == [0.0, 1.0, 1.0]
        for key in ("reward/total", "response/length_mean"):
            assert [h[key] for h in r["history"]] == [h[key] for h in one["history"]], key
        for key in ("loss", "grad_norm", "entropy", "kl/ref_seq"):
            np.testing.assert_allclose([h[key] for h in r["history"]], [h[key] for h in one["history"]],
                                       rtol=1e-5, atol=1e-6, err_msg=key)
        np.testing.assert_allclose(r["digest"], one["digest"], rtol=1e-5, atol=1e-6)
