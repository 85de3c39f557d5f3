"""The run config: one typed dataclass tree, loaded from YAML with dotted overrides.

A recipe YAML has these sections (every key optional unless noted)::

    algorithm: dpo            # a name of alignax.trainers.api.ALGORITHMS   (required)
    output_dir: runs/dpo      # checkpoints, metrics.jsonl, TensorBoard events, export
    model: {...}              # ModelSpec
    precision: {...}          # PrecisionConfig: parameter, compute, master, moment and frozen dtypes
    placement: {...}          # alignax.parallel.placement.PlacementConfig: frozen models in device or host memory
    lora: {...}               # alignax.models.lora.LoraConfig: train low-rank adapters only (null: all params)
    data: {...}               # alignax.data.DataConfig
    optim: {...}              # OptimConfig
    train: {...}              # TrainSection
    checkpoint: {...}         # CheckpointSection
    logging: {...}            # LoggingSection
    mesh: {...}               # MeshSection
    sft / reward_model / prm / preference / iterative / ppo / grpo / distill: {...}   # the chosen algorithm's own settings
    rollout / rewards: {...}  # online RL (ppo, grpo): generation and the reward function
    evaluation: {...}         # alignax.evaluation.EvaluationConfig: greedy accuracy, pass@k
    env: {...}                # alignax.envs.EnvConfig: multi-turn rollouts with an environment and tools
    monitor: {...}            # MonitorSection: online alarms and their actions, KL budget, gold signal

``alignax.trainers.api.load_config(path, overrides)`` reads it; an unknown or ill-typed
key is an error naming its dotted path and the valid choices, and so is a key the
algorithm cannot use (:mod:`alignax.trainers.validation`).

Renamed sections (:data:`RENAMED_SECTIONS`): ``dpo:`` is ``preference:`` (it holds the whole
offline preference family: DPO and its variants, SimPO, CPO, ORPO, KTO) and ``reward:`` is
``reward_model:`` (training a Bradley-Terry reward model; ``rewards:`` is how online runs
score completions). The old names load for one release with a ``DeprecationWarning`` naming
the new key (:func:`rename_sections`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any, Literal

from alignax.config import ConfigError
from alignax.data import DataConfig
from alignax.trackers import MlflowSection, WandbSection
from alignax.envs.config import EnvConfig
from alignax.evaluation import EvaluationConfig
from alignax.models.lora import LoraConfig
from alignax.losses.policy import check_rejection, check_rejection_divergences
from alignax.ops import AggregationMode
from alignax.parallel.multihost import DistributedConfig
from alignax.parallel.placement import PlacementConfig
from alignax.rewards.composite import RewardConfig

DtypeName = Literal["float32", "bfloat16"]


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """Which dtype holds what.

    Fields:
      param_dtype: storage of the trained weights the model computes from.
      compute_dtype: activations and matmuls (weights are cast to it where they are
        used). Logits, log-probs, losses and the optimiser stay float32 (:mod:`alignax.trainers.engine.precision`).
      master_dtype: with ``param_dtype: bfloat16``, the optimiser keeps the weights in this
        dtype in its state (so checkpoints carry them), applies updates there and writes
        their bfloat16 rounding back to the params. ``null``: updates are added to the
        bfloat16 params directly, and any update smaller than half a weight's bfloat16
        spacing (0.2 % of the weight) is lost; saves 4 bytes per parameter.
      mu_dtype: Adam's first moment (optax's ``mu_dtype``). The second moment stays
        float32: its running average moves by ``1 - b2`` (0.1 % at ``b2 = 0.999``) a step,
        less than half a bfloat16 spacing, so a bfloat16 second moment could never decay.
      frozen_dtype: the reference policy and reward models (weights; reward models compute
        in float32); ``null``: ``param_dtype``.
    """

    param_dtype: DtypeName = "float32"
    compute_dtype: DtypeName = "float32"
    master_dtype: Literal["float32"] | None = "float32"
    mu_dtype: DtypeName = "float32"
    frozen_dtype: DtypeName | None = None

    def model_dtypes(self) -> dict[str, str]:
        """``param_dtype`` and ``dtype`` (compute) as :class:`alignax.models.ModelConfig` names them."""
        return {"param_dtype": self.param_dtype, "dtype": self.compute_dtype}

    @property
    def frozen(self) -> str:
        """The dtype frozen models are held in."""
        return self.frozen_dtype or self.param_dtype


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimiser settings.

    Fields:
      name: ``adamw`` | ``adam`` | ``sgd``.
      learning_rate: peak learning rate, reached after ``warmup_steps``.
      schedule: ``constant`` | ``cosine`` | ``linear`` decay after warmup, to
        ``learning_rate * min_lr_ratio`` at the last step.
      warmup_steps: linear warmup from 0.
      weight_decay: decoupled weight decay (AdamW), applied to parameters of rank >= 2
        only — never to norms or biases.
      b1, b2, eps: Adam moments.
      max_grad_norm: clip the global gradient norm; ``null`` disables clipping.
    """

    name: Literal["adamw", "adam", "sgd"] = "adamw"
    learning_rate: float = 1e-5
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0

    def __post_init__(self):
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0; got {self.learning_rate}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0; got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1]; got {self.min_lr_ratio}")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which model to train and how to hold it.

    Fields:
      name: a registry name (``smollm2-135m-instruct``) or a local Hugging Face folder
        (config.json + safetensors + tokenizer files).
      random_init: when set, the named model's config.json with these fields replaced,
        randomly initialised (tiny test models; its tokenizer is the named model's).
      seed: seed of random initialisation (and of fresh heads).
      param_dtype / dtype: no longer read (an error when set): the dtypes are the
        ``precision`` section's (``precision.param_dtype``, ``precision.compute_dtype``).
      scan_layers: scan over stacked layers (fast compiles for deep models).
      remat: what each layer keeps for the backward pass (less memory, more compute):
        ``none`` | ``full`` | ``dots_saveable`` | ``dots_with_no_batch_dims_saveable`` |
        ``offload_dots`` (see :data:`alignax.models.config.REMAT_POLICIES`); ``true`` is
        ``full``, ``false`` is ``none``.
      attention: ``xla`` (scores materialised by XLA; every backend) | ``cudnn`` (cuDNN's
        fused kernel through ``jax.nn.dot_product_attention``; GPU, bfloat16 compute) |
        ``splash`` (the Pallas splash kernel; TPU; no shared-prompt packing of groups) |
        ``auto`` (``cudnn`` on a GPU with bfloat16 compute, ``splash`` on a TPU, else
        ``xla``). Decode steps and prefills into the sampler's cache use ``xla``.
      router_aux_loss_coef: a mixture-of-experts model's weight on the load-balancing loss
        every trainer adds to its objective (:mod:`alignax.models.moe`; logged as
        ``moe/aux_loss``, unscaled); ``null``: the checkpoint's ``router_aux_loss_coef``
        (transformers' default 0.001). An error on a dense model.
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
    remat: bool | Literal["none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "offload_dots"] = "none"
    attention: Literal["xla", "cudnn", "splash", "auto"] = "xla"
    logprob_chunk_size: int | None = None
    router_aux_loss_coef: float | None = None

    def __post_init__(self):
        if self.router_aux_loss_coef is not None and not self.router_aux_loss_coef >= 0:
            raise ValueError(f"model.router_aux_loss_coef must be >= 0 (or null); got {self.router_aux_loss_coef}")
        if isinstance(self.remat, bool):
            object.__setattr__(self, "remat", "full" if self.remat else "none")


@dataclasses.dataclass(frozen=True)
class TrainSection:
    """Fields:
      total_steps: optimiser steps.
      grad_accum_steps: micro-batches per step (the data batch is split evenly).
      seed: RNG seed of the run (dropout-free models use it for sampling only).
      log_every / eval_every / save_every: in steps (0 disables periodic eval/saves;
        the run still evaluates and saves at its end).
      max_nonfinite_streak: stop after this many skipped non-finite updates in a row.
      max_stalled_streak: stop after this many stalled updates in a row — a zero gradient
        with a non-zero loss, or loss and gradient norm exactly equal to the previous step's
        (a diverged model whose logits collapsed); 0 turns the alarm off. Checkpoints are
        not written during a streak, so the last one saved before it is kept.
      eval_batches: cap on eval batches per evaluation (``null``: the whole eval split).
    """

    total_steps: int = 100
    grad_accum_steps: int = 1
    seed: int = 0
    log_every: int = 1
    eval_every: int = 0
    save_every: int = 0
    max_nonfinite_streak: int = 5
    max_stalled_streak: int = 5
    eval_batches: int | None = None

    def __post_init__(self):
        for name in ("total_steps", "grad_accum_steps", "log_every", "max_nonfinite_streak"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1; got {getattr(self, name)}")
        if self.max_stalled_streak < 0:
            raise ValueError(f"train.max_stalled_streak must be >= 0 (0: off); got {self.max_stalled_streak}")


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """Fields:
      enabled: write checkpoints under ``output_dir/checkpoints``.
      keep: newest steps kept on disk (>= 1).
      async_save: write arrays in the background while training goes on.
      resume: continue from the latest checkpoint of ``output_dir`` when one exists. With
        ``resume: false`` a directory that already holds a run is refused unless
        ``overwrite`` is set.
      overwrite: replace the run in ``output_dir`` (its checkpoints, metrics, TensorBoard
        files, evaluation reports, export and configs) with a fresh one
        (``alignax train --overwrite``).
      allow_changes: resume although the config differs from the one the run was started
        with in keys that change what is trained (optimiser, schedule, data, algorithm); the
        changes are logged and the former config kept as ``config.<n>.yaml``
        (``alignax train --allow-changes``).
      resume_step: resume from this step instead of the latest intact one; newer steps are
        removed so the resumed run can save there (``alignax train --step N``).
    """

    enabled: bool = True
    keep: int = 3
    async_save: bool = True
    resume: bool = True
    overwrite: bool = False
    allow_changes: bool = False
    resume_step: int | None = None


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    """Fields: ``console`` (progress bar / lines), ``jsonl`` (``metrics.jsonl``),
    ``tensorboard`` (event files under ``tensorboard/``), ``console_keys`` (the figures on
    the progress line; ``null``: the algorithm's own choice), ``wandb`` / ``mlflow`` (an
    experiment tracker's settings; null: off; :mod:`alignax.trackers`)."""

    console: bool = True
    jsonl: bool = True
    tensorboard: bool = True
    console_keys: tuple[str, ...] | None = None
    wandb: WandbSection | None = None
    mlflow: MlflowSection | None = None


@dataclasses.dataclass(frozen=True)
class MeshSection:
    """``shape``: sizes of the mesh axes ``(data, fsdp, tensor)``; one may be -1 (the
    remaining devices). The default puts every device on ``fsdp``.

    ``dcn_shape``: a multi-slice mesh (TPU slices joined by the data-centre network; on
    GPUs and CPUs each process counts as a slice): the sizes of the axes across slices,
    ``shape`` then being the mesh within one slice, so axis ``i`` has ``shape[i] *
    dcn_shape[i]`` devices. E.g. ``shape: [1, -1, 1]`` and ``dcn_shape: [2, 1, 1]`` on two
    slices: FSDP within a slice, data parallel across (only gradients cross the slow
    links). See :func:`alignax.parallel.sharding.hybrid_mesh`."""

    shape: tuple[int, int, int] = (1, -1, 1)
    dcn_shape: tuple[int, int, int] | None = None


@dataclasses.dataclass(frozen=True)
class SFTSection:
    """``aggregation``: how token NLLs reduce to the loss (``alignax.ops.aggregate``)."""

    aggregation: AggregationMode = "token-mean"


@dataclasses.dataclass(frozen=True)
class RewardModelSection:
    """Bradley-Terry reward model. ``center_coef``: TRL's centring term weight;
    ``use_margin``: subtract the record's ``margin`` field (Llama 2); every record must
    carry one (a record without it is a data error naming the record)."""

    center_coef: float = 0.0
    use_margin: bool = False


@dataclasses.dataclass(frozen=True)
class PRMSection:
    """Process reward model (``alignax.losses.process.prm_loss``): ``aggregation`` of the
    per-step cross-entropies (``token-mean``: every step alike; ``seq-mean-token-mean``:
    every solution alike)."""

    aggregation: AggregationMode = "token-mean"


@dataclasses.dataclass(frozen=True)
class IterativeSection:
    """Iterative DPO (``algorithm: iterative_dpo``; each round's training reads the
    ``preference:`` section). ``rounds``: sample-label-train rounds;
    ``reference``: each round's DPO reference, ``previous`` (the policy the round starts
    from) or ``original`` (the model named by ``model``)."""

    rounds: int = 2
    reference: Literal["previous", "original"] = "previous"

    def __post_init__(self):
        if self.rounds < 1:
            raise ValueError(f"iterative.rounds must be >= 1; got {self.rounds}")


@dataclasses.dataclass(frozen=True)
class SyncRefSection:
    """TR-DPO's reference updates (Gorbatovski et al. 2024, "Learn Your Reference Model for Real
    Good Alignment", the soft update): after every ``tau``-th step the reference becomes
    ``alpha * policy + (1 - alpha) * reference``; between updates it is a frozen input. It is
    part of the train state, so checkpoints carry it. TRL: ``ref_model_mixup_alpha`` (0.6),
    ``ref_model_sync_steps`` (512)."""

    alpha: float = 0.6
    tau: int = 512

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"preference.sync_ref.alpha must be in [0, 1]; got {self.alpha}")
        if self.tau < 1:
            raise ValueError(f"preference.sync_ref.tau must be >= 1 (steps); got {self.tau}")


@dataclasses.dataclass(frozen=True)
class PreferenceSection:
    """Offline preference optimisation (the ``preference:`` section; ``dpo:`` before).

    Fields:
      loss: ``dpo`` | ``simpo`` | ``cpo`` | ``orpo`` | ``kto``.
      variant: the DPO variant (``sigmoid``, ``hinge``, ``ipo``, ``robust``, ``dpop``,
        ``exo_pair``, ``nca_pair``, ``sppo_hard``, ``apo_zero``, ``apo_down``, ``bco_pair``,
        ``aot``, ``aot_unpaired``, ``discopop``, ``sigmoid_norm``), or a list of them and
        ``sft`` (the chosen responses' NLL): a weighted mixture (MPO: ``[sigmoid, bco_pair,
        sft]``), ``loss_weights`` one weight each (default 1).
      beta, label_smoothing, dpop_lambda: DPO family hyper-parameters; discopop_tau:
        DiscoPOP's temperature.
      rpo_alpha: RPO's NLL term on the chosen responses at this weight (``null``: none).
      f_divergence / f_alpha: f-DPO's divergence (``reverse_kl`` is DPO; ``forward_kl``,
        ``js``, ``alpha`` with ``f_alpha``, TRL's ``f_alpha_divergence_coef``).
      use_weighting: WPO's per-pair weights from the policy's own probabilities.
      ld_alpha: LD-DPO: tokens past the pair's shared length count ``ld_alpha`` (``null``: off).
      sync_ref: TR-DPO (:class:`SyncRefSection`): the reference moves towards the policy
        every ``tau`` steps (``null``: a fixed reference).
      simpo_gamma: SimPO's target margin; cpo_alpha: CPO's NLL weight.
      kto_desirable_weight / kto_undesirable_weight: KTO class weights.
      reference: ``live`` (the frozen reference runs beside the policy each step) or
        ``precomputed`` (one pass over the data before training; no reference in memory
        during training); ``precomputed`` is an error with simpo, cpo, orpo.
      Keys the chosen loss does not read are an error when the config loads.
    """

    loss: Literal["dpo", "simpo", "cpo", "orpo", "kto"] = "dpo"
    variant: str | tuple[str, ...] = "sigmoid"
    loss_weights: tuple[float, ...] | None = None
    beta: float = 0.1
    label_smoothing: float = 0.0
    dpop_lambda: float = 50.0
    discopop_tau: float = 0.05
    rpo_alpha: float | None = None
    f_divergence: Literal["reverse_kl", "forward_kl", "js", "alpha"] = "reverse_kl"
    f_alpha: float = 0.5
    use_weighting: bool = False
    ld_alpha: float | None = None
    sync_ref: SyncRefSection | None = None
    simpo_gamma: float = 0.5
    cpo_alpha: float = 1.0
    kto_desirable_weight: float = 1.0
    kto_undesirable_weight: float = 1.0
    reference: Literal["live", "precomputed"] = "live"


@dataclasses.dataclass(frozen=True)
class DistillSection:
    """Distillation from a frozen teacher (``algorithm: distill`` on the dataset's sequences;
    ``algorithm: gkd`` also on the student's own samples), :mod:`alignax.losses.distill`.

    Fields:
      teacher: the teacher model (a :class:`ModelSpec`: a folder or registry name); its
        tokenizer must be the student's. It may differ from the student in size.
      divergence: ``forward_kl`` (``KL(teacher || student)``), ``reverse_kl`` or ``jsd``
        (GKD's generalised JSD at ``beta``: 0 is forward KL, 1 reverse KL).
      beta: the JSD's interpolation, in ``[0, 1]``.
      temperature: divides both models' logits in the loss (and the student's when it
        samples, ``gkd``).
      top_k: keep only the teacher's ``top_k`` most likely tokens a position (sparse
        teacher logits, a forward KL); ``None``: the whole vocabulary.
      teacher_logits: ``live`` (the teacher runs on every batch) or ``precomputed`` (its
        top-``k`` log-probs of every record computed once before training and kept as a
        table, like DPO's precomputed reference; needs ``top_k``).
      lmbda: ``gkd``: the probability that a step trains on the student's own samples of
        the batch's prompts rather than the dataset's responses (GKD's ``lambda``).
      aggregation: how per-token divergences reduce (``alignax.ops.aggregate``).
    """

    teacher: ModelSpec | None = None
    divergence: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    beta: float = 0.5
    temperature: float = 1.0
    top_k: int | None = None
    teacher_logits: Literal["live", "precomputed"] = "live"
    lmbda: float = 0.5
    aggregation: AggregationMode = "token-mean"

    def __post_init__(self):
        if not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"distill.beta must lie in [0, 1]; got {self.beta}")
        if not 0.0 <= self.lmbda <= 1.0:
            raise ValueError(f"distill.lmbda must lie in [0, 1]; got {self.lmbda}")
        if not self.temperature > 0:
            raise ValueError(f"distill.temperature must be > 0; got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"distill.top_k must be >= 1 (or null: the whole vocabulary); got {self.top_k}")


@dataclasses.dataclass(frozen=True)
class OnPolicyDistillSection:
    """On-policy distillation on the online trainer (``algorithm: onpolicy_distill``,
    :mod:`alignax.trainers.online.distill`): the student samples ``rollout.num_samples``
    completions of each prompt (the rollout section: budget, temperature, async), the frozen
    teacher (``distill.teacher``, held like the reference) scores every sampled position, and
    the loss is the per-token reverse KL ``KL(p_student || p_teacher)`` at
    ``rollout.temperature``.

    Fields:
      estimator: ``exact`` (default): the reverse KL over the whole vocabulary from both
        models' logits at each sampled position (no sampling noise beyond the positions
        themselves); ``sampled``: its one-sample estimate ``log p_s(y_t) - log p_t(y_t)`` of
        the sampled token as the token's negative advantage under PPO-clip (as verl, slime
        and Tinker run it: the teacher hands back one log-prob a token, so it may sit on
        ``placement.reference: submesh``).
      aggregation: how per-token losses reduce (``alignax.ops.aggregate``).
      epochs / minibatches: passes over each rollout, and minibatches per pass.
    """

    estimator: Literal["exact", "sampled"] = "exact"
    aggregation: AggregationMode = "token-mean"
    epochs: int = 1
    minibatches: int = 1


@dataclasses.dataclass(frozen=True)
class AsyncSection:
    """Asynchronous, bounded-staleness rollouts (``rollout.async``;
    ``alignax.trainers.online.schedule``).

    Fields:
      max_staleness: ``k``, how many updates the sampler's weights may lag the learner's.
        ``0``: today's synchronous loop (sample with the current weights, then update).
        ``k >= 1``: while the learner updates on batch ``t`` a background thread samples
        batch ``t + k`` with the weights of version ``t`` (time-sliced on the sampler's
        devices: ``rollout.mesh``, else the training mesh); every batch records the version
        it was sampled with, and none is used more than ``k`` versions old. The loss reads
        the sampler's (behaviour) log-probs: as the old ones under
        ``rollout.old_logps: sampler``, or through the ``rollout.tis_cap`` weight under
        ``recompute``.
      devices: how many devices the sampler gets for itself (``0``, the default: none,
        time-sliced). The last ``devices / P`` devices of each of the ``P`` processes (after
        a ``placement.submesh``'s) form the sampler's group, laid out as ``rollout.mesh``
        (``null``: the training mesh's shape); the learner's mesh (``mesh:``) spans the rest,
        which must be as many devices as the sampler's (the weights move one shard to one
        device: ``alignax.trainers.online.actors.Actors.sampling_state``). On one device per
        process there is one group: time-sliced, with a warning.
    """

    max_staleness: int = 0
    devices: int = 0

    def __post_init__(self):
        if self.max_staleness < 0:
            raise ValueError(f"rollout.async.max_staleness must be >= 0 (0: synchronous); got {self.max_staleness}")
        if self.devices < 0:
            raise ValueError(f"rollout.async.devices must be >= 0 (0: time-sliced on the training devices); "
                             f"got {self.devices}")


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    """Generation for online RL (the on-device sampler).

    Fields:
      max_new_tokens: response budget ``N``.
      temperature / top_k / top_p: the sampling distribution. The trainer's log-probs use
        the same temperature (the policy optimised is the tempered one, as in TRL/verl).
      num_samples: completions per prompt, the group size ``G`` (1 for PPO).
      stop_token_ids: ids ending a completion; ``null``: the tokenizer's EOS.
      old_logps: ``recompute`` (a forward pass of the policy before the update; exact
        on-policy ratios) or ``sampler`` (the sampler's log-probs, no extra pass). The
        mismatch between the two is measured every step either way. With one update per
        rollout (1 epoch x 1 minibatch) and nothing before it reading the policy (GRPO
        with the KL in the loss), ``recompute`` costs no extra pass: the update's own
        forward pass is that policy, so its log-probs, gradient stopped, are the old ones.
      tis_cap: truncated importance weight ``min(pi_old / pi_sampler, cap)`` on the loss,
        correcting sampler/trainer mismatch (``null``: off). With ``old_logps: sampler``
        (verl's bypass mode) only an objective without a ratio of its own (``pg``, ``gpg``,
        ``dro``) takes it, as ``min(sg(pi_theta) / pi_sampler, cap)``: REINFORCE with explicit
        IS weights; a ratio objective's ratio is already ``pi_theta / pi_sampler``.
      tis_level: ``token`` (each token's ratio) or ``sequence`` (the product over the
        completion, on each of its tokens), verl's ``rollout_is``.
      tis_lower: IcePop (verl's ``rollout_is_threshold: "lower_upper"``): the weight is the
        ratio itself inside ``[tis_lower, tis_cap]`` and 0 outside, in place of
        ``min(ratio, tis_cap)``; a weight, not a rejection mask (it counts in
        ``tis_batch_normalize``'s mean). ``null`` (default): the truncated weight.
      tis_batch_normalize: divide the truncated weights by their mean, so that they average 1
        (verl's ``rollout_is_batch_normalize``): over the response tokens (``tis_level:
        token``) or over the completions (``sequence``) of each micro-batch the loss sees,
        on every device (``alignax.losses.sampler_correction``). The optimal token
        baseline's ``w^2`` (decoupled mode) reads the weights normalised over the whole
        rollout, at pricing: the two means differ when ``minibatches`` or
        ``train.grad_accum_steps`` split the rollout (verl takes one batch-level mean for
        both). ``false`` (default): off.
      rejection / rejection_bounds: verl's rejection masks (``rollout_rs`` ``token_k1``,
        ``seq_sum_k1``, ``seq_mean_k1``): drop the policy term of a token whose ratio
        (``token``), whose completion's ratio product (``sequence``) or per-token geometric
        mean (``geometric``) to the sampler falls outside ``[lo, hi]`` (``(0.5, 2.0)``, ours).
        The ratio is the one ``tis_cap`` weighs by. Several at once, each with its own
        bounds: a mapping ``{criterion: [lo, hi]}``, e.g. ``{token: [0.5, 2.0], geometric:
        [0.9, 1.1]}`` (verl's ``rollout_rs: "token_k1,seq_mean_k1"`` with
        ``rollout_rs_threshold`` per option), with no ``rejection_bounds`` beside it; a token
        is kept only if every criterion keeps it. ``null``: no rejection.
      rejection_divergences: verl's divergence criteria (``rollout_rs`` ``token_k2``,
        ``token_k3``, ``seq_sum_k2`` ... ``seq_max_k3``) as ``{criterion: upper bound}``, e.g.
        ``{seq_max_k2: 2.5, token_k3: 0.1}``: drop the policy term of a token whose
        ``k2 = (log rho)^2 / 2`` or ``k3 = rho - 1 - log rho`` to the sampler (``rho`` the ratio
        ``tis_cap`` weighs by), or its completion's sum / mean / max of them, exceeds the bound
        (``alignax.losses.sampler_correction``). A token is kept only if every criterion, and
        ``rejection``, keeps it (verl's comma-separated ``rollout_rs`` with one
        ``rollout_rs_threshold`` each). A mapping rather than a list beside ``rejection_bounds``:
        each bound sits by its criterion, a criterion cannot be given twice, and the k2 / k3
        bounds (a divergence, >= 0) are one number where the k1 ones are a ratio interval.
        ``null`` (default): none.
      pack_groups: run the ``G`` completions of a prompt as one row holding the prompt
        once (``alignax.trainers.engine.packing``) in the trainer's forward passes (policy,
        reference, update); the outputs are the unpacked ones, the trunk sees
        ``P + G N`` tokens instead of ``G (P + N)``. ``auto``: when ``G > 1`` and the
        forward FLOPs (projections + dense attention) drop with attention scores at most
        twice the unpacked ones (``packing.group_packing_pays``); ``on``: whenever
        ``G > 1``; ``off``: never. Packed updates draw whole groups into minibatches.
      mesh: the sampler's own mesh ``(data, fsdp, tensor)`` over the same devices (one entry
        may be -1), e.g. ``[-1, 1, 8]`` on hosts of 8 accelerators: tensor parallel within a
        host, data parallel across hosts, no weight gathered per decoded token. The
        sampler decodes from a copy of the policy with its kernels in
        ``precision.compute_dtype``, laid out for this mesh by the logical-axis rules and
        remade after every update (``alignax.trainers.engine.precision.compute_copy``).
        ``null``: the training mesh (and, when ``precision.compute_dtype`` differs from
        ``precision.param_dtype``, that compute-dtype copy on it; else the training
        weights themselves, no copy).
      async: asynchronous rollouts (:class:`AsyncSection`).
      max_logprob_gap: stop the run (``LogprobGapError``) before training on a rollout
        whose largest per-token gap between the sampler's log-probs and the learner's
        recomputation of them exceeds this many nats
        (:mod:`alignax.trainers.online.agreement`; measured either way, as
        ``agreement/<compute dtype>/gap_*``). ``null`` (default): measured, not enforced.
        Measured bounds per dtype: docs/sampler-agreement.md.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    num_samples: int = 8
    stop_token_ids: tuple[int, ...] | None = None
    old_logps: Literal["recompute", "sampler"] = "recompute"
    tis_cap: float | None = None
    tis_level: Literal["token", "sequence"] = "token"
    tis_lower: float | None = None
    tis_batch_normalize: bool = False
    rejection: Literal["token", "sequence", "geometric"] | dict[str, tuple[float, float]] | None = None
    rejection_bounds: tuple[float, float] = (0.5, 2.0)
    rejection_divergences: dict[str, float] | None = None
    pack_groups: Literal["auto", "on", "off"] = "auto"
    mesh: tuple[int, int, int] | None = None
    async_: AsyncSection = dataclasses.field(default_factory=AsyncSection)  # the key ``rollout.async``
    max_logprob_gap: float | None = None

    def __post_init__(self):
        check_rejection(self.rejection, self.rejection_bounds, key="rollout.rejection",
                        bounds_key="rollout.rejection_bounds")
        check_rejection_divergences(self.rejection_divergences, key="rollout.rejection_divergences")
        if self.tis_lower is not None and not 0 < self.tis_lower <= (self.tis_cap or math.inf):
            raise ValueError(f"rollout.tis_lower must be > 0 and <= rollout.tis_cap ({self.tis_cap}): IcePop's bounds "
                             f"on the ratio; got {self.tis_lower}")
        if self.max_logprob_gap is not None and not self.max_logprob_gap > 0:
            raise ValueError(f"rollout.max_logprob_gap must be > 0 nats (null: not enforced); "
                             f"got {self.max_logprob_gap}")


@dataclasses.dataclass(frozen=True)
class PolicyUpdateSection:
    """What the online families (``grpo:``, ``ppo:``) share: the KL to the reference, the
    entropy bonus, the loss aggregation, the passes over a rollout and the upper clips. Each
    family's section sets its own defaults (its papers').

    Fields:
      kl_coef / kl_kind / kl_placement: the KL to the reference (``alignax.kl``, per token),
        in the ``loss`` or subtracted from the ``reward``; ``kl_coef: 0`` drops the reference.
      kl_importance_weight: with the KL in the loss, multiply each token's KL estimate by
        ``pi_theta / pi_old`` (``alignax.kl.importance_weighted_kl``; DeepSeek-V3.2, TRL's
        ``use_bias_correction_kl``), which keeps it unbiased when the tokens came from an
        older policy (``epochs > 1``, ``rollout.old_logps: sampler``, asynchronous
        rollouts). ``ratio``: the weight is differentiated (TRL's and the paper's form: the
        gradient becomes that of KL(pi_theta || ref), on-policy too); ``detached_ratio``: it
        is not (on-policy, value and gradient are exactly the unweighted ones). ``none``
        (the default, as TRL's): unweighted, so existing runs and TRL ports keep their
        update; docs/importance-weighted-kl.md says when to switch.
      off_policy_mask_threshold: DeepSeek-V3.2's off-policy sequence masking (TRL's key of
        that name): a negative-advantage token loses its policy term when its completion's
        mean per-token ``log pi_old - log pi_theta`` exceeds this many nats
        (``alignax.losses.off_policy_sequence_mask``); it acts only off-policy (``epochs >
        1``, ``rollout.old_logps: sampler``). ``null`` (default): off. It must be ``> 0``:
        on-policy, ``pi_old`` (the pricing pass) and ``pi_theta`` (the update's forward) are
        the same weights through two compiled programs, equal only to float32 rounding, so 0
        would mask sequences on that rounding alone (TRL's example is 0.5).
      top_entropy_quantile: only the tokens in this top fraction of entropy keep their policy
        term ("Beyond the 80/20 Rule" keeps 0.2; TRL's key; ``alignax.losses.high_entropy_mask``);
        ``null`` (default): every token.
      adaptive_kl / kl_target / kl_horizon: Ziegler et al. 2019's adaptive coefficient,
        steering the sequence KL towards ``kl_target``.
      entropy_coef: entropy bonus.
      aggregation: loss aggregation (``alignax.ops.aggregate``).
      epochs / minibatches: passes over each rollout, and minibatches per pass.
      clip_eps_high / dual_clip_c: DAPO's clip-higher and the dual clip (Ye et al. 2020) for
        negative advantages; ``null``: the family's own default (below).
    """

    kl_coef: float = 0.0
    kl_kind: Literal["k1", "k2", "k3", "abs"] = "k1"
    kl_placement: Literal["loss", "reward"] = "loss"
    kl_importance_weight: Literal["none", "ratio", "detached_ratio"] = "none"
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float | None = None
    adaptive_kl: bool = False
    kl_target: float = 6.0
    kl_horizon: float = 10000.0
    entropy_coef: float = 0.0
    aggregation: AggregationMode = "token-mean"
    epochs: int = 1
    minibatches: int = 1
    clip_eps_high: float | None = None
    dual_clip_c: float | None = None

    def __post_init__(self):
        section = "ppo" if isinstance(self, PPOSection) else "grpo"
        if self.off_policy_mask_threshold is not None and not self.off_policy_mask_threshold > 0:
            raise ValueError(f"{section}.off_policy_mask_threshold must be > 0 nats (null: off; 0 would mask "
                             "on-policy sequences on the float32 rounding between the pricing pass and the "
                             f"update's forward); got {self.off_policy_mask_threshold}")
        if self.top_entropy_quantile is not None and not 0 < self.top_entropy_quantile <= 1:
            raise ValueError(f"{section}.top_entropy_quantile must be in (0, 1] (null: every token); "
                             f"got {self.top_entropy_quantile}")


@dataclasses.dataclass(frozen=True)
class GRPOSection(PolicyUpdateSection):
    """The GRPO family from one config (with :class:`PolicyUpdateSection`'s fields).

    Fields:
      advantage: an advantage estimator of :data:`alignax.estimators.ESTIMATORS`: ``grpo`` |
        ``dr_grpo`` | ``rloo`` | ``reinforce_pp`` | ``remax`` | ``process`` (step rewards at step
        boundaries, DeepSeekMath process supervision) | ``grpo_passk`` |
        ``reinforce_plus_plus_baseline`` | ``opo`` | ``gpg`` | ``optimal_token_baseline`` |
        ``tir_optimal_token_baseline`` | ``gdpo`` (verl's names; docs/migrating-from-verl.md).
      reward_aggregation: with several ``rewards:`` components, ``sum_then_normalize`` (the
        default: GRPO normalises the weighted total) or ``normalize_then_sum`` (GDPO, TRL's
        ``multi_objective_aggregation``: each component normalised in its group, then the
        weighted sum whitened over the batch; the same as ``advantage: gdpo``).
      unbiased_std / reinforce_baseline: ``group_advantages`` options.
      gpg_valid: ``gpg`` advantages' count of valid samples in ``alpha = B / (B - M)``:
        ``nonzero_reward`` (verl's: samples with a non-zero reward) or ``varied_group`` (the GPG
        authors' code: samples of groups whose rewards are not all equal).
      scale_rewards: ``grpo`` advantages' divisor (TRL's key): ``group`` (each group's
        std, the default), ``batch`` (the std of the rollout's rewards) or ``none``
        (``dr_grpo``'s advantages).
      policy_loss: ``ppo`` (clipped; DAPO's clip-higher via ``clip_eps_high``) | ``gspo`` |
        ``cispo`` | ``sapo`` (a soft gate, ``sapo_temperature_pos`` / ``_neg``; ``null``:
        TRL's 1.0 / 1.05) | ``pg`` | ``gpg`` | ``dppo_tv`` / ``dppo_kl`` (``clip_eps_*`` are
        then divergence thresholds, ``dppo_ratio_cap``) | ``clip_cov`` (``clip_cov_ratio``,
        ``clip_cov_lb``, ``clip_cov_ub``) | ``kl_cov`` (``kl_cov_ratio``, ``kl_cov_coef``) |
        ``geo_mean`` | ``dro`` (``dro_beta``, required) | ``vespo`` (``vespo_k_pos``,
        ``vespo_lambda_pos``, ``vespo_k_neg``, ``vespo_lambda_neg``): the registry
        ``alignax.losses.objectives.OBJECTIVES``; each key left ``null`` takes the loss's own
        default (its paper's), docs/migrating-from-verl.md maps verl's names.
      clip_eps_low / clip_eps_high / dual_clip_c: the clip ranges; ``null`` (the default)
        means the chosen loss's own default, its paper's: PPO-clip 0.2 / = low, GSPO
        3e-4 / 4e-4, CISPO no lower clip / 0.28. ``dual_clip_c`` is PPO-clip's only.
      aggregation: ``token-mean`` for DAPO, ``seq-mean-token-sum-norm`` for Dr. GRPO,
        ``seq-mean-token-mean`` (the default) for GRPO.
      kl_coef / kl_kind / kl_placement: GRPO's defaults: 0.04, k3, in the loss.
      target_entropy: adapt ``entropy_coef`` towards this mean per-token entropy (nats),
        Skywork-OR1's adaptive entropy control (``alignax.trainers.online.entropy``): after
        each rollout the coefficient steps up by ``entropy_coef_delta`` (TRL's 0.005) while
        the rollout's entropy is below the target and down otherwise, within ``[0,
        entropy_coef_max]`` (1.0), and the bonus applies only while the last rollout's
        entropy is at or below the target. Checkpointed with the run. ``null``: a fixed
        ``entropy_coef``.
      dynamic_sampling: DAPO: keep sampling prompt batches until the rollout holds
        ``num_prompts`` groups with non-zero reward variance (at most ``max_refills`` more).
      step_delimiter / process_reward: ``process`` advantages: steps end at this string;
        ``module:function`` returning per-step rewards for each completion.
      process_reward_model: ``process`` advantages from a trained PRM instead (a folder,
        ``alignax export`` of an ``algorithm: prm`` run, sharing the policy's tokenizer):
        ``process_reward_aggregation`` ``step`` rewards each step with the PRM's probability
        that it is good; ``min`` / ``product`` / ``last`` give the completion one score (its
        weakest step, all steps, its last step) on its last step.
    """

    kl_coef: float = 0.04
    kl_kind: Literal["k1", "k2", "k3", "abs"] = "k3"
    aggregation: AggregationMode = "seq-mean-token-mean"
    advantage: str = "grpo"  # a name of alignax.estimators.ESTIMATORS (checked by the map's grpo entry)
    reward_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    unbiased_std: bool = True
    reinforce_baseline: bool = False
    scale_rewards: Literal["group", "batch", "none"] = "group"
    gpg_valid: Literal["nonzero_reward", "varied_group"] = "nonzero_reward"
    # a name of alignax.losses.objectives.OBJECTIVES (validated through the algorithm map)
    policy_loss: str = "ppo"
    sapo_temperature_pos: float | None = None
    sapo_temperature_neg: float | None = None
    clip_eps_low: float | None = None
    dppo_ratio_cap: float | None = None
    clip_cov_ratio: float | None = None
    clip_cov_lb: float | None = None
    clip_cov_ub: float | None = None
    kl_cov_ratio: float | None = None
    kl_cov_coef: float | None = None
    dro_beta: float | None = None
    target_entropy: float | None = None
    entropy_coef_delta: float = 0.005
    entropy_coef_max: float = 1.0
    vespo_k_pos: float | None = None
    vespo_lambda_pos: float | None = None
    vespo_k_neg: float | None = None
    vespo_lambda_neg: float | None = None
    dynamic_sampling: bool = False
    max_refills: int = 4
    step_delimiter: str = "\n"
    process_reward: str = "alignax.rewards.process:outcome_on_last_step"
    process_reward_model: str | None = None
    process_reward_aggregation: Literal["step", "min", "product", "last"] = "step"


@dataclasses.dataclass(frozen=True)
class PPOSection(PolicyUpdateSection):
    """PPO with a critic (Ouyang et al. 2022's RLHF recipe; Huang et al. 2024's details), with
    :class:`PolicyUpdateSection`'s fields.

    Fields:
      critic: ``separate`` (its own decoder, ``critic_init`` from the ``policy`` weights or
        a ``reward_model`` folder at ``critic_path``), ``shared`` (a value head on the
        policy trunk) or, with LoRA (and only with it), ``adapter`` (a LoRA adapter of its
        own and a value head on the policy's frozen base: the same base buffers).
      gamma / lam: GAE discount and lambda.
      kl_coef / kl_kind / kl_placement: PPO's defaults: 0.05, k1, a per-token penalty in the
        reward (Ziegler et al. 2019).
      whiten_advantages: standardise advantages over the rollout.
      clip_eps / value_clip / vf_coef: the PPO-clip losses; ``clip_eps_high`` (``null``: =
        ``clip_eps``).
      critic_learning_rate: the critic's own peak learning rate (the separate critic, or
        the shared trunk's value head); ``null``: ``optim.learning_rate``.
      epochs: 4 by default; ``target_kl`` stops the remaining epochs once the epoch's mean
        approx KL exceeds 1.5x it.
      ptx_coef: PPO-ptx, an SFT loss on ``ptx_data`` (format ``sft`` for chat data or ``text``
        for raw text) mixed in with this weight, normalised over the minibatch's tokens.
    """

    kl_coef: float = 0.05
    kl_placement: Literal["loss", "reward"] = "reward"
    epochs: int = 4
    critic: Literal["separate", "shared", "adapter"] = "separate"
    critic_init: Literal["policy", "reward_model"] = "policy"
    critic_path: str | None = None
    gamma: float = 1.0
    lam: float = 0.95
    whiten_advantages: bool = True
    clip_eps: float = 0.2
    critic_learning_rate: float | None = None
    value_clip: float | None = 0.2
    vf_coef: float = 0.5
    target_kl: float | None = None
    ptx_coef: float = 0.0
    ptx_data: DataConfig | None = None


AlarmAction = Literal["warn", "stop", "rollback"]


@dataclasses.dataclass(frozen=True)
class KLAccelerationAlarm:
    """KL to the reference growing faster and faster: over the last ``window`` rollouts every
    increment exceeded the one before, and KL (nats per sequence) is above ``kl_floor``."""

    action: AlarmAction = "warn"
    window: int = 5
    kl_floor: float = 0.01


@dataclasses.dataclass(frozen=True)
class EntropyCollapseAlarm:
    """Policy entropy (nats per token) below ``fraction`` of its first rollout's value."""

    action: AlarmAction = "warn"
    fraction: float = 0.2


@dataclasses.dataclass(frozen=True)
class LengthDriftAlarm:
    """Mean response length moved by more than ``change`` (relative) over ``window``
    rollouts while the task reward did not rise (a response-length blow-up)."""

    action: AlarmAction = "warn"
    window: int = 5
    change: float = 0.5


@dataclasses.dataclass(frozen=True)
class NoSignalAlarm:
    """Stalled updates: ``streak`` rollouts in a row whose every update had a zero gradient
    (``train.max_stalled_streak`` still ends such a run with its own error)."""

    action: AlarmAction = "warn"
    streak: int = 1


@dataclasses.dataclass(frozen=True)
class GoldDivergenceAlarm:
    """The proxy (training) reward rising while the gold signal falls, over the last
    ``window`` gold evaluations: gold fell by more than ``min_gold_drop`` and the mean proxy
    reward since the evaluation ``window`` back rose by more than ``min_proxy_rise``."""

    action: AlarmAction = "warn"
    window: int = 2
    min_gold_drop: float = 0.0
    min_proxy_rise: float = 0.0


@dataclasses.dataclass(frozen=True)
class ThresholdAlarm:
    """A rate above ``max`` (``null``: the alarm is off), averaged over ``window`` rollouts:
    the PPO clip fraction (``clipfrac_low + clipfrac_high``) or the share of updates
    skipped as non-finite."""

    action: AlarmAction = "warn"
    max: float | None = None
    window: int = 1


@dataclasses.dataclass(frozen=True)
class KLBudget:
    """A hard budget on the sequence KL to the reference (``kl/ref_seq``, nats): above
    ``max`` (``null``: no budget) the run ``stop``s, or ``raise_beta`` multiplies the KL
    coefficient by ``beta_factor`` at every rollout it stays above."""

    max: float | None = None
    action: Literal["stop", "raise_beta"] = "stop"
    beta_factor: float = 2.0


@dataclasses.dataclass(frozen=True)
class RollbackPolicy:
    """What an alarm's ``rollback`` does: restore the checkpoint whose gold score was best,
    multiply the learning rate by ``lr_factor`` and the KL coefficient by ``kl_factor``,
    and continue; past ``max_rollbacks`` an alarm that asks for one stops the run."""

    max_rollbacks: int = 2
    lr_factor: float = 0.5
    kl_factor: float = 1.0


@dataclasses.dataclass(frozen=True)
class GoldSection:
    """A held-out gold signal (``alignax.trainers.online.gold``): ``prompts`` (a prompt set
    that shares no prompt with the training data) decoded greedily every ``every`` rollouts
    (and before the first), at most ``max_prompts`` of them, scored by ``rewards`` — a
    verifier, a judge model, reward models or ``functions`` (dotted paths), never the
    training reward (``rewards``)."""

    prompts: DataConfig | None = None
    every: int = 10
    max_prompts: int = 64
    rewards: RewardConfig = dataclasses.field(default_factory=RewardConfig)


@dataclasses.dataclass(frozen=True)
class MonitorSection:
    """Online RL's alarms, what each does, the KL budget and the gold signal
    (``alignax.trainers.online.guard``; docs/guardrails.md). Each alarm's ``action``:
    ``warn`` (log it), ``stop`` (save, exit with status 3 and a one-line reason), or
    ``rollback`` (:class:`RollbackPolicy`; needs ``gold.prompts``). Every event goes to the
    metrics (``alarm/<name>``, ``guard/*``) and to ``<output_dir>/alarms.jsonl``; ``plot``
    draws gold vs proxy vs sqrt(KL) to ``<output_dir>/gold.png`` at the end of a run."""

    kl_acceleration: KLAccelerationAlarm = dataclasses.field(default_factory=KLAccelerationAlarm)
    entropy_collapse: EntropyCollapseAlarm = dataclasses.field(default_factory=EntropyCollapseAlarm)
    length_drift: LengthDriftAlarm = dataclasses.field(default_factory=LengthDriftAlarm)
    no_signal: NoSignalAlarm = dataclasses.field(default_factory=NoSignalAlarm)
    gold_divergence: GoldDivergenceAlarm = dataclasses.field(default_factory=GoldDivergenceAlarm)
    clip_fraction: ThresholdAlarm = dataclasses.field(default_factory=ThresholdAlarm)
    nonfinite_rate: ThresholdAlarm = dataclasses.field(default_factory=ThresholdAlarm)
    kl_budget: KLBudget = dataclasses.field(default_factory=KLBudget)
    rollback: RollbackPolicy = dataclasses.field(default_factory=RollbackPolicy)
    gold: GoldSection = dataclasses.field(default_factory=GoldSection)
    plot: bool = True


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A whole run; see the module docstring for the YAML layout."""

    algorithm: str  # a name of alignax.trainers.api.ALGORITHMS (checked when the config loads)
    output_dir: str = "runs/default"
    model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    placement: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
    lora: LoraConfig | None = None
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainSection = dataclasses.field(default_factory=TrainSection)
    checkpoint: CheckpointSection = dataclasses.field(default_factory=CheckpointSection)
    logging: LoggingSection = dataclasses.field(default_factory=LoggingSection)
    mesh: MeshSection = dataclasses.field(default_factory=MeshSection)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    sft: SFTSection = dataclasses.field(default_factory=SFTSection)
    reward_model: RewardModelSection = dataclasses.field(default_factory=RewardModelSection)
    prm: PRMSection = dataclasses.field(default_factory=PRMSection)
    preference: PreferenceSection = dataclasses.field(default_factory=PreferenceSection)
    iterative: IterativeSection = dataclasses.field(default_factory=IterativeSection)
    distill: DistillSection = dataclasses.field(default_factory=DistillSection)
    onpolicy_distill: OnPolicyDistillSection = dataclasses.field(default_factory=OnPolicyDistillSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    rewards: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    grpo: GRPOSection = dataclasses.field(default_factory=GRPOSection)
    ppo: PPOSection = dataclasses.field(default_factory=PPOSection)
    evaluation: EvaluationConfig = dataclasses.field(default_factory=EvaluationConfig)
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    monitor: MonitorSection = dataclasses.field(default_factory=MonitorSection)

    @property
    def dpo(self) -> PreferenceSection:
        """The ``preference`` section under its old name (one release)."""
        warnings.warn("TrainConfig.dpo is now TrainConfig.preference", DeprecationWarning, stacklevel=2)
        return self.preference

    @property
    def reward(self) -> RewardModelSection:
        """The ``reward_model`` section under its old name (one release)."""
        warnings.warn("TrainConfig.reward is now TrainConfig.reward_model", DeprecationWarning, stacklevel=2)
        return self.reward_model


RENAMED_SECTIONS = {"dpo": "preference", "reward": "reward_model"}
"""Old section name -> new; the old names load until the next release."""


def rename_sections(raw: Mapping[str, Any], *, warn: bool = True) -> dict[str, Any]:
    """``raw`` (a recipe's mapping, overrides applied) with each old section name of
    :data:`RENAMED_SECTIONS` moved to its new name, with a ``DeprecationWarning`` naming the
    new key. A section given under both names is merged; a key given under both with
    different values is a ``ConfigError`` naming both."""
    out = dict(raw)
    for old, new in RENAMED_SECTIONS.items():
        if old not in out:
            continue
        section = out.pop(old)
        if warn:
            warnings.warn(f"config section '{old}:' is now '{new}:' ({old}.<key> -> {new}.<key>); the old name "
                          "loads until the next release", DeprecationWarning, stacklevel=3)
        current = out.get(new)
        if current is None or section is None:
            out[new] = section if current is None else current
            continue
        if not isinstance(section, Mapping) or not isinstance(current, Mapping):
            raise ConfigError(f"{old}: {section!r} and {new}: {current!r}: '{old}:' is the old name of '{new}:'; "
                              f"set {new} only")
        for key, value in section.items():
            if key in current and current[key] != value:
                raise ConfigError(f"{old}.{key}={value!r} and {new}.{key}={current[key]!r}: '{old}:' is the old "
                                  f"name of '{new}:'; set {new}.{key} only")
        out[new] = {**current, **section}
    return out
