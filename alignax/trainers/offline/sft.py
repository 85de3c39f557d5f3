"""Supervised fine-tuning: prompt-masked negative log-likelihood of the response tokens.

``data.format: sft`` trains on assistant turns; ``data.format: text`` on every token of
raw text but the first (continued pre-training). With ``data.packing`` a training row holds
several examples (:mod:`alignax.data.example_packing`); the token-level aggregations
(``token-mean``, ``token-sum``) are then the unpacked loss of the same examples.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from alignax import ops
from alignax.losses.sft import sft_loss
from alignax.trainers.engine.setup import response_logps
from alignax.trainers.config import TrainConfig
from alignax.trainers.offline.task import Task


def make_task(config: TrainConfig, graphdef: nnx.GraphDef, rest: nnx.State) -> Task:
    # data.format (sft or text) was checked when the config loaded (the algorithm map's entry)
    aggregation = config.sft.aggregation
    chunk = config.model.logprob_chunk_size
    window = config.data.max_response_length  # the LM head runs on response positions only

    def token_logps(params, batch):
        model = nnx.merge(graphdef, params, rest)
        # a packed training row (data.packing) holds several responses: scored whole
        segments = batch.get("segment_ids")
        logps, mask = response_logps(model, batch["tokens"], batch["positions"], batch["attention_mask"],
                                     batch["response_mask"], chunk_size=chunk,
                                     window=window if segments is None else None, segment_ids=segments)
        if "example_mask" in batch:
            mask = mask * batch["example_mask"][:, None].astype(mask.dtype)
        return logps, mask

    def normalisers_fn(batch):
        # Counts only (tokens, sequences): the same whether or not a window is used.
        mask = batch["response_mask"][:, 1:].astype(jnp.float32)
        if "example_mask" in batch:
            mask = mask * batch["example_mask"][:, None].astype(jnp.float32)
        return ops.aggregation_normalisers(mask)

    def loss_fn(params, frozen, batch, normalisers, rng):
        del frozen, rng
        logps, mask = token_logps(params, batch)
        return sft_loss(logps, mask, aggregation=aggregation, **normalisers)

    def eval_fn(params, frozen, batch):
        del frozen
        logps, mask = token_logps(params, batch)
        tokens = jnp.sum(mask)
        nll = -jnp.sum(jnp.where(mask > 0, logps, 0.0))
        # Token-level NLL (and its perplexity at the end) whatever the training aggregation.
        return {"nll": (nll, tokens)}

    return Task(loss_fn=loss_fn, normalisers_fn=normalisers_fn, eval_fn=eval_fn,
                console_keys=("loss", "ppl", "grad_norm"))
