"""SmolLM2-135M-Instruct distilled on-policy from its own GRPO-trained export: how much of the
teacher's gain over the base model the student recovers on the demo's held-out sets (issue 31).

Stages, all through ``alignax.trainers.api`` on this machine:

1. the demo's data and judging sets (``tools/examples/demo.py``'s ``write_data``: chain_sum
   RL prompts, the 25 one-digit questions training never sees, 128 two-digit sums);
2. the teacher: ``--teacher FOLDER`` (e.g. ``runs/demo/grpo/export`` after ``make demo``), or
   a GRPO run of ``--teacher-steps`` steps from the base model (configs/demo-grpo.yaml with
   ``model.name`` the base: no DPO stage), exported;
3. the student: the base model distilled on-policy from the teacher
   (configs/onpolicy-distill.yaml: ``algorithm: onpolicy_distill``, ``--estimator``), for
   ``--distill-steps`` rollouts of the same prompts;
4. base, teacher and student judged greedily (``alignax.evaluation``, the demo's rewards and
   response budget) on the one-digit set and the first ``--two-digit`` two-digit sums.

Writes one JSON object (``--json``, default ``<out>/distill_smollm2.json``): settings, each
model's accuracy on each set (with the half-width of its 95% interval), the share of the
teacher's gain the student recovers (``(student - base) / (teacher - base)``, null where the
teacher gained nothing), seconds per stage and the load average at the start and the end.

    nice -n 19 .venv/bin/python tools/studies/distill_smollm2.py --out runs/distill-study \\
        --teacher runs/demo/grpo/export --distill-steps 16 --json docs/results/distill_smollm2.json

(the measured run, after ``make demo``; figures in docs/algorithms/distillation.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/studies/ -> the repository
sys.path.insert(0, os.path.join(ROOT, "tools", "examples"))  # the demo's data and judging sets

import demo  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/distill-study")
    p.add_argument("--teacher", default=None, help="a GRPO-trained export to distil from (default: train one)")
    p.add_argument("--teacher-steps", type=int, default=16, help="GRPO steps of the teacher trained here")
    p.add_argument("--distill-steps", type=int, default=16)
    p.add_argument("--estimator", choices=("exact", "sampled"), default="exact")
    p.add_argument("--lr", type=float, default=5e-6, help="the student's learning rate")
    p.add_argument("--seed", type=int, default=0, help="the student run's train.seed and data.seed (sampling, prompt order)")
    p.add_argument("--two-digit", type=int, default=128, help="how many of the 128 two-digit sums to judge")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def judge(model, tokenizer, config, sets: dict, mesh) -> dict:
    """Greedy verifier accuracy (and ``alignax.evaluation``'s other figures) on each set."""
    from alignax import evaluation

    return {name: evaluation.evaluate_model(model, tokenizer, config, prompts=prompts, mesh=mesh,
                                            evaluation=settings)
            for name, (prompts, settings) in sets.items()}


def judging_sets(paths: dict, two_digit: int) -> dict:
    from alignax.data import DataConfig
    from alignax.evaluation import EvaluationConfig

    def prompts(name):
        return DataConfig(paths=(paths[name],), format="prompt", max_prompt_length=demo.JUDGE_PROMPT_LENGTH,
                          truncation="reject", batch_size=demo.JUDGE_BATCH, shuffle=False, read_threads=0)

    return {"one_digit": (prompts("one_digit"), EvaluationConfig(max_prompts=None)),
            "two_digit": (prompts("two_digit"), EvaluationConfig(max_prompts=two_digit))}


def train_teacher(args, paths) -> tuple[str, dict]:
    from alignax.trainers import api

    config = api.load_config(os.path.join(ROOT, "configs/demo-grpo.yaml"), [
        f"output_dir={args.out}/teacher", "model.name=smollm2-135m-instruct", f"data.paths=[{paths['grpo_prompts']}]",
        "checkpoint.resume=false", "checkpoint.overwrite=true", f"train.total_steps={args.teacher_steps}"])
    start = time.time()
    result = api.train(config)
    seconds = time.time() - start
    rewards = [h["reward/total"] for h in result.history]
    del result
    gc.collect()
    folder = api.export(config, f"{args.out}/teacher/export")
    return folder, {"grpo_steps": args.teacher_steps, "seconds": round(seconds, 1), "reward_first": rewards[0],
                    "reward_last": rewards[-1], "config": "configs/demo-grpo.yaml from the base model"}


def interval_95(figures: dict) -> float:
    """Half-width of the 95% interval of a greedy accuracy, 1.96 standard errors (the demo's
    ``fraction``, so the figures read as the README's demo table does)."""
    n, p = int(figures["prompts"]), figures["accuracy"]
    return 1.96 * math.sqrt(p * (1 - p) / n)


def recovered(figures: dict, set_name: str) -> float | None:
    base, teacher, student = (figures[m][set_name]["accuracy"] for m in ("base", "teacher", "student"))
    return None if teacher <= base else (student - base) / (teacher - base)


def main(argv=None) -> int:
    os.chdir(ROOT)
    args = parse_args(argv)
    from alignax.trainers import api
    from alignax.trainers.program import load_model, load_tokenizer, run_mesh

    started, load_start = time.time(), os.getloadavg()
    paths = demo.write_data(args.out)
    teacher_run = {"folder": args.teacher}
    if args.teacher is None:
        args.teacher, teacher_run = train_teacher(args, paths)
        teacher_run["folder"] = args.teacher
    config = api.load_config(os.path.join(ROOT, "configs/onpolicy-distill.yaml"), [
        f"output_dir={args.out}/student", f"data.paths=[{paths['grpo_prompts']}]", f"distill.teacher.name={args.teacher}",
        f"onpolicy_distill.estimator={args.estimator}", f"optim.learning_rate={args.lr}",
        f"train.total_steps={args.distill_steps}", f"train.seed={args.seed}", f"data.seed={args.seed}",
        "checkpoint.resume=false", "checkpoint.overwrite=true"])
    mesh, sets = run_mesh(config), judging_sets(paths, args.two_digit)
    tokenizer = load_tokenizer(config)
    figures, seconds = {}, {}
    for name, folder in (("base", config.model.name), ("teacher", args.teacher)):
        t = time.time()
        model = load_model(dataclasses.replace(config, model=dataclasses.replace(config.model, name=folder)), mesh=mesh)
        figures[name] = judge(model, tokenizer, config, sets, mesh)
        seconds[f"judge_{name}"] = round(time.time() - t, 1)
        del model
        gc.collect()
    t = time.time()
    student = api.train(config)
    seconds["distill"] = round(time.time() - t, 1)
    t = time.time()
    figures["student"] = judge(student.model, student.tokenizer, config, sets, mesh)
    seconds["judge_student"] = round(time.time() - t, 1)
    history = student.history
    out = {
        "settings": {"teacher": teacher_run, "distill_steps": args.distill_steps, "estimator": args.estimator,
                     "seed": args.seed, "learning_rate": args.lr, "prompts_per_rollout": config.data.batch_size,
                     "samples_per_prompt": config.rollout.num_samples, "max_new_tokens": config.rollout.max_new_tokens,
                     "recipe": "configs/onpolicy-distill.yaml", "command": " ".join(["tools/studies/distill_smollm2.py",
                                                                                     *(argv or sys.argv[1:])])},
        "accuracy": {m: {s: {"correct": round(f[s]["accuracy"] * f[s]["prompts"]), "prompts": int(f[s]["prompts"]),
                             "accuracy": f[s]["accuracy"], "interval_95": interval_95(f[s])} for s in sets}
                     for m, f in figures.items()},
        "recovered_share_of_teacher_gain": {s: recovered(figures, s) for s in sets},
        # the sampled KL to the teacher (both estimators); the exact one's full-vocabulary figures
        "student_run": {f"{key}_{end}": row.get(key) for key in ("kl/ref_k1", "divergence", "teacher_agreement")
                        for end, row in (("first", history[0]), ("last", history[-1]))},
        "seconds": {**seconds, "teacher": teacher_run.get("seconds"), "total": round(time.time() - started, 1)},
        "load_average": {"start": load_start[0], "end": os.getloadavg()[0]},
    }
    path = args.json or os.path.join(args.out, "distill_smollm2.json")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
