"""The online-RL trainer: the run, for any
:class:`~alignax.trainers.online.algorithm.OnlineAlgorithm`, over four rooms:

- :mod:`~alignax.trainers.online.actors`: the models, meshes and their placement, the
  sampler (:func:`alignax.evaluation.build_sampler`) and the frozen reference;
- :mod:`~alignax.trainers.online.collect`: prompts -> a typed
  :class:`~alignax.trainers.online.collect.RolloutBatch` (:meth:`OnlineTrainer.collect`);
- :mod:`~alignax.trainers.online.update`: a rollout batch -> the new state and a typed
  :class:`~alignax.trainers.online.update.UpdateResult` (:meth:`OnlineTrainer.learn`; the
  compiled step is :attr:`OnlineTrainer.step`);
- this module: one rollout step (:meth:`OnlineTrainer.rollout_step`: collect, learn,
  figures and alarms, :mod:`alignax.trainers.online.monitoring`) and the run.

The host loop around a step (logging, eval, checkpoints at rollout boundaries, SIGTERM)
is the engine's :class:`~alignax.trainers.engine.session.Session`; a resumed run repeats
the same rollouts because each one's randomness comes from the seed and the rollout index.
Under ``rollout.async.max_staleness > 0`` the collect half of a step is
:class:`~alignax.trainers.online.schedule.AsyncSchedule`'s (the same ``collect`` split over
a sampler thread and the learner); every batch records the policy version it was sampled with.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from alignax import evaluation, paths
from alignax.config import ConfigError
from alignax.data import prepare_dataset
from alignax.parallel.multihost import collectives_on
from alignax.parallel.placement import place_optimizer_state
from alignax.trainers.config import TrainConfig
from alignax.trainers.engine.rundir import checkpoint_steps
from alignax.trainers.engine.session import Session, TrainResult, init_state_on_mesh
from alignax.trainers.engine.step import StepOutput, TrainState
from alignax.trainers.online.actors import Actors
from alignax.trainers.online.algorithm import OnlineAlgorithm
from alignax.trainers.online.collect import Collector, RolloutBatch, single_update
from alignax.trainers.online.guard import build_guard
from alignax.trainers.online.monitoring import AlarmSettings, Alarms, step_figures
from alignax.trainers.online.rollout import Minibatch, RowLayout
from alignax.trainers.online.schedule import AsyncSchedule
from alignax.trainers.online.update import Learner, Observer, UpdateResult

log = logging.getLogger("alignax")

CONSOLE_KEYS = ("reward/total", "reward/answer", "kl/ref_seq", "entropy", "response/length_mean")


def check_layout(config: TrainConfig, algorithm: OnlineAlgorithm, layout: RowLayout) -> None:
    """The run's groups and minibatches fit together, else a ``ValueError`` naming the keys
    (that its data are prompts is the algorithm map's fact, checked when the config loads)."""
    if layout.group_size < algorithm.min_group_size:
        raise ValueError(f"{config.algorithm} compares samples of a prompt: rollout.num_samples must be >= "
                         f"{algorithm.min_group_size}; got {layout.group_size}")
    if layout.local_rows % algorithm.minibatches:
        raise ValueError(f"each of the {jax.process_count()} processes holds {layout.local_rows} rollout rows, which "
                         f"do not split into {algorithm.minibatches} minibatches")
    if layout.rows % algorithm.minibatches:
        raise ValueError(f"{layout.rows} rollout rows (data.batch_size x rollout.num_samples) do not split into "
                         f"{algorithm.minibatches} minibatches")


class OnlineTrainer:
    """An online run: its actors, collector and learner, and the run over them.

    ``single_pass``: whether the one update of a rollout supplies the old log-probs
    (:func:`~alignax.trainers.online.collect.single_update`, the default when ``None``);
    ``False`` keeps the separate forward pass (the two must give the same step)."""

    def __init__(self, config: TrainConfig, algorithm: OnlineAlgorithm, *, records: Sequence[Mapping] | None = None,
                 single_pass: bool | None = None):
        self.layout = RowLayout(num_prompts=config.data.batch_size, group_size=config.rollout.num_samples)
        check_layout(config, algorithm, self.layout)
        if single_pass and not single_update(config, algorithm):
            raise ValueError(f"single_pass=True needs one update per rollout ({config.algorithm}: epochs x "
                             f"minibatches = {algorithm.epochs * algorithm.minibatches}) and no critic nor KL in the "
                             "reward reading the policy's log-probs before it (collect.single_update)")
        self.config, self.algorithm = config, algorithm
        self.single_pass = single_update(config, algorithm) if single_pass is None else single_pass
        self.actors = Actors(config, algorithm)
        self.mesh, self.tokenizer = self.actors.mesh, self.actors.tokenizer
        self.data = prepare_dataset(config.data, self.tokenizer, records=records)
        self.collector = Collector(config, algorithm, self.actors, self.layout, single_pass=self.single_pass)
        self.learner = Learner(config, algorithm, self.actors, self.layout)
        self.alarms = Alarms(AlarmSettings.from_monitor(config.monitor),
                             max_stalled_streak=config.train.max_stalled_streak)
        self.reference = None  # what a run saves once as its reference (set by start)
        self.schedule: AsyncSchedule | None = None  # rollout.async.max_staleness > 0: set by train

    # ------------------------------------------------------------------ the program seam
    def init_state(self) -> tuple[TrainState, Any]:
        """The fresh train state on the mesh (carrying the KL controller and the rollout
        count), and its shardings."""
        extra = {"kl_coef": self.algorithm.kl.controller.init(), "rollouts": jnp.zeros((), jnp.int32)}
        if self.algorithm.objective.entropy_control is not None:  # grpo.target_entropy
            extra["entropy_coef"] = self.algorithm.objective.entropy_control.init()
        state, shardings = init_state_on_mesh(self.actors.initial_params, self.learner.optimizer,
                                              seed=self.config.train.seed, mesh=self.mesh, extra=extra)
        return place_optimizer_state(state, shardings, self.config.placement.optimizer_state)

    def start(self) -> tuple[TrainState, dict[str, Any]]:
        """``(fresh train state, frozen)`` on the mesh, ``frozen`` holding the reference (the
        initial policy params themselves, in ``precision.frozen_dtype``) when the KL is on;
        compiles :attr:`step` for them. :attr:`reference` is what the run saves once;
        ``actors.initial_params`` is None from here on: the state holds buffers of its own."""
        state = self._compile_step()
        return state, self.actors.frozen_inputs(self.reference)

    def _compile_step(self) -> TrainState:
        """The fresh state; compiles :attr:`step` for it and sets :attr:`reference`."""
        state, shardings = self.init_state()
        self.learner.compile(shardings)
        self.reference = self.actors.initial_reference(self.actors.initial_params)
        self.actors.initial_params = None
        return state

    @property
    def step(self):
        """The compiled update step, ``step(state, frozen, minibatch) -> (state, StepOutput)``
        (set by :meth:`start`)."""
        return self.learner.step

    def minibatch_shapes(self) -> Minibatch:
        """The :class:`Minibatch` :attr:`step` takes, as shapes with shardings:
        ``trainer.step.lower(state, frozen, trainer.minibatch_shapes())`` compiles it
        without a rollout."""
        return self.learner.minibatch_shapes(self.single_pass)

    # ------------------------------------------------------------------ one rollout step
    def collect(self, state, frozen, prompt_batch: Mapping[str, Any], batches: Iterator) -> RolloutBatch:
        """One rollout of the policy in ``state`` (``batches``: more prompts for dynamic sampling)."""
        return self.collector.collect(state, frozen, prompt_batch, batches)

    def learn(self, state, frozen, batch: RolloutBatch, *,
              observe: Observer | None = None) -> tuple[TrainState, UpdateResult]:
        """The updates of one rollout batch (``observe``: each step's minibatch and output)."""
        return self.learner.update(state, frozen, batch, observe=observe)

    def rollout_step(self, state, frozen, prompt_batch: Mapping[str, Any], batches: Iterator, *,
                     observe: Observer | None = None) -> tuple[TrainState, StepOutput]:
        """One rollout and its updates: the new state and the rollout's figures (host floats)."""
        t_start = time.perf_counter()
        collect = self.collect if self.schedule is None else self.schedule.collect
        batch = collect(state, frozen, prompt_batch, batches)
        state, result = self.learn(state, frozen, batch, observe=observe)
        agreement = self.collector.agreement_after_update(batch, result.recomputed)
        if self.schedule is not None:
            self.schedule.finish()
        figures = {**self.figures(batch, result), **agreement}
        figures["perf/step_time_s"] = time.perf_counter() - t_start
        return state, StepOutput(metrics=figures)

    def figures(self, batch: RolloutBatch, result: UpdateResult) -> dict[str, float]:
        """A rollout step's figures (:func:`~alignax.trainers.online.monitoring.step_figures`)
        and its alarms (which keep a history: once a step)."""
        figures = step_figures(batch, result, mesh=self.mesh, group_size=self.layout.group_size,
                               with_advantages=self.algorithm.logits_loss is None)
        figures.update(self.alarms.update(batch.rollout_index + 1, kl=figures.get("kl/ref_seq"),
                                          entropy=figures["entropy"], length=figures["response/length_mean"],
                                          reward=figures.get("reward/answer", figures["reward/total"]),
                                          grad_norm=figures["grad_norm_max"]))
        return figures

    # ------------------------------------------------------------------ evaluation and export
    def eval_frozen(self, state) -> None:
        """An online evaluation samples with the policy alone: no frozen inputs."""
        del state
        return None

    def has_evaluation(self) -> bool:
        """Whether there are prompts to evaluate on: ``evaluation.prompts`` or an eval split."""
        return self.config.evaluation.prompts is not None or self.data.stats.get("eval", 0) > 0

    def evaluate(self, params, frozen: Any = None) -> dict[str, float]:
        """Generation-based figures (:mod:`alignax.evaluation`: greedy accuracy, pass@k,
        rewards, lengths) on ``evaluation.prompts`` or the eval split, scored like the rollouts."""
        del frozen
        if self.schedule is not None:  # the sampler's devices are the sampler thread's until it is done
            self.schedule.drain()
        batches = evaluation.prompt_batches(self.config, self.tokenizer, run_data=self.data)
        return evaluation.evaluate_policy(self.actors.sampler, self.actors.sampling_state(params), batches,
                                          self.config.evaluation, seed=self.config.train.seed)

    def export_models(self, params, *, critic: bool = False) -> dict[str, nnx.Module]:
        """``{"": the policy}``, and ``{"critic": ...}`` with ``critic`` (a separate critic)."""
        return self.actors.export_models(params, critic=critic)

    # ------------------------------------------------------------------ the run
    def start_schedule(self) -> AsyncSchedule | None:
        """The asynchronous schedule of ``rollout.async.max_staleness > 0``.

        Over several processes the two threads' programs must start in the same order on
        every process, else a collective of one waits for a peer still in the other's. XLA's
        CPU client runs a process's multi-device programs one at a time in the order they
        were launched, whichever thread and devices (``PjRtCpuClient``'s last collective
        launch event), so on CPU, and time-sliced on any backend (both threads on the same
        devices), the schedule samples inline: each rollout where it is queued, on the
        learner's thread (the same rollouts from the same weights; nothing overlaps). With
        ``rollout.async.devices`` on an accelerator each thread keeps to its own devices
        (:meth:`train`); reward models are then refused (the sampler thread would score on
        the learner's devices)."""
        staleness = self.config.rollout.async_.max_staleness
        if staleness == 0:
            return None
        processes = jax.process_count()
        inline = processes > 1 and (self.actors.sampler_counterpart is None or jax.default_backend() == "cpu")
        if processes > 1 and not inline and self.config.rewards.reward_models:
            raise ConfigError(f"rewards.reward_models with rollout.async.max_staleness={staleness} and "
                              f"rollout.async.devices over {processes} processes: the sampler thread would score on "
                              "the learner's devices; use rule rewards or max_staleness 0")
        if inline:
            log.info("rollout.async.max_staleness=%d over %d processes on %s%s: each rollout is sampled on the "
                     "learner's thread, where it is queued (the same rollouts; no overlap)", staleness, processes,
                     jax.default_backend(), "" if self.actors.sampler_counterpart else " without rollout.async.devices")
        output_dir = self.config.output_dir
        return AsyncSchedule(self.collector, staleness, directory=paths.as_path(output_dir) / "async_in_flight",
                             kept_steps=lambda: checkpoint_steps(output_dir), inline=inline)

    def train(self) -> TrainResult:
        """The run. With an asynchronous sampler on devices of its own, every host collective
        of this (the learner's) thread runs on the learner's devices
        (:func:`~alignax.parallel.multihost.collectives_on`; the sampler thread's on its own),
        and the work that runs collectives on every device (Orbax's checkpoint barriers, an
        evaluation or a gold point on the sampler's mesh, a rollback's restore) waits for the
        sampler thread to be idle first (:meth:`AsyncSchedule.drain`): every device then runs
        its programs in the same order on every process."""
        self.schedule = self.start_schedule()
        split = self.schedule is not None and self.schedule.sampler_devices is not None and not self.schedule.inline
        try:
            with collectives_on(list(self.mesh.devices.flat) if split else None):
                return self._train()
        finally:
            if self.schedule is not None:
                self.schedule.close()
            self.schedule = None

    def quiesced(self, guard):
        """``guard`` run with the sampler thread idle when it may touch devices beyond the
        learner's (a gold point samples, a rollback restores a checkpoint) in a multi-process
        asynchronous run; else ``guard`` itself."""
        if self.schedule is None or self.schedule.inline or jax.process_count() == 1 or not guard.touches_devices:
            return guard

        def drained(step, state, metrics):
            self.schedule.drain()
            return guard(step, state, metrics)

        return drained

    def _train(self) -> TrainResult:
        config, learner, schedule = self.config, self.learner, self.schedule
        state = self._compile_step()  # not start(): a resumed run's frozen inputs come from the saved reference
        batches = self.data.iterator("train")
        with Session(config, console_keys=CONSOLE_KEYS) as session:
            state, reference = session.resume(state, batches, self.reference)
            frozen = self.actors.frozen_inputs(reference)  # placed once
            guard = build_guard(config, self)  # monitor: the alarms' actions and the gold signal
            if session.resumed:
                guard.set_state(session.meta.get("guard", {}))
                self.alarms.set_state(session.meta.get("alarms", {}))
                if learner.ptx is not None:
                    learner.ptx.set_state(session.meta["ptx_data"])
                if schedule is not None:
                    schedule.set_in_flight(session.meta.get("async_in_flight", []))
            elif start := guard.begin(state):
                session.writer.write(0, start)
            self.reference = reference = None

            def meta():
                out = {"alarms": self.alarms.state(), "guard": guard.state()}
                if learner.ptx is not None:
                    out["ptx_data"] = learner.ptx.get_state()
                if schedule is not None:  # the resumed run trains on the same samples
                    out["async_in_flight"] = schedule.in_flight_state()
                return out

            try:
                result = session.run(
                    state=state, frozen=frozen, batches=batches, data_stats=self.data.stats,
                    step_fn=lambda st, fr, batch: self.rollout_step(st, fr, batch, batches),
                    eval_fn=session.reporting_eval(lambda st: self.evaluate(st.params),
                                                   step_of=lambda st: st.extra["rollouts"])
                    if self.has_evaluation() else None,
                    meta_fn=meta, progress=lambda st: st.extra["rollouts"], count_batch_tokens=None,
                    guard=self.quiesced(guard),
                )
            finally:
                guard.finish()
        policy = nnx.merge(self.actors.graphdef, self.actors.whole_policy(result.state.params), self.actors.rest)
        return TrainResult(config=config, model=policy, tokenizer=self.tokenizer, loop=result,
                           data_stats=dict(self.data.stats))
