"""DPO step time: alignax's trainer vs Google Tunix's DPOTrainer, same shapes, same run.

    HF_HUB_OFFLINE=1 .venv/bin/python tools/benchmarks/bench_dpo.py --model tiny
    HF_HUB_OFFLINE=1 .venv/bin/python tools/benchmarks/bench_dpo.py --model smollm2-135m --steps 3 --out runs/bench/dpo.json

One step: 8 preference pairs x 128 tokens (prompt 64 + response 64, every token real,
random ids), sigmoid DPO loss (beta 0.1) on response log-probs summed per sequence,
AdamW (lr 1e-5, weight decay 1e-4 as optax.adamw's default, constant schedule),
float32. Each pair is one packed row (prompt once, then chosen, then rejected: 192 tokens
instead of 2 x 128; alignax.trainers.engine.packing), as the data pipeline's batches are;
``--unpacked`` runs chosen and rejected as two full rows like Tunix. The frozen reference
is live, so every step also runs its forward.

alignax side: what ``alignax train`` with ``algorithm: dpo`` and ``preference.reference: live``
runs, through the public seam: the trainer ``alignax.trainers.api.build_trainer`` builds
from a TrainConfig, ``trainer.start()`` (the fresh state and what the step reads besides
it, the reference; same donation and shardings as ``alignax train``) and the compiled
``trainer.step``. A step's time runs from placing its batch (``trainer.place_batch``) to
its metrics on the host, as the run loop takes it.

Tunix side: tools/peers/tunix_dpo.py in .venv-bench (reference forward in
``_prepare_inputs`` + the jitted train step, both blocked).

``--reference precomputed`` times alignax's other reference mode (log-probs computed in
one pass before training) against the same Tunix step, as an extra figure.

Gradient clipping is off on our side (``optim.max_grad_norm: null``) because Tunix's DPO
step has none. Prints one JSON object (see ``--help``); ``speedup`` = Tunix median step
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

BATCH, SEQ, PROMPT = 8, 128, 64
BETA, LR, WEIGHT_DECAY = 0.1, 1e-5, 1e-4


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(parser, steps=5, warmup=1)
    parser.add_argument("--reference", default="live", choices=("live", "precomputed"),
                        help="preference.reference: live (the parity setting: Tunix always runs its reference each step) "
                             "or precomputed (alignax's one pass before training; timed apart)")
    parser.add_argument("--unpacked", action="store_true",
                        help="leave prompt_length out of the batches, so chosen and rejected run as two rows "
                             "each holding the prompt (as Tunix does) instead of one packed row per pair")
    args = parser.parse_args(argv)
    common.check_common_args(parser, args)
    return args


def train_config(args):
    from alignax.data import DataConfig
    from alignax.trainers.config import MeshSection, PreferenceSection, TrainConfig, TrainSection
    from alignax.trainers.config import OptimConfig

    return TrainConfig(
        algorithm="dpo",
        output_dir="runs/bench-dpo",
        model=common.model_spec(args),
        # max_response_length as the recipes set it: the LM head scores the response window only.
        data=DataConfig(format="preference", max_length=SEQ, max_prompt_length=PROMPT,
                        max_response_length=SEQ - PROMPT, batch_size=BATCH),
        optim=OptimConfig(name="adamw", learning_rate=LR, schedule="constant", weight_decay=WEIGHT_DECAY,
                          max_grad_norm=None),
        train=TrainSection(total_steps=args.warmup + args.rounds * args.steps, seed=args.seed),
        preference=PreferenceSection(loss="dpo", variant="sigmoid", beta=BETA, reference=args.reference),
        mesh=MeshSection(shape=(1, 1, 1)),
    )


def make_batches(n: int, *, vocab: int, seed: int, packed: bool = True) -> list[dict]:
    """``n`` preference batches in the data pipeline's layout (right-padded, here full);
    ``packed=False`` drops ``prompt_length``, which turns shared-prompt packing off."""
    import numpy as np

    rng = np.random.default_rng(seed)
    response = SEQ - PROMPT
    positions = np.broadcast_to(np.arange(SEQ, dtype=np.int32), (BATCH, SEQ)).copy()
    ones = np.ones((BATCH, SEQ), np.int32)
    response_mask = np.concatenate([np.zeros((BATCH, PROMPT), np.int32), np.ones((BATCH, response), np.int32)], 1)
    batches = []
    for i in range(n):
        prompt = rng.integers(3, vocab, size=(BATCH, PROMPT), dtype=np.int32)
        batch = {"example_mask": np.ones((BATCH,), np.int32),
                 "record_index": np.arange(i * BATCH, (i + 1) * BATCH, dtype=np.int32)}
        if packed:
            batch["prompt_length"] = np.full((BATCH,), PROMPT, np.int32)
        for side in ("chosen", "rejected"):
            tokens = np.concatenate([prompt, rng.integers(3, vocab, size=(BATCH, response), dtype=np.int32)], 1)
            batch |= {f"{side}_tokens": tokens, f"{side}_positions": positions, f"{side}_attention_mask": ones,
                      f"{side}_response_mask": response_mask}
        batches.append(batch)
    return batches


class AlignaxDPO:
    """alignax's DPO steps through the trainer's seam; ``warm()`` then ``run(n)`` rounds."""

    def __init__(self, args):
        import jax

        from alignax.trainers import api

        self.args = args
        self.clock = common.CompileClock()
        config = train_config(args)
        t0 = time.perf_counter()
        # The trainer of `alignax train` (alignax.trainers.api), minus data files, checkpoints and writers.
        trainer = api.build_trainer(config, with_data=False)
        params = trainer.params
        total = args.warmup + args.rounds * args.steps
        batches = make_batches(total, vocab=int(common.SHAPES[args.model]["vocab_size"]), seed=args.seed + 1,
                               packed=not args.unpacked)
        self.precompute_s = None
        if args.reference == "precomputed":
            # start() would precompute over the run's data files; here the records are the
            # benchmark's batches: the trainer's one pass over them, timed on its own
            self.state, _ = trainer.start()
            t_pre = time.perf_counter()
            self.frozen = trainer.precompute_reference(trainer.reference, batches, num_records=total * BATCH)
            trainer.reference = None  # the table replaces it, as in training
            self.precompute_s = time.perf_counter() - t_pre
        else:
            self.state, self.frozen = trainer.start()  # the fresh state, and what the step reads besides it
        self.place_batch = trainer.place_batch
        self.step_fn = trainer.step
        jax.block_until_ready(self.state)
        self.build_s = time.perf_counter() - t0
        self.model = common.model_summary(args, params)
        self.batches = iter(batches)
        self.history = []  # each step's metrics and time, one entry per step
        self.compiles = []  # compile-clock deltas, one per step

    def _loop(self, n: int) -> None:
        import jax

        for _ in range(n):
            started, before = time.perf_counter(), self.clock.snapshot()
            self.state, out = self.step_fn(self.state, self.frozen, self.place_batch(next(self.batches)))
            metrics = jax.device_get(out.metrics)  # blocks: the step is done when its figures are on the host
            self.compiles.append(tuple(a - b for a, b in zip(self.clock.snapshot(), before)))
            self.history.append({**{k: float(v) for k, v in metrics.items()},
                                 "perf/step_time_s": time.perf_counter() - started})

    def warm(self) -> None:
        self._loop(self.args.warmup)

    def run(self, n: int) -> None:
        self._loop(n)

    def summary(self) -> dict:
        import jax

        history = self.history
        figures = common.timing_figures([h["perf/step_time_s"] for h in history], self.compiles,
                                        warmup=self.args.warmup, build_s=self.build_s)
        return {
            **figures,
            "reference": self.args.reference,
            "reference_precompute_time_s": self.precompute_s,
            "tokens_per_s": 2 * BATCH * SEQ / figures["step_time_s_median"],
            "loss_first_last": [history[0]["loss"], history[-1]["loss"]],
            "grad_norm_first": history[0]["grad_norm"],
            "devices": [str(d) for d in jax.devices()],
            "jax": jax.__version__,
            "what": "trainer.step of api.build_trainer's DPO trainer (the jitted train step of the DPO task's "
                    "loss_fn) after trainer.start(): per step place batch + policy fwd/bwd on 2B rows (+ reference "
                    "fwd when live) + AdamW, metrics pulled to the host",
        }


def main(argv=None) -> None:
    args = parse_args(argv)
    load_start = os.getloadavg()
    peer_args = ["--batch", str(BATCH), "--seq", str(SEQ), "--prompt-len", str(PROMPT), "--steps", str(args.steps),
                 "--warmup", str(args.warmup), "--beta", str(BETA), "--lr", str(LR)]
    bench = AlignaxDPO(args)
    peer, failures = common.alternate(args, bench, "tunix_dpo.py", peer_args)
    ours, model = bench.summary(), bench.model
    notes = [
        "alignax: optim.max_grad_norm=null (Tunix's DPO step clips nothing); weight_decay 1e-4 on matrices only "
        "(optax.adamw's default 1e-4 on every parameter on the Tunix side); constant learning rate on both.",
        "alignax: model.logprob_chunk_size null (default); data.max_response_length 64 (as configs/dpo.yaml "
        "sets it): the LM head runs on each row's 64-position response window; Tunix computes [2B, T, V] "
        "logits and slices the completion part.",
        "alignax's step is one jit (policy + reference + update), so no ref/train split is reported for it.",
        "alignax: chosen and rejected as two rows of 128 tokens (--unpacked), as Tunix runs them."
        if args.unpacked else
        "alignax: shared-prompt packing (the default for the data pipeline's preference batches): each pair is "
        "one row [prompt 64 | chosen 64 | rejected 64], 192 trunk tokens instead of 256; Tunix runs 2 rows of 128.",
    ]
    if args.reference == "precomputed":
        notes.append("preference.reference=precomputed: alignax's steps run no reference forward (one pass before "
                     "training, reference_precompute_time_s, compile included); Tunix still runs it every step.")
    if ours["compile_time_timed_steps_s"] > 0.5:
        notes.append(f"alignax compiled {ours['compile_time_timed_steps_s']:.2f}s during timed steps.")
    notes.extend(f"Tunix run failed: {failure}" for failure in failures)
    if peer is not None:
        notes.extend(common.shape_notes(model, peer))
    result = {
        "task": "dpo",
        "model": model,
        "shapes": {"pairs": BATCH, "seq": SEQ, "prompt_len": PROMPT, "response_len": SEQ - PROMPT,
                   "sequences_per_step": 2 * BATCH, "dtype": "float32"},
        "hyper": {"loss": "dpo sigmoid", "beta": BETA, "label_smoothing": 0.0,
                  "logps": "summed over response tokens", "reference": args.reference,
                  "packing": "unpacked" if args.unpacked else "shared prompt",
                  "optimizer": f"adamw lr {LR} constant, b1 0.9 b2 0.999 eps 1e-8, weight decay {WEIGHT_DECAY}",
                  "max_grad_norm": None, "grad_accum_steps": 1},
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "order": "tunix first" if args.peer_first else "alignax first",
        "alignax": ours,
        "tunix": peer,
        **common.speedups(ours, peer),
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
