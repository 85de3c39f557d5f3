"""Update: a :class:`~alignax.trainers.online.collect.RolloutBatch` -> the new train state
and a typed :class:`UpdateResult`.

:class:`Learner` owns the optimiser (with a critic learning rate of its own when set), the
loss of one micro-batch (:meth:`Learner.loss_fn`: the policy objective from per-token
log-probs, :meth:`Learner.policy_loss`, plus the critic's value loss and PPO-ptx's SFT
loss) and the compiled step (:attr:`Learner.step`, the engine's jitted step: gradient
accumulation, non-finite guard, clipping, optimiser). :meth:`Learner.update` runs
``epochs`` passes of ``minibatches`` steps over a rollout (``stop_after_epoch`` may end
them early), then moves the carried state on: the KL controller and the rollout count.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from alignax import ops
from alignax.data import prepare_dataset
from alignax.losses import sft_loss, value_loss
from alignax.metrics import to_host
from alignax.models.moe import routed_model
from alignax.parallel.sharding import batch_sharding, fit_rows
from alignax.trainers.config import TrainConfig
from alignax.trainers.engine import adapters
from alignax.trainers.engine.optim import build_optimizer
from alignax.trainers.engine.setup import response_logps
from alignax.trainers.engine.step import LossAux, StepOutput, TrainState, make_train_step
from alignax.trainers.online.actors import Actors
from alignax.trainers.online.algorithm import OnlineAlgorithm
from alignax.trainers.online.collect import RolloutBatch
from alignax.trainers.online.rollout import Minibatch, Rollout, RowLayout, UpdateRows

log = logging.getLogger("alignax")

# observe(minibatch, output) is called after each step with what the step read and returned
Observer = Callable[[Minibatch, StepOutput], None]


@dataclasses.dataclass(frozen=True)
class UpdateResult:
    """What a rollout's updates did.

    ``metrics``: each step's metrics (host floats), in order; ``epochs_run``: epochs that
    ran (``stop_after_epoch`` may end them before ``epochs``); ``old_logps``,
    ``recomputed``, ``entropy`` ``[R, N]``: the rollout's policy log-probs and entropy (in
    single-update mode from the update's own forward pass); ``ref_logps [R, N]``: the
    reference's (the teacher's) log-probs of the sampled tokens, from the collector or, when
    the loss runs it (``algorithm.reference_in_update``), from the first epoch's steps
    (``None`` without a reference); ``seq_kl [R]``: each completion's k1 KL to the
    reference on the host (``None`` without one); ``kl_coef``: the KL controller's state
    for the next rollout; ``seconds``: wall time of the steps.
    """

    metrics: tuple[dict[str, float], ...]
    epochs_run: int
    old_logps: jax.Array
    recomputed: jax.Array
    entropy: jax.Array
    seq_kl: np.ndarray | None
    kl_coef: Any
    seconds: float
    ref_logps: jax.Array | None = None


@jax.jit
def rows_in_rollout_order(indices: list[jax.Array], values: list[jax.Array], like: jax.Array) -> jax.Array:
    """``[R, N]``: the steps' per-row ``values`` (``[M, N]`` each) put back at their rows
    ``indices`` (``[M]`` each, together every row of the rollout once); ``like``: an ``[R, N]``
    array of the dtype wanted."""
    return jnp.zeros_like(like).at[jnp.concatenate(indices)].set(jnp.concatenate(values).astype(like.dtype))


class Learner:
    """The optimiser, loss and compiled step of an online run (see the module docstring)."""

    def __init__(self, config: TrainConfig, algorithm: OnlineAlgorithm, actors: Actors, layout: RowLayout):
        self.config, self.algorithm, self.actors, self.layout = config, algorithm, actors, layout
        self.ptx = None
        if algorithm.ptx is not None:
            self.ptx = prepare_dataset(algorithm.ptx.data, actors.tokenizer).iterator("train")
        total_updates = config.train.total_steps * algorithm.epochs * algorithm.minibatches
        self.optimizer, self.schedule = self._build_optimizer(total_updates)
        self.step = None  # compiled by compile()

    def _build_optimizer(self, total_updates: int):
        """The policy's optimiser; with a critic learning rate of its own, the critic's
        params (a separate critic, or the shared trunk's value head) get their own."""
        optimizer, schedule = build_optimizer(self.config.optim, total_updates, precision=self.config.precision)
        critic = self.algorithm.critic
        if critic is None or critic.optim is None:
            return optimizer, schedule
        critic_optimizer, _ = build_optimizer(critic.optim, total_updates, precision=self.config.precision)
        separate = self.actors.separate_critic

        def labels(params):
            if separate:
                return {"policy": jax.tree.map(lambda _: "policy", params["policy"]),
                        "critic": jax.tree.map(lambda _: "critic", params["critic"])}
            return jax.tree.map_with_path(
                lambda path, _: "critic" if "value_head" in jax.tree_util.keystr(path) else "policy", params)

        return optax.multi_transform({"policy": optimizer, "critic": critic_optimizer}, labels), schedule

    def compile(self, shardings) -> Callable:
        """:attr:`step`: ``step(state, frozen, minibatch) -> (state, StepOutput)``, jitted for
        the state's ``shardings`` (donating the state)."""
        step = make_train_step(adapters.with_base(adapters.with_dropout(self.loss_fn, self.config.lora),
                                                  merge=self.actors.with_frozen_base),
                               self.optimizer, normalisers_fn=self.normalisers_fn,
                               grad_accum_steps=self.config.train.grad_accum_steps, schedule=self.schedule,
                               schedule_position=lambda state, mb: mb.schedule_position,
                               row_block=self.actors.pack_group)
        self.step = jax.jit(step, donate_argnums=(0,), out_shardings=(shardings, None))
        self._shardings = shardings
        return self.step

    def scale_learning_rate(self, factor: float) -> None:
        """Multiply the learning rate (``optim.learning_rate``, so the whole schedule) by
        ``factor`` from the next update on: the optimiser is rebuilt (its state keeps its
        structure) and :attr:`step` recompiled (a monitor rollback, ``monitor.rollback.lr_factor``)."""
        optim = self.config.optim
        self.config = dataclasses.replace(self.config, optim=dataclasses.replace(
            optim, learning_rate=optim.learning_rate * factor))
        total_updates = self.config.train.total_steps * self.algorithm.epochs * self.algorithm.minibatches
        self.optimizer, self.schedule = self._build_optimizer(total_updates)
        self.compile(self._shardings)

    # ------------------------------------------------------------------ the loss
    def policy_loss(self, logps, entropy, mb: Minibatch, normalisers, rng=None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The policy objective of the minibatch rows from their log-probs and entropy
        ``[M, N]`` under the current params (with the KL to the reference where the
        algorithm puts it in the loss): ``(loss, metrics)``. ``rng``: the micro-batch's key,
        for an objective that draws (Clip-Cov)."""
        objective, ro = self.algorithm.objective, mb.rollout
        entropy_coef = objective.entropy_coef if mb.entropy_coef is None else mb.entropy_coef
        options = dict(aggregation=objective.aggregation, num_tokens=normalisers["num_tokens"],
                       num_seqs=normalisers["num_seqs"], norm_length=self.actors.max_new, entropy=entropy,
                       entropy_coef=entropy_coef, **self.algorithm.kl.loss_keywords(ro.ref_logps, mb.kl_coef))
        options.update(self.sampler_correction_keywords(ro))
        if objective.rng:
            options["key"] = jax.random.key(0) if rng is None else rng
        # Single-update mode: this forward pass is the rollout's policy.
        old_logps = jax.lax.stop_gradient(logps) if ro.old_logps is None else ro.old_logps
        loss, metrics = objective.loss_fn(logps, old_logps, ro.advantages, ro.loss_mask, **objective.keywords,
                                          **options)
        if mb.entropy_coef is not None:
            metrics = {**metrics, "entropy_coef": mb.entropy_coef}
        return loss, metrics

    def sampler_correction_keywords(self, ro: Rollout) -> dict:
        """The rollout-correction keywords of the policy loss (``rollout.tis_cap``,
        ``tis_level``, ``tis_lower``, ``tis_batch_normalize``, ``rejection``,
        ``rejection_divergences``): none unless one is set. With ``rollout.old_logps: sampler``
        (verl's bypass mode) the ratio to the sampler is the current policy's."""
        rc = self.config.rollout
        if rc.tis_cap is None and rc.rejection is None and not rc.rejection_divergences:
            return {}
        return dict(sampler_logps=ro.sampler_logps, tis_cap=rc.tis_cap, tis_level=rc.tis_level,
                    tis_ratio="current" if rc.old_logps == "sampler" else "old", rejection=rc.rejection,
                    rejection_bounds=tuple(rc.rejection_bounds), rejection_divergences=rc.rejection_divergences,
                    tis_lower=rc.tis_lower, tis_batch_normalize=rc.tis_batch_normalize)

    def loss_fn(self, params, frozen, mb: Minibatch, normalisers, rng):
        """The update's loss on one micro-batch: :meth:`policy_loss`, plus the critic's value
        loss and PPO-ptx (or the algorithm's ``logits_loss``: on-policy distillation)."""
        algo, actors, ro = self.algorithm, self.actors, mb.rollout
        if algo.logits_loss is not None:  # the policy's whole next-token distributions against the teacher's
            return algo.logits_loss(actors, params, frozen, mb, normalisers)
        logps, entropy, values = actors.policy_forward(actors.policy_params(params), ro.tokens, ro.positions,
                                                       ro.attention_mask)
        loss, metrics = self.policy_loss(logps, entropy, mb, normalisers, rng)
        metrics = dict(metrics)
        # Loss parts computed with the minibatch's normalisers add up over micro-batches.
        sums = {"pg_loss": metrics.pop("pg_loss"), "policy_loss": loss}
        critic = algo.critic
        if critic is not None:
            if actors.separate_critic:
                with routed_model("critic"):  # a mixture critic's load-balancing term is its own
                    values = actors.critic_values(params["critic"], ro.tokens, ro.positions, ro.attention_mask)
            v_loss, v_metrics = value_loss(values, ro.old_values, ro.returns, ro.loss_mask, clip_eps=critic.value_clip,
                                           aggregation=algo.objective.aggregation,
                                           num_tokens=normalisers["num_tokens"], num_seqs=normalisers["num_seqs"],
                                           norm_length=actors.max_new)
            metrics.update({f"value/{k}": v for k, v in v_metrics.items()})
            sums["value/loss"] = v_loss
            loss = loss + critic.vf_coef * v_loss
        if mb.ptx is not None:
            model = nnx.merge(actors.graphdef, actors.policy_params(params), actors.rest)
            ptx = mb.ptx
            ptx_logps, ptx_mask = response_logps(model, ptx["tokens"], ptx["positions"], ptx["attention_mask"],
                                                 ptx["response_mask"], chunk_size=self.config.model.logprob_chunk_size)
            ptx_loss, _ = sft_loss(ptx_logps, ptx_mask, num_tokens=normalisers["ptx_num_tokens"])
            sums["ptx/loss"] = ptx_loss
            loss = loss + algo.ptx.coef * ptx_loss
        rows = UpdateRows(logps=jax.lax.stop_gradient(logps), entropy=jax.lax.stop_gradient(entropy))
        return loss, LossAux(metrics, rows, sums)

    @staticmethod
    def normalisers_fn(mb: Minibatch) -> dict[str, jax.Array]:
        """Counts of the whole minibatch, so micro-batch losses add up to its loss."""
        out = ops.aggregation_normalisers(mb.rollout.loss_mask)
        if mb.ptx is not None:
            out["ptx_num_tokens"] = jnp.sum(mb.ptx["response_mask"][:, 1:].astype(jnp.float32))
        return out

    # ------------------------------------------------------------------ the minibatches
    def minibatch_rows(self, order_rng: np.random.Generator) -> list[np.ndarray]:
        """One epoch's minibatches of rollout rows (global indices): a random split of this
        process's rows (the same draw on every process), or of its groups when groups are
        packed (each group's rows stay together; the caller sorts the rows, which keeps
        every group contiguous)."""
        minibatches, layout = self.algorithm.minibatches, self.layout
        if self.actors.pack_group == 1:
            rows = np.split(order_rng.permutation(layout.local_rows), minibatches)
            return [layout.row_offset + part for part in rows]
        G = self.actors.pack_group
        groups = np.split(order_rng.permutation(layout.local_prompts), minibatches)
        return [layout.row_offset + (g[:, None] * G + np.arange(G)[None, :]).reshape(-1) for g in groups]

    def next_ptx_batch(self):
        if self.ptx is None:
            return None
        batch = next(self.ptx)
        return {k: self.actors.place(batch[k]) for k in ("tokens", "positions", "attention_mask", "response_mask")}

    def minibatch_shapes(self, single_pass: bool) -> Minibatch:
        """The :class:`Minibatch` :attr:`step` takes, as ``jax.ShapeDtypeStruct`` with its
        shardings: ``step.lower(state, frozen, learner.minibatch_shapes(...))`` compiles the
        update without a rollout (memory checks, alignax.estimate's calibration)."""
        actors = self.actors
        rows = self.layout.rows // self.algorithm.minibatches
        width = actors.prompt_len + actors.max_new

        def array(shape, dtype):  # rows over the batch axes that divide them (as placed); a scalar replicated
            sharding = (fit_rows(batch_sharding(actors.mesh, len(shape)), shape[0]) if shape
                        else jax.sharding.NamedSharding(actors.mesh, jax.sharding.PartitionSpec()))
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

        per_token = array((rows, actors.max_new), jnp.float32)
        priced = self.algorithm.kl.uses_reference and not self.algorithm.reference_in_update  # the collector's
        rollout = Rollout(tokens=array((rows, width), jnp.int32), positions=array((rows, width), jnp.int32),
                          attention_mask=array((rows, width), jnp.int32), loss_mask=per_token,
                          sampler_logps=per_token, old_logps=None if single_pass else per_token,
                          ref_logps=per_token if priced else None, old_values=per_token,
                          advantages=per_token, returns=per_token)
        ptx = None
        if self.ptx is not None:
            ptx = {k: array(v.shape, v.dtype) for k, v in self.next_ptx_batch().items()}
        adaptive = self.algorithm.objective.entropy_control is not None
        return Minibatch(rollout=rollout, kl_coef=array((), jnp.float32),
                         schedule_position=array((), jnp.int32), ptx=ptx,
                         entropy_coef=array((), jnp.float32) if adaptive else None)

    # ------------------------------------------------------------------ one rollout's updates
    def update(self, state: TrainState, frozen, batch: RolloutBatch, *,
               observe: Observer | None = None) -> tuple[TrainState, UpdateResult]:
        """``epochs`` passes of ``minibatches`` steps over ``batch``, then the KL controller
        and the rollout count; ``observe`` sees each step's minibatch and output."""
        algo, version, kl_coef = self.algorithm, batch.rollout_index, batch.inputs.kl_coef
        control = algo.objective.entropy_control
        entropy_coef = None if control is None else control.applied(state.extra["entropy_coef"])
        t_start = time.perf_counter()
        order_rng = np.random.default_rng([self.config.train.seed, version])
        metrics: list[dict[str, float]] = []
        epochs_run = 0
        per_rollout = algo.epochs * algo.minibatches
        teacher_rows: tuple[list, list] = ([], [])  # the loss's own reference log-probs: rows, values
        for epoch in range(algo.epochs):
            epoch_metrics = []
            for index, rows in enumerate(self.minibatch_rows(order_rng)):
                position = version * per_rollout + epoch * algo.minibatches + index
                placed_rows = self.actors.place(np.sort(rows).astype(np.int32))
                minibatch = Minibatch(rollout=batch.rollout.take(placed_rows),
                                      kl_coef=kl_coef, schedule_position=jnp.asarray(position, jnp.int32),
                                      ptx=self.next_ptx_batch(), entropy_coef=entropy_coef)
                state, out = self.step(state, frozen, minibatch)
                if observe is not None:
                    observe(minibatch, out)
                if epoch == 0 and algo.reference_in_update:  # the frozen model is the same each epoch
                    teacher_rows[0].append(placed_rows)
                    teacher_rows[1].append(out.rows.ref_logps)
                epoch_metrics.append(to_host(out.metrics))
            metrics.extend(epoch_metrics)
            epochs_run += 1
            if algo.stop_after_epoch is not None and epoch + 1 < algo.epochs and algo.stop_after_epoch(epoch_metrics):
                log.info("rollout %d: stopping the updates after epoch %d of %d (ppo.target_kl)", version + 1,
                         epoch + 1, algo.epochs)
                break
        seconds = time.perf_counter() - t_start
        recomputed, entropy, old_logps = batch.recomputed, batch.entropy, batch.rollout.old_logps
        if recomputed is None:  # single-update mode: one update over every row, in rollout order
            recomputed, entropy = out.rows.logps, out.rows.entropy
            old_logps = recomputed if old_logps is None else old_logps
        ref_logps = batch.rollout.ref_logps
        if teacher_rows[0]:
            ref_logps = rows_in_rollout_order(*teacher_rows, batch.rollout.loss_mask)
        seq_kl, new_coef = algo.kl.next_coef(state.extra["kl_coef"], old_logps, ref_logps,
                                             batch.response_mask, mesh=self.actors.mesh, rows=self.layout.rows)
        extra = {**state.extra, "kl_coef": new_coef, "rollouts": state.extra["rollouts"] + 1}
        if control is not None:  # the adaptive entropy coefficient steps on this rollout's entropy
            extra["entropy_coef"] = control.update(state.extra["entropy_coef"],
                                                   ops.masked_mean(entropy, batch.rollout.loss_mask))
        state = state._replace(extra=extra)
        return state, UpdateResult(metrics=tuple(metrics), epochs_run=epochs_run, old_logps=old_logps,
                                   recomputed=recomputed, entropy=entropy, seq_kl=seq_kl, kl_coef=new_coef,
                                   seconds=seconds, ref_logps=ref_logps)
