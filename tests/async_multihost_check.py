"""One process of tests/test_async_multihost.py's check: an asynchronous GRPO run at
``max_staleness: 1`` with the sampler on devices of its own (``rollout.async.devices: 4``,
the learner's mesh ``[4, 1, 1]``), on the toy model. Prints one JSON line: each step's
figures, and sums of the final parameters computed on the global arrays (comparable
across layouts).

    python tests/async_multihost_check.py PROCESS_ID NUM_PROCESSES PORT MODEL_DIR OUTPUT_DIR

``NUM_PROCESSES`` 1 runs without ``jax.distributed`` (the single-process run to compare with).
"""

from __future__ import annotations

import faulthandler
import json
import sys

import jax
import jax.numpy as jnp

FIGURES = ("reward/total", "response/length_mean", "loss", "grad_norm", "entropy", "kl/ref_seq", "async/staleness")


def main() -> None:
    faulthandler.dump_traceback_later(420, exit=True)  # a hang ends with every thread's stack, not a timeout
    process_id, processes, port, model_dir, output_dir = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3],
                                                          sys.argv[4], sys.argv[5])
    from alignax.trainers import api
    from tests.support.rl_toy import toy_config, toy_prompts

    distributed = ({"coordinator": f"127.0.0.1:{port}", "num_processes": processes, "process_id": process_id}
                   if processes > 1 else {})
    config = toy_config(output_dir, model_dir, "grpo", steps=3, distributed=distributed, mesh={"shape": [4, 1, 1]},
                        checkpoint={"enabled": False}, logging={"console": False, "tensorboard": False},
                        rollout={"old_logps": "sampler", "async": {"max_staleness": 1, "devices": 4}})
    result = api.train(config, records=toy_prompts(32))
    leaves = jax.tree.leaves(result.loop.state.params)
    digest = jax.jit(lambda ls: [jnp.sum(x.astype(jnp.float32)) for x in ls])(leaves)
    print(json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                      "devices": jax.device_count(), "local_devices": jax.local_device_count(),
                      "history": [{k: h[k] for k in FIGURES} for h in result.history],
                      "digest": [float(x) for x in jax.device_get(digest)]}), flush=True)


if __name__ == "__main__":
    main()
