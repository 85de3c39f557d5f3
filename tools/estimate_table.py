"""The README's estimator table: ``alignax estimate --json`` for Llama-2-7B and -70B with
PPO, DPO and GRPO (``configs/<algorithm>.yaml``: their batch, lengths and remat) on
v5e-64, v5p-128, 8xH100 and 2x8xH100, all devices on FSDP, bf16 weights and compute with
a float32 master and float32 Adam moments (the accelerator precision policy), remat
``full``; the recipes' own batch sizes and lengths.

    HF_HUB_OFFLINE=1 .venv/bin/python tools/estimate_table.py --out docs/estimate_table.json

Prints two Markdown tables (per-device GB, fits or not, step time at 40% MFU; † where the
batch is not a multiple of the batch devices: the estimate's note), with the recipes'
batches and with ``data.batch_size`` = the devices (a pair or a prompt per device: the
smallest batch a multi-host pod places), and writes the JSON of every cell (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODELS = ("llama-2-7b", "llama-2-70b")
ALGORITHMS = ("ppo", "dpo", "grpo")
# name -> (device kind of alignax.estimate.PEAK_FLOPS / DEVICE_MEMORY, devices)
PLATFORMS = {"v5e-64": ("v5e", 64), "v5p-128": ("v5p", 128), "8xH100": ("h100", 8), "2x8xH100": ("h100", 16)}
POLICY = ["precision.param_dtype=bfloat16", "precision.compute_dtype=bfloat16", "precision.master_dtype=float32",
          "model.remat=full"]


def cell(algorithm: str, model: str, platform: str, per_device: bool = False) -> dict:
    """One ``alignax estimate --json``; ``per_device``: ``data.batch_size`` = the devices
    (a pair or a prompt per device, the smallest batch a multi-host pod places)."""
    from alignax import cli

    device, devices = PLATFORMS[platform]
    argv = ["estimate", str(ROOT / "configs" / f"{algorithm}.yaml"), "--model", model, "--devices", str(devices),
            "--mesh", f"1,{devices},1", "--device", device, "--json", *POLICY,
            *([f"data.batch_size={devices}"] if per_device else [])]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(argv)
    if code:
        raise SystemExit(f"alignax {' '.join(argv)} exited {code}")
    return {"algorithm": algorithm, "model": model, "platform": platform, "per_device_batch": per_device,
            "command": "alignax " + " ".join(argv),
            **json.loads(out.getvalue().strip().splitlines()[-1])}


def markdown(cells: list[dict], per_device: bool = False) -> str:
    lines = ["| model | algorithm | " + " | ".join(PLATFORMS) + " |", "|---|---|" + "---|" * len(PLATFORMS)]
    for model in MODELS:
        for algorithm in ALGORITHMS:
            row = []
            for platform in PLATFORMS:
                c = next(c for c in cells if (c["model"], c["algorithm"], c["platform"], c["per_device_batch"])
                         == (model, algorithm, platform, per_device))
                verdict = "fits" if c["fits"] else "**no**"
                whole = " †" if c["notes"] else ""  # rows the batch devices do not divide: see the estimate's note
                row.append(f"{c['total_bytes'] / 1e9:.1f} GB {verdict}, {c['step_seconds_at_mfu']:.1f} s{whole}")
            lines.append(f"| {model} | {algorithm} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON of every cell here")
    args = parser.parse_args()
    cells = [cell(a, m, p, per_device) for per_device in (False, True) for m in MODELS for a in ALGORITHMS
             for p in PLATFORMS]
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"policy": POLICY, "cells": cells}, indent=1) + "\n", encoding="utf-8")
    print("The recipes' batches:\n" + markdown(cells) + "\n\ndata.batch_size = the devices (one pair or prompt each):\n"
          + markdown(cells, per_device=True))


if __name__ == "__main__":
    main()
