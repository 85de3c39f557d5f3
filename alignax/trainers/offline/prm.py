"""Process reward model training: per-step binary cross-entropy on step-labelled solutions.

The model is a reward model (a decoder and a scalar score head, ``alignax.models.RewardModel``,
exported and loaded like any reward model) whose head is read at every step's end token
(``per_token=True``) instead of the last one only: the logit of step ``k`` is the score of
the prefix that ends with it. Data are ``data.format: steps`` (``step_mask``,
``step_labels``); the loss is :func:`alignax.losses.process.prm_loss` with
``prm.aggregation``; the eval figures are the loss, step accuracy and first-error-step
accuracy over the eval split.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from alignax import ops
from alignax.losses.process import prm_loss, prm_step_counts
from alignax.trainers.config import TrainConfig
from alignax.trainers.offline.task import Task


def make_task(config: TrainConfig, graphdef: nnx.GraphDef, rest: nnx.State) -> Task:
    # data.format was checked when the config loaded (the algorithm map's entry)
    aggregation = config.prm.aggregation

    def step_mask_of(batch):
        mask = batch["step_mask"].astype(jnp.float32)
        if "example_mask" in batch:
            mask = mask * batch["example_mask"][:, None].astype(jnp.float32)
        return mask

    def scores_of(params, batch):
        model = nnx.merge(graphdef, params, rest)
        return model(batch["tokens"], batch["positions"], batch["attention_mask"], per_token=True).values

    def normalisers_fn(batch):
        return ops.aggregation_normalisers(step_mask_of(batch))

    def loss_fn(params, frozen, batch, normalisers, rng):
        del frozen, rng
        return prm_loss(scores_of(params, batch), batch["step_labels"], step_mask_of(batch),
                        aggregation=aggregation, **normalisers)

    def eval_fn(params, frozen, batch):
        del frozen
        scores, mask = scores_of(params, batch), step_mask_of(batch)
        loss, _ = prm_loss(scores, batch["step_labels"], mask, aggregation=aggregation)
        counts = prm_step_counts(scores, batch["step_labels"], mask)
        solutions = counts["solutions"]
        return {"loss": (loss * solutions, solutions),
                "step_accuracy": (counts["step_correct"], counts["steps"]),
                "first_error_accuracy": (counts["first_error_correct"], solutions)}

    return Task(loss_fn=loss_fn, normalisers_fn=normalisers_fn, eval_fn=eval_fn,
                console_keys=("loss", "step_accuracy", "first_error_accuracy", "grad_norm"))
