"""``make demo-agent``: SmolLM2-135M-Instruct learns to use a calculator, on this CPU.

1. Data from reasoning-gym ``chain_sum`` with two 4-digit terms (too large to add reliably
   in a 135M model's head): RL prompts, SFT tool traces for other questions
   (:func:`alignax.envs.traces.calculator_traces`: call the calculator, read the result,
   answer), and held-out questions that neither contains.
2. The base model judged on the held-out questions: greedy accuracy *with the tool* (the
   multi-turn calculator environment, ``configs/grpo-calculator.yaml``) and *without* it
   (one turn, the task's verifier on the answer tag or the last number).
3. SFT warm start on the traces (the ``sft`` format: assistant turns trained, the tool's
   result context); judged again with the tool.
4. GRPO with the calculator environment from the SFT policy; judged again with the tool.
5. A summary: accuracies, and each stage's wall and CPU seconds (printed, and
   ``<out>/summary.json``).

Sized for 2 CPU cores in about 20 minutes: scanned layers (one layer's compile, not 30),
the compact tool prompt (133-token prompts), 200-token SFT rows, GRPO groups of 4 without
a reference model (``kl_coef: 0``), no checkpoints (the policies are saved once, as Hugging
Face folders). ``--quick`` runs the same shapes with 2 SFT and 2 GRPO steps on 8 held-out
questions: the compiles and a few steps, from which the full run's time is extrapolated.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/examples/ -> the repository
TASK = dict(min_terms=2, max_terms=2, min_digits=4, max_digits=4)
PROMPT_LENGTH = 136  # SmolLM2 renders a question with the calculator's compact tool prompt in 133 tokens
FULL = dict(held_out=64, sft_steps=24, grpo_steps=12)
QUICK = dict(held_out=8, sft_steps=2, grpo_steps=2)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo-agent")
    p.add_argument("--quick", action="store_true", help="the same shapes, 2 SFT and 2 GRPO steps, 8 held-out questions")
    return p.parse_args(argv)


def write_data(out: str, held_out: int) -> dict[str, str]:
    from alignax.data import reasoning_gym_prompts, write_jsonl
    from alignax.envs.traces import calculator_traces

    # reasoning-gym draws entry i of a dataset from seed + i: seeds 1 and 2 share all but one
    # question, so the three sets start 100,000 apart (and any repeat is dropped)
    judged = reasoning_gym_prompts("chain_sum", size=held_out, seed=100_000, **TASK)
    seen = {r["prompt"] for r in judged}
    rl = [r for r in reasoning_gym_prompts("chain_sum", size=200, seed=200_000, **TASK) if r["prompt"] not in seen]
    seen |= {r["prompt"] for r in rl}
    traces = calculator_traces(r for r in reasoning_gym_prompts("chain_sum", size=200, seed=300_000, **TASK)
                               if r["prompt"] not in seen)
    files = {"held_out": judged, "rl_prompts": rl, "sft_traces": traces}
    paths = {name: os.path.join(out, "data", f"{name}.jsonl") for name in files}
    os.makedirs(os.path.join(out, "data"), exist_ok=True)
    for name, records in files.items():
        write_jsonl(records, paths[name])
    print(f"data: {len(traces)} SFT tool traces, {len(rl)} RL prompts, {len(judged)} held-out questions "
          f"(chain_sum, two 4-digit terms)")
    return paths


class Clock:
    """Wall and CPU (user + system, all threads) seconds of each stage."""

    def __init__(self):
        self.stages: dict[str, dict[str, float]] = {}

    @staticmethod
    def now() -> tuple[float, float]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return time.time(), usage.ru_utime + usage.ru_stime

    def stage(self, name: str, since: tuple[float, float]) -> dict[str, float]:
        wall, cpu = self.now()
        self.stages[name] = {"wall_s": round(wall - since[0], 1), "cpu_s": round(cpu - since[1], 1)}
        return self.stages[name]


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.chdir(ROOT)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from alignax import evaluation
    from alignax.data import DataConfig
    from alignax.models import save_pretrained
    from alignax.trainers import api
    from alignax.trainers.program import load_model, load_tokenizer, run_mesh

    clock = Clock()
    started = clock.now()
    out = args.out
    size = QUICK if args.quick else FULL
    paths = write_data(out, size["held_out"])
    common = ["model.scan_layers=true", "model.remat=true", "checkpoint.enabled=false", "data.eval_fraction=0.0",
              "train.eval_every=0", "train.save_every=0"]
    sft_config = api.load_config("configs/sft.yaml", [
        *common, f"output_dir={out}/sft", f"data.paths=[{paths['sft_traces']}]", "data.max_length=200",
        f"data.max_prompt_length={PROMPT_LENGTH}", "data.max_response_length=64", "data.batch_size=8",
        "data.truncation=reject", f"train.total_steps={size['sft_steps']}", "optim.learning_rate=1.0e-4",
        "optim.warmup_steps=2", "optim.schedule=constant"])
    grpo_config = api.load_config("configs/grpo-calculator.yaml", [
        *common, f"output_dir={out}/grpo", f"model.name={out}/sft/policy", f"data.paths=[{paths['rl_prompts']}]",
        f"data.max_prompt_length={PROMPT_LENGTH}", "data.batch_size=2", "rollout.num_samples=4",
        "rollout.max_new_tokens=96", "env.max_turns=3", "env.max_turn_tokens=40", "env.max_observation_tokens=24",
        "grpo.minibatches=1", "grpo.kl_coef=0.0", f"train.total_steps={size['grpo_steps']}",
        "optim.learning_rate=2.0e-6", "optim.warmup_steps=0"])
    # without the tool: one turn, the verifier on the answer tag or the last number
    plain_config = api.load_config("configs/grpo.yaml", ["model.scan_layers=true",
                                                         f"data.max_prompt_length={PROMPT_LENGTH}",
                                                         "rollout.max_new_tokens=48"])
    held_out = DataConfig(paths=(paths["held_out"],), format="prompt", max_prompt_length=PROMPT_LENGTH,
                          batch_size=8, shuffle=False, read_threads=0, truncation="reject")
    mesh = run_mesh(grpo_config)
    every = evaluation.EvaluationConfig(max_prompts=None)

    def judge(name, model, tokenizer, *, without_tool: bool = False) -> dict:
        since = clock.now()
        figures = {"with_tool": evaluation.evaluate_model(model, tokenizer, grpo_config, prompts=held_out, mesh=mesh,
                                                          evaluation=every)}
        line = f"[{name}] held-out accuracy with the calculator {figures['with_tool']['accuracy']:.2f}"
        if without_tool:
            figures["without_tool"] = evaluation.evaluate_model(model, tokenizer, plain_config, prompts=held_out,
                                                                mesh=mesh, evaluation=every)
            line += f", without it {figures['without_tool']['accuracy']:.2f}"
        took = clock.stage(f"judge_{name}", since)
        print(f"{line} ({took['wall_s']:.0f} s wall, {took['cpu_s']:.0f} s CPU)")
        return figures

    summary: dict = {"task": {"name": "chain_sum", **TASK}, "sizes": size}
    print("\n== base model")
    base = load_model(sft_config, mesh=mesh)
    tokenizer = load_tokenizer(sft_config)
    summary["base"] = judge("base", base, tokenizer, without_tool=True)
    del base

    print(f"\n== SFT on tool traces: {size['sft_steps']} steps of {sft_config.data.batch_size}")
    since = clock.now()
    sft = api.train(sft_config)
    save_pretrained(sft.model, f"{out}/sft/policy")
    sft.tokenizer.save_pretrained(f"{out}/sft/policy")
    summary["sft"] = {**clock.stage("sft", since), "loss": [h.get("loss") for h in sft.history],
                      "step_time_s": [h.get("perf/step_time_s") for h in sft.history]}
    summary["sft"].update(judge("sft", sft.model, sft.tokenizer))
    del sft

    print(f"\n== GRPO with the calculator: {size['grpo_steps']} rollouts of "
          f"{grpo_config.data.batch_size} x {grpo_config.rollout.num_samples} trajectories")
    since = clock.now()
    grpo = api.train(grpo_config)
    summary["grpo"] = {**clock.stage("grpo", since),
                       "reward_per_rollout": [h.get("reward/total") for h in grpo.history],
                       "tool_calls_per_trajectory": [h.get("env/tool_calls_per_trajectory") for h in grpo.history],
                       "step_time_s": [h.get("perf/step_time_s") for h in grpo.history]}
    summary["grpo"].update(judge("grpo", grpo.model, grpo.tokenizer))

    summary["stages"] = clock.stages
    summary.update(clock.stage("total", started))
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=float)
    print("\n== held-out accuracy (greedy, "
          f"{size['held_out']} questions)")
    print(f"  without the calculator: base {summary['base']['without_tool']['accuracy']:.2f}")
    for stage in ("base", "sft", "grpo"):
        print(f"  with the calculator:    {stage:5s} {summary[stage]['with_tool']['accuracy']:.2f}")
    print("stage seconds (wall / CPU): " + ", ".join(f"{k} {v['wall_s']:.0f}/{v['cpu_s']:.0f}"
                                                      for k, v in clock.stages.items()))
    print(f"summary in {out}/summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
