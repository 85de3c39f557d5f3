"""The critic's loss for PPO with a value model, and the explained-variance diagnostic.

Per-token arrays are ``[B, T]``; ``mask`` is 1 on the tokens whose value is trained
(response tokens) and 0 elsewhere. Both functions are pure and trace under ``jax.jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from alignax import ops
from alignax._checks import check_choice, check_rank, check_same_shape, is_concrete_number

Array = jax.Array
Scalar = Array | float


def _f32(x) -> Array:
    return jnp.asarray(x, jnp.float32)


def explained_variance(returns: Array, values: Array, mask: Array) -> Array:
    """``1 - Var[R - V] / Var[R]`` over the masked-in tokens; a float32 scalar.

    1 when the values predict the returns exactly, 0 when they do no better than the
    returns' mean, negative when worse. Variances are population variances (the ratio is
    the same with Bessel's correction). When ``Var[R] = 0`` — constant returns, fewer
    than two masked tokens, or an empty mask — the ratio is undefined; the result is then
    0 (nothing to explain), never NaN or inf.

    Args:
      returns, values, mask: ``[B, T]`` (or any one shared shape).
    """
    check_same_shape(returns=returns, values=values, mask=mask)
    keep = jnp.asarray(mask).astype(bool)
    returns = jnp.where(keep, _f32(returns), 0.0)
    values = jnp.where(keep, _f32(values), 0.0)
    var_returns = ops.masked_var(returns, keep, unbiased=False)
    var_residual = ops.masked_var(returns - values, keep, unbiased=False)
    safe = jnp.where(var_returns > 0, var_returns, 1.0)
    return jnp.where(var_returns > 0, 1.0 - var_residual / safe, 0.0)


def value_loss(
    values: Array,
    old_values: Array,
    returns: Array,
    mask: Array,
    *,
    clip_eps: Scalar | None = None,
    aggregation: ops.AggregationMode = "token-mean",
    num_tokens: Scalar | None = None,
    num_seqs: Scalar | None = None,
    norm_length: Scalar | None = None,
) -> tuple[Array, dict[str, Array]]:
    """Squared-error critic loss, optionally clipped around the old values (PPO2).

    Per token, with ``V`` the current values, ``V_old`` those of the rollout and ``R`` the
    return targets (e.g. GAE advantages + ``V_old``):

        no clip:  l_t = 1/2 (V_t - R_t)^2
        clip:     l_t = 1/2 max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -eps, eps) - R_t)^2)

    The clipped form is OpenAI baselines' PPO2 (``ppo2/model.py``; Schulman et al. 2017
    clip the policy, baselines applied the same idea to the value): the pessimistic
    maximum stops the value moving more than ``eps`` from ``V_old`` when that would help
    the fit. The per-token loss is reduced by :func:`alignax.ops.aggregate` with
    ``aggregation`` and the global normalisers, as for the policy losses.

    Args:
      values: ``[B, T]`` current value predictions (differentiable).
      old_values: ``[B, T]`` value predictions at rollout time (constant).
      returns: ``[B, T]`` regression targets (constant).
      mask: ``[B, T]``, 1 on trained tokens. Masked-out entries are replaced by 0 before
        any arithmetic, so garbage there gets exactly zero gradient.
      clip_eps: half-width of the value clip; ``None`` disables clipping.

    Returns ``(loss, metrics)`` with stop-gradiented float32 metrics over masked tokens:
    ``vf_clipfrac`` (fraction of tokens where the clipped term is strictly larger, so the
    clip decides the loss; 0 without clipping), ``explained_variance`` (of ``returns`` by
    ``values``, see :func:`explained_variance`), ``values_mean``, ``returns_mean``.
    """
    check_rank(values=(values, 2))
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    check_choice("aggregation", aggregation, ops.AGGREGATION_MODES)
    if clip_eps is not None and is_concrete_number(clip_eps) and clip_eps < 0:
        raise ValueError(f"clip_eps must be >= 0 or None; got {clip_eps}")

    keep = jnp.asarray(mask).astype(bool)
    sg = jax.lax.stop_gradient
    values = jnp.where(keep, _f32(values), 0.0)
    old_values = sg(jnp.where(keep, _f32(old_values), 0.0))
    returns = sg(jnp.where(keep, _f32(returns), 0.0))

    unclipped = jnp.square(values - returns)
    if clip_eps is None:
        squared = unclipped
        clip_active = jnp.zeros(keep.shape, bool)
    else:
        values_clipped = old_values + jnp.clip(values - old_values, -clip_eps, clip_eps)
        clipped = jnp.square(values_clipped - returns)
        squared = jnp.maximum(unclipped, clipped)
        clip_active = clipped > unclipped
    loss = ops.aggregate(
        0.5 * squared, keep, mode=aggregation, num_tokens=num_tokens, num_seqs=num_seqs,
        norm_length=norm_length,
    )
    metrics = {
        "vf_clipfrac": ops.masked_mean(clip_active, keep),
        "explained_variance": explained_variance(returns, values, keep),
        "values_mean": ops.masked_mean(values, keep),
        "returns_mean": ops.masked_mean(returns, keep),
    }
    return _f32(loss), {k: sg(_f32(v)) for k, v in metrics.items()}
