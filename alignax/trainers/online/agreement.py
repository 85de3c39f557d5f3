"""Sampler/learner agreement: how far the learner's log-probs of a rollout's sampled tokens
are from the ones the sampler recorded while drawing them, measured every rollout and
enforced by ``rollout.max_logprob_gap``.

Both sides run the same model on the same weights (the sampler's compute-dtype copy,
``rollout.mesh``, LoRA merged for sampling are the same numbers in another layout), so
the gap is numerical only: a KV-cache decode against one full forward pass, other sums'
orders under a mesh, another attention path. Peers correct this mismatch after the fact
(truncated importance sampling, ``rollout.tis_cap`` here too); alignax measures it, and a
run can refuse to train on a rollout whose gap exceeds a bound.

The measurement reads what a rollout step computes anyway: the sampler's log-probs of
the tokens (``Groups.sampler_logps``) and the learner's recomputation of them (the old
log-probs' forward pass in pricing, or the single update's own forward pass), so it costs
one reduction over ``[R, N]`` and three scalars brought to the host, no forward pass.

It is only the sampler's agreement when both used the same weights: an asynchronous batch
sampled ``k`` updates ago differs by what those updates changed as well, so no figures
are made for it (``mismatch/sampler_trainer_*`` still report that gap), and the bound is
refused with ``rollout.async.max_staleness > 0`` (:mod:`alignax.trainers.validation`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from alignax import ops
from alignax.trainers.config import TrainConfig
from alignax.trainers.engine.loop import RunStoppedError

Array = jax.Array

# |Δ| above which a token counts as disagreeing: a thousandth of a nat, the scale where a
# per-token importance ratio exp(Δ) moves by 0.1% (far above float32 noise, ~1e-6, and
# about one bfloat16 rounding step of a log-prob of magnitude ~0.1-1).
SHARE_THRESHOLD = 1e-3


class LogprobGapError(RunStoppedError):
    """A rollout's sampler/learner log-prob gap exceeded ``rollout.max_logprob_gap``."""


def logprob_gap(sampler_logps: Array, learner_logps: Array, mask: Array) -> dict[str, Array]:
    """The gap ``Δ = learner_logps - sampler_logps`` over the counted tokens.

    Args:
      sampler_logps: ``[R, N]`` log q(y_t | ...) the sampler recorded for each drawn token
        (nats, float32; the tempered distribution it drew from).
      learner_logps: ``[R, N]`` the learner's log-probs of the same tokens at the same
        temperature (:func:`alignax.trainers.online.rollout.response_forward`).
      mask: ``[R, N]``, 1 on the policy's own tokens (a multi-turn trajectory's
        observation tokens are 0: nobody sampled them).

    Returns ``{"mean", "max", "share", "tokens"}`` float32 scalars: mean and max of ``|Δ|``
    over the mask, the share of masked tokens with ``|Δ| > SHARE_THRESHOLD``, and how many
    tokens were counted; all 0 for an empty mask.
    """
    gap = jnp.abs(jnp.asarray(learner_logps, jnp.float32) - jnp.asarray(sampler_logps, jnp.float32))
    counted = mask > 0
    return {
        "mean": ops.masked_mean(gap, counted),
        "max": jnp.max(jnp.where(counted, gap, 0.0)),
        "share": ops.masked_mean((gap > SHARE_THRESHOLD).astype(jnp.float32), counted),
        "tokens": jnp.sum(counted.astype(jnp.float32)),
    }


class Agreement:
    """Measures each rollout's gap (labelled by ``precision.compute_dtype``, in which both
    the sampler and the learner compute) and stops the run past ``rollout.max_logprob_gap``."""

    def __init__(self, config: TrainConfig):
        self.dtype = config.precision.compute_dtype
        self.bound = config.rollout.max_logprob_gap  # None: measured, never enforced
        self._gap = jax.jit(logprob_gap)

    def keys(self) -> dict[str, str]:
        """The metric key of each statistic, e.g. ``agreement/bfloat16/gap_max``."""
        prefix = f"agreement/{self.dtype}"
        return {"mean": f"{prefix}/gap_mean", "max": f"{prefix}/gap_max",
                "share": f"{prefix}/share_above_{SHARE_THRESHOLD:g}", "tokens": f"{prefix}/tokens"}

    def measure(self, sampler_logps: Array, learner_logps: Array, mask: Array, *, rollout_index: int,
                policy_version: int) -> dict[str, float]:
        """The rollout's agreement figures (host floats; none for a batch sampled by older
        weights than the learner's, ``policy_version < rollout_index``); raises
        :class:`LogprobGapError` when ``gap_max`` exceeds the bound."""
        if policy_version != rollout_index:
            return {}
        gap = {name: float(value) for name, value in jax.device_get(self._gap(sampler_logps, learner_logps,
                                                                                mask)).items()}
        if self.bound is not None and gap["max"] > self.bound:
            raise LogprobGapError(
                f"rollout {rollout_index + 1}: the learner's log-probs of the sampled tokens differ from the "
                f"sampler's by up to {gap['max']:.3g} nats (mean {gap['mean']:.3g}; {100 * gap['share']:.3g}% of "
                f"{gap['tokens']:.0f} tokens above {SHARE_THRESHOLD:g}), computing in {self.dtype}; "
                f"rollout.max_logprob_gap is {self.bound:g}, so the run stops before training on it. Sampler and "
                "learner should agree to ~1e-6 in float32 (docs/sampler-agreement.md): compute in float32 "
                "(precision.compute_dtype) to tell bfloat16 rounding from a real mismatch, or raise "
                "rollout.max_logprob_gap to the figure measured for this dtype.")
        return {self.keys()[name]: value for name, value in gap.items()}
