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

Time-sliced: both threads dispatch to the devices they were given (the sampler's mesh is
``rollout.mesh`` or the training mesh); overlap comes from whatever one side leaves idle
(host decoding, reward code, the other's dispatch). One process only: the sampler thread's
collectives would have to be ordered against the learner's across processes.
"""

from __future__ import annotations

import base64
import collections
import io
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from alignax.sampling.scored import Groups
from alignax.trainers.online.collect import Collector, RolloutBatch, Sampled


class StaleSampleError(RuntimeError):
    """A rollout's samples are older than ``rollout.async.max_staleness`` versions, or are not
    the rollout the learner is at (a schedule out of step: never trained on)."""


class AsyncSchedule:
    """The sampler thread and the rollouts in flight for one run (see the module docstring)."""

    def __init__(self, collector: Collector, max_staleness: int):
        self.collector, self.max_staleness = collector, max_staleness
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="alignax-sampler")
        self.in_flight: collections.deque[Future] = collections.deque()
        self._lock = threading.Lock()
        self._sampler_idle_s = 0.0  # since the last rollout: the sampler thread waiting for weights
        self._sampler_free_since: float | None = None
        self._opened = 0  # rollouts queued by a step whose update has not finished (see finish)

    # ------------------------------------------------------------------ the two threads
    def _sample(self, weights, prompt_batch, rollout_index: int, version: int) -> Sampled:
        with self._lock:
            if self._sampler_free_since is not None:
                self._sampler_idle_s += time.perf_counter() - self._sampler_free_since
            self._sampler_free_since = None
        try:
            return self.collector.sample(weights, prompt_batch, iter(()), rollout_index=rollout_index,
                                         version=version)
        finally:
            with self._lock:
                self._sampler_free_since = time.perf_counter()

    def _launch(self, state, prompt_batch: Mapping[str, Any], rollout_index: int, version: int) -> None:
        weights = self.collector.actors.sampling_state(state.params)  # dispatched before the update donates
        self.in_flight.append(self.pool.submit(self._sample, weights, prompt_batch, rollout_index, version))

    def collect(self, state, frozen, prompt_batch: Mapping[str, Any], batches: Iterator) -> RolloutBatch:
        """Rollout ``t``'s batch (``t``: the rollouts ``state`` has learned from), with the
        sampling of rollout ``t + k`` queued from ``state``'s weights first. ``prompt_batch``
        is rollout ``t + k``'s prompts; on the first call (or a resume without rollouts in
        flight) it is rollout ``t``'s and ``batches`` gives rollouts ``t + 1 .. t + k``'s."""
        version, _ = self.collector.rollout_key(state)
        queued = len(self.in_flight)
        if not self.in_flight:
            self._launch(state, prompt_batch, version, version)
            for ahead in range(1, self.max_staleness + 1):
                self._launch(state, next(batches), version + ahead, version)
        else:
            self._launch(state, prompt_batch, version + self.max_staleness, version)
        self._opened = len(self.in_flight) - queued
        t_wait = time.perf_counter()
        sampled = self.in_flight[0].result()  # taken off the queue by finish, once the update is done
        learner_wait_s = time.perf_counter() - t_wait
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
        raised, and those after it, are left out (the resumed run samples again from the
        next prompts: not the uninterrupted run)."""
        kept = list(self.in_flight)[: len(self.in_flight) - self._opened]
        saved = []
        for future in kept:
            if future.exception() is not None:
                break
            saved.append(sampled_to_json(future.result()))
        return saved

    def set_in_flight(self, saved: list[dict[str, Any]]) -> None:
        """Rollouts in flight from :meth:`in_flight_state`, as finished work."""
        self.in_flight.clear()
        for item in saved:
            done: Future = Future()
            done.set_result(sampled_from_json(item))
            self.in_flight.append(done)

    def close(self) -> None:
        """Stop the sampler thread (rollouts still queued past the run's end are dropped)."""
        for future in self.in_flight:
            future.cancel()
        self.pool.shutdown(wait=True)
        self.in_flight.clear()


# ---------------------------------------------------------------------- host arrays <-> JSON
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
