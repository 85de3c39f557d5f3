"""Multi-turn rollouts in two JAX processes (gloo collectives on CPU, 2 fake devices each)
against one process with 4: each process plays its own rows of the global prompt batch,
and together they give the one process's trajectories (tokens, masks, log-probs, rewards,
turns, end reasons)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.fake_devices import last_json_line, subprocess_env
from tests.test_multihost import free_port
from tests.support.toy_agent import make_agent_model

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.xdist_group("multihost")  # with the other multi-process launch: not both at once on 2 cores
def test_two_processes_play_the_trajectories_of_one(tmp_path):
    model_dir = make_agent_model(tmp_path / "model")
    port = str(free_port())
    script = os.path.join(HERE, "multihost_agent_check.py")
    runs = [(p, 2, 2) for p in range(2)] + [(0, 1, 4)]  # (process, processes, devices): all three at once
    procs = [subprocess.Popen([sys.executable, script, str(p), str(n), port, model_dir],
                              env=subprocess_env(devices, HF_HUB_OFFLINE="1"), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for p, n, devices in runs]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-2000:] + err[-4000:]
        results.append(last_json_line(out))
    *two, one = results
    assert [(r["process"], r["processes"], r["devices"]) for r in two] == [(0, 2, 4), (1, 2, 4)]
    assert (one["processes"], one["devices"]) == (1, 4)
    assert len(two[0]["rewards"]) == len(two[1]["rewards"]) == len(one["rewards"]) // 2  # each its own rows
    assert two[0]["prompts"] + two[1]["prompts"] == one["prompts"]  # block p of the global batch
    for key in ("tokens", "response_mask", "action_mask", "rewards"):
        np.testing.assert_array_equal(two[0][key] + two[1][key], one[key], err_msg=key)
    np.testing.assert_allclose(two[0]["sampler_logps"] + two[1]["sampler_logps"], one["sampler_logps"],
                               rtol=1e-5, atol=1e-6)
    for key, values in one["trajectory"].items():  # turns, counts, end reasons (env_s is a time)
        if key == "env_s":
            continue
        np.testing.assert_array_equal(two[0]["trajectory"][key] + two[1]["trajectory"][key], values, err_msg=key)
    # not vacuous: observations between turns, and rows that ended at different turns, in both processes
    for r in two:
        actions, real = np.asarray(r["action_mask"]), np.asarray(r["response_mask"])
        assert ((real > 0) & (actions == 0)).any()
        assert len(set(r["trajectory"]["turns"])) > 1
