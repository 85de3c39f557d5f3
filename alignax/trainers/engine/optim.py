"""Optimiser and learning-rate schedule from config: AdamW, warmup + cosine/linear decay,
global-norm clipping, weight decay on matrices only.

The learning rate is read at a position the train step passes
(``optimizer.update(..., schedule_step=n)``), not at a count the optimiser keeps: offline
that is the number of updates applied so far (what ``optax.adamw``'s own count would be);
online it is the rollout's place in the run (``rollout * epochs * minibatches + update``),
so epochs cut short by PPO's target KL neither stretch nor cut the schedule.

The run's precision policy (:mod:`alignax.trainers.engine.precision`) sets the dtype of
Adam's first moment and, for bfloat16 parameters, wraps the whole optimiser so that it
computes in float32 on a float32 master copy of the weights.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import optax

from alignax.trainers.config import OptimConfig, PrecisionConfig
from alignax.trainers.engine.precision import with_precision


def learning_rate_schedule(config: OptimConfig, total_steps: int) -> optax.Schedule:
    """Warmup to ``learning_rate`` then the configured decay over the remaining steps."""
    peak = config.learning_rate
    end = peak * config.min_lr_ratio
    decay_steps = max(total_steps - config.warmup_steps, 1)
    if config.schedule == "constant":
        decay = optax.constant_schedule(peak)
    elif config.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=config.min_lr_ratio)
    else:
        decay = optax.linear_schedule(peak, end, decay_steps)
    if config.warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, peak, config.warmup_steps)
    return optax.join_schedules([warmup, decay], [config.warmup_steps])


def scale_by_schedule_at(schedule: optax.Schedule) -> optax.GradientTransformationExtraArgs:
    """``updates -> -schedule(n) * updates`` with ``n = schedule_step`` when the caller
    passes it to ``update`` (an extra argument that ``optax.chain`` and ``optax.partition``
    pass through), else the transformation's own count of updates, as
    ``optax.scale_by_learning_rate`` does."""

    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None, *, schedule_step=None, **extra_args):
        del params, extra_args
        rate = schedule(state.count if schedule_step is None else schedule_step)
        updates = jax.tree.map(lambda u: (-rate * u).astype(u.dtype), updates)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init, update)


def _decay_mask(params):
    return jax.tree.map(lambda p: getattr(p, "ndim", 0) >= 2, params)


def build_optimizer(
    config: OptimConfig, total_steps: int, *, precision: PrecisionConfig = PrecisionConfig()
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``(optimizer, schedule)``; gradients are clipped before the update rule, and the
    optimiser's ``update`` takes ``schedule_step`` (see the module docstring).

    The rules are optax's own compositions (``optax.adamw`` is ``scale_by_adam``, then
    ``add_decayed_weights``, then the learning rate), with the learning rate read at
    ``schedule_step``; under a float32 ``precision`` policy that is all there is. Adam's
    first moment is stored in ``precision.mu_dtype``, and bfloat16 parameters get the
    float32 arithmetic (and master copy) of :func:`~alignax.trainers.engine.precision.with_precision`."""
    schedule = learning_rate_schedule(config, total_steps)
    parts = [] if config.max_grad_norm is None else [optax.clip_by_global_norm(config.max_grad_norm)]
    if config.name in ("adamw", "adam"):
        mu_dtype = None if precision.mu_dtype == "float32" else jnp.dtype(precision.mu_dtype)
        parts.append(optax.scale_by_adam(b1=config.b1, b2=config.b2, eps=config.eps, mu_dtype=mu_dtype))
    if config.name == "adamw":
        parts.append(optax.add_decayed_weights(config.weight_decay, mask=_decay_mask))
    parts.append(scale_by_schedule_at(schedule))
    return with_precision(optax.chain(*parts), precision), schedule
