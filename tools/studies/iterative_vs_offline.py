"""One round of iterative DPO against offline DPO on the same number of pairs: held-out greedy
accuracy before and after each, on SmolLM2-135M-Instruct with reasoning-gym chain_sum.

Both arms start from ``--model`` and train the same DPO run (``--steps`` steps of
``--batch-size`` pairs, ``--lr``, ``--beta``, the reference = the starting policy):

- **iterative** (one round of ``algorithm: iterative_dpo``, :mod:`alignax.trainers.iterative`):
  ``--samples`` completions of every training prompt from the starting policy, labelled by the
  reward (the chain_sum verifier; ``--reward-function module:fn`` replaces it); a prompt's
  best and worst completion, when their rewards differ, are a pair;
- **offline**: as many pairs, for the same prompts, from a fixed preference set
  (``--offline-pairs``, default: the reasoning-gym pair builder on ``--prompts``,
  :func:`alignax.data.builders.reasoning_gym_pairs`: chosen = the correct answer, rejected =
  a wrong one). Prompts the set lacks are replaced by other training prompts in order.

``--train-prompts`` prompts are trained on and the next ``--eval-prompts`` are held out
(``evaluation.prompts``); both arms and the starting policy are judged greedily on them by
the same sampler. Prints (and writes to ``<out>/iterative_vs_offline.json``) one JSON
object: settings, pair counts, accuracy and reward before and after each arm, wall seconds
per stage and the machine's load average at the start and the end.

    .venv/bin/python tools/studies/iterative_vs_offline.py --out runs/iter-vs-off [--steps 8 --train-prompts 32 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import time
from collections.abc import Sequence

from alignax.data import write_jsonl
from alignax.data.builders import generate, is_generator_spec
from alignax.trainers.api import build_trainer, load_config, train
from alignax.trainers.program import load_model

CHAIN_SUM = "reasoning_gym:chain_sum?size=400&seed=7&max_terms=3&max_digits=1"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/iterative-vs-offline")
    p.add_argument("--model", default="smollm2-135m-instruct", help="registry name or local HF folder")
    p.add_argument("--prompts", default=CHAIN_SUM, help="prompt records: a JSONL path or a generator spec")
    p.add_argument("--offline-pairs", default=None,
                   help="offline preference records (JSONL or generator spec); default: --prompts as pairs")
    p.add_argument("--reward-function", default=None, help="labeller module:function (default: the verifier)")
    p.add_argument("--success-threshold", type=float, default=None,
                   help="a completion is correct when its reward reaches this (default: the verifier's verdict)")
    p.add_argument("--train-prompts", type=int, default=32)
    p.add_argument("--eval-prompts", type=int, default=16)
    p.add_argument("--samples", type=int, default=4, help="completions per training prompt (iterative arm)")
    p.add_argument("--max-prompt-length", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=4, help="pairs per DPO step and prompts per sampling batch")
    p.add_argument("--steps", type=int, default=8, help="DPO steps of each arm")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def read_records(source: str, format: str) -> list[dict]:
    if is_generator_spec(source):
        return generate(source, format)
    with open(source, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_prompts(args) -> tuple[str, str, list[str]]:
    """``<out>/train_prompts.jsonl`` and ``<out>/eval_prompts.jsonl`` (the first
    ``--train-prompts`` records, then the next ``--eval-prompts``), and the training prompts."""
    records = read_records(args.prompts, "prompt")
    total = args.train_prompts + args.eval_prompts
    if len(records) < total:
        raise ValueError(f"--prompts {args.prompts} holds {len(records)} prompts; the comparison needs "
                         f"--train-prompts + --eval-prompts = {total}")
    train_path, eval_path = os.path.join(args.out, "train_prompts.jsonl"), os.path.join(args.out, "eval_prompts.jsonl")
    write_jsonl(records[:args.train_prompts], train_path)
    write_jsonl(records[args.train_prompts:total], eval_path)
    return train_path, eval_path, [r["prompt"] for r in records[:args.train_prompts]]


def iterative_config(args, train_path: str, eval_path: str):
    """One round of iterative DPO on the training prompts, judged on the held-out ones."""
    if args.reward_function:
        rewards = {"verifier_weight": 0.0, "format_weight": 0.0, "functions": {args.reward_function: 1.0}}
    else:
        rewards = {"verifier_weight": 1.0, "format_weight": 0.0, "answer_extraction": "tag_or_last_number"}
    return load_config(data={
        "algorithm": "iterative_dpo", "output_dir": os.path.join(args.out, "iterative"),
        "model": {"name": args.model},
        "data": {"paths": [train_path], "format": "prompt", "max_prompt_length": args.max_prompt_length,
                 "batch_size": args.batch_size, "eval_fraction": 0.0, "read_threads": 0},
        "rollout": {"max_new_tokens": args.max_new_tokens, "num_samples": args.samples, "temperature": 1.0},
        "rewards": rewards,
        "evaluation": {"max_prompts": args.eval_prompts, "success_threshold": args.success_threshold,
                       "prompts": {"paths": [eval_path], "format": "prompt",
                                   "max_prompt_length": args.max_prompt_length, "batch_size": args.batch_size,
                                   "read_threads": 0}},
        "iterative": {"rounds": 1, "reference": "previous"},
        "preference": {"loss": "dpo", "variant": "sigmoid", "beta": args.beta},
        "optim": {"learning_rate": args.lr, "schedule": "constant", "warmup_steps": 0},
        "train": {"total_steps": args.steps, "save_every": 0, "eval_every": 0, "seed": args.seed},
        "checkpoint": {"enabled": False, "overwrite": True},
        "logging": {"console": False, "tensorboard": False},
        "mesh": {"shape": [1, 1, 1]},
    })


def offline_pairs(args, train_prompts: list[str], iterative_pairs: list[dict]) -> tuple[list[dict], int]:
    """As many offline pairs as the iterative round has, for its prompts first (then other
    training prompts in order), and how many of them share the iterative round's prompts."""
    source = args.offline_pairs or args.prompts
    by_prompt: dict[str, dict] = {}
    for record in read_records(source, "preference"):
        by_prompt.setdefault(record["prompt"], {k: record[k] for k in ("prompt", "chosen", "rejected")})
    wanted = [p["prompt"] for p in iterative_pairs]
    shared = [by_prompt[p] for p in wanted if p in by_prompt]
    taken = {p["prompt"] for p in shared}
    others = [by_prompt[p] for p in train_prompts if p in by_prompt and p not in taken]
    pairs = (shared + others)[:len(iterative_pairs)]
    if len(pairs) < len(iterative_pairs):
        raise ValueError(f"--offline-pairs {source} has pairs for {len(pairs)} of the {len(train_prompts)} "
                         f"training prompts; the iterative round has {len(iterative_pairs)} pairs")
    return pairs, len(shared)


def run(args) -> dict:
    for arm in ("iterative", "offline"):  # a fresh comparison: no pairs or runs of an earlier one
        shutil.rmtree(os.path.join(args.out, arm), ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    began, load_start = time.perf_counter(), os.getloadavg()
    seconds: dict[str, float] = {}

    def stage(name, fn, *a):
        start = time.perf_counter()
        out = fn(*a)
        seconds[name] = round(time.perf_counter() - start, 1)
        return out

    train_path, eval_path, train_prompts = write_prompts(args)
    config = iterative_config(args, train_path, eval_path)
    trainer = build_trainer(config)  # algorithm: iterative_dpo -> the iterative trainer
    before = stage("eval_start", trainer.judge, load_model(config))

    round_cfg, sampling = stage("iterative_sample", trainer.prepare_round, 0)
    with open(round_cfg.data.paths[0], encoding="utf-8") as f:
        pairs = [json.loads(line) for line in f if line.strip()]
    iterative_model = stage("iterative_dpo", train, round_cfg).model
    after_iterative = stage("eval_iterative", trainer.judge, iterative_model)

    chosen, shared = offline_pairs(args, train_prompts, pairs)
    pairs_path = os.path.join(args.out, "offline", "pairs.jsonl")
    os.makedirs(os.path.dirname(pairs_path), exist_ok=True)
    write_jsonl(chosen, pairs_path)
    offline_cfg = dataclasses.replace(round_cfg, output_dir=os.path.join(args.out, "offline"),
                                      data=dataclasses.replace(round_cfg.data, paths=(pairs_path,)))
    offline_model = stage("offline_dpo", train, offline_cfg).model
    after_offline = stage("eval_offline", trainer.judge, offline_model)

    def figures(before_, after_):
        return {"accuracy_before": before_.get("accuracy"), "accuracy_after": after_.get("accuracy"),
                "reward_before": before_["reward"], "reward_after": after_["reward"]}

    seconds["total"] = round(time.perf_counter() - began, 1)
    report = {
        "settings": vars(args),
        "held_out_prompts": before["prompts"],
        "iterative": {"pairs": len(pairs), "sampled_prompts": sampling.get("prompts"),
                      "sample_reward": sampling.get("sample_reward"), **figures(before, after_iterative)},
        "offline": {"pairs": len(chosen), "pairs_on_iterative_prompts": shared, **figures(before, after_offline)},
        "start": before, "after_iterative": after_iterative, "after_offline": after_offline,
        "seconds": seconds, "loadavg": {"start": load_start, "end": os.getloadavg()},
    }
    with open(os.path.join(args.out, "iterative_vs_offline.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    return report


def main(argv: Sequence[str] | None = None) -> None:
    print(json.dumps(run(parse_args(argv)), indent=1))


if __name__ == "__main__":
    main()
