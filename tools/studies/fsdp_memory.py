"""Per-device memory and collectives of Llama-2-7B-shaped steps as XLA compiles them on
8, 64 and 256 fake CPU devices, without and with the decoder's activation constraints
(issue 12, "Real FSDP").

    .venv/bin/python tools/studies/fsdp_memory.py
    .venv/bin/python tools/studies/fsdp_memory.py --devices 8 64 --programs dpo --out runs/fsdp_memory.json

Each (program, device count, constraints) is one subprocess of tests/fsdp_compile_check.py
(the device count is fixed when jax is imported), which lowers and compiles the program
on a mesh with every device on ``fsdp`` and never runs it. Programs: ``dpo`` (the
offline trainer's DPO step, one pair per device), ``grpo`` (the same step with a GRPO
policy-gradient loss and a live reference, one row per device) and ``rollout`` (the
sampler's ``generate``, one prompt per device, 8 samples each). "before" traces under
``alignax.parallel.activation_constraints(False)``: no activation constraint in the
decoder or the sampler (the sampler's group repeat stays the new broadcast).

Prints one JSON object: the settings, and per program and device count the per-device
GB (``memory_analysis``: arguments + outputs - donated + temporaries), ``after/before``,
and the bytes of all-gather / all-reduce / all-to-all results in the compiled HLO (a
collective in the scanned layer body counts once; CPU moves bfloat16 matmul operands as
float32).

``--sampler`` measures the sampler's decode step instead (one generated token,
``--decode-rows`` rows in all, a cache of ``--seq - 1`` slots) on its own mesh as
``rollout.mesh: [-1, 1, 8]`` lays it out on hosts of 8 devices: ``(devices / 8, 1, 8)``,
tensor parallel within a host and data parallel across hosts, from the bfloat16 copy of
the float32 parameters. Per device count: the mesh, per-device GB, the KV cache's bytes
per device (the donated loop state) and what is all-gathered.

    .venv/bin/python tools/studies/fsdp_memory.py --sampler --devices 8 64 256 --out runs/sampler_memory.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/: bench_common
from bench_common import ROOT, finish, run_on_fake_devices  # noqa: E402

# The compile check is the one tests/test_fsdp_compile.py asserts on: run as a program (by
# path, never imported), so the study measures exactly what the test checks.
CHECK = ROOT / "tests" / "fsdp_compile_check.py"

KINDS = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter")


def measure(program: str, devices: int, constraints: bool, extra: list[str]) -> dict:
    flags = ["--program", program, *extra] + ([] if constraints else ["--no-constraints"])
    return run_on_fake_devices(CHECK, *flags, devices=devices, timeout=3600)


def summary(result: dict) -> dict:
    return {
        "gb": round(result["per_device_gb"], 2),
        "collective_gb": {k: round(result["collectives"][k]["result_bytes"] / 1e9, 2) for k in KINDS},
        "involuntary_remat": result["involuntary_remat"],
        "compile_s": result["compile_s"],
    }


def sampler_rows(devices: list[int], rows: int, seq: int, layers: int) -> dict:
    """The decode step on ``(d / 8, 1, 8)`` for each device count ``d`` (the global batch fixed)."""
    out = []
    for count in devices:
        mesh = f"{max(count // 8, 1)},1,{min(count, 8)}"
        result = run_on_fake_devices(CHECK, "--program", "decode", "--decode-meshes", mesh, "--decode-rows",
                                     str(rows), "--seq", str(seq), "--layers", str(layers), devices=count, timeout=3600)
        decode = result["decode"][0]
        gathers = decode["collectives"]["all-gather"]
        out.append({"devices": count, "mesh": decode["mesh"], "gb": round(decode["memory_total"] / 1e9, 3),
                    "cache_gb": round(decode["memory"]["alias"] / 1e9, 3),
                    "temp_gb": round(decode["memory"]["temp"] / 1e9, 3),
                    "all_gather_elements": decode["all_gather_elements"],
                    "all_gather_gb": round(gathers["result_bytes"] / 1e9, 4), "compile_s": decode["compile_s"]})
        print(json.dumps(out[-1]), file=sys.stderr)
    return {"model": "Llama-2-7B shape (D 4096, 32 heads, F 11008, V 32000)", "program": "decode step",
            "layers": layers, "rows": rows, "cache_slots": seq - 1, "weights": "bfloat16 copy of float32 params",
            "mesh": "(devices / 8, 1, 8): tensor within a host of 8, data across hosts", "sampler": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", nargs="+", default=["dpo", "grpo", "rollout"], choices=("dpo", "grpo", "rollout"))
    parser.add_argument("--devices", nargs="+", type=int, default=[8, 64, 256])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--sampler", action="store_true", help="the sampler's decode step on (devices / 8, 1, 8)")
    parser.add_argument("--decode-rows", type=int, default=64, help="--sampler: rows decoded in all")
    args = parser.parse_args()
    if args.sampler:
        finish(sampler_rows(args.devices, args.decode_rows, args.seq, args.layers), args.out)
        return
    extra = ["--layers", str(args.layers), "--seq", str(args.seq)]
    rows = []
    for program in args.programs:
        for devices in args.devices:
            before = measure(program, devices, False, extra)
            after = measure(program, devices, True, extra)
            rows.append({"program": program, "devices": devices, "before": summary(before), "after": summary(after),
                         "after_over_before": round(after["per_device_gb"] / before["per_device_gb"], 3)})
            print(json.dumps(rows[-1]), file=sys.stderr)
    out = {
        "model": "Llama-2-7B shape (D 4096, 32 heads, F 11008, V 32000)", "layers": args.layers, "seq": args.seq,
        "param_dtype": "float32", "dtype": "bfloat16", "mesh": "all devices on fsdp", "rows": rows,
    }
    finish(out, args.out)


if __name__ == "__main__":
    main()
