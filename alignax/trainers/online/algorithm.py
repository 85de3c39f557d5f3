"""An online-RL algorithm as data and pure functions, and the typed values it works on.

The online trainer (:mod:`alignax.trainers.online.trainer`) runs the same rollout →
reward → advantage → update step for every algorithm; what differs is an
:class:`OnlineAlgorithm`, built from the config by a family module
(:func:`alignax.trainers.online.grpo.build_algorithm`,
:func:`alignax.trainers.online.ppo.build_algorithm`):

- ``objective``: the policy loss (:data:`alignax.losses.POLICY_LOSSES`) with its clip
  keywords, aggregation, entropy bonus and whether the KL to the reference sits in it;
- ``kl``: coefficient, controller (fixed or adaptive), estimator and placement (``loss``,
  ``sequence_reward``: subtracted from each completion's reward, ``token_reward``: a
  per-token penalty in the rewards GAE sees);
- ``advantages``: a pure ``AdvantageInputs -> (advantages [R, N], returns [R, N])``,
  jitted by the trainer;
- ``critic`` (PPO) and ``ptx`` (PPO-ptx) when present; ``stop_after_epoch``: a pure host
  rule on an epoch's update metrics (PPO's target KL);
- what the rollout must gather: a greedy ``baseline`` (ReMax), process step rewards,
  DAPO's dynamic sampling.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import numpy as np
from flax import struct

from alignax import kl as kl_lib
from alignax.data import DataConfig
from alignax.parallel.multihost import host_global, local_rows
from alignax.rewards.process import ProcessRewardModel
from alignax.trainers.engine.optim import OptimConfig

Array = jax.Array
KLPlacement = Literal["loss", "sequence_reward", "token_reward", "teacher"]


@struct.dataclass
class AdvantageInputs:
    """What an advantage estimator may read, on device. Per-token arrays ``[R, N]``.

    ``rewards [R]``: sequence rewards (after a ``sequence_reward`` KL); ``loss_mask``: the
    tokens that get loss; ``group_ids [R]``; ``kl_coef``: the controller's current value;
    ``baseline [R]``: ReMax's greedy reward (zeros otherwise); ``step_rewards``/``step_mask``:
    process rewards on step-end tokens (zeros otherwise); ``ref_logps``: ``None`` without a
    reference model (:attr:`KLSetup.uses_reference`). For the estimators that read them
    (:class:`alignax.estimators.Estimator`'s flags), ``None`` otherwise:
    ``reward_components [R, K]`` each ``rewards:`` component before its weight and
    ``reward_weights [K]`` the weights; ``sum_pi_squared [R, N]``: ``sum_v pi(v)^2`` at each
    token and ``stat_logps [R, N]`` the sampled token's log-prob, both from one forward pass of
    the learner's policy at pricing (not necessarily ``old_logps``: those are the sampler's
    under ``rollout.old_logps: sampler`` and in single-update mode); ``is_weights [R, N]``: the
    rollout-correction weight of ``pi_old / pi_sampler`` at each token (``rollout.tis_cap``
    with recomputed old log-probs, verl's decoupled ``rollout_is_weights``), else ``None``.
    """

    rewards: Array
    loss_mask: Array
    group_ids: Array
    old_logps: Array
    ref_logps: Array | None
    old_values: Array
    kl_coef: Array
    baseline: Array
    step_rewards: Array
    step_mask: Array
    reward_components: Array | None = None
    reward_weights: Array | None = None
    sum_pi_squared: Array | None = None
    stat_logps: Array | None = None
    is_weights: Array | None = None


AdvantageFn = Callable[[AdvantageInputs], tuple[Array, Array]]


@dataclasses.dataclass(frozen=True)
class PolicyObjective:
    """The policy loss of the update.

    ``loss_fn(logps, old_logps, advantages, mask, **keywords, aggregation=..., ...)``;
    ``keywords`` hold only the clip settings the user set, so a key left out means the
    loss's own default (GSPO's and CISPO's papers' ranges differ from PPO's), and the
    off-policy sequence mask's threshold when set.
    """

    loss_fn: Callable
    keywords: Mapping[str, Any]
    aggregation: str
    entropy_coef: float = 0.0
    # the objective's own ratio carries the importance correction (alignax.losses.objectives.Objective.ratio)
    ratio: bool = True
    rng: bool = False  # its loss draws random numbers: the step's key is passed as key=
    # alignax.trainers.online.entropy.AdaptiveEntropyController: entropy_coef adapted to a target
    entropy_control: Any = None


@dataclasses.dataclass(frozen=True)
class KLSetup:
    """KL to the reference: ``coef`` (initial), ``controller``, ``kind`` and ``placement``;
    ``importance_weight``: ``pi_theta / pi_old`` on the KL in the loss
    (:func:`alignax.kl.importance_weighted_kl`). A zero fixed coefficient drops the
    reference model altogether, save under ``teacher``: the frozen model is on-policy
    distillation's teacher (:attr:`OnlineAlgorithm.teacher`), its log-probs gathered (the
    advantages' ``ref_logps``, the ``kl/ref_*`` figures: the student's KL to the teacher; by
    the update's loss under :attr:`OnlineAlgorithm.reference_in_update`) and no KL penalty
    placed anywhere."""

    coef: float
    controller: Any  # kl_lib.FixedKLController | kl_lib.AdaptiveKLController
    kind: str
    placement: KLPlacement
    importance_weight: kl_lib.KLWeight = "none"

    @property
    def uses_reference(self) -> bool:
        return (self.placement == "teacher" or self.coef > 0
                or isinstance(self.controller, kl_lib.AdaptiveKLController))

    # The KL to the reference is applied here and nowhere else: to the sequence rewards,
    # to the per-token rewards GAE sees, or in the loss, as ``placement`` says.
    def sequence_rewards(self, rewards: np.ndarray, old_logps: Array, ref_logps: Array | None, mask: Array,
                         coef: Array) -> np.ndarray:
        """This process's sequence rewards ``[R_local]`` less ``coef`` x each completion's
        KL (estimator ``kind``, summed over ``mask`` ``[R, N]``) under ``sequence_reward``;
        ``rewards`` as they are otherwise."""
        if self.placement != "sequence_reward" or not self.uses_reference:
            return rewards
        seq_kl = kl_lib.sequence_kl(old_logps, ref_logps, mask, kind=self.kind)
        return rewards - float(jax.device_get(coef)) * local_rows(seq_kl)

    def token_penalty(self, x: AdvantageInputs) -> Array | None:
        """Under ``token_reward``: ``kl_coef * KL_t`` ``[R, N]`` on the loss mask, what the
        per-token rewards lose (PPO's RLHF reward); ``None`` otherwise or without a reference."""
        if self.placement != "token_reward" or x.ref_logps is None:
            return None
        return kl_lib.kl_penalty(x.old_logps, x.ref_logps, x.loss_mask, beta=x.kl_coef, kind=self.kind)

    def loss_keywords(self, ref_logps: Array | None, coef: Array) -> dict[str, Any]:
        """The policy loss's KL keywords under ``loss`` (``ref_logps [R, N]``, the
        coefficient, the estimator, its importance weight); none otherwise."""
        if self.placement != "loss" or not self.uses_reference:
            return {}
        return dict(ref_logps=ref_logps, kl_coef=coef, kl_kind=self.kind, kl_importance_weight=self.importance_weight)

    def next_coef(self, coef, old_logps: Array, ref_logps: Array | None, mask: Array, *, mesh, rows: int):
        """``(sequence k1 KL [R] on the host or None, the controller's next state)`` after a
        rollout whose policy log-probs were ``old_logps`` (a fixed 0 without a reference)."""
        if not self.uses_reference:
            return None, coef
        seq_kl = host_global(kl_lib.sequence_kl(old_logps, ref_logps, mask, kind="k1"), mesh)
        return seq_kl, self.controller.update(coef, float(np.mean(seq_kl)), rows)


@dataclasses.dataclass(frozen=True)
class CriticSetup:
    """PPO's critic: a value head on the policy trunk (``shared``), its own decoder
    (``separate``, from the policy's weights or a reward model folder ``path``) or, with
    LoRA, its own adapter and value head on the policy's frozen base (``adapter``), trained
    with the clipped value loss at weight ``vf_coef``; ``optim``: its own optimiser
    settings (``None``: the policy's)."""

    kind: Literal["shared", "separate", "adapter"]
    init: Literal["policy", "reward_model"]
    path: str | None
    vf_coef: float
    value_clip: float | None
    optim: OptimConfig | None = None


@dataclasses.dataclass(frozen=True)
class PtxSetup:
    """PPO-ptx: an SFT loss on ``data`` (chat SFT or raw text) at weight ``coef``,
    normalised over the whole minibatch's tokens."""

    coef: float
    data: DataConfig


@dataclasses.dataclass(frozen=True)
class OnlineAlgorithm:
    """Everything that makes one online-RL algorithm what it is (see the module docstring)."""

    name: str
    policy_kind: str  # models.MODEL_KINDS entry of the policy
    epochs: int
    minibatches: int
    objective: PolicyObjective
    kl: KLSetup
    advantages: AdvantageFn
    min_group_size: int = 1  # group-relative estimators compare samples of a prompt
    critic: CriticSetup | None = None
    ptx: PtxSetup | None = None
    stop_after_epoch: Callable[[Sequence[Mapping[str, float]]], bool] | None = None
    greedy_baseline: bool = False  # ReMax
    # step rewards: a function of alignax.rewards.process's signature, or a trained PRM
    # (alignax.rewards.process.ProcessRewardModel) scoring the sampled tokens
    process_reward: Callable | ProcessRewardModel | None = None
    step_delimiter: str = "\n"
    dynamic_sampling_refills: int | None = None  # DAPO: None = off
    # what the estimator reads beyond the total reward (alignax.estimators.Estimator's flags)
    reward_components: bool = False  # each rewards: component and its weight (GDPO)
    token_stats: bool = False  # log pi(y) and sum_v pi(v)^2 per token, the learner's (optimal token baseline)
    # On-policy distillation (trainers/online/onpolicy_distill.py): the frozen teacher held in the
    # reference's place, with a graph and size of its own (``build(mesh) -> params``,
    # ``model(params) -> nnx.Module``); and the update's loss from the policy's whole next-token
    # distributions, ``(actors, params, frozen, minibatch, normalisers) -> (loss, LossAux)``,
    # in place of ``objective`` (None: ``objective``).
    teacher: Any = None
    logits_loss: Callable | None = None

    @property
    def reference_in_update(self) -> bool:
        """Whether the frozen model runs in the update rather than in the collector: a
        ``logits_loss`` reading it (the ``exact`` estimator's teacher logits) hands back its
        log-probs of the sampled tokens from that one pass (:attr:`~alignax.trainers.online.
        rollout.UpdateRows.ref_logps`), so the collector does not run it a second time."""
        return self.logits_loss is not None and self.kl.uses_reference
