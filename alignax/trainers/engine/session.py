"""One run from a TrainConfig: model, data, optimiser, checkpoints and metrics wired to the
shared loop. ``train`` is what ``alignax train`` calls; ``evaluate`` and ``export`` serve
``alignax eval`` and ``alignax export``.

Output directory layout::

    <output_dir>/config.yaml          the resolved config of the run
    <output_dir>/metrics.jsonl        one line per logged step (and eval)
    <output_dir>/tensorboard/         TensorBoard event files
    <output_dir>/checkpoints/         Orbax checkpoints (see alignax.checkpoint)
    <output_dir>/export/              Hugging Face safetensors + tokenizer (``export``)
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from alignax import config as config_io
from alignax.checkpoint import Checkpointer
from alignax.data import prepare_dataset
from alignax.metrics import ConsoleWriter, JsonlWriter, MultiWriter, TensorBoardWriter
from alignax.models import save_pretrained
from alignax.parallel.sharding import tree_shardings
from alignax.trainers import preference, reward, sft
from alignax.trainers.common import BatchPlacer, build_mesh, build_model, load_tokenizer, split_params
from alignax.trainers.config import TrainConfig
from alignax.trainers.loop import LoopConfig, LoopResult, run_loop
from alignax.trainers.optim import build_optimizer
from alignax.trainers.step import init_train_state, make_train_step
from alignax.trainers.task import Task

log = logging.getLogger("alignax")

OFFLINE_TASKS = {"sft": sft.make_task, "reward": reward.make_task, "dpo": preference.make_task}
MODEL_KIND = {"sft": "causal_lm", "reward": "reward", "dpo": "causal_lm"}


@dataclasses.dataclass
class TrainResult:
    """What a finished (or stopped) run leaves in memory besides its files."""

    config: TrainConfig
    model: nnx.Module  # the trained model (params merged back)
    tokenizer: Any
    loop: LoopResult
    data_stats: dict[str, int]

    @property
    def history(self) -> list[dict[str, float]]:
        return self.loop.history

    @property
    def eval_history(self) -> list[dict[str, float]]:
        return self.loop.eval_history


class _Run:
    """The pieces of a run shared by train, eval and export."""

    def __init__(self, config: TrainConfig, *, records: Sequence[Mapping] | None = None, with_data: bool = True):
        if config.algorithm not in OFFLINE_TASKS:
            raise ValueError(f"algorithm {config.algorithm!r} is not an offline trainer; valid: {', '.join(OFFLINE_TASKS)}")
        self.config = config
        self.mesh = build_mesh(config.mesh)
        self.tokenizer = load_tokenizer(config.model)
        self.data = prepare_dataset(config.data, self.tokenizer, records=records) if with_data else None
        model = build_model(config.model, kind=MODEL_KIND[config.algorithm], mesh=self.mesh)
        self.graphdef, self.params, self.rest = split_params(model)
        self.task: Task = OFFLINE_TASKS[config.algorithm](config, self.graphdef, self.rest)
        self.placer = BatchPlacer(self.mesh)
        self.checkpoint_dir = os.path.join(config.output_dir, "checkpoints")

    def model_from(self, params) -> nnx.Module:
        return nnx.merge(self.graphdef, params, self.rest)

    def make_eval(self, frozen_fn):
        """``eval(params) -> {name: value}`` over the whole eval split (or its first N batches)."""
        if self.data.stats.get("eval", 0) == 0:
            return None
        fn = jax.jit(self.task.eval_fn)
        limit = self.config.train.eval_batches

        def evaluate(params) -> dict[str, float]:
            sums: dict[str, list[float]] = {}
            for i, batch in enumerate(self.data.iterator("eval")):
                if limit is not None and i >= limit:
                    break
                figures = jax.device_get(fn(params, frozen_fn(), self.placer(batch)))
                for key, (total, weight) in figures.items():
                    acc = sums.setdefault(key, [0.0, 0.0])
                    acc[0] += float(total)
                    acc[1] += float(weight)
            out = {k: (t / w if w > 0 else float("nan")) for k, (t, w) in sums.items()}
            if "nll" in out:
                out["ppl"] = float(np.exp(out["nll"]))
            return out

        return evaluate


def _writers(config: TrainConfig, keys: Sequence[str]) -> MultiWriter:
    writers = []
    if config.logging.console:
        writers.append(ConsoleWriter(config.train.total_steps, keys=keys, description=config.algorithm,
                                     print_every=config.train.log_every))
    if config.logging.jsonl:
        writers.append(JsonlWriter(os.path.join(config.output_dir, "metrics.jsonl")))
    if config.logging.tensorboard:
        writers.append(TensorBoardWriter(os.path.join(config.output_dir, "tensorboard")))
    return MultiWriter(writers)


def _precompute_reference(run: _Run, reference_params) -> dict[str, Any]:
    """Reference log-probs of every record, indexed by record index (``[num_records]``)."""
    forward = jax.jit(run.task.precompute)
    num_records = int(run.data.stats["records"])
    tables: dict[str, np.ndarray] = {}
    for split in ("train", "eval"):
        if run.data.stats.get(split, 0) == 0:
            continue
        iterator = run.data.iterator("eval") if split == "eval" else run.data.iterator("train", ordered=True)
        for batch in iterator:
            values = jax.device_get(forward(reference_params, run.placer(batch)))
            for key, value in values.items():
                table = tables.setdefault(key, np.zeros(num_records, np.float32))
                keep = batch["example_mask"] > 0
                table[batch["record_index"][keep]] = np.asarray(value)[keep]
    return {"ref_logps": {k: jnp.asarray(v) for k, v in tables.items()}}


def train(config: TrainConfig, *, records: Sequence[Mapping] | None = None) -> TrainResult:
    """Run ``config`` to ``train.total_steps`` (resuming from its checkpoints when allowed)."""
    os.makedirs(config.output_dir, exist_ok=True)
    with open(os.path.join(config.output_dir, "config.yaml"), "w", encoding="utf-8") as f:
        yaml.safe_dump(config_io.to_dict(config), f, sort_keys=False)
    run = _Run(config, records=records)
    task = run.task
    optimizer, schedule = build_optimizer(config.optim, config.train.total_steps)
    # Parameters carry their logical-axis shardings (alignax.parallel rules); the
    # optimiser state is built from them and placed the same way.
    abstract = jax.eval_shape(lambda p: init_train_state(p, optimizer, jax.random.key(config.train.seed)), run.params)
    shardings = tree_shardings(abstract, run.mesh)
    # One compiled program builds the whole state in place (not one tiny compile per leaf).
    state = jax.jit(lambda p: init_train_state(p, optimizer, jax.random.key(config.train.seed)),
                    out_shardings=shardings)(run.params)

    checkpointer = Checkpointer(run.checkpoint_dir, keep=config.checkpoint.keep,
                                async_save=config.checkpoint.async_save) if config.checkpoint.enabled else None
    batches = run.data.iterator("train")
    reference = None
    if task.uses_reference:
        reference = jax.jit(lambda p: jax.tree.map(jnp.copy, p))(run.params)
    resumed = False
    if checkpointer is not None and config.checkpoint.resume and checkpointer.latest_step() is not None:
        state, meta = checkpointer.restore(state)
        batches.set_state(meta["data"])
        if reference is not None:
            reference = checkpointer.restore_reference(reference)
        resumed = True
        log.info("resumed from step %d of %s", int(state.step), run.checkpoint_dir)
    elif checkpointer is not None and reference is not None:
        checkpointer.save_reference(reference)

    frozen: dict[str, Any] = {}
    if reference is not None:
        frozen = _precompute_reference(run, reference) if task.precompute is not None else {"reference": reference}
        if task.precompute is not None:
            del reference  # no reference in memory during training

    step_fn = jax.jit(
        make_train_step(task.loss_fn, optimizer, normalisers_fn=task.normalisers_fn,
                        grad_accum_steps=config.train.grad_accum_steps, schedule=schedule),
        donate_argnums=(0,),
        out_shardings=(shardings, None),
    )
    writer = _writers(config, task.console_keys)
    if not resumed:
        writer.write(0, {f"data/{k}": float(v) for k, v in run.data.stats.items()})
    evaluate = run.make_eval(lambda: frozen)
    loop_config = LoopConfig(
        total_steps=config.train.total_steps, log_every=config.train.log_every, eval_every=config.train.eval_every,
        save_every=config.train.save_every, max_nonfinite_streak=config.train.max_nonfinite_streak,
        eval_at_start=not resumed,
    )
    try:
        result = run_loop(
            config=loop_config, state=state, frozen=frozen, step_fn=step_fn, batches=batches,
            place_batch=run.placer, writer=writer, checkpointer=checkpointer,
            meta_fn=lambda: {"config": config_io.to_dict(config), "data_stats": run.data.stats},
            eval_fn=None if evaluate is None else (lambda st: evaluate(st.params)),
        )
    finally:
        writer.close()
        if checkpointer is not None:
            checkpointer.close()
    return TrainResult(config=config, model=run.model_from(result.state.params), tokenizer=run.tokenizer,
                       loop=result, data_stats=dict(run.data.stats))


def _restored_params(run: _Run, step: int | None):
    """The policy params of a checkpoint (latest when ``step`` is None), or the initial ones."""
    if not os.path.isdir(run.checkpoint_dir):
        return run.params
    checkpointer = Checkpointer(run.checkpoint_dir)
    try:
        if checkpointer.latest_step() is None:
            return run.params
        optimizer, _ = build_optimizer(run.config.optim, run.config.train.total_steps)
        abstract = init_train_state(run.params, optimizer, jax.random.key(0))
        state, _ = checkpointer.restore(abstract, step)
        return state.params
    finally:
        checkpointer.close()


def evaluate(config: TrainConfig, *, step: int | None = None, records: Sequence[Mapping] | None = None) -> dict[str, float]:
    """Eval figures of a run's checkpoint (latest, or ``step``) on its eval split."""
    run = _Run(config, records=records)
    params = _restored_params(run, step)
    frozen: dict[str, Any] = {}
    if run.task.uses_reference:
        frozen = {"reference": run.params}
        if run.task.precompute is not None:
            frozen = _precompute_reference(run, run.params)
    evaluate_fn = run.make_eval(lambda: frozen)
    if evaluate_fn is None:
        raise ValueError("the eval split is empty; set data.eval_fraction > 0")
    return evaluate_fn(params)


def export(config: TrainConfig, destination: str | None = None, *, step: int | None = None) -> str:
    """Write a run's policy (latest checkpoint, or ``step``) as HF safetensors + tokenizer."""
    run = _Run(config, with_data=False)
    params = _restored_params(run, step)
    destination = destination or os.path.join(config.output_dir, "export")
    model = run.model_from(params)
    save_pretrained(model, destination)
    run.tokenizer.save_pretrained(destination)
    return destination
