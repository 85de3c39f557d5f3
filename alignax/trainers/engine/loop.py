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
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import numpy as np

from alignax.checkpoint import Checkpointer, CheckpointWriteError
from alignax.metrics import MetricWriter, to_host
from alignax.parallel import multihost
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


def _recv_or_empty(sock: socket.socket) -> bytes:
    """The next bytes on ``sock``, or ``b""`` once it is shut down."""
    try:
        return sock.recv(64)
    except OSError:
        return b""


class _StopSignals:
    """Turns SIGTERM and the first SIGINT into a flag the loop polls between steps (a step
    is never cut); a second SIGINT interrupts at once (KeyboardInterrupt).

    With several processes a signal often reaches one of them only (a scheduler preempting
    one host). :meth:`agreed` is then a collective at every step boundary: the largest stop
    code of all processes (SIGTERM over SIGINT), so every process leaves the loop after the
    same step and they save together. From the signal (or from learning of it) a watchdog
    gives the process ``shutdown_timeout_s`` to save and leave the job; past it, or when
    the other processes cannot be reached, the process exits at once with the signal's
    status, logging that nothing was saved after the last complete checkpoint."""

    def __init__(self, shutdown_timeout_s: float = 120.0):
        self.received: str | None = None
        self.shutdown_timeout_s = shutdown_timeout_s
        self._watchdog: threading.Timer | None = None
        self._arming = threading.Lock()

    def agreed(self) -> str | None:
        """The stop signal received by any process (by this one with a single process)."""
        if jax.process_count() == 1:
            return self.received
        try:
            codes = multihost.allgather_rows(np.array([_STOP_CODES.index(self.received)], np.int32))
        except Exception as err:
            if self.received is None:
                raise
            self.exit(f"{self.received}, and the other processes could not be reached to save together "
                      f"({type(err).__name__}: {' '.join(str(err).split())[:300]})")
        name = _STOP_CODES[int(np.max(codes))]
        if name is not None:
            self._arm_watchdog(name)
        return name

    def exit(self, why: str, name: str | None = None) -> None:
        """End this process now with the stop signal's status: a job member told to stop
        that cannot stop together with the others (the main thread may be stuck in a
        collective, so no exception would reach the CLI)."""
        log.error("process %d of %d: %s: exiting without waiting for the other processes; nothing after the last "
                  "complete checkpoint is saved", jax.process_index(), jax.process_count(), why)
        logging.shutdown()
        os._exit(_EXIT_STATUS[name or self.received or "SIGTERM"])

    def _arm_watchdog(self, name: str) -> None:
        with self._arming:  # the handler and the signal-watch thread may both arm it
            if self._watchdog is not None:
                return
            self._start_watchdog(name)

    def _start_watchdog(self, name: str) -> None:
        timeout = self.shutdown_timeout_s

        def expire():
            self.exit(f"{name}, and the save and shutdown did not end within {timeout:g} s "
                      "(distributed.shutdown_timeout_s)", name)

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
        watcher = self._watch_while_blocked() if previous and jax.process_count() > 1 else contextlib.nullcontext()
        try:
            with watcher:
                yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @contextlib.contextmanager
    def _watch_while_blocked(self):
        """Arm the watchdog from a thread of its own. A Python handler runs only when the
        main thread next runs Python: while it waits in a collective for a peer that is frozen
        (its sockets open, so the collective never fails) it never does, and jax's heartbeat
        check would abort the process natively 100 s later. The C-level handler writes each
        signal's number to the wakeup fd from whichever thread it interrupts, so this thread
        learns of the signal at once."""
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        previous_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

        def watch():
            while data := _recv_or_empty(reader):
                for signum in data:
                    if signum in (signal.SIGTERM, signal.SIGINT):
                        self._arm_watchdog(signal.Signals(signum).name)

        thread = threading.Thread(target=watch, name="alignax-signal-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            signal.set_wakeup_fd(previous_fd)
            with contextlib.suppress(OSError):
                reader.shutdown(socket.SHUT_RDWR)
            writer.close()
            thread.join(timeout=5)
            reader.close()

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
    guard: Callable[[int, TrainState, dict[str, Any]], TrainState] | None = None,
) -> LoopResult:
    """Train from step ``progress(state)`` to ``config.total_steps``.

    ``step_fn`` is the jitted step (or, for online RL, a whole rollout step);
    ``place_batch`` puts a host batch on the mesh; ``meta_fn`` returns the JSON-able
    extras saved with each checkpoint (config, data counts); the data iterator's state is
    saved beside them under ``"data"``. ``count_tokens`` counts a host batch's tokens for
    ``perf/tokens_per_s`` (``None``: the step reports its own throughput).
    ``progress`` reads the loop's step count from the state (optimiser updates by default).
    ``guard(step, state, metrics) -> state`` acts on each step's alarms before it is logged
    (:class:`alignax.trainers.online.guard.Guard`): it may add figures to ``metrics``, return
    another state to go on from (a rollback), or raise :class:`RunStoppedError`, which saves
    the step's checkpoint first.
    """
    run = _Run(config, state, frozen, step_fn, batches, place_batch, writer, checkpointer, meta_fn, eval_fn,
               count_tokens, int(jax.device_get(progress(state))))
    run.guard = guard
    with run.signals.installed():
        return run.train()


class _Run:
    """One call of :func:`run_loop`: the loop's state between steps and what it does at each."""

    def __init__(self, config, state, frozen, step_fn, batches, place_batch, writer, checkpointer, meta_fn, eval_fn,
                 count_tokens, start):
        self.config, self.state, self.frozen, self.step_fn = config, state, frozen, step_fn
        self.batches, self.place_batch, self.writer, self.checkpointer = batches, place_batch, writer, checkpointer
        self.meta_fn, self.eval_fn, self.count_tokens = meta_fn, eval_fn, count_tokens
        self.start = self.step = start
        self.history: list[dict[str, float]] = []
        self.eval_history: list[dict[str, float]] = []
        self.signals = _StopSignals(config.shutdown_timeout_s)
        self.stall = StallWatch()
        self.guard = None  # set by run_loop
        self.tick, self.tokens_since_log, self.steps_since_log = time.perf_counter(), 0, 0

    def train(self) -> LoopResult:
        try:
            return self._train()
        except Exception as err:
            if self.signals.received is None or jax.process_count() == 1:
                raise
            # told to stop, and a collective failed under it (a peer is gone): no exception can
            # save with the others any more, and the job's leave() would wait for them
            self.signals.exit(f"{self.signals.received}, and the run failed before it could save with the other "
                              f"processes ({type(err).__name__}: {' '.join(str(err).split())[:300]})")
            raise

    def _train(self) -> LoopResult:
        config, stop = self.config, None
        if config.eval_at_start:
            self.evaluate()
        self.tick = time.perf_counter()
        # with several processes `agreed` is a collective: every process calls it after the same steps
        while self.step < config.total_steps and (stop := self.signals.agreed()) is None:
            output = self.advance()
            healthy = self.check_health(output)
            self.apply_guard(output)
            self.log(output)
            if config.eval_every and self.step % config.eval_every == 0 and self.step < config.total_steps:
                self.evaluate()
            if (config.save_every and self.step % config.save_every == 0 and self.step < config.total_steps
                    and healthy):
                self.save()
        stopped = stop is not None and self.step < config.total_steps
        if stopped:
            log.warning("%s at step %d: saving a checkpoint before exit%s", stop, self.step,
                        "" if stop == self.signals.received else " (received by another process)")
            if hasattr(self.writer, "record_outcome"):
                self.writer.record_outcome("killed")
        elif self.step > self.start or self.eval_fn is not None:
            self.evaluate()
        self.save(force=True)
        self.wait_for_saves()
        return LoopResult(state=self.state, last_step=self.step, stopped_by_signal=stopped, history=self.history,
                          eval_history=self.eval_history, signal_name=stop if stopped else None)

    def advance(self) -> StepOutput:
        """One step: the next batch through ``step_fn``. A step that raises before its
        update saves the state from before it first (its batch is read again on resume)."""
        position = self.batches.get_state() if self.checkpointer is not None else None
        host_batch = next(self.batches)
        if self.count_tokens is not None:
            self.tokens_since_log += self.count_tokens(host_batch)
        try:
            new_state, output = self.step_fn(self.state, self.frozen, self.place_batch(host_batch))
        except Exception:
            if self.state_intact():  # the step failed before its update: keep the work so far
                log.error("step %d failed; saving the checkpoint of step %d first", self.step + 1, self.step)
                self.save(force=True, data_state=position)
                self.wait_for_saves()
            raise
        self.state = new_state
        self.step += 1
        self.steps_since_log += 1
        self.poll_saves()
        return output

    def apply_guard(self, output: StepOutput) -> None:
        """The guard's actions on this step (see :func:`run_loop`); a stop logs the step and
        saves its checkpoint before it goes on."""
        if self.guard is None:
            return
        try:
            self.state = self.guard(self.step, self.state, output.metrics)
        except RunStoppedError:
            self.log(output)
            self.save(force=True)
            self.wait_for_saves()
            raise

    def state_intact(self) -> bool:
        return not any(isinstance(leaf, jax.Array) and leaf.is_deleted() for leaf in jax.tree.leaves(self.state))

    def check_health(self, output: StepOutput) -> bool:
        """Count non-finite and stalled updates, stopping the run past their limits;
        whether this step's update was a healthy one (only those are saved)."""
        config, step = self.config, self.step
        streak, loss, grad_norm, skipped = jax.device_get((
            self.state.nonfinite_streak, output.metrics.get("loss", 0.0), output.metrics.get("grad_norm", 0.0),
            output.metrics.get("update_skipped", 0.0)))
        streak, loss, grad_norm = int(streak), float(loss), float(grad_norm)
        if streak:
            log.warning("step %d: non-finite loss or gradient; update skipped (%d in a row)", step, streak)
        if streak >= config.max_nonfinite_streak:
            self.save(force=True)  # the skipped updates left the last good params in the state
            raise NonFiniteError(
                f"{streak} updates in a row had a non-finite loss or gradient (step {step}); "
                f"stopping (train.max_nonfinite_streak={config.max_nonfinite_streak}). "
                "Lower the learning rate or inspect the data of the last batches.")
        stalled = self.stall.update(loss, grad_norm, bool(skipped))
        if stalled:
            log.warning("step %d: stalled update (loss %.6g, grad_norm %.6g; %d in a row)", step, loss, grad_norm,
                        stalled)
        if config.max_stalled_streak and stalled >= config.max_stalled_streak:
            kept = self.checkpointer.latest_step() if self.checkpointer is not None else None
            raise StalledRunError(
                f"{stalled} updates in a row stalled (step {step}: loss {loss:.6g}, grad_norm {grad_norm:.6g}): a "
                "zero gradient or a loss frozen at one value means the model has diverged (collapsed logits) or "
                f"stopped learning; stopping (train.max_stalled_streak={config.max_stalled_streak}). "
                + (f"The last checkpoint before the stall is step {kept}. " if kept is not None else "")
                + "Lower the learning rate.")
        return not streak and not stalled

    def log(self, output: StepOutput) -> None:
        step = self.step
        if step % self.config.log_every and step != self.config.total_steps:
            return
        figures = to_host(output.metrics)
        elapsed = time.perf_counter() - self.tick
        figures.setdefault("perf/step_time_s", elapsed / self.steps_since_log)
        if self.count_tokens is not None:
            figures["perf/tokens_per_s"] = self.tokens_since_log / elapsed if elapsed > 0 else 0.0
        figures["nonfinite_total"] = float(jax.device_get(self.state.nonfinite_total))
        self.history.append({"step": step, **figures})
        self.writer.write(step, figures)
        self.tick, self.tokens_since_log, self.steps_since_log = time.perf_counter(), 0, 0

    def evaluate(self) -> None:
        if self.eval_fn is None:
            return
        figures = {f"eval/{k}": float(v) for k, v in self.eval_fn(self.state).items()}
        self.eval_history.append({"step": self.step, **figures})
        self.writer.write(self.step, figures)

    def save(self, *, force: bool = False, data_state: Any = None) -> None:
        checkpointer, at_step = self.checkpointer, self.step
        if checkpointer is None or checkpointer.latest_step() == at_step:
            return
        data_state = self.batches.get_state() if data_state is None else data_state
        meta = dict(self.meta_fn(), data=data_state, step=at_step)
        try:
            checkpointer.save(at_step, self.state, meta, force=force)
            checkpointer.check_for_errors()
        except Exception as err:
            raise self.save_failed(err) from err

    def poll_saves(self) -> None:
        """A save writing in the background that has failed stops the run at this step."""
        if self.checkpointer is not None:
            try:
                self.checkpointer.check_for_errors()
            except Exception as err:
                raise self.save_failed(err) from err

    def wait_for_saves(self) -> None:
        if self.checkpointer is not None:
            try:
                self.checkpointer.wait()
            except Exception as err:
                raise self.save_failed(err) from err

    def save_failed(self, err: Exception) -> CheckpointSaveError:
        """The one-line error of a failed save: which step, where, why, and what is kept."""
        checkpointer = self.checkpointer
        what = (str(err) if isinstance(err, CheckpointWriteError)
                else f"saving checkpoint step {self.step} under {checkpointer.directory} failed "
                     f"({type(err).__name__}: {err})")
        kept = [s for s in checkpointer.all_steps() if s != getattr(err, "step", None)]
        last = (f"the last complete checkpoint is step {kept[-1]} ({checkpointer.step_path(kept[-1])})" if kept
                else "no complete checkpoint is kept")
        return CheckpointSaveError(f"{what}; the run stops at step {self.step} rather than train on without "
                                   f"checkpoints; {last}")
