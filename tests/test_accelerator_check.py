"""tools/accelerator_check.py end to end on CPU at the tiny shape (the run a lent GPU or TPU
makes at full shapes), so the script never rots: its JSON has every field the device run
reports, with figures worked out here by hand where they are arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tiny shape (tools/accelerator_check.py SHAPES/SIZES): D 64, F 128, L 2, 4 heads of 16
# over 2 kv heads, vocabulary 512, tied head. Matmul parameters per layer: q,k,v,o
# 64*16*(4+4+2+2) = 12,288 and the gated MLP 3*64*128 = 24,576; two layers and the head
# 64*512: 106,496. A forward of 4 rows of 32 tokens: 4*32*(2*106,496 + 4*2*64*32) = 29,360,128.
TINY_FORWARD_4x32 = 29_360_128


@pytest.mark.xdist_group("accelerator_check")
def test_the_device_check_runs_on_cpu_and_reports_every_field(tmp_path):
    out = tmp_path / "check.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    command = [sys.executable, "tools/accelerator_check.py", "--tiny", "--steps", "1", "--budget-s", "3600",
               "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    device = result["device"]
    assert device["platform"] == "cpu" and device["chip"] is None and device["devices_used"] == 1
    assert {"device_kind", "local_devices", "devices", "processes", "jax", "jaxlib", "peak_bf16_flops",
            "hbm_bandwidth_bytes_per_s"} <= set(device)
    assert result["attention_used"] == "xla"

    # every implementation against xla: on CPU, stand-ins (the cuDNN route through XLA's
    # implementation gives XLA's numbers at real tokens; splash interpreted, in bfloat16)
    for name in ("cudnn", "splash"):
        entry = result["attention"][name]
        assert entry["kernel"].startswith("stand-in")
        assert entry["dpo_grad_max_abs"] > 0
        assert 0 <= entry["logits_max_abs_diff"] < 0.05 and 0 <= entry["dpo_grad_rel_diff"] < 0.05, entry
    # the cuDNN route's gather/scatter around XLA's implementation computes XLA's logits at the
    # real tokens: equal on jaxlib 0.10/0.11; jaxlib 0.12 fuses the bfloat16 sums of the two
    # layouts differently, within one bfloat16 rounding (2^-8 relative) of the largest logit.
    # A wrong gather or mask is off by the logits' own size.
    cudnn = result["attention"]["cudnn"]
    assert cudnn["logits_max_abs_diff"] <= 2.0 ** -8 * cudnn["logits_max_abs"], cudnn

    tiny = result["throughput"]["tiny"]
    assert set(tiny) == {"dpo", "grpo", "ppo"}
    dpo = tiny["dpo"]
    assert dpo["rows"] == 4 and dpo["length"] == 32 and dpo["tokens"] == 128
    assert dpo["model_flops"] == 4 * TINY_FORWARD_4x32  # policy forward + backward (3x), reference forward
    phases = {"grpo": (2, 3), "ppo": (3, 6)}  # scoring forwards; update passes (PPO: policy and critic)
    for algorithm, (scoring, update) in phases.items():
        entry = tiny[algorithm]
        assert entry["rows"] == 4 and entry["length"] == 32 and entry["new_tokens"] == 16
        assert entry["rollout"]["tokens"] == 4 * 16 and entry["rollout"]["model_flops"] == TINY_FORWARD_4x32
        assert entry["scoring"]["model_flops"] == scoring * TINY_FORWARD_4x32
        assert entry["update"]["model_flops"] == update * TINY_FORWARD_4x32 and entry["update"]["tokens"] == 128
    for entry in (dpo, tiny["grpo"]["rollout"], tiny["grpo"]["update"], tiny["ppo"]["rollout"], tiny["ppo"]["update"]):
        assert entry["step_s"] > 0
        assert entry["tokens_per_s_per_device"] == pytest.approx(entry["tokens"] / entry["step_s"])
        assert "mfu" in entry and entry["mfu"] is None  # a CPU has no peak in the tables
    for algorithm in ("dpo", "grpo", "ppo"):
        memory = tiny[algorithm]["memory"]
        assert "peak_bytes_in_use" in memory  # None on CPU: memory_stats() has none
        assert memory["compiled_update_bytes"] > 0
        assert 0.5 < memory["estimate_update_step_bytes"] / memory["compiled_update_bytes"] < 2, memory
        assert memory["estimate_total_bytes"] >= memory["estimate_update_step_bytes"]

    decode = result["decode"]["tiny"]
    assert decode["weight_bytes"] == 2 * (106_496 + 2 * (2 * 64) + 64)  # bf16: matmuls, 2 norms per layer, final
    assert set(decode["batches"]) == {"1", "8", "64"}
    for entry in decode["batches"].values():
        assert entry["tokens_per_s"] > 0 and entry["hbm_ceiling_tokens_per_s"] is None
