"""One process of a multi-process check: train tiny recipes and print what they measured.

    python tests/multihost_check.py PROCESS_ID NUM_PROCESSES PORT JOBS_JSON

Run by tests/test_multihost.py with ``--xla_force_host_platform_device_count`` set, once
per process (``NUM_PROCESSES`` 1 runs without ``jax.distributed``). ``JOBS_JSON`` is a list
of jobs ``{"name", "model_dir", "output_dir", "dpo_reference", "steps", "resume"}``; each
trains the tiny DPO recipe through ``alignax.trainers.api.train`` on the same records and
prints one JSON line: the losses of the steps it ran, the step metrics rows it wrote, and a
digest of the final parameters (sums computed on the global arrays, so every process and
every layout gives comparable numbers).
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp


def main() -> None:
    process_id, num_processes, port, jobs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    from alignax.trainers import api
    from tests.trainer_helpers import separable_pairs, tiny_config

    distributed = ({"coordinator": f"127.0.0.1:{port}", "num_processes": num_processes, "process_id": process_id}
                   if num_processes > 1 else {})
    for job in jobs:
        config = tiny_config(
            job["output_dir"], "dpo", steps=job["steps"], model_dir=job["model_dir"],
            data={"batch_size": 8, "eval_fraction": 0.0}, mesh={"shape": [1, -1, 1]},
            dpo={"reference": job["dpo_reference"]}, distributed=distributed,
            logging={"console": False, "tensorboard": False},
        )
        result = api.train(config, records=separable_pairs(48))
        params = result.loop.state.params
        leaves = jax.tree.leaves(params)
        digest = jax.jit(lambda ls: [jnp.sum(x.astype(jnp.float32)) for x in ls]
                         + [jnp.sum(jnp.square(x.astype(jnp.float32))) for x in ls])(leaves)
        metrics = os.path.join(job["output_dir"], "metrics.jsonl")
        rows = []
        if os.path.exists(metrics):
            with open(metrics) as f:
                rows = [json.loads(line)["step"] for line in f if '"loss"' in line]
        print(json.dumps({
            "job": job["name"], "process": jax.process_index(), "processes": jax.process_count(),
            "devices": jax.device_count(), "local_devices": jax.local_device_count(),
            "losses": [h["loss"] for h in result.history], "steps": [h["step"] for h in result.history],
            "metric_steps": rows, "digest": [float(x) for x in jax.device_get(digest)],
        }), flush=True)


if __name__ == "__main__":
    main()
