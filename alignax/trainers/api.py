"""``load_config``, ``train`` / ``evaluate`` / ``export`` for every algorithm of the map.

The map (:mod:`alignax.trainers.algorithms`, re-exported here as ``ALGORITHMS`` and
``algorithm``) has an entry for each value of a recipe's ``algorithm:`` key: its family
(``offline``: a fixed dataset; ``online``: rollout → reward → advantage → update;
``iterative``), the model kinds it builds, the builder of its trainer, and every other fact
validation and the estimator ask. ``alignax.cli``, ``tools/demo.py`` and the benchmarks
come through here.

A trainer (:class:`~alignax.trainers.offline.trainer.OfflineTrainer` or
:class:`~alignax.trainers.online.trainer.OnlineTrainer`) offers the same four things:
``train()``, ``init_state()`` (the fresh state and its shardings, the template a checkpoint
is restored into), ``evaluate(params, frozen)`` and ``export_models(params, critic=...)``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import jax

from alignax import paths
from alignax import config as config_io
from alignax._checks import check_choice
from alignax.checkpoint import Checkpointer
from alignax.config import ConfigError
from alignax.models import save_pretrained
from alignax.models import registry
from alignax.models.lora import PEFT_FAMILIES, save_peft_adapter
from alignax.parallel import hardware, multihost
from alignax.trainers.algorithms import ALGORITHMS, ALIASES, Algorithm, algorithm, expand_alias
from alignax.trainers.config import TrainConfig, rename_sections
from alignax.trainers.engine import rundir
from alignax.trainers.engine.precision import cast_floating, master_params
from alignax.trainers.engine.session import TrainResult, checkpoint_dir
from alignax.trainers import iterative
from alignax.trainers.offline.trainer import OfflineTrainer
from alignax.trainers.online.trainer import OnlineTrainer
from alignax.trainers.validation import validate

__all__ = ["ALGORITHMS", "Algorithm", "algorithm", "build_trainer", "evaluate", "export", "load_config",
           "restore_params", "train"]


def build_trainer(config: TrainConfig, *, records: Sequence[Mapping] | None = None,
                  with_data: bool = True) -> OfflineTrainer | OnlineTrainer:
    """The trainer of ``config.algorithm`` (models, data, compiled functions).

    ``with_data=False`` (export, benchmarks) skips reading an offline run's data; an online
    trainer always reads its prompts."""
    entry = algorithm(config.algorithm)
    if entry.family == "iterative":
        return entry.make(config, records=records, with_data=with_data)
    if entry.family == "offline":
        return OfflineTrainer(config, task_builder=entry.make, model_kind=entry.model_kinds[0], records=records,
                              with_data=with_data)
    return OnlineTrainer(config, entry.make(config), records=records)


def load_config(path: str | None = None, overrides: Sequence[str] = (), *, data: dict | None = None) -> TrainConfig:
    """``TrainConfig`` from a YAML file (or a dict) plus ``dotted.key=value`` overrides,
    checked before any model or data is read: every key and type
    (:func:`alignax.config.from_dict`; a section under its old name,
    :data:`~alignax.trainers.config.RENAMED_SECTIONS`, is read as the new one with a
    ``DeprecationWarning``), the algorithm's name (an alias such as ``kto`` is the entry
    and keys it stands for, :data:`~alignax.trainers.algorithms.ALIASES`), and the keys across sections
    (:func:`alignax.trainers.validation.validate`: a key the algorithm cannot use, or values
    that disagree, is a ``ConfigError`` naming them)."""
    raw = config_io.load_yaml(path) if path is not None else dict(data or {})
    raw = expand_alias(rename_sections(config_io.apply_overrides(raw, overrides)))
    config = config_io.from_dict(TrainConfig, raw)
    if config.algorithm not in ALGORITHMS:
        raise ConfigError(f"algorithm: {config.algorithm!r} is not a valid choice; valid: "
                          f"{', '.join(map(repr, [*ALGORITHMS, *ALIASES]))}")
    validate(config)
    return config


def train(config: TrainConfig, *, records: Sequence[Mapping] | None = None) -> TrainResult:
    """Run ``config`` to ``train.total_steps`` (resuming from its checkpoints when allowed).

    ``records`` replaces the files of ``data.paths`` (in-memory data, tests and tools).
    ``output_dir`` is claimed first (:func:`alignax.trainers.engine.rundir.claim`), so a
    directory held by another run, an earlier run that would be lost, or a resume with
    unapproved config changes is refused before any model or data is read."""
    multihost.initialize(config.distributed)
    hardware.announce(config)  # before output_dir is claimed: a refused run leaves nothing behind
    with rundir.claim(config):
        return build_trainer(config, records=records).train()


def restore_params(trainer, config: TrainConfig, step: int | None = None, *, master: bool = False):
    """The trained params of a run's checkpoint (the latest when ``step`` is None); with
    ``master``, at the precision the optimiser keeps them (the float32 master copy of
    bfloat16 params, :func:`~alignax.trainers.engine.precision.master_params`)."""
    state = restore_state(trainer, config, step)
    return master_params(state.params, state.opt_state) if master else state.params


def restore_state(trainer, config: TrainConfig, step: int | None = None):
    """The train state of a run's checkpoint (the latest when ``step`` is None): its params,
    and what the state carries besides (a reference that moves during training, TR-DPO).

    A run with no checkpoint is an error naming the directory: evaluating or exporting the
    untrained starting weights by mistake would look like a result."""
    directory = checkpoint_dir(config)
    steps = []
    if paths.as_path(directory).is_dir():
        with Checkpointer(directory) as checkpointer:
            steps = checkpointer.all_steps()
            if steps and (step is None or step in steps):
                template, _ = trainer.init_state()
                # eval and export read a run; they never delete its corrupt steps
                state, _ = checkpointer.restore(template, step, discard_corrupt=False)
                return state
    where = f"step {step}" if step is not None and steps else "checkpoint"
    found = f"; steps there: {', '.join(map(str, sorted(steps)))}" if steps else ""
    raise FileNotFoundError(f"no {where} under {directory} (train the run first, or check output_dir){found}")


def evaluate(config: TrainConfig, *, step: int | None = None,
             records: Sequence[Mapping] | None = None) -> dict[str, float]:
    """Eval figures of a run's checkpoint (latest, or ``step``): the eval split's loss
    figures for offline runs, generation-based figures (``alignax.evaluation``) for online
    runs and for offline runs whose config names ``evaluation.prompts``."""
    multihost.initialize(config.distributed)
    trainer = build_trainer(config, records=records)
    if algorithm(config.algorithm).family == "iterative":  # step: a round
        return trainer.evaluate(step)
    state = restore_state(trainer, config, step)
    return trainer.evaluate(state.params, trainer.eval_frozen(state))


def export(config: TrainConfig, destination: str | None = None, *, step: int | None = None,
           critic: bool = False, dtype: str | None = None) -> str:
    """Write a run's trained model (latest checkpoint, or ``step``) as Hugging Face
    safetensors + tokenizer into ``destination`` (default ``<output_dir>/export``); with
    ``critic`` (PPO with a separate critic), the critic goes to ``<destination>/critic``. A LoRA
    run's model is written merged (``W + s A B``), and its adapter alone in PEFT's format
    under ``<destination>/adapter`` (the families of
    :data:`alignax.models.lora.PEFT_FAMILIES`).

    The trained weights are written as the optimiser holds them: a run with bfloat16 params
    and a float32 master writes the float32 master (the bfloat16 params are its rounding,
    and a fine-tune's updates can be finer than that rounding). ``dtype`` (``float32`` |
    ``bfloat16``) casts them instead; frozen parts (a LoRA base) keep their dtype."""
    multihost.initialize(config.distributed)
    if algorithm(config.algorithm).family == "iterative":  # the rounds export their policies; step: a round
        if dtype is not None:
            raise ValueError("an iterative run's export copies a round's saved policy; --dtype does not apply")
        return iterative.export(config, destination, step=step)
    trainer = build_trainer(config, with_data=False)
    params = restore_params(trainer, config, step, master=True)
    if dtype is not None:
        check_choice("export dtype", dtype, ("float32", "bfloat16"))
        params = cast_floating(params, dtype)
    if jax.process_count() > 1:  # every process takes part in gathering; process 0 writes
        params = multihost.replicated(params, trainer.mesh)
    destination = destination or os.path.join(config.output_dir, "export")
    models = trainer.export_models(params, critic=critic)
    if multihost.is_writer():
        with paths.local_directory_for(destination) as local:  # a gs://... destination: written, then copied up
            for name, model in models.items():
                target = os.path.join(local, name) if name else local
                save_pretrained(model, target)
                trainer.tokenizer.save_pretrained(target)
                if model.config.lora is not None and model.config.model_type in PEFT_FAMILIES:
                    save_peft_adapter(model, os.path.join(target, "adapter"), base_model_name=registry.hub_id(config.model.name),
                                      base_model_revision=registry.hub_revision(config.model.name))
    return destination
