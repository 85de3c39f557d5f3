"""The main job (``make demo``): DPO, then GRPO, on SmolLM2-135M-Instruct, on this CPU.

1. Data from reasoning-gym's ``chain_sum`` (two one-digit terms): preference pairs and RL
   prompts (the same seeds and sizes as ever, so training is unchanged), and two judging
   sets that training never sees: every one-digit question absent from the training data
   (there are only 200 one-digit questions and training covers 175 of them, so this set
   has 25), and 128 two-digit sums (``min_digits = max_digits = 2``), a harder task.
2. The base model judged (``alignax.evaluation``): greedy verifier accuracy on both sets,
   and its log-prob preference accuracy on DPO's held-out pairs (the share of pairs with
   ``log pi(chosen) > log pi(rejected)``).
3. DPO (configs/demo-dpo.yaml) through ``alignax.trainers.api``; judged again; its DPO
   held-out preference accuracy (implicit reward; 0 at step 0, when policy = reference);
   the policy exported as Hugging Face safetensors.
4. GRPO from the DPO policy (configs/demo-grpo.yaml); judged again; exported; a PNG of
   the reward per step (raw and moving average) and the KL to the reference.
5. A summary (printed, and <out>/summary.json); each judgement's JSON report under
   <out>/evaluation/.

``--long`` trains 4x more steps (about an hour on 2 CPU cores). Any ``dotted.key=value``
after ``--dpo`` / ``--grpo`` overrides that stage's config (judging follows the GRPO
config's ``rewards`` and ``rollout.max_new_tokens``). ``--pass-k 1 4`` adds sampled pass@k.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tools/examples/ -> the repository
TASK = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)  # what the demo trains on
HARD_TASK = dict(min_terms=2, max_terms=2, min_digits=2, max_digits=2)  # never trained on
HELD_OUT = 16  # questions kept out of the training data (unchanged: the training data depend on it)
HARD_QUESTIONS = 128
# Judging batches: one shape for both sets (one compiled sampler); every chain_sum prompt
# of either set is 46-48 tokens with SmolLM2's template (a longer one is an error).
JUDGE_BATCH, JUDGE_PROMPT_LENGTH = 64, 48
SETS = {"one_digit": "one-digit held-out", "two_digit": "two-digit (harder)"}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo", help="where data, runs, plot and summary go")
    p.add_argument("--long", action="store_true", help="4x the training steps")
    p.add_argument("--dpo", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of configs/demo-dpo.yaml")
    p.add_argument("--grpo", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of configs/demo-grpo.yaml")
    p.add_argument("--pass-k", nargs="*", type=int, default=[], metavar="K",
                   help="also judge sampled pass@k (max(K) samples per question: that many times the judging time)")
    return p.parse_args(argv)


def write_data(out: str) -> dict[str, str]:
    from alignax.data import reasoning_gym_pairs, reasoning_gym_prompts, write_jsonl

    # Training data: exactly as before this demo judged on more questions.
    held_out = reasoning_gym_prompts("chain_sum", size=64, seed=99, **TASK)[:HELD_OUT]
    questions = {r["prompt"] for r in held_out}
    pairs = [r for r in reasoning_gym_pairs("chain_sum", size=600, seed=0, **TASK) if r["prompt"] not in questions]
    prompts = [r for r in reasoning_gym_prompts("chain_sum", size=600, seed=1, **TASK) if r["prompt"] not in questions]
    trained = {r["prompt"] for r in pairs} | {r["prompt"] for r in prompts}
    # Judging sets: every one-digit question training never shows (2,000 draws cover all
    # 200), the original held-out ones first; and two-digit sums.
    everything = reasoning_gym_prompts("chain_sum", size=2000, seed=99, **TASK)
    seen = trained | questions
    unseen = held_out + [r for r in everything if r["prompt"] not in seen]
    hard = reasoning_gym_prompts("chain_sum", size=HARD_QUESTIONS + 32, seed=7, **HARD_TASK)[:HARD_QUESTIONS]
    assert not trained & {r["prompt"] for r in unseen + hard}, "a judging question is in the training data"
    assert len(hard) == HARD_QUESTIONS, len(hard)
    files = {"dpo_pairs": pairs, "grpo_prompts": prompts, "one_digit": unseen, "two_digit": hard}
    paths = {name: os.path.join(out, "data", f"{name}.jsonl") for name in files}
    os.makedirs(os.path.dirname(paths["dpo_pairs"]), exist_ok=True)
    for name, records in files.items():
        write_jsonl(records, paths[name])
    print(f"data: {len(pairs)} DPO pairs and {len(prompts)} RL prompts over {len(trained)} one-digit questions; "
          f"judging on the {len(unseen)} one-digit questions they never contain and {len(hard)} two-digit ones")
    return paths


class Judge:
    """The demo's judgement of a policy: greedy verifier accuracy (and the rest of
    ``alignax.evaluation``'s figures) on both judging sets, under the GRPO run's rewards
    and response budget; and log-prob preference accuracy on DPO's held-out pairs."""

    def __init__(self, paths: dict[str, str], grpo_config, dpo_config, out: str, pass_k=()):
        from alignax.data import DataConfig
        from alignax.evaluation import EvaluationConfig
        from alignax.trainers.program import run_mesh

        self.config = grpo_config
        self.settings = EvaluationConfig(max_prompts=None, pass_k=tuple(pass_k))
        self.dpo_data = dpo_config.data
        self.mesh = run_mesh(grpo_config)
        self.out = out
        self.sets = {
            name: DataConfig(paths=(paths[name],), format="prompt", max_prompt_length=JUDGE_PROMPT_LENGTH,
                             truncation="reject", batch_size=JUDGE_BATCH, shuffle=False, read_threads=0)
            for name in SETS
        }
        self._pair_logps = None

    def __call__(self, name: str, model, tokenizer) -> dict:
        from alignax import evaluation

        start = time.time()
        verdict = {}
        for set_name, prompts in self.sets.items():
            figures = evaluation.evaluate_model(model, tokenizer, self.config, prompts=prompts, mesh=self.mesh,
                                                evaluation=self.settings)
            evaluation.write_report(os.path.join(self.out, "evaluation", f"{name}-{set_name}.json"), figures,
                                    model=name, prompts=prompts.paths[0], evaluation=self.settings,
                                    rewards=self.config.rewards, max_new_tokens=self.config.rollout.max_new_tokens)
            verdict[set_name] = figures
        verdict["logprob_preference_accuracy"] = self.logprob_preference_accuracy(model, tokenizer)
        verdict["seconds"] = round(time.time() - start, 1)
        line = ", ".join(f"{SETS[s]} {fraction(verdict[s])}" + "".join(
            f", pass@{k} {verdict[s][f'pass@{k}']:.2f}" for k in self.settings.pass_k) for s in SETS)
        print(f"[{name}] greedy verifier accuracy: {line}; log-prob preference accuracy "
              f"{verdict['logprob_preference_accuracy']['accuracy']:.2f} ({verdict['seconds']:.0f}s)")
        return verdict

    def logprob_preference_accuracy(self, model, tokenizer) -> dict[str, float]:
        """Share of DPO's held-out pairs (its own eval split) where the policy gives the
        chosen response a higher summed log-prob than the rejected one."""
        import jax
        import numpy as np
        from flax import nnx

        from alignax.data import prepare_dataset
        from alignax.trainers.program import response_logps, sequence_logps

        graphdef, state = nnx.split(model)
        if self._pair_logps is None:
            chunk = self.config.model.logprob_chunk_size

            def pair_logps(graphdef, state, batch):
                policy = nnx.merge(graphdef, state)
                return [sequence_logps(*response_logps(policy, batch[f"{s}_tokens"], batch[f"{s}_positions"],
                                                       batch[f"{s}_attention_mask"], batch[f"{s}_response_mask"],
                                                       chunk_size=chunk))[0]
                        for s in ("chosen", "rejected")]

            self._pair_logps = jax.jit(pair_logps, static_argnums=0)
        wins = pairs = 0
        for batch in prepare_dataset(self.dpo_data, tokenizer).iterator("eval"):
            arrays = {k: v for k, v in batch.items() if k.startswith(("chosen_", "rejected_"))}
            chosen, rejected = (np.asarray(x) for x in jax.device_get(self._pair_logps(graphdef, state, arrays)))
            keep = batch["example_mask"] > 0
            wins += int(np.sum((chosen > rejected)[keep]))
            pairs += int(keep.sum())
        return {"accuracy": wins / pairs, "pairs": pairs}


def fraction(figures: dict) -> str:
    """``k/n (p% ± 1.96 standard errors)`` of a greedy accuracy."""
    n, p = int(figures["prompts"]), figures["accuracy"]
    return f"{round(p * n)}/{n} ({100 * p:.1f}% ± {196 * math.sqrt(p * (1 - p) / n):.1f})"


def moving_average(values, window: int):
    """Trailing mean over the last ``window`` values (fewer at the start)."""
    return [sum(values[max(0, i + 1 - window): i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]


def plot(history, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    window = max(2, len(history) // 4)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    series = [("reward/total", "total", "tab:blue")]
    if "reward/answer" in history[0]:
        if all(h["reward/answer"] == h["reward/total"] for h in history):  # no other component scored
            series = [("reward/total", "total = answer (verifier)", "tab:blue")]
        else:
            series.append(("reward/answer", "answer (verifier)", "tab:green"))
    for key, label, color in series:
        values = [h[key] for h in history]
        ax1.plot(steps, values, "o", color=color, alpha=0.35, markersize=4, label=f"{label}, per step")
        ax1.plot(steps, moving_average(values, window), "-", color=color, linewidth=2,
                 label=f"{label}, mean of last {window}")
    ax1.set_xlabel("GRPO step"), ax1.set_ylabel("mean rollout reward"), ax1.legend(fontsize=7), ax1.grid(alpha=0.3)
    if "kl/ref_k3" in history[0]:  # absent when the run has no reference model (grpo.kl_coef=0)
        ax2.plot(steps, [h["kl/ref_k3"] for h in history], marker="o", color="tab:red")
    ax2.set_xlabel("GRPO step"), ax2.set_ylabel("KL to reference (k3, per token)"), ax2.grid(alpha=0.3)
    fig.suptitle("GRPO on SmolLM2-135M-Instruct, reasoning-gym chain_sum")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    os.chdir(ROOT)
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from alignax.trainers import api
    from alignax.trainers.program import load_model, load_tokenizer, run_mesh

    started = time.time()
    out = args.out
    paths = write_data(out)
    scale = 4 if args.long else 1
    dpo_config = api.load_config("configs/demo-dpo.yaml", [
        f"output_dir={out}/dpo", f"data.paths=[{paths['dpo_pairs']}]", "checkpoint.resume=false",
        *([f"train.total_steps={16 * scale}"] if args.long else []), *args.dpo])
    grpo_config = api.load_config("configs/demo-grpo.yaml", [
        f"output_dir={out}/grpo", f"model.name={out}/dpo/export", f"data.paths=[{paths['grpo_prompts']}]",
        "checkpoint.resume=false", *([f"train.total_steps={16 * scale}"] if args.long else []), *args.grpo])
    judge = Judge(paths, grpo_config, dpo_config, out, pass_k=args.pass_k)
    summary: dict = {"task": {"name": "chain_sum", **TASK}, "harder_task": {"name": "chain_sum", **HARD_TASK},
                     "judging": {"greedy": True, "max_new_tokens": grpo_config.rollout.max_new_tokens,
                                 "rewards": "configs/demo-grpo.yaml rewards (verifier: answer tag or last number)"}}

    print("\n== base model")
    base = load_model(dpo_config, mesh=run_mesh(dpo_config))  # the trainers' mesh: one compile
    tokenizer = load_tokenizer(dpo_config)
    summary["base"] = judge("base", base, tokenizer)
    del base
    gc.collect()

    print(f"\n== DPO: {dpo_config.train.total_steps} steps of {dpo_config.data.batch_size} pairs")
    t = time.time()
    dpo = api.train(dpo_config)
    dpo_time = time.time() - t
    before, after = dpo.eval_history[0], dpo.eval_history[-1]
    dpo_export = api.export(dpo_config, f"{out}/dpo/export")
    summary["dpo"] = {
        "seconds": round(dpo_time, 1),
        "held_out_pairs": dpo.data_stats["eval"],
        "implicit_reward_accuracy_before": before["eval/rewards/accuracies"],  # 0: policy = reference
        "implicit_reward_accuracy_after": after["eval/rewards/accuracies"],
        "held_out_loss_before": before["eval/loss"],
        "held_out_loss_after": after["eval/loss"],
        **judge("dpo", dpo.model, dpo.tokenizer),
        "export": dpo_export,
    }
    print(f"DPO held-out implicit-reward accuracy {before['eval/rewards/accuracies']:.2f} -> "
          f"{after['eval/rewards/accuracies']:.2f} ({dpo.data_stats['eval']} pairs); exported to {dpo_export}")
    del dpo  # the DPO policy, its reference and optimiser state: memory the GRPO stage needs
    gc.collect()

    print(f"\n== GRPO: {grpo_config.train.total_steps} steps of {grpo_config.data.batch_size} prompts x "
          f"{grpo_config.rollout.num_samples} samples, from the DPO policy")
    t = time.time()
    grpo = api.train(grpo_config)
    grpo_time = time.time() - t
    history = grpo.history
    png = os.path.join(out, "grpo_reward_kl.png")
    plot(history, png)
    first = history[: max(1, len(history) // 4)]
    last = history[-max(1, len(history) // 4):]
    summary["grpo"] = {
        "seconds": round(grpo_time, 1),
        "reward_first_quarter": sum(h["reward/total"] for h in first) / len(first),
        "reward_last_quarter": sum(h["reward/total"] for h in last) / len(last),
        "kl_last": history[-1].get("kl/ref_k3"),  # None (null) without a reference model
        "generation_s": sum(h["perf/generation_s"] for h in history),
        "training_s": sum(h["perf/training_s"] + h["perf/logprob_s"] for h in history),
        **judge("grpo", grpo.model, grpo.tokenizer),
        "plot": png,
    }
    del grpo
    gc.collect()
    summary["grpo"]["export"] = grpo_export = api.export(grpo_config, f"{out}/grpo/export")
    summary["total_seconds"] = round(time.time() - started, 1)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)

    rows = [("SmolLM2-135M-Instruct", summary["base"]), ("after DPO", summary["dpo"]),
            ("after GRPO", summary["grpo"])]
    sizes = {s: int(summary["base"][s]["prompts"]) for s in SETS}
    pairs = summary["base"]["logprob_preference_accuracy"]["pairs"]
    print(f"\n== summary: greedy verifier accuracy (± 95% interval) with {grpo_config.rollout.max_new_tokens} new tokens;"
          f" log-prob preference accuracy on {pairs} held-out pairs")
    heads = (f"one-digit, {sizes['one_digit']} unseen", f"two-digit, {sizes['two_digit']} (harder)",
             "log pi(c) > log pi(r)")
    print(f"  {'':22}{heads[0]:>26}{heads[1]:>28}{heads[2]:>24}")
    for label, verdict in rows:
        print(f"  {label:22}{fraction(verdict['one_digit']):>26}{fraction(verdict['two_digit']):>28}"
              f"{verdict['logprob_preference_accuracy']['accuracy']:>24.2f}")
    d, g = summary["dpo"], summary["grpo"]
    print(f"  DPO implicit-reward accuracy on the held-out pairs {d['implicit_reward_accuracy_before']:.2f} -> "
          f"{d['implicit_reward_accuracy_after']:.2f} (0 at step 0 by construction: policy = reference)")
    print(f"  GRPO mean rollout reward {g['reward_first_quarter']:.3f} (first quarter) -> "
          f"{g['reward_last_quarter']:.3f} (last quarter), final KL "
          f"{'(no reference)' if g['kl_last'] is None else format(g['kl_last'], '.4f')}")
    judging = sum(v["seconds"] for v in (summary["base"], d, g))
    print(f"  time: DPO {dpo_time:.0f}s, GRPO {grpo_time:.0f}s, judging {judging:.0f}s, "
          f"total {summary['total_seconds']:.0f}s")
    print(f"  plot: {png}; summary: {out}/summary.json; reports: {out}/evaluation/; "
          f"exported policies: {dpo_export}, {grpo_export}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
