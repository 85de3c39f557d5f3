"""Reward-model training: a Bradley-Terry loss on preference pairs, scored by a reward
head on the last real token of each sequence. Held-out pair accuracy is the eval figure.

With ``reward_model.use_margin`` the loss is ``-log s(r_c - r_r - m)``, ``m`` the record's
``margin`` field (Llama 2's graded preferences; the data's ``margin [B]``), and every
record must carry one (the task's ``required_fields``).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from alignax.losses.reward import bradley_terry_loss
from alignax.trainers.config import TrainConfig
from alignax.trainers.offline.task import Task


def make_task(config: TrainConfig, graphdef: nnx.GraphDef, rest: nnx.State) -> Task:
    # data.format was checked when the config loaded (the algorithm map's entry)
    section = config.reward_model

    def rewards(params, batch):
        model = nnx.merge(graphdef, params, rest)
        tokens = jnp.concatenate([batch["chosen_tokens"], batch["rejected_tokens"]])
        positions = jnp.concatenate([batch["chosen_positions"], batch["rejected_positions"]])
        attention = jnp.concatenate([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
        scores = model(tokens, positions, attention).rewards
        b = batch["chosen_tokens"].shape[0]
        return scores[:b], scores[b:]

    def weights_of(batch):
        if "example_mask" in batch:
            return batch["example_mask"].astype(jnp.float32)
        return jnp.ones(batch["chosen_tokens"].shape[:1], jnp.float32)

    def normalisers_fn(batch):
        return {"num_pairs": jnp.sum(weights_of(batch))}

    def loss_fn(params, frozen, batch, normalisers, rng):
        del frozen, rng
        chosen, rejected = rewards(params, batch)
        margin = batch["margin"] if section.use_margin else None
        return bradley_terry_loss(chosen, rejected, margin=margin, center_coef=section.center_coef,
                                  weights=weights_of(batch), num_pairs=normalisers["num_pairs"])

    def eval_fn(params, frozen, batch):
        loss, metrics = loss_fn(params, frozen, batch, normalisers_fn(batch), None)
        count = jnp.sum(weights_of(batch))
        return {k: (v * count, count) for k, v in {"loss": loss, **metrics}.items()}

    return Task(loss_fn=loss_fn, normalisers_fn=normalisers_fn, eval_fn=eval_fn,
                console_keys=("loss", "accuracy", "margin", "grad_norm"),
                required_fields=("margin",) if section.use_margin else ())
