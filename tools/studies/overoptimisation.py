"""Reward-model over-optimisation (Gao, Schulman & Hilton 2022, "Scaling Laws for Reward Model
Overoptimization"): gold and proxy reward against sqrt(KL(pi || pi_ref)), for best-of-N and RL.

1. ``--pair-prompts`` training prompts are sampled ``--label-samples`` times each from the
   starting policy; a prompt's best and worst completion by the **gold** reward (a
   reasoning-gym verifier, ``--gold-function module:fn`` or ``--gold-reward-model DIR``) make
   one preference pair (:func:`alignax.trainers.program.sample_pairs`);
2. a **proxy** Bradley-Terry reward model is trained on those pairs (``algorithm: reward``,
   ``--rm-steps``) and written to ``<out>/proxy``;
3. best-of-N against the proxy: ``--n-max`` samples of every held-out prompt from the starting
   policy, and for N = 1, 2, 4, ..., n_max the expected proxy and gold reward of the
   proxy's pick (:func:`alignax.best_of_n.best_of_k`, over all N-subsets) at
   ``KL = log N - (N-1)/N`` (:func:`alignax.best_of_n.best_of_n_kl`);
4. RL against the proxy: GRPO with the proxy as its only reward (``--kl-coef``, default 0),
   checkpointed every ``--rl-every`` steps; at the start and at each checkpoint,
   ``--rl-samples`` samples of every held-out prompt give the gold and proxy reward and the
   sample estimate of ``KL(pi || pi_ref) = E_{y ~ pi}[log pi(y|x) - log pi_ref(y|x)]``
   (sequence log-ratio averaged over the samples, :func:`sample_kl`).

Prints (and writes to ``<out>/overoptimisation.json``) one JSON object: the settings, the
pairs and the proxy's held-out pair accuracy, ``best_of_n`` and ``rl`` point lists
(``kl``, ``sqrt_kl``, ``proxy``, ``gold``), and wall and CPU seconds per stage.
notebooks/overoptimisation.ipynb plots it.

    .venv/bin/python tools/studies/overoptimisation.py --out runs/overopt [--rm-steps 20 --rl-steps 12 ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from alignax import evaluation
from alignax.best_of_n import BestOfNConfig, Selectors, best_of_k, best_of_n_kl
from alignax.data import write_jsonl
from alignax.data.builders import generate, is_generator_spec
from alignax.kl import sequence_kl
from alignax.models import save_pretrained
from alignax.parallel.sharding import mesh_for_shape
from alignax.sampling.scored import Groups
from alignax.trainers.api import build_trainer, load_config, restore_params, train
from alignax.trainers.program import load_model, load_tokenizer, response_logps, sample_pairs

CHAIN_SUM = "reasoning_gym:chain_sum?size=400&seed=7&max_terms=3&max_digits=1"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="runs/overopt")
    p.add_argument("--model", default="smollm2-135m-instruct", help="registry name or local HF folder")
    p.add_argument("--prompts", default=CHAIN_SUM, help="prompt records: a JSONL path or a generator spec")
    p.add_argument("--gold-function", default=None, help="gold reward module:function (default: the verifier)")
    p.add_argument("--gold-reward-model", default=None, help="gold reward: a trained reward model folder")
    p.add_argument("--max-prompt-length", type=int, default=128)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--batch-size", type=int, default=8, help="prompts per batch (sampling, RL rollouts)")
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts every point is measured on")
    p.add_argument("--pair-prompts", type=int, default=64, help="training prompts sampled for gold-labelled pairs")
    p.add_argument("--label-samples", type=int, default=4, help="samples per prompt when labelling pairs")
    p.add_argument("--rm-steps", type=int, default=20)
    p.add_argument("--rm-lr", type=float, default=3e-5)
    p.add_argument("--n-max", type=int, default=16, help="best-of-N up to this N")
    p.add_argument("--rl-steps", type=int, default=12)
    p.add_argument("--rl-every", type=int, default=4, help="RL steps between measured checkpoints")
    p.add_argument("--rl-group", type=int, default=4, help="GRPO samples per prompt")
    p.add_argument("--rl-lr", type=float, default=2e-5)
    p.add_argument("--kl-coef", type=float, default=0.0, help="GRPO's KL-to-reference coefficient")
    p.add_argument("--rl-samples", type=int, default=4, help="samples per held-out prompt at each RL point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scan-layers", action="store_true",
                   help="scan over the layers: XLA compiles one layer instead of every one (minutes on a CPU)")
    args = p.parse_args(argv)
    if args.gold_function and args.gold_reward_model:
        p.error("give one gold: --gold-function or --gold-reward-model (or neither: the verifier)")
    if args.rl_every < 1 or args.rl_steps % args.rl_every:
        p.error(f"--rl-steps ({args.rl_steps}) must be a multiple of --rl-every ({args.rl_every})")
    return args


def gold_rewards(args) -> dict:
    """The ``rewards:`` section of the gold reward."""
    off = {"verifier_weight": 0.0, "format_weight": 0.0}
    if args.gold_function:
        return {**off, "functions": {args.gold_function: 1.0}}
    if args.gold_reward_model:
        return {**off, "reward_models": [args.gold_reward_model]}
    return {"verifier_weight": 1.0, "format_weight": 0.0, "answer_extraction": "tag_or_last_number"}


def proxy_rewards(proxy_dir: str) -> dict:
    return {"verifier_weight": 0.0, "format_weight": 0.0, "reward_models": [proxy_dir]}


def write_prompts(args) -> str:
    """The study's ``--pair-prompts + --eval-prompts`` first prompt records, written to
    ``<out>/prompts.jsonl``."""
    total = args.pair_prompts + args.eval_prompts
    if is_generator_spec(args.prompts):
        records = generate(args.prompts, "prompt")
    else:
        with open(args.prompts, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
    if len(records) < total:
        raise ValueError(f"--prompts {args.prompts} holds {len(records)} prompts; the study needs "
                         f"--pair-prompts + --eval-prompts = {total}")
    path = os.path.join(args.out, "prompts.jsonl")
    write_jsonl(records[:total], path)
    return path


def policy_config(args, output_dir: str, rewards: dict, prompts_path: str):
    """A GRPO config on the study's prompts: ``--pair-prompts`` training prompts, the
    ``--eval-prompts`` others held out (its eval split)."""
    total = args.pair_prompts + args.eval_prompts
    keep = args.rl_steps // args.rl_every + 1
    return load_config(data={
        "algorithm": "grpo", "output_dir": output_dir,
        "model": {"name": args.model, "scan_layers": args.scan_layers},
        "data": {"paths": [prompts_path], "format": "prompt", "max_prompt_length": args.max_prompt_length,
                 "batch_size": args.batch_size, "eval_fraction": args.eval_prompts / total,
                 "read_threads": 0},
        "rollout": {"max_new_tokens": args.max_new_tokens, "num_samples": args.rl_group, "temperature": 1.0},
        "rewards": rewards,
        "evaluation": {"max_prompts": args.eval_prompts},
        "grpo": {"kl_coef": args.kl_coef},
        "optim": {"learning_rate": args.rl_lr, "schedule": "constant", "warmup_steps": 0},
        "train": {"total_steps": args.rl_steps, "save_every": args.rl_every, "seed": args.seed},
        "checkpoint": {"keep": keep, "async_save": False, "overwrite": True},
        "logging": {"console": False, "tensorboard": False},
        "mesh": {"shape": [1, 1, 1]},
    })


def proxy_config(args, output_dir: str, pairs_path: str):
    budget = args.max_new_tokens + 1
    return load_config(data={
        "algorithm": "reward", "output_dir": output_dir,
        "model": {"name": args.model, "scan_layers": args.scan_layers},
        "data": {"paths": [pairs_path], "format": "preference", "max_prompt_length": args.max_prompt_length,
                 "max_response_length": budget, "max_length": args.max_prompt_length + budget,
                 "batch_size": args.batch_size, "eval_fraction": 0.2, "read_threads": 0},
        "optim": {"learning_rate": args.rm_lr, "schedule": "constant", "warmup_steps": 0},
        "train": {"total_steps": args.rm_steps, "eval_every": args.rm_steps, "seed": args.seed},
        "checkpoint": {"enabled": False, "overwrite": True},
        "logging": {"console": False, "tensorboard": False},
        "mesh": {"shape": [1, 1, 1]},
    })


# ---------------------------------------------------------------------- measuring a policy
@functools.partial(jax.jit, static_argnums=0)
def _response_logps(graphdef, state, tokens, positions, attention, response_mask):
    model = nnx.merge(graphdef, state)
    return response_logps(model, tokens, positions, attention, response_mask, chunk_size=64)


def response_token_logps(graphdef, state, groups, *, rows_per_call: int = 16):
    """``(logps [R, N], mask [R, N])``: the model's log-prob of each sampled response token
    of ``groups`` (aligned with ``groups.tokens``), a full forward pass per row chunk."""
    tokens, positions, attention = groups.full_sequences()
    prompt = groups.prompt_tokens.shape[1]
    response_mask = np.concatenate([np.zeros_like(groups.prompt_mask), groups.response_mask], axis=1)
    out = []
    for start in range(0, len(tokens), rows_per_call):
        part = slice(start, start + rows_per_call)
        rows = len(tokens[part])
        pad = rows_per_call - rows  # one compiled shape for every chunk
        chunk = [np.pad(a[part], ((0, pad), (0, 0))) for a in (tokens, positions, attention, response_mask)]
        logps, _ = _response_logps(graphdef, state, *chunk)
        out.append(np.asarray(logps)[:rows, prompt - 1:])  # logps[:, t] scores token t + 1
    return np.concatenate(out), groups.response_mask.astype(np.float32)


def sample_kl(policy_logps, ref_logps, mask) -> float:
    """Monte-Carlo ``KL(pi || pi_ref)`` per prompt, from responses sampled from ``pi``:
    the mean over rows of ``sum_t (log pi(y_t | .) - log pi_ref(y_t | .))`` (the k1
    estimator summed over the sequence, :func:`alignax.kl.sequence_kl`; unbiased)."""
    return float(np.mean(np.asarray(sequence_kl(policy_logps, ref_logps, mask, kind="k1", clamp=None))))


class Measure:
    """Samples a policy on the held-out prompts and scores the samples by gold and proxy."""

    def __init__(self, config, tokenizer, base_model, proxy_dir: str):
        self.config, self.tokenizer = config, tokenizer
        mesh = mesh_for_shape(config.mesh.shape)
        self.graphdef, self.ref_state = nnx.split(base_model)
        vocab = base_model.config.vocab_size
        self.sampler = evaluation.build_sampler(self.graphdef, tokenizer, config, mesh=mesh, vocab_size=vocab)
        self.proxy = Selectors(BestOfNConfig(by_reward=False, reward_models=(proxy_dir,)), tokenizer,
                               vocab_size=vocab, mesh=mesh, place=self.sampler.place)

    def sample(self, state, n: int, seed: int):
        """``(groups, gold [P, n], proxy [P, n])`` of ``n`` samples of each held-out prompt."""
        sampling = dataclasses.replace(self.sampler.config, greedy=False, temperature=1.0, num_samples=n)
        key = jax.random.key(seed)
        parts = []
        for index, batch in enumerate(evaluation.prompt_batches(self.config, self.tokenizer)):
            groups, _, _ = self.sampler.sample(state, batch, jax.random.fold_in(key, index), config=sampling)
            real = np.repeat(np.asarray(batch["example_mask"]) > 0, n)
            parts.append(groups.take(np.flatnonzero(real)))
        groups = Groups.concat(parts)
        proxy = self.proxy.scores(groups)["orm"]
        return groups, groups.rewards.reshape(-1, n).astype(np.float64), proxy.reshape(-1, n)

    def kl(self, state, groups) -> float:
        policy, mask = response_token_logps(self.graphdef, state, groups)
        ref, _ = response_token_logps(self.graphdef, self.ref_state, groups)
        return sample_kl(policy, ref, mask)


def point(kl: float, proxy: float, gold: float, **extra) -> dict:
    return {**extra, "kl": kl, "sqrt_kl": math.sqrt(max(kl, 0.0)), "proxy": proxy, "gold": gold}


def best_of_n_points(measure: Measure, n_max: int, seed: int) -> list[dict]:
    """Proxy and gold reward of the proxy's best of N, N = 1, 2, 4, ..., ``n_max``."""
    _, gold, proxy = measure.sample(measure.ref_state, n_max, seed)
    return [point(best_of_n_kl(n), float(best_of_k(proxy, proxy, n).mean()), float(best_of_k(proxy, gold, n).mean()),
                  n=n)
            for n in BestOfNConfig(n=n_max).sizes()]


def rl_points(args, measure: Measure, config) -> list[dict]:
    """GRPO against the proxy; gold, proxy and sample KL at the start and every checkpoint."""
    train(config)
    trainer = build_trainer(config)
    points = []
    for step in range(0, args.rl_steps + 1, args.rl_every):
        state = measure.ref_state if step == 0 else trainer.actors.sampling_state(restore_params(trainer, config, step))
        groups, gold, proxy = measure.sample(state, args.rl_samples, args.seed + 1)
        points.append(point(measure.kl(state, groups), float(proxy.mean()), float(gold.mean()), step=step))
    return points


def run(args) -> dict:
    """The study (module docstring); returns the JSON object and writes it under ``args.out``."""
    seconds: dict[str, float] = {}
    cpu_seconds: dict[str, float] = {}  # this process's CPU time: wall time on a shared machine says little
    clock, cpu = time.perf_counter(), time.process_time()

    def lap(name):
        nonlocal clock, cpu
        now, now_cpu = time.perf_counter(), time.process_time()
        seconds[name], cpu_seconds[name] = round(now - clock, 1), round(now_cpu - cpu, 1)
        clock, cpu = now, now_cpu

    os.makedirs(args.out, exist_ok=True)
    prompts_path = write_prompts(args)
    gold_config = policy_config(args, os.path.join(args.out, "labels"), gold_rewards(args), prompts_path)
    tokenizer = load_tokenizer(gold_config)
    base = load_model(gold_config)
    # 1. gold-labelled pairs from the starting policy's samples of the training prompts
    graphdef, state = nnx.split(base)
    labeller = evaluation.build_sampler(graphdef, tokenizer, gold_config, mesh=mesh_for_shape(gold_config.mesh.shape),
                                        vocab_size=base.config.vocab_size)
    label_config = dataclasses.replace(gold_config, rollout=dataclasses.replace(gold_config.rollout,
                                                                               num_samples=args.label_samples))
    pairs, label_figures = sample_pairs(labeller, state, label_config, 0)
    if len(pairs) < 2:
        raise ValueError(f"only {len(pairs)} of {args.pair_prompts} training prompts had samples the gold reward "
                         "tells apart; raise --pair-prompts or --label-samples")
    pairs_path = os.path.join(args.out, "pairs.jsonl")
    write_jsonl(pairs, pairs_path)
    lap("label_pairs")

    # 2. the proxy reward model
    rm_config = proxy_config(args, os.path.join(args.out, "proxy-run"), pairs_path)
    result = train(rm_config)
    proxy_dir = os.path.join(args.out, "proxy")
    save_pretrained(result.model, proxy_dir)
    tokenizer.save_pretrained(proxy_dir)
    rm_eval = result.eval_history[-1] if result.eval_history else {}
    lap("train_proxy")

    # 3. best-of-N and 4. RL, both measured on the held-out prompts
    measure = Measure(gold_config, tokenizer, base, proxy_dir)
    best_of_n = best_of_n_points(measure, args.n_max, args.seed)
    lap("best_of_n")
    rl_config = policy_config(args, os.path.join(args.out, "rl"), proxy_rewards(proxy_dir), prompts_path)
    rl = rl_points(args, measure, rl_config)
    lap("rl")

    report = {
        "settings": {k: v for k, v in vars(args).items()},
        "gold": gold_rewards(args),
        "pairs": {"count": len(pairs), **label_figures},
        "proxy_eval": {k: float(v) for k, v in rm_eval.items() if isinstance(v, (int, float))},
        "best_of_n": best_of_n,
        "rl": rl,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
    }
    with open(os.path.join(args.out, "overoptimisation.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    return report


def main(argv: Sequence[str] | None = None) -> None:
    report = run(parse_args(argv))
    json.dump(report, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
