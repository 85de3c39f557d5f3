"""Wall time and learning curve of asynchronous rollouts (``rollout.async.max_staleness``
0, 1, 2) on the tiny GRPO recipe (configs/tiny-grpo.yaml: a random 1-layer model,
reasoning-gym chain_sum prompts) with the benchmarks' cheap rule reward
(``bench_common:even_char_share``, which the random model can learn; it never writes a
right chain_sum answer), with and without an injected host latency
(a reward function that sleeps ``--latency`` seconds per scored batch, standing in for a
slow verifier, judge or tool).

Every setting runs ``--steps`` timed rollouts after ``--warmup`` untimed ones (the first
compiles; the schedule reaches its steady staleness after ``k``), in
``--rounds`` alternating rounds (0, 1, 2, 0, 1, 2, ... so that a slow spell of the shared
machine falls on every setting). ``wall_s`` is the sum of the timed steps'
``perf/step_time_s``: the learner's thread is the critical path of either schedule (the
synchronous one does everything there; the asynchronous one waits there for samples), so
it is the run's wall time less start-up. ``learner_wait_share`` / ``sampler_wait_share``:
``async/learner_wait_s`` and ``async/sampler_wait_s`` over the same wall time (``null`` for
the synchronous loop, which has no second thread). The reward curve is ``reward/total``
per step, every step from the first.

Two layouts on ``--devices`` fake CPU devices: ``sliced`` (one data-parallel mesh over every
device; the sampler thread and the learner time-slice it; ``staleness_0`` is the synchronous
loop there, the baseline of every speed-up) and ``split`` (``rollout.async.devices``: half the
devices are the sampler's, the learner's mesh is the other half; ``max_staleness`` 1 and 2
only, 0 would leave the sampler's devices idle). Each round runs every setting once, in the
same order. ``load_average`` is read before and after the measurement (the machine is
shared). Prints one JSON object and writes it to ``--out``.

    HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/python tools/studies/async_overlap.py --steps 16 --rounds 2 \
        --out docs/results/async_overlap.json

``--model smollm2`` runs the demo's GRPO recipe instead (configs/demo-grpo.yaml from the base
SmolLM2-135M-Instruct, no DPO stage: 4 chain_sum prompts of two one-digit terms x 6 samples,
24 new tokens, the task's verifier plus the small format reward), with the sampler's
log-probs as the old ones (``rollout.old_logps: sampler``, every setting, staleness 0
included) and the verifier's curve (``reward/answer``) beside ``reward/total``. Its defaults:
one device (``--devices 1``: the machine's one real CPU device, as the demo runs), the
``sliced`` layout only, no latency runs.

    HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/python tools/studies/async_overlap.py --model smollm2 --steps 16 \
        --rounds 2 --out docs/results/async_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
SETTINGS = (("sliced", 0), ("sliced", 1), ("sliced", 2), ("split", 1), ("split", 2))  # (layout, max_staleness)
# Per recipe: the defaults of --devices, --layouts and --latency.
DEFAULTS = {"tiny": {"devices": 8, "layouts": ("sliced", "split"), "latency": 0.2},
            "smollm2": {"devices": 1, "layouts": ("sliced",), "latency": 0.0}}
# The demo's RL prompts (tools/examples/demo.py: chain_sum, two one-digit terms, seed 1).
DEMO_PROMPTS = "reasoning_gym:chain_sum?size=600&seed=1&min_terms=2&max_terms=2&min_digits=1&max_digits=1"


def no_reward_after(seconds: float):
    """A reward function worth 0 that takes ``seconds`` of host time per scored batch."""
    def reward(completions, references):
        del references
        time.sleep(seconds)
        return [0.0] * len(completions)
    return reward


LATENCY_S = float(os.environ.get("ASYNC_OVERLAP_LATENCY_S", "0"))
slow_zero_reward = no_reward_after(LATENCY_S)  # named by the recipe: async_overlap:slow_zero_reward


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=tuple(DEFAULTS), default="tiny",
                        help="tiny: configs/tiny-grpo.yaml, rule reward; smollm2: configs/demo-grpo.yaml, verifier")
    parser.add_argument("--steps", type=int, default=16, help="timed rollouts per setting and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rollouts first (>= 1 + the largest k)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--devices", type=int, default=None,
                        help="(fake) CPU devices (split: half the sampler's); default 8 (tiny), 1 (smollm2)")
    parser.add_argument("--layouts", nargs="+", choices=("sliced", "split"), default=None,
                        help="default: sliced split (tiny), sliced (smollm2)")
    parser.add_argument("--latency", type=float, default=None,
                        help="seconds of injected host latency per batch (0: no latency runs); default 0.2 (tiny), 0 (smollm2)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    for key, value in DEFAULTS[args.model].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.layouts = tuple(args.layouts)
    if "split" in args.layouts and (args.devices < 2 or args.devices % 2):
        parser.error(f"--layouts split needs an even --devices >= 2 (half the sampler's); --devices is {args.devices}")
    if "sliced" not in args.layouts:
        parser.error("--layouts needs sliced: its staleness 0 (the synchronous loop) is every speed-up's baseline")
    if args.rounds < 1 or args.steps < 1:
        parser.error(f"--rounds and --steps must be >= 1; got {args.rounds} and {args.steps}")
    return args


def settings_of(args) -> list[tuple[str, int]]:
    """The (layout, max_staleness) pairs a round runs, in order."""
    return [(layout, k) for layout, k in SETTINGS if layout in args.layouts]


def config_for(staleness: int, steps: int, devices: int, slow: bool, out: str, layout: str = "sliced",
               model: str = "tiny"):
    sys.path.insert(0, str(ROOT / "tools"))  # the reward's module: bench_common
    from alignax.trainers.api import load_config

    overrides = [f"output_dir={out}", f"train.total_steps={steps}", "train.log_every=1", "checkpoint.enabled=false",
                 "data.eval_fraction=0.0",
                 f"mesh.shape=[{devices if layout == 'sliced' else devices // 2},1,1]",
                 f"rollout.async.devices={0 if layout == 'sliced' else devices // 2}",
                 "logging.console=false", "logging.tensorboard=false",
                 f"rollout.async.max_staleness={staleness}", "rollout.old_logps=sampler"]
    slow_reward = {"async_overlap:slow_zero_reward": 1.0} if slow else {}
    if model == "smollm2":  # the demo's recipe and rewards (verifier + format), from the base model
        overrides += ["model.name=smollm2-135m-instruct", f"data.paths=['{DEMO_PROMPTS}']"]
        if slow:
            overrides.append("rewards.functions=" + json.dumps(slow_reward))
        return load_config(str(ROOT / "configs" / "demo-grpo.yaml"), overrides)
    overrides += ["data.batch_size=8", "data.paths=['reasoning_gym:chain_sum?size=400&seed=0']",
                  "rewards.verifier_weight=0.0", "rewards.format_weight=0.0",
                  "rewards.functions=" + json.dumps({"bench_common:even_char_share": 1.0, **slow_reward})]
    return load_config(str(ROOT / "configs" / "tiny-grpo.yaml"), overrides)


def one_run(staleness: int, args, slow: bool, layout: str = "sliced") -> dict:
    from alignax.trainers.api import train

    config = config_for(staleness, args.warmup + args.steps, args.devices, slow,
                        tempfile.mkdtemp(prefix="async-overlap-"), layout, args.model)
    load_start = os.getloadavg()
    every = train(config).history
    history = every[args.warmup:]
    wall = sum(h["perf/step_time_s"] for h in history)
    waits = {side: sum(h[f"async/{side}_wait_s"] for h in history) / wall if staleness else None
             for side in ("learner", "sampler")}
    return {"wall_s": wall, "learner_wait_share": waits["learner"], "sampler_wait_share": waits["sampler"],
            "staleness": [h.get("async/staleness", 0.0) for h in history],
            "reward_total": [h["reward/total"] for h in every],
            **({"reward_answer": [h["reward/answer"] for h in every]} if "reward/answer" in every[0] else {}),
            "load_average_start": load_start, "load_average_end": os.getloadavg()}


def _median(values):
    return None if None in values else statistics.median(values)


def curve_summary(rounds: list[dict], synchronous: list[dict]) -> dict:
    """Per reward curve (``reward_total``, and ``reward_answer`` where recorded): its mean over
    every step of every round, the largest gap at any step from the synchronous run's curve
    (the same round's), and the synchronous curve's standard deviation over its steps (the
    step-to-step noise the gap is read against)."""
    out = {}
    for key in ("reward_total", "reward_answer"):
        if key not in rounds[0]:
            continue
        out[f"{key}_mean"] = statistics.mean(x for r in rounds for x in r[key])
        out[f"{key}_max_gap_to_staleness_0"] = max(abs(a - b) for r, s in zip(rounds, synchronous)
                                                  for a, b in zip(r[key], s[key]))
        out[f"{key}_staleness_0_step_sd"] = statistics.median(statistics.stdev(s[key]) for s in synchronous)
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the slow reward's module: async_overlap
    runs: dict[str, list[dict]] = {}
    load_before = os.getloadavg()
    for slow in (False, True) if args.latency > 0 else (False,):  # --latency 0: without the latency runs
        for _ in range(args.rounds):
            for layout, staleness in settings_of(args):
                runs.setdefault(f"{'latency' if slow else 'no_latency'}/{layout}/staleness_{staleness}", []).append(
                    one_run(staleness, args, slow, layout))
                result = report(args, runs, load_before)  # written after every run: a stopped study keeps its runs
    print(json.dumps(result, indent=1))
    return result


def report(args, runs: dict[str, list[dict]], load_before) -> dict:
    """The JSON object of the runs so far (``rounds_done``: per setting), written to ``--out``."""
    summary = {}
    for name, rounds in runs.items():
        synchronous = runs[name.split("/", 1)[0] + "/sliced/staleness_0"]
        base = statistics.median(r["wall_s"] for r in synchronous)
        wall = statistics.median(r["wall_s"] for r in rounds)
        summary[name] = {"rounds_done": len(rounds), "wall_s_median": wall, "speedup_vs_staleness_0": base / wall,
                         "learner_wait_share": _median([r["learner_wait_share"] for r in rounds]),
                         "sampler_wait_share": _median([r["sampler_wait_share"] for r in rounds]),
                         **curve_summary(rounds, synchronous)}
    result = {"settings": {**vars(args), "timed_rollouts": args.steps, "cpu_count": os.cpu_count(),
                           "load_average_before": load_before, "load_average_after": os.getloadavg(),
                           "order": [f"{layout}/staleness_{k}" for layout, k in settings_of(args)]},
              "summary": summary, "runs": runs}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    _args = parse_args()
    os.environ["ASYNC_OVERLAP_LATENCY_S"] = str(_args.latency)  # read again when the reward's module is imported
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={_args.devices}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
