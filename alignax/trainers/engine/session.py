"""A run session: what every training run does around its steps, whatever the algorithm.

It owns the output directory (claimed with :func:`alignax.trainers.engine.rundir.claim`:
one run at a time, no earlier run lost or mixed, config changes on resume named), the
resolved config written there once the run is accepted, the metric writers, the
checkpointer (resume, the frozen reference saved once), and the host loop
(:func:`alignax.trainers.engine.loop.run_loop`: logging, eval, periodic and final saves,
SIGTERM). A trainer builds its state, frozen inputs and step function, and hands them to
:meth:`Session.run`; the offline and the online trainers both do, and so do the benchmarks.

Output directory layout::

    <output_dir>/config.yaml          the resolved config of the run (config.<n>.yaml: earlier ones)
    <output_dir>/.alignax.lock        held while a run trains (host, pid)
    <output_dir>/metrics.jsonl        one line per logged step (and eval)
    <output_dir>/tensorboard/         TensorBoard event files
    <output_dir>/checkpoints/         Orbax checkpoints (see alignax.checkpoint)
    <output_dir>/evaluation/          one JSON report per evaluation (``evaluation.report``)
    <output_dir>/export/              Hugging Face safetensors + tokenizer (``alignax export``)

``output_dir`` may be an object-store URI (``gs://bucket/run``); every file above is then
written there through ``etils.epath`` (see :mod:`alignax.paths` for what differs).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx

from alignax import config as config_io
from alignax.checkpoint import Checkpointer
from alignax.evaluation import report_path, write_report
from alignax.metrics import ConsoleWriter, JsonlWriter, MultiWriter, TensorBoardWriter
from alignax.trackers import tracker_writers
from alignax.trainers.config import TrainConfig
from alignax.trainers.engine import rundir
from alignax.trainers.engine.loop import BatchIterator, LoopConfig, LoopResult, count_tokens, run_loop
from alignax.parallel.multihost import is_writer
from alignax.parallel.sharding import tree_shardings
from alignax.trainers.engine.step import TrainState, init_train_state

log = logging.getLogger("alignax")


@dataclasses.dataclass
class TrainResult:
    """What a finished (or stopped) run leaves in memory besides its files."""

    config: TrainConfig
    model: nnx.Module  # the trained policy (or reward model), params merged back
    tokenizer: Any
    loop: LoopResult
    data_stats: dict[str, int]

    @property
    def history(self) -> list[dict[str, float]]:
        return self.loop.history

    @property
    def eval_history(self) -> list[dict[str, float]]:
        return self.loop.eval_history


def checkpoint_dir(config: TrainConfig) -> str:
    return os.path.join(config.output_dir, "checkpoints")


def make_writers(config: TrainConfig, keys: Sequence[str]) -> MultiWriter:
    """Console (with ``keys`` on the progress line), JSONL, TensorBoard and the experiment
    trackers (:mod:`alignax.trackers`), as configured; none on processes other than 0
    (every process sees the same figures)."""
    writers = []
    if not is_writer():
        return MultiWriter(writers)
    if config.logging.console:
        writers.append(ConsoleWriter(config.train.total_steps, keys=keys, description=config.algorithm,
                                     print_every=config.train.log_every))
    if config.logging.jsonl:
        writers.append(JsonlWriter(os.path.join(config.output_dir, "metrics.jsonl")))
    if config.logging.tensorboard:
        writers.append(TensorBoardWriter(os.path.join(config.output_dir, "tensorboard")))
    writers += tracker_writers(config.logging, config.output_dir, config)
    return MultiWriter(writers)


class Session:
    """One training run's directory, writers and checkpoints; use as a context manager.

    ``console_keys``: the algorithm's figures worth a place on the progress line, shown
    unless ``logging.console_keys`` names others.
    """

    def __init__(self, config: TrainConfig, *, console_keys: Sequence[str]):
        self.config = config
        self._claim = rundir.claim(config)
        self.directory = self._claim.__enter__()
        try:
            self.checkpointer = (Checkpointer(checkpoint_dir(config), keep=config.checkpoint.keep,
                                              async_save=config.checkpoint.async_save)
                                 if config.checkpoint.enabled else None)
            self.writer = make_writers(config, config.logging.console_keys or console_keys)
        except BaseException:
            self._claim.__exit__(None, None, None)
            raise
        self.resumed = False
        self.meta: dict[str, Any] = {}

    def __enter__(self) -> Session:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            if exc_type is not None:  # a stop by signal is recorded by the loop, which returns
                self.writer.record_outcome("killed" if issubclass(exc_type, KeyboardInterrupt) else "failed")
            self.writer.close()
            if self.checkpointer is not None:
                self.checkpointer.close()
        finally:
            self._claim.__exit__(None, None, None)

    def reporting_eval(self, evaluate: Callable[[TrainState], dict[str, float]], *,
                       step_of: Callable[[TrainState], Any] = lambda state: state.step):
        """``evaluate`` that also writes its figures as a JSON report per step
        (``<output_dir>/evaluation/step_<n>.json``) when ``evaluation.report`` is on."""
        if not self.config.evaluation.report:
            return evaluate

        def evaluate_and_report(state: TrainState) -> dict[str, float]:
            figures = evaluate(state)
            step = int(jax.device_get(step_of(state)))
            if is_writer():
                write_report(report_path(self.config.output_dir, step), figures, step=step,
                             algorithm=self.config.algorithm, evaluation=self.config.evaluation)
            return figures

        return evaluate_and_report

    def resume(self, state: TrainState, batches: BatchIterator, reference: Any = None) -> tuple[TrainState, Any]:
        """Continue from the latest intact checkpoint (or ``checkpoint.resume_step``) when
        there is one and ``checkpoint.resume`` allows; otherwise save ``reference`` (the
        frozen reference policy, if any) once. Returns ``(state, reference)``;
        :attr:`resumed` and :attr:`meta` say what was read."""
        ckpt = self.checkpointer
        if ckpt is not None and self.config.checkpoint.resume and ckpt.latest_step() is not None:
            chosen = self.config.checkpoint.resume_step
            if chosen is not None:
                ckpt.delete_after(chosen)
            state, self.meta = ckpt.restore(state, chosen)
            batches.set_state(self.meta["data"])
            if reference is not None:
                reference = ckpt.restore_reference(reference)
            self.resumed = True
            log.info("resumed at step %s from %s", self.meta.get("step"), ckpt.directory)
            saved, now = self.meta.get("layout"), layout(self.config)
            if saved is not None and saved != now:
                log.info("the layout changed since that checkpoint: saved %s, now %s (arrays were resharded)",
                         saved, now)
        elif ckpt is not None and reference is not None:
            ckpt.save_reference(reference)
        return state, reference

    def run(
        self,
        *,
        state: TrainState,
        frozen: Any,
        step_fn: Callable,
        batches: BatchIterator,
        data_stats: Mapping[str, int],
        place_batch: Callable = lambda batch: batch,
        eval_fn: Callable[[TrainState], dict[str, float]] | None = None,
        meta_fn: Callable[[], dict[str, Any]] = dict,
        progress: Callable[[TrainState], Any] = lambda state: state.step,
        count_batch_tokens: Callable | None = count_tokens,
        guard: Callable | None = None,
    ) -> LoopResult:
        """Train to ``train.total_steps`` from wherever ``state`` is (see :func:`run_loop`)."""
        config = self.config
        self.directory.write_config()
        if not self.resumed:
            self.writer.write(0, {f"data/{k}": float(v) for k, v in data_stats.items()})
        loop_config = LoopConfig(
            total_steps=config.train.total_steps, log_every=config.train.log_every,
            eval_every=config.train.eval_every, save_every=config.train.save_every,
            max_nonfinite_streak=config.train.max_nonfinite_streak,
            max_stalled_streak=config.train.max_stalled_streak,
            eval_at_start=eval_fn is not None and not self.resumed,
            shutdown_timeout_s=config.distributed.shutdown_timeout_s,
        )
        return run_loop(
            config=loop_config, state=state, frozen=frozen, step_fn=step_fn, batches=batches,
            place_batch=place_batch, writer=self.writer, checkpointer=self.checkpointer,
            meta_fn=lambda: {"config": config_io.to_dict(config), "data_stats": dict(data_stats),
                             "layout": layout(config), **meta_fn()},
            eval_fn=eval_fn, count_tokens=count_batch_tokens, progress=progress, guard=guard,
        )


def layout(config: TrainConfig) -> dict[str, Any]:
    """Where a run's arrays live: processes, devices and the mesh shape asked for."""
    return {"processes": jax.process_count(), "devices": jax.device_count(), "mesh": list(config.mesh.shape)}


def init_state_on_mesh(params: Any, optimizer, *, seed: int, mesh: jax.sharding.Mesh, extra: Any = ()):
    """``(train state, its shardings)``: the optimiser state built in one compiled program
    from ``params`` and placed like them (logical-axis shardings of ``alignax.parallel``)."""
    def init(p):
        return init_train_state(p, optimizer, jax.random.key(seed), extra)

    shardings = tree_shardings(jax.eval_shape(init, params), mesh)
    return jax.jit(init, out_shardings=shardings)(params), shardings
