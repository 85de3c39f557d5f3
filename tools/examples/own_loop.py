"""Your own training loop over a recipe's trainer: the public seam, nothing of the engine.

    .venv/bin/python tools/examples/own_loop.py configs/tiny-dpo.yaml --steps 4
    .venv/bin/python tools/examples/own_loop.py configs/tiny-grpo.yaml --steps 2

``alignax train`` runs the same trainer with checkpoints, resume, writers and SIGTERM
handling; here the loop is yours: between two steps you may look at anything, change the
batch, or stop. Both wings offer the same seam: ``trainer.start()`` returns the fresh state
and ``frozen`` (what the step reads besides it: the reference or its log-probs), and
``trainer.step(state, frozen, batch)`` is the compiled step, ``-> (state, output)`` with
``output.metrics`` the step's figures. An offline step takes a batch of the recipe's data;
an online trainer's step takes a rollout's minibatch, so its loop is
``trainer.rollout_step`` (sample, score, update) over prompt batches.
"""

from __future__ import annotations

import argparse

import jax

from alignax.data import prepare_dataset
from alignax.trainers import api


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a recipe (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    parser.add_argument("--steps", type=int, default=4, help="steps to run")
    args = parser.parse_args(argv)

    config = api.load_config(args.config, args.overrides)
    trainer = api.build_trainer(config)
    state, frozen = trainer.start()
    batches = prepare_dataset(config.data, trainer.tokenizer).iterator("train")
    online = api.algorithm(config.algorithm).family == "online"
    for step in range(1, args.steps + 1):
        batch = next(batches)
        if online:  # sample, score and update: the online step of `alignax train`
            state, output = trainer.rollout_step(state, frozen, batch, batches)
        else:
            state, output = trainer.step(state, frozen, trainer.place_batch(batch))
        figures = jax.device_get(output.metrics)
        print(f"step {step}: " + "  ".join(f"{k}={float(v):.4g}" for k, v in sorted(figures.items())
                                         if k in ("loss", "grad_norm", "reward/total", "kl/ref_seq")))


if __name__ == "__main__":
    main()
