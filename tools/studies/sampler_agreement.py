"""Sampler/learner log-prob agreement (alignax.trainers.online.agreement) measured on real
rollouts: for each setting and compute dtype, one GRPO rollout is sampled and priced by
the trainer, and the ``agreement/<dtype>/gap_*`` figures it logs are collected (mean and
max |learner - sampler| log-prob over the policy's tokens, the share above 1e-3), with
the cost of the measurement against the pricing forward pass (``perf/logprob_s``).

Settings: ``one_device``; ``lora`` (rank 8 adapters, perturbed so they change the
model) and ``lora_merged`` (the same with ``lora.merge_for_sampling``); with ``--devices 8``
(fake CPU devices unless the machine has 8) also ``mesh`` (training and sampling on a
(2, 2, 2) mesh) and ``own_mesh`` (training on (1, 8, 1), the sampler on its own (2, 1, 4),
``rollout.mesh``). The model is SmolLM2-135M-Instruct unless ``--model`` names another;
prompts are reasoning-gym chain_sum.

    .venv/bin/python tools/studies/sampler_agreement.py --out docs/results/sampler_agreement.json
    .venv/bin/python tools/studies/sampler_agreement.py --devices 8 --settings mesh own_mesh --append ...
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

SETTINGS = ("one_device", "lora", "lora_merged", "mesh", "own_mesh")


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--settings", nargs="+", default=["one_device", "lora", "lora_merged"], choices=SETTINGS)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--prompts", type=int, default=4, help="prompts per rollout (data.batch_size)")
    p.add_argument("--samples", type=int, default=4, help="completions per prompt (rollout.num_samples)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--devices", type=int, default=1, help="fake CPU devices to ask XLA for (8 for the mesh settings)")
    p.add_argument("--out", default=None, help="write the JSON here as well")
    p.add_argument("--append", action="store_true", help="add these rows to --out's rows instead of replacing them")
    p.add_argument("--self-consistency", action="store_true",
                   help="also the learner against itself: its pass over the first P + k tokens against its pass "
                        "over the whole sequence, k = 1, 5, 15, 25 (what no sampler can beat)")
    return p.parse_args(argv)


def recipe(args, setting: str, dtype: str, output_dir: str) -> dict:
    """The GRPO recipe of one measurement (one rollout; nothing is saved)."""
    raw = {
        "algorithm": "grpo", "output_dir": output_dir,
        "model": {"name": args.model, "logprob_chunk_size": 32},
        "precision": {"compute_dtype": dtype},
        "data": {"paths": ["reasoning_gym:chain_sum?size=32&seed=0"], "format": "prompt", "max_prompt_length": 128,
                 "batch_size": args.prompts, "eval_fraction": 0.0},
        "rollout": {"max_new_tokens": args.max_new_tokens, "num_samples": args.samples,
                    "temperature": args.temperature},
        "rewards": {"verifier_weight": 1.0},
        "train": {"total_steps": 1}, "checkpoint": {"enabled": False},
        "logging": {"tensorboard": False, "console": False},
        "mesh": {"shape": [1, 1, 1]},
    }
    if setting in ("lora", "lora_merged"):
        raw["lora"] = {"rank": 8, "alpha": 16, "merge_for_sampling": setting == "lora_merged"}
    if setting == "mesh":
        raw["mesh"] = {"shape": [2, 2, 2]}
    if setting == "own_mesh":
        raw["mesh"] = {"shape": [1, 8, 1]}
        raw["rollout"]["mesh"] = [2, 1, 4]
    return raw


def self_consistency(trainer, state, batch, ks=(1, 5, 15, 25)) -> dict:
    """Largest |log-prob difference| of response token ``k``: the learner's pass over the
    first ``P + k`` tokens (the sequence cut after the token's context) against its pass
    over the whole sequence, and the sampler's against the whole-sequence pass. Same
    code, same weights: only the sequence length differs."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    actors, ro = trainer.actors, batch.rollout
    model = nnx.merge(actors.graphdef, actors.whole_policy(state.params), actors.rest)
    temperature, P = trainer.config.rollout.temperature, actors.prompt_len

    @jax.jit
    def logps(tokens, positions, attention):  # [R, T - 1]: the log-prob of each next token
        logits = model.logits(model(tokens, positions, attention, return_logits=False).hidden[:, :-1]) / temperature
        return jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1)[..., 0]

    mask, sampler = np.asarray(batch.response_mask) > 0, np.asarray(ro.sampler_logps)
    whole = np.asarray(logps(ro.tokens, ro.positions, ro.attention_mask))
    out = {"k": [], "learner_prefix_vs_whole": [], "sampler_vs_whole": []}
    for k in ks:
        if k >= mask.shape[1] or not mask[:, k].any():
            continue
        cut = P + k + 1  # the prompt, response tokens 0..k
        prefix = np.asarray(logps(ro.tokens[:, :cut], ro.positions[:, :cut], ro.attention_mask[:, :cut]))[:, -1]
        full = whole[:, P + k - 1]
        out["k"].append(k)
        out["learner_prefix_vs_whole"].append(float(np.max(np.abs(prefix - full)[mask[:, k]])))
        out["sampler_vs_whole"].append(float(np.max(np.abs(sampler[:, k] - full)[mask[:, k]])))
    return out


def measure(args, setting: str, dtype: str) -> dict:
    """One rollout of ``setting`` in ``dtype``: its agreement figures and timings."""
    import tempfile

    import jax

    from alignax.trainers.api import build_trainer, load_config

    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(data=recipe(args, setting, dtype, tmp))
        trainer = build_trainer(config)
        state, frozen = trainer.start()
        if config.lora is not None:  # fresh adapters are zero (the base itself): give them weights
            leaves, treedef = jax.tree.flatten(state.params)
            keys = jax.random.split(jax.random.key(1), len(leaves))
            noisy = [x + 0.02 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
            state = state._replace(params=jax.tree.unflatten(treedef, noisy))
        batches = trainer.data.iterator("train")
        trainer.collect(state, frozen, next(batches), batches)  # compiles the sampler and the forward pass
        t0 = time.perf_counter()
        batch = trainer.collect(state, frozen, next(batches), batches)
        collect_s = time.perf_counter() - t0
        gap = trainer.collector.agreement
        sampler_logps, recomputed, mask = batch.rollout.sampler_logps, batch.recomputed, batch.response_mask
        if recomputed is None:  # single-update mode: the same forward pass the update would run
            recomputed = trainer.actors.forward(trainer.actors.whole_policy(state.params), batch.rollout.tokens,
                                                batch.rollout.positions, batch.rollout.attention_mask)[0]
        for _ in range(2):  # the first call compiles the reduction; the second is what a rollout pays
            t0 = time.perf_counter()
            figures = gap.measure(sampler_logps, recomputed, mask, rollout_index=batch.rollout_index,
                                  policy_version=batch.policy_version)
            measure_s = time.perf_counter() - t0
        extra = {"self_consistency": self_consistency(trainer, state, batch)} if args.self_consistency else {}
    keys = gap.keys()
    return {**extra, "setting": setting, "dtype": dtype, "gap_mean": figures[keys["mean"]],
            "gap_max": figures[keys["max"]], "share_above_1e-3": figures[keys["share"]],
            "tokens": int(figures[keys["tokens"]]),
            "measure_s": measure_s, "logprob_s": batch.figures["perf/logprob_s"], "collect_s": collect_s,
            "devices": jax.device_count()}


def main(argv=None) -> int:
    args = parse(argv)
    if args.devices > 1:  # before jax is imported
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.devices}")
    import jax

    rows = []
    for setting in args.settings:
        if setting in ("mesh", "own_mesh") and jax.device_count() < 8:
            raise SystemExit(f"setting {setting} needs 8 devices; run with --devices 8")
        for dtype in args.dtypes:
            rows.append(measure(args, setting, dtype))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    out = {"model": args.model, "prompts": args.prompts, "samples": args.samples,
           "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
           "jax": jax.__version__, "backend": jax.default_backend(), "machine": platform.machine(), "rows": rows}
    if args.out and args.append and os.path.exists(args.out):
        with open(args.out) as f:
            previous = json.load(f)
        done = {(r["setting"], r["dtype"]) for r in rows}
        out["rows"] = [r for r in previous["rows"] if (r["setting"], r["dtype"]) not in done] + rows
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
