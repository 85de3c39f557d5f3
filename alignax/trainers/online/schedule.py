"""Asynchronous, bounded-staleness rollouts: another schedule of the same ``collect`` and
``learn`` (``rollout.async.max_staleness: k``), never a second trainer.

The collector's two halves (:meth:`Collector.sample`, the sampler's; :meth:`Collector.price`,
the learner's) run on two threads. At rollout ``t`` (the learner holds weights of version
``t``) the schedule

1. copies the weights to the sampler (``Actors.sampling_state``: a compiled copy, and a
   reshard when the sampler has its own ``rollout.mesh``; no host round trip) and queues
   the sampling of rollout ``t + k`` with them on the sampler's thread;
2. takes rollout ``t``'s samples (queued at rollout ``t - k`` with weights of version
   ``t - k``, or of the first version for the first ``k`` rollouts), waiting if they are
   not ready, and prices them with the learner's weights; the update then runs while the
   sampler works on what is queued.

Which weights sample which rollout is fixed by the rollout index, not by thread timing,
so a run is deterministic, staleness is at most ``k`` by construction (and checked: a
sample older than that raises :class:`StaleSampleError` before it is used), ``k = 0`` is
the synchronous loop, and a resumed run repeats an uninterrupted one when the checkpoint
carries the rollouts in flight (:meth:`AsyncSchedule.in_flight_state`: host arrays, JSON).

A sampling that raised (a reward function, a tool) stops the run when the learner comes to
that rollout (every process at the same one) with :class:`SamplerFailedError` naming it; the checkpoint saved on the
way out carries, for each rollout in flight not yet sampled, its prompts and the sampler's
weights it was queued with (a file beside the checkpoints, ``async_in_flight/``), so the
resumed run samples it again from the same weights and repeats the uninterrupted run.

Time-sliced: both threads dispatch to the devices they were given (the sampler's mesh is
``rollout.mesh`` or the training mesh); overlap comes from whatever one side leaves idle
(host decoding, reward code, the other's dispatch). With ``rollout.async.devices`` the
sampler has a device group of its own (``Actors.sampler_mesh``) and the weights move there
device to device. Over several processes every process must start its programs in the same
order: on CPU (XLA's client runs a process's multi-device programs one at a time, in launch
order, across threads) and time-sliced, the schedule samples ``inline`` (each rollout where it
is queued, on the learner's thread); with its own devices on an accelerator each thread's
host collectives run on its own devices (:func:`~alignax.parallel.multihost.collectives_on`)
and work with collectives on every device (Orbax's) waits for an idle sampler thread
(:meth:`AsyncSchedule.drain`); see ``OnlineTrainer.start_schedule`` and docs/async-rollouts.md.
Files beside the checkpoints are named by the step that needs them and removed once no kept
checkpoint is that old (:meth:`AsyncSchedule.clean`).
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import contextlib
import dataclasses
import io
import json
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np

from alignax import paths
from alignax.parallel.multihost import allgather_rows, collectives_on
from alignax.sampling.scored import Groups
from alignax.trainers.online.collect import Collector, RolloutBatch, Sampled


class StaleSampleError(RuntimeError):
    """A rollout's samples are older than ``rollout.async.max_staleness`` versions, or are not
    the rollout the learner is at (a schedule out of step: never trained on)."""


class SamplerFailedError(RuntimeError):
    """The sampler thread raised while sampling a rollout (its cause is ``__cause__``)."""


@dataclasses.dataclass
class Job:
    """A rollout queued on the sampler thread: its ``future`` (a :class:`Sampled`), the
    rollout and policy version it is, its ``prompts`` and the sampler's ``weights`` it was
    queued with (dropped once it is sampled; kept for a failure's checkpoint)."""

    future: Future
    rollout_index: int
    version: int
    prompts: Mapping[str, Any]
    weights: Any

    def result(self) -> Sampled:
        return self.future.result()


class AsyncSchedule:
    """The sampler thread and the rollouts in flight for one run (see the module docstring).
    ``directory``: where a checkpoint's unsampled rollouts keep their weights (``None``:
    nowhere; a checkpoint then cannot carry them)."""

    def __init__(self, collector: Collector, max_staleness: int, *, directory: str | Path | None = None,
                 kept_steps: Callable[[], list[int]] = list, inline: bool = False):
        self.collector, self.max_staleness = collector, max_staleness
        # inline: each rollout is sampled on the learner's thread where it is queued (every
        # program issued from one thread in one order; see OnlineTrainer.start_schedule)
        self.inline = inline
        # local or on an object store (a run's output_dir on a bucket)
        self.directory = None if directory is None else paths.as_path(directory)
        self.kept_steps = kept_steps  # the run's checkpoints on disk: whose files in directory are still needed
        # rollout.async.devices: the sampler thread's collectives and stray programs stay on its devices
        own = collector.actors.sampler_counterpart
        self.sampler_devices = None if own is None else list(own)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="alignax-sampler")
        self.in_flight: collections.deque[Job] = collections.deque()
        self._restored: list[dict[str, Any]] = []  # a checkpoint's rollouts in flight, queued by the first collect
        self._lock = threading.Lock()
        self._sampler_idle_s = 0.0  # since the last rollout: the sampler thread waiting for weights
        self._sampler_free_since: float | None = None
        self._opened = 0  # rollouts queued by a step whose update has not finished (see finish)

    # ------------------------------------------------------------------ the two threads
    def _sample(self, job: Job) -> Sampled:
        with self._lock:
            if self._sampler_free_since is not None:
                self._sampler_idle_s += time.perf_counter() - self._sampler_free_since
            self._sampler_free_since = None
        try:
            with self._on_sampler_devices():
                sampled = self.collector.sample(job.weights, job.prompts, iter(()), rollout_index=job.rollout_index,
                                                version=job.version)
            job.weights = None  # sampled: a checkpoint carries the samples, not the weights
            return sampled
        finally:
            with self._lock:
                self._sampler_free_since = time.perf_counter()

    def _on_sampler_devices(self) -> contextlib.AbstractContextManager:
        """On the sampler thread, with devices of its own: its host collectives
        (:func:`~alignax.parallel.multihost.collectives_on`) and the programs it makes without
        a mesh (a rollout's key) on those devices, never on the learner's."""
        if self.sampler_devices is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(collectives_on(self.sampler_devices))
        stack.enter_context(jax.default_device(next(d for d in self.sampler_devices
                                                    if d.process_index == jax.process_index())))
        return stack

    def _queue(self, weights, prompt_batch: Mapping[str, Any], rollout_index: int, version: int) -> None:
        job = Job(Future(), rollout_index, version, prompt_batch, weights)
        if self.inline:
            try:
                job.future.set_result(self._sample(job))
            except Exception as err:  # noqa: BLE001 - raised where the learner takes this rollout, as threaded
                job.future.set_exception(err)
        else:
            job.future = self.pool.submit(self._sample, job)
        self.in_flight.append(job)

    def _launch(self, state, prompt_batch: Mapping[str, Any], rollout_index: int, version: int) -> None:
        weights = self.collector.actors.sampling_state(state.params)  # dispatched before the update donates
        self._queue(weights, prompt_batch, rollout_index, version)

    def _raise_if_failed(self, job: Job) -> None:
        """:class:`SamplerFailedError` naming ``job``'s rollout when its sampling raised in this
        process or in another (agreed at this rollout, the one every process waits for: the
        processes stop at the same step)."""
        err = job.future.exception()
        if allgather_rows(np.array([err is not None])).any():
            cause = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}" if err else "in another process"
            raise SamplerFailedError(f"rollout {job.rollout_index}: the sampler thread failed (sampling with policy "
                                     f"version {job.version}): {cause}") from err

    def collect(self, state, frozen, prompt_batch: Mapping[str, Any], batches: Iterator) -> RolloutBatch:
        """Rollout ``t``'s batch (``t``: the rollouts ``state`` has learned from), with the
        sampling of rollout ``t + k`` queued from ``state``'s weights first. ``prompt_batch``
        is rollout ``t + k``'s prompts; on the first call (or a resume without rollouts in
        flight) it is rollout ``t``'s and ``batches`` gives rollouts ``t + 1 .. t + k``'s."""
        version, _ = self.collector.rollout_key(state)
        if self._restored:
            self._requeue(state)
        queued = len(self.in_flight)
        if not self.in_flight:
            self._launch(state, prompt_batch, version, version)
            for ahead in range(1, self.max_staleness + 1):
                self._launch(state, next(batches), version + ahead, version)
        else:
            self._launch(state, prompt_batch, version + self.max_staleness, version)
        self._opened = len(self.in_flight) - queued
        t_wait = time.perf_counter()
        concurrent.futures.wait([self.in_flight[0].future])  # taken off the queue by finish, once the update is done
        learner_wait_s = time.perf_counter() - t_wait
        self._raise_if_failed(self.in_flight[0])
        sampled = self.in_flight[0].result()
        staleness = version - sampled.version
        if sampled.rollout_index != version or not 0 <= staleness <= self.max_staleness:
            raise StaleSampleError(
                f"rollout {version}: the samples in flight are rollout {sampled.rollout_index}'s, sampled with "
                f"policy version {sampled.version} (staleness {staleness}); rollout.async.max_staleness is "
                f"{self.max_staleness}")
        batch = self.collector.price(state, frozen, sampled)
        with self._lock:
            sampler_idle_s, self._sampler_idle_s = self._sampler_idle_s, 0.0
        batch.figures.update({"async/staleness": float(staleness), "async/learner_wait_s": learner_wait_s,
                              "async/sampler_wait_s": sampler_idle_s})
        return batch

    def finish(self) -> None:
        """The update of the rollout :meth:`collect` gave is done: off the queue."""
        self.in_flight.popleft()
        self._opened = 0

    # ------------------------------------------------------------------ resume
    def in_flight_state(self) -> list[dict[str, Any]]:
        """The rollouts in flight, JSON-able (waits for them): what a checkpoint carries so
        that the resumed run trains on the same samples. A step that failed before its
        update is saved as not begun (the loop saves the data position before its prompts):
        the rollouts it queued are left out, the one it took stays. A rollout whose sampling
        raised is carried as its prompts and the weights it was queued with (written under
        ``directory``, a file per process), to be sampled again on resume."""
        self.drain()  # and the checkpoint's collectives (Orbax's over every device) then meet an idle sampler
        kept = list(self.in_flight)[: len(self.in_flight) - self._opened]
        if not kept:
            return []
        step = kept[0].rollout_index  # the checkpoint's: the rollout its state learns from next
        self.clean(keep=step)
        saved = []
        for job in kept:
            if job.future.exception() is None:
                saved.append(sampled_to_json(job.result()))
            else:
                saved.append(self._unsampled_to_json(job, step))
        if jax.process_count() == 1:
            return saved
        # each process's rows are its own: a file per process, the checkpoint's meta names it
        name = f"step_{step}.in_flight"
        paths.write_text(self._directory(kept[0]) / f"{name}.process_{jax.process_index()}.json", json.dumps(saved))
        return [{"per_process": name}]

    def clean(self, *, keep: int | None = None) -> None:
        """Remove this process's files under ``directory`` that no checkpoint on disk needs:
        those written for a step older than the oldest checkpoint kept (``keep``: a step being
        saved now, whose files stay). A resumed run's unsampled rollouts' weights thus go once
        the checkpoint it resumed from is no longer kept (a newer checkpoint carries them as
        samples). Nothing goes while no checkpoint is on disk; a save still being committed
        is newer than every kept one, so its files stay."""
        if self.directory is None or not self.directory.is_dir():
            return
        steps = [*self.kept_steps(), *([] if keep is None else [keep])]
        if not steps:
            return
        oldest, process = min(steps), jax.process_index()
        for path in self.directory.iterdir():
            # this process's files, and what a write killed midway left (``...npz.tmp-PID-THREAD``)
            match = re.fullmatch(r"step_(\d+)\..*\.process_(\d+)\.(npz|json)(\.tmp-[\d-]+)?", path.name)
            if match and int(match.group(1)) < oldest and int(match.group(2)) == process:
                path.unlink(missing_ok=True)
        if not any(self.directory.iterdir()):
            self.directory.rmdir()

    def _directory(self, job: Job) -> Path:
        if self.directory is None:
            raise SamplerFailedError(f"rollout {job.rollout_index} is in flight and this schedule has no directory "
                                     "for what a checkpoint carries beside its meta")
        self.directory.mkdir(parents=True, exist_ok=True)
        return self.directory

    def _unsampled_to_json(self, job: Job, step: int) -> dict[str, Any]:
        name = f"step_{step}.version_{job.version}.process_{jax.process_index()}.npz"  # each process its own shards
        write_weights(self._directory(job) / name, job.weights)
        return {"unsampled": True, "rollout_index": job.rollout_index, "version": job.version,
                "prompts": {k: _value_json(v) for k, v in job.prompts.items()}, "weights": name}

    def set_in_flight(self, saved: list[dict[str, Any]]) -> None:
        """Rollouts in flight from :meth:`in_flight_state`: sampled ones as finished work;
        unsampled ones are queued again, with their saved weights, by the next :meth:`collect`
        (the weights' layout is the sampler's, known from the state)."""
        self.in_flight.clear()
        if saved and "per_process" in saved[0]:
            saved = json.loads((self.directory / f"{saved[0]['per_process']}.process_{jax.process_index()}.json")
                               .read_text())
        self._restored = list(saved)

    def _requeue(self, state) -> None:
        """The restored rollouts in flight, in order: done, or queued with their saved weights."""
        template = None
        for item in self._restored:
            if not item.get("unsampled"):
                job = Job(Future(), int(item["rollout_index"]), int(item["version"]), {}, None)
                job.future.set_result(sampled_from_json(item))
                self.in_flight.append(job)
                continue
            if template is None:
                template = self.collector.actors.sampling_state(state.params)
            weights = read_weights(self.directory / item["weights"], template)
            prompts = {k: _json_value(v) for k, v in item["prompts"].items()}
            self._queue(weights, prompts, int(item["rollout_index"]), int(item["version"]))
        self._restored = []

    def drain(self) -> None:
        """Wait until the sampler thread has finished what is queued (a program of another
        thread on the sampler's devices then runs in the same order in every process)."""
        concurrent.futures.wait([job.future for job in self.in_flight])

    def close(self) -> None:
        """Stop the sampler thread (rollouts still queued past the run's end are dropped), and
        :meth:`clean` after the run's last checkpoint."""
        for job in self.in_flight:
            job.future.cancel()
        self.pool.shutdown(wait=True)
        self.in_flight.clear()
        self.clean()


# ---------------------------------------------------------------------- the sampler's weights <-> a file
def _slices(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[list[int]]:
    return [[sl.start or 0, dim if sl.stop is None else sl.stop] for sl, dim in zip(index, shape)]


def write_weights(path: Path, weights: Any) -> None:
    """This process's shards of ``weights``' arrays as raw bytes in one ``.npz`` (any dtype,
    bfloat16 included: each shard viewed as unsigned integers of its width), with each
    shard's place in its array and its dtype's name: every process writes its own file."""
    shards, index = {}, []
    for i, x in enumerate(jax.tree.leaves(weights)):
        placed = {}
        for shard in x.addressable_shards:
            key = json.dumps(_slices(shard.index, x.shape))
            if key not in placed:  # a replicated shard once
                data = np.asarray(shard.data)
                placed[key] = f"leaf_{i}_{len(placed)}"
                shards[placed[key]] = data.view(f"u{data.dtype.itemsize}")
        index.append({"dtype": str(x.dtype), "shards": placed})
    path = paths.as_path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with paths.writing(path) as f:  # whole or not at all: a checkpoint names it
        np.savez(f, index=np.frombuffer(json.dumps(index).encode(), np.uint8), **shards)


def read_weights(path: Path, template: Any) -> Any:
    """:func:`write_weights`' arrays, bit for bit, placed as ``template``'s (same tree, shapes
    and shardings: the sampler's weights of the resumed run)."""
    like, treedef = jax.tree.flatten(template)
    with paths.as_path(path).open("rb") as f, np.load(f, allow_pickle=False) as saved:
        index = json.loads(saved["index"].tobytes())
        if len(index) != len(like):
            raise ValueError(f"{path} holds {len(index)} arrays; the sampler's weights have {len(like)}")
        leaves = []
        for x, entry in zip(like, index):
            dtype = jax.numpy.dtype(entry["dtype"])
            where = x.sharding.addressable_devices_indices_map(x.shape)
            parts = [jax.device_put(saved[entry["shards"][json.dumps(_slices(i, x.shape))]].view(dtype), d)
                     for d, i in where.items()]
            leaves.append(jax.make_array_from_single_device_arrays(x.shape, x.sharding, parts))
    return jax.tree.unflatten(treedef, leaves)


# ---------------------------------------------------------------------- host arrays <-> JSON
def _value_json(value: Any) -> dict[str, Any]:
    """A prompt batch's field as JSON: arrays exactly (:func:`_array_text`), tuples kept apart."""
    if isinstance(value, np.ndarray):
        return {"npy": _array_text(value)}
    return {"tuple" if isinstance(value, tuple) else "json": list(value) if isinstance(value, tuple) else value}


def _json_value(item: Mapping[str, Any]) -> Any:
    """The inverse of :func:`_value_json`."""
    if "npy" in item:
        return _text_array(item["npy"])
    return tuple(item["tuple"]) if "tuple" in item else item["json"]


def _array_text(a: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(a), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _text_array(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


_GROUP_ARRAYS = ("prompt_tokens", "prompt_mask", "tokens", "response_mask", "sampler_logps", "stopped", "rewards")


def sampled_to_json(sampled: Sampled) -> dict[str, Any]:
    """``sampled`` as JSON: arrays as base64 ``.npy`` bytes (exact: dtypes and bits kept)."""
    g = sampled.groups
    groups = {name: _array_text(getattr(g, name)) for name in _GROUP_ARRAYS}
    groups.update(references=list(g.references), completions=list(g.completions),
                  components={k: _array_text(v) for k, v in g.components.items()},
                  trajectory={k: _array_text(v) for k, v in g.trajectory.items()},
                  action_mask=None if g.action_mask is None else _array_text(g.action_mask))
    return {"groups": groups, "baseline": _array_text(sampled.baseline), "figures": dict(sampled.figures),
            "rollout_index": sampled.rollout_index, "version": sampled.version}


def sampled_from_json(item: Mapping[str, Any]) -> Sampled:
    """The inverse of :func:`sampled_to_json`."""
    g = item["groups"]
    groups = Groups(**{name: _text_array(g[name]) for name in _GROUP_ARRAYS},
                    references=list(g["references"]), completions=list(g["completions"]),
                    components={k: _text_array(v) for k, v in g["components"].items()},
                    trajectory={k: _text_array(v) for k, v in g["trajectory"].items()},
                    action_mask=None if g["action_mask"] is None else _text_array(g["action_mask"]))
    return Sampled(groups=groups, baseline=_text_array(item["baseline"]), figures=dict(item["figures"]),
                   rollout_index=int(item["rollout_index"]), version=int(item["version"]))
