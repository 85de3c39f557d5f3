"""One process of a two-process monitor check: the guard's decision is the job's, not a process's.

    python tests/multihost_guard_check.py PROCESS_ID NUM_PROCESSES PORT OUTPUT_DIR

Run by tests/test_multihost_guard.py with one CPU device a process (gloo collectives). Each
process runs two guarded runs, ``rollback`` then ``stop`` (one job: one start-up), each a
:class:`~alignax.trainers.online.guard.Guard` whose ``entropy_collapse`` alarm has that
action, fed the figures of two rollouts: process 0's entropy collapses at step 2
(2.0 -> 0.3), process 1's does not (2.0 -> 1.9). The train states are global arrays
replicated over both processes' devices, and the gold-best checkpoints live in
``OUTPUT_DIR/<action>/gold_best`` (Orbax, written by both processes together).

A third run, ``raise_beta``, arms the KL budget (``max`` 1 nat, ``raise_beta``) instead:
process 0's KL to the reference goes over it at step 2 (0.5 -> 2.0), process 1's stays 0.5.

Each process prints one JSON object a run: ``rollback`` / ``raise_beta``: the step it
restored, the parameters and KL coefficient as this process holds them, the rollbacks
counted; ``stop``: the stop's one line and its exit status, with which the process then
exits (as ``alignax train`` does).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np


def main() -> int:
    process_id, num_processes, port, output_dir = sys.argv[1:5]
    from alignax.parallel import multihost
    from alignax.parallel.multihost import DistributedConfig

    multihost.initialize(DistributedConfig(coordinator=f"127.0.0.1:{port}", num_processes=int(num_processes),
                                           process_id=int(process_id), initialization_timeout_s=120))
    guarded_run(int(process_id), os.path.join(output_dir, "rollback"), "rollback")
    guarded_run(int(process_id), os.path.join(output_dir, "raise_beta"), "raise_beta")
    return guarded_run(int(process_id), os.path.join(output_dir, "stop"), "stop")


def guarded_run(process_id: int, output_dir: str, action: str) -> int:
    """One run of the module docstring; its exit status."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from alignax import kl as kl_lib
    from alignax.trainers.config import MonitorSection
    from alignax.trainers.engine.step import TrainState
    from alignax.trainers.online.guard import AlarmStopError, Guard
    from alignax.trainers.online.monitoring import AlarmSettings, Alarms

    replicated = NamedSharding(Mesh(np.array(jax.devices()), ("data",)), PartitionSpec())

    def global_array(value):
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, replicated, lambda index: value[index])

    def state(fill: float, rollouts: int) -> TrainState:
        """A train state whose parameters are ``fill`` (the same on every process)."""
        params = {"w": np.full((3, 4), fill, np.float32), "b": np.arange(4, dtype=np.float32) * fill}
        moments = {k: v * 0.5 for k, v in params.items()}
        extra = {"kl_coef": kl_lib.KLControllerState(coef=np.float32(0.1)), "rollouts": np.int32(rollouts)}
        host = TrainState(step=np.int32(rollouts), params=params, opt_state={"mu": moments},
                          rng=np.zeros((2,), np.uint32), nonfinite_streak=np.int32(0), nonfinite_total=np.int32(0),
                          extra=extra)
        return jax.tree.map(global_array, host)

    class ScriptedGold:
        """Gold scores in turn (the same on every process, as an agreed evaluation's are)."""

        def __init__(self, scores):
            self.scores = list(scores)

        def score(self, params):
            return {"gold/score": self.scores.pop(0)}

    monitor = dataclasses.replace(MonitorSection(), gold=dataclasses.replace(MonitorSection().gold, every=1))
    if action == "raise_beta":  # the KL budget's: process 0's KL goes over it at step 2
        monitor = dataclasses.replace(monitor, kl_budget=dataclasses.replace(
            monitor.kl_budget, max=1.0, action="raise_beta", beta_factor=2.0))
    else:
        monitor = dataclasses.replace(
            monitor, entropy_collapse=dataclasses.replace(monitor.entropy_collapse, action=action))
    alarms = Alarms(AlarmSettings.from_monitor(monitor))
    factors: list[float] = []
    # gold: 0.2 at the start, 0.5 at step 1 (the best), 0.1 at step 2: a rollback restores step 1
    guard = Guard(monitor, output_dir, alarms=alarms, gold=ScriptedGold([0.2, 0.5, 0.1]),
                  scale_learning_rate=factors.append)
    guard.begin(state(0.0, 0))
    tripped = process_id == 0
    entropies = [2.0, 0.3] if tripped and action != "raise_beta" else [2.0, 1.9]
    kls = [0.5, 2.0] if tripped and action == "raise_beta" else [0.5, 0.5]
    current = None
    try:
        for step, (entropy, kl) in enumerate(zip(entropies, kls), start=1):
            current = state(float(step), step)
            metrics = {"kl/ref_seq": kl, "entropy": entropy, "response/length_mean": 10.0, "reward/total": 0.0,
                       "grad_norm_max": 1.0, "clipfrac_low": 0.0, "clipfrac_high": 0.0, "update_skipped": 0.0,
                       "epochs_run": 1.0}
            metrics.update(alarms.update(step, kl=kl, entropy=entropy, length=10.0, reward=0.0, grad_norm=1.0))
            current = guard(step, current, metrics)
    except AlarmStopError as err:
        print(json.dumps({"process": process_id, "action": action, "stopped": str(err), "exit": err.exit_code}),
              flush=True)
        return err.exit_code
    finally:
        guard.finish()
    restored = [json.loads(line)["restored_step"] for line in guard.events.lines.splitlines()
                if "restored_step" in json.loads(line)]
    local = {k: np.asarray(v.addressable_data(0)).tolist() for k, v in current.params.items()}
    coef = float(np.asarray(current.extra["kl_coef"].coef.addressable_data(0)))
    print(json.dumps({"process": process_id, "action": action, "restored_steps": restored, "params": local,
                      "rollbacks": guard.rollbacks, "lr_factors": factors, "kl_coef": coef}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
