"""Pure loss functions, each returning ``(loss, metrics)``.

- policy: ``ppo_policy_loss`` (clip-higher, dual clip), ``gspo_policy_loss``,
  ``cispo_policy_loss``, ``sapo_policy_loss``, ``pg_loss`` — with entropy bonus,
  KL-in-loss and truncated importance weights as options of each; ``POLICY_LOSSES`` maps their config names to
  them, ``policy_loss_clip_keywords`` lists the clip keywords each takes;
  ``off_policy_sequence_mask`` (DeepSeek-V3.2's off-policy sequence masking),
  ``high_entropy_mask`` (top-entropy token selection).
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
    sapo_policy_loss,
)
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
    "POLICY_LOSSES",
    "bradley_terry_loss",
    "cispo_policy_loss",
    "cpo_loss",
    "distill_loss",
    "dpo_loss",
    "ensemble_rewards",
    "explained_variance",
    "gspo_policy_loss",
    "high_entropy_mask",
    "kto_loss",
    "kto_reference_point",
    "off_policy_sequence_mask",
    "orpo_loss",
    "pg_loss",
    "prm_loss",
    "prm_step_counts",
    "policy_loss_clip_keywords",
    "ppo_policy_loss",
    "sapo_policy_loss",
    "sft_loss",
    "simpo_loss",
    "sparse_distill_loss",
    "value_loss",
]
