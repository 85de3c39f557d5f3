"""GRPO step time (generation + update): alignax's OnlineTrainer vs Google Tunix's
GRPOLearner, same shapes, same run.

    HF_HUB_OFFLINE=1 .venv/bin/python tools/benchmarks/bench_grpo.py --model tiny
    HF_HUB_OFFLINE=1 .venv/bin/python tools/benchmarks/bench_grpo.py --model smollm2-135m --steps 2 --out runs/bench/grpo.json

One step: 8 prompts of 64 real tokens (random ids), G = 2 completions each of exactly 64
sampled tokens (no stop token on either side), temperature 0.9, top_p 1.0, a cheap rule
reward on the host, group advantages ``(r - mean) / (std_unbiased + eps)``, the clipped
loss (eps 0.2) with k1 KL to the frozen reference in the loss (beta 0.04),
seq-mean-token-mean aggregation, 1 epoch x 1 minibatch, AdamW lr 1e-6 (weight decay 1e-4,
constant schedule, no clipping), float32. alignax's reference and update forwards run
each prompt's two completions as one packed row with the prompt once
(``rollout.pack_groups: auto``); Tunix runs each completion with its own prompt copy.

alignax side: ``OnlineTrainer.rollout_step`` itself, the trainer's whole rollout step:
sampling (the one-jit sampler), decoding and scoring, reference log-probs, advantages,
the jitted update (one update per rollout: the old log-probs are its own forward pass's,
gradient stopped), metrics. The trainer is built from a TrainConfig; the state, the
jitted update and the frozen reference come from ``OnlineTrainer.start``, as
``OnlineTrainer.train`` sets them up. Prompt batches are fed directly: the
tiny model's vocabulary (4096) is smaller than its tokenizer's (SmolLM2, 49152), so the
prompts are random ids below the model's vocabulary; the tokenizer decodes them like any
others. The parts come from the step's own figures: ``perf/generation_s``,
``perf/logprob_s``, ``perf/training_s``; the step time is the wall time of the call.

Tunix side: tools/peers/tunix_grpo.py in .venv-bench (its own ``GRPOLearner.train`` loop,
timers around generate / reference log-probs / update). ``speedup`` = Tunix median step
time / alignax median step time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/: bench_common
import bench_common as common  # noqa: E402

common.offline_environment()

PROMPTS, GROUP, PROMPT_LEN, NEW_TOKENS = 8, 2, 64, 64
TEMPERATURE, TOP_P = 0.9, 1.0
BETA, CLIP, LR, WEIGHT_DECAY = 0.04, 0.2, 1e-6, 1e-4
REWARD = "bench_common:even_char_share"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, steps=3, warmup=1)
    args = parser.parse_args(argv)
    common.check_common_args(parser, args)
    return args


def train_config(args):
    from alignax.data import DataConfig
    from alignax.trainers.config import (CheckpointSection, GRPOSection, LoggingSection, MeshSection, RewardConfig,
                                         RolloutSection, TrainConfig, TrainSection)
    from alignax.trainers.config import OptimConfig

    vocab = int(common.SHAPES[args.model]["vocab_size"])
    return TrainConfig(
        algorithm="grpo",
        output_dir="runs/bench-grpo",
        model=common.model_spec(args),
        data=DataConfig(format="prompt", max_prompt_length=PROMPT_LEN, batch_size=PROMPTS, read_threads=0),
        # An id outside the vocabulary is never sampled: every completion has exactly
        # NEW_TOKENS tokens, as on the Tunix side (eos_tokens=[-1]).
        rollout=RolloutSection(max_new_tokens=NEW_TOKENS, temperature=TEMPERATURE, top_k=0, top_p=TOP_P,
                               num_samples=GROUP, stop_token_ids=(vocab,), old_logps="recompute"),
        rewards=RewardConfig(verifier_weight=0.0, format_weight=0.0, functions={REWARD: 1.0}),
        grpo=GRPOSection(advantage="grpo", unbiased_std=True, policy_loss="ppo", clip_eps_low=CLIP,
                         clip_eps_high=None, aggregation="seq-mean-token-mean", kl_coef=BETA, kl_kind="k1",
                         kl_placement="loss", entropy_coef=0.0, epochs=1, minibatches=1),
        optim=OptimConfig(name="adamw", learning_rate=LR, schedule="constant", weight_decay=WEIGHT_DECAY,
                          max_grad_norm=None),
        train=TrainSection(total_steps=args.warmup + args.rounds * args.steps, seed=args.seed),
        checkpoint=CheckpointSection(enabled=False),
        logging=LoggingSection(console=False, jsonl=False, tensorboard=False),
        mesh=MeshSection(shape=(1, 1, 1)),
    )


def prompt_batches(n: int, *, vocab: int, seed: int) -> list[dict]:
    """``n`` prompt batches in the data pipeline's layout (left-padded; here full)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [
        {
            "prompt_tokens": rng.integers(3, vocab, size=(PROMPTS, PROMPT_LEN), dtype=np.int32),
            "prompt_attention_mask": np.ones((PROMPTS, PROMPT_LEN), np.int32),
            "references": tuple({"prompt": "", "answer": ""} for _ in range(PROMPTS)),
        }
        for _ in range(n)
    ]


class AlignaxGRPO:
    """alignax's GRPO rollout steps, ``OnlineTrainer.rollout_step``; ``warm()`` then ``run(n)`` rounds."""

    def __init__(self, args):
        import jax

        from alignax.trainers.api import build_trainer as make_trainer

        self.args = args
        self.clock = common.CompileClock()
        config = train_config(args)
        t0 = time.perf_counter()
        # The data section needs records to build; the steps are fed prompt batches directly.
        records = [{"prompt": "hi", "answer": ""} for _ in range(PROMPTS)]
        self.trainer = make_trainer(config, records=records)
        self.state, self.frozen = self.trainer.start()  # the fresh state, and what the step reads besides it
        jax.block_until_ready((self.state, self.frozen))
        self.build_s = time.perf_counter() - t0
        self.model = common.model_summary(args, self.trainer.actors.policy_params(self.state.params))
        total = args.warmup + args.rounds * args.steps
        self.batches = iter(prompt_batches(total, vocab=int(common.SHAPES[args.model]["vocab_size"]),
                                           seed=args.seed + 1))
        self.walls, self.figures, self.compiles = [], [], []

    def _steps(self, n: int) -> None:
        import jax

        for _ in range(n):
            batch = next(self.batches)
            before = self.clock.snapshot()
            start = time.perf_counter()
            self.state, out = self.trainer.rollout_step(self.state, self.frozen, batch, iter(()))
            figures = out.metrics
            jax.block_until_ready(self.state)
            self.walls.append(time.perf_counter() - start)
            self.compiles.append(tuple(a - b for a, b in zip(self.clock.snapshot(), before)))
            self.figures.append(figures)

    def warm(self) -> None:
        self._steps(self.args.warmup)

    def run(self, n: int) -> None:
        self._steps(n)

    def summary(self) -> dict:
        import jax

        warmup = self.args.warmup
        timed_figures = self.figures[warmup:]
        part = lambda key: [f[key] for f in timed_figures]  # noqa: E731
        step_times = self.walls[warmup:]
        generation, logprob, update = part("perf/generation_s"), part("perf/logprob_s"), part("perf/training_s")
        other = [s - g - lp - u for s, g, lp, u in zip(step_times, generation, logprob, update)]
        last = self.figures[-1]
        return {
            **common.timing_figures(self.walls, self.compiles, warmup=warmup, build_s=self.build_s),
            "generation_s": common.median(generation),
            "generation_times_s": generation,
            "logprob_s": common.median(logprob),
            "update_s": common.median(update),
            "update_times_s": update,
            "other_s": common.median(other),
            "generated_tokens_per_s": PROMPTS * GROUP * NEW_TOKENS / common.median(generation),
            "completion_length_mean": last["response/length_mean"],
            "reward_mean_last": last["reward/total"],
            "first_minibatch_ratio_mean_last": last["first_minibatch/ratio_mean"],
            "kl_ref_k1_last": last["kl/ref_k1"],
            "devices": [str(d) for d in jax.devices()],
            "jax": jax.__version__,
            "what": "OnlineTrainer.rollout_step wall time (blocked on the new state): generation = perf/generation_s "
                    "(the jitted sampler incl. device->host), logprob = perf/logprob_s (the reference forward at "
                    "temperature 0.9; one update per rollout, so the old log-probs are the update's own forward "
                    "pass's), update = "
                    "perf/training_s (the jitted make_train_step, metrics to host), other = decoding, reward, "
                    "advantages, host figures",
        }


def main(argv=None) -> None:
    args = parse_args(argv)
    load_start = os.getloadavg()
    peer_args = ["--batch", str(PROMPTS), "--num-generations", str(GROUP), "--seq", str(PROMPT_LEN + NEW_TOKENS),
                 "--prompt-len", str(PROMPT_LEN), "--steps", str(args.steps), "--warmup", str(args.warmup),
                 "--beta", str(BETA), "--epsilon", str(CLIP), "--kl-mode", "kl",
                 "--loss-agg", "sequence-mean-token-mean", "--temperature", str(TEMPERATURE), "--top-p", str(TOP_P),
                 "--lr", str(LR)]
    bench = AlignaxGRPO(args)
    peer, failures = common.alternate(args, bench, "tunix_grpo.py", peer_args)
    ours, model = bench.summary(), bench.model
    notes = [
        "alignax: optim.max_grad_norm=null (Tunix's GRPO update clips nothing); weight_decay 1e-4 on matrices "
        "only (optax.adamw's default on every parameter on the Tunix side); constant learning rate on both.",
        "old log-probs: one update per rollout on both sides, so both take old = stop_gradient(new) from the "
        "update's own forward pass (alignax: rollout.old_logps=recompute with 1 epoch x 1 minibatch) and run "
        "no separate policy forward.",
        "top_p=1.0: alignax keeps the whole vocabulary without sorting; Tunix 0.1.7 still sorts the vocabulary "
        "every decode step at top_p=1.0 (its top-p path).",
        f"reward: alignax {REWARD} (share of even code points of the decoded text); Tunix parity_reward (share "
        "of even token ids); both host Python over 16 short strings.",
        "no early stop: alignax rollout.stop_token_ids=[vocab_size] (never sampled), Tunix eos_tokens=[-1].",
        f"alignax: rollout.pack_groups=auto packs each prompt's {GROUP} completions into one row with the "
        f"prompt once ({PROMPT_LEN} + {GROUP} x {NEW_TOKENS} tokens instead of {GROUP} x {PROMPT_LEN + NEW_TOKENS}) "
        "in the reference and update forwards; Tunix runs every completion with its own copy of the prompt.",
    ]
    if ours["compile_time_timed_steps_s"] > 0.5:
        notes.append(f"alignax compiled {ours['compile_time_timed_steps_s']:.2f}s during timed steps.")
    parts = None
    notes.extend(f"Tunix run failed: {failure}" for failure in failures)
    if peer is not None:
        notes.extend(common.shape_notes(model, peer))
        ours_train = ours["logprob_s"] + ours["update_s"]
        peer_train = peer["ref_logps_time_s_median"] + peer["update_time_s_median"]
        parts = {
            "generation": peer["generation_time_s_median"] / ours["generation_s"],
            "logprobs_plus_update": peer_train / ours_train,
            "what": "tunix / alignax medians; logprobs_plus_update: tunix ref + update vs alignax logprob + update",
        }
    result = {
        "task": "grpo",
        "model": model,
        "shapes": {"prompts": PROMPTS, "num_generations": GROUP, "rows": PROMPTS * GROUP, "prompt_len": PROMPT_LEN,
                   "new_tokens": NEW_TOKENS, "seq": PROMPT_LEN + NEW_TOKENS, "dtype": "float32"},
        "hyper": {"advantage": "grpo (unbiased std)", "policy_loss": "ppo clip", "clip_eps": CLIP, "kl_coef": BETA,
                  "kl_kind": "k1", "kl_placement": "loss", "aggregation": "seq-mean-token-mean", "epochs": 1,
                  "minibatches": 1, "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": 0,
                  "optimizer": f"adamw lr {LR} constant, weight decay {WEIGHT_DECAY}", "max_grad_norm": None,
                  "reward": REWARD},
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "order": "tunix first" if args.peer_first else "alignax first",
        "alignax": ours,
        "tunix": peer,
        **common.speedups(ours, peer),
        "speedup_parts": parts,
        "target_speedup": 1.5,
        "load_average_start": list(load_start),
        "load_average": list(os.getloadavg()),
        "cpu_count": os.cpu_count(),
        "alignax_source": common.source_state(),
        "notes": notes,
    }
    common.finish(result, args.out)


if __name__ == "__main__":
    main()
