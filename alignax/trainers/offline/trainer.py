"""The offline trainer: a :class:`~alignax.trainers.offline.task.Task` (SFT, reward model,
DPO family, KTO) over a fixed dataset, run by the engine's session.

It builds the mesh, tokenizer, data and model, the jitted step and the eval pass over the
eval split; a reference-based task gets a frozen copy of the initial policy (saved once
with the checkpoints), or the reference log-probs of every record computed once before
training (``dpo.reference: precomputed``), or (``placement.reference: submesh``) a
reference built on devices of its own whose log-probs of each batch ride in the batch
(:class:`SubmeshReference`). With ``lora`` the train state holds the
adapters alone, the base rides in the frozen inputs and the reference is that base with
the adapters off (:mod:`alignax.trainers.engine.adapters`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from alignax import evaluation
from alignax.data import prepare_dataset
from alignax.parallel.multihost import local_rows
from alignax.parallel.placement import place, place_optimizer_state, rows_to, to_device
from alignax.parallel.sharding import place_array
from alignax.trainers.config import TrainConfig
from alignax.trainers.engine import adapters
from alignax.trainers.engine.optim import build_optimizer
from alignax.trainers.engine.precision import frozen_params
from alignax.trainers.engine.session import Session, TrainResult, init_state_on_mesh
from alignax.trainers.engine.setup import (BatchPlacer, build_frozen_params, build_meshes, build_model, load_tokenizer,
                                           split_params)
from alignax.trainers.engine.step import TrainState, make_train_step
from alignax.trainers.offline.task import Task

TaskBuilder = Callable[[TrainConfig, nnx.GraphDef, nnx.State], Task]


def _reference_on_device(fn):
    """``fn(params, frozen, ...)`` with ``frozen["reference"]`` moved into device memory
    inside the program, right before ``fn`` runs it (a no-op for a reference already there;
    ``placement.reference: host`` holds it in host memory between steps)."""
    def wrapped(params, frozen, *args):
        if isinstance(frozen, dict) and "reference" in frozen:
            frozen = {**frozen, "reference": to_device(frozen["reference"])}
        return fn(params, frozen, *args)

    return wrapped


def _with_carried(frozen: dict[str, Any], state: TrainState) -> dict[str, Any]:
    """``frozen`` with the reference the state carries (``Task.sync_reference``), if any."""
    if isinstance(state.extra, dict) and "reference" in state.extra:
        return {**frozen, "reference": state.extra["reference"]}
    return frozen


def _carrying_reference(step, sync_reference: Callable):
    """``step`` reading the reference from ``state.extra`` and moving it after the update
    (``Task.sync_reference``); the update itself sees it as a frozen input."""
    def carried_step(state: TrainState, frozen, batch):
        new_state, out = step(state, _with_carried(frozen, state), batch)
        reference = sync_reference(new_state.params, state.extra["reference"], new_state.step)
        return new_state._replace(extra={"reference": reference}), out

    return carried_step


class SubmeshReference:
    """``placement.reference: submesh``: the reference's log-probs of each batch
    (``task.reference_logps``), computed on the sub-mesh's devices from the host batch and
    handed back as global arrays on the training mesh (``batch["ref_logps"]``)."""

    def __init__(self, reference_logps: Callable, params: Any, *, submesh, mesh):
        self.forward = jax.jit(reference_logps)
        self.params = params  # built on the sub-mesh (OfflineTrainer.initial_reference)
        self.placer = BatchPlacer(submesh)
        self.mesh = mesh

    def __call__(self, host_batch: Mapping[str, Any]) -> dict[str, jax.Array]:
        return rows_to(self.mesh, self.forward(self.params, self.placer(host_batch)))


class OfflineTrainer:
    """One offline run's pieces, shared by train, eval and export."""

    def __init__(self, config: TrainConfig, *, task_builder: TaskBuilder, model_kind: str,
                 records: Sequence[Mapping] | None = None, with_data: bool = True):
        self.config = config
        self.mesh, self.submesh = build_meshes(config)
        self.model_kind = model_kind
        self.submesh_reference: SubmeshReference | None = None  # set by frozen_inputs
        self.reference = None  # what a run saves once as its reference (set by start)
        self.tokenizer = load_tokenizer(config.model)
        model = build_model(config.model, kind=model_kind, mesh=self.mesh, precision=config.precision,
                            lora=config.lora)
        self.vocab_size = model.config.vocab_size
        self.graphdef, params, self.rest = split_params(model)
        del model
        self.params, base = adapters.split_trainable(params, config.lora)
        self.base = None if base is None else frozen_params(base, config.precision)
        del params, base
        task = task_builder(config, self.graphdef, self.rest)
        loss_fn = adapters.with_base(adapters.with_dropout(task.loss_fn, config.lora))
        self.task = dataclasses.replace(task, loss_fn=_reference_on_device(loss_fn),
                                        eval_fn=_reference_on_device(adapters.with_base(task.eval_fn)))
        self.data = (prepare_dataset(config.data, self.tokenizer, records=records,
                                     required_fields=self.task.required_fields) if with_data else None)
        self.placer = BatchPlacer(self.mesh)
        self.optimizer, self.schedule = build_optimizer(config.optim, config.train.total_steps,
                                                        precision=config.precision)

    # ---- what api.py reads -----------------------------------------------------------
    def init_state(self) -> tuple[TrainState, Any]:
        """The fresh train state on the mesh, and its shardings (the optimiser state's in host
        memory with ``placement.optimizer_state: host``); a task whose reference moves
        (``Task.sync_reference``) carries it in ``extra``."""
        state, shardings = init_state_on_mesh(self.params, self.optimizer, seed=self.config.train.seed, mesh=self.mesh)
        if self.task.sync_reference is not None:  # buffers of its own: the state is donated to the step
            reference = jax.tree.map(jnp.copy, self.initial_reference())
            state = state._replace(extra={"reference": reference})
            shardings = shardings._replace(extra={"reference": jax.tree.map(lambda x: x.sharding, reference)})
        return place_optimizer_state(state, shardings, self.config.placement.optimizer_state)

    def export_models(self, params, *, critic: bool = False) -> dict[str, nnx.Module]:
        """``{"": the trained model}`` (a policy, or a reward model for ``reward``)."""
        if critic:
            raise ValueError(f"algorithm {self.config.algorithm} has no critic to export")
        return {"": self.model_from(params)}

    def model_from(self, params) -> nnx.Module:
        if self.base is not None:
            params = nnx.merge_state(params, self.base)
        return nnx.merge(self.graphdef, params, self.rest)

    def frozen_inputs(self, reference) -> dict[str, Any]:
        """What the loss reads besides the params: the live reference or its log-probs, and
        with LoRA the frozen base (``reference`` is then the adapters-off leaves, unless it
        is a model of its own: a distillation teacher, placed beside the base)."""
        frozen = self._frozen_base(reference)
        if reference is None:
            return frozen
        if self.task.precompute is not None:
            table = self.precompute_reference(frozen.pop("reference", reference))
            return {**frozen, **table}
        if self.config.placement.on_submesh("reference"):  # its log-probs ride in each batch (place_batch)
            self.submesh_reference = SubmeshReference(self.task.reference_logps, reference, submesh=self.submesh,
                                                      mesh=self.mesh)
            return frozen
        if "reference" in frozen:  # LoRA: the base with the adapters off, on the base's buffers
            return frozen
        # placement.reference: host holds it in host memory; the step and the evaluation
        # move it to the device inside their programs (_reference_on_device)
        return {**frozen, "reference": place(reference, self.config.placement.reference)}

    def _frozen_base(self, reference) -> dict[str, Any]:
        """:func:`adapters.frozen_base` of the run: ``{}`` without LoRA; with it the base and,
        when the reference is the base with the adapters off, that reference (a teacher,
        ``Task.reference_params``, is a model of its own: not merged with the base)."""
        own_model = self.task.reference_params is not None
        return adapters.frozen_base(self.base, None if own_model else reference)

    def place_batch(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        """A host batch on the training mesh, with the sub-mesh reference's log-probs of it
        (``ref_logps``) under ``placement.reference: submesh``."""
        placed = self.placer(batch)
        if self.submesh_reference is not None:
            placed["ref_logps"] = self.submesh_reference(batch)
        return placed

    def reference_model_params(self, config: TrainConfig) -> Any:
        """The frozen params of ``config.model`` (a policy of this trainer's kind) built on
        the mesh the reference lives on (the sub-mesh under ``placement.reference:
        submesh``), in ``precision.frozen_dtype``."""
        on_submesh = self.config.placement.on_submesh("reference")
        return build_frozen_params(config.model, kind=self.model_kind, mesh=self.submesh if on_submesh else self.mesh,
                                   precision=self.config.precision)

    def initial_reference(self) -> Any:
        """The reference the run starts from (``None`` when the task has none): the initial
        params in ``precision.frozen_dtype``, or with LoRA the adapters switched off."""
        if not self.task.uses_reference:
            return None
        if self.task.reference_params is not None:  # a model of its own (a teacher), built where it is placed
            return self.task.reference_params(self.submesh if self.config.placement.on_submesh("reference")
                                              else self.mesh)
        if self.base is not None:
            return adapters.reference_adapters(self.params)
        if self.config.placement.on_submesh("reference"):  # built there: the same weights, other devices
            return self.reference_model_params(self.config)
        return frozen_params(self.params, self.config.precision)

    def eval_frozen(self, state: TrainState) -> dict[str, Any]:
        """The frozen inputs of an evaluation of the checkpoint ``state`` outside training: the
        initial params are the reference (the run saved exactly them, in
        ``precision.frozen_dtype``, as its reference), or the one the state carries where the
        reference moved during training (TR-DPO, ``Task.sync_reference``)."""
        return _with_carried(self.frozen_inputs(self.initial_reference()), state)

    def has_evaluation(self) -> bool:
        """Whether there is anything to evaluate: an eval split, or ``evaluation.prompts``."""
        return self.data.stats.get("eval", 0) > 0 or self.config.evaluation.prompts is not None

    def evaluate(self, params, frozen: Any) -> dict[str, float]:
        """The task's figures over the eval split (or its first ``train.eval_batches``), and
        generation-based figures (``generation/...``, :mod:`alignax.evaluation`) on
        ``evaluation.prompts`` when the config names a prompt set."""
        if not self.has_evaluation():
            raise ValueError("nothing to evaluate: the eval split is empty; set data.eval_fraction > 0, "
                             "or evaluation.prompts (a prompt set)")
        out = self._split_figures(params, frozen) if self.data.stats.get("eval", 0) > 0 else {}
        if self.config.evaluation.prompts is not None:
            if not hasattr(self, "_sampler"):
                self._sampler = evaluation.build_sampler(self.graphdef, self.tokenizer, self.config, mesh=self.mesh,
                                                         vocab_size=self.vocab_size)
            batches = evaluation.prompt_batches(self.config, self.tokenizer)
            state = nnx.merge_state(params, *(() if self.base is None else (self.base,)), self.rest)
            figures = evaluation.evaluate_policy(self._sampler, state, batches, self.config.evaluation,
                                                 seed=self.config.train.seed)
            out.update({f"generation/{k}": v for k, v in figures.items()})
        return out

    def _split_figures(self, params, frozen: Any) -> dict[str, float]:
        fn = self._eval_fn()
        limit = self.config.train.eval_batches
        sums: dict[str, list[float]] = {}
        for i, batch in enumerate(self.data.iterator("eval")):
            if limit is not None and i >= limit:
                break
            figures = jax.device_get(fn(params, frozen, self.place_batch(batch)))
            for key, (total, weight) in figures.items():
                acc = sums.setdefault(key, [0.0, 0.0])
                acc[0] += float(total)
                acc[1] += float(weight)
        out = {k: (t / w if w > 0 else float("nan")) for k, (t, w) in sums.items()}
        if "nll" in out:
            out["ppl"] = float(np.exp(out["nll"]))
        return out

    def _eval_fn(self):
        if not hasattr(self, "_jitted_eval"):
            self._jitted_eval = jax.jit(self.task.eval_fn)
        return self._jitted_eval

    def precompute_reference(self, reference_params, batches=None, num_records: int | None = None) -> dict[str, Any]:
        """Reference log-probs of every record, indexed by record index (``[num_records, ...]``):
        one pass over the train split (in file order) and the eval split, or over ``batches``."""
        forward = jax.jit(self.task.precompute)
        if batches is None:
            num_records = int(self.data.stats["records"])
            batches = [self.data.iterator(split, ordered=True) if split == "train" else self.data.iterator(split)
                       for split in ("train", "eval") if self.data.stats.get(split, 0) > 0]
            batches = (batch for split in batches for batch in split)
        tables: dict[str, np.ndarray] = {}
        for batch in batches:  # this process's rows of each global batch
            values = forward(reference_params, self.placer(batch))
            keep = batch["example_mask"] > 0 if "example_mask" in batch else slice(None)
            for key, value in values.items():
                rows = local_rows(value)  # [B] a number a record, or [B, ...] (a teacher's top-k a position)
                table = tables.setdefault(key, np.zeros((num_records, *rows.shape[1:]), rows.dtype))
                table[batch["record_index"][keep]] = rows[keep]
        if jax.process_count() > 1:  # each record was scored by one process: sum the tables
            tables = {k: np.sum(multihost_utils.process_allgather(v), axis=0) for k, v in tables.items()}
        whole = NamedSharding(self.mesh, PartitionSpec())
        return {"ref_logps": {k: place_array(v, whole) for k, v in tables.items()}}

    def start(self) -> tuple[TrainState, Any]:
        """``(fresh train state, frozen)`` on the mesh, as the online trainer's: ``frozen`` is
        what :attr:`step` reads besides the params (:meth:`frozen_inputs` of the reference);
        compiles :attr:`step` for the state. :attr:`reference`, when the task uses one, is
        what the run saves once: the initial params themselves (in ``precision.frozen_dtype``);
        the trainer lets go of them (:attr:`params` is None from here on): the state holds
        buffers of its own."""
        state = self._compile_step()
        if self.task.precompute is not None and self.data is None:
            # with_data=False: no records to precompute over; the caller's batches
            # (precompute_reference) make the table from the reference handed here
            frozen = self._frozen_base(self.reference)
            return state, frozen if "reference" in frozen else {**frozen, "reference": self.reference}
        return state, self.frozen_inputs(self.reference)

    def _compile_step(self) -> TrainState:
        """The fresh state; compiles :attr:`step` for it and sets :attr:`reference`."""
        state, shardings = self.init_state()
        task = self.task
        step = make_train_step(task.loss_fn, self.optimizer, normalisers_fn=task.normalisers_fn,
                               grad_accum_steps=self.config.train.grad_accum_steps, schedule=self.schedule)
        if task.sync_reference is not None:  # the state carries the reference: nothing to save once
            step = _carrying_reference(step, task.sync_reference)
        self.step = jax.jit(step, donate_argnums=(0,), out_shardings=(shardings, None))
        self.reference = self.initial_reference() if task.sync_reference is None else None
        self.params = None
        return state

    # ---- the run ---------------------------------------------------------------------
    def train(self) -> TrainResult:
        """Run to ``train.total_steps`` (resuming from the run's checkpoints when allowed)."""
        config, task = self.config, self.task
        state = self._compile_step()  # not start(): a resumed run's frozen inputs come from the saved reference
        batches = self.data.iterator("train")
        with Session(config, console_keys=task.console_keys) as session:
            state, reference = session.resume(state, batches, self.reference)
            frozen = self.frozen_inputs(reference)  # once: a precomputed table is one pass over the data
            self.reference = reference = None  # precomputed: no reference in memory during training
            result = session.run(
                state=state, frozen=frozen, step_fn=self.step, batches=batches, data_stats=self.data.stats,
                place_batch=self.place_batch,
                eval_fn=session.reporting_eval(lambda st: self.evaluate(st.params, _with_carried(frozen, st)))
                if self.has_evaluation() else None,
            )
        return TrainResult(config=config, model=self.model_from(result.state.params), tokenizer=self.tokenizer,
                           loop=result, data_stats=dict(self.data.stats))
