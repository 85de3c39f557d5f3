"""Compiled memory of the DPO step under each ``model.remat`` policy (and the estimator's
activation figure beside it), same model, shapes and batch, in one process.

    HF_HUB_OFFLINE=1 .venv/bin/python tools/benchmarks/bench_remat.py --model tiny
    HF_HUB_OFFLINE=1 .venv/bin/python tools/benchmarks/bench_remat.py --model smollm2-135m --steps 2 \\
        --out runs/bench/remat.json

The step is tools/benchmarks/bench_dpo.py's alignax side (8 preference pairs x 128 tokens, live
reference, AdamW), built by ``alignax.trainers.api.build_trainer`` with only
``model.remat`` changed, compiled ahead of time (``OfflineTrainer.start``'s donation and
shardings). For each policy: XLA's memory analysis (temporaries are what remat changes;
peak = arguments + outputs - donated + temporaries), the compile time, the median time of
``--steps`` steps (0: compile only) and ``alignax.estimate``'s activation figure for the
same config. Scanned layers (``model.scan_layers``) by default, as the large recipes run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/: bench_common
import bench_common as common  # noqa: E402

common.offline_environment()

import bench_dpo  # noqa: E402

POLICIES = ("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "offload_dots")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=tuple(common.SHAPES))
    parser.add_argument("--steps", type=int, default=0, help="timed steps per policy (0: compile only)")
    parser.add_argument("--loop-layers", action="store_true", help="a Python loop over layers instead of a scan")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the JSON object to this file")
    args = parser.parse_args(argv)
    if args.steps < 0:
        parser.error("--steps must be >= 0")
    # what bench_dpo.train_config and bench_common.model_spec read
    args.weights, args.scan_layers, args.reference = "random", not args.loop_layers, "live"
    args.warmup, args.rounds = 1, max(args.steps, 1)
    return args


def measure(args, policy: str, batches) -> dict:
    import jax

    from alignax.estimate import estimate
    from alignax.trainers import api

    config = bench_dpo.train_config(args)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, remat=policy))
    trainer = api.build_trainer(config, with_data=False)
    state, frozen = trainer.start()  # the fresh state, and what the step reads besides it
    t0 = time.perf_counter()
    step = trainer.step.lower(state, frozen, trainer.place_batch(batches[0])).compile()
    model_config = trainer.model_from(state.params).config
    figures = {"compile_time_s": time.perf_counter() - t0, "compiled_memory": common.compiled_memory(step),
               "estimated_activations_bytes": int(estimate(config, model=model_config, devices=1,
                                                           mesh=(1, 1, 1)).items["activations"])}
    times = []
    for i in range(args.steps + (1 if args.steps else 0)):  # the first step is untimed
        t0 = time.perf_counter()
        state, out = step(state, frozen, trainer.place_batch(batches[i]))
        jax.block_until_ready(out.metrics)
        times.append(time.perf_counter() - t0)
    if args.steps:
        figures["step_time_s_median"] = common.median(times[1:])
        figures["step_times_s"] = times[1:]
    return figures


def main(argv=None) -> None:
    args = parse_args(argv)
    load_start = os.getloadavg()
    batches = bench_dpo.make_batches(args.steps + 1, vocab=int(common.SHAPES[args.model]["vocab_size"]),
                                     seed=args.seed + 1)
    figures = {policy: measure(args, policy, batches) for policy in POLICIES}
    none = figures["none"]["compiled_memory"]["temp_size_in_bytes"]
    result = {
        "task": "dpo step under each remat policy",
        "model": {"preset": args.model, **common.SHAPES[args.model]},
        "shapes": {"pairs": bench_dpo.BATCH, "seq": bench_dpo.SEQ, "prompt_len": bench_dpo.PROMPT,
                   "reference": "live", "scan_layers": args.scan_layers},
        "policies": figures,
        "temporaries_vs_none": {p: f["compiled_memory"]["temp_size_in_bytes"] / none for p, f in figures.items()},
        **common.run_context(load_start),
    }
    common.finish(result, args.out)


if __name__ == "__main__":
    main()
