"""LoRA vs full-parameter training, side by side in one run: DPO and GRPO step time, compiled
peak memory of the step, and the estimator's figure; Tunix's LoRA (qwix) DPO step as a peer.

    HF_HUB_OFFLINE=1 .venv/bin/python tools/benchmarks/bench_lora.py --model tiny
    HF_HUB_OFFLINE=1 TUNIX_PYTHON=/work/venv-tunix/bin/python nice -n 19 .venv/bin/python tools/benchmarks/bench_lora.py \
        --model smollm2-135m --weights real --peer-weights random --scan-layers --variants full,lora,nf4 \
        --steps 1 --rounds 2 --warmup 1 --dpo-pairs 4 --dpo-seq 64 --grpo-prompts 4 --grpo-prompt-len 32 \
        --grpo-new-tokens 16 --peer-timeout 2400 --out runs/bench/lora-smollm2.json

(docs/lora.md's figures: 58 min under a load average of 7 to 25 on 2 cores, 40 min of it the two
Tunix processes).

The steps are those of tools/benchmarks/bench_dpo.py (preference pairs, live reference, shared-prompt
packing) and tools/benchmarks/bench_grpo.py (prompts x 2 samples, KL to the reference in the loss),
with their batch and sequence sizes set by the ``--dpo-*`` / ``--grpo-*`` flags (defaults:
those scripts' 8 x 128 and 8 x 2 x (64 + 64); the JSON states the sizes run). Each step
runs in the ``--variants`` asked for: ``full`` (full-parameter), ``lora`` (``lora: {rank:
R, alpha: 2R, targets: [all]}``, the seven projections of every layer; default R = 16),
``int8`` / ``nf4`` (the same adapters on a QLoRA base, ``lora.quantize``). Float32, one
device.

Rounds alternate: every variant of a task is built and warmed up first, then each round
times ``--steps`` steps of every variant in turn (then one Tunix run), so a change of the
machine's load during the run falls on every column alike.

Per variant: the step-time median of the timed steps (DPO: the trainer loop's
``perf/step_time_s``; GRPO: the rollout step's wall time and its update part), the
compiled train step's memory (``compiled.memory_analysis()`` of the step compiled once,
ahead of its first call, and then run: arguments + outputs - aliased (donated) +
temporaries, i.e. what the step needs while it runs, the frozen base or reference
included since they are its arguments), the bytes of trainable parameters and optimiser
state actually held, and ``alignax.estimate``'s per-device total for the same config.

Peer (unless ``--skip-peer``): tools/peers/tunix_dpo.py with ``--lora-rank R --lora-alpha
2R`` in the Tunix venv (``TUNIX_PYTHON``, default ``.venv-bench/bin/python``; ``make
bench-env``): Tunix 0.1.7's DPOTrainer on a qwix LoRA model of the same shape and batch
(the same seven projections), with its train step's memory analysis. ``--peer-grpo`` also
runs tools/peers/tunix_grpo.py the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/: bench_common
import bench_common as common  # noqa: E402

common.offline_environment()

import bench_dpo  # noqa: E402
import bench_grpo  # noqa: E402

VARIANTS = ("full", "lora", "int8", "nf4")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, steps=2, warmup=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--variants", default="full,lora",
                        help="comma-separated, from: full (full-parameter), lora, int8, nf4 (QLoRA bases)")
    parser.add_argument("--tasks", default="dpo,grpo", help="comma-separated: dpo, grpo")
    parser.add_argument("--dpo-pairs", type=int, default=bench_dpo.BATCH, help="preference pairs per DPO step")
    parser.add_argument("--dpo-seq", type=int, default=bench_dpo.SEQ, help="tokens per DPO sequence")
    parser.add_argument("--dpo-prompt", type=int, default=None, help="prompt tokens of a DPO sequence (seq // 2)")
    parser.add_argument("--grpo-prompts", type=int, default=bench_grpo.PROMPTS, help="prompts per GRPO step")
    parser.add_argument("--grpo-group", type=int, default=bench_grpo.GROUP, help="samples per prompt")
    parser.add_argument("--grpo-prompt-len", type=int, default=bench_grpo.PROMPT_LEN)
    parser.add_argument("--grpo-new-tokens", type=int, default=bench_grpo.NEW_TOKENS)
    parser.add_argument("--peer-weights", default="same", choices=("same", "random"),
                        help="random: the Tunix model is randomly initialised even with --weights real (its "
                             "safetensors loader makes the train step compile twice; timing does not depend on "
                             "the values)")
    parser.add_argument("--peer-grpo", action="store_true", help="also run Tunix's GRPO with a qwix LoRA model")
    args = parser.parse_args(argv)
    common.check_common_args(parser, args)
    if args.dpo_prompt is None:
        args.dpo_prompt = args.dpo_seq // 2
    args.variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    args.tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    unknown = [v for v in args.variants if v not in VARIANTS] + [t for t in args.tasks if t not in ("dpo", "grpo")]
    if unknown or not args.variants or not args.tasks:
        parser.error(f"--variants take {', '.join(VARIANTS)}, --tasks dpo, grpo; got {list(args.variants)}, "
                     f"{list(args.tasks)}")
    if not 0 < args.dpo_prompt < args.dpo_seq:
        parser.error(f"--dpo-prompt must be in [1, {args.dpo_seq - 1}]; got {args.dpo_prompt}")
    return args


@contextlib.contextmanager
def sizes(args):
    """bench_dpo's and bench_grpo's batch and sequence sizes set from ``args`` (their module
    constants, read by their configs, batches and figures), restored afterwards."""
    values = {bench_dpo: {"BATCH": args.dpo_pairs, "SEQ": args.dpo_seq, "PROMPT": args.dpo_prompt},
              bench_grpo: {"PROMPTS": args.grpo_prompts, "GROUP": args.grpo_group,
                           "PROMPT_LEN": args.grpo_prompt_len, "NEW_TOKENS": args.grpo_new_tokens}}
    saved = {module: {name: getattr(module, name) for name in names} for module, names in values.items()}
    for module, names in values.items():
        for name, value in names.items():
            setattr(module, name, value)
    try:
        yield
    finally:
        for module, names in saved.items():
            for name, value in names.items():
                setattr(module, name, value)


@contextlib.contextmanager
def lora_recipe(module, lora):
    """``module.train_config`` (bench_dpo's or bench_grpo's) with ``lora`` set."""
    original = module.train_config
    module.train_config = lambda args: dataclasses.replace(original(args), lora=lora)
    try:
        yield
    finally:
        module.train_config = original


class Recorder:
    """A jitted step compiled once, ahead of its first call, and run as that executable: its
    ``memory_analysis()`` comes without a second compile (the step donates its state, so the
    figures must be read from the executable that runs)."""

    def __init__(self, jitted):
        self.jitted, self.compiled, self.memory = jitted, None, None

    def __call__(self, *args):
        if self.compiled is None:
            self.compiled = self.jitted.lower(*args).compile()
            self.memory = common.compiled_memory(self.compiled)
        return self.compiled(*args)


def _nbytes(tree) -> int:
    import jax

    return int(sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes")))


def _estimate(config) -> float:
    from alignax import estimate

    model = estimate.model_config_for(config)
    return estimate.estimate(config, model=model, devices=1, mesh=(1, 1, 1)).total


def lora_for(variant: str, rank: int):
    from alignax.models.lora import LoraConfig

    if variant == "full":
        return None
    return LoraConfig(rank=rank, alpha=2.0 * rank, targets=("all",), quantize="none" if variant == "lora" else variant)


class Variant:
    """One column: a bench_dpo / bench_grpo bench built with a ``lora`` section (or none)."""

    def __init__(self, task: str, variant: str, args):
        module, bench_class = (bench_dpo, "AlignaxDPO") if task == "dpo" else (bench_grpo, "AlignaxGRPO")
        self.task, self.variant = task, variant
        self.lora = lora_for(variant, args.rank)
        bench_args = module.parse_args(["--model", args.model, "--weights", args.weights, "--steps", str(args.steps),
                                        "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--seed",
                                        str(args.seed), "--skip-peer"] + (["--scan-layers"] if args.scan_layers else []))
        with lora_recipe(module, self.lora):
            self.config = module.train_config(bench_args)
            self.bench = getattr(module, bench_class)(bench_args)
        # DPO: the bench's own loop calls the step, so it runs the executable it measured. GRPO:
        # the trainer's rollout step calls it, so its memory is read from a compile of the same
        # step after the timed steps (trainer.step.lower on the minibatch shapes, untimed).
        self.recorder = self.bench.step_fn = Recorder(self.bench.step_fn) if task == "dpo" else None

    def memory(self) -> dict:
        if self.recorder is not None:
            return self.recorder.memory
        trainer = self.bench.trainer
        return common.compiled_memory(
            trainer.step.lower(self.bench.state, self.bench.frozen, trainer.minibatch_shapes()).compile())

    def figures(self) -> dict:
        import jax

        summary = self.bench.summary()
        keys = ("loss_first_last",) if self.task == "dpo" else ("update_s", "update_times_s", "generation_s",
                                                                "logprob_s")
        state = self.bench.state
        return {"lora": None if self.lora is None else dataclasses.asdict(self.lora),
                **{key: summary[key] for key in ("step_time_s_median", "step_times_s", "step_time_s_min",
                                                 "compile_time_s", "build_time_s", *keys)},
                **self.memory(),
                "trainable_parameters": int(sum(x.size for x in jax.tree.leaves(state.params))),
                "trainable_bytes": _nbytes(state.params), "optimizer_state_bytes": _nbytes(state.opt_state),
                "estimate_total_bytes": _estimate(self.config)}


def peer_args(task: str, args) -> list[str]:
    lora = ["--lora-rank", str(args.rank), "--lora-alpha", str(2.0 * args.rank), "--memory"]
    if task == "dpo":
        return ["--batch", str(args.dpo_pairs), "--seq", str(args.dpo_seq), "--prompt-len", str(args.dpo_prompt),
                "--steps", str(args.steps), "--warmup", str(args.warmup), "--beta", str(bench_dpo.BETA),
                "--lr", str(bench_dpo.LR), *lora]
    return ["--batch", str(args.grpo_prompts), "--num-generations", str(args.grpo_group),
            "--seq", str(args.grpo_prompt_len + args.grpo_new_tokens), "--prompt-len", str(args.grpo_prompt_len),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--beta", str(bench_grpo.BETA),
            "--epsilon", str(bench_grpo.CLIP), "--kl-mode", "kl", "--loss-agg", "sequence-mean-token-mean",
            "--temperature", str(bench_grpo.TEMPERATURE), "--top-p", str(bench_grpo.TOP_P), "--lr",
            str(bench_grpo.LR), *lora]


def run_task(task: str, args) -> dict:
    """Every variant of ``task`` built and warmed up, then ``args.rounds`` alternating rounds."""
    columns = {variant: Variant(task, variant, args) for variant in args.variants}
    for column in columns.values():
        column.bench.warm()
    with_peer = not args.skip_peer and (task == "dpo" or args.peer_grpo)
    script = "tunix_dpo.py" if task == "dpo" else "tunix_grpo.py"
    peer_runs, failures = [], []
    for _ in range(args.rounds):
        for column in columns.values():
            column.bench.run(args.steps)
        if with_peer:
            model_args = common.peer_model_args(
                argparse.Namespace(**{**vars(args), "weights": "random"}) if args.peer_weights == "random" else args)
            peer, failure = common.run_peer(script, [*peer_args(task, args), *model_args],
                                            timeout=args.peer_timeout)
            peer_runs.append(peer) if peer is not None else failures.append(failure)
    result = {variant: column.figures() for variant, column in columns.items()}
    if "full" in result:
        result["ratios_over_full"] = {variant: {key: result[variant][key] / result["full"][key] for key in (
            "step_time_s_median", "peak_bytes", "optimizer_state_bytes", "estimate_total_bytes")}
            for variant in args.variants if variant != "full"}
    if with_peer:
        result["tunix_lora"] = common.pool_runs(peer_runs)
        result["tunix_failures"] = failures
    del columns
    gc.collect()
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    load_start = os.getloadavg()
    result = {"model": args.model, "weights": args.weights, "peer_weights": args.peer_weights, "scan_layers": args.scan_layers, "rank": args.rank,
              "alpha": 2.0 * args.rank, "targets": "all (q k v o gate up down)", "variants": list(args.variants),
              "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "dtype": "float32",
              "shapes": {"dpo": {"pairs": args.dpo_pairs, "seq": args.dpo_seq, "prompt_len": args.dpo_prompt,
                                 "response_len": args.dpo_seq - args.dpo_prompt, "packing": "shared prompt"},
                         "grpo": {"prompts": args.grpo_prompts, "num_generations": args.grpo_group,
                                  "prompt_len": args.grpo_prompt_len, "new_tokens": args.grpo_new_tokens}},
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "load_average_start": list(load_start)}
    with sizes(args):
        for task in args.tasks:
            result[task] = run_task(task, args)
            result[f"load_average_after_{task}"] = list(os.getloadavg())
            if args.out:  # what is measured so far survives a run stopped before the next task ends
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    result.update(common.run_context(load_start))
    result["notes"] = [
        "peak_bytes: the compiled train step (DPO: policy + live reference + AdamW; GRPO: the update), arguments "
        "+ outputs - donated + temporaries (compiled.memory_analysis()); the GRPO sampler is not in it.",
        "DPO with adapters: the step's frozen inputs are the base and the reference (the base with the "
        "adapters off), the same weight buffers; memory_analysis() counts an argument per parameter, so its "
        "argument bytes (and peak_bytes) hold the frozen base twice; resident, it is there once.",
        "estimate_total_bytes: alignax.estimate's per-device total for the same config (training state, frozen "
        "base/reference, activations and logits; its own assumptions, see alignax/estimate.py).",
        "load: the machine (2 cores) was shared with other processes; times are rough, memory figures are exact.",
        "rounds alternate the variants (and the Tunix run, a fresh process each round: its compile is outside "
        "its timed steps).",
    ]
    common.finish(result, args.out)


if __name__ == "__main__":
    main()
