"""The jitted train step: gradient accumulation, non-finite guard, optimiser update.

Every trainer supplies a loss function

    loss_fn(params, frozen, micro_batch, normalisers, rng) -> (loss, metrics)

``params`` are the trainable parameters (a pytree), ``frozen`` whatever stays constant
(reference policy, reward model, ...), ``normalisers`` the global counts of the FULL
batch (tokens, sequences, pairs), so per-micro-batch losses add up to the full-batch
loss exactly; the step sums losses and gradients over micro-batches and never divides
by their number. ``metrics`` is a flat dict of scalars (averaged over micro-batches, all
of equal size), or a :class:`LossAux` that adds loss parts to sum over micro-batches and
per-row outputs (a pytree of ``[rows, ...]`` arrays, e.g. the log-probs the forward pass
computed), concatenated over micro-batches back into the batch's row order. The step
returns the new state and a :class:`StepOutput`.

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

from alignax.models.moe import POLICY, collect_router_losses, router_objective
from alignax.parallel.placement import to_device
from alignax.parallel.sharding import batch_shards, constrain

Array = jax.Array
LossFn = Callable[[Any, Any, Any, Mapping[str, Array], Array], tuple[Array, dict[str, Array]]]
NormalisersFn = Callable[[Any], dict[str, Array]]


class LossAux(NamedTuple):
    """What a loss function returns beside the loss when a plain metrics dict is not enough.

    ``metrics``: scalars that are means over the micro-batch (averaged over micro-batches);
    ``sums``: scalars that, like the loss, are computed with the whole batch's normalisers
    and so add up over micro-batches (the parts of a loss: ``pg_loss``, ``value/loss``);
    ``rows``: a pytree of ``[rows, ...]`` per-row outputs, gradient stopped."""

    metrics: dict[str, Array]
    rows: Any = ()
    sums: dict[str, Array] = {}


class StepOutput(NamedTuple):
    """What one jitted step returns beside the new state."""

    metrics: dict[str, Array]  # float32 scalars: the loss's, plus loss, grad_norm, update_skipped, learning_rate
    rows: Any = ()  # the loss's per-row outputs over the whole batch, in row order


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


def _micro_shards(rows: int, num_micro: int, shards: int, block: int) -> int:
    """How many parts a micro-batch of ``rows // num_micro`` rows is made of
    (:func:`split_micro_batches`): the largest ``s`` dividing ``shards`` for which each
    part is whole ``block``s (``s`` groups of ``shards / s`` consecutive shards, e.g. the
    ``data`` groups when a micro-batch has fewer rows than there are shards)."""
    for s in range(shards, 1, -1):
        if shards % s == 0 and rows % (s * num_micro) == 0 and (rows // (s * num_micro)) % block == 0:
            return s
    return 1


def split_micro_batches(batch: Any, num_micro: int, *, block: int = 1) -> Any:
    """``[A * m, ...]`` leaves → ``[A, m, ...]`` (A = ``num_micro``); a scalar leaf (a
    value every row shares, e.g. a KL coefficient) is repeated for each micro-batch.

    Which rows make micro-batch ``a``: on a mesh the rows lie in ``S`` contiguous blocks,
    one per device group of the batch axes (:func:`alignax.parallel.sharding.batch_shards`);
    micro-batch ``a`` is the ``a``-th part of every block, so it is spread over the devices
    as the whole batch was and splitting moves no data (with fewer rows per micro-batch
    than blocks, the ``a``-th part of every group of consecutive blocks, e.g. of each
    ``data`` group). A contiguous split (rows ``[a m,
    (a + 1) m)``) puts each micro-batch on ``1/A`` of the devices, and the partitioner
    spreads it back by replicating it on every device (XLA's "involuntary full
    rematerialization" warning, a full copy of the batch per device). Without a mesh
    (``S = 1``), or when a block's part would split a ``block`` of rows that must stay
    together (a packed group of ``G`` rows), the split is contiguous. Sums over the
    micro-batches are the same either way; :func:`join_micro_rows` undoes the order.
    """

    def split(x):
        if x.ndim == 0:
            return jnp.broadcast_to(x, (num_micro,))
        rows = x.shape[0]
        if rows % num_micro:
            raise ValueError(f"batch dimension {rows} is not divisible by grad_accum_steps={num_micro}")
        s = _micro_shards(rows, num_micro, batch_shards(x), block)
        parts = x.reshape(s, num_micro, rows // (s * num_micro), *x.shape[1:])
        micro = jnp.swapaxes(parts, 0, 1).reshape(num_micro, rows // num_micro, *x.shape[1:])
        # pinned, so the scan's slices arrive spread as well (propagation alone may shard
        # the stacked micro-batches on their first dim)
        return constrain(micro, (None, "batch") + (None,) * (x.ndim - 1)) if s > 1 else micro

    return jax.tree.map(split, batch)


def join_micro_rows(rows: Any, shards: Mapping[int, int], *, block: int = 1) -> Any:
    """Per-row outputs ``[A, m, ...]`` of the micro-batches of :func:`split_micro_batches`
    back to ``[A m, ...]`` in the batch's row order; ``shards`` maps a batch leaf's row
    count to the blocks its rows lay in (:func:`alignax.parallel.sharding.batch_shards`)."""

    def join(r):
        num_micro, per_micro = r.shape[:2]
        s = _micro_shards(num_micro * per_micro, num_micro, shards.get(num_micro * per_micro, 1), block)
        parts = r.reshape(num_micro, s, per_micro // s, *r.shape[2:])
        return jnp.swapaxes(parts, 0, 1).reshape(num_micro * per_micro, *r.shape[2:])

    return jax.tree.map(join, rows)


def tree_all_finite(tree: Any) -> Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def accumulate_gradients(
    loss_fn: LossFn, params: Any, frozen: Any, batch: Any, normalisers: Mapping[str, Array], rng: Array,
    *, num_micro: int, row_block: int = 1,
) -> tuple[Array, Any, LossAux]:
    """Sum of micro-batch losses and gradients, mean of their scalar metrics and
    concatenation of their per-row outputs (a ``lax.scan``). Gradients of parameters
    narrower than float32 (bfloat16) are summed in float32.

    A mixture-of-experts model trained by ``loss_fn`` adds its load-balancing loss
    (:mod:`alignax.models.moe`): ``router_aux_loss_coef * aux`` joins each micro-batch's loss
    divided by their number (so the step's loss holds the mean over micro-batches), and
    ``moe/aux_loss`` (``aux`` unscaled, the same mean) joins the metrics; a separate mixture
    critic adds its own term and logs ``moe/critic_aux_loss``."""
    def typed_loss(*args):
        with collect_router_losses() as routed:
            loss, aux = loss_fn(*args)
        aux = aux if isinstance(aux, LossAux) else LossAux(dict(aux))
        if routed:
            scaled, plain = router_objective(routed)
            loss = loss + scaled / num_micro
            logged = {"moe/aux_loss" if model == POLICY else f"moe/{model}_aux_loss": value / num_micro
                      for model, value in plain.items()}
            aux = aux._replace(sums={**aux.sums, **logged})
        return loss, aux

    grad_fn = jax.value_and_grad(typed_loss, has_aux=True)
    if num_micro == 1:
        (loss, aux), grads = grad_fn(params, frozen, batch, normalisers, rng)
        return loss, grads, aux
    micro_batches = split_micro_batches(batch, num_micro, block=row_block)
    shards = {x.shape[0]: batch_shards(x) for x in jax.tree.leaves(batch) if x.ndim}
    rngs = jax.random.split(rng, num_micro)

    def body(carry, inputs):
        loss_sum, grad_sum = carry
        micro, key = inputs
        (loss, aux), grads = grad_fn(params, frozen, micro, normalisers, key)
        return (loss_sum + loss, jax.tree.map(lambda s, g: s + g.astype(s.dtype), grad_sum, grads)), aux

    zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32)), params)
    (loss, grads), aux = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros), (micro_batches, rngs))
    # Stacked over micro-batches: scalars [A] are averaged, per-row [A, rows, ...] concatenated.
    return loss, grads, LossAux(metrics=jax.tree.map(lambda m: jnp.mean(m, axis=0), aux.metrics),
                                rows=join_micro_rows(aux.rows, shards, block=row_block),
                                sums=jax.tree.map(lambda m: jnp.sum(m, axis=0), aux.sums))


def guarded_update(optimizer: optax.GradientTransformationExtraArgs, state: TrainState, grads: Any, *,
                   finite: Array, position: Array, rng: Array) -> TrainState:
    """``state`` after one optimiser update with ``grads`` (``schedule_step=position``),
    its step counted and ``rng`` stored; when ``finite`` is false the params and optimiser
    state stay as they were and the non-finite counters rise."""
    # placement.optimizer_state: host holds it in host memory between steps; it is moved
    # in here, after the backward pass (a no-op for a state already on the device)
    opt_state = to_device(state.opt_state)

    def apply(params, opt_state):
        updates, new_opt_state = optimizer.update(grads, opt_state, params, schedule_step=position)
        return optax.apply_updates(params, updates), new_opt_state

    # The non-finite guard: a step whose loss or gradients are not finite leaves params
    # and optimiser state as they were. As a conditional, not a select between the new
    # and the old state: selecting needs the old moments alive until the new ones exist,
    # and XLA then copies the donated moments when the step starts and holds the copies
    # through the forward and backward passes (50-95% of the moments at the compiled
    # peaks); under ``cond`` the update runs in place on the donated buffers.
    new_params, new_opt_state = jax.lax.cond(finite, apply, lambda params, opt_state: (params, opt_state),
                                             state.params, opt_state)
    streak = jnp.where(finite, 0, state.nonfinite_streak + 1)
    return state._replace(
        step=state.step + 1,
        params=new_params,
        opt_state=new_opt_state,
        rng=jax.random.key_data(rng),
        nonfinite_streak=streak.astype(jnp.int32),
        nonfinite_total=state.nonfinite_total + jnp.where(finite, 0, 1).astype(jnp.int32),
    )


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    *,
    normalisers_fn: NormalisersFn,
    grad_accum_steps: int = 1,
    schedule: optax.Schedule | None = None,
    schedule_position: Callable[[TrainState, Any], Array] | None = None,
    row_block: int = 1,
) -> Callable[[TrainState, Any, Any], tuple[TrainState, StepOutput]]:
    """``step(state, frozen, batch) -> (state, StepOutput)``, pure and ready for ``jax.jit``.

    ``optimizer.update`` gets ``schedule_step``: ``schedule_position(state, batch)``, by
    default the number of updates applied so far (``step - nonfinite_total``); optimisers
    that take no extra arguments ignore it. ``schedule`` (for the ``learning_rate``
    metric) is read at the same position.

    ``row_block``: rows that must stay in one micro-batch (the online trainer's packed
    groups); see :func:`split_micro_batches`.

    Metrics added to the loss's own: ``loss``, ``grad_norm`` (before clipping),
    ``update_skipped`` (1.0 when the non-finite guard fired), ``learning_rate``.
    """

    optimizer = optax.with_extra_args_support(optimizer)

    def step(state: TrainState, frozen: Any, batch: Any) -> tuple[TrainState, StepOutput]:
        rng = jax.random.wrap_key_data(state.rng)
        rng, step_key = jax.random.split(rng)
        step_key = jax.random.fold_in(step_key, state.step)
        normalisers = normalisers_fn(batch)
        loss, grads, aux = accumulate_gradients(
            loss_fn, state.params, frozen, batch, normalisers, step_key, num_micro=grad_accum_steps,
            row_block=row_block,
        )
        finite = jnp.isfinite(loss) & tree_all_finite(grads)
        if schedule_position is None:
            position = state.step - state.nonfinite_total
        else:
            position = schedule_position(state, batch)
        new_state = guarded_update(optimizer, state, grads, finite=finite, position=position, rng=rng)
        metrics = {**aux.metrics, **aux.sums}
        metrics["loss"] = loss
        metrics["grad_norm"] = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads))
        metrics["update_skipped"] = 1.0 - finite.astype(jnp.float32)
        if schedule is not None:
            metrics["learning_rate"] = jnp.asarray(schedule(position), jnp.float32)
        metrics = {k: jnp.asarray(m, jnp.float32) for k, m in metrics.items()}
        return new_state, StepOutput(metrics=metrics, rows=aux.rows)

    return step
