"""FSDP as compiled (issue 12): a Llama-2-7B-shaped step on 8 and 64 fake CPU devices,
lowered and compiled, never run (tests/fsdp_compile_check.py).

The mesh tests compare values, which are the same whatever XLA moves. These look at
the plan: per-device memory from ``compiled.memory_analysis()`` and the collectives of
the compiled HLO. Without the decoder's activation constraints (measured by turning
:func:`alignax.parallel.activation_constraints` off) the DPO step keeps weights in place
and all-reduces activations over ``fsdp``: 22.5 GB per device on 8 devices and 16.9 GB
on 64 (0.75x), 3.3 GB of all-reduce on 8 and 26 GB on 64, growing with the global
batch. With them: 22.5 GB and 4.5 GB (0.20x), weights all-gathered, and the only
all-reduces are the weight gradients of one layer and of the LM head (1.33 GB on both).
The sampler's prompt KV cache repeated over GRPO groups all-gathered the whole cache
(2.1 GB on 8 devices) before ``jnp.repeat`` lost ``total_repeat_length``. On its own
mesh (``rollout.mesh``, tensor parallel) from the bfloat16 copy, a decode step gathers no
weight; on the training mesh from the float32 weights it gathers every kernel per token.

Bytes are those of the CPU backend, which upcasts bfloat16 matmuls to float32 after
partitioning, so its weight all-gathers and gradient all-reduces move float32.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import pytest

from alignax.parallel import activation_constraints, constrain
from tests.fake_devices import run_check

D, F, NH, V = 4096, 11008, 32 * 128, 32000  # Llama-2-7B: model dim, MLP, heads x head dim, vocab
LAYER = 4 * D * NH + 3 * D * F + 2 * D  # parameters of one decoder layer (with its two norm scales)
F32 = 4


# The rollout check also compiles the sampler's decode step (one generated token, 16 rows,
# a 511-slot cache) on its own meshes (1, 1, 2) and (1, 1, 8) from the compute-dtype copy,
# and on the training mesh (1, 8, 1) from the float32 training weights: one subprocess.
ROLLOUT = ("rollout", 8, "--decode-meshes", "1,1,2", "1,1,8", "1,8,1:train")


@functools.lru_cache(maxsize=None)
def compiled(program: str, devices: int, *flags: str) -> dict:
    return run_check("fsdp_compile_check.py", "--program", program, *flags, devices=devices)


def test_fsdp_dpo_step_gathers_weights_and_memory_falls_with_devices():
    small, large = compiled("dpo", 8), compiled("dpo", 64)
    # Parameters, reference and Adam state are sharded 8x more finely; what stays is one
    # gathered layer and one pair's activations. Without the constraints: 0.75x.
    assert large["memory"]["total"] < 0.35 * small["memory"]["total"], (small["memory"], large["memory"])
    for result in (small, large):
        gathers, reduces = result["collectives"]["all-gather"], result["collectives"]["all-reduce"]
        # Every layer kernel is all-gathered whole (forward, rematerialised forward, backward)...
        assert {D * NH, D * F} <= set(result["all_gather_elements"]), result["all_gather_elements"]
        assert gathers["result_bytes"] >= 3 * LAYER * F32, gathers
        # ...and the only all-reduces are weight gradients (one layer in the scan body, the
        # LM head, the embedding) and scalars; activations all-reduced over fsdp would add
        # ~0.8 GB per matmul and grow with the device count.
        assert reduces["result_bytes"] <= 1.01 * (LAYER + 2 * V * D) * F32, reduces
        assert reduces["largest_result_bytes"] <= LAYER * F32, reduces
    assert large["collectives"]["all-reduce"]["result_bytes"] <= small["collectives"]["all-reduce"]["result_bytes"]


def test_fsdp_group_rollout_repeats_the_prompt_cache_in_place():
    """GRPO's rollout: one prompt per device, 8 samples each; the prompt's KV cache is
    repeated on the device that holds it, never gathered whole."""
    result = compiled(*ROLLOUT)
    cache_bytes = 32 * 8 * 511 * NH * 2  # [L, B, S, K, H] bfloat16, one of k / v, the whole batch
    gathers = result["collectives"]["all-gather"]
    assert gathers["largest_result_bytes"] <= V * D * F32 < cache_bytes, gathers
    # Sharded weights (fp32, 1/8) + this device's 8 rows of cache + one gathered layer: 6.8 GB
    # (9.5 GB with the cache gathered).
    assert result["memory"]["total"] < 8e9, result["memory"]


def test_sampler_mesh_decodes_without_gathering_weights_and_memory_falls_with_devices():
    """The decode step on the sampler's own meshes (heads, MLP and vocab over ``tensor``,
    bfloat16 kernels) gathers no weight: its only all-gather is the 16 rows' logits. On
    the training mesh from the float32 weights it all-gathers every layer kernel per
    token. Per-device memory falls 4x from 2 to 8 devices (weights and KV cache split)."""
    two, eight, train = compiled(*ROLLOUT)["decode"]
    assert (two["mesh"], eight["mesh"], train["mesh"]) == ([1, 1, 2], [1, 1, 8], [1, 8, 1])
    for own in (two, eight):
        assert own["weight_dtypes"] == ["bfloat16"] and own["cache_dtype"] == "bfloat16"
        assert own["all_gather_elements"] == [16 * V], own["all_gather_elements"]  # [16, V] float32 logits
        # the only all-reduces are [16, D] activations summed over the tensor split
        assert own["collectives"]["all-reduce"]["largest_result_bytes"] <= 16 * D * F32, own["collectives"]
    assert train["weight_dtypes"] == ["float32"]
    assert {D * NH, D * F, V * D} <= set(train["all_gather_elements"]), train["all_gather_elements"]
    assert eight["memory_total"] < 0.3 * two["memory_total"], (two["memory"], eight["memory"])


@pytest.mark.slow
def test_fsdp_constraints_off_is_the_old_plan():
    """The switch measures what the constraints buy: off, the 64-device DPO step
    all-reduces activations (more bytes than on 8) and needs over half the memory of 8."""
    small, large = compiled("dpo", 8, "--no-constraints"), compiled("dpo", 64, "--no-constraints")
    assert large["memory"]["total"] > 0.5 * small["memory"]["total"]
    assert large["collectives"]["all-reduce"]["result_bytes"] > 4 * small["collectives"]["all-reduce"]["result_bytes"]


def test_constrain_is_the_identity_without_a_mesh():
    x = jnp.ones((2, 3, 4))
    assert constrain(x, ("batch", "length", "activation_embed")) is x
    with activation_constraints(False):
        assert constrain(x, ("batch", "length", "activation_embed")) is x
    with pytest.raises(ValueError, match="2 axis names"):
        constrain(x, ("batch", "length"))
