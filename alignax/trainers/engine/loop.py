"""The host-side training loop shared by every trainer.

It owns what happens between jitted steps: fetching and placing batches, writing
metrics (with step time and tokens/s), periodic evaluation, checkpoints (periodic, final,
and on SIGTERM or SIGINT), resuming, and stopping a run that has gone wrong:

- updates that keep coming out non-finite (:class:`NonFiniteError`; each is skipped);
- updates that keep stalling (:class:`StalledRunError`): a zero gradient with a non-zero
  loss, or loss and gradient norm bit-equal to the previous step's — what a diverged
  model whose logits collapsed produces (a zero loss with a zero gradient, e.g. GRPO
  groups whose rewards all tie, is no signal, not a stall);
- a step that raises on the host (a reward function, a NaN reward): the state from before
  that step is saved first, then the error goes on;
- a checkpoint that cannot be written (:class:`CheckpointSaveError`, e.g. a full disk):
  the run stops at once rather than training on without checkpoints.

No checkpoint is written while a non-finite or stalled streak is running, so keep-N
rotation never removes the last checkpoint saved before it. What a step computes is the
trainer's business (``alignax.trainers.engine.step``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import numpy as np
from jax.experimental import multihost_utils

from alignax.checkpoint import Checkpointer
from alignax.metrics import MetricWriter, to_host
from alignax.trainers.engine.step import StepOutput, TrainState

log = logging.getLogger("alignax")


class RunStoppedError(RuntimeError):
    """A run stopped itself because training went wrong; the message says why and what to do."""


class NonFiniteError(RunStoppedError):
    """Raised when too many updates in a row had a non-finite loss or gradient."""


class StalledRunError(RunStoppedError):
    """Raised when too many updates in a row stalled (see the module docstring)."""


class CheckpointSaveError(RunStoppedError):
    """A checkpoint could not be written; the run stops instead of training on unsaved."""


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
      max_stalled_streak: stop with an error after this many stalled updates in a row (0: off).
      eval_at_start: evaluate before the first step (the baseline of a fresh run).
      shutdown_timeout_s: with several processes, the seconds from a stop signal to the
        process's exit: a process whose save and leave are not done by then (a peer gone,
        a collective that never completes) exits with the signal's status without waiting.
    """

    total_steps: int
    log_every: int = 1
    eval_every: int = 0
    save_every: int = 0
    max_nonfinite_streak: int = 5
    max_stalled_streak: int = 5
    eval_at_start: bool = False
    shutdown_timeout_s: float = 120.0


# Signal names in the order the processes' stop codes rank them (0: none); an allgather
# of the codes gives every process the same answer.
_STOP_CODES = (None, "SIGINT", "SIGTERM")
_EXIT_STATUS = {"SIGINT": 130, "SIGTERM": 143}


class _StopSignals:
    """Turns SIGTERM and the first SIGINT into a flag the loop polls between steps (a step
    is never cut); a second SIGINT interrupts at once (KeyboardInterrupt).

    With several processes a signal often reaches one of them only (a scheduler preempting
    one host). :meth:`agreed` is then a collective at every step boundary: the largest stop
    code of all processes (SIGTERM over SIGINT), so every process leaves the loop after the
    same step and they save together. From that moment a watchdog gives the process
    ``shutdown_timeout_s`` to save and leave the job; past it the process exits at once
    with the signal's status, logging that nothing was saved after the last checkpoint."""

    def __init__(self, shutdown_timeout_s: float = 120.0):
        self.received: str | None = None
        self.shutdown_timeout_s = shutdown_timeout_s
        self._watchdog: threading.Timer | None = None

    def agreed(self) -> str | None:
        """The stop signal received by any process (by this one with a single process)."""
        if jax.process_count() == 1:
            return self.received
        codes = multihost_utils.process_allgather(np.array(_STOP_CODES.index(self.received), np.int32))
        name = _STOP_CODES[int(np.max(codes))]
        if name is not None:
            self._arm_watchdog(name)
        return name

    def _arm_watchdog(self, name: str) -> None:
        if self._watchdog is not None:
            return
        index, count, timeout = jax.process_index(), jax.process_count(), self.shutdown_timeout_s

        def expire():
            log.error("process %d of %d: %s, and the save and shutdown did not end within %g s "
                      "(distributed.shutdown_timeout_s): exiting without waiting for the other processes; "
                      "nothing after the last complete checkpoint is saved", index, count, name, timeout)
            logging.shutdown()
            os._exit(_EXIT_STATUS[name])

        self._watchdog = threading.Timer(timeout, expire)
        self._watchdog.daemon = True  # a process that ends in time is not held by it
        self._watchdog.start()

    @contextlib.contextmanager
    def installed(self):
        previous = {}
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: no signal handling
            pass
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.received == "SIGINT":
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        if jax.process_count() > 1:  # the countdown starts now, even if a peer never reaches the next step
            self._arm_watchdog(self.received)
        if signum == signal.SIGINT:
            log.warning("SIGINT: finishing this step and saving a checkpoint (press Ctrl-C again to abort)")


class StallWatch:
    """Counts stalled updates in a row (see the module docstring)."""

    def __init__(self):
        self.streak = 0
        self.previous: tuple[float, float] | None = None

    def update(self, loss: float, grad_norm: float, skipped: bool) -> int:
        if skipped:
            return self.streak
        zero_signal = loss == 0.0 and grad_norm == 0.0
        stalled = not zero_signal and (grad_norm == 0.0 or (loss, grad_norm) == self.previous)
        self.previous = (loss, grad_norm)
        self.streak = self.streak + 1 if stalled else 0
        return self.streak


@dataclasses.dataclass
class LoopResult:
    state: TrainState
    last_step: int
    stopped_by_signal: bool
    history: list[dict[str, float]]
    eval_history: list[dict[str, float]]
    signal_name: str | None = None  # "SIGTERM" or "SIGINT" when stopped by one


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
    signals = _StopSignals(config.shutdown_timeout_s)
    stall = StallWatch()

    def save(at_step: int, *, force: bool = False, data_state: Any = None) -> None:
        if checkpointer is None or checkpointer.latest_step() == at_step:
            return
        data_state = batches.get_state() if data_state is None else data_state
        meta = dict(meta_fn(), data=data_state, step=at_step)
        try:
            checkpointer.save(at_step, state, meta, force=force)
            checkpointer.check_for_errors()
        except Exception as err:
            raise CheckpointSaveError(f"saving the checkpoint of step {at_step} under {checkpointer.directory} "
                                      f"failed ({type(err).__name__}: {err}); the run stops here rather than "
                                      "train on without checkpoints") from err

    def evaluate(at_step: int) -> None:
        if eval_fn is None:
            return
        figures = {f"eval/{k}": float(v) for k, v in eval_fn(state).items()}
        eval_history.append({"step": at_step, **figures})
        writer.write(at_step, figures)

    def state_intact() -> bool:
        return not any(isinstance(leaf, jax.Array) and leaf.is_deleted() for leaf in jax.tree.leaves(state))

    with signals.installed():
        if config.eval_at_start:
            evaluate(step)
        tick = time.perf_counter()
        tokens_since_log = 0
        steps_since_log = 0
        stop = None
        # with several processes `agreed` is a collective: every process calls it after the same steps
        while step < config.total_steps and (stop := signals.agreed()) is None:
            position = batches.get_state() if checkpointer is not None else None
            host_batch = next(batches)
            if count_tokens is not None:
                tokens_since_log += count_tokens(host_batch)
            try:
                new_state, output = step_fn(state, frozen, place_batch(host_batch))
            except Exception:
                if state_intact():  # the step failed before its update: keep the work so far
                    log.error("step %d failed; saving the checkpoint of step %d first", step + 1, step)
                    save(step, force=True, data_state=position)
                    if checkpointer is not None:
                        checkpointer.wait()
                raise
            state = new_state
            step += 1
            steps_since_log += 1
            streak, loss, grad_norm, skipped = jax.device_get((
                state.nonfinite_streak, output.metrics.get("loss", 0.0), output.metrics.get("grad_norm", 0.0),
                output.metrics.get("update_skipped", 0.0)))
            streak = int(streak)
            if streak:
                log.warning("step %d: non-finite loss or gradient; update skipped (%d in a row)", step, streak)
            if streak >= config.max_nonfinite_streak:
                save(step, force=True)  # the skipped updates left the last good params in the state
                raise NonFiniteError(
                    f"{streak} updates in a row had a non-finite loss or gradient (step {step}); "
                    f"stopping (train.max_nonfinite_streak={config.max_nonfinite_streak}). "
                    "Lower the learning rate or inspect the data of the last batches."
                )
            stalled = stall.update(float(loss), float(grad_norm), bool(skipped))
            if stalled:
                log.warning("step %d: stalled update (loss %.6g, grad_norm %.6g; %d in a row)", step,
                            float(loss), float(grad_norm), stalled)
            if config.max_stalled_streak and stalled >= config.max_stalled_streak:
                kept = checkpointer.latest_step() if checkpointer is not None else None
                raise StalledRunError(
                    f"{stalled} updates in a row stalled (step {step}: loss {float(loss):.6g}, grad_norm "
                    f"{float(grad_norm):.6g}): a zero gradient or a loss frozen at one value means the model has "
                    f"diverged (collapsed logits) or stopped learning; stopping (train.max_stalled_streak="
                    f"{config.max_stalled_streak}). " + (f"The last checkpoint before the stall is step {kept}. "
                                                         if kept is not None else "")
                    + "Lower the learning rate.")
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
            healthy = not streak and not stalled
            if config.save_every and step % config.save_every == 0 and step < config.total_steps and healthy:
                save(step)

        stopped = stop is not None and step < config.total_steps
        if stopped:
            log.warning("%s at step %d: saving a checkpoint before exit%s", stop, step,
                        "" if stop == signals.received else " (received by another process)")
            save(step, force=True)
        else:
            if step > start or eval_fn is not None:
                evaluate(step)
            save(step, force=True)
        if checkpointer is not None:
            try:
                checkpointer.wait()
            except Exception as err:
                raise CheckpointSaveError(f"writing the last checkpoint under {checkpointer.directory} failed "
                                          f"({type(err).__name__}: {err})") from err
    return LoopResult(state=state, last_step=step, stopped_by_signal=stopped, history=history,
                      eval_history=eval_history, signal_name=stop if stopped else None)
