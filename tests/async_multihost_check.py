"""One process of the multi-process asynchronous check: GRPO on the toy model at
``rollout.async.max_staleness: 1`` with the sampler on devices of its own
(``rollout.async.devices: 4``; the learner ``mesh: [4, 1, 1]`` on the rest), 4 rollouts with
a checkpoint and an evaluation at rollout 2 (while rollout 3 is in flight) and at the end.

    python tests/async_multihost_check.py PROCESS_ID NUM_PROCESSES PORT MODEL_DIR OUTPUT_DIR

Run by tests/test_async_multihost.py with ``--xla_force_host_platform_device_count`` set:
as 2 processes of 4 fake CPU devices (each process's first 2 are the learner's, its last 2
the sampler's) and as 1 process of 8 (the first 4 the learner's, the last 4 the sampler's):
the same mesh shapes, so the same programs (two processes on CPU sample inline, on the
learner's thread; one samples on its sampler thread). Prints one JSON line: each rollout's figures
(timings left out), the evaluations, the devices each side ran on, and the final parameters'
SHA-256; process 0 writes the final parameters to ``OUTPUT_DIR/params.npz`` (float32).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import jax
import numpy as np


def timing(key: str) -> bool:
    return key.startswith("perf/") or key.endswith("_s") or key.endswith("per_s")


def where(mesh) -> list[list[int]]:
    """``[process, its device's place among that process's devices]`` of each device of ``mesh``."""
    place = {}
    for d in sorted(jax.devices(), key=lambda d: (d.process_index, d.id)):
        place[d] = [d.process_index, sum(e.process_index == d.process_index for e in place)]
    return sorted(place[d] for d in mesh.devices.flat)


def main() -> None:
    process_id, num_processes, port, model_dir, out = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
                                                        sys.argv[5])
    from alignax.parallel.multihost import replicated
    from alignax.trainers import api
    from tests.support.rl_toy import toy_config, toy_prompts

    distributed = ({"coordinator": f"127.0.0.1:{port}", "num_processes": num_processes, "process_id": process_id}
                   if num_processes > 1 else {})
    config = toy_config(out, model_dir, "grpo", steps=4, data={"batch_size": 8}, mesh={"shape": [4, 1, 1]},
                        rollout={"num_samples": 2, "old_logps": "sampler",
                                 "async": {"max_staleness": 1, "devices": 4}},
                        train={"save_every": 2, "eval_every": 2}, evaluation={"max_prompts": 8},
                        distributed=distributed)
    trainers = []
    build_trainer = api.build_trainer
    api.build_trainer = lambda *args, **kwargs: trainers.append(build_trainer(*args, **kwargs)) or trainers[-1]
    result = api.train(config, records=toy_prompts(48))
    actors = trainers[-1].actors
    params = jax.tree.leaves(result.loop.state.params)
    whole = [np.asarray(x.addressable_data(0), np.float32) for x in replicated(params, trainers[-1].mesh)]
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(p).tobytes() for p in whole)).hexdigest()
    if jax.process_index() == 0:
        np.savez(os.path.join(out, "params.npz"), *whole)
    print(json.dumps({
        "process": jax.process_index(), "processes": jax.process_count(), "devices": jax.device_count(),
        "learner_devices": where(trainers[-1].mesh), "sampler_devices": where(actors.sampler_mesh),
        "history": [{k: v for k, v in h.items() if not timing(k)} for h in result.history],
        "eval": result.eval_history, "params_sha256": digest,
        "in_flight_files": sorted(os.listdir(os.path.join(out, "async_in_flight")))
        if os.path.isdir(os.path.join(out, "async_in_flight")) else [],
    }), flush=True)


if __name__ == "__main__":
    main()
    print(json.dumps({"finished": time.time()}), flush=True)
