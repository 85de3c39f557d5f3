"""The ``alignax`` entrypoint.

    alignax train  CONFIG.yaml [--overwrite] [--allow-changes] [--step N] [dotted.key=value ...]
    alignax eval   CONFIG.yaml [--step N] [dotted.key=value ...]
    alignax eval   MODEL_OR_RECIPE --suite NAME[,NAME...] [--problems N] [--pass-k 1,4] [--num-samples N]
                   [--seed S] [--temperature T] [--max-new-tokens N] [--out FILE.json] [...]
    alignax export CONFIG.yaml [--out DIR] [--step N] [--critic] [--dtype D] [dotted.key=value ...]
    alignax estimate CONFIG.yaml [--devices N] [--device h100|v5e|...] [--device-memory GB]
                     [--mesh d,f,t] [--model PRESET] [--assumptions standard|seed] [--json]
    alignax generate MODEL_OR_RECIPE PROMPTS [--out FILE] [--step N] [--num-samples G] [--greedy]
                     [--temperature T] [--top-k K] [--top-p P] [--max-new-tokens N] [...]
    alignax judge JUDGE_MODEL FILE.jsonl [--mode pointwise|pairwise] [--out FILE] [--rubric TEXT]
                  [--verdicts yes,no] [--answers a,b]
    alignax label CONFIG.yaml SOLUTIONS --out FILE [--num-samples K] [--estimator hard|soft] [...]
    alignax best-of-n CONFIG.yaml PROMPTS --out FILE [--n N] [--checkpoint [--step S]] [--seed S]

Every algorithm of ``alignax.trainers.api.ALGORITHMS`` supports all three.

Exit status:
  0    done.
  2    an error the user can fix — a config key, value or combination, an override, a
       YAML syntax error, a mesh or placement the devices cannot hold, a missing or
       unreadable file (a model folder, a corrupt config.json or Parquet file), a bad data
       record, an output_dir that is in use or holds another run, a corrupt checkpoint, a
       reward function or environment that fails, a job whose processes cannot gather:
       one line naming the key, file or spec (``--debug`` or ``ALIGNAX_DEBUG=1`` adds the
       traceback). Every such refusal is an ``alignax.config.ConfigError``.
  1    the run stopped itself (non-finite or stalled updates, a non-finite reward, a
       checkpoint that could not be written): one line saying why; or an internal error,
       with its traceback.
  143  stopped by SIGTERM, 130 by SIGINT (Ctrl-C), after saving a checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import traceback

from alignax.config import ConfigError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alignax", description="Align language models with JAX.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("train", "train from a recipe"), ("eval", "evaluate a run's checkpoint"),
                            ("export", "write a run's policy as Hugging Face safetensors")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config", help="recipe YAML (see configs/)" if name != "eval" else
                       "recipe YAML (see configs/); with --suite, a model (registry name, Hugging Face folder or "
                       "hub id) or a recipe (its run's checkpoint)")
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
        if name == "eval":
            _suite_arguments(p)
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
    p.add_argument("--devices", type=int, default=None,
                   help="devices (default: the product of mesh.shape, plus placement.submesh's; with a -1 axis, "
                        "one host of --device's kind, else this machine's)")
    p.add_argument("--device", default=None, help="device kind for memory and peak FLOPs: "
                   "h100, h200, a100, v4, v5e, v5p, v6e")
    p.add_argument("--device-memory", type=float, default=None, help="GB per device (overrides --device's)")
    p.add_argument("--mesh", default=None, help="data,fsdp,tensor (default: mesh.shape)")
    p.add_argument("--model", default=None, help="a model shape preset instead of model.name "
                   "(llama-2-7b, llama-2-70b, llama-3-8b, qwen2.5-7b)")
    p.add_argument("--assumptions", default="standard", choices=("standard", "seed"))
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation for the step time")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    _generate_parser(sub)
    _judge_parser(sub)
    _label_parser(sub)
    _best_of_n_parser(sub)
    return parser


def _suite_arguments(p) -> None:
    from alignax.eval_suites import SUITES, SuiteOptions

    d = SuiteOptions()
    p.add_argument("--suite", default=None, metavar="NAME[,NAME...]",
                   help=f"benchmark suites ({', '.join(SUITES)}, or reasoning_gym:<task>[?option=value&...]): "
                        "greedy accuracy and pass@k on problems that ship with reasoning-gym (alignax.eval_suites)")
    p.add_argument("--problems", type=int, default=d.problems, help="problems a task (fixed by --seed)")
    p.add_argument("--pass-k", default="", metavar="K[,K...]", help="sampled pass@k for these k (default: greedy only)")
    p.add_argument("--num-samples", type=int, default=None, help="n samples a problem for pass@k (default: max k)")
    p.add_argument("--seed", type=int, default=d.seed, help="the problems' seed and the samples'")
    p.add_argument("--temperature", type=float, default=d.temperature, help="of the pass@k samples")
    p.add_argument("--max-new-tokens", type=int, default=None, help="response budget (default: each task's own)")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="problems a compiled call")
    p.add_argument("--system-prompt", default=d.system_prompt, help="a reasoning-gym system prompt name (default, "
                   "direct, simple, DeepSeekZero, chain_of_draft), literal text, or none")
    p.add_argument("--extraction", default=d.extraction, help="how the answer is read: tag (<answer>...</answer>) "
                   "or tag_or_last_number")
    p.add_argument("--out", default=None, help="the JSON report (default: eval-<suites>.json); the Markdown table "
                   "and the per-problem JSONL records are written beside it (.md, .records.jsonl)")


def _eval_suite(args) -> int:
    from alignax import eval_suites

    try:
        pass_k = tuple(int(k) for k in args.pass_k.split(",") if k.strip())
    except ValueError:
        raise ConfigError(f"--pass-k {args.pass_k!r}: expected comma-separated positive integers, e.g. 1,4") from None
    options = eval_suites.SuiteOptions(
        problems=args.problems, seed=args.seed, pass_k=pass_k, num_samples=args.num_samples,
        temperature=args.temperature, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        system_prompt=args.system_prompt, extraction=args.extraction)
    eval_suites.check_options(options)
    out = args.out or "eval-" + "-".join("".join(c if c.isalnum() or c in "_-" else "_" for c in name)
                                         for name in args.suite.split(",")) + ".json"
    report = eval_suites.run(args.config, args.suite, out, options, step=args.step, overrides=args.overrides)
    print(eval_suites.markdown_table(report), end="")
    print(eval_suites.output_paths(out)[0])
    return 0


def _best_of_n_parser(sub) -> None:
    p = sub.add_parser("best-of-n", help="sample N completions a prompt and keep the one the recipe's rewards "
                       "score highest (JSONL out)",
                       description="Best-of-N with a recipe's policy and rewards (alignax.generate.best_of_n_file).")
    p.add_argument("config", help="a recipe: the policy (model), rollout sampling settings and rewards (the selector)")
    p.add_argument("prompts", help="a prompt set as data.paths reads it (JSONL, Parquet, a generator spec, ...)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the recipe")
    p.add_argument("--out", required=True, help="output JSONL: one line per prompt")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--checkpoint", action="store_true", help="the run's trained policy (latest checkpoint) instead "
                   "of the recipe's model")
    p.add_argument("--step", type=int, default=None, help="with --checkpoint: this checkpoint step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--debug", action="store_true", help="show the traceback of any error")


def _best_of_n(args) -> int:
    from alignax import generate

    print(json.dumps(generate.best_of_n_file(args.config, args.prompts, args.out, n=args.n,
                                              overrides=args.overrides, checkpoint=args.checkpoint,
                                              step=args.step, seed=args.seed)))
    return 0


def _label_parser(sub) -> None:
    p = sub.add_parser("label", help="Math-Shepherd step labels for step-by-step solutions (PRM data)",
                       description="Label each step of each solution with the share of a recipe's policy's "
                                   "completions from it that its verifier accepts (alignax.math_shepherd).")
    p.add_argument("config", help="a recipe: the policy (model), rollout settings and rewards (the verifier)")
    p.add_argument("solutions", help="format-steps JSONL, or a generator spec (reasoning_gym:chain_sum?size=16)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the recipe")
    p.add_argument("--out", required=True, help="the labelled JSONL (format steps: process reward model data)")
    p.add_argument("--num-samples", type=int, default=8, help="completions per step prefix (K)")
    p.add_argument("--estimator", default="soft", help="hard (any completion correct) or soft (c/K)")
    p.add_argument("--batch-prefixes", type=int, default=8, help="step prefixes sampled together")
    p.add_argument("--limit", type=int, default=None, help="label only the first N solutions")
    p.add_argument("--delimiter", default="\n", help="the text between two steps of a completion")
    p.add_argument("--debug", action="store_true", help="show the traceback of any error")


def _label(args) -> int:
    from alignax import math_shepherd

    print(json.dumps(math_shepherd.label_file(
        args.config, args.solutions, args.out, overrides=args.overrides, num_samples=args.num_samples,
        estimator=args.estimator, batch_prefixes=args.batch_prefixes, limit=args.limit, delimiter=args.delimiter)))
    return 0


def _judge_parser(sub) -> None:
    p = sub.add_parser("judge", help="score a JSONL file with an LLM judge, pointwise or pairwise",
                       description="Score each record of a JSONL file with a judge model (alignax.judging): "
                                   "pointwise adds judge_logp/judge_p; pairwise writes preference records.")
    p.add_argument("model", metavar="JUDGE_MODEL", help="the judge: a registry name, Hugging Face folder or hub id")
    p.add_argument("file", metavar="FILE", help="JSONL: prompt + completion (pointwise), prompt + two answers or "
                   "alignax generate --num-samples 2 output (pairwise)")
    p.add_argument("--mode", choices=("pointwise", "pairwise"), default="pointwise")
    p.add_argument("--out", default=None, help="output JSONL (default: <file>.judged.jsonl)")
    p.add_argument("--rubric", default=None, help="the judge's instruction: {prompt} and {completion} (pointwise) "
                   "or {prompt}, {first}, {second} (pairwise)")
    p.add_argument("--verdicts", default=None, help="positive,negative verdict texts (default yes,no; pairwise A,B)")
    p.add_argument("--answers", default="a,b", help="pairwise: the two fields holding the answers")
    p.add_argument("--debug", action="store_true", help="show the traceback of any error")


def _judge(args) -> int:
    from alignax import judging

    verdicts = tuple(args.verdicts.split(",")) if args.verdicts else None
    answers = tuple(args.answers.split(","))
    if len(answers) != 2 or not all(answers):
        raise ConfigError(f"--answers {args.answers!r}: expected two field names, e.g. a,b")
    print(judging.run(args.model, args.file, args.out, mode=args.mode, rubric=args.rubric, verdicts=verdicts,
                      answers=answers))
    return 0


def _generate_parser(sub) -> None:
    from alignax.generate import GenerateOptions

    d = GenerateOptions()
    p = sub.add_parser("generate", help="sample completions of a model or a run for a prompt file (JSONL out)",
                       description="Sample completions for every prompt of a file; one JSON line per sample "
                                   "(alignax.generate).")
    p.add_argument("source", metavar="MODEL_OR_RECIPE",
                   help="a model (registry name, Hugging Face folder such as a run's export/, or hub id) or a "
                        "recipe YAML (its run's checkpoint)")
    p.add_argument("prompts", metavar="PROMPTS", help="a prompt set as data.paths reads it (JSONL, Parquet, a "
                   "folder, or a generator spec such as reasoning_gym:chain_sum?size=8)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides of the recipe")
    p.add_argument("--out", default=None, help="output JSONL (default: <prompts>.completions.jsonl)")
    p.add_argument("--step", type=int, default=None, help="a recipe's checkpoint step (default: latest)")
    p.add_argument("--num-samples", type=int, default=d.num_samples, help="samples per prompt")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (one sample is enough)")
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--top-k", type=int, default=d.top_k, help="0 keeps every token")
    p.add_argument("--top-p", type=float, default=d.top_p, help="1 keeps every token")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="prompts per compiled call")
    p.add_argument("--max-prompt-length", type=int, default=d.max_prompt_length,
                   help="prompt tokens (longer prompts keep their end; default: the model's context less "
                        "--max-new-tokens, at most 512)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--debug", action="store_true", help="show the traceback of any error")


def _generate(args) -> int:
    from alignax import generate

    options = generate.GenerateOptions(
        num_samples=args.num_samples, greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
        max_prompt_length=args.max_prompt_length, seed=args.seed)
    generate.check_options(options)
    print(generate.run(args.source, args.prompts, args.out, options, step=args.step, overrides=args.overrides))
    return 0


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


# Errors a user fixes by changing a config, a file or a command (exit 2): every refusal of
# user input is a ConfigError (a run directory, a data record, a checkpoint... subclass it);
# the OS's own errors for a path the user named are the rest.
_USER_ERRORS = (ConfigError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def _stopped_errors() -> tuple[type[BaseException], ...]:
    """A run that stopped itself because training went wrong (exit 1, one line)."""
    from alignax.rewards.composite import NonFiniteRewardError
    from alignax.trainers.engine.loop import RunStoppedError

    return (RunStoppedError, NonFiniteRewardError)


def _run(args) -> int:
    if args.command == "generate":
        return _generate(args)
    if args.command == "judge":
        return _judge(args)
    if args.command == "label":
        return _label(args)
    if args.command == "best-of-n":
        return _best_of_n(args)
    if args.command == "eval" and args.suite is not None:
        return _eval_suite(args)
    if args.command == "eval":
        _refuse_suite_flags(args)
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


def _refuse_suite_flags(args) -> None:
    """A recipe's own evaluation (no --suite) reads its ``evaluation:`` section; the suite flags would be ignored."""
    from alignax.eval_suites import SuiteOptions

    d = SuiteOptions()
    given = [flag for flag, value, default in (
        ("--problems", args.problems, d.problems), ("--pass-k", args.pass_k, ""),
        ("--num-samples", args.num_samples, None), ("--seed", args.seed, d.seed), ("--temperature", args.temperature, d.temperature),
        ("--max-new-tokens", args.max_new_tokens, None), ("--batch-size", args.batch_size, d.batch_size),
        ("--system-prompt", args.system_prompt, d.system_prompt), ("--extraction", args.extraction, d.extraction),
        ("--out", args.out, None)) if value != default]
    if given:
        raise ConfigError(f"{', '.join(given)} apply to --suite; a recipe's own evaluation reads its evaluation: "
                          "section (set evaluation.* overrides instead)")


# Devices of one host of each --device kind: what `estimate` assumes for a mesh with a -1
# axis when --devices is not given (an 8-GPU node; a TPU VM host).
_HOST_DEVICES = {"h100": 8, "h200": 8, "a100": 8, "v4": 4, "v5e": 8, "v5p": 4, "v6e": 8}


def _estimate_mesh(args, config) -> tuple[tuple[int, int, int], int]:
    """``(mesh, devices)`` of ``alignax estimate``'s flags, each flag checked in one line."""
    mesh: tuple[int, ...] = tuple(config.mesh.shape)
    if args.mesh is not None:
        try:
            mesh = tuple(int(x) for x in args.mesh.split(","))
        except ValueError:
            mesh = ()
        if len(mesh) != 3 or any(x < 1 and x != -1 for x in mesh):
            raise ConfigError(f"--mesh {args.mesh!r}: expected three sizes data,fsdp,tensor, each a positive "
                              "integer or one -1 (e.g. 1,8,1)")
    if args.devices is not None and args.devices < 1:
        raise ConfigError(f"--devices {args.devices}: expected a positive number of devices")
    devices = args.devices
    if devices is None and -1 not in mesh:  # the mesh's, and a sub-mesh's set apart for frozen models
        devices = mesh[0] * mesh[1] * mesh[2] + config.placement.devices_apart
    elif devices is None:  # a -1 axis takes what there is: one host of the named kind, or this machine
        import jax

        devices = _HOST_DEVICES[args.device] if args.device is not None else jax.device_count()
        where = f"one {args.device} host" if args.device is not None else "this machine"
        print(f"alignax: mesh {list(mesh)} has a -1 axis; assuming the {devices} devices of {where} "
              "(--devices N to choose)", file=sys.stderr)
    return mesh, devices


def _estimate(args, config) -> int:
    from alignax import estimate as est

    if args.device is not None and args.device not in est.PEAK_FLOPS:
        raise ConfigError(f"--device {args.device!r}: known: {', '.join(est.PEAK_FLOPS)}")
    if args.device_memory is not None and not args.device_memory > 0:
        raise ConfigError(f"--device-memory {args.device_memory:g}: expected a positive number of GB per device")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu {args.mfu:g}: expected a fraction in (0, 1]")
    mesh, devices = _estimate_mesh(args, config)
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
    takes_overrides = hasattr(args, "overrides")  # the recipe commands (judge reads no recipe)
    unknown = [item for item in extra if item.startswith("-") or "=" not in item or not takes_overrides]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = [*getattr(args, "overrides", []), *extra]
    args.debug = args.debug or os.environ.get("ALIGNAX_DEBUG", "") not in ("", "0")
    if not args.debug:
        logging.getLogger("absl").addFilter(_without_traceback)
    try:
        return _run(args)
    except _USER_ERRORS as err:
        _report(args, "config error" if type(err) is ConfigError else "error", err)
        return 2
    except _stopped_errors() as err:
        _report(args, "run stopped", err)
        return getattr(err, "exit_code", 1)  # a monitor alarm's stop: 3 (alignax.trainers.online.guard)


def _without_traceback(record: logging.LogRecord) -> bool:
    """Orbax logs a failed background save (a full disk) with a traceback from each thread
    it crosses; the run's own error says it in one line, so their records keep one line too."""
    record.exc_info, record.exc_text, record.stack_info = None, None, None
    return True


def _report(args, kind: str, err: BaseException) -> None:
    """One line on stderr (a multi-line message joined), or the traceback with ``--debug``."""
    if args.debug:
        traceback.print_exception(err)
    hint = "" if args.debug else " (--debug shows the traceback)"
    message = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
    print(f"alignax: {kind}: {message}{hint}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
