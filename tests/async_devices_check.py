"""Run by tests/test_async_devices.py on 8 fake CPU devices: the asynchronous sampler on a
device group of its own (``rollout.async.devices: 4``, the learner on the other 4) against
the time-sliced schedule on 4 devices (``mesh: [4, 1, 1]``, the first 4 of the 8; sampler
and learner both there), both at ``max_staleness: 1``, 3 rollouts; a device-split run at
``max_staleness: 2``; and where the sampler's weights land and how they get there. Prints
one JSON line of measured results.
"""

from __future__ import annotations

import json
import re
import tempfile

import jax
import numpy as np
from flax import nnx

from alignax.trainers.api import build_trainer, train
from tests.support.rl_toy import toy_config, toy_prompts
from tests.support.toy_model import make_toy_model

FIGURES = ("reward/total", "response/length_mean", "loss", "grad_norm", "entropy", "async/staleness")


def config(tmp: str, model_dir: str, *, staleness: int, devices: int, steps: int = 3):
    return toy_config(tmp, model_dir, "grpo", steps=steps, checkpoint={"enabled": False}, mesh={"shape": [4, 1, 1]},
                      rollout={"old_logps": "sampler", "async": {"max_staleness": staleness, "devices": devices}})


def run(model_dir: str, **kw) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = train(config(tmp, model_dir, **kw), records=toy_prompts(32))
    params = jax.device_get(jax.tree.leaves(result.loop.state.params))
    return {"history": [{k: h[k] for k in FIGURES} for h in result.history],
            "param_sums": [float(np.sum(np.asarray(p, np.float64))) for p in params],
            "params": [np.asarray(p) for p in params]}


def ids(tree) -> list[int]:
    return sorted({d.id for x in jax.tree.leaves(tree) for d in x.sharding.device_set})


def weights_move(model_dir: str) -> dict:
    """Where the sampler's copy of the weights lies, that making it moves nothing through
    the host (transfer guards on host<->device, explicit transfers included), and what the
    compiled copy program holds (no host callback, no host memory space)."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build_trainer(config(tmp, model_dir, staleness=1, devices=4), records=toy_prompts(32))
    state, _ = trainer.start()
    actors = trainer.actors
    with jax.transfer_guard_device_to_host("disallow_explicit"), jax.transfer_guard_host_to_device("disallow_explicit"):
        copy = actors.sampling_state(state.params)
        jax.block_until_ready(copy)
    whole = nnx.merge_state(actors.whole_policy(state.params), actors.rest)
    hlo = actors._copy_program.lower(whole).compile().as_text()  # the program that made the copy
    same = all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
               for a, b in zip(jax.tree.leaves(copy), jax.tree.leaves(whole)))
    return {"training_devices": ids(state.params), "sampler_mesh_devices": sorted(d.id for d in actors.sampler_mesh.devices.flat),
            "copy_devices": ids(copy), "copy_equals_params": same,
            "copy_specs_match_mesh": all(x.sharding.mesh == actors.sampler_mesh for x in jax.tree.leaves(copy)),
            "host_callbacks": len(re.findall(r"callback|custom_call_target=\"xla_ffi_python", hlo)),
            "host_memory_space": len(re.findall(r"S\(5\)|pinned_host", hlo))}


def main() -> None:
    assert jax.device_count() == 8
    model_dir = make_toy_model(tempfile.mkdtemp(prefix="toy-"))
    sliced = run(model_dir, staleness=1, devices=0)
    split = run(model_dir, staleness=1, devices=4)
    two = run(model_dir, staleness=2, devices=4)
    diffs = [float(np.max(np.abs(a.astype(np.float64) - b))) for a, b in zip(sliced.pop("params"), split.pop("params"))]
    two.pop("params")
    print(json.dumps({"devices": jax.device_count(), "sliced": sliced, "split": split, "split_k2": two,
                      "max_param_diff": max(diffs), "weights": weights_move(model_dir)}))


if __name__ == "__main__":
    main()
