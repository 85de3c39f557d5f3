"""DPO step time and memory under each precision policy: float32 vs bfloat16 (with its
float32 master copy), same model, shapes and batches, in one process.

    HF_HUB_OFFLINE=1 .venv/bin/python tools/benchmarks/bench_precision.py --model tiny
    HF_HUB_OFFLINE=1 .venv/bin/python tools/benchmarks/bench_precision.py --model smollm2-135m --steps 2 --rounds 2 \\
        --out runs/bench/precision.json

The run is tools/benchmarks/bench_dpo.py's alignax side (8 preference pairs x 128 tokens, packed
shared prompt, live reference, AdamW lr 1e-5 constant, no clipping), built once per policy
by ``alignax.trainers.api.build_trainer`` with only ``precision`` changed:

  float32:   every dtype float32 (the default policy);
  bfloat16:  ``precision.param_dtype: bfloat16``, ``precision.compute_dtype: bfloat16``
             (float32 master copy and Adam moments, bfloat16 reference).

Each policy's jitted step (``OfflineTrainer.start``: the donation and shardings of
``alignax train``) is compiled ahead of time; XLA's memory analysis of that executable
gives its peak (``arguments + outputs - donated aliases + temporaries``), and the train
state plus the reference give the bytes held between steps. Steps are timed in
alternating rounds (float32, bfloat16, float32, ...), so a change of machine load falls on
both; ``ratio`` = float32 median step time / bfloat16 median step time (> 1: bfloat16 is
faster). On CPU, XLA runs many bfloat16 ops through float32 conversions, so the time ratio
there says little about an accelerator; the memory figures do.
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

POLICIES = {
    "float32": {},
    "bfloat16": {"param_dtype": "bfloat16", "compute_dtype": "bfloat16"},
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=tuple(common.SHAPES))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per policy and round")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the policies")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per policy first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the JSON object to this file")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--steps and --rounds must be >= 1, --warmup >= 0")
    # what bench_dpo.train_config and bench_common.model_spec read
    args.weights, args.scan_layers, args.reference = "random", False, "live"
    return args


def nbytes(tree) -> int:
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


class Policy:
    """One policy's trainer, its compiled step and its timed steps."""

    def __init__(self, args, name: str, batches):
        import jax

        from alignax.trainers import api
        from alignax.trainers.config import PrecisionConfig

        self.name, self.batches, self.position = name, batches, 0
        config = dataclasses.replace(bench_dpo.train_config(args), precision=PrecisionConfig(**POLICIES[name]))
        t0 = time.perf_counter()
        trainer = api.build_trainer(config, with_data=False)
        self.placer = trainer.place_batch
        self.state, self.frozen = trainer.start()  # the fresh state, and what the step reads besides it
        self.held_bytes = {"params": nbytes(self.state.params), "optimizer_state": nbytes(self.state.opt_state),
                           "reference": nbytes(self.frozen)}
        t1 = time.perf_counter()
        self.step = trainer.step.lower(self.state, self.frozen, self.placer(batches[0])).compile()
        self.compile_s = time.perf_counter() - t1
        self.build_s = t1 - t0
        self.memory = common.compiled_memory(self.step)
        self.times, self.losses = [], []
        jax.block_until_ready(self.state)

    def run(self, n: int, *, timed: bool = True) -> None:
        import jax

        for _ in range(n):
            batch = self.placer(self.batches[self.position])
            self.position += 1
            t0 = time.perf_counter()
            self.state, out = self.step(self.state, self.frozen, batch)
            metrics = jax.device_get(out.metrics)
            if timed:
                self.times.append(time.perf_counter() - t0)
            self.losses.append(float(metrics["loss"]))

    def summary(self) -> dict:
        return {"step_time_s_median": common.median(self.times), "step_time_s_min": min(self.times),
                "step_times_s": self.times, "compile_time_s": self.compile_s, "build_time_s": self.build_s,
                "compiled_memory": self.memory, "held_between_steps_bytes": self.held_bytes,
                "held_total_bytes": sum(self.held_bytes.values()), "losses": self.losses,
                "precision": POLICIES[self.name] or "all float32"}


def main(argv=None) -> None:
    args = parse_args(argv)
    load_start = os.getloadavg()
    total = len(POLICIES) * (args.warmup + args.rounds * args.steps)
    batches = bench_dpo.make_batches(total, vocab=int(common.SHAPES[args.model]["vocab_size"]), seed=args.seed + 1)
    policies = {name: Policy(args, name, batches) for name in POLICIES}
    for policy in policies.values():
        policy.run(args.warmup, timed=False)
    for _ in range(args.rounds):
        for policy in policies.values():
            policy.run(args.steps)
    figures = {name: policy.summary() for name, policy in policies.items()}
    f32, bf16 = figures["float32"], figures["bfloat16"]
    result = {
        "task": "dpo step under each precision policy",
        "model": {"preset": args.model, **common.SHAPES[args.model]},
        "shapes": {"pairs": bench_dpo.BATCH, "seq": bench_dpo.SEQ, "prompt_len": bench_dpo.PROMPT,
                   "packing": "shared prompt", "reference": "live"},
        "steps": args.steps, "rounds": args.rounds, "warmup": args.warmup,
        **figures,
        "ratio": f32["step_time_s_median"] / bf16["step_time_s_median"],
        "ratio_min": f32["step_time_s_min"] / bf16["step_time_s_min"],
        "peak_memory_ratio": bf16["compiled_memory"]["peak_bytes"] / f32["compiled_memory"]["peak_bytes"],
        "held_memory_ratio": bf16["held_total_bytes"] / f32["held_total_bytes"],
        **common.run_context(load_start),
    }
    common.finish(result, args.out)


if __name__ == "__main__":
    main()
