"""Optimiser and learning-rate schedule from config: AdamW, warmup + cosine/linear decay,
global-norm clipping, weight decay on matrices only.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import optax


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


def _decay_mask(params):
    return jax.tree.map(lambda p: getattr(p, "ndim", 0) >= 2, params)


def build_optimizer(config: OptimConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``(optimizer, schedule)``; gradients are clipped before the update rule."""
    schedule = learning_rate_schedule(config, total_steps)
    if config.name == "adamw":
        rule = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                           weight_decay=config.weight_decay, mask=_decay_mask)
    elif config.name == "adam":
        rule = optax.adam(schedule, b1=config.b1, b2=config.b2, eps=config.eps)
    else:
        rule = optax.sgd(schedule)
    parts = [rule] if config.max_grad_norm is None else [optax.clip_by_global_norm(config.max_grad_norm), rule]
    return optax.chain(*parts), schedule
