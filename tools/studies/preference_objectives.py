"""Issue 36's preference objectives side by side: the same tiny DPO run
(``configs/tiny-dpo.yaml``: a random 1-layer Llama with SmolLM2's tokenizer, reasoning-gym
chain_sum pairs) trained with each ``preference`` option, through the public API.

For each option: the eval split's loss, reward accuracy and margin after ``--steps`` steps,
and the median step time after the first step (the compile) with its ratio to the plain
``sigmoid`` run of the same invocation. Prints one JSON object and writes it to ``--json``
(default ``docs/results/preference_objectives.json``), with the machine's load average at
the start and the end (the step times are only comparable within one invocation).

    .venv/bin/python tools/studies/preference_objectives.py --steps 12 [--only sigmoid,wpo]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence

from alignax.trainers.api import load_config, train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(ROOT, "configs", "tiny-dpo.yaml")

# name -> the preference section's keys (over the recipe's sigmoid DPO, beta 0.1)
OPTIONS: dict[str, dict] = {
    "sigmoid": {},
    "bco_pair": {"variant": "bco_pair"},
    "aot": {"variant": "aot"},
    "aot_unpaired": {"variant": "aot_unpaired"},
    "discopop": {"variant": "discopop"},
    "sigmoid_norm": {"variant": "sigmoid_norm"},
    "mpo": {"variant": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
    "rpo": {"rpo_alpha": 1.0},
    "f_js": {"f_divergence": "js"},
    "f_alpha": {"f_divergence": "alpha", "f_alpha": 0.5},
    "wpo": {"use_weighting": True},
    "ld_dpo": {"ld_alpha": 0.5},
    "tr_dpo": {"sync_ref": {"alpha": 0.6, "tau": 4}},
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--only", default=None, help="comma-separated option names (default: all)")
    p.add_argument("--json", default=os.path.join(ROOT, "docs", "results", "preference_objectives.json"))
    return p.parse_args(argv)


def run_option(name: str, section: dict, steps: int, out: str) -> dict:
    config = load_config(RECIPE, [f"output_dir={out}", f"train.total_steps={steps}", "train.save_every=0",
                                  "checkpoint.enabled=false", "logging.console=false", "logging.tensorboard=false"]
                         + [f"preference.{k}={json.dumps(v)}" for k, v in section.items()])
    start = time.perf_counter()
    result = train(config)
    wall = time.perf_counter() - start
    times = [h["perf/step_time_s"] for h in result.history if "perf/step_time_s" in h][1:]
    evals = result.eval_history[-1] if result.eval_history else {}
    return {
        "preference": section,
        "train_loss_last": result.history[-1]["loss"],
        "eval": {k: evals[f"eval/{k}"] for k in ("loss", "rewards/accuracies", "rewards/margins")},
        "step_time_s_median": statistics.median(times) if times else None,
        "wall_s": wall,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    names = list(OPTIONS) if args.only is None else args.only.split(",")
    load_start = os.getloadavg()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            rows[name] = run_option(name, OPTIONS[name], args.steps, os.path.join(tmp, name))
    base = rows.get("sigmoid", {}).get("step_time_s_median")
    for row in rows.values():
        t = row["step_time_s_median"]
        row["step_time_vs_sigmoid"] = (t / base) if (t and base) else None
    out = {
        "command": "tools/studies/preference_objectives.py " + " ".join(argv if argv is not None else []),
        "recipe": "configs/tiny-dpo.yaml", "steps": args.steps, "machine": platform.machine(),
        "cpus": os.cpu_count(), "load_average": {"start": load_start, "end": os.getloadavg()}, "options": rows,
    }
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
