"""The ``alignax`` entrypoint.

    alignax train  CONFIG.yaml [dotted.key=value ...]
    alignax eval   CONFIG.yaml [--step N] [dotted.key=value ...]
    alignax export CONFIG.yaml [--out DIR] [--step N] [--critic] [dotted.key=value ...]

Every algorithm of ``alignax.trainers.api.ALGORITHMS`` supports all three.

A config error (unknown key, wrong type, bad choice) prints one line naming the key and
exits with status 2; a run stopped by SIGTERM exits 143 after its checkpoint is saved.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from alignax.config import ConfigError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alignax", description="Align language models with JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("train", "train from a recipe"), ("eval", "evaluate a run's checkpoint"),
                            ("export", "write a run's policy as Hugging Face safetensors")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config", help="recipe YAML (see configs/)")
        p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
        if name in ("eval", "export"):
            p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
        if name == "export":
            p.add_argument("--out", default=None, help="destination (default: <output_dir>/export)")
            p.add_argument("--critic", action="store_true",
                           help="PPO with a separate critic: also write the critic to <out>/critic")
    return parser


def _load(args):
    from alignax.trainers.api import load_config

    return load_config(args.config, args.overrides)


def _train(config) -> int:
    from alignax.trainers import api

    result = api.train(config)
    if result.loop.stopped_by_signal:
        print(f"stopped by SIGTERM at step {result.loop.last_step}; checkpoint saved", file=sys.stderr)
        return 143
    if result.eval_history:
        print(json.dumps({"eval": result.eval_history[-1]}))
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src.xla_bridge", "orbax"):  # per-save chatter, TPU probing
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args = _parser().parse_args(argv)
    try:
        config = _load(args)
    except (ConfigError, FileNotFoundError) as err:
        print(f"alignax: config error: {err}", file=sys.stderr)
        return 2
    if args.command == "train":
        return _train(config)
    from alignax.trainers import api

    if args.command == "eval":
        print(json.dumps(api.evaluate(config, step=args.step)))
        return 0
    print(api.export(config, args.out, step=args.step, critic=args.critic))
    return 0


if __name__ == "__main__":
    sys.exit(main())
