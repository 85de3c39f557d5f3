"""A rollout as the update sees it: typed, on device, fixed shapes.

Shapes: ``B`` prompts per rollout (``data.batch_size``), ``G`` samples per prompt
(``rollout.num_samples``), ``R = B * G`` rows, ``P`` prompt width, ``N`` response budget.
Row ``r`` answers prompt ``group_ids[r] = r // G``; every per-token array is ``[R, N]``
over the response tokens only (the log-prob of response token ``t`` comes from the
hidden state at sequence position ``P + t - 1``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from alignax.models import token_logprobs_from_hidden
from alignax.parallel.multihost import process_rows
from alignax.trainers.engine import packing

Array = jax.Array


def response_forward(model, tokens, positions, attention_mask, *, prompt_len: int, temperature: float,
                     chunk_size: int | None, group: int = 1):
    """``(logps [R, N], entropy [R, N], values [R, N] or None)`` of the response tokens.

    One forward over prompt + response; the LM head only runs on the ``N`` positions that
    predict response tokens, at ``temperature`` (the sampler's), in float32. With
    ``group > 1`` the ``group`` rows that share a prompt run as one packed row (the prompt
    once; :func:`alignax.trainers.engine.packing.pack_groups`): same outputs, fewer tokens.
    """
    hidden, values = response_states(model, tokens, positions, attention_mask, prompt_len=prompt_len, group=group)
    logps, entropy = token_logprobs_from_hidden(
        hidden, model, tokens[:, prompt_len:], chunk_size=chunk_size, temperature=temperature, with_entropy=True,
    )
    return logps, entropy, values


def response_states(model, tokens, positions, attention_mask, *, prompt_len: int, group: int = 1):
    """``(hidden [R, N, D], values [R, N] or None)``: the final hidden states (and a value
    head's outputs) at the ``N`` positions that predict the response tokens, from one forward
    over prompt + response (``group > 1``: packed as :func:`response_forward` says). What a
    loss of the whole next-token distributions reads (``model.logits(hidden)``)."""
    if group > 1:
        packed_tokens, packed_positions, packed_mask, segments = packing.pack_groups(
            tokens, positions, attention_mask, prompt_len=prompt_len, group=group)
        out = model(packed_tokens, packed_positions, packed_mask, segment_ids=segments, return_logits=False)
        states = lambda x: packing.group_scoring_states(x, prompt_len=prompt_len, group=group)  # noqa: E731
    else:
        out = model(tokens, positions, attention_mask, return_logits=False)
        states = lambda x: x[:, prompt_len - 1 : -1]  # noqa: E731
    return states(out.hidden), None if out.values is None else states(out.values)


@struct.dataclass
class Rollout:
    """One rollout's rows on device.

    ``tokens``/``positions``/``attention_mask`` ``[R, P + N]``: prompt then response.
    ``loss_mask [R, N]``: response tokens that get loss (truncated completions are left
    out under ``rewards.mask_truncated``). ``old_logps`` is ``None`` when the single update
    supplies them (its own forward pass, gradient stopped); ``ref_logps`` is ``None`` when
    the run has no reference model (a zero fixed KL coefficient).
    """

    tokens: Array
    positions: Array
    attention_mask: Array
    loss_mask: Array
    sampler_logps: Array
    old_logps: Array | None
    ref_logps: Array | None
    old_values: Array
    advantages: Array
    returns: Array

    def take(self, index: Array) -> Rollout:
        """The rows ``index`` (``[M]`` int32), in that order."""
        return jax.tree.map(lambda x: jnp.take(x, index, axis=0), self)


@struct.dataclass
class Minibatch:
    """What one update step reads: a minibatch of rollout rows; the KL coefficient of the
    controller (a scalar, shared by every micro-batch); the update's position in the
    learning-rate schedule (``rollout * epochs * minibatches + update``); and, for PPO-ptx,
    a batch of SFT rows (``tokens``, ``positions``, ``attention_mask``, ``response_mask``)."""

    rollout: Rollout
    kl_coef: Array
    schedule_position: Array
    ptx: Any = None
    entropy_coef: Array | None = None  # the adaptive entropy coefficient this rollout applies (None: fixed)


@struct.dataclass
class UpdateRows:
    """Per-row outputs of an update's forward pass, gradient stopped, ``[rows, N]``:
    the policy's log-probs and entropy and, when the loss runs the frozen model itself
    (:attr:`~alignax.trainers.online.algorithm.OnlineAlgorithm.reference_in_update`), its
    log-probs of the sampled tokens (``None`` otherwise)."""

    logps: Array
    entropy: Array
    ref_logps: Array | None = None


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Which rollout rows are whose: ``num_prompts`` prompts (every process's: the global
    ``data.batch_size``) of ``group_size`` samples each, ``rows = B * G``. Each process
    samples, scores and picks minibatch rows of its own ``local_prompts`` prompts
    (:mod:`alignax.parallel.multihost`), global rows ``row_offset`` on."""

    num_prompts: int
    group_size: int

    @property
    def rows(self) -> int:
        return self.num_prompts * self.group_size

    @property
    def local_prompts(self) -> int:
        return self.num_prompts // jax.process_count()

    @property
    def local_rows(self) -> int:
        return self.local_prompts * self.group_size

    @property
    def row_offset(self) -> int:
        return process_rows(self.rows).start

    def group_ids(self) -> np.ndarray:
        """``[R_local]`` int32: the global prompt index of each of this process's rows (no
        two processes share a group)."""
        first = self.row_offset // self.group_size
        return np.repeat(np.arange(first, first + self.local_prompts, dtype=np.int32), self.group_size)
