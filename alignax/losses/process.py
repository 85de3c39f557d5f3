"""Process reward model (PRM) loss and step metrics.

A PRM scores every reasoning step of a solution: a logit ``s`` at each step's end token
(``step_mask [B, T]`` is 1 there), trained against the step's label ``y`` in [0, 1] — a
human's good/bad (Lightman et al. 2023, "Let's Verify Step by Step", PRM800K) or an
estimated chance that the prefix still reaches the right answer (Wang et al. 2024,
"Math-Shepherd", soft labels). Per-step arrays are ``[B, T]``, zero off the step ends, so
the loss reduces with :func:`alignax.ops.aggregate` like any per-token loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from alignax import ops
from alignax._checks import check_choice, check_rank, check_same_shape

Array = jax.Array


def step_bce(scores: Array, labels: Array) -> Array:
    """Binary cross-entropy of logits against soft labels, elementwise:
    ``-(y log s(x) + (1 - y) log(1 - s(x))) = softplus(x) - y x`` (stable for any ``x``)."""
    x = jnp.asarray(scores, jnp.float32)
    return jax.nn.softplus(x) - jnp.asarray(labels, jnp.float32) * x


def _first(flags: Array, mask: Array) -> Array:
    """Index ``[B]`` of the first position where ``flags & mask``; ``T`` where none."""
    t = jnp.arange(flags.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(flags & (mask > 0), t, flags.shape[-1]), axis=-1)


def prm_step_counts(scores: Array, labels: Array, step_mask: Array) -> dict[str, Array]:
    """Sums behind the PRM metrics (add them over batches, then divide).

    A step is good when its label is >= 0.5 and predicted good when ``sigmoid(score) >=
    0.5`` (``score >= 0``). Returns ``step_correct`` / ``steps`` (step accuracy) and
    ``first_error_correct`` / ``solutions``: solutions (rows with a step) whose first step
    predicted bad is their first step labelled bad, "none" matching "none" (Lightman et
    al.'s first-error identification, the ProcessBench figure).
    """
    mask = jnp.asarray(step_mask, jnp.float32)
    good = jnp.asarray(labels, jnp.float32) >= 0.5
    predicted = jnp.asarray(scores, jnp.float32) >= 0.0
    has_steps = jnp.sum(mask, axis=-1) > 0
    first_match = (_first(~good, mask) == _first(~predicted, mask)) & has_steps
    return {
        "step_correct": jnp.sum(jnp.where(mask > 0, (good == predicted).astype(jnp.float32), 0.0)),
        "steps": jnp.sum(mask),
        "first_error_correct": jnp.sum(first_match.astype(jnp.float32)),
        "solutions": jnp.sum(has_steps.astype(jnp.float32)),
    }


def prm_loss(
    scores: Array,
    labels: Array,
    step_mask: Array,
    *,
    aggregation: ops.AggregationMode = "token-mean",
    num_tokens: Array | float | None = None,
    num_seqs: Array | float | None = None,
    norm_length: Array | float | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Per-step binary cross-entropy of a process reward model, aggregated over steps.

    ``l_bt = softplus(s_bt) - y_bt s_bt`` on step ends (``step_mask``), reduced by
    ``aggregate(l, step_mask, mode=aggregation)``: ``token-mean`` weighs every step alike,
    ``seq-mean-token-mean`` every solution alike (its steps' mean), and so on; with soft
    labels the minimum, ``H(y)``, is reached at ``sigmoid(s) = y``.

    Args:
      scores: ``[B, T]`` logits (the reward head at every position).
      labels: ``[B, T]`` labels in [0, 1] at step ends (ignored elsewhere).
      step_mask: ``[B, T]`` 1 at each step's end token (times ``example_mask``).
      aggregation, num_tokens, num_seqs, norm_length: as :func:`alignax.ops.aggregate`
        (``num_tokens`` counts steps, ``num_seqs`` solutions, of the full batch).

    Returns ``(loss, metrics)``: ``step_accuracy``, ``first_error_accuracy`` (see
    :func:`prm_step_counts`), ``mean_score`` (mean ``sigmoid(s)`` over steps) of the local
    batch.
    """
    check_rank(scores=(scores, 2))
    check_same_shape(scores=scores, labels=labels, step_mask=step_mask)
    check_choice("aggregation", aggregation, ops.AGGREGATION_MODES)
    loss = ops.aggregate(step_bce(scores, labels), step_mask, mode=aggregation, num_tokens=num_tokens,
                         num_seqs=num_seqs, norm_length=norm_length)
    counts = prm_step_counts(scores, labels, step_mask)
    metrics = {
        "step_accuracy": counts["step_correct"] / jnp.maximum(counts["steps"], 1.0),
        "first_error_accuracy": counts["first_error_correct"] / jnp.maximum(counts["solutions"], 1.0),
        "mean_score": ops.masked_mean(jax.nn.sigmoid(jnp.asarray(scores, jnp.float32)), step_mask),
    }
    return loss, {k: jax.lax.stop_gradient(v) for k, v in metrics.items()}
