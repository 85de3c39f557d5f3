"""What an algorithm hands the shared runner: its model kind, loss and evaluation.

``loss_fn(params, frozen, batch, normalisers, rng) -> (loss, metrics)`` is the step's
loss on one micro-batch (see :mod:`alignax.trainers.step`); ``normalisers_fn(batch)``
counts the full batch; ``eval_fn(params, frozen, batch) -> {name: (sum, weight)}`` gives
weighted sums that the runner adds over eval batches and divides at the end, so padded
eval batches (``example_mask == 0``) never bias a figure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax

Array = jax.Array
EvalFn = Callable[[Any, Any, Mapping[str, Array]], dict[str, tuple[Array, Array]]]


@dataclasses.dataclass(frozen=True)
class Task:
    """An algorithm, as the runner sees it.

    Fields:
      model_kind: ``causal_lm`` | ``reward`` | ``policy_value`` (``build_model``'s kinds).
      loss_fn / normalisers_fn / eval_fn: see the module docstring.
      uses_reference: the runner keeps a frozen copy of the initial params as
        ``frozen["reference"]`` (saved once in the checkpoint directory).
      precompute: optional ``(params, reference, batches) -> frozen`` run once before
        training (e.g. reference log-probs of every record); replaces the live reference.
      console_keys: metrics worth a place on the progress line.
    """

    model_kind: str
    loss_fn: Callable
    normalisers_fn: Callable[[Mapping[str, Array]], dict[str, Array]]
    eval_fn: EvalFn
    uses_reference: bool = False
    precompute: Callable | None = None
    console_keys: tuple[str, ...] = ("loss",)


def weighted(value: Array, weights: Array) -> tuple[Array, Array]:
    """``(sum(value * weights), sum(weights))`` for eval accumulation."""
    import jax.numpy as jnp

    weights = weights.astype(jnp.float32)
    return jnp.sum(value.astype(jnp.float32) * weights), jnp.sum(weights)
