"""The monitor against reward over-optimisation (issue 32 item 4): the setup of
``tools/studies/overoptimisation.py`` (a Bradley-Terry proxy trained on pairs that a gold
reward labelled; GRPO against the proxy alone), run twice from the same start with a held-out
gold signal (``monitor.gold``):

- ``warn``: the gold-divergence alarm only warns (today's behaviour);
- ``rollback``: the same alarm rolls back to the gold-best checkpoint, halves the learning rate
  and raises the KL coefficient (``monitor.rollback``), at most ``--max-rollbacks`` times.

1. the first ``--pair-prompts`` prompts are the training prompts; the next ``--gold-prompts``
   whose text is not a training prompt's (reasoning-gym's small tasks repeat prompts) are the
   gold set, written to ``<out>/gold.jsonl``;
2. pairs: the starting policy's ``--label-samples`` samples of each training prompt, best vs
   worst by the gold reward (``--gold-function``, default the dense
   ``alignax.rewards.verifiers:numeric_closeness``), as the over-optimisation study makes them;
3. the proxy reward model trained on them (``--rm-steps``);
4. the two GRPO runs against the proxy (``--rl-steps``, ``--kl-coef``), the gold set scored
   greedily every ``--gold-every`` rollouts by the gold reward; each run's gold points (gold,
   proxy: the mean rollout reward since the previous point, sqrt of the rollouts' sequence KL
   to the reference), its alarm events and its ``gold.png``.

Prints and writes ``<out>/guarded_overoptimisation.json``:

    .venv/bin/python tools/studies/guarded_overoptimisation.py --out runs/guarded [--rl-steps 6 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # overoptimisation: the study's stages

from overoptimisation import CHAIN_SUM, proxy_config, proxy_rewards  # noqa: E402

from alignax import evaluation  # noqa: E402
from alignax.data import write_jsonl  # noqa: E402
from alignax.data.builders import generate, is_generator_spec  # noqa: E402
from alignax.models import save_pretrained  # noqa: E402
from alignax.parallel.sharding import mesh_for_shape  # noqa: E402
from alignax.trainers.api import load_config, train  # noqa: E402
from alignax.trainers.program import load_model, load_tokenizer, sample_pairs  # noqa: E402

DENSE_GOLD = "alignax.rewards.verifiers:numeric_closeness"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/guarded")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prompts", default=CHAIN_SUM, help="prompt records: a JSONL path or a generator spec")
    p.add_argument("--gold-function", default=DENSE_GOLD, help="gold reward module:function")
    p.add_argument("--max-prompt-length", type=int, default=56)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--pair-prompts", type=int, default=32, help="training prompts (pairs are made from them)")
    p.add_argument("--gold-prompts", type=int, default=8, help="held-out prompts of the gold signal")
    p.add_argument("--label-samples", type=int, default=4)
    p.add_argument("--rm-steps", type=int, default=8)
    p.add_argument("--rm-lr", type=float, default=5e-5)
    p.add_argument("--rl-steps", type=int, default=6)
    p.add_argument("--rl-group", type=int, default=4)
    p.add_argument("--rl-lr", type=float, default=2e-5)
    p.add_argument("--kl-coef", type=float, default=0.01, help="GRPO's KL coefficient (both runs)")
    p.add_argument("--gold-every", type=int, default=2)
    p.add_argument("--max-rollbacks", type=int, default=2)
    p.add_argument("--lr-factor", type=float, default=0.5)
    p.add_argument("--kl-factor", type=float, default=4.0)
    p.add_argument("--min-gold-drop", type=float, default=0.0,
                   help="the alarm: gold fell by more than this between two consecutive gold points ...")
    p.add_argument("--min-proxy-rise", type=float, default=0.0,
                   help="... while the proxy rose by more than this (-inf: whatever the proxy did)")
    p.add_argument("--arms", default="warn,rollback", help="which runs, comma-separated")
    p.add_argument("--reuse", action="store_true",
                   help="read <out>/proxy and the arms whose <out>/<arm>/gold.json exist instead of running them "
                        "again (an interrupted study; the report says which were read)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scan-layers", action="store_true")
    return p.parse_args(argv)


def split_prompts(args) -> tuple[str, str]:
    """``(train.jsonl, gold.jsonl)`` under ``args.out``: the first ``--pair-prompts`` records,
    then ``--gold-prompts`` records whose prompt text no training record has."""
    records = generate(args.prompts, "prompt") if is_generator_spec(args.prompts) else [
        json.loads(line) for line in open(args.prompts, encoding="utf-8") if line.strip()]
    train_records = records[:args.pair_prompts]
    seen = {r["prompt"] for r in train_records}
    gold = [r for r in records[args.pair_prompts:] if r["prompt"] not in seen and not seen.add(r["prompt"])]
    if len(gold) < args.gold_prompts:
        raise ValueError(f"--prompts {args.prompts}: {len(gold)} held-out prompts after the {args.pair_prompts} "
                         f"training ones; --gold-prompts is {args.gold_prompts}")
    paths = os.path.join(args.out, "train.jsonl"), os.path.join(args.out, "gold.jsonl")
    write_jsonl(train_records, paths[0])
    write_jsonl(gold[:args.gold_prompts], paths[1])
    return paths


def gold_rewards(args) -> dict:
    return {"verifier_weight": 0.0, "format_weight": 0.0, "functions": {args.gold_function: 1.0}}


def run_config(args, output_dir: str, rewards: dict, train_path: str, monitor: dict | None = None,
               steps: int | None = None):
    """GRPO on the training prompts (no eval split: the gold set is the held-out one)."""
    data = {
        "algorithm": "grpo", "output_dir": output_dir,
        "model": {"name": args.model, "scan_layers": args.scan_layers},
        "data": {"paths": [train_path], "format": "prompt", "max_prompt_length": args.max_prompt_length,
                 "batch_size": args.batch_size, "eval_fraction": 0.0, "read_threads": 0},
        "rollout": {"max_new_tokens": args.max_new_tokens, "num_samples": args.rl_group, "temperature": 1.0},
        "rewards": rewards,
        "grpo": {"kl_coef": args.kl_coef},
        "optim": {"learning_rate": args.rl_lr, "schedule": "constant", "warmup_steps": 0},
        "train": {"total_steps": steps or args.rl_steps, "seed": args.seed},
        "checkpoint": {"keep": 1, "async_save": False, "overwrite": True},
        "logging": {"console": False, "tensorboard": True},
        "mesh": {"shape": [1, 1, 1]},
    }
    if monitor is not None:
        data["monitor"] = monitor
    return load_config(data=data)


def monitor_section(args, gold_path: str, action: str) -> dict:
    rollback = {"rollback": {"max_rollbacks": args.max_rollbacks, "lr_factor": args.lr_factor,
                             "kl_factor": args.kl_factor}} if action == "rollback" else {}
    return {**rollback,
        "gold": {"prompts": {"paths": [gold_path], "format": "prompt", "max_prompt_length": args.max_prompt_length,
                             "batch_size": args.batch_size},
                 "every": args.gold_every, "max_prompts": args.gold_prompts, "rewards": gold_rewards(args)},
        # gold fell (at all) while the proxy rose, between two consecutive gold points
        "gold_divergence": {"action": action, "window": 1, "min_gold_drop": args.min_gold_drop,
                            "min_proxy_rise": args.min_proxy_rise},
    }


def make_proxy(args, train_path: str) -> tuple[str, dict]:
    """Stages 2 and 3: gold-labelled pairs and the proxy trained on them; ``(proxy dir, figures)``."""
    label_config = run_config(args, os.path.join(args.out, "labels"), gold_rewards(args), train_path)
    label_config = dataclasses.replace(label_config, rollout=dataclasses.replace(
        label_config.rollout, num_samples=args.label_samples))
    tokenizer, base = load_tokenizer(label_config), load_model(label_config)
    graphdef, state = nnx.split(base)
    sampler = evaluation.build_sampler(graphdef, tokenizer, label_config, mesh=mesh_for_shape([1, 1, 1]),
                                       vocab_size=base.config.vocab_size)
    pairs, figures = sample_pairs(sampler, state, label_config, 0)
    if len(pairs) < 4:
        raise ValueError(f"only {len(pairs)} training prompts had samples the gold tells apart")
    pairs_path = os.path.join(args.out, "pairs.jsonl")
    write_jsonl(pairs, pairs_path)
    study = argparse.Namespace(**{**vars(args), "eval_prompts": args.gold_prompts})
    result = train(proxy_config(study, os.path.join(args.out, "proxy-run"), pairs_path))
    proxy_dir = os.path.join(args.out, "proxy")
    save_pretrained(result.model, proxy_dir)
    tokenizer.save_pretrained(proxy_dir)
    rm_eval = result.eval_history[-1] if result.eval_history else {}
    return proxy_dir, {"pairs": len(pairs), **figures, **{f"proxy_{k}": float(v) for k, v in rm_eval.items()}}


def run_arm(args, action: str, train_path: str, gold_path: str, proxy_dir: str) -> dict:
    """One GRPO run against the proxy with the monitor's gold-divergence alarm set to ``action``."""
    out = os.path.join(args.out, action)
    status = "finished"
    if args.reuse and os.path.exists(os.path.join(out, "gold.json")):
        status = "read from an earlier invocation (--reuse)"
    else:
        config = run_config(args, out, proxy_rewards(proxy_dir), train_path,
                            monitor_section(args, gold_path, action))
        try:
            train(config)
        except RuntimeError as err:  # a stop past max_rollbacks: the run's own answer, recorded
            status = f"stopped: {err}"
    with open(os.path.join(out, "gold.json"), encoding="utf-8") as f:
        gold = json.load(f)
    events = [json.loads(line) for line in open(os.path.join(out, "alarms.jsonl"), encoding="utf-8")] \
        if os.path.exists(os.path.join(out, "alarms.jsonl")) else []
    return {"action": action, "status": status, "points": gold["points"], "rollbacks": gold["rollbacks"],
            "events": events, "final_gold": gold["points"][-1]["gold"], "png": os.path.join(out, "gold.png")}


def run(args) -> dict:
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name):
        nonlocal clock
        seconds[name] = round(time.perf_counter() - clock, 1)
        clock = time.perf_counter()

    os.makedirs(args.out, exist_ok=True)
    train_path, gold_path = split_prompts(args)
    if args.reuse and os.path.isdir(os.path.join(args.out, "proxy")):
        proxy_dir, proxy_figures = os.path.join(args.out, "proxy"), {"reused": True}
    else:
        proxy_dir, proxy_figures = make_proxy(args, train_path)
    lap("pairs_and_proxy")
    arms = {}
    for action in args.arms.split(","):
        arms[action] = run_arm(args, action, train_path, gold_path, proxy_dir)
        lap(f"rl_{action}")
    report = {"settings": vars(args), "gold": gold_rewards(args), "proxy": proxy_figures, "arms": arms,
              "seconds": seconds, "load_average": os.getloadavg()}
    Path(args.out, "guarded_overoptimisation.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    return report


def main(argv: Sequence[str] | None = None) -> None:
    print(json.dumps(run(parse_args(argv)), indent=1))


if __name__ == "__main__":
    main()
