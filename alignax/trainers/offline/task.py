"""What an offline algorithm hands the offline trainer: its loss, counts and evaluation
(the model kind it trains is the algorithm's entry in :mod:`alignax.trainers.api`).

``loss_fn(params, frozen, batch, normalisers, rng) -> (loss, metrics)`` is the step's
loss on one micro-batch (see :mod:`alignax.trainers.engine.step`); ``normalisers_fn(batch)``
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
      loss_fn / normalisers_fn / eval_fn: see the module docstring.
      uses_reference: the runner keeps a frozen copy of the initial params as
        ``frozen["reference"]`` (saved once in the checkpoint directory).
      reference_logps: ``(reference params, batch) -> {name: [B]}``, the reference's
        sequence log-probs of a batch (a task with a reference). The loss reads them from
        ``batch["ref_logps"]`` where the batch carries them (``placement.reference:
        submesh``: computed on the sub-mesh's devices); else it runs the live reference.
      precompute: optional ``(reference params, batch) -> {name: [B, ...]}`` run once
        before training over every record (e.g. reference log-probs); the tables, indexed
        by record (``frozen["ref_logps"][name][record_index]``), replace the live reference.
      reference_params: optional ``mesh -> params``: the frozen model the task holds is a
        model of its own rather than a copy of the initial params (distillation's teacher),
        built on the mesh it is placed on; held, placed and saved as a reference is.
      sync_reference: optional ``(params, reference, step) -> reference``: the reference moves
        during training (TR-DPO). The train state then carries it (``state.extra["reference"]``,
        saved with every checkpoint) instead of the frozen inputs; each step reads it as
        ``frozen["reference"]`` and, after the update, replaces it by this function's value
        at the new step count.
      console_keys: metrics worth a place on the progress line.
      required_fields: optional fields of the data format that every record must carry
        for this task (``alignax.data.prepare_dataset(required_fields=...)``), e.g.
        ``("margin",)`` for a reward model with ``reward_model.use_margin``.
    """

    loss_fn: Callable
    normalisers_fn: Callable[[Mapping[str, Array]], dict[str, Array]]
    eval_fn: EvalFn
    uses_reference: bool = False
    reference_logps: Callable | None = None
    precompute: Callable | None = None
    reference_params: Callable | None = None
    sync_reference: Callable | None = None
    console_keys: tuple[str, ...] = ("loss",)
    required_fields: tuple[str, ...] = ()
