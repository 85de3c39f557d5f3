"""``make demo-agent``: SmolLM2-135M-Instruct learns to use a calculator, on this CPU.

1. Data from reasoning-gym ``chain_sum`` with two 4-digit terms (too large to add reliably
   in a 135M model's head): RL prompts, SFT tool traces for other questions
   (:func:`alignax.envs.traces.calculator_traces`: call the calculator, read the result,
   answer), and held-out questions that neither contains.
2. The base model judged on the held-out questions: greedy accuracy *with the tool* (the
   multi-turn calculator environment, ``configs/grpo-calculator.yaml``) and *without* it
   (one turn, the task's verifier on the answer tag or the last number).
3. SFT warm start on the traces (the ``sft`` format: assistant turns trained, tool results
   context); judged again.
4. GRPO with the calculator environment from the SFT policy; judged again.
5. A summary (printed, and ``<out>/summary.json``).

``--quick`` runs a few steps on 8 held-out questions (a check of the plumbing, minutes).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = dict(min_terms=2, max_terms=2, min_digits=4, max_digits=4)
PROMPT_LENGTH = 352  # SmolLM2's rendering of a question with the calculator's schema: ~300 tokens


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo-agent")
    p.add_argument("--quick", action="store_true", help="a few steps on 8 held-out questions")
    return p.parse_args(argv)


def write_data(out: str, held_out: int) -> dict[str, str]:
    from alignax.data import reasoning_gym_prompts, write_jsonl
    from alignax.envs.traces import calculator_traces

    judged = reasoning_gym_prompts("chain_sum", size=held_out, seed=99, **TASK)
    seen = {r["prompt"] for r in judged}
    rl = [r for r in reasoning_gym_prompts("chain_sum", size=400, seed=1, **TASK) if r["prompt"] not in seen]
    seen |= {r["prompt"] for r in rl}
    traces = calculator_traces(r for r in reasoning_gym_prompts("chain_sum", size=600, seed=2, **TASK)
                               if r["prompt"] not in seen)
    files = {"held_out": judged, "rl_prompts": rl, "sft_traces": traces}
    paths = {name: os.path.join(out, "data", f"{name}.jsonl") for name in files}
    os.makedirs(os.path.join(out, "data"), exist_ok=True)
    for name, records in files.items():
        write_jsonl(records, paths[name])
    print(f"data: {len(traces)} SFT tool traces, {len(rl)} RL prompts, {len(judged)} held-out questions "
          f"(chain_sum, two 4-digit terms)")
    return paths


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.chdir(ROOT)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from alignax import evaluation
    from alignax.data import DataConfig
    from alignax.trainers import api
    from alignax.trainers.engine.setup import build_mesh, build_model, load_tokenizer

    started = time.time()
    out = args.out
    quick = args.quick
    paths = write_data(out, 8 if quick else 64)
    sft_steps, grpo_steps = (2, 2) if quick else (60, 30)
    sft_config = api.load_config("configs/sft.yaml", [
        f"output_dir={out}/sft", f"data.paths=[{paths['sft_traces']}]", "data.max_length=448",
        f"data.max_prompt_length={PROMPT_LENGTH}", "data.max_response_length=96", "data.batch_size=8",
        "train.grad_accum_steps=4", "model.remat=true",  # micro-batches of 2 x 448 tokens: ~11 GB without
        "data.eval_fraction=0.0", f"train.total_steps={sft_steps}", "train.eval_every=0", "train.save_every=0",
        "optim.learning_rate=3.0e-5", "optim.warmup_steps=5", "checkpoint.resume=false"])
    grpo_config = api.load_config("configs/grpo-calculator.yaml", [
        f"output_dir={out}/grpo", f"model.name={out}/sft/export", f"data.paths=[{paths['rl_prompts']}]",
        "data.eval_fraction=0.0", "data.batch_size=4", "rollout.num_samples=4", "grpo.minibatches=1",
        "train.grad_accum_steps=4", "model.remat=true",  # the quick run's update asked for 26 GB without
        f"train.total_steps={grpo_steps}", "train.eval_every=0", "train.save_every=0", "optim.learning_rate=2.0e-6",
        "checkpoint.resume=false"])
    # without the tool: one turn, the verifier on the answer tag or the last number
    plain_config = api.load_config("configs/grpo.yaml", [f"data.max_prompt_length={PROMPT_LENGTH}",
                                                         "rollout.max_new_tokens=48"])
    held_out = DataConfig(paths=(paths["held_out"],), format="prompt", max_prompt_length=PROMPT_LENGTH,
                          batch_size=8, shuffle=False, read_threads=0)
    mesh = build_mesh(grpo_config.mesh)

    def judge(name, model, tokenizer) -> dict:
        start = time.time()
        figures = {}
        for key, config in (("with_tool", grpo_config), ("without_tool", plain_config)):
            figures[key] = evaluation.evaluate_model(model, tokenizer, config, prompts=held_out, mesh=mesh,
                                                     evaluation=evaluation.EvaluationConfig(max_prompts=None))
        print(f"[{name}] held-out accuracy with the calculator {figures['with_tool']['accuracy']:.2f}, "
              f"without it {figures['without_tool']['accuracy']:.2f} ({time.time() - start:.0f}s)")
        return figures

    summary: dict = {"task": {"name": "chain_sum", **TASK}}
    print("\n== base model")
    base = build_model(sft_config.model, mesh=mesh)
    tokenizer = load_tokenizer(sft_config.model)
    summary["base"] = judge("base", base, tokenizer)
    del base

    print(f"\n== SFT on tool traces: {sft_steps} steps of {sft_config.data.batch_size}")
    t = time.time()
    sft = api.train(sft_config)
    api.export(sft_config, f"{out}/sft/export")
    summary["sft"] = {"seconds": round(time.time() - t, 1), **judge("sft", sft.model, sft.tokenizer)}

    print(f"\n== GRPO with the calculator: {grpo_steps} rollouts of "
          f"{grpo_config.data.batch_size} x {grpo_config.rollout.num_samples} trajectories")
    t = time.time()
    grpo = api.train(grpo_config)
    summary["grpo"] = {"seconds": round(time.time() - t, 1), **judge("grpo", grpo.model, grpo.tokenizer),
                       "reward_per_rollout": [h.get("reward/total") for h in grpo.history],
                       "tool_calls_per_trajectory": [h.get("env/tool_calls_per_trajectory") for h in grpo.history]}

    summary["seconds"] = round(time.time() - started, 1)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=float)
    print("\n== held-out accuracy (greedy)")
    for stage in ("base", "sft", "grpo"):
        print(f"  {stage:5s} with the calculator {summary[stage]['with_tool']['accuracy']:.2f}   "
              f"without it {summary[stage]['without_tool']['accuracy']:.2f}")
    print(f"total {summary['seconds'] / 60:.1f} min; summary in {out}/summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
