"""The host-side training loop shared by every trainer.

It owns what happens between jitted steps: fetching and placing batches, writing
metrics (with step time and tokens/s), periodic evaluation, checkpoints (periodic, final,
and on SIGTERM), resuming, and stopping a run whose updates keep coming out non-finite.
What a step computes is the trainer's business (``alignax.trainers.engine.step``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import signal
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import numpy as np

from alignax.checkpoint import Checkpointer
from alignax.metrics import MetricWriter, to_host
from alignax.trainers.engine.step import StepOutput, TrainState

log = logging.getLogger("alignax")


class NonFiniteError(RuntimeError):
    """Raised when too many updates in a row had a non-finite loss or gradient."""


class BatchIterator(Protocol):
    """What the loop needs from a data pipeline: batches, and a JSON-able position."""

    def __next__(self) -> Mapping[str, np.ndarray]: ...

    def get_state(self) -> Any: ...

    def set_state(self, state: Any) -> None: ...


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """How long to train and how often to log, evaluate and save.

    Fields:
      total_steps: optimiser steps of the whole run (resumed runs count from 0).
      log_every: write metrics every N steps (console, JSONL, TensorBoard).
      eval_every: run the evaluation every N steps (0: only at the end).
      save_every: checkpoint every N steps (0: only at the end and on SIGTERM).
      max_nonfinite_streak: stop with an error after this many skipped updates in a row.
      eval_at_start: evaluate before the first step (the baseline of a fresh run).
    """

    total_steps: int
    log_every: int = 1
    eval_every: int = 0
    save_every: int = 0
    max_nonfinite_streak: int = 5
    eval_at_start: bool = False


class _SigtermFlag:
    """Turns SIGTERM into a flag the loop polls between steps (a step is never cut)."""

    def __init__(self):
        self.raised = False

    @contextlib.contextmanager
    def installed(self):
        try:
            previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: no signal handling, nothing to restore
            yield self
            return
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _handle(self, signum, frame):
        del signum, frame
        self.raised = True


@dataclasses.dataclass
class LoopResult:
    state: TrainState
    last_step: int
    stopped_by_signal: bool
    history: list[dict[str, float]]
    eval_history: list[dict[str, float]]


def count_tokens(batch: Mapping[str, np.ndarray]) -> int:
    """Real (non-padding) tokens in a batch: the sum of every ``*attention_mask`` field."""
    return int(sum(np.sum(v) for k, v in batch.items() if k.endswith("attention_mask")))


def run_loop(
    *,
    config: LoopConfig,
    state: TrainState,
    frozen: Any,
    step_fn: Callable[[TrainState, Any, Any], tuple[TrainState, StepOutput]],
    batches: BatchIterator,
    place_batch: Callable[[Mapping[str, np.ndarray]], Any],
    writer: MetricWriter,
    checkpointer: Checkpointer | None = None,
    meta_fn: Callable[[], dict[str, Any]] = dict,
    eval_fn: Callable[[TrainState], dict[str, float]] | None = None,
    count_tokens: Callable[[Mapping[str, np.ndarray]], int] | None = count_tokens,
    progress: Callable[[TrainState], Any] = lambda state: state.step,
) -> LoopResult:
    """Train from step ``progress(state)`` to ``config.total_steps``.

    ``step_fn`` is the jitted step (or, for online RL, a whole rollout step);
    ``place_batch`` puts a host batch on the mesh; ``meta_fn`` returns the JSON-able
    extras saved with each checkpoint (config, data counts); the data iterator's state is
    saved beside them under ``"data"``. ``count_tokens`` counts a host batch's tokens for
    ``perf/tokens_per_s`` (``None``: the step reports its own throughput).
    ``progress`` reads the loop's step count from the state (optimiser updates by default).
    """
    history: list[dict[str, float]] = []
    eval_history: list[dict[str, float]] = []
    start = int(jax.device_get(progress(state)))
    step = start
    sigterm = _SigtermFlag()

    def save(at_step: int, *, force: bool = False) -> None:
        if checkpointer is None or checkpointer.latest_step() == at_step:
            return
        meta = dict(meta_fn(), data=batches.get_state(), step=at_step)
        checkpointer.save(at_step, state, meta, force=force)

    def evaluate(at_step: int) -> None:
        if eval_fn is None:
            return
        figures = {f"eval/{k}": float(v) for k, v in eval_fn(state).items()}
        eval_history.append({"step": at_step, **figures})
        writer.write(at_step, figures)

    with sigterm.installed():
        if config.eval_at_start:
            evaluate(step)
        tick = time.perf_counter()
        tokens_since_log = 0
        steps_since_log = 0
        while step < config.total_steps and not sigterm.raised:
            host_batch = next(batches)
            if count_tokens is not None:
                tokens_since_log += count_tokens(host_batch)
            state, output = step_fn(state, frozen, place_batch(host_batch))
            step += 1
            steps_since_log += 1
            streak = int(jax.device_get(state.nonfinite_streak))
            if streak:
                log.warning("step %d: non-finite loss or gradient; update skipped (%d in a row)", step, streak)
            if streak >= config.max_nonfinite_streak:
                save(step, force=True)
                raise NonFiniteError(
                    f"{streak} updates in a row had a non-finite loss or gradient (step {step}); "
                    f"stopping (train.max_nonfinite_streak={config.max_nonfinite_streak}). "
                    "Lower the learning rate or inspect the data of the last batches."
                )
            if step % config.log_every == 0 or step == config.total_steps:
                figures = to_host(output.metrics)
                elapsed = time.perf_counter() - tick
                figures.setdefault("perf/step_time_s", elapsed / steps_since_log)
                if count_tokens is not None:
                    figures["perf/tokens_per_s"] = tokens_since_log / elapsed if elapsed > 0 else 0.0
                figures["nonfinite_total"] = float(jax.device_get(state.nonfinite_total))
                history.append({"step": step, **figures})
                writer.write(step, figures)
                tick, tokens_since_log, steps_since_log = time.perf_counter(), 0, 0
            if config.eval_every and step % config.eval_every == 0 and step < config.total_steps:
                evaluate(step)
            if config.save_every and step % config.save_every == 0 and step < config.total_steps:
                save(step)

        stopped = sigterm.raised and step < config.total_steps
        if stopped:
            log.warning("SIGTERM at step %d: saving a checkpoint before exit", step)
            save(step, force=True)
        else:
            if step > start or eval_fn is not None:
                evaluate(step)
            save(step, force=True)
        if checkpointer is not None:
            checkpointer.wait()
    return LoopResult(state=state, last_step=step, stopped_by_signal=stopped, history=history,
                      eval_history=eval_history)
