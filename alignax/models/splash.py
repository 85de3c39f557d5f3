"""Causal attention through the Pallas splash kernel (TPU; interpreted elsewhere).

``jax.experimental.pallas.ops.tpu.splash_attention`` computes ``softmax(q k^T) v`` block by
block in the TPU's vector memory, with a forward and two backward kernels: no ``[T, S]``
scores are materialised, for the forward pass or for the backward one. It takes one batch
row and one key/value head at a time (its "MQA" form: the ``G`` query heads of a group share
the head), a static mask (causal here) and segment ids: a query sees a key only when their
ids are equal. Padding is written in those ids — real tokens 0, padded keys 1, and the
slots added to reach a multiple of the block size 2 — so a real query sees exactly the real
keys before it, as the decoder's dense mask says. Shared-prompt packing (a prefix segment
every later segment sees) is not an equality of ids: the decoder refuses ``segment_ids``
under this kernel, and the online trainer does not pack groups with it.

Off TPU the kernel runs in Pallas's interpreter: exact, and slow, which is what the suite
uses to check it against the dense attention on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernels
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

Array = jax.Array

BLOCK = 128  # the kernel's query and key block (a multiple of the TPU's 128 lanes)


@functools.lru_cache(maxsize=32)
def _kernel(length: int, group: int, interpret: bool):
    """The causal splash kernel for ``group`` query heads over one key/value head.

    Built with concrete arrays (``ensure_compile_time_eval``) whatever traces the first call:
    the kernel holds its mask's block tables as arrays, and this cache hands the same kernel
    to every later program, so tables made as one ``jit``'s tracers would leak into the next
    (a train step and an evaluation step of the same length, on TPU)."""
    causal = masks.MultiHeadMask([masks.CausalMask((length, length)) for _ in range(group)])
    sizes = kernels.BlockSizes(block_q=BLOCK, block_kv=BLOCK, block_kv_compute=BLOCK, block_q_dkv=BLOCK,
                               block_kv_dkv=BLOCK, block_kv_dkv_compute=BLOCK, block_q_dq=BLOCK, block_kv_dq=BLOCK)
    with jax.ensure_compile_time_eval():
        return kernels.make_splash_mqa_single_device(causal, block_sizes=sizes, interpret=interpret)


def splash_attention(q: Array, k: Array, v: Array, key_mask: Array, *, scale: float,
                     interpret: bool | None = None) -> Array:
    """Causal attention over a row's real keys.

    Args:
      q: ``[B, T, N, H]`` queries; ``k, v``: ``[B, T, K, H]`` (``N`` a multiple of ``K``).
      key_mask: ``[B, T]``, true at real tokens (left or right padding is false).
      scale: the logits' scale (applied to ``q`` in float32, then cast back).
      interpret: run the Pallas interpreter; ``None``: whenever the backend is not a TPU.

    Returns ``[B, T, N, H]`` in ``q``'s dtype.
    """
    B, T, N, H = q.shape
    K = k.shape[2]
    G = N // K
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    length = -(-T // BLOCK) * BLOCK
    tail = ((0, 0), (0, length - T), (0, 0), (0, 0))
    q = jnp.pad((q.astype(jnp.float32) * scale).astype(q.dtype), tail)
    k, v = jnp.pad(k, tail), jnp.pad(v, tail)
    ids = jnp.pad(jnp.where(key_mask, 0, 1).astype(jnp.int32), ((0, 0), (0, length - T)), constant_values=2)
    heads = q.reshape(B, length, K, G, H).transpose(0, 2, 3, 1, 4)  # [B, K, G, T', H]
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T', H]
    kernel = _kernel(length, G, interpret)

    def one_head(q1, k1, v1, row_ids):
        return kernel(q1, k1, v1, segment_ids=kernels.SegmentIds(q=row_ids, kv=row_ids))

    per_row = jax.vmap(one_head, in_axes=(0, 0, 0, None))  # the K heads of a row
    out = jax.vmap(per_row)(heads, k, v, ids)  # [B, K, G, T', H]
    return out.transpose(0, 3, 1, 2, 4).reshape(B, length, N, H)[:, :T]
