"""Offline preference optimisation: DPO and its variants, SimPO, CPO, ORPO, KTO.

Chosen and rejected sequences go through the policy in one forward pass (concatenated
on the batch axis). The frozen reference is either live (``frozen["reference"]``, run
under ``stop_gradient``), or its log-probs of the batch come with the batch
(``batch["ref_logps"]``, computed on devices of its own: ``placement.reference:
submesh``), or precomputed once before training (``frozen["ref_logps"]``, per record,
looked up by ``batch["record_index"]``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from alignax import models
from alignax.config import Is
from alignax.losses import preference as pref
from alignax.models.moe import frozen_forward
from alignax.trainers.engine import packing
from alignax.trainers.engine.setup import response_hidden, response_logps, sequence_logps
from alignax.trainers.config import TrainConfig
from alignax.trainers.offline.task import Task

Array = jax.Array
USES_REFERENCE = Is("preference.loss", "dpo", "kto")  # simpo, cpo and orpo are reference-free
def _example_weights(batch: Mapping[str, Array], key: str) -> Array:
    if "example_mask" in batch:
        return batch["example_mask"].astype(jnp.float32)
    return jnp.ones(batch[key].shape[:1], jnp.float32)


class PairLogps(NamedTuple):
    """A batch of pairs as the losses read it, each ``[B]``: the sequence log-probs of chosen
    and rejected (LD-DPO's reweighted sums with ``preference.ld_alpha``), the response lengths,
    the plain summed chosen log-probs (the NLL terms'), and WPO's per-pair weights (or ``None``)."""

    chosen: Array
    rejected: Array
    chosen_lengths: Array
    rejected_lengths: Array
    chosen_plain: Array
    wpo_scale: Array | None = None


def _pair_token_logps(model, batch, chunk_size, window, wpo: bool):
    """Token log-probs and masks of chosen and rejected (each ``[B, W]``), and WPO's aligned
    sums ``[2B]`` when ``wpo`` (else ``None``).

    With ``prompt_length`` in the batch (the data pipeline's preference batches) and a
    response window shorter than the rows, the pair is one packed row (the prompt once,
    then chosen, then rejected; see :mod:`alignax.trainers.engine.packing`); otherwise chosen and
    rejected are two rows of one forward pass (also under ``model.attention=splash|cudnn``,
    whose kernels cannot express a prompt both continuations see, and with WPO, whose
    weights read each position's full distribution: ``[2B, W, V]`` logits, no gradient).
    """
    rows = batch["chosen_tokens"].shape[1]
    if not wpo and "prompt_length" in batch and packing.pair_packs(model.config.attention, row_length=rows,
                                                                  window=window):
        sides = [{k: batch[f"{side}_{k}"] for k in ("tokens", "attention_mask", "response_mask")}
                 for side in ("chosen", "rejected")]
        logps, mask = packing.packed_response_logps(
            model, packing.pack(sides, batch["prompt_length"], window), chunk_size=chunk_size
        )
        return (logps[0], mask[0]), (logps[1], mask[1]), None
    both = {
        k: jnp.concatenate([batch[f"chosen_{k}"], batch[f"rejected_{k}"]])
        for k in ("tokens", "positions", "attention_mask", "response_mask")
    }
    args = (model, both["tokens"], both["positions"], both["attention_mask"], both["response_mask"])
    aligned = None
    if wpo:
        hidden, targets, mask = response_hidden(*args, window=window)
        logps = models.token_logprobs_from_hidden(hidden, model, targets, chunk_size=chunk_size)
        # WPO's aligned log-probs, model.logprob_chunk_size positions of logits at a time
        terms = models.map_time_chunks(lambda h, y: pref.wpo_token_terms(model.logits(h), y),
                                       jax.lax.stop_gradient(hidden), targets, chunk_size=chunk_size)
        aligned = jnp.sum(jnp.where(mask > 0, terms, 0.0), axis=-1)
    else:
        logps, mask = response_logps(*args, chunk_size=chunk_size, window=window)
    b = batch["chosen_tokens"].shape[0]
    return (logps[:b], mask[:b]), (logps[b:], mask[b:]), aligned


def _pair_logps(model, batch, chunk_size, window, ld_alpha=None, wpo=False) -> PairLogps:
    """:class:`PairLogps` of a batch (:func:`_pair_token_logps`'s forward pass)."""
    (logps_c, mask_c), (logps_r, mask_r), aligned = _pair_token_logps(model, batch, chunk_size, window, wpo)
    seq_c, len_c = sequence_logps(logps_c, mask_c)
    seq_r, len_r = sequence_logps(logps_r, mask_r)
    chosen_plain = seq_c
    if ld_alpha is not None:
        seq_c, seq_r = pref.ld_sequence_logps(logps_c, mask_c, logps_r, mask_r, alpha=ld_alpha)
    scale = None
    if aligned is not None:
        b = seq_c.shape[0]
        scale = pref.wpo_weights(aligned[:b], aligned[b:], len_c, len_r)
    return PairLogps(seq_c, seq_r, len_c, len_r, chosen_plain, scale)


def _single_logps(model, batch, prefix, chunk_size, window):
    logps, mask = response_logps(
        model, batch[f"{prefix}tokens"], batch[f"{prefix}positions"], batch[f"{prefix}attention_mask"],
        batch[f"{prefix}response_mask"], chunk_size=chunk_size, window=window,
    )
    return sequence_logps(logps, mask)


@dataclasses.dataclass(frozen=True)
class _Forward:
    """The forward passes of the family: the policy's (and the live reference's) summed
    response log-probs of a batch, or the reference's from the batch or a precomputed table."""

    graphdef: nnx.GraphDef
    rest: nnx.State
    chunk: int | None  # model.logprob_chunk_size
    window: int | None  # data.max_response_length: the LM head runs on response positions only
    ld_alpha: float | None = None  # preference.ld_alpha (policy and reference alike)
    wpo: bool = False  # preference.use_weighting (the policy's pass only)

    def model(self, params):
        return nnx.merge(self.graphdef, params, self.rest)

    def pair(self, params, batch, *, policy: bool = False) -> PairLogps:
        """:class:`PairLogps` of the batch; WPO's weights on the ``policy``'s pass only."""
        return _pair_logps(self.model(params), batch, self.chunk, self.window, self.ld_alpha, self.wpo and policy)

    def single(self, params, batch, prefix):
        """``(summed log-probs [B], lengths [B])`` of the ``prefix`` rows (KTO's completion or KL partner)."""
        return _single_logps(self.model(params), batch, prefix, self.chunk, self.window)

    def reference(self, frozen, batch, keys):
        """The reference's figures ``keys`` of ``batch``: carried by the batch (a sub-mesh
        reference), looked up in the precomputed table, or run live under stop_gradient."""
        if "ref_logps" in batch:
            return tuple(batch["ref_logps"][k] for k in keys)
        if "ref_logps" in frozen:
            return tuple(frozen["ref_logps"][k][batch["record_index"]] for k in keys)
        with frozen_forward():  # a mixture reference's routing trains nothing
            live = _reference_logps(keys == ("completion", "kl"), self)(frozen["reference"], batch)
        return tuple(jax.lax.stop_gradient(live[k]) for k in keys)


def _paired_loss(section, forward: _Forward, params, frozen, batch, weights, num_pairs, num_chosen_tokens):
    """The ``preference.loss`` of a batch of pairs: ``(loss, metrics)``."""
    pairs = forward.pair(params, batch, policy=True)
    pol_c, pol_r, len_c, len_r = pairs.chosen, pairs.rejected, pairs.chosen_lengths, pairs.rejected_lengths
    common = dict(weights=weights, num_pairs=num_pairs)
    if section.loss == "dpo":
        ref_c, ref_r = forward.reference(frozen, batch, ("chosen", "rejected"))
        return pref.dpo_loss(pol_c, pol_r, ref_c, ref_r, len_c, len_r, **_dpo_options(section), **common,
                             pair_scale=pairs.wpo_scale, chosen_nll_logps=pairs.chosen_plain,
                             num_chosen_tokens=num_chosen_tokens)
    if section.loss == "simpo":
        return pref.simpo_loss(pol_c, pol_r, len_c, len_r, beta=section.beta, gamma=section.simpo_gamma,
                               label_smoothing=section.label_smoothing, **common)
    if section.loss == "cpo":
        return pref.cpo_loss(pol_c, pol_r, len_c, beta=section.beta, alpha=section.cpo_alpha,
                             label_smoothing=section.label_smoothing, num_chosen_tokens=num_chosen_tokens, **common)
    return pref.orpo_loss(pol_c, pol_r, len_c, len_r, beta=section.beta, num_chosen_tokens=num_chosen_tokens, **common)


def _dpo_options(section) -> dict:
    """``dpo_loss``'s keywords from the ``preference`` section."""
    return dict(beta=section.beta, variant=section.variant, loss_weights=section.loss_weights,
                label_smoothing=section.label_smoothing, dpop_lambda=section.dpop_lambda,
                discopop_tau=section.discopop_tau, f_divergence=section.f_divergence, f_alpha=section.f_alpha,
                rpo_alpha=section.rpo_alpha)


def _reads_chosen_nll(section) -> bool:
    """Whether the loss has a token-mean NLL of the chosen responses (CPO, ORPO, a mixture's sft, RPO)."""
    if section.loss in ("cpo", "orpo"):
        return True
    variants = (section.variant,) if isinstance(section.variant, str) else section.variant
    return section.loss == "dpo" and (pref.SFT_TERM in variants or section.rpo_alpha is not None)


def _kto_loss(section, forward: _Forward, params, frozen, batch, weights, num_examples):
    """KTO of a batch of unpaired records and their KL partners: ``(loss, metrics)``."""
    policy, _ = forward.single(params, batch, "")
    with frozen_forward():  # the KL partners' pass is under stop_gradient (the reference point): it trains nothing
        kl_policy, _ = forward.single(params, batch, "kl_")
    ref, kl_ref = forward.reference(frozen, batch, ("completion", "kl"))
    ref_point = pref.kto_reference_point(kl_policy, kl_ref, weights=weights)
    return pref.kto_loss(
        policy, ref, batch["label"], beta=section.beta, desirable_weight=section.kto_desirable_weight,
        undesirable_weight=section.kto_undesirable_weight, kl_ref_point=ref_point, weights=weights,
        num_examples=num_examples,
    )


def make_task(config: TrainConfig, graphdef: nnx.GraphDef, rest: nnx.State) -> Task:
    # data.format and preference.variant were checked when the config loaded (the algorithm map's entry)
    section = config.preference
    loss_name = section.loss
    uses_reference = USES_REFERENCE(config)
    forward = _Forward(graphdef, rest, config.model.logprob_chunk_size, config.data.max_response_length,
                       ld_alpha=section.ld_alpha, wpo=section.use_weighting)
    reads_nll = _reads_chosen_nll(section)

    def normalisers_fn(batch):
        key = "tokens" if loss_name == "kto" else "chosen_tokens"
        weights = _example_weights(batch, key)
        out = {"num_pairs": jnp.sum(weights)}
        if reads_nll:
            mask = batch["chosen_response_mask"][:, 1:].astype(jnp.float32)
            out["num_chosen_tokens"] = jnp.sum(mask * weights[:, None])
        return out

    def loss_fn(params, frozen, batch, normalisers, rng):
        del rng
        if loss_name == "kto":
            return _kto_loss(section, forward, params, frozen, batch, _example_weights(batch, "tokens"),
                             normalisers["num_pairs"])
        return _paired_loss(section, forward, params, frozen, batch, _example_weights(batch, "chosen_tokens"),
                            normalisers["num_pairs"], normalisers.get("num_chosen_tokens"))

    def eval_fn(params, frozen, batch):
        # The loss's metrics are means weighted by example_mask; turned back into sums so
        # padded eval batches add up exactly.
        loss, metrics = loss_fn(params, frozen, batch, normalisers_fn(batch), None)
        count = normalisers_fn(batch)["num_pairs"]
        figures = {"loss": loss, **metrics}
        return {k: (v * count, count) for k, v in figures.items()}

    reference_logps = _reference_logps(loss_name == "kto", forward) if uses_reference else None
    sync = section.sync_ref if uses_reference else None
    return Task(
        loss_fn=loss_fn,
        normalisers_fn=normalisers_fn,
        eval_fn=eval_fn,
        uses_reference=uses_reference,
        reference_logps=reference_logps,
        precompute=reference_logps if section.reference == "precomputed" else None,
        sync_reference=None if sync is None else functools.partial(sync_reference, alpha=sync.alpha, tau=sync.tau),
        console_keys=("loss", "rewards/accuracies", "rewards/margins", "grad_norm"),
    )


def _reference_logps(unpaired: bool, forward: _Forward):
    """The reference's sequence log-probs of a batch: ``{chosen, rejected}`` of the pairs,
    or KTO's (``unpaired``) ``{completion, kl}`` (``ref_logps``, per batch or precomputed per record)."""

    def reference_forward(reference_params, batch):
        if unpaired:
            return {"completion": forward.single(reference_params, batch, "")[0],
                    "kl": forward.single(reference_params, batch, "kl_")[0]}
        pairs = forward.pair(reference_params, batch)
        return {"chosen": pairs.chosen, "rejected": pairs.rejected}

    return reference_forward


def sync_reference(params, reference, step, *, alpha: float, tau: int):
    """TR-DPO's soft update (Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good
    Alignment", eq. 5): at every ``tau``-th step (``step % tau == 0``, ``step`` the updates
    attempted so far) ``reference <- alpha * params + (1 - alpha) * reference``, mixed in
    float32 and stored in the reference's dtype; otherwise the reference unchanged (a
    ``lax.cond``: no arithmetic on the other steps)."""

    def mix(p, r):
        return jax.tree.map(lambda a, b: (alpha * a.astype(jnp.float32) + (1.0 - alpha) * b.astype(jnp.float32))
                            .astype(b.dtype), p, r)

    return jax.lax.cond(step % tau == 0, mix, lambda p, r: r, params, reference)
