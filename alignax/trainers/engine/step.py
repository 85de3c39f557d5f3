"""The jitted train step: gradient accumulation, non-finite guard, optimiser update.

Every trainer supplies a loss function

    loss_fn(params, frozen, micro_batch, normalisers, rng) -> (loss, metrics)

``params`` are the trainable parameters (a pytree), ``frozen`` whatever stays constant
(reference policy, reward model, ...), ``normalisers`` the global counts of the FULL
batch (tokens, sequences, pairs), so per-micro-batch losses add up to the full-batch
loss exactly; the step sums losses and gradients over micro-batches and never divides
by their number. Scalar metrics are averaged over micro-batches (all have equal size);
a metric with a leading row dimension (a per-row output such as the log-probs the
forward pass computed) is concatenated over them, back into the batch's row order.

A step whose loss or gradients are not finite changes nothing but the counters: params
and optimiser state are kept, ``nonfinite_streak`` and ``nonfinite_total`` rise, and the
host loop stops the run when the streak reaches its limit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

Array = jax.Array
LossFn = Callable[[Any, Any, Any, Mapping[str, Array], Array], tuple[Array, dict[str, Array]]]
NormalisersFn = Callable[[Any], dict[str, Array]]


class TrainState(NamedTuple):
    """Everything a step changes; a pytree that Orbax saves as one item."""

    step: Array  # int32 scalar: updates attempted so far
    params: Any
    opt_state: Any
    rng: Array  # raw uint32 key data (jax.random.key_data), so it saves and restores as an array
    nonfinite_streak: Array  # int32: consecutive skipped updates
    nonfinite_total: Array  # int32: all skipped updates
    extra: Any = ()  # trainer-specific carried state (e.g. the KL controller)


def init_train_state(params: Any, optimizer: optax.GradientTransformation, rng: Array, extra: Any = ()) -> TrainState:
    def zero():  # distinct buffers: the state is donated to the step, leaf by leaf
        return jnp.zeros((), jnp.int32)

    return TrainState(
        step=zero(), params=params, opt_state=optimizer.init(params), rng=jax.random.key_data(rng),
        nonfinite_streak=zero(), nonfinite_total=zero(), extra=extra,
    )


def split_micro_batches(batch: Any, num_micro: int) -> Any:
    """``[A * m, ...]`` leaves → ``[A, m, ...]`` (A = ``num_micro``)."""

    def split(x):
        if x.shape[0] % num_micro:
            raise ValueError(f"batch dimension {x.shape[0]} is not divisible by grad_accum_steps={num_micro}")
        return x.reshape(num_micro, x.shape[0] // num_micro, *x.shape[1:])

    return jax.tree.map(split, batch)


def tree_all_finite(tree: Any) -> Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def accumulate_gradients(
    loss_fn: LossFn, params: Any, frozen: Any, batch: Any, normalisers: Mapping[str, Array], rng: Array,
    *, num_micro: int,
) -> tuple[Array, Any, dict[str, Array]]:
    """Sum of micro-batch losses and gradients, mean of their scalar metrics and
    concatenation of their per-row ones (a ``lax.scan``)."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if num_micro == 1:
        (loss, metrics), grads = grad_fn(params, frozen, batch, normalisers, rng)
        return loss, grads, metrics
    micro_batches = split_micro_batches(batch, num_micro)
    rngs = jax.random.split(rng, num_micro)

    def body(carry, inputs):
        loss_sum, grad_sum = carry
        micro, key = inputs
        (loss, metrics), grads = grad_fn(params, frozen, micro, normalisers, key)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), metrics

    zeros = jax.tree.map(jnp.zeros_like, params)
    (loss, grads), metrics = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), (micro_batches, rngs))
    def combine(m):  # stacked over micro-batches: [A] for scalars, [A, rows, ...] for per-row
        return jnp.mean(m, axis=0) if m.ndim == 1 else m.reshape(-1, *m.shape[2:])

    return loss, grads, jax.tree.map(combine, metrics)


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    normalisers_fn: NormalisersFn,
    grad_accum_steps: int = 1,
    schedule: optax.Schedule | None = None,
) -> Callable[[TrainState, Any, Any], tuple[TrainState, dict[str, Array]]]:
    """``step(state, frozen, batch) -> (state, metrics)``, pure and ready for ``jax.jit``.

    Metrics added to the loss's own: ``loss``, ``grad_norm`` (before clipping),
    ``update_skipped`` (1.0 when the non-finite guard fired), ``learning_rate``.
    """

    def step(state: TrainState, frozen: Any, batch: Any) -> tuple[TrainState, dict[str, Array]]:
        rng = jax.random.wrap_key_data(state.rng)
        rng, step_key = jax.random.split(rng)
        step_key = jax.random.fold_in(step_key, state.step)
        normalisers = normalisers_fn(batch)
        loss, grads, metrics = accumulate_gradients(
            loss_fn, state.params, frozen, batch, normalisers, step_key, num_micro=grad_accum_steps
        )
        finite = jnp.isfinite(loss) & tree_all_finite(grads)
        # Zero out non-finite gradients before they reach the optimiser, so its moments
        # stay finite even on the branch that is thrown away.
        safe_grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
        updates, new_opt_state = optimizer.update(safe_grads, state.opt_state, state.params)
        new_params = optax.apply_updates(state.params, updates)

        def keep_if_finite(new, old):
            return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

        streak = jnp.where(finite, 0, state.nonfinite_streak + 1)
        new_state = state._replace(
            step=state.step + 1,
            params=keep_if_finite(new_params, state.params),
            opt_state=keep_if_finite(new_opt_state, state.opt_state),
            rng=jax.random.key_data(rng),
            nonfinite_streak=streak.astype(jnp.int32),
            nonfinite_total=state.nonfinite_total + jnp.where(finite, 0, 1).astype(jnp.int32),
        )
        metrics = dict(metrics)
        metrics["loss"] = loss
        metrics["grad_norm"] = optax.tree.norm(grads)
        metrics["update_skipped"] = 1.0 - finite.astype(jnp.float32)
        if schedule is not None:
            metrics["learning_rate"] = jnp.asarray(schedule(state.step), jnp.float32)
        return new_state, jax.tree.map(lambda m: jnp.asarray(m, jnp.float32), metrics)

    return step
