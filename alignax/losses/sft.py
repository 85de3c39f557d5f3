"""Supervised fine-tuning loss: prompt-masked negative log-likelihood of response tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from alignax import ops
from alignax._checks import check_choice, check_rank, check_same_shape

Array = jax.Array


def sft_loss(
    logps: Array,
    mask: Array,
    *,
    aggregation: ops.AggregationMode = "token-mean",
    num_tokens: Array | float | None = None,
    num_seqs: Array | float | None = None,
    norm_length: Array | float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Negative log-likelihood of the response tokens, ``aggregate(-log pi(y_t), mask)``.

    Maximum-likelihood fine-tuning on demonstrations (Ouyang et al. 2022, "Training
    language models to follow instructions with human feedback", SFT); only
    response tokens count, prompt and padding are masked out.

    Args:
      logps: ``[B, T]`` log-probs of the target tokens (:func:`alignax.ops.token_logprobs`).
      mask: ``[B, T]``, 1 on response tokens, 0 on prompt and padding. Masked positions
        get exactly zero gradient, and NaN/inf there never reaches the loss.
      aggregation: one of ``alignax.ops.AGGREGATION_MODES``; ``token-mean`` (default) is
        ``sum -log pi * m / sum m``, the usual cross-entropy over response tokens.
      num_tokens, num_seqs, norm_length: global normalisers of
        :func:`alignax.ops.aggregate`; given the full batch's values
        (:func:`alignax.ops.aggregation_normalisers`), per-shard losses sum to the
        full-batch loss in every mode.

    Returns ``(loss, metrics)``. Metrics describe the local batch: ``nll`` (token-mean
    NLL, whatever the aggregation), ``ppl`` (``exp(nll)``), ``num_tokens`` (response
    tokens). An all-masked batch gives loss 0, ``nll`` 0 and ``ppl`` 1, never NaN.
    """
    check_rank(logps=(logps, 2))
    check_same_shape(logps=logps, mask=mask)
    check_choice("aggregation", aggregation, ops.AGGREGATION_MODES)
    nll_per_token = -jnp.asarray(logps, jnp.float32)
    loss = ops.aggregate(
        nll_per_token, mask, mode=aggregation, num_tokens=num_tokens, num_seqs=num_seqs, norm_length=norm_length
    )
    nll = ops.masked_mean(nll_per_token, mask)
    metrics = {
        "nll": nll,
        "ppl": jnp.exp(nll),
        "num_tokens": jnp.sum(jnp.asarray(mask, jnp.float32)),
    }
    return loss, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
