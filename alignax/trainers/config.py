"""The run config: one typed dataclass tree, loaded from YAML with dotted overrides.

A recipe YAML has these sections (every key optional unless noted)::

    algorithm: dpo            # sft | reward | dpo | ppo | grpo   (required)
    output_dir: runs/dpo      # checkpoints, metrics.jsonl, TensorBoard events, export
    model: {...}              # ModelSpec
    data: {...}               # alignax.data.DataConfig
    optim: {...}              # OptimConfig
    train: {...}              # TrainSection
    checkpoint: {...}         # CheckpointSection
    logging: {...}            # LoggingSection
    mesh: {...}               # MeshSection
    sft / reward / dpo / ppo / grpo: {...}   # the chosen algorithm's own settings

``load_config(path, overrides)`` reads it; an unknown or ill-typed key is an error naming
its dotted path and the valid choices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from alignax import config as config_io
from alignax.data import DataConfig
from alignax.ops import AggregationMode
from alignax.trainers.optim import OptimConfig

ALGORITHMS = ("sft", "reward", "dpo", "ppo", "grpo")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which model to train and how to hold it.

    Fields:
      name: a registry name (``smollm2-135m-instruct``) or a local Hugging Face folder
        (config.json + safetensors + tokenizer files).
      random_init: when set, the named model's config.json with these fields replaced,
        randomly initialised (tiny test models; its tokenizer is the named model's).
      seed: seed of random initialisation (and of fresh heads).
      param_dtype / dtype: storage and compute dtypes; log-probs and losses are float32.
      scan_layers: scan over stacked layers (fast compiles for deep models).
      remat: rematerialise layers in the backward pass (less memory, more compute).
      logprob_chunk_size: compute token log-probs this many positions at a time from
        the final hidden states, never holding ``[B, T, V]`` float32 logits; ``null``:
        the whole sequence at once.
    """

    name: str = "smollm2-135m-instruct"
    random_init: dict[str, Any] | None = None
    seed: int = 0
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    dtype: Literal["float32", "bfloat16"] = "float32"
    scan_layers: bool = False
    remat: bool = False
    logprob_chunk_size: int | None = None


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """Fields:
      total_steps: optimiser steps.
      grad_accum_steps: micro-batches per step (the data batch is split evenly).
      seed: RNG seed of the run (dropout-free models use it for sampling only).
      log_every / eval_every / save_every: in steps (0 disables periodic eval/saves;
        the run still evaluates and saves at its end).
      max_nonfinite_streak: stop after this many skipped non-finite updates in a row.
      eval_batches: cap on eval batches per evaluation (``null``: the whole eval split).
    """

    total_steps: int = 100
    grad_accum_steps: int = 1
    seed: int = 0
    log_every: int = 1
    eval_every: int = 0
    save_every: int = 0
    max_nonfinite_streak: int = 5
    eval_batches: int | None = None

    def __post_init__(self):
        for name in ("total_steps", "grad_accum_steps", "log_every", "max_nonfinite_streak"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1; got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """Fields: ``enabled``; ``keep`` (newest steps kept); ``async_save``; ``resume``
    (continue from the latest checkpoint in ``output_dir/checkpoints`` when one exists)."""

    enabled: bool = True
    keep: int = 3
    async_save: bool = True
    resume: bool = True


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    """Fields: ``console`` (progress bar / lines), ``jsonl`` (``metrics.jsonl``),
    ``tensorboard`` (event files under ``tensorboard/``), ``console_keys``."""

    console: bool = True
    jsonl: bool = True
    tensorboard: bool = True
    console_keys: tuple[str, ...] = ("loss", "rewards/accuracies", "rewards/margins", "grad_norm")


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """``shape``: sizes of the mesh axes ``(data, fsdp, tensor)``; one may be -1 (the
    remaining devices). The default puts every device on ``fsdp``."""

    shape: tuple[int, int, int] = (1, -1, 1)


@dataclasses.dataclass(frozen=True)
class SFTSection:
    """``aggregation``: how token NLLs reduce to the loss (``alignax.ops.aggregate``)."""

    aggregation: AggregationMode = "token-mean"


@dataclasses.dataclass(frozen=True)
class RewardSection:
    """Bradley-Terry reward model. ``center_coef``: TRL's centring term weight;
    ``use_margin``: subtract the record's ``margin`` field (Llama 2) when present."""

    center_coef: float = 0.0
    use_margin: bool = False


@dataclasses.dataclass(frozen=True)
class PreferenceSection:
    """Offline preference optimisation.

    Fields:
      loss: ``dpo`` | ``simpo`` | ``cpo`` | ``orpo`` | ``kto``.
      variant: the DPO variant (``sigmoid``, ``hinge``, ``ipo``, ``robust``, ``dpop``,
        ``exo_pair``, ``nca_pair``, ``sppo_hard``, ``apo_zero``, ``apo_down``).
      beta, label_smoothing, dpop_lambda: DPO family hyper-parameters.
      simpo_gamma: SimPO's target margin; cpo_alpha: CPO's NLL weight.
      kto_desirable_weight / kto_undesirable_weight: KTO class weights.
      reference: ``live`` (the frozen reference runs beside the policy each step) or
        ``precomputed`` (one pass over the data before training; no reference in memory
        during training). Reference-free losses (simpo, cpo, orpo) ignore it.
    """

    loss: Literal["dpo", "simpo", "cpo", "orpo", "kto"] = "dpo"
    variant: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    dpop_lambda: float = 50.0
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0
    kto_desirable_weight: float = 1.0
    kto_undesirable_weight: float = 1.0
    reference: Literal["live", "precomputed"] = "live"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A whole run; see the module docstring for the YAML layout."""

    algorithm: Literal["sft", "reward", "dpo", "ppo", "grpo"]
    output_dir: str = "runs/default"
    model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    logging: LoggingSection = dataclasses.field(default_factory=LoggingSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    sft: SFTSection = dataclasses.field(default_factory=SFTSection)
    reward: RewardSection = dataclasses.field(default_factory=RewardSection)
    dpo: PreferenceSection = dataclasses.field(default_factory=PreferenceSection)


def load_config(path: str | None = None, overrides: Sequence[str] = (), *, data: dict | None = None) -> TrainConfig:
    """``TrainConfig`` from a YAML file (or a dict) plus ``dotted.key=value`` overrides."""
    raw = config_io.load_yaml(path) if path is not None else dict(data or {})
    raw = config_io.apply_overrides(raw, overrides)
    return config_io.from_dict(TrainConfig, raw)
