"""The ``alignax`` entrypoint.

    alignax train  CONFIG.yaml [--overwrite] [--allow-changes] [--step N] [dotted.key=value ...]
    alignax eval   CONFIG.yaml [--step N] [dotted.key=value ...]
    alignax export CONFIG.yaml [--out DIR] [--step N] [--critic] [--dtype D] [dotted.key=value ...]
    alignax estimate CONFIG.yaml [--devices N] [--device h100|v5e|...] [--device-memory GB]
                     [--mesh d,f,t] [--model PRESET] [--assumptions standard|seed] [--json]

Every algorithm of ``alignax.trainers.api.ALGORITHMS`` supports all three.

Exit status:
  0    done.
  2    an error the user can fix — a config key, value or combination, an override, a
       missing or unreadable file, a bad data record, an output_dir that is in use or holds
       another run, a corrupt checkpoint, a reward function that fails: one line naming
       the key, file or spec (``--debug`` adds the traceback).
  1    the run stopped itself (non-finite or stalled updates, a non-finite reward, a
       checkpoint that could not be written): one line saying why; or an internal error,
       with its traceback.
  143  stopped by SIGTERM, 130 by SIGINT (Ctrl-C), after saving a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback

from alignax.config import ConfigError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alignax", description="Align language models with JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("train", "train from a recipe"), ("eval", "evaluate a run's checkpoint"),
                            ("export", "write a run's policy as Hugging Face safetensors")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config", help="recipe YAML (see configs/)")
        p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
        p.add_argument("--debug", action="store_true", help="show the traceback of any error")
        if name == "train":
            p.add_argument("--step", type=int, default=None,
                           help="resume from this checkpoint step (newer steps are removed)")
            p.add_argument("--overwrite", action="store_true",
                           help="replace the run already in output_dir instead of refusing to start")
            p.add_argument("--allow-changes", action="store_true",
                           help="resume although the config changes what is trained (changes are logged)")
        else:
            p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
        if name == "export":
            p.add_argument("--out", default=None, help="destination (default: <output_dir>/export)")
            p.add_argument("--critic", action="store_true",
                           help="PPO with a separate critic: also write the critic to <out>/critic")
            p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                           help="dtype of the written weights (default: as the optimiser keeps them, the float32 "
                                "master of a bfloat16 run)")
    p = sub.add_parser("estimate", help="per-device memory and step FLOPs of a recipe (alignax.estimate)")
    p.add_argument("config", help="recipe YAML")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    p.add_argument("--debug", action="store_true", help="show the traceback of any error")
    p.add_argument("--devices", type=int, default=None, help="devices (default: the product of mesh.shape, plus placement.submesh's)")
    p.add_argument("--device", default=None, help="device kind for memory and peak FLOPs: "
                   "h100, h200, a100, v4, v5e, v5p, v6e")
    p.add_argument("--device-memory", type=float, default=None, help="GB per device (overrides --device's)")
    p.add_argument("--mesh", default=None, help="data,fsdp,tensor (default: mesh.shape)")
    p.add_argument("--model", default=None, help="a model shape preset instead of model.name "
                   "(llama-2-7b, llama-2-70b, llama-3-8b, qwen2.5-7b)")
    p.add_argument("--assumptions", default="standard", choices=("standard", "seed"))
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation for the step time")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser


def _flag_overrides(args) -> list[str]:
    """The train flags as the config keys they set (recorded in the run's config.yaml)."""
    if args.command != "train":
        return []
    flags = []
    if args.step is not None:
        flags.append(f"checkpoint.resume_step={args.step}")
    if args.overwrite:
        flags.append("checkpoint.overwrite=true")
    if args.allow_changes:
        flags.append("checkpoint.allow_changes=true")
    return flags


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors a user fixes by changing a config, a file or a command (exit 2)."""
    from alignax.checkpoint import CorruptCheckpointError
    from alignax.data.sources import BadRecordError
    from alignax.rewards.composite import RewardFunctionError
    from alignax.trainers.engine.rundir import RunDirectoryError

    return (ConfigError, RunDirectoryError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
            PermissionError, BadRecordError, CorruptCheckpointError, RewardFunctionError)


def _stopped_errors() -> tuple[type[BaseException], ...]:
    """A run that stopped itself because training went wrong (exit 1, one line)."""
    from alignax.rewards.composite import NonFiniteRewardError
    from alignax.trainers.engine.loop import RunStoppedError

    return (RunStoppedError, NonFiniteRewardError)


def _run(args) -> int:
    from alignax.trainers import api

    config = api.load_config(args.config, [*args.overrides, *_flag_overrides(args)])
    if args.command == "train":
        result = api.train(config)
        if result.loop.stopped_by_signal:
            name = result.loop.signal_name or "SIGTERM"
            print(f"stopped by {name} at step {result.loop.last_step}; checkpoint saved", file=sys.stderr)
            return 130 if name == "SIGINT" else 143
        if result.eval_history:
            print(json.dumps({"eval": result.eval_history[-1]}))
        return 0
    if args.command == "estimate":
        return _estimate(args, config)
    if args.command == "eval":
        print(json.dumps(api.evaluate(config, step=args.step)))
        return 0
    print(api.export(config, args.out, step=args.step, critic=args.critic, dtype=args.dtype))
    return 0


def _estimate(args, config) -> int:
    from alignax import estimate as est

    mesh = tuple(int(x) for x in args.mesh.split(",")) if args.mesh else tuple(config.mesh.shape)
    if len(mesh) != 3:
        raise ConfigError(f"--mesh {args.mesh!r}: expected data,fsdp,tensor")
    devices = args.devices
    if devices is None:  # the mesh's, and a sub-mesh's set apart for frozen models
        if -1 in mesh:
            raise ConfigError(f"mesh {list(mesh)} has a -1 axis: give --devices")
        devices = mesh[0] * mesh[1] * mesh[2] + config.placement.devices_apart
    if args.device is not None and args.device not in est.PEAK_FLOPS:
        raise ConfigError(f"--device {args.device!r}: known: {', '.join(est.PEAK_FLOPS)}")
    memory = args.device_memory if args.device_memory is not None else est.DEVICE_MEMORY.get(args.device)
    try:
        model = est.model_config_for(config, args.model)
        result = est.estimate(config, model=model, devices=devices, mesh=mesh, device_memory_gb=memory,
                              assumptions=args.assumptions, mfu=args.mfu, peak_flops=est.PEAK_FLOPS.get(args.device))
    except ValueError as err:
        raise ConfigError(str(err)) from err
    print(json.dumps(result.to_dict()) if args.json else result.table())
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax._src.xla_bridge", "orbax"):  # per-save chatter, TPU probing
        logging.getLogger(noisy).setLevel(logging.WARNING)
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may follow the flags too (`train cfg.yaml --step 3 optim.learning_rate=1e-5`)
    unknown = [item for item in extra if item.startswith("-") or "=" not in item]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*args.overrides, *extra]
    try:
        return _run(args)
    except ConfigError as err:
        _report(args, "config error", err)
        return 2
    except _user_errors() as err:
        _report(args, "error", err)
        return 2
    except _stopped_errors() as err:
        _report(args, "run stopped", err)
        return 1


def _report(args, kind: str, err: BaseException) -> None:
    if args.debug:
        traceback.print_exception(err)
    hint = "" if args.debug else " (--debug shows the traceback)"
    print(f"alignax: {kind}: {err}{hint}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
