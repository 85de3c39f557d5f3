"""Pure loss functions, each returning ``(loss, metrics)``.

- policy: ``ppo_policy_loss`` (clip-higher, dual clip), ``gspo_policy_loss``,
  ``cispo_policy_loss``, ``sapo_policy_loss``, ``pg_loss`` — with entropy bonus,
  KL-in-loss and truncated importance weights as options of each; ``POLICY_LOSSES`` maps their config names to
  them, ``policy_loss_clip_keywords`` lists the clip keywords each takes;
  ``off_policy_sequence_mask`` (DeepSeek-V3.2's off-policy sequence masking),
  ``high_entropy_mask`` (top-entropy token selection).
- objectives: ``OBJECTIVES``, the registry of policy objectives (the ``grpo.policy_loss``
  values: the losses above plus GPG, DPPO-TV/KL, Clip-Cov, KL-Cov, GMPO, DRO and VESPO, each
  in its own module of :mod:`alignax.losses.objectives`), ``sampler_correction`` (verl's
  rollout correction: truncated IS at token or sequence level and rejection masks).
- value: ``value_loss`` (clipped), ``explained_variance``.
- preference: ``dpo_loss`` (variants in ``DPO_VARIANTS``), ``simpo_loss``, ``cpo_loss``,
  ``orpo_loss``, ``kto_loss`` (+ ``kto_reference_point``).
- reward: ``bradley_terry_loss``, ``ensemble_rewards``.
- sft: ``sft_loss``.
- process: ``prm_loss`` (per-step BCE of a process reward model), ``prm_step_counts``.
- distill: ``distill_loss`` (forward KL, reverse KL, GKD's JSD(beta) to a teacher's logits),
  ``sparse_distill_loss`` (to its top-k log-probs).
"""

from alignax.losses.distill import distill_loss, sparse_distill_loss
from alignax.losses.policy import (
    POLICY_LOSSES,
    cispo_policy_loss,
    gspo_policy_loss,
    high_entropy_mask,
    off_policy_sequence_mask,
    pg_loss,
    policy_loss_clip_keywords,
    ppo_policy_loss,
    sampler_correction,
    sapo_policy_loss,
)
from alignax.losses.objectives import OBJECTIVES
from alignax.losses.objectives.cov import clip_cov_policy_loss, kl_cov_policy_loss
from alignax.losses.objectives.dppo import dppo_kl_policy_loss, dppo_tv_policy_loss
from alignax.losses.objectives.dro import dro_policy_loss
from alignax.losses.objectives.geo_mean import geo_mean_policy_loss
from alignax.losses.objectives.vespo import vespo_policy_loss
from alignax.losses.preference import (
    DPO_VARIANTS,
    cpo_loss,
    dpo_loss,
    kto_loss,
    kto_reference_point,
    orpo_loss,
    simpo_loss,
)
from alignax.losses.process import prm_loss, prm_step_counts
from alignax.losses.reward import ENSEMBLE_METHODS, bradley_terry_loss, ensemble_rewards
from alignax.losses.sft import sft_loss
from alignax.losses.value import explained_variance, value_loss

__all__ = [
    "DPO_VARIANTS",
    "ENSEMBLE_METHODS",
    "OBJECTIVES",
    "POLICY_LOSSES",
    "bradley_terry_loss",
    "cispo_policy_loss",
    "clip_cov_policy_loss",
    "cpo_loss",
    "distill_loss",
    "dpo_loss",
    "dppo_kl_policy_loss",
    "dppo_tv_policy_loss",
    "dro_policy_loss",
    "ensemble_rewards",
    "explained_variance",
    "geo_mean_policy_loss",
    "gspo_policy_loss",
    "high_entropy_mask",
    "kl_cov_policy_loss",
    "kto_loss",
    "kto_reference_point",
    "off_policy_sequence_mask",
    "orpo_loss",
    "pg_loss",
    "prm_loss",
    "prm_step_counts",
    "policy_loss_clip_keywords",
    "ppo_policy_loss",
    "sampler_correction",
    "sapo_policy_loss",
    "sft_loss",
    "simpo_loss",
    "sparse_distill_loss",
    "value_loss",
    "vespo_policy_loss",
]
