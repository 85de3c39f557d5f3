"""Many processes, one job: joining it, and moving batches between hosts and global arrays.

A multi-host run (a TPU pod slice, GPU nodes, or several CPU processes with gloo
collectives) is one JAX program per process. Each process reads only its share of every
global batch (``alignax.data``: ``data.batch_size`` is global, process ``p`` of ``P`` reads
block ``p`` of each global batch), places it with :func:`place_local_batch` as its part
of one global array (the blocks in process order: the one-process batch, row for row),
and reads back only its own rows with :func:`local_rows`.
Scalars (losses, metrics) come out of compiled steps replicated, so every process sees
the same figures; process 0 alone writes files (:func:`is_writer`).

Joining: :func:`initialize` calls ``jax.distributed.initialize`` once, before anything
touches a JAX backend, from the ``distributed`` config section or from the environment
(TPU VMs, SLURM, and ``JAX_COORDINATOR_ADDRESS``, as ``jax.distributed.initialize()``
detects them). One process is the default and needs nothing. A process that has not
joined within ``distributed.initialization_timeout_s`` (a coordinator that does not
answer, a process never started) exits with status 2 and one line naming the
coordinator, its process id and the timeout, before jax's own deadline would end it
natively (SIGABRT and a C++ stack).

Compiling: in a job of several CPU processes, every process compiles its programs itself;
jax's persistent compilation cache (``JAX_COMPILATION_CACHE_DIR``) is turned off for the
job (:func:`_compile_in_every_cpu_process`). Only process 0 writes that cache, and the other
processes' cache keys differ from its own, so with a warm cache process 0 ran the
executable deserialized from it while process 1 ran a fresh compile of the same program:
on jaxlib 0.12.1 (gloo collectives) both then waited forever in the gloo all-gathers of
the first training step (both processes alive, neither past step 1), while a cold cache
(both compiled) trained.

Leaving: a process that :func:`initialize` joined to a job leaves it with :func:`leave`, run
at interpreter exit (before jax's own exit-time clean-up) and callable earlier: a barrier
through the coordination service once every process's work is done, then
``jax.distributed.shutdown()`` while the backends are still up. Left to jax's exit-time
clean-up instead, each process shuts down whenever it gets there, after tearing down its
backends; when the processes finished almost together, process 0 (the coordination
service's host) was seen gone while process 1 sat 150 s in its shutdown.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import hashlib
import logging
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from alignax.parallel.sharding import batch_sharding, fit_rows, place_array

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
      initialization_timeout_s: how long to wait for every process to join, and at the
        end for every process to finish (:func:`leave`).
      shutdown_timeout_s: after SIGTERM or SIGINT reaches any process of the job, how long
        each process has to save the checkpoint with the others and leave; past it the
        process exits at once with status 143 (130) (see docs/reliability.md).
      require_accelerator: refuse to start on CPU (:func:`alignax.parallel.hardware.announce`).
    """

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    cpu_collectives: str = "gloo"
    initialization_timeout_s: int = 300
    shutdown_timeout_s: int = 120
    require_accelerator: bool = False

    def __post_init__(self):
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"distributed.num_processes must be >= 1; got {self.num_processes}")
        if (self.process_id is not None and self.num_processes is not None
                and not 0 <= self.process_id < self.num_processes):
            raise ValueError(f"distributed.process_id={self.process_id} is not in [0, distributed.num_processes="
                             f"{self.num_processes})")
        if self.shutdown_timeout_s <= 0:
            raise ValueError(f"distributed.shutdown_timeout_s must be > 0 seconds; got {self.shutdown_timeout_s}")
        if self.cpu_collectives not in ("gloo", "mpi"):
            raise ValueError(f"distributed.cpu_collectives: {self.cpu_collectives!r} is not one of 'gloo', 'mpi'")


# The clusters jax.distributed.initialize() would join on its own (jax's own detectors;
# mpi4py's is opt-in there and Kubernetes' alone says nothing about a multi-process job).
_AUTO_CLUSTERS = ("SlurmCluster", "OmpiCluster", "GceTpuCluster", "GkeTpuCluster")


def _cluster_detected() -> bool:
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    try:
        from jax._src import clusters  # no public API lists them
        return any(c.__name__ in _AUTO_CLUSTERS and c.is_env_present() for c in clusters.ClusterEnv._cluster_types)
    except Exception as err:  # noqa: BLE001 - a jax without these internals: explicit keys still work
        log.debug("cluster detection unavailable (%s); set the distributed keys", err)
        return False


def _is_initialized() -> bool:
    from jax._src import distributed  # the public API has no query before jax 0.6

    return distributed.global_state.client is not None


# Set while this process is in a job that initialize() joined: the timeout of its leave()
_joined: dict[str, int] = {}


def initialize(config: DistributedConfig | None) -> bool:
    """Join the multi-process job ``config`` (or the environment) describes; returns
    whether this is a multi-process run. Idempotent; a no-op for a single process. A job
    joined here is left by :func:`leave` at interpreter exit."""
    config = config or DistributedConfig()
    if _is_initialized():
        return True
    explicit = config.coordinator is not None or (config.num_processes or 1) > 1
    if not explicit and not _cluster_detected():
        return False
    jax.config.update("jax_cpu_collectives_implementation", config.cpu_collectives)
    timeout = config.initialization_timeout_s
    # jax's own deadline comes later than ours: when it passes, its coordination client ends the
    # process natively (SIGABRT, a C++ stack); the watchdog below ends it first, in one line
    kwargs: dict[str, Any] = {"initialization_timeout": timeout + max(30, timeout // 10)}
    if explicit:
        kwargs.update(coordinator_address=config.coordinator, num_processes=config.num_processes,
                      process_id=config.process_id)
    if config.local_device_ids is not None:
        kwargs["local_device_ids"] = list(config.local_device_ids)
    watchdog = threading.Timer(timeout, _join_failed, args=(config,))
    watchdog.daemon = True
    watchdog.start()
    try:
        jax.distributed.initialize(**kwargs)
    finally:
        watchdog.cancel()
    _joined["timeout_s"] = config.initialization_timeout_s
    _compile_in_every_cpu_process()
    atexit.register(leave)  # after jax's exit-time clean-up was registered (at import), so it runs before it
    log.info("joined a %d-process job as process %d (%d local devices of %d)", jax.process_count(),
             jax.process_index(), jax.local_device_count(), jax.device_count())
    return True


def _compile_in_every_cpu_process() -> None:
    """Turn jax's persistent compilation cache off in a multi-process CPU job (see the
    module docstring, "Compiling"): every process then runs a program it compiled itself,
    and all of them issue the same cross-process collectives in the same order. Called
    after joining and before anything is compiled (jax reads the setting at the first
    compile)."""
    if jax.process_count() == 1 or jax.default_backend() != "cpu":
        return
    if jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir:
        log.info("process %d of %d: jax's persistent compilation cache (%s) is off for this CPU job: each "
                 "process compiles its own programs (a cached program in process 0 only hung the collectives)",
                 jax.process_index(), jax.process_count(), jax.config.jax_compilation_cache_dir)
    jax.config.update("jax_enable_compilation_cache", False)


def _coordinator_answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


def _join_failed(config: DistributedConfig) -> None:
    """End this process, in one line and with status 2, when it has not joined the job
    within ``distributed.initialization_timeout_s`` (run by :func:`initialize`'s watchdog
    while ``jax.distributed.initialize`` still waits; the main thread cannot be woken)."""
    coordinator = config.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS") or "(from the environment)"
    process = "?" if config.process_id is None else config.process_id
    count = "?" if config.num_processes is None else config.num_processes
    if process == 0:
        why = f"not all {count} processes joined; start the others with distributed.coordinator={coordinator}"
    elif _coordinator_answers(coordinator):
        why = f"the coordinator answers but not all {count} processes joined; start every process of the job"
    else:
        why = (f"nothing answers at {coordinator}: start process 0 there, or correct distributed.coordinator "
               "(host:port of process 0)")
    print(f"alignax: error: process {process} of {count} could not join the job at coordinator {coordinator} within "
          f"{config.initialization_timeout_s} s (distributed.initialization_timeout_s): {why}", file=sys.stderr,
          flush=True)
    logging.shutdown()
    os._exit(2)


def leave() -> None:
    """Leave the multi-process job :func:`initialize` joined: wait at a barrier until every
    process has finished (its checkpoints, metrics and exports written), then shut down
    ``jax.distributed`` while the backends are up. Every process arrives within moments of
    the last one, and ``jax.distributed.shutdown()`` is itself a barrier over the processes'
    clients, after which process 0 stops the coordination service it hosts: no process is
    left talking to a service that is gone. Runs at interpreter exit; every process must
    call it (it is a collective); nothing in the job may run after it. A no-op in a
    single-process run, for a job joined by someone else, and when called again."""
    from jax._src import distributed  # the client's barrier has no public API

    timeout_s = _joined.pop("timeout_s", None)
    if timeout_s is None or distributed.global_state.client is None:
        return
    index, count, start = jax.process_index(), jax.process_count(), time.perf_counter()
    try:
        jax.effects_barrier()  # this process's dispatched work is done
        distributed.global_state.client.wait_at_barrier("alignax_leave", timeout_s * 1000)
    except Exception as err:  # noqa: BLE001 - another process failed or hung: shut down without waiting for it
        log.error("process %d of %d: not every process reached the end within %d s (%s); shutting down",
                  index, count, timeout_s, err)
    else:
        log.info("process %d of %d: every process finished; leaving the job", index, count)
    jax.distributed.shutdown()
    log.info("process %d of %d: left the job (jax.distributed shut down) %.2f s after finishing",
             index, count, time.perf_counter() - start)


def is_writer() -> bool:
    """Whether this process writes the run's files (process 0)."""
    return jax.process_index() == 0


def process_rows(num_rows: int) -> slice:
    """The rows of a global batch of ``num_rows`` that this process provides and reads:
    block ``p`` of ``P`` equal blocks (process order)."""
    count, index = jax.process_count(), jax.process_index()
    if num_rows % count:
        raise ValueError(f"a global batch of {num_rows} rows does not split over {count} processes")
    share = num_rows // count
    return slice(index * share, (index + 1) * share)


def _addressable_rows(sharding: NamedSharding, shape: tuple[int, ...]) -> set[tuple[int, int]]:
    spans = set()
    for index in sharding.addressable_devices_indices_map(shape).values():
        rows = index[0] if index else slice(None)
        spans.add(rows.indices(shape[0])[:2])
    return spans


def place_local_batch(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """This process's rows of a global batch, placed as its part of the global array.

    ``value`` holds ``B / P`` rows (``P`` processes); in the global array (``B`` rows) they
    are rows :func:`process_rows` — process 0's first. With one process this is a plain
    placement. The mesh must give each process's devices one contiguous block of the
    batch axes (as ``jax.devices()``' process-major order does). Batch axes that do not
    divide ``B`` are dropped from ``sharding`` (:func:`alignax.parallel.sharding.fit_rows`:
    the rows are whole on their devices); with several processes the rows must still split
    over the processes.
    """
    value = np.asarray(value)
    if value.ndim == 0:  # a 0-d leaf is the same on every process
        return place_array(value, sharding)
    global_shape = (value.shape[0] * jax.process_count(), *value.shape[1:])
    fitted = fit_rows(sharding, global_shape[0])
    if jax.process_count() == 1:
        return place_array(value, fitted)
    mine = process_rows(global_shape[0])
    spans = _addressable_rows(fitted, global_shape)
    if min(a for a, _ in spans) != mine.start or max(b for _, b in spans) != mine.stop:
        if fitted is not sharding:
            batch_devices = math.prod(sharding.mesh.shape[a] for a in np.atleast_1d(sharding.spec[0]))
            raise ValueError(f"a batch of {global_shape[0]} rows does not split over the mesh's {batch_devices} "
                             f"batch devices (data x fsdp), and with {jax.process_count()} processes each process "
                             "must hold its own rows: make the batch (data.batch_size; online, its prompts x "
                             f"rollout.num_samples) a multiple of {batch_devices}")
        raise ValueError(f"process {jax.process_index()}'s devices hold rows {sorted(spans)} of a batch of "
                         f"{global_shape[0]}, not its block {mine.start}:{mine.stop}; build the mesh so that each "
                         "process's devices are one contiguous block of the batch axes")
    return jax.make_array_from_callback(global_shape, fitted, lambda index: _take_rows(value, index, mine.start))


def place_rows(value: np.ndarray, mesh) -> jax.Array:
    """This process's rows of a host array placed over ``mesh``'s batch axes
    (:func:`place_local_batch` with :func:`alignax.parallel.sharding.batch_sharding`)."""
    value = np.asarray(value)
    return place_local_batch(value, batch_sharding(mesh, value.ndim))


def _take_rows(value: np.ndarray, index: tuple, offset: int) -> np.ndarray:
    rows = index[0] if index else slice(None)
    start, stop, _ = rows.indices(offset + value.shape[0])
    return value[(slice(start - offset, stop - offset), *index[1:])]


def local_rows(array: jax.Array) -> np.ndarray:
    """This process's rows (:func:`process_rows`) of a global batch array, as NumPy — the
    inverse of :func:`place_local_batch`; the whole array with one process."""
    if jax.process_count() == 1 or array.ndim == 0:  # a 0-d array is replicated: every process has it
        return np.asarray(jax.device_get(array))
    mine = process_rows(array.shape[0])
    pieces: dict[int, np.ndarray] = {}
    for shard in array.addressable_shards:
        rows = shard.index[0] if shard.index else slice(None)
        start, stop, _ = rows.indices(array.shape[0])
        if any(s.indices(n)[:2] != (0, n) for s, n in zip(shard.index[1:], array.shape[1:])):
            raise ValueError(f"local_rows reads arrays sharded over their first axis only; got shard index "
                             f"{shard.index} of shape {array.shape}")
        lo, hi = max(start, mine.start), min(stop, mine.stop)
        if lo < hi and lo not in pieces:
            pieces[lo] = np.asarray(shard.data)[lo - start: hi - start]
    out, at = [], mine.start
    for lo in sorted(pieces):
        if lo != at:
            break
        out.append(pieces[lo])
        at = lo + len(pieces[lo])
    if at != mine.stop:
        raise ValueError(f"process {jax.process_index()} does not hold its rows {mine.start}:{mine.stop} of an "
                         f"array of shape {array.shape}")
    return np.concatenate(out, axis=0)


def host_global(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """Every array of ``tree`` whole, as NumPy, on every process (a collective with
    several processes); for per-row figures, not for per-token batches at scale."""
    if jax.process_count() > 1:
        tree = replicated(tree, mesh)
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)), tree)


# The devices the host collectives of this thread run on (None: every device); see collectives_on
_scope = threading.local()


@contextlib.contextmanager
def collectives_on(devices: Sequence[jax.Device] | None) -> Iterator[None]:
    """Run this thread's host collectives (:func:`allgather_rows`, :func:`all_agree`,
    :func:`process_zero_says`, :func:`barrier`) as programs on ``devices`` only (``None``:
    every device, the default), one device of each process.

    Why: a CPU device runs its programs one after another in the order they were issued. When
    two threads of a process issue programs that are collectives across the processes (an
    asynchronous run's sampler and learner), a program of one thread over *every* device can
    be issued before the other thread's program on some device in one process and after it
    in another; each process then waits for the other and the job hangs. Each thread's
    collectives on its own device group keep every device's programs in one order on every
    process. ``devices`` must include a device of each process."""
    previous = getattr(_scope, "devices", None)
    _scope.devices = None if devices is None else tuple(devices)
    try:
        yield
    finally:
        _scope.devices = previous


def _collective_mesh() -> Mesh | None:
    """A 1-D mesh of one device of each process, from this thread's :func:`collectives_on`
    devices (``None``: every device, jax's own choice)."""
    devices = getattr(_scope, "devices", None)
    if devices is None:
        return None
    first: dict[int, jax.Device] = {}
    for device in sorted(devices, key=lambda d: (d.process_index, d.id)):
        first.setdefault(device.process_index, device)
    if sorted(first) != list(range(jax.process_count())):
        raise ValueError(f"collectives_on: the devices {sorted(d.id for d in devices)} leave out a process "
                         f"(they are processes {sorted(first)} of {jax.process_count()})")
    return Mesh(np.array([first[p] for p in sorted(first)]), ("processes",))


def _gathered(value: np.ndarray) -> np.ndarray:
    """``[P, *value.shape]``: every process's ``value`` (same shape and dtype), in process
    order, on every process: a collective over this thread's devices (:func:`collectives_on`)."""
    mesh = _collective_mesh()
    if mesh is None:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value))
    mine = mesh.devices.flat[jax.process_index()]
    rows = NamedSharding(mesh, jax.sharding.PartitionSpec("processes"))
    shape = (jax.process_count(), *value.shape)
    placed = jax.make_array_from_single_device_arrays(shape, rows, [jax.device_put(value[None], mine)])
    whole = _whole_on(placed, NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return np.asarray(whole.addressable_data(0))


@functools.partial(jax.jit, static_argnums=1)
def _whole_on(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, sharding)


def allgather_rows(value: np.ndarray) -> np.ndarray:
    """This process's host rows concatenated with every other process's, in process order
    (a collective over this thread's devices, :func:`collectives_on`)."""
    value = np.asarray(value)
    if jax.process_count() == 1:
        return value
    return _gathered(value).reshape(-1, *value.shape[1:])


def all_agree(ok: bool) -> bool:
    """True when ``ok`` on every process (a collective with several)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(allgather_rows(np.array([ok], np.int32))))


def process_zero_says(flag: bool) -> bool:
    """Process 0's ``flag`` on every process (a collective with several)."""
    if jax.process_count() == 1:
        return flag
    return bool(allgather_rows(np.array([flag], np.int32))[0])


def barrier(name: str) -> None:
    """Every process waits here until all have come (a collective with several): and they
    came to the same ``name``, else a ``RuntimeError`` naming both."""
    if jax.process_count() == 1:
        return
    code = np.frombuffer(hashlib.sha256(name.encode()).digest()[:8], np.int32)
    codes = _gathered(code)
    if not (codes == code).all():
        raise RuntimeError(f"barrier {name!r}: process {int(np.argmax((codes != code).any(axis=1)))} is at "
                           "another barrier")


def agreed_reasons(raised: Mapping[str, str], names: Sequence[str], *, width: int = 1024) -> dict[str, str]:
    """Every process's ``raised`` (name -> a one-line reason) made one decision: a name
    raised on any process is raised on every process, with the reason of the first process
    (by index) that raised it, cut to ``width`` UTF-8 bytes. ``names``: every name that may
    be raised, the same on every process; the result is in their order. A collective
    (every process calls it at the same point); with one process, ``raised`` in that order."""
    unknown = sorted(set(raised) - set(names))
    if unknown:
        raise ValueError(f"agreed_reasons: {unknown} are not among the names {list(names)}")
    if jax.process_count() == 1:
        return {name: raised[name] for name in names if name in raised}
    table = np.zeros((1, len(names), width + 1), np.uint8)  # [flag, reason bytes...] per name
    for j, name in enumerate(names):
        if name in raised:
            text = raised[name].encode("utf-8")[:width]
            table[0, j, 0] = 1
            table[0, j, 1:1 + len(text)] = np.frombuffer(text, np.uint8)
    every = allgather_rows(table).reshape(-1, len(names), width + 1)  # [processes, names, 1 + width]
    out = {}
    for j, name in enumerate(names):
        first = np.flatnonzero(every[:, j, 0])
        if first.size:
            out[name] = bytes(every[first[0], j, 1:]).rstrip(b"\0").decode("utf-8", errors="ignore")
    return out


def replicated(tree: Any, mesh: jax.sharding.Mesh) -> Any:
    """``tree`` resharded to be whole on every device (so every process can read it);
    every process must call it (a collective)."""
    target = NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.jit(lambda t: t, out_shardings=jax.tree.map(lambda _: target, tree))(tree)
