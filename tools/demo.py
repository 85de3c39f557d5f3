"""The main job (``make demo``): DPO, then GRPO, on SmolLM2-135M-Instruct, on this CPU.

1. Data from reasoning-gym's ``chain_sum`` (two one-digit terms): 16 held-out questions,
   preference pairs and RL prompts that never contain them.
2. Greedy verifier accuracy of the base model on the held-out questions.
3. DPO (configs/demo-dpo.yaml): held-out preference accuracy before and after; verifier
   accuracy after; the policy exported as Hugging Face safetensors.
4. GRPO from the DPO policy (configs/demo-grpo.yaml): verifier accuracy after; a PNG of
   reward and KL per step.
5. A summary (printed, and runs/demo/summary.json).

``--long`` trains 4x more steps (about an hour on 2 CPU cores). Any ``dotted.key=value``
after ``--dpo`` / ``--grpo`` overrides that stage's config.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)
HELD_OUT = 16


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/demo", help="where data, runs, plot and summary go")
    p.add_argument("--long", action="store_true", help="4x the training steps")
    p.add_argument("--dpo", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of configs/demo-dpo.yaml")
    p.add_argument("--grpo", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of configs/demo-grpo.yaml")
    return p.parse_args(argv)


def write_data(out: str) -> dict[str, str]:
    from alignax.data import reasoning_gym_pairs, reasoning_gym_prompts, write_jsonl

    held_out = reasoning_gym_prompts("chain_sum", size=64, seed=99, **TASK)[:HELD_OUT]
    questions = {r["prompt"] for r in held_out}
    pairs = [r for r in reasoning_gym_pairs("chain_sum", size=600, seed=0, **TASK) if r["prompt"] not in questions]
    prompts = [r for r in reasoning_gym_prompts("chain_sum", size=600, seed=1, **TASK) if r["prompt"] not in questions]
    paths = {name: os.path.join(out, "data", f"{name}.jsonl") for name in ("held_out", "dpo_pairs", "grpo_prompts")}
    os.makedirs(os.path.dirname(paths["held_out"]), exist_ok=True)
    for name, records in (("held_out", held_out), ("dpo_pairs", pairs), ("grpo_prompts", prompts)):
        write_jsonl(records, paths[name])
    print(f"data: {len(held_out)} held-out questions, {len(pairs)} DPO pairs, {len(prompts)} RL prompts "
          "(none of them a held-out question)")
    return paths


class HeldOutJudge:
    """Greedy decoding on the held-out questions, scored by the reasoning-gym verifier."""

    def __init__(self, path: str, grpo_config):
        from alignax.data import DataConfig, prepare_dataset
        from alignax.sampling import SamplingConfig
        from alignax.parallel.sharding import batch_sharding, place_array
        from alignax.trainers.common import build_mesh
        from alignax.trainers.rl_rewards import RewardScorer

        self.mesh = build_mesh(grpo_config.mesh)
        self.rewards = grpo_config.rewards
        self.max_new = grpo_config.rollout.max_new_tokens
        self.data_config = DataConfig(paths=(path,), format="prompt", max_prompt_length=grpo_config.data.max_prompt_length,
                                      batch_size=HELD_OUT, eval_fraction=0.0, shuffle=False, read_threads=0)
        self._prepare, self._sampling_config = prepare_dataset, SamplingConfig
        self._scorer_cls, self._place = RewardScorer, lambda v: place_array(v, batch_sharding(self.mesh, v.ndim))

    def __call__(self, model, tokenizer) -> dict[str, float]:
        from flax import nnx

        from alignax.trainers.rollout import Sampler, evaluate_greedy

        stop = (tokenizer.eos_token_id,)
        config = self._sampling_config(max_new_tokens=self.max_new, greedy=True, stop_token_ids=stop,
                                       pad_id=tokenizer.pad_token_id)
        scorer = self._scorer_cls(self.rewards, max_new_tokens=self.max_new, stop_token_ids=stop)
        graphdef, state = nnx.split(model)
        sampler = Sampler(graphdef, tokenizer, scorer, config, mesh=self.mesh, place=self._place)
        data = self._prepare(self.data_config, tokenizer)
        return evaluate_greedy(sampler, state, data.iterator("train", ordered=True), limit=HELD_OUT, config=config)


def plot(history, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    ax1.plot(steps, [h["reward/total"] for h in history], marker="o", label="total")
    if "reward/answer" in history[0]:
        ax1.plot(steps, [h["reward/answer"] for h in history], marker=".", label="answer (verifier)")
    ax1.set_xlabel("GRPO step"), ax1.set_ylabel("mean reward"), ax1.legend(), ax1.grid(alpha=0.3)
    ax2.plot(steps, [h["kl/ref_k3"] for h in history], marker="o", color="tab:red")
    ax2.set_xlabel("GRPO step"), ax2.set_ylabel("KL to reference (k3, per token)"), ax2.grid(alpha=0.3)
    fig.suptitle("GRPO on SmolLM2-135M-Instruct, reasoning-gym chain_sum")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    os.chdir(ROOT)
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from alignax.trainers import online, run
    from alignax.trainers.config import load_config

    started = time.time()
    out = args.out
    paths = write_data(out)
    scale = 4 if args.long else 1
    dpo_config = load_config("configs/demo-dpo.yaml", [
        f"output_dir={out}/dpo", f"data.paths=[{paths['dpo_pairs']}]", "checkpoint.resume=false",
        *( [f"train.total_steps={16 * scale}"] if args.long else []), *args.dpo])
    grpo_config = load_config("configs/demo-grpo.yaml", [
        f"output_dir={out}/grpo", f"model.name={out}/dpo/export", f"data.paths=[{paths['grpo_prompts']}]",
        "checkpoint.resume=false", *([f"train.total_steps={16 * scale}"] if args.long else []), *args.grpo])
    judge = HeldOutJudge(paths["held_out"], grpo_config)
    summary: dict = {"held_out_questions": HELD_OUT, "task": {"name": "chain_sum", **TASK}}

    print("\n== base model: greedy answers to the held-out questions")
    from alignax.trainers.common import build_model, load_tokenizer

    base = build_model(dpo_config.model)
    tokenizer = load_tokenizer(dpo_config.model)
    summary["base"] = judge(base, tokenizer)
    print(f"verifier accuracy {summary['base']['accuracy'] * HELD_OUT:.0f}/{HELD_OUT}")
    del base
    gc.collect()

    print(f"\n== DPO: {dpo_config.train.total_steps} steps of {dpo_config.data.batch_size} pairs")
    t = time.time()
    dpo = run.train(dpo_config)
    dpo_time = time.time() - t
    before, after = dpo.eval_history[0], dpo.eval_history[-1]
    export_dir = run.export(dpo_config, f"{out}/dpo/export")
    summary["dpo"] = {
        "seconds": round(dpo_time, 1),
        "held_out_pairs": dpo.data_stats["eval"],
        "preference_accuracy_before": before["eval/rewards/accuracies"],
        "preference_accuracy_after": after["eval/rewards/accuracies"],
        "held_out_loss_before": before["eval/loss"],
        "held_out_loss_after": after["eval/loss"],
        "verifier": judge(dpo.model, dpo.tokenizer),
        "export": export_dir,
    }
    print(f"held-out preference accuracy {before['eval/rewards/accuracies']:.3f} -> {after['eval/rewards/accuracies']:.3f}"
          f" ({dpo.data_stats['eval']} pairs); verifier accuracy "
          f"{summary['dpo']['verifier']['accuracy'] * HELD_OUT:.0f}/{HELD_OUT}; exported to {export_dir}")
    del dpo  # the DPO policy, its reference and optimiser state: memory the GRPO stage needs
    gc.collect()

    print(f"\n== GRPO: {grpo_config.train.total_steps} steps of {grpo_config.data.batch_size} prompts x "
          f"{grpo_config.rollout.num_samples} samples, from the DPO policy")
    t = time.time()
    grpo = online.train(grpo_config)
    grpo_time = time.time() - t
    png = os.path.join(out, "grpo_reward_kl.png")
    plot(grpo.history, png)
    history = grpo.history
    summary["grpo"] = {
        "seconds": round(grpo_time, 1),
        "reward_first_steps": sum(h["reward/total"] for h in history[:4]) / min(4, len(history)),
        "reward_last_steps": sum(h["reward/total"] for h in history[-4:]) / min(4, len(history)),
        "kl_last": history[-1]["kl/ref_k3"],
        "generation_s": sum(h["perf/generation_s"] for h in history),
        "training_s": sum(h["perf/training_s"] + h["perf/logprob_s"] for h in history),
        "verifier": judge(grpo.model, grpo.tokenizer),
        "plot": png,
    }
    summary["total_seconds"] = round(time.time() - started, 1)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)

    acc = lambda s: f"{s['accuracy'] * HELD_OUT:.0f}/{HELD_OUT}"  # noqa: E731
    print("\n== summary (greedy verifier accuracy on the held-out questions)")
    print(f"  base model      {acc(summary['base'])}")
    print(f"  after DPO       {acc(summary['dpo']['verifier'])}   (held-out preference accuracy "
          f"{summary['dpo']['preference_accuracy_before']:.2f} -> {summary['dpo']['preference_accuracy_after']:.2f})")
    print(f"  after GRPO      {acc(summary['grpo']['verifier'])}   (mean reward {summary['grpo']['reward_first_steps']:.3f} "
          f"-> {summary['grpo']['reward_last_steps']:.3f}, final KL {summary['grpo']['kl_last']:.4f})")
    print(f"  time: DPO {dpo_time:.0f}s, GRPO {grpo_time:.0f}s, total {summary['total_seconds']:.0f}s")
    print(f"  plot: {png}; summary: {out}/summary.json; exported DPO policy: {export_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
