"""``alignax estimate`` against XLA: the estimator's per-device bytes beside the compiled
step's ``memory_analysis()`` (arguments + outputs - aliased + temporaries), per case.

    HF_HUB_OFFLINE=1 .venv/bin/python tools/estimate_vs_compiled.py --out docs/estimate_vs_compiled.json
    HF_HUB_OFFLINE=1 .venv/bin/python tools/estimate_vs_compiled.py --models tiny --devices 1 --remat none full

Cases: DPO, GRPO and PPO (``configs/tiny-<algorithm>.yaml``) on the tiny model of those
recipes and on SmolLM2-135M's shape, under each ``--remat`` policy (scanned layers, as the
large recipes run), on 1 device and on 8 fake CPU devices (``mesh.shape=[1, N, 1]``, all
FSDP); each device count is one subprocess (the count is fixed when jax is imported). The
trainer is built from abstract weights (:func:`abstract_weights`: nothing allocated, the
run's shardings), so a SmolLM2-shaped step on 8 fake devices compiles in about 1 GB. The
program compiled is the one the trainer runs: the offline trainer's ``step`` on a batch of
its data, the online trainer's ``update`` on a minibatch of the rollout's shapes (the
rollout itself, with its KV cache, is another program: the estimate's
``update_step_items``, without the KV cache, and online without the reference and reward
models, which the rollout's programs read). With ``--llama7b``, the Llama-2-7B-shaped DPO,
GRPO and PPO steps of tests/fsdp_compile_check.py (abstract weights, compiled and never
run; GRPO's with the reference's log-probs as inputs and PPO's with a separate critic, as
the online trainer's update runs them) on 8 and 64 fake devices, against the estimate of
the same shapes::

    HF_HUB_OFFLINE=1 .venv/bin/python tools/estimate_vs_compiled.py --devices --llama7b 8 64 --out runs/7b.json

With ``--submesh S`` (and one device count N), each case also with its reference on
devices of its own (``placement.reference: submesh``, ``placement.submesh=[1, S, 1]``;
training on ``[1, N - S, 1]``): two rows, the training devices' step against the
estimate's training items, and the reference's forward program on the sub-mesh (the
offline trainer's per-batch log-probs; the online trainer's reference pass over a rollout)
against the estimate's sub-mesh items::

    HF_HUB_OFFLINE=1 .venv/bin/python tools/estimate_vs_compiled.py --devices 8 --submesh 4 --algorithms dpo grpo

With ``--rollout``, each GRPO and PPO case also compiles the rollout's generation (the
trainer's sampler, ``alignax.sampling.generate``, on the prompts of one step) against the
estimate's ``rollout_items`` (the weights it samples with, the KV cache, the decode
buffers and, under FSDP, the weights it gathers)::

    HF_HUB_OFFLINE=1 .venv/bin/python tools/estimate_vs_compiled.py --devices 1 8 --algorithms grpo ppo --remat full --rollout

``--reestimate A.json B.json --out C.json`` puts the rows of earlier runs in one output
with the estimates recomputed (the compiled figures stay), each for the jaxlib its row was
compiled with.

Each row names the jaxlib that compiled it (``jaxlib``, also in ``spec``): XLA's buffers
move between releases, and the estimate counts the LM-head buffers as that release's XLA
writes them (``alignax.estimate.LM_HEAD_ARRAYS``). Rows from before the column were all
compiled by the pinned jaxlib 0.10.2. Run the tool from another venv for another jax::

    HF_HUB_OFFLINE=1 .venv-latest/bin/python tools/estimate_vs_compiled.py --models tiny --devices 1 8 --out x.json

Each row: the estimate's items, the compiled figures, and ``ratio`` = estimate /
compiled (within 0.85..1.15 is the issue's bar); the states (weights, gradients, moments,
master, frozen models) are compared with the arguments, the rest with the temporaries.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from bench_common import finish, run_on_fake_devices  # noqa: E402

ALGORITHMS = ("dpo", "grpo", "ppo")
SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
           "head_dim": 64, "intermediate_size": 1536}
STATES = ("weights", "gradients", "moments", "master", "reference", "reward models", "frozen base")


def case_overrides(algorithm: str, model: str, devices: int, remat: str, output_dir: str, submesh: int = 0
                   ) -> list[str]:
    """The dotted overrides of one case on ``configs/tiny-<algorithm>.yaml`` (``submesh``:
    that many of the ``devices`` hold the reference)."""
    out = [f"output_dir={output_dir}", f"mesh.shape=[1, {devices - submesh}, 1]", "model.scan_layers=true",
           f"model.remat={remat}", "data.batch_size=8", "train.total_steps=1"]
    if submesh:
        out += ["placement.reference=submesh", f"placement.submesh=[1, {submesh}, 1]"]
    if model == "smollm2-135m":
        out.append("model.random_init=" + json.dumps(SMOLLM2))
    return out


def compiled_figures(compiled) -> dict[str, int]:
    memory = compiled.memory_analysis()
    out = {k: int(getattr(memory, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    # what offload_dots moves to the host (pinned host memory), beside the device's figures
    out["host_temp"] = int(getattr(memory, "host_temp_size_in_bytes", 0) or 0)
    return out


def case_config(algorithm: str, model: str, devices: int, remat: str, output_dir: str = "runs/estimate-check",
                submesh: int = 0):
    from alignax.trainers import api

    return api.load_config(str(ROOT / "configs" / f"tiny-{algorithm}.yaml"),
                           case_overrides(algorithm, model, devices, remat, output_dir, submesh))


# what compiled the rows written before each row named its jaxlib (the pinned set of constraints.txt)
JAXLIB_BEFORE_THE_COLUMN = "0.10.2"


def estimate_items(spec: dict) -> dict[str, float]:
    """The estimator's per-device items for a row's ``spec`` (cheap: no compile): the
    update step's, or with ``spec["program"] == "submesh reference"`` the sub-mesh's; for
    the jaxlib that compiled the row."""
    from alignax.estimate import estimate, model_config_for

    submesh = spec.get("submesh", 0)
    if spec["model"] == "llama-2-7b":
        config = llama7b_config(spec["algorithm"], spec["devices"])
        model = model_config_for(config, "llama-2-7b")
    else:
        config = case_config(spec["algorithm"], spec["model"], spec["devices"], spec["remat"], submesh=submesh)
        model = model_config_for(config)
    result = estimate(config, model=model, devices=spec["devices"], mesh=(1, spec["devices"] - submesh, 1),
                      jaxlib=spec.get("jaxlib", JAXLIB_BEFORE_THE_COLUMN))
    if spec.get("program") == "rollout":
        return result.rollout_items()
    return result.submesh if spec.get("program") == "submesh reference" else result.update_step_items()


@contextlib.contextmanager
def abstract_weights():
    """Trainers built inside allocate no weights: each model, the train state (params and
    Adam moments) and the reference are ``jax.ShapeDtypeStruct`` with the shardings a run
    gives them, so a step compiles (never runs) at SmolLM2's shape on 8 fake devices
    without the ~4 GB the arrays would take. Patches ``create_model`` (what
    ``build_model`` calls for a ``random_init`` model) and the trainers' ``init_state_on_mesh``."""
    import jax
    from flax import nnx

    from alignax import models
    from alignax.parallel import abstract_tree, tree_shardings
    from alignax.trainers.engine.step import init_train_state
    from alignax.trainers.offline import trainer as offline
    from alignax.trainers.online import trainer as online

    def create_model(config, *, kind="causal_lm", seed=0, mesh=None):
        graphdef, state = nnx.split(nnx.eval_shape(lambda: models.MODEL_KINDS[kind](config, rngs=nnx.Rngs(seed))))
        return nnx.merge(graphdef, abstract_tree(state, tree_shardings(state, mesh)))

    def init_state_on_mesh(params, optimizer, *, seed, mesh, extra=()):
        state = jax.eval_shape(lambda p: init_train_state(p, optimizer, jax.random.key(seed), extra), params)
        shardings = tree_shardings(state, mesh)
        return abstract_tree(state, shardings), shardings

    patches = [(models, "create_model", create_model), (offline, "init_state_on_mesh", init_state_on_mesh),
               (online, "init_state_on_mesh", init_state_on_mesh)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    try:
        for owner, name, value in patches:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def measure_case(algorithm: str, model: str, devices: int, remat: str, submesh: int = 0,
                 rollout: bool = False) -> list[dict]:
    """The case's row: its step compiled; with ``submesh``, the reference on a sub-mesh of
    that many devices, and a second row for the reference's program there; with
    ``rollout`` (online algorithms), a row for the rollout's generation program."""
    import jax
    from flax import nnx

    from alignax.parallel import batch_sharding
    from alignax.trainers import api

    from alignax.estimate import installed_jaxlib

    spec = {"algorithm": algorithm, "model": model, "devices": devices, "remat": remat, "jaxlib": installed_jaxlib()}
    if submesh:
        spec["submesh"] = submesh
    with tempfile.TemporaryDirectory() as tmp, abstract_weights():
        config = case_config(algorithm, model, devices, remat, tmp, submesh)
        trainer = api.build_trainer(config)
        state, frozen = trainer.start()
        reference = None
        if algorithm == "dpo":
            reference = trainer.reference
            host_batch = next(trainer.data.iterator("train"))
            batch = trainer.placer(host_batch)
            if submesh:  # the sub-mesh's log-probs ride in the batch (shapes only: the weights are abstract)
                on_submesh = trainer.submesh_reference.placer(host_batch)
                reference_program = trainer.submesh_reference.forward.lower(reference, on_submesh).compile()
                batch["ref_logps"] = jax.tree.map(
                    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=batch_sharding(trainer.mesh, x.ndim)),
                    jax.eval_shape(trainer.submesh_reference.forward, reference, on_submesh))
            compiled = trainer.step.lower(state, frozen, batch).compile()
        else:
            if submesh:  # the rollout's reference pass: every row, on the sub-mesh
                rows = trainer.layout.rows
                width = trainer.actors.prompt_len + trainer.actors.max_new
                sequence = jax.ShapeDtypeStruct((rows, width), jax.numpy.int32,
                                                sharding=batch_sharding(trainer.actors.submesh, 2))
                reference_program = trainer.actors.forward.lower(trainer.actors.submesh_reference, sequence, sequence,
                                                                  sequence).compile()
            compiled = trainer.step.lower(state, frozen, trainer.minibatch_shapes()).compile()
        out = [row(spec, compiled_figures(compiled))]
        if submesh:
            out.append(row({**spec, "program": "submesh reference"}, compiled_figures(reference_program)))
        if rollout and algorithm != "dpo":  # the sampler's program on one step's prompts (float32: no copy)
            actors = trainer.actors
            sampler_state = nnx.merge_state(actors.whole_policy(state.params), actors.rest)
            prompts = jax.ShapeDtypeStruct((config.data.batch_size, actors.prompt_len), jax.numpy.int32,
                                           sharding=batch_sharding(actors.sampler_mesh, 2))
            with jax.set_mesh(actors.sampler_mesh):
                generation = actors.sampler._generate.lower(actors.sampler.graphdef, sampler_state, prompts, prompts,
                                                            jax.random.key(0), config=actors.sampler.config).compile()
            out.append(row({**spec, "program": "rollout"}, compiled_figures(generation)))
    return out


def row(spec: dict, figures: dict) -> dict:
    items = estimate_items(spec)
    name = f"{spec['algorithm']} {spec['model']} {spec['devices']} dev remat={spec['remat']}"
    if spec.get("submesh"):
        name += f" reference on {spec['submesh']} dev" + (": its program" if spec.get("program") else ": training step")
    if spec.get("program") == "rollout":
        name += ": rollout generation"
    jaxlib = spec.get("jaxlib", JAXLIB_BEFORE_THE_COLUMN)
    name += f" (jaxlib {jaxlib})"
    step_items = {k: float(v) for k, v in items.items() if v}
    states = sum(v for k, v in step_items.items() if any(s in k for s in STATES))
    total = sum(step_items.values())
    out = {"case": name, "jaxlib": jaxlib, "spec": spec, "estimate_bytes": total, "compiled_bytes": figures["total"],
           "ratio": round(total / figures["total"], 3),
           "states_estimate_bytes": states, "compiled_argument_bytes": figures["argument"],
           "rest_estimate_bytes": total - states, "compiled_temp_bytes": figures["temp"],
           "estimate_items": step_items, "compiled": figures}
    if spec["remat"] == "offload_dots" and not figures.get("host_temp"):
        # the estimate puts the offloaded projections in host memory, where a GPU or TPU
        # keeps them; the CPU backend has no host memory space apart and compiles the
        # same program as dots_with_no_batch_dims_saveable (the same bytes)
        out["note"] = ("nothing offloaded (host_temp 0): this backend keeps the saved projections in device "
                       "memory, which the estimate puts in host memory")
    return out


def worker(args) -> None:
    rows = []
    for model in args.models:
        for algorithm in args.algorithms:
            for remat in args.remat:
                for measured in measure_case(algorithm, model, args.worker, remat, args.submesh, args.rollout):
                    rows.append(measured)
                    # the whole row as it comes: a process killed later (out of memory) loses none
                    print(json.dumps(measured), file=sys.stderr, flush=True)
    print(json.dumps(rows))


def llama7b_config(program: str, devices: int):
    """The config of tests/fsdp_compile_check.py's program: Llama-2-7B, float32 params and
    reference, bfloat16 compute, AdamW, remat ``full``, scanned layers, one pair (DPO) or
    row (GRPO with the k3 KL to the reference's log-probs; PPO with a separate critic) of
    512 tokens (256 of response) per device, log-probs in chunks of 128."""
    from alignax.trainers.api import load_config

    common = [f"mesh.shape=[1, {devices}, 1]", "model.remat=full", "model.scan_layers=true",
              "model.logprob_chunk_size=128", "precision.compute_dtype=bfloat16"]
    if program == "dpo":
        return load_config(str(ROOT / "configs" / "dpo.yaml"), [
            *common, f"data.batch_size={devices}", "data.max_length=512", "data.max_prompt_length=256",
            "data.max_response_length=256", "train.grad_accum_steps=1"])
    online = [*common, "data.max_prompt_length=256", "rollout.max_new_tokens=256", "train.grad_accum_steps=1",
              "rewards.reward_models=[]"]
    if program == "grpo":  # groups of 2 rows, unpacked: one row per device, as the program has
        return load_config(str(ROOT / "configs" / "grpo.yaml"), [
            *online, f"data.batch_size={devices // 2}", "rollout.num_samples=2", 'rollout.pack_groups="off"',
            "grpo.minibatches=1", "grpo.kl_coef=0.04"])
    return load_config(str(ROOT / "configs" / "ppo.yaml"), [
        *online, f"data.batch_size={devices}", "rollout.num_samples=1", "ppo.minibatches=1"])


def llama7b(devices: int, program: str) -> dict:
    """tests/fsdp_compile_check.py's ``program`` compiled on ``devices`` fake devices (never
    run) against the estimate of :func:`llama7b_config`."""
    # the online trainer's update takes the reference's log-probs (the rollout scored them)
    flags = ["--ref-logps"] if program == "grpo" else []
    compiled = run_on_fake_devices(ROOT / "tests" / "fsdp_compile_check.py", "--program", program, *flags,
                                   devices=devices, timeout=3600)
    memory = compiled["memory"]
    from alignax.estimate import installed_jaxlib

    spec = {"algorithm": program, "model": "llama-2-7b", "devices": devices, "remat": "full",
            "jaxlib": installed_jaxlib()}
    return row(spec, {"argument": memory["argument"], "output": memory["output"], "alias": memory["alias"],
                "temp": memory["temp"], "total": memory["total"]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2-135m"], choices=("tiny", "smollm2-135m"))
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    parser.add_argument("--devices", nargs="*", type=int, default=[1, 8],
                        help="device counts of the tiny and SmolLM2-shaped cases (none: only --llama7b)")
    parser.add_argument("--remat", nargs="+", default=["none", "full"],
                        choices=("none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "offload_dots"))
    parser.add_argument("--llama7b", nargs="*", type=int, default=None, metavar="DEVICES",
                        help="also the compile-only Llama-2-7B steps of --algorithms on these device counts (8 64)")
    parser.add_argument("--submesh", type=int, default=0, metavar="S",
                        help="the reference on S devices of its own (placement.submesh [1, S, 1]), training on the rest")
    parser.add_argument("--rollout", action="store_true",
                        help="also the rollout's generation program of the GRPO and PPO cases")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--reestimate", nargs="+", metavar="JSON",
                        help="recompute the estimates of earlier outputs' rows (their compiled figures stay), "
                             "all of them in one output")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    if args.worker is not None:
        return worker(args)
    if args.reestimate:
        rows = [{**row(r["spec"], r["compiled"]), "command": r.get("command")} for path in args.reestimate
                for r in json.loads(Path(path).read_text())["rows"]]
        return report(rows, args.out)
    rows = []
    for devices in args.devices:
        env = {**os.environ, "JAX_PLATFORMS": "cpu",
               "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"}
        command = [sys.executable, __file__, "--worker", str(devices), "--models", *args.models,
                   "--algorithms", *args.algorithms, "--remat", *args.remat, "--submesh", str(args.submesh),
                   *(["--rollout"] if args.rollout else [])]
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True)
        rows.extend(json.loads(done.stdout.strip().splitlines()[-1]))
    for devices in args.llama7b or ():
        for program in args.algorithms:
            rows.append(llama7b(devices, program))
            print(json.dumps({k: rows[-1][k] for k in ("case", "ratio")}), file=sys.stderr, flush=True)
    python = os.path.relpath(sys.executable, ROOT)  # .venv/bin/python, or .venv-latest/... for another jax
    command = f"HF_HUB_OFFLINE=1 {python} tools/estimate_vs_compiled.py " + " ".join(sys.argv[1:])
    report([{**r, "command": command} for r in rows], args.out)


def report(rows: list[dict], out_path: str | None) -> None:
    """The rows, and how many are within the bar. A row with a ``note`` measured a program
    that is not the one the estimate describes (``offload_dots`` where the backend offloads
    nothing): it is listed apart, not counted either way."""
    comparable = [r for r in rows if "note" not in r]
    finish({"bar": "estimate within 15% of compiled (ratio 0.85..1.15)",
            "jaxlib": sorted({r["jaxlib"] for r in rows}),
            "within_15_percent": sum(0.85 <= r["ratio"] <= 1.15 for r in comparable), "cases": len(comparable),
            "outside": [r["case"] for r in comparable if not 0.85 <= r["ratio"] <= 1.15],
            "not_comparable_here": {r["case"]: r["note"] for r in rows if "note" in r}, "rows": rows},
           out_path)


if __name__ == "__main__":
    main()
