"""Distillation tasks: a student pulled toward a frozen teacher's next-token distributions.

``algorithm: distill`` (logit distillation on a dataset, Hinton et al. 2015; Tunix's logit
KD): on each batch's sequences (data format ``sft`` or ``text``) the teacher's logits at
every response position are the target of a divergence (:func:`alignax.losses.distill_loss`:
forward KL, reverse KL, GKD's JSD(beta)), or its top-``k`` tokens are
(:func:`alignax.losses.sparse_distill_loss`). The teacher runs on the fly (``distill.
teacher_logits: live``), or its top-``k`` log-probs of every record are computed once before
training and kept as a table (``precomputed``), as DPO's precomputed reference.

``algorithm: gkd`` (generalised knowledge distillation, Agarwal et al. 2024, "On-Policy
Distillation of Language Models"): with probability ``distill.lmbda`` a step trains on the
student's own samples of the batch's prompts (it samples them inside the step, at
``distill.temperature``, from its current weights, with no gradient through the sampling)
and the teacher scores each sampled position; otherwise on the dataset's responses. With
``divergence: reverse_kl`` (or ``jsd`` at ``beta: 1``) and ``lmbda: 1`` this is on-policy
distillation: the loss is the per-token reverse KL of the student's samples.

The teacher is one more frozen model, held like the reference (``placement.reference``:
device, host memory, or the sub-mesh, where it sends back its top-``k`` only) and saved once
with the checkpoints. It may be larger or smaller than the student; it must share the
student's tokenizer (:func:`check_same_tokenizer`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from alignax import evaluation, ops
from alignax.config import ConfigError
from alignax.losses.distill import distill_loss, sparse_distill_loss, teacher_topk
from alignax.models.hf import read_config
from alignax.models.modeling import positions_from_mask
from alignax.models.moe import collect_router_losses, frozen_forward, record_router_objective, router_objective
from alignax.sampling.sampler import generate
from alignax.trainers.config import TrainConfig
from alignax.trainers.engine.precision import frozen_params
from alignax.trainers.engine.setup import (build_model, load_tokenizer, model_directory, response_hidden,
                                           split_params)
from alignax.trainers.offline.task import Task

TOPK_KEYS = ("topk_logps", "topk_ids")  # what a precomputed / sub-mesh teacher hands the loss


def check_same_tokenizer(config: TrainConfig):
    """The student's tokenizer, after checking that the teacher's is the same (same
    vocabulary, ids and special tokens); a ``ConfigError`` naming both models otherwise."""
    student, teacher = load_tokenizer(config.model), load_tokenizer(config.distill.teacher)
    same = (student.get_vocab() == teacher.get_vocab() and student.eos_token_id == teacher.eos_token_id
            and student.pad_token_id == teacher.pad_token_id)
    if not same:
        raise ConfigError(f"distill.teacher={config.distill.teacher.name} and model.name={config.model.name} have "
                          f"different tokenizers ({len(teacher.get_vocab()):,} and {len(student.get_vocab()):,} "
                          "tokens); distillation compares their distributions token by token and needs one tokenizer")
    return student


def vocab_size(spec) -> int:
    """The logits a position of the model ``spec`` names (its config, ``random_init`` applied)."""
    return int({**read_config(model_directory(spec), name=spec.name), **(spec.random_init or {})}["vocab_size"])


class Teacher:
    """The frozen teacher: built on the mesh it is placed on when the trainer asks
    (:attr:`Task.reference_params`), its graph kept for the loss's forward passes."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self.graphdef = self.rest = None

    def build(self, mesh) -> nnx.State:
        config = self.config
        model = build_model(config.distill.teacher, kind="causal_lm", mesh=mesh, precision=config.precision)
        student_vocab = vocab_size(config.model)
        if model.config.vocab_size != student_vocab:
            raise ConfigError(f"distill.teacher={config.distill.teacher.name} has {model.config.vocab_size:,} "
                              f"logits a position and model.name={config.model.name} {student_vocab:,}; "
                              "distillation needs the same vocabulary (one tokenizer, the same embedding rows)")
        self.graphdef, params, self.rest = split_params(model)
        return frozen_params(params, config.precision)

    def model(self, params) -> nnx.Module:
        return nnx.merge(self.graphdef, params, self.rest)


def window_logits(model, rows, window):
    """``(logits [B, W, V] float32, mask [B, W])`` at the response positions of ``rows``
    (``tokens``, ``positions``, ``attention_mask``, ``response_mask``, each ``[B, T]``)."""
    hidden, _, mask = response_hidden(model, rows["tokens"], rows["positions"], rows["attention_mask"],
                                      rows["response_mask"], window=window)
    return model.logits(hidden).astype(jnp.float32), mask


def _example_mask(mask, batch):
    if "example_mask" in batch:
        mask = mask * batch["example_mask"][:, None].astype(mask.dtype)
    return mask


def left_padded_prompts(batch, width: int, pad_id: int):
    """Each row's prompt (the tokens before its first response token), left-padded to
    ``width`` (its last ``width`` tokens if longer): ``(tokens [B, width], mask [B, width])``,
    as the sampler takes them. A row without a response token keeps its first token."""
    first = jnp.maximum(jnp.argmax(batch["response_mask"] > 0, axis=1), 1)  # [B] prompt lengths
    source = first[:, None] - width + jnp.arange(width)[None, :]  # column j holds prompt token source[:, j]
    valid = source >= 0
    tokens = jnp.take_along_axis(batch["tokens"], jnp.maximum(source, 0), axis=1)
    return jnp.where(valid, tokens, pad_id).astype(jnp.int32), valid.astype(jnp.int32)


def student_samples(graphdef, params, rest, batch, rng, sampling, prompt_width: int):
    """The student's samples of the batch's prompts, as rows ``[B, width + N]`` of
    ``tokens``/``positions``/``attention_mask``/``response_mask`` (the response after the
    prompt). No gradient flows through the sampling."""
    state = nnx.merge_state(jax.lax.stop_gradient(params), rest)
    prompt, prompt_mask = left_padded_prompts(batch, prompt_width, sampling.pad_id)
    out = generate(graphdef, state, prompt, prompt_mask, rng, config=sampling)
    tokens, attention_mask, response_mask = out.sequences()
    return {"tokens": tokens, "positions": positions_from_mask(attention_mask), "attention_mask": attention_mask,
            "response_mask": response_mask}


@dataclasses.dataclass(frozen=True)
class _Setup:
    section: object
    window: int | None  # positions scored a row (data.max_response_length)
    sampling: object  # gkd: the student's sampling (SamplingConfig); None for distill
    prompt_width: int
    lmbda: float


def _setup(config: TrainConfig, tokenizer, on_policy: bool) -> _Setup:
    dc, section = config.data, config.distill
    budget = dc.max_response_length or dc.max_length - dc.max_prompt_length
    sampling = None
    if on_policy:
        base = evaluation.greedy_sampling(config, tokenizer)
        sampling = dataclasses.replace(base, greedy=False, temperature=section.temperature, max_new_tokens=budget)
    return _Setup(section, dc.max_response_length, sampling, dc.max_prompt_length,
                  section.lmbda if on_policy else 0.0)


def _divergence(setup: _Setup, student_logits, teacher, mask, normalisers):
    """The loss of one set of rows: ``teacher`` holds full logits (``logits``) or the top-k
    (:data:`TOPK_KEYS`)."""
    s = setup.section
    if "logits" not in teacher:
        return sparse_distill_loss(student_logits, teacher["topk_logps"], teacher["topk_ids"], mask,
                                   temperature=s.temperature, aggregation=s.aggregation, **normalisers)
    if s.top_k is not None:
        logps, ids = teacher_topk(teacher["logits"], s.top_k)
        return sparse_distill_loss(student_logits, logps, ids, mask, temperature=s.temperature,
                                   aggregation=s.aggregation, **normalisers)
    return distill_loss(student_logits, teacher["logits"], mask, divergence=s.divergence, beta=s.beta,
                        temperature=s.temperature, aggregation=s.aggregation, **normalisers)


def _mixed(lmbda: float, on_policy_loss, dataset_loss):
    """The step's loss: on the student's samples with probability ``lmbda``, else on the
    dataset's rows. One coin a (micro-)batch, as GKD draws one a step; ``lmbda`` 0 or 1
    compiles one branch only. A mixture student's load-balancing loss is collected inside
    each ``lax.cond`` branch and returned from it (a branch's values do not exist outside it)."""
    def loss_fn(params, frozen, batch, normalisers, rng):
        if lmbda == 0.0:
            return dataset_loss(params, frozen, batch, normalisers)
        sample_rng, coin_rng = jax.random.split(rng)
        if lmbda == 1.0:
            return on_policy_loss(params, frozen, batch, sample_rng)
        routed = []

        def branch(loss):
            def run():
                with collect_router_losses() as record:
                    out = loss()
                routed.append(bool(record))
                return out, router_objective(record)
            return run

        out, objective = jax.lax.cond(jax.random.uniform(coin_rng) < lmbda,
                                      branch(lambda: on_policy_loss(params, frozen, batch, sample_rng)),
                                      branch(lambda: dataset_loss(params, frozen, batch, normalisers)))
        if any(routed):
            record_router_objective(*objective)
        return out

    return loss_fn


def make_task(config: TrainConfig, graphdef: nnx.GraphDef, rest: nnx.State, *, on_policy: bool = False) -> Task:
    tokenizer = check_same_tokenizer(config)
    teacher = Teacher(config)
    setup = _setup(config, tokenizer, on_policy)

    def student(params):
        return nnx.merge(graphdef, params, rest)

    def teacher_scores(teacher_params, rows):
        """The teacher's top-k of ``rows`` (precomputed tables, the sub-mesh's answer)."""
        logits, _ = window_logits(teacher.model(teacher_params), rows, setup.window)
        return dict(zip(TOPK_KEYS, teacher_topk(logits, config.distill.top_k)))

    def dataset_teacher(frozen, batch):
        if "ref_logps" in batch:  # placement.reference: submesh
            return batch["ref_logps"]
        if "ref_logps" in frozen:  # distill.teacher_logits: precomputed
            return {k: frozen["ref_logps"][k][batch["record_index"]] for k in TOPK_KEYS}
        with frozen_forward():
            logits, _ = window_logits(teacher.model(frozen["reference"]), batch, setup.window)
        return {"logits": jax.lax.stop_gradient(logits)}

    def dataset_loss(params, frozen, batch, normalisers):
        logits, mask = window_logits(student(params), batch, setup.window)
        loss, metrics = _divergence(setup, logits, dataset_teacher(frozen, batch), _example_mask(mask, batch),
                                    normalisers)
        return loss, {**metrics, "on_policy": jnp.float32(0.0)}

    def on_policy_loss(params, frozen, batch, rng):
        rows = student_samples(graphdef, params, rest, batch, rng, setup.sampling, setup.prompt_width)
        logits, mask = window_logits(student(params), rows, setup.sampling.max_new_tokens)
        with frozen_forward():
            t_logits, _ = window_logits(teacher.model(frozen["reference"]), rows, setup.sampling.max_new_tokens)
        teacher_out = {"logits": jax.lax.stop_gradient(t_logits)}
        # the samples' own token counts: the dataset's normalisers do not describe them
        loss, metrics = _divergence(setup, logits, teacher_out, _example_mask(mask, batch), {})
        return loss, {**metrics, "on_policy": jnp.float32(1.0)}

    def normalisers_fn(batch):
        mask = batch["response_mask"][:, 1:].astype(jnp.float32)
        return ops.aggregation_normalisers(_example_mask(mask, batch))

    def eval_fn(params, frozen, batch):
        logits, mask = window_logits(student(params), batch, setup.window)
        mask = _example_mask(mask, batch)
        _, metrics = _divergence(setup, logits, dataset_teacher(frozen, batch), mask, {})
        tokens = jnp.sum(mask)
        return {"divergence": (metrics["divergence"] * tokens, tokens),
                "teacher_agreement": (metrics["teacher_agreement"] * tokens, tokens)}

    precomputed = config.distill.teacher_logits == "precomputed"
    return Task(loss_fn=_mixed(setup.lmbda, on_policy_loss, dataset_loss), normalisers_fn=normalisers_fn,
                eval_fn=eval_fn, uses_reference=True,
                reference_logps=teacher_scores if config.distill.top_k is not None else None,
                precompute=teacher_scores if precomputed else None, reference_params=teacher.build,
                console_keys=("loss", "divergence", "teacher_agreement"))


def make_gkd_task(config: TrainConfig, graphdef: nnx.GraphDef, rest: nnx.State) -> Task:
    """:func:`make_task` with GKD's on-policy steps (``distill.lmbda``)."""
    return make_task(config, graphdef, rest, on_policy=True)
