"""On-policy distillation as an :class:`~alignax.trainers.online.algorithm.OnlineAlgorithm`.

The student samples completions of the run's prompts with the online sampler (the
``rollout`` section: ``num_samples``, ``max_new_tokens``, ``temperature``, the asynchronous
schedule, since it goes through the same collector); the frozen teacher (``distill.teacher``)
scores every sampled position; the loss is the per-token reverse KL
``KL(p_student || p_teacher)`` at ``rollout.temperature`` (Gu et al. 2024, "MiniLLM";
Agarwal et al. 2024, "On-Policy Distillation of Language Models", GKD at ``lambda = 1``; as
verl, slime, NeMo-RL and Tunix run it). The teacher is held in the reference's place
(``KLSetup`` placement ``teacher``): on device, in host memory or on the sub-mesh
(``placement.reference``), saved once with the checkpoints; it may be larger or smaller than
the student and must share its tokenizer.

``onpolicy_distill.estimator``:

- ``exact`` (default): at each sampled position ``t`` the reverse KL over the whole
  vocabulary from both models' logits, ``sum_v p_s(v|y<t) (log p_s(v|y<t) - log p_t(v|y<t))``
  (:func:`alignax.losses.distill_loss`, ``divergence="reverse_kl"``), computed in the update
  (:func:`exact_reverse_kl_loss`, the algorithm's ``logits_loss``): the teacher runs beside
  the student in the step, so it sits on device or in host memory.
- ``sampled``: the one-sample estimate of that KL at the token the student drew,
  ``log p_s(y_t) - log p_t(y_t)``, as the token's negative advantage under PPO-clip
  (:func:`teacher_advantages`; discount 0: each token is charged its own term, as Tinker's
  and slime's on-policy distillation do). The teacher hands back one log-prob a token (the
  reference's forward), so it may sit on the sub-mesh. Its gradient equals the exact one in
  expectation over the sampled token, with that sample's variance on top.

Both leave out how a token changes the later positions' KL (no gradient through the
sampling, as GKD). The ``kl/ref_*`` figures (the student's sampled KL to the teacher) are
gathered for both: under ``sampled`` from the collector's teacher pass, under ``exact`` from
the update's (the teacher runs once a rollout, once an epoch past one epoch: the collector
does not run it, :attr:`~alignax.trainers.online.algorithm.OnlineAlgorithm.reference_in_update`;
its advantages are zeros, which the exact loss does not read).
GKD's ``lmbda`` (mixing the student's samples with a dataset's responses) stays with
``algorithm: gkd``: this family's data are prompts, with no responses to mix in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from alignax import ops
from alignax.losses import ppo_policy_loss
from alignax.losses.distill import distill_loss
from alignax.models.moe import frozen_forward
from alignax.parallel.placement import to_device
from alignax.trainers.config import TrainConfig
from alignax.trainers.engine.step import LossAux
from alignax.trainers.offline.distill import Teacher, check_same_tokenizer
from alignax.trainers.online.algorithm import AdvantageInputs, KLSetup, OnlineAlgorithm, PolicyObjective
from alignax.trainers.online.grpo import kl_controller
from alignax.trainers.online.rollout import Minibatch, UpdateRows, response_states


class OnlineTeacher(Teacher):
    """``distill.teacher`` in the reference's place: checked for the student's tokenizer and
    vocabulary, then built on the mesh the reference would run on
    (:meth:`~alignax.trainers.online.actors.Actors.initial_reference`)."""

    def build(self, mesh) -> nnx.State:
        check_same_tokenizer(self.config)
        return super().build(mesh)


def teacher_advantages(x: AdvantageInputs) -> tuple[jax.Array, jax.Array]:
    """``(A [R, N], zeros [R, N])`` with ``A_t = log p_t(y_t) - log p_s(y_t)`` on the loss mask:
    the negative one-sample reverse KL of each sampled token (``ref_logps``: the teacher's,
    ``old_logps``: the policy that sampled, both at ``rollout.temperature``). Zeros when the
    collector did not run the teacher (``exact``: its loss reads no advantage, and the
    teacher runs once a rollout, in the update)."""
    if x.ref_logps is None:
        return jnp.zeros_like(x.old_logps), jnp.zeros_like(x.old_logps)
    advantages = (x.ref_logps - x.old_logps) * x.loss_mask
    return advantages, jnp.zeros_like(advantages)


def response_logits(model: nnx.Module, mb: Minibatch, actors) -> jax.Array:
    """``[M, N, V]`` float32 logits of ``model`` at the positions predicting the minibatch's
    response tokens (packed like the policy's forward when its groups are)."""
    ro = mb.rollout
    hidden, _ = response_states(model, ro.tokens, ro.positions, ro.attention_mask, prompt_len=actors.prompt_len,
                                group=actors.pack_group)
    return model.logits(hidden).astype(jnp.float32)


def exact_reverse_kl_loss(aggregation: str, temperature: float):
    """The ``logits_loss`` of the ``exact`` estimator: ``aggregate(KL(p_s || p_t)_t, loss_mask)``
    over the whole vocabulary, ``p = softmax(logits / temperature)``, with the minibatch's
    normalisers. Its rows: the student's log-probs and entropy of the sampled tokens (the
    rollout's policy in single-update mode) and the teacher's log-probs of them from the
    same logits (the ``kl/ref_*`` figures: the teacher's one pass a rollout is this one)."""

    def loss_fn(actors, params, frozen, mb: Minibatch, normalisers):
        ro = mb.rollout
        student = nnx.merge(actors.graphdef, actors.policy_params(params), actors.rest)
        teacher = actors.algorithm.teacher.model(to_device(frozen["reference"]))
        logits = response_logits(student, mb, actors)
        with frozen_forward():
            teacher_logits = jax.lax.stop_gradient(response_logits(teacher, mb, actors))
        loss, metrics = distill_loss(logits, teacher_logits, ro.loss_mask, divergence="reverse_kl",
                                     temperature=temperature, aggregation=aggregation,
                                     num_tokens=normalisers["num_tokens"], num_seqs=normalisers["num_seqs"],
                                     norm_length=actors.max_new)
        sampled = ro.tokens[:, actors.prompt_len:]
        chunk = actors.config.model.logprob_chunk_size  # no second whole [M, N, V] log-softmax
        logps, entropy = ops.token_logprobs_and_entropy(logits, sampled, temperature=temperature, chunk_size=chunk)
        teacher_logps = ops.token_logprobs(teacher_logits, sampled, temperature=temperature, chunk_size=chunk)
        rows = UpdateRows(logps=jax.lax.stop_gradient(logps), entropy=jax.lax.stop_gradient(entropy),
                          ref_logps=teacher_logps)
        metrics = {"divergence": metrics["divergence"], "teacher_agreement": metrics["teacher_agreement"]}
        return loss, LossAux(metrics, rows, {"distill_loss": loss})

    return loss_fn


def build_algorithm(config: TrainConfig) -> OnlineAlgorithm:
    """On-policy distillation of ``config.onpolicy_distill`` from ``config.distill.teacher``."""
    section = config.onpolicy_distill
    exact = section.estimator == "exact"
    return OnlineAlgorithm(
        name="onpolicy_distill",
        policy_kind="causal_lm",
        epochs=section.epochs,
        minibatches=section.minibatches,
        # the sampled estimator's update (the exact one's is logits_loss): PPO-clip at its
        # paper's range, whose ratio keeps stale (async) or re-used (epochs > 1) samples honest
        objective=PolicyObjective(ppo_policy_loss, {}, section.aggregation),
        kl=KLSetup(0.0, kl_controller(0.0, False, 0.0, 1.0), "k1", "teacher"),
        advantages=teacher_advantages,
        min_group_size=1,  # nothing compares the samples of a prompt
        teacher=OnlineTeacher(config),
        logits_loss=exact_reverse_kl_loss(section.aggregation, config.rollout.temperature) if exact else None,
    )
