"""One process of a multi-process check: train tiny recipes and print what they measured.

    python tests/multihost_check.py PROCESS_ID NUM_PROCESSES PORT JOBS_JSON

Run by tests/test_multihost.py with ``--xla_force_host_platform_device_count`` set, once
per process (``NUM_PROCESSES`` 1 runs without ``jax.distributed``). ``JOBS_JSON`` is a list
of jobs ``{"name", "recipe" (dpo | grpo | ppo), "model_dir", "output_dir", "dpo_reference",
"steps", "rollout_mesh" (optional: the online sampler's own mesh), "placement" (optional: the
run's ``placement`` section)}``; each trains that tiny recipe on the toy model through
``alignax.trainers.api.train`` on the same records and prints one JSON line: the losses of the steps it ran, the step metrics rows it wrote, and a
digest of the final parameters (sums computed on the global arrays, so every process and
every layout gives comparable numbers). A job ``{"name", "check": "batch_per_process"}`` places 4 rows on 8
batch devices and prints the error it gets. A job ``{"name", "cli": [ARGS]}`` runs the command
line (``alignax ARGS``, this process's ``distributed.*`` keys appended) and prints its exit
status and stdout. Last, each process prints ``{"finished": TIME}`` and returns: the job
is left the way a run leaves it (:func:`alignax.parallel.multihost.leave` at exit), which
tests/test_multihost.py times and reads from stderr.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def frozen_layout(trainer) -> dict:
    """Where a reference placed on a sub-mesh lies: how many devices hold it, how many of
    them are this process's, and whether any is a training device (empty without one)."""
    reference = getattr(getattr(trainer, "actors", trainer), "submesh_reference", None)  # online: the actors hold it
    if reference is None:
        return {}
    devices = {d for x in jax.tree.leaves(reference) for d in x.sharding.device_set}
    return {"reference_devices": len(devices), "reference_local_devices": sum(d in jax.local_devices() for d in devices),
            "reference_on_training_devices": bool(devices & set(trainer.mesh.devices.flat))}


def main() -> None:
    process_id, num_processes, port, jobs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    from alignax.trainers import api
    from tests.support.rl_toy import toy_config, toy_prompts
    from tests.support.trainer_helpers import separable_pairs, tiny_config

    distributed = ({"coordinator": f"127.0.0.1:{port}", "num_processes": num_processes, "process_id": process_id}
                   if num_processes > 1 else {})
    common = {"mesh": {"shape": [1, -1, 1]}, "distributed": distributed,
              "logging": {"console": False, "tensorboard": False}}
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger("alignax").addHandler(Collect(level=logging.INFO))
    logging.getLogger("alignax").setLevel(logging.INFO)
    trainers = []  # the trainer api.train builds, to read the mesh its sampler ran on
    build_trainer = api.build_trainer
    api.build_trainer = lambda *args, **kwargs: trainers.append(build_trainer(*args, **kwargs)) or trainers[-1]
    for job in jobs:
        messages.clear()
        if job.get("check") == "batch_per_process":  # a batch that cannot give each process rows of its own
            from alignax.parallel import batch_sharding, make_mesh
            from alignax.parallel.multihost import place_local_batch

            try:  # this process's 2 of 4 rows, on the 8 batch devices of both processes
                place_local_batch(np.zeros((2, 3), np.float32), batch_sharding(make_mesh((1, -1, 1)), 2))
                error = None
            except ValueError as err:
                error = str(err)
            print(json.dumps({"job": job["name"], "process": jax.process_index(), "error": error}), flush=True)
            continue
        if "cli" in job:
            from alignax import cli

            keys = [f"distributed.{k}={v}" for k, v in distributed.items()]
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                rc = cli.main([*job["cli"], *keys])
            print(json.dumps({"job": job["name"], "process": jax.process_index(), "rc": rc,
                              "stdout": out.getvalue()}), flush=True)
            continue
        recipe = job.get("recipe", "dpo")
        if recipe == "dpo":
            config = tiny_config(job["output_dir"], "dpo", steps=job["steps"], model_dir=job["model_dir"],
                                 data={"batch_size": 8, "eval_fraction": 0.0},
                                 preference={"reference": job["dpo_reference"]}, **common)
            records = separable_pairs(48)
        else:  # online: 8 prompts x 2 samples, one minibatch (so the rows of an update are the same set)
            section = {"minibatches": 1, **({"epochs": 2} if recipe == "ppo" else {})}
            config = toy_config(job["output_dir"], job["model_dir"], recipe, steps=job["steps"],
                                data={"batch_size": 8},
                                rollout={"num_samples": 2, **({"mesh": job["rollout_mesh"]} if "rollout_mesh" in job
                                                              else {})},
                                evaluation={"max_prompts": 8}, placement=job.get("placement", {}),
                                **{recipe: section}, **common)
            records = toy_prompts(48)
        result = api.train(config, records=records)
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
            "metric_steps": rows, "eval": result.eval_history,
            "sampler_mesh": list(getattr(getattr(trainers[-1], "actors", None), "sampler_mesh",
                                         trainers[-1].mesh).shape.values()),
            **frozen_layout(trainers[-1]),
            "layout_changed": any("layout changed" in m for m in messages), "digest": [float(x) for x in jax.device_get(digest)],
        }), flush=True)


if __name__ == "__main__":
    main()
    print(json.dumps({"finished": time.time()}), flush=True)
