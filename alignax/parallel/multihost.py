"""Many processes, one job: joining it, and moving batches between hosts and global arrays.

A multi-host run (a TPU pod slice, GPU nodes, or several CPU processes with gloo
collectives) is one JAX program per process. Each process reads only its share of every
global batch (``alignax.data``: ``data.batch_size`` is global, process ``p`` of ``P`` reads
rows ``p, p + P, ...`` of the global stream), places it with :func:`place_local_batch` as
its part of one global array, and reads back only its own rows with :func:`local_rows`.
Scalars (losses, metrics) come out of compiled steps replicated, so every process sees
the same figures; process 0 alone writes files (:func:`is_writer`).

Joining: :func:`initialize` calls ``jax.distributed.initialize`` once, before anything
touches a JAX backend, from the ``distributed`` config section or from the environment
(TPU VMs, SLURM, and ``JAX_COORDINATOR_ADDRESS``, as ``jax.distributed.initialize()``
detects them). One process is the default and needs nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

log = logging.getLogger("alignax")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """The ``distributed`` section: how this process joins a multi-process job.

    Fields:
      coordinator: ``host:port`` of process 0's coordination service (``null``: taken from
        the environment when a cluster is detected, else a single-process run).
      num_processes: processes in the job (``null``: from the environment).
      process_id: this process's index in ``[0, num_processes)`` (``null``: from the
        environment).
      local_device_ids: the devices of this host this process uses (``null``: all).
      cpu_collectives: collectives of the CPU backend across processes (``gloo``; ``mpi``
        where jaxlib was built with it).
      initialization_timeout_s: how long to wait for every process to join.
    """

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    cpu_collectives: str = "gloo"
    initialization_timeout_s: int = 300

    def __post_init__(self):
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"distributed.num_processes must be >= 1; got {self.num_processes}")
        if (self.process_id is not None and self.num_processes is not None
                and not 0 <= self.process_id < self.num_processes):
            raise ValueError(f"distributed.process_id={self.process_id} is not in [0, distributed.num_processes="
                             f"{self.num_processes})")
        if self.cpu_collectives not in ("gloo", "mpi"):
            raise ValueError(f"distributed.cpu_collectives: {self.cpu_collectives!r} is not one of 'gloo', 'mpi'")


# Environment variables by which jax.distributed.initialize() finds a cluster on its own.
_CLUSTER_ENV = ("JAX_COORDINATOR_ADDRESS", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS",
                "OMPI_COMM_WORLD_SIZE")


def _cluster_detected() -> bool:
    if any(os.environ.get(name) for name in _CLUSTER_ENV):
        return True
    tasks = os.environ.get("SLURM_NTASKS") or os.environ.get("SLURM_STEP_NUM_TASKS")
    return bool(os.environ.get("SLURM_JOB_ID")) and tasks is not None and int(tasks) > 1


def _is_initialized() -> bool:
    from jax._src import distributed  # the public API has no query before jax 0.6

    return distributed.global_state.client is not None


def initialize(config: DistributedConfig | None) -> bool:
    """Join the multi-process job ``config`` (or the environment) describes; returns
    whether this is a multi-process run. Idempotent; a no-op for a single process."""
    config = config or DistributedConfig()
    if _is_initialized():
        return True
    explicit = config.coordinator is not None or (config.num_processes or 1) > 1
    if not explicit and not _cluster_detected():
        return False
    jax.config.update("jax_cpu_collectives_implementation", config.cpu_collectives)
    kwargs: dict[str, Any] = {"initialization_timeout": config.initialization_timeout_s}
    if explicit:
        kwargs.update(coordinator_address=config.coordinator, num_processes=config.num_processes,
                      process_id=config.process_id)
    if config.local_device_ids is not None:
        kwargs["local_device_ids"] = list(config.local_device_ids)
    jax.distributed.initialize(**kwargs)
    log.info("joined a %d-process job as process %d (%d local devices of %d)", jax.process_count(),
             jax.process_index(), jax.local_device_count(), jax.device_count())
    return True


def is_writer() -> bool:
    """Whether this process writes the run's files (process 0)."""
    return jax.process_index() == 0


def place_local_batch(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """This process's rows of a global batch, placed as its part of the global array.

    ``value`` holds ``B / P`` rows (``P`` processes); the global array has ``B`` rows in
    process order (process 0's rows first). With one process this is a plain placement.
    """
    value = np.asarray(value)
    if jax.process_count() == 1 or value.ndim == 0:  # a 0-d leaf is the same on every process
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
    global_shape = (value.shape[0] * jax.process_count(), *value.shape[1:])
    return jax.make_array_from_process_local_data(sharding, value, global_shape)


def local_rows(array: jax.Array) -> np.ndarray:
    """The rows of a batch-sharded global array that this process holds, as NumPy (the
    inverse of :func:`place_local_batch`); the whole array when it is fully addressable."""
    if array.is_fully_addressable:
        return np.asarray(jax.device_get(array))
    pieces: dict[tuple[int, int], np.ndarray] = {}
    for shard in array.addressable_shards:
        rows = shard.index[0] if shard.index else slice(None)
        start, stop, _ = rows.indices(array.shape[0])
        if any(s != slice(None) and s.indices(n)[:2] != (0, n) for s, n in zip(shard.index[1:], array.shape[1:])):
            raise ValueError("local_rows reads arrays sharded over their first axis only; got shard index "
                             f"{shard.index} of shape {array.shape}")
        pieces.setdefault((start, stop), np.asarray(shard.data))
    spans = sorted(pieces)
    for (_, stop), (start, _) in zip(spans, spans[1:]):
        if stop != start:
            raise ValueError(f"this process's rows of an array of shape {array.shape} are not contiguous: {spans}")
    return np.concatenate([pieces[s] for s in spans], axis=0)


def replicated(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """``tree`` resharded to be whole on every device (so every process can read it);
    every process must call it (a collective)."""
    target = NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(lambda t: t, out_shardings=jax.tree.map(lambda _: target, tree))(tree)
