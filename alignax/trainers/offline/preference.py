"""Offline preference optimisation: DPO and its variants, SimPO, CPO, ORPO, KTO.

Chosen and rejected sequences go through the policy in one forward pass (concatenated
on the batch axis). The frozen reference is either live (``frozen["reference"]``, run
under ``stop_gradient``), or its log-probs of the batch come with the batch
(``batch["ref_logps"]``, computed on devices of its own: ``placement.reference:
submesh``), or precomputed once before training (``frozen["ref_logps"]``, per record,
looked up by ``batch["record_index"]``).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from alignax.losses import preference as pref
from alignax.trainers.engine import packing
from alignax.trainers.engine.setup import response_logps, sequence_logps
from alignax.trainers.config import TrainConfig
from alignax.trainers.offline.task import Task

Array = jax.Array
PAIRED_LOSSES = ("dpo", "simpo", "cpo", "orpo")
REFERENCE_FREE = ("simpo", "cpo", "orpo")
def _example_weights(batch: Mapping[str, Array], key: str) -> Array:
    if "example_mask" in batch:
        return batch["example_mask"].astype(jnp.float32)
    return jnp.ones(batch[key].shape[:1], jnp.float32)


def _pair_logps(model, batch, chunk_size, window):
    """Summed response log-probs and lengths of chosen and rejected: 4 arrays ``[B]``.

    With ``prompt_length`` in the batch (the data pipeline's preference batches) and a
    response window shorter than the rows, the pair is one packed row (the prompt once,
    then chosen, then rejected; see :mod:`alignax.trainers.engine.packing`); otherwise chosen and
    rejected are two rows of one forward pass (also under ``model.attention=splash|cudnn``,
    whose kernels cannot express a prompt both continuations see).
    """
    rows = batch["chosen_tokens"].shape[1]
    if "prompt_length" in batch and packing.pair_packs(model.config.attention, row_length=rows, window=window):
        sides = [{k: batch[f"{side}_{k}"] for k in ("tokens", "attention_mask", "response_mask")}
                 for side in ("chosen", "rejected")]
        logps, mask = packing.packed_response_logps(
            model, packing.pack(sides, batch["prompt_length"], window), chunk_size=chunk_size
        )
        (seq_c, seq_r), (len_c, len_r) = sequence_logps(logps, mask)
        return seq_c, seq_r, len_c, len_r
    both = {
        k: jnp.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]])
        for k in ("tokens", "positions", "attention_mask", "response_mask")
    }
    logps, mask = response_logps(
        model, both["tokens"], both["positions"], both["attention_mask"], both["response_mask"], chunk_size=chunk_size,
        window=window,
    )
    seq, lengths = sequence_logps(logps, mask)
    b = batch["chosen_tokens"].shape[0]
    return seq[:b], seq[b:], lengths[:b], lengths[b:]


def _single_logps(model, batch, prefix, chunk_size, window):
    logps, mask = response_logps(
        model, batch[f"{prefix}tokens"], batch[f"{prefix}positions"], batch[f"{prefix}attention_mask"],
        batch[f"{prefix}response_mask"], chunk_size=chunk_size, window=window,
    )
    return sequence_logps(logps, mask)


def make_task(config: TrainConfig, graphdef: nnx.GraphDef, rest: nnx.State) -> Task:
    section = config.dpo
    chunk = config.model.logprob_chunk_size
    window = config.data.max_response_length  # the LM head runs on response positions only
    loss_name = section.loss
    uses_reference = loss_name not in REFERENCE_FREE
    if loss_name == "kto" and config.data.format != "unpaired":
        raise ValueError(f"dpo.loss=kto needs data.format=unpaired; got {config.data.format!r}")
    if loss_name in PAIRED_LOSSES and config.data.format != "preference":
        raise ValueError(f"dpo.loss={loss_name} needs data.format=preference; got {config.data.format!r}")
    if loss_name == "dpo" and section.variant not in pref.DPO_VARIANTS:
        raise ValueError(f"unknown dpo.variant {section.variant!r}; valid: {', '.join(pref.DPO_VARIANTS)}")

    def model_of(params):
        return nnx.merge(graphdef, params, rest)

    def reference_pair(frozen, batch):
        if "ref_logps" in batch:
            return batch["ref_logps"]["chosen"], batch["ref_logps"]["rejected"]
        if "ref_logps" in frozen:
            idx = batch["record_index"]
            return frozen["ref_logps"]["chosen"][idx], frozen["ref_logps"]["rejected"][idx]
        ref_c, ref_r, _, _ = _pair_logps(model_of(frozen["reference"]), batch, chunk, window)
        return jax.lax.stop_gradient(ref_c), jax.lax.stop_gradient(ref_r)

    def paired_loss(params, frozen, batch, weights, num_pairs, num_chosen_tokens):
        pol_c, pol_r, len_c, len_r = _pair_logps(model_of(params), batch, chunk, window)
        if loss_name == "dpo":
            ref_c, ref_r = reference_pair(frozen, batch)
            return pref.dpo_loss(
                pol_c, pol_r, ref_c, ref_r, len_c, len_r, beta=section.beta, variant=section.variant,
                label_smoothing=section.label_smoothing, dpop_lambda=section.dpop_lambda,
                weights=weights, num_pairs=num_pairs,
            )
        if loss_name == "simpo":
            return pref.simpo_loss(pol_c, pol_r, len_c, len_r, beta=section.beta, gamma=section.simpo_gamma,
                                   label_smoothing=section.label_smoothing, weights=weights, num_pairs=num_pairs)
        if loss_name == "cpo":
            return pref.cpo_loss(pol_c, pol_r, len_c, beta=section.beta, alpha=section.cpo_alpha,
                                 label_smoothing=section.label_smoothing, weights=weights, num_pairs=num_pairs,
                                 num_chosen_tokens=num_chosen_tokens)
        return pref.orpo_loss(pol_c, pol_r, len_c, len_r, beta=section.beta, weights=weights, num_pairs=num_pairs,
                              num_chosen_tokens=num_chosen_tokens)

    def kto(params, frozen, batch, weights, num_examples):
        model = model_of(params)
        policy, _ = _single_logps(model, batch, "", chunk, window)
        kl_policy, _ = _single_logps(model, batch, "kl_", chunk, window)
        if "ref_logps" in batch:
            ref, kl_ref = batch["ref_logps"]["completion"], batch["ref_logps"]["kl"]
        elif "ref_logps" in frozen:
            idx = batch["record_index"]
            ref, kl_ref = frozen["ref_logps"]["completion"][idx], frozen["ref_logps"]["kl"][idx]
        else:
            reference = model_of(frozen["reference"])
            ref = jax.lax.stop_gradient(_single_logps(reference, batch, "", chunk, window)[0])
            kl_ref = jax.lax.stop_gradient(_single_logps(reference, batch, "kl_", chunk, window)[0])
        ref_point = pref.kto_reference_point(kl_policy, kl_ref, weights=weights)
        return pref.kto_loss(
            policy, ref, batch["label"], beta=section.beta, desirable_weight=section.kto_desirable_weight,
            undesirable_weight=section.kto_undesirable_weight, kl_ref_point=ref_point, weights=weights,
            num_examples=num_examples,
        )

    def normalisers_fn(batch):
        key = "tokens" if loss_name == "kto" else "chosen_tokens"
        weights = _example_weights(batch, key)
        out = {"num_pairs": jnp.sum(weights)}
        if loss_name in ("cpo", "orpo"):
            mask = batch["chosen_response_mask"][:, 1:].astype(jnp.float32)
            out["num_chosen_tokens"] = jnp.sum(mask * weights[:, None])
        return out

    def loss_fn(params, frozen, batch, normalisers, rng):
        del rng
        if loss_name == "kto":
            return kto(params, frozen, batch, _example_weights(batch, "tokens"), normalisers["num_pairs"])
        return paired_loss(params, frozen, batch, _example_weights(batch, "chosen_tokens"),
                           normalisers["num_pairs"], normalisers.get("num_chosen_tokens"))

    def eval_fn(params, frozen, batch):
        # The loss's metrics are means weighted by example_mask; turned back into sums so
        # padded eval batches add up exactly.
        loss, metrics = loss_fn(params, frozen, batch, normalisers_fn(batch), None)
        count = normalisers_fn(batch)["num_pairs"]
        figures = {"loss": loss, **metrics}
        return {k: (v * count, count) for k, v in figures.items()}

    reference_logps = _reference_logps(loss_name, chunk, window, model_of) if uses_reference else None
    return Task(
        loss_fn=loss_fn,
        normalisers_fn=normalisers_fn,
        eval_fn=eval_fn,
        uses_reference=uses_reference,
        reference_logps=reference_logps,
        precompute=reference_logps if section.reference == "precomputed" else None,
        console_keys=("loss", "rewards/accuracies", "rewards/margins", "grad_norm"),
    )


def _reference_logps(loss_name, chunk, window, model_of):
    """The reference's sequence log-probs of a batch: ``{chosen, rejected}`` of the pairs,
    or KTO's ``{completion, kl}`` (``ref_logps``, per batch or precomputed per record)."""

    def forward(reference_params, batch):
        reference = model_of(reference_params)
        if loss_name == "kto":
            return {
                "completion": _single_logps(reference, batch, "", chunk, window)[0],
                "kl": _single_logps(reference, batch, "kl_", chunk, window)[0],
            }
        ref_c, ref_r, _, _ = _pair_logps(reference, batch, chunk, window)
        return {"chosen": ref_c, "rejected": ref_r}

    return forward
