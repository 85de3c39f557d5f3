"""Helpers shared by the sequence-level losses (preference and reward): argument checks
for ``[B]`` vectors and weighted batch means with a global normaliser."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from alignax import ops
from alignax._checks import check_rank, check_same_shape

Array = jax.Array


def f32(x) -> Array:
    return jnp.asarray(x, jnp.float32)


def check_vectors(**named) -> None:
    """Each named array (``None`` skipped) is ``[B]`` with one common ``B``."""
    given = {n: v for n, v in named.items() if v is not None}
    check_rank(**{n: (v, 1) for n, v in given.items()})
    check_same_shape(**given)


def check_scalar(**named) -> None:
    check_rank(**{n: (v, 0) for n, v in named.items() if v is not None})


def batch_mean(values: Array, weights: Array | None = None, normaliser: Array | float | None = None) -> Array:
    """``sum_i w_i v_i / N``, float32; ``N = normaliser`` or ``sum_i w_i``; 0 when ``N`` is 0.

    Entries with ``w_i = 0`` are selected out (``ops.masked_sum``), so a non-finite
    value on a dropped pair reaches neither the result nor the other pairs' gradients.
    The weights are data (which pairs count, and how much): no gradient reaches them.
    """
    values = f32(values)
    w = jnp.ones_like(values) if weights is None else jax.lax.stop_gradient(f32(weights))
    total = ops.masked_sum(w * values, w)
    denom = jnp.sum(w) if normaliser is None else f32(normaliser)
    return jnp.where(denom > 0, total / jnp.where(denom > 0, denom, 1.0), 0.0)


def weighted_means(values: dict[str, Array], weights: Array | None) -> dict[str, Array]:
    """Local weighted means of per-pair values, as stop-gradiented float32 scalars."""
    return {name: jax.lax.stop_gradient(batch_mean(v, weights)) for name, v in values.items()}
