"""What a second process costs: step time of 1 process x 8 fake CPU devices against
2 processes x 4 (gloo collectives), on the tiny DPO and GRPO recipes.

    HF_HUB_OFFLINE=1 .venv/bin/python tools/benchmarks/bench_multiprocess.py
    HF_HUB_OFFLINE=1 .venv/bin/python tools/benchmarks/bench_multiprocess.py --algorithms dpo --rounds 3 --out runs/bench/mp.json

Both layouts train the same recipe (configs/tiny-dpo.yaml, configs/tiny-grpo.yaml: a
2-layer random Llama with SmolLM2's vocabulary) through ``alignax.trainers.api.train`` on
the same mesh shape ``(1, 8, 1)`` and the same global batch (GRPO: 8 prompts, one per device); only the process count
differs, so the difference is what crossing processes costs: gloo all-reduces of the
gradients and all-gathers of the fsdp-sharded weights between the processes, the
per-process data share, and (GRPO) the host-side gathers of the rollout's figures. Step
times are the trainer's own ``perf/step_time_s`` (process 0's; every process waits for
the same collectives), the first ``--warmup`` steps of each launch dropped (compiles).

The layouts run in alternating rounds (1x8, 2x4, 1x8, 2x4, ...) so that a change of
machine load during the run falls on both. Each launch is a fresh set of processes
(``--xla_force_host_platform_device_count`` must be set before jax starts). Prints one
JSON object: per algorithm and layout the pooled median and minimum step time and each
round's median, and ``two_over_one`` (the 2x4 median over the 1x8 median).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/: bench_common
import bench_common as common  # noqa: E402

common.offline_environment()

LAYOUTS = {"1x8": (1, 8), "2x4": (2, 4)}  # processes x devices per process: 8 devices either way
RECIPES = {"dpo": "tiny-dpo.yaml", "grpo": "tiny-grpo.yaml"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", nargs="+", default=list(RECIPES), choices=tuple(RECIPES))
    parser.add_argument("--steps", type=int, default=6, help="timed steps per launch")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first in each launch (compiles)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the two layouts")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a launch is killed")
    parser.add_argument("--out", default=None, help="also write the JSON object to this file")
    parser.add_argument("--worker", nargs=5, metavar=("PROCESS_ID", "NUM_PROCESSES", "PORT", "ALGORITHM", "OUTPUT_DIR"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1 or args.rounds < 1:
        parser.error("--steps, --warmup and --rounds must be >= 1 (the first step compiles)")
    return args


def worker(args) -> None:
    """One process of a launch: train the recipe, print its step times as one JSON line."""
    process_id, num_processes, port, algorithm, output_dir = args.worker
    import jax

    from alignax.trainers.api import load_config, train

    overrides = [f"output_dir={output_dir}", f"train.total_steps={args.warmup + args.steps}", "train.log_every=1",
                 "train.eval_every=0", "checkpoint.enabled=false", "logging.console=false",
                 "logging.tensorboard=false", "logging.jsonl=false", "mesh.shape=[1,-1,1]", "data.eval_fraction=0.0"]
    if algorithm == "grpo":  # the recipe's 4 prompts do not split over 8 devices
        overrides.append("data.batch_size=8")
    if int(num_processes) > 1:
        overrides += [f"distributed.coordinator=127.0.0.1:{port}", f"distributed.num_processes={num_processes}",
                      f"distributed.process_id={process_id}"]
    config = load_config(str(common.ROOT / "configs" / RECIPES[algorithm]), overrides=overrides)
    result = train(config)
    times = [row["perf/step_time_s"] for row in result.history if "perf/step_time_s" in row]
    print(json.dumps({"process": jax.process_index(), "processes": jax.process_count(),
                      "devices": jax.device_count(), "local_devices": jax.local_device_count(),
                      "step_times_s": times}), flush=True)


def launch(args, algorithm: str, layout: str, output_dir: str) -> dict:
    """One fresh launch of ``layout``; process 0's report."""
    processes, devices = LAYOUTS[layout]
    env = common.fake_devices_env(devices)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    argv = [sys.executable, __file__, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    procs = [subprocess.Popen(argv + ["--worker", str(p), str(processes), port, algorithm, output_dir], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for p in range(processes)]
    reports = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=args.timeout)
            if proc.returncode != 0:
                raise RuntimeError(f"{algorithm} {layout} failed (exit {proc.returncode}):\n{err[-4000:]}")
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:  # a failed or timed-out launch leaves no process waiting on a collective
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    report = next(r for r in reports if r["process"] == 0)
    assert (report["processes"], report["devices"]) == (processes, 8), report
    return report


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    load_start = os.getloadavg()
    started = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory(prefix="alignax-bench-mp-") as scratch:
        for algorithm in args.algorithms:
            rounds: dict[str, list[list[float]]] = {layout: [] for layout in LAYOUTS}
            for r in range(args.rounds):
                for layout in LAYOUTS:
                    report = launch(args, algorithm, layout, os.path.join(scratch, f"{algorithm}-{layout}-{r}"))
                    rounds[layout].append(report["step_times_s"][args.warmup:])
                    print(json.dumps({"progress": {"algorithm": algorithm, "layout": layout, "round": r,
                                                   "step_times_s": rounds[layout][-1]}}), file=sys.stderr, flush=True)
            figures = {}
            for layout, timed in rounds.items():
                pooled = [t for one in timed for t in one]
                figures[layout] = {"step_time_s_median": common.median(pooled), "step_time_s_min": min(pooled),
                                   "round_medians_s": [common.median(one) for one in timed], "step_times_s": pooled}
            figures["two_over_one"] = figures["2x4"]["step_time_s_median"] / figures["1x8"]["step_time_s_median"]
            figures["two_over_one_min"] = figures["2x4"]["step_time_s_min"] / figures["1x8"]["step_time_s_min"]
            results[algorithm] = figures
    common.finish({
        "benchmark": "multiprocess", "layouts": {k: {"processes": p, "devices_per_process": d}
                                                 for k, (p, d) in LAYOUTS.items()},
        "mesh_shape": [1, 8, 1], "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds,
        "recipes": {a: f"configs/{RECIPES[a]}" for a in args.algorithms}, "results": results,
        "wall_time_s": time.perf_counter() - started, "context": common.run_context(load_start),
    }, args.out)


if __name__ == "__main__":
    main()
