"""Shared-prompt packing: one prompt and its ``n`` continuations in one row.

A preference pair repeats its prompt in the chosen and the rejected row, and the trunk
runs over it twice. Packed, a pair is one row

    [ prompt (p) | continuation 1 (L_1) | continuation 2 (L_2) | ... | pad ]

with segment ids 0 (prompt), 1, 2, ... and positions restarting at ``p`` for every
continuation. The decoder's ``segment_ids`` mask lets each continuation see the prompt and
itself only, so every hidden state equals the one of the unpacked ``prompt + continuation``
row (same tokens, same positions, same visible keys); the trunk runs on ``p + sum L_k``
tokens instead of ``n (p + L)`` — a quarter fewer for DPO with prompts as long as the
responses.

Scoring: token ``i`` of continuation ``k`` sits at packed column ``s_k + i`` and is scored
by the hidden state at ``s_k + i - 1``, except its first token (``i = 0``), which the
prompt's last hidden state (column ``p - 1``) scores — in the unpacked row that is the
same state. Only a ``window`` of positions per continuation is scored (the LM head never
runs over the prompt), so every continuation must be at most ``window`` tokens long: the
data pipeline enforces ``data.max_response_length`` on every example, and a row that breaks
it gets NaN log-probs (a skipped, counted update) rather than silently dropped tokens.

Inputs are the right-padded rows of the data pipeline (``alignax.data.pipeline``): per
continuation ``tokens``, ``attention_mask``, ``response_mask`` ``[B, T]`` holding the same
prompt in their first ``prompt_length [B]`` columns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import struct

from alignax import models

Array = jax.Array

# Attention kernels whose masks are causal + real keys only (splash: equal segment ids;
# cuDNN: sequence lengths): a prefix every continuation sees is beyond them, so rows they
# run are never packed.
FUSED_ATTENTION = ("splash", "cudnn")


@struct.dataclass
class Packed:
    """Packed rows ``[B, W]`` and where each continuation's scored tokens are.

    ``score_hidden`` / ``score_target`` ``[n, B, window]``: packed columns of the hidden
    state that scores each token and of the token itself; ``score_mask`` ``[n, B, window]``:
    1 where the token is a response token to train on (the rows' ``response_mask``).
    ``fits [B]``: every continuation of the row is at most ``window`` tokens long.
    """

    tokens: Array
    positions: Array
    attention_mask: Array
    segment_ids: Array
    score_hidden: Array
    score_target: Array
    score_mask: Array
    fits: Array


def packed_width(row_length: int, num_continuations: int, window: int) -> int:
    """``T + (n - 1) * window``: the first row as it is, then ``window`` per continuation."""
    return row_length + (num_continuations - 1) * window


def pair_packs(attention: str, *, row_length: int, window: int | None) -> bool:
    """Whether a preference pair runs as one packed row (the prompt once, then chosen, then
    rejected): when the LM head's response window is shorter than the rows and the
    attention can express a prompt both continuations see (not the fused kernels)."""
    return attention not in FUSED_ATTENTION and window is not None and window < row_length


def pack(rows: Sequence[Mapping[str, Array]], prompt_length: Array, window: int) -> Packed:
    """Pack ``n`` right-padded rows sharing a prompt into one row each (see module docstring)."""
    if not rows:
        raise ValueError("pack needs at least one continuation")
    B, T = rows[0]["tokens"].shape
    n = len(rows)
    width = packed_width(T, n, window)
    p = prompt_length.astype(jnp.int32)[:, None]  # [B, 1]
    col = jnp.arange(width, dtype=jnp.int32)[None, :]  # [1, W]
    i = jnp.arange(window, dtype=jnp.int32)[None, :]  # [1, window]

    def take(x, index):
        return jnp.take_along_axis(x, jnp.clip(index, 0, T - 1), axis=1)

    tokens = take(rows[0]["tokens"], col)  # the prompt (and garbage past it, overwritten below)
    positions = col
    segment = jnp.zeros((B, width), jnp.int32)
    start = p
    hidden_cols, target_cols, score_masks = [], [], []
    fits = jnp.ones((B,), bool)
    for k, row in enumerate(rows, start=1):
        length = jnp.sum(row["attention_mask"], axis=1, keepdims=True, dtype=jnp.int32) - p  # [B, 1]
        fits = fits & (length[:, 0] <= window)
        inside = (col >= start) & (col < start + length)
        source = p + col - start  # column of the same token in the unpacked row
        tokens = jnp.where(inside, take(row["tokens"], source), tokens)
        positions = jnp.where(inside, source, positions)
        segment = jnp.where(inside, k, segment)
        target = start + i
        hidden_cols.append(jnp.where(i == 0, jnp.maximum(p - 1, 0), target - 1))
        target_cols.append(jnp.minimum(target, width - 1))
        scored = (i < length) & (p + i >= 1) & (target < width)
        score_masks.append(take(row["response_mask"], p + i).astype(jnp.float32) * scored)
        start = start + length
    real = col < start
    return Packed(
        tokens=tokens,  # past the last continuation: leftover ids of the first row, masked out
        positions=jnp.where(real, positions, 0),
        attention_mask=real.astype(jnp.int32),
        segment_ids=jnp.where(real, segment, 0),
        score_hidden=jnp.stack(hidden_cols),
        score_target=jnp.stack(target_cols),
        score_mask=jnp.stack(score_masks),
        fits=fits,
    )


def packed_response_logps(model, packed: Packed, *, chunk_size: int | None = None) -> tuple[Array, Array]:
    """Per-token log-probs of every continuation's scored window from one packed forward.

    Returns ``(logps [n, B, window], mask [n, B, window])``, the values
    :func:`alignax.trainers.common.response_logps` gives for each unpacked row with the
    same window. Rows that do not fit get NaN log-probs.
    """
    hidden = model(
        packed.tokens, packed.positions, packed.attention_mask, segment_ids=packed.segment_ids, return_logits=False
    ).hidden
    n, B, window = packed.score_hidden.shape
    flat = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, n * window)  # [n, B, W] -> [B, n * W]
    h = jnp.take_along_axis(hidden, flat(packed.score_hidden)[:, :, None], axis=1)
    targets = jnp.take_along_axis(packed.tokens, flat(packed.score_target), axis=1)
    logps = models.token_logprobs_from_hidden(h, model, targets, chunk_size=chunk_size)
    logps = jnp.moveaxis(logps.reshape(B, n, window), 1, 0)
    poison = jnp.where(packed.fits, 0.0, jnp.nan)[None, :, None]
    return logps + poison, packed.score_mask


def pack_groups(tokens: Array, positions: Array, attention_mask: Array, *, prompt_len: int, group: int):
    """Rollout rows ``[R, P + N]`` (left-padded prompt ``P``, then a response window ``N``;
    ``group`` consecutive rows share their prompt) as ``[R / group, P + group * N]`` rows:
    the prompt once, then each response's window in turn. Returns ``(tokens, positions,
    attention_mask, segment_ids)``; positions and masks are the unpacked rows', so each
    response sees the same prompt at the same positions. A pure reshape: no gather."""
    R, width = tokens.shape
    n = width - prompt_len
    if R % group:
        raise ValueError(f"{R} rollout rows do not form groups of {group}")

    def packed(x):
        x = x.reshape(R // group, group, width)
        return jnp.concatenate([x[:, 0, :prompt_len], x[:, :, prompt_len:].reshape(R // group, group * n)], axis=1)

    segments = jnp.concatenate([jnp.zeros((prompt_len,), jnp.int32), jnp.repeat(jnp.arange(1, group + 1), n)])
    segments = jnp.broadcast_to(segments, (R // group, prompt_len + group * n))
    return packed(tokens), packed(positions), packed(attention_mask), segments


def group_scoring_states(x: Array, *, prompt_len: int, group: int) -> Array:
    """From a packed forward's per-position outputs ``[R / group, P + group * N, ...]``,
    the ones that predict each response token, back in rollout row order: ``[R, N, ...]``.
    Response ``k``'s first token is predicted at the prompt's last column ``P - 1``, its
    token ``i > 0`` at its own column ``i - 1``."""
    rows, width = x.shape[:2]
    n = (width - prompt_len) // group
    last_prompt = x[:, prompt_len - 1 : prompt_len]
    responses = x[:, prompt_len:].reshape(rows, group, n, *x.shape[2:])
    parts = [jnp.concatenate([last_prompt, responses[:, k, : n - 1]], axis=1) for k in range(group)]
    return jnp.stack(parts, axis=1).reshape(rows * group, n, *x.shape[2:])


def group_packing_pays(config, *, prompt_len: int, new_tokens: int, group: int) -> bool:
    """Whether one packed row per group costs less than ``group`` unpacked rows.

    Per token and layer a forward pass costs ``2 * (layer parameters)`` FLOPs in the
    projections plus ``4 * T * N * H`` in attention over ``T`` key slots (computed densely,
    masked or not). Packing cuts tokens from ``G (P + N)`` to ``P + G N`` but lengthens
    the rows, so attention per token grows; it pays when the total is lower and the
    attention scores held at once stay within twice the unpacked ones. ``config`` is the
    policy's :class:`alignax.models.ModelConfig`.
    """
    c = config
    q_dim = c.num_heads * c.head_dim
    layer_params = 2 * c.hidden_size * (q_dim + c.num_kv_heads * c.head_dim)
    layer_params += c.hidden_size * c.intermediate_size * (3 if c.gated_mlp else 2)
    unpacked_len, packed_len = prompt_len + new_tokens, prompt_len + group * new_tokens

    def flops(tokens):
        return tokens * (2 * layer_params + 4 * tokens * q_dim)

    return flops(packed_len) < group * flops(unpacked_len) and packed_len**2 <= 2 * group * unpacked_len**2


def packed_group_size(config, model_config, *, minibatches: int, batch_devices: int = 1) -> int:
    """``G`` when an online trainer's forward passes pack each group into one row, else 1.

    ``config`` is the run's ``TrainConfig`` (``rollout.pack_groups``, ``num_samples``,
    lengths, ``data.batch_size`` prompts, ``train.grad_accum_steps``), ``model_config`` the
    policy's :class:`alignax.models.ModelConfig`, ``batch_devices`` the devices a batch's
    rows are split over (the mesh's ``data`` x ``fsdp``). Packing needs every minibatch and
    micro-batch to hold whole groups (minibatches are then drawn group by group);
    ``pack_groups: on`` says so when they cannot, and when ``model.attention`` is a fused kernel,
    which cannot express the shared-prompt mask. ``auto`` also leaves the rows unpacked when
    the packed rows would not split over the batch devices but the unpacked ones do: a
    row dimension that does not divide is not split at all (the logical-axis rule), so
    every device would run every packed group, ``G`` times the tokens of its share of
    unpacked rows (e.g. 4 packed PPO groups on 8 devices).
    """
    rc = config.rollout
    G, P, N = rc.num_samples, config.data.max_prompt_length, rc.max_new_tokens
    if rc.pack_groups == "off" or G < 2:
        return 1
    if model_config.attention in FUSED_ATTENTION:
        if rc.pack_groups == "on":
            raise ValueError(f"rollout.pack_groups=on needs a shared-prompt mask, which model.attention="
                             f"{model_config.attention} cannot express; set rollout.pack_groups=auto or off")
        return 1
    if rc.pack_groups == "auto" and not group_packing_pays(model_config, prompt_len=P, new_tokens=N, group=G):
        return 1
    prompts = config.data.batch_size
    rows_per_micro = prompts * G // (minibatches * config.train.grad_accum_steps)
    if prompts % minibatches or rows_per_micro % G:
        if rc.pack_groups == "on":
            raise ValueError(
                f"rollout.pack_groups=on needs whole groups of {G} in every minibatch and micro-batch; "
                f"{prompts} prompts into {minibatches} minibatches x "
                f"{config.train.grad_accum_steps} micro-batches do not give that"
            )
        return 1
    packed_rows = rows_per_micro // G
    if rc.pack_groups == "auto" and packed_rows % batch_devices and rows_per_micro % batch_devices == 0:
        return 1
    return G
