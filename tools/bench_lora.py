"""LoRA vs full-parameter training, side by side in one run: DPO and GRPO step time, compiled
peak memory of the step, and the estimator's figure.

    HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_lora.py --model tiny
    HF_HUB_OFFLINE=1 .venv/bin/python tools/bench_lora.py --model smollm2-135m --steps 2 --out runs/bench/lora.json

The steps are those of tools/bench_dpo.py (8 preference pairs x 128 tokens, live reference)
and tools/bench_grpo.py (8 prompts x 2 samples, 64 + 64 tokens, KL to the reference in
the loss), each run twice: full-parameter, and with ``lora: {rank: R, alpha: 2R, targets:
[all]}`` (the seven projections of every layer; default R = 16). Float32, one device.

Per run: the step-time median of the timed steps (DPO: the trainer loop's
``perf/step_time_s``; GRPO: the rollout step's wall time and its update part), the
compiled train step's memory (``compiled.memory_analysis()``: arguments + outputs -
aliased (donated) + temporaries, i.e. what the step needs while it runs, the frozen base or
reference included since they are its arguments), the bytes of trainable parameters and
optimiser state actually held, and ``alignax.estimate``'s per-device total for the same
config. No Tunix column: Tunix 0.1.7's LoRA path goes through qwix, which is not installed
in this environment (there is no Tunix environment on this machine at all: tools/peers' ``.venv-bench`` is absent),
so it was not run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as common  # noqa: E402

common.offline_environment()

import bench_dpo  # noqa: E402
import bench_grpo  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=tuple(common.SHAPES))
    parser.add_argument("--steps", type=int, default=2, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (the compiles)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tasks", default="dpo,grpo", help="comma-separated: dpo, grpo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the JSON object to this file")
    return parser.parse_args(argv)


@contextlib.contextmanager
def lora_recipe(module, lora):
    """``module.train_config`` (bench_dpo's or bench_grpo's) with ``lora`` set."""
    original = module.train_config
    module.train_config = lambda args: dataclasses.replace(original(args), lora=lora)
    try:
        yield
    finally:
        module.train_config = original


def _abstract(tree):
    import jax

    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))
                        if hasattr(x, "shape") else x, tree)


class Recorder:
    """Wraps a jitted step; keeps the abstract arguments of its first call (the step donates
    its state, so they are taken before it runs) to compile it again for memory_analysis()."""

    def __init__(self, jitted):
        self.jitted, self.args = jitted, None

    def __call__(self, *args):
        if self.args is None:
            self.args = _abstract(args)
        return self.jitted(*args)

    def memory(self) -> dict:
        stats = self.jitted.lower(*self.args).compile().memory_analysis()
        peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
                + stats.temp_size_in_bytes)
        return {"compiled_peak_bytes": int(peak), "argument_bytes": int(stats.argument_size_in_bytes),
                "temp_bytes": int(stats.temp_size_in_bytes), "alias_bytes": int(stats.alias_size_in_bytes)}


def _nbytes(tree) -> int:
    import jax

    return int(sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes")))


def _estimate(config, args) -> float:
    from alignax import estimate

    model = estimate.model_config_for(config)  # SmolLM2's config.json with the preset's shape
    return estimate.estimate(config, model=model, devices=1, mesh=(1, 1, 1)).total


def _build(module, bench_class, args, lora):
    """The bench of ``module`` (bench_dpo / bench_grpo) with ``lora`` set, and its config."""
    bench_args = module.parse_args(["--model", args.model, "--steps", str(args.steps), "--warmup",
                                    str(args.warmup), "--seed", str(args.seed), "--skip-peer"])
    with lora_recipe(module, lora):
        return getattr(module, bench_class)(bench_args), module.train_config(bench_args)


def run_dpo(args, lora) -> dict:
    bench, config = _build(bench_dpo, "AlignaxDPO", args, lora)
    bench.step_fn = Recorder(bench.step_fn)
    return _measure(bench, bench.step_fn, config, args, keys=("loss_first_last",))


def run_grpo(args, lora) -> dict:
    bench, config = _build(bench_grpo, "AlignaxGRPO", args, lora)
    bench.trainer.update = Recorder(bench.trainer.update)
    return _measure(bench, bench.trainer.update, config, args, keys=("update_s", "generation_s", "logprob_s"))


def _measure(bench, recorder: Recorder, config, args, *, keys) -> dict:
    """Warm up, time ``args.steps`` steps, then the step's compiled memory and state bytes."""
    import jax

    bench.warm()
    bench.run(args.steps)
    summary = bench.summary()
    return {"step_time_s_median": summary["step_time_s_median"], "step_times_s": summary["step_times_s"],
            **{key: summary[key] for key in keys}, **recorder.memory(),
            "trainable_parameters": int(sum(x.size for x in jax.tree.leaves(bench.state.params))),
            "trainable_bytes": _nbytes(bench.state.params), "optimizer_state_bytes": _nbytes(bench.state.opt_state),
            "estimate_total_bytes": _estimate(config, args)}


def main(argv=None) -> None:
    import jax

    from alignax.models.lora import LoraConfig

    args = parse_args(argv)
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank, targets=("all",))
    load_start = os.getloadavg()
    result = {"model": args.model, "lora": dataclasses.asdict(lora), "steps": args.steps, "warmup": args.warmup}
    runners = {"dpo": run_dpo, "grpo": run_grpo}
    for task in args.tasks.split(","):
        full, adapted = runners[task](args, None), runners[task](args, lora)
        result[task] = {"full": full, "lora": adapted, "ratios_lora_over_full": {
            key: adapted[key] / full[key] for key in ("step_time_s_median", "compiled_peak_bytes",
                                                      "optimizer_state_bytes", "estimate_total_bytes")}}
    result.update(devices=[str(d) for d in jax.devices()], jax=jax.__version__, load_average_start=list(load_start),
                  load_average=list(os.getloadavg()), cpu_count=os.cpu_count(), alignax_source=common.source_state(),
                  notes=["compiled_peak_bytes: the jitted train step (DPO: policy + live reference + AdamW; GRPO: the "
                         "update), arguments + outputs - donated + temporaries; the sampler is not in it.",
                         "Tunix's LoRA (qwix) was not run: no Tunix/qwix environment (.venv-bench) on this machine."])
    common.finish(result, args.out)


if __name__ == "__main__":
    main()
