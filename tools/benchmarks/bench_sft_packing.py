"""SFT throughput with and without packing (``data.packing``), alternating rounds in one run.

    HF_HUB_OFFLINE=1 .venv/bin/python tools/benchmarks/bench_sft_packing.py --out docs/results/sft_packing.json
    HF_HUB_OFFLINE=1 .venv/bin/python tools/benchmarks/bench_sft_packing.py --model tiny --steps 3   # a smoke run

Both sides are ``alignax train``'s SFT trainer through the public seam
(``api.build_trainer`` -> ``trainer.start()`` -> the compiled ``trainer.step``) on the same
records: reasoning-gym ``chain_sum`` conversations (short: a question and an answer, under
100 tokens with SmolLM2's chat template), rows of ``--seq`` tokens, ``--batch`` rows a step.
Unpacked, a row holds one example and the rest is padding; packed, a row holds as many
examples as fit. The figure that matters is real (non-padding) tokens per second, and
trained (response) tokens per second; a step costs about the same either way (same
shapes), so packing's gain is the fill ratio. Rounds alternate (packed, unpacked, packed,
...) so that the machine's load falls on both. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/: bench_common
import bench_common as common  # noqa: E402

common.offline_environment()

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2-135m", "tiny"), default="smollm2-135m",
                        help="SmolLM2-135M-Instruct's weights, or a tiny random model with its tokenizer")
    parser.add_argument("--batch", type=int, default=4, help="rows a step")
    parser.add_argument("--seq", type=int, default=256, help="tokens a row")
    parser.add_argument("--steps", type=int, default=4, help="timed steps a round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each side, alternating")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (compilation)")
    parser.add_argument("--records", type=int, default=600)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    return parser.parse_args(argv)


def _config(args, packed: bool, out: str):
    from alignax.trainers.api import load_config

    # log-probs in chunks of 128 positions: a [rows, seq, 49152] float32 logits array is not held
    model = {"name": "smollm2-135m-instruct", "logprob_chunk_size": 128,
             **({"random_init": TINY} if args.model == "tiny" else {})}
    return load_config(data={
        "algorithm": "sft", "output_dir": out, "model": model,
        "data": {"paths": [f"reasoning_gym:chain_sum?size={args.records}&seed=0"], "format": "sft",
                 "max_length": args.seq, "max_prompt_length": args.seq // 2, "batch_size": args.batch,
                 "eval_fraction": 0.0, "packing": packed, "read_threads": 0},
        "optim": {"learning_rate": 1e-5, "schedule": "constant"},
        "train": {"total_steps": 10_000, "save_every": 0},
        "logging": {"console": False, "tensorboard": False}, "mesh": {"shape": [1, 1, 1]},
    })


class Side:
    """One side's trainer, state and batch stream; ``run(n)`` times ``n`` steps."""

    def __init__(self, args, packed: bool):
        import jax

        from alignax.trainers import api

        self.packed = packed
        self.config = _config(args, packed, tempfile.mkdtemp(prefix="bench-sft-packing-"))
        trainer = api.build_trainer(self.config)
        self.state, self.frozen = trainer.start()
        self.step, self.place = trainer.step, trainer.place_batch
        self.batches = trainer.data.iterator("train")
        self.examples_per_epoch = len(trainer.data.train_indices)
        self.steps_per_epoch = self.batches.steps_per_epoch
        self.times, self.real, self.trained, self.examples = [], [], [], []
        jax.block_until_ready(self.state)

    def run(self, n: int, *, timed: bool = True) -> None:
        import jax

        for _ in range(n):
            batch = next(self.batches)
            started = time.perf_counter()
            self.state, out = self.step(self.state, self.frozen, self.place(batch))
            jax.device_get(out.metrics)  # the step is done when its figures are on the host
            if timed:
                self.times.append(time.perf_counter() - started)
                self.real.append(int(batch["attention_mask"].sum()))
                self.trained.append(int(batch["response_mask"].sum()))
                self.examples.append(int(batch["examples"].sum()) if "examples" in batch else len(batch["tokens"]))

    def summary(self, args) -> dict:
        seconds = sum(self.times)
        return {
            "steps": len(self.times), "step_time_s_median": common.median(self.times),
            "real_tokens_per_s": sum(self.real) / seconds, "trained_tokens_per_s": sum(self.trained) / seconds,
            "examples_per_s": sum(self.examples) / seconds,
            "fill": sum(self.real) / (len(self.times) * args.batch * args.seq),
            "examples_per_row": sum(self.examples) / (len(self.times) * args.batch),
            "steps_per_epoch": self.steps_per_epoch,
        }


def main(argv=None) -> None:
    args = parse_args(argv)
    load_start = os.getloadavg()
    sides = {"packed": Side(args, True), "unpacked": Side(args, False)}
    for side in sides.values():
        side.run(args.warmup, timed=False)
    for _ in range(args.rounds):
        for side in sides.values():
            side.run(args.steps)
    packed, unpacked = (sides[k].summary(args) for k in ("packed", "unpacked"))
    import jax

    result = {
        "task": "sft packing",
        "model": args.model, "rows_per_step": args.batch, "seq": args.seq, "data": "reasoning_gym chain_sum sft",
        "rounds": args.rounds, "steps_per_round": args.steps, "order": "packed first, alternating",
        "packed": packed, "unpacked": unpacked,
        "speedup_real_tokens_per_s": packed["real_tokens_per_s"] / unpacked["real_tokens_per_s"],
        "speedup_examples_per_s": packed["examples_per_s"] / unpacked["examples_per_s"],
        "jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
        "load_average_start": list(load_start), "load_average": list(os.getloadavg()), "cpu_count": os.cpu_count(),
        "alignax_source": common.source_state(),
        "command": "HF_HUB_OFFLINE=1 .venv/bin/python tools/benchmarks/bench_sft_packing.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
    }
    common.finish(result, args.out)


if __name__ == "__main__":
    main()
