"""Shared plumbing of the side-by-side trainer benchmarks (bench_dpo.py, bench_grpo.py).

Each benchmark times alignax's own trainer step in this process and then Google Tunix's
step in a subprocess (``.venv-bench``, see tools/peers/README.md) on the same model
shape, batch shapes, dtype and hyper-parameters, and prints one JSON object with both
sides and ``speedup = tunix median / alignax median``.

What lives here:
  * ``SHAPES``: the model shapes both sides build (HF ``config.json`` keys, the same
    values as the peer scripts' presets), and ``model_spec`` turning one into the
    ``ModelSpec`` of a TrainConfig (random init, or SmolLM2's real weights);
  * ``CompileClock``: JAX's own compile events (trace + lower + XLA compile), the same
    events the peer scripts count, so both sides' compile times mean the same thing;
  * ``run_peer``: the Tunix script as a subprocess, its one JSON line parsed;
  * ``shape_notes``: checks that the peer built the network we did;
  * ``even_char_share``: the cheap rule reward of the GRPO benchmark;
  * ``finish``: the result JSON on stdout (and in ``--out``);
  * ``fake_devices_env`` / ``run_on_fake_devices``: a child interpreter on N fake CPU
    devices (the count is fixed when jax is imported, so each count is its own process).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT / "tools" / "peers"
# The Tunix venv's interpreter (tools/peers/setup_tunix_env.sh); TUNIX_PYTHON names another one.
TUNIX_PYTHON = Path(os.environ.get("TUNIX_PYTHON") or ROOT / ".venv-bench" / "bin" / "python")
REGISTRY_MODEL = "smollm2-135m-instruct"

# HF config.json fields (LlamaConfig names): the network both sides build. Equal to the
# presets of tools/peers/_tunix_common.py, which the peer is told to use by name.
SHAPES = {
    "tiny": {
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 512,
        "vocab_size": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    },
    "smollm2-135m": {
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
    },
}
_COMPARED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "vocab_size", "tie_word_embeddings")


def add_common_args(parser: argparse.ArgumentParser, *, steps: int, warmup: int) -> None:
    parser.add_argument("--model", default="tiny", choices=tuple(SHAPES),
                        help="tiny: 2 layers, hidden 256, vocab 4096; smollm2-135m: SmolLM2-135M's shape")
    parser.add_argument("--weights", default="random", choices=("random", "real"),
                        help="real: SmolLM2-135M-Instruct's weights on both sides (alignax's converted cache "
                             "directory; Tunix loads the same safetensors); needs --model smollm2-135m")
    parser.add_argument("--steps", type=int, default=steps, help="timed steps per side and round")
    parser.add_argument("--rounds", type=int, default=1,
                        help="alternate the sides this many times (alignax, Tunix, alignax, Tunix, ...); the "
                             "figures pool every round's timed steps")
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps first (the first compiles)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scan-layers", action="store_true",
                        help="alignax: model.scan_layers (one layer compiled, scanned; faster compiles)")
    parser.add_argument("--skip-peer", action="store_true", help="time alignax only")
    parser.add_argument("--peer-first", action="store_true",
                        help="run Tunix before alignax (a check that the order, i.e. a change of machine load "
                             "during the run, does not decide the ratio)")
    parser.add_argument("--peer-timeout", type=float, default=3600.0, help="seconds before the Tunix run is killed")
    parser.add_argument("--out", default=None, help="also write the JSON object to this file")


def check_common_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error(f"--steps and --rounds must be >= 1, --warmup >= 0; got {args.steps}, {args.rounds}, "
                     f"{args.warmup}")
    if args.weights == "real" and args.model != "smollm2-135m":
        parser.error(f"--weights real loads SmolLM2-135M-Instruct; it needs --model smollm2-135m, not {args.model}")


def model_spec(args: argparse.Namespace):
    """``ModelSpec`` of the run's policy: the named shape, random or with SmolLM2's weights.

    Random init replaces fields of SmolLM2's config.json (its tokenizer stays: token ids
    of the tiny model are < 4096, which that tokenizer decodes like any others).
    """
    from alignax.trainers.config import ModelSpec

    if args.weights == "real":
        return ModelSpec(name=REGISTRY_MODEL, seed=args.seed, logprob_chunk_size=None, scan_layers=args.scan_layers)
    shape = dict(SHAPES[args.model])
    theta = shape.pop("rope_theta")
    shape["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return ModelSpec(name=REGISTRY_MODEL, random_init=shape, seed=args.seed, logprob_chunk_size=None,
                     scan_layers=args.scan_layers)


def model_summary(args: argparse.Namespace, params) -> dict:
    import jax

    return {"preset": args.model, "weights": args.weights, **SHAPES[args.model],
            "n_params": int(sum(x.size for x in jax.tree.leaves(params))), "dtype": "float32",
            "scan_layers": args.scan_layers}


def peer_model_args(args: argparse.Namespace) -> list[str]:
    """Model flags of a peer script: the same preset, or the same weights directory."""
    out = ["--model-config", args.model, "--seed", str(args.seed), "--dtype", "float32"]
    if args.weights == "real":
        from alignax.models import registry

        out += ["--weights-dir", str(registry.local_model_path(REGISTRY_MODEL))]
    return out


class CompileClock:
    """Seconds JAX spends compiling: jaxpr tracing, lowering to MLIR, XLA compilation.

    The same three monitoring events the peer scripts sum, so compile times compare.
    """

    EVENTS = (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    )

    def __init__(self):
        import jax

        self.total = 0.0
        self.backend = 0.0
        self.compiles = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, **_):
        if event in self.EVENTS:
            self.total += duration
            if event == self.EVENTS[2]:
                self.backend += duration
                self.compiles += 1

    def snapshot(self) -> tuple[float, float, int]:
        """``(all compile seconds, XLA backend seconds, XLA compiles)`` so far."""
        return self.total, self.backend, self.compiles


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def timing_figures(step_times: Sequence[float], compiles: Sequence[tuple[float, float, int]], *, warmup: int,
                   build_s: float) -> dict:
    """Step-time and compile figures of a side: ``step_times`` and ``compiles``
    (:meth:`CompileClock.snapshot` deltas) have one entry per step, warm-up steps first."""
    timed = list(step_times[warmup:])
    return {
        "step_time_s_median": median(timed),
        "step_times_s": timed,
        "step_time_s_min": min(timed),
        "first_step_time_s": step_times[0],
        "compile_time_s": sum(c[0] for c in compiles[:warmup]),
        "xla_compile_time_s": sum(c[1] for c in compiles[:warmup]),
        "xla_compiles_warmup": sum(c[2] for c in compiles[:warmup]),
        "compile_time_timed_steps_s": sum(c[0] for c in compiles[warmup:]),
        "build_time_s": build_s,
    }


def run_peer(script: str, args: Sequence[str], *, timeout: float) -> tuple[dict | None, str | None]:
    """``(result, None)`` from ``.venv-bench/bin/python tools/peers/<script> args``, or
    ``(None, why)`` when it cannot run or fails (its stderr tail says why)."""
    if not TUNIX_PYTHON.exists():
        return None, f"{TUNIX_PYTHON} is missing: run tools/peers/setup_tunix_env.sh once (or set TUNIX_PYTHON)"
    command = [str(TUNIX_PYTHON), str(PEERS / script), *args]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PYTHONPATH")}
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None, f"{' '.join(command)} ran past {timeout:.0f}s and was killed"
    wall = time.perf_counter() - start
    lines = [line for line in done.stdout.splitlines() if line.strip().startswith("{")]
    if done.returncode != 0 or not lines:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        return None, f"{' '.join(command)} exited {done.returncode} after {wall:.0f}s; stderr tail:\n{tail}"
    result = json.loads(lines[-1])
    result["command"] = " ".join(command)
    result["process_wall_time_s"] = wall
    return result, None


def shape_notes(ours: dict, peer: dict) -> list[str]:
    """Differences between the network we built and the one the peer reports."""
    peer_model = peer.get("model", {})
    diffs = {k: (ours.get(k), peer_model.get(k)) for k in _COMPARED if ours.get(k) != peer_model.get(k)}
    notes = []
    if diffs:
        notes.append(f"MODEL SHAPES DIFFER (alignax, tunix): {diffs}")
    if "n_params" in peer_model and peer_model["n_params"] != ours.get("n_params"):
        notes.append(f"parameter counts differ: alignax {ours.get('n_params')}, tunix {peer_model['n_params']}")
    return notes


def even_char_share(completions: Sequence[str], references) -> list[float]:
    """Cheap rule reward: the share of characters with an even code point.

    The text-side twin of the Tunix script's ``parity_reward`` (share of even token ids):
    alignax's reward functions receive decoded text, Tunix's (with its integer tokenizer)
    the ids written as text; both are a pass of host Python over 16 short strings.
    """
    del references
    return [sum(1 for ch in text if ord(ch) % 2 == 0) / max(len(text), 1) for text in completions]


def compiled_memory(compiled) -> dict:
    """XLA's memory analysis of a compiled step, with its peak: arguments + outputs -
    donated aliases + temporaries."""
    memory = compiled.memory_analysis()
    figures = {key: int(getattr(memory, key)) for key in (
        "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes")}
    figures["peak_bytes"] = (figures["argument_size_in_bytes"] + figures["output_size_in_bytes"]
                             - figures["alias_size_in_bytes"] + figures["temp_size_in_bytes"])
    return figures


def finish(result: dict, out: str | None) -> None:
    """Print the result as one JSON object; also write it to ``out``."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n", encoding="utf-8")


def speedups(ours: dict, peer: dict | None) -> dict:
    """``speedup`` (ratio of median step times) and ``speedup_min`` (of the fastest steps).

    Other processes on the machine only ever add time to a step, so the fastest step is
    the steadier figure when the load average moves during a run.
    """
    if peer is None:
        return {"speedup": None, "speedup_min": None}
    return {"speedup": float(peer["step_time_s_median"]) / float(ours["step_time_s_median"]),
            "speedup_min": min(peer["step_times_s"]) / min(ours["step_times_s"])}


def alternate(args, ours, peer_script: str, peer_args: Sequence[str]) -> tuple[dict | None, list[str]]:
    """Time both sides in ``args.rounds`` alternating rounds; ``(pooled peer result, failures)``.

    ``ours`` has ``warm()`` (build, compile, warmup steps) and ``run(n)`` (n more timed
    steps, state carried over). A round is ``ours.run(args.steps)`` then one Tunix run of
    ``args.warmup + args.steps`` steps (the other way round with ``--peer-first``), so a
    change of machine load during the benchmark falls on both sides.
    """
    runs, failures = [], []
    ours.warm()
    for _ in range(args.rounds):
        for side in (("peer", "ours") if args.peer_first else ("ours", "peer")):
            if side == "ours":
                ours.run(args.steps)
            elif not args.skip_peer:
                peer, failure = run_peer(peer_script, [*peer_args, *peer_model_args(args)], timeout=args.peer_timeout)
                if peer is not None:
                    runs.append(peer)
                else:
                    failures.append(failure)
    return pool_runs(runs), failures


def pool_runs(runs: Sequence[dict]) -> dict | None:
    """One peer result from several runs: per-step lists joined, medians over the joined
    lists (or, for a figure reported only as a median, the median of the runs' medians)."""
    if not runs:
        return None
    if len(runs) == 1:
        return dict(runs[0])
    pooled = dict(runs[0])
    for key, value in runs[0].items():
        if key.endswith("_times_s") and isinstance(value, list):
            pooled[key] = [x for run in runs for x in run[key]]
    for key in runs[0]:
        if key.endswith("_time_s_median"):
            joined = pooled.get(key.replace("_time_s_median", "_times_s"))
            pooled[key] = median(joined) if isinstance(joined, list) else median([run[key] for run in runs])
    pooled["runs"] = [{k: run.get(k) for k in ("step_times_s", "compile_time_s", "process_wall_time_s")}
                      for run in runs]
    return pooled


def run_context(load_start) -> dict:
    """Where and on what a figure was measured: devices, jax, machine load (at the start and
    now), CPU count and the source commit."""
    import jax

    return {"devices": [str(d) for d in jax.devices()], "jax": jax.__version__,
            "load_average_start": list(load_start), "load_average": list(os.getloadavg()),
            "cpu_count": os.cpu_count(), "alignax_source": source_state()}


def source_state() -> dict:
    """The commit measured and any uncommitted changes under alignax/ (figures depend on them)."""
    def git(*argv):
        try:
            return subprocess.run(["git", *argv], capture_output=True, text=True, cwd=ROOT, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    changed = git("status", "--porcelain", "--", "alignax")
    return {"commit": git("rev-parse", "HEAD").strip() or None,
            "uncommitted_alignax_files": [line[3:] for line in changed.splitlines()]}


def fake_devices_env(devices: int) -> dict:
    """This process's environment for a child on ``devices`` fake CPU devices (other XLA
    flags kept), with the repository importable."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}",
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def run_on_fake_devices(script: Path, *args: str, devices: int, timeout: float) -> dict:
    """The last line of ``python script args`` on ``devices`` fake CPU devices, a JSON object;
    a failed run is an error carrying the end of its output."""
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          env=fake_devices_env(devices), timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{script.name} {' '.join(args)} on {devices} devices failed (exit {done.returncode}):\n"
                           f"{done.stdout[-2000:]}{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def offline_environment() -> None:
    """No hub access; quiet TensorFlow-style logs. Call before importing jax/alignax."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    if str(Path(__file__).resolve().parent) not in sys.path:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
