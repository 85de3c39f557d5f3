"""Compile (never run) a Llama-2-7B-shaped step on fake CPU devices; print one JSON line of
per-device memory and collectives, as XLA planned them.

Run in a subprocess by tests/test_fsdp_compile.py and tools/studies/fsdp_memory.py: the device
count is fixed when jax is imported, so each count is its own process::

    XLA_FLAGS=--xla_force_host_platform_device_count=64 JAX_PLATFORMS=cpu \
        python tests/fsdp_compile_check.py --program dpo [--no-constraints]

Programs (all on a mesh with every device on ``fsdp``; parameters, gradients and Adam
state abstract, with the shardings the logical-axis rules give them):

- ``dpo``: the train step the offline trainer jits (``make_train_step`` with the DPO
  task's loss, live reference, AdamW with clipping), one preference pair per device (one
  packed row of ``--seq`` + ``--response`` tokens), remat on, scanned layers;
- ``grpo``: the same step with a GRPO policy-gradient loss (``response_forward`` +
  ``ppo_policy_loss`` with the k3 KL to a live reference), ``--rows-per-device`` rows
  (``--pack-groups``: each group of ``--group`` rows as one packed row, as the online
  trainer does when packing pays);
  (``--ref-logps``: the reference's log-probs come with the batch, as the online trainer's
  update takes them, and no reference is scored in the step);
- ``ppo``: the online trainer's PPO update with a separate critic (``ppo.critic:
  separate``, the KL in the reward): policy and critic trained together, the clipped
  policy loss + 0.5 x the clipped value loss, ``--rows-per-device`` rows;
- ``rollout``: the sampler's ``generate`` (prefill, ``jnp.repeat`` of the prompt KV
  cache over ``--group`` samples, the decode loop), one prompt per device.

``--decode-meshes 1,1,2 1,1,8 1,8,1:train`` also compiles the sampler's decode step (what
runs once per generated token, :func:`alignax.sampling.sampler.decode_step`) for
``--decode-rows`` rows and a cache of ``--seq - 1`` slots on each mesh, over its first
devices: with the weights the online trainer decodes from when ``rollout.mesh`` is set
(``compute_copy``: kernels in ``--dtype``, laid out by the rules for that mesh), or with
``:train`` the training parameters as they lie (``--param-dtype``). Their figures are
the JSON's ``decode`` list, one entry per mesh. ``--program decode`` compiles only those
(tools/studies/fsdp_memory.py ``--sampler``).

Memory is ``compiled.memory_analysis()`` of the per-device program: arguments + outputs
- aliased (donated) + temporaries. Collectives are read from ``compiled.as_text()``; a
collective inside the scan body counts once (it runs once per layer). For each kind the
JSON gives the count and the summed bytes of its operands and of its results (an
all-gather's result is the gathered, full-size array).

``--no-constraints`` traces with :func:`alignax.parallel.activation_constraints` off: no
activation sharding constraint in the decoder or the sampler, as the decoder was before
issue 12 (the sampler's group repeat stays the broadcast that replaced its gather).
"""

from __future__ import annotations

import os

# LLVM's optimisation of the generated CPU code halves the compile time and changes
# nothing measured here (HLO passes, buffer assignment and collectives are the same).
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from alignax import models  # noqa: E402
from alignax.data import DataConfig  # noqa: E402
from alignax.losses import ppo_policy_loss, value_loss  # noqa: E402
from alignax.parallel import (  # noqa: E402
    abstract_tree, activation_constraints, batch_sharding, make_mesh, tree_shardings)
from alignax.models.cache import cache_shardings, init_cache  # noqa: E402
from alignax.sampling import SamplingConfig, generate  # noqa: E402
from alignax.sampling.sampler import decode_step, new_loop_state  # noqa: E402
from alignax.trainers.config import ModelSpec, PreferenceSection, TrainConfig  # noqa: E402
from alignax.trainers.engine.optim import OptimConfig, build_optimizer  # noqa: E402
from alignax.trainers.engine.precision import compute_copy  # noqa: E402
from alignax.trainers.engine.step import init_train_state, make_train_step  # noqa: E402
from alignax.trainers.offline.preference import make_task  # noqa: E402
from alignax.trainers.online.rollout import response_forward  # noqa: E402

LLAMA2_7B = dict(model_type="llama", vocab_size=32000, hidden_size=4096, num_heads=32, num_kv_heads=32,
                 head_dim=128, intermediate_size=11008, norm_eps=1e-5, max_position_embeddings=4096)
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
GB = 1e9


def batch_arrays(mesh, fields: dict[str, tuple[tuple[int, ...], object]]):
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(mesh, len(shape)))
            for k, (shape, dtype) in fields.items()}


def _bytes(types: str) -> int:
    """Bytes of every array type in an HLO type string (``bf16[4,8]{1,0}`` or a tuple)."""
    total = 0
    for dtype, dims in re.findall(r"\b(pred|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64)\[([0-9,]*)\]", types):
        size = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8}[dtype]
        total += size * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return total


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+(?P<op>[a-z][a-z\-]*)\((?P<operands>[^)]*)\)")


def collectives(hlo: str) -> dict[str, dict[str, int]]:
    """``{kind: {count, operand_bytes, result_bytes, largest_result_bytes}}`` over the
    compiled HLO (async ``*-start`` ops count as their kind; ``*-done`` are skipped).
    Operands are printed by name only, so their types are looked up by name."""
    instructions = [m for m in map(_INSTRUCTION.match, hlo.splitlines()) if m]
    types = {m.group("name"): m.group("type") for m in instructions}
    out = {k: {"count": 0, "operand_bytes": 0, "result_bytes": 0, "largest_result_bytes": 0} for k in COLLECTIVES}
    for m in instructions:
        op = m.group("op").removesuffix("-start")
        if op not in out:
            continue
        operands = re.findall(r"%([\w.\-]+)", m.group("operands"))
        operand_bytes = sum(_bytes(types.get(name, "")) for name in operands)
        result_bytes = _bytes(m.group("type"))
        if m.group("op").endswith("-start"):  # ``(operands, results)`` tuple: the result half lands
            result_bytes -= operand_bytes
        entry = out[op]
        entry["count"] += 1
        entry["operand_bytes"] += operand_bytes
        entry["result_bytes"] += result_bytes
        entry["largest_result_bytes"] = max(entry["largest_result_bytes"], result_bytes)
    return out


def all_gather_elements(hlo: str) -> list[int]:
    """Distinct element counts of the arrays all-gathered (whole weights show up as theirs)."""
    counts = set()
    for m in map(_INSTRUCTION.match, hlo.splitlines()):
        if m and m.group("op") in ("all-gather", "all-gather-start") and not m.group("type").startswith("("):
            dims = re.search(r"\[([0-9,]*)\]", m.group("type")).group(1)
            counts.add(int(np.prod([int(d) for d in dims.split(",") if d] or [1])))
    return sorted(counts)


def model_config(args) -> models.ModelConfig:
    return models.ModelConfig(**LLAMA2_7B, num_layers=args.layers, scan_layers=True, remat=True,
                              param_dtype=args.param_dtype, dtype=args.dtype)


def train_program(args, mesh, config: models.ModelConfig):
    """The jitted train step and its abstract arguments (DPO or GRPO loss)."""
    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: models.CausalLM(config, rngs=nnx.Rngs(0))),
                                       nnx.Param, ...)
    params = abstract_tree(params, tree_shardings(params, mesh))
    if args.program == "ppo":  # the critic: a decoder of the policy's shape with a value head
        critic_graphdef, critic_params, critic_rest = nnx.split(
            nnx.eval_shape(lambda: models.ValueModel(config, rngs=nnx.Rngs(0))), nnx.Param, ...)
        params = {"policy": params, "critic": abstract_tree(critic_params, tree_shardings(critic_params, mesh))}
    optimizer, schedule = build_optimizer(OptimConfig(weight_decay=0.1), 1000)
    state = jax.eval_shape(lambda p: init_train_state(p, optimizer, jax.random.key(0)), params)
    state_shardings = tree_shardings(state, mesh)
    state = abstract_tree(state, state_shardings)
    n = mesh.size
    T, W = args.seq, args.response
    if args.program == "dpo":
        spec = ModelSpec(scan_layers=True, remat=True, logprob_chunk_size=args.chunk)
        train_config = TrainConfig(algorithm="dpo", model=spec, preference=PreferenceSection(),
                                   data=DataConfig(format="preference", max_length=T, max_prompt_length=T - W,
                                                   max_response_length=W))
        task = make_task(train_config, graphdef, rest)
        loss_fn, normalisers_fn = task.loss_fn, task.normalisers_fn
        pairs = args.rows_per_device * n
        fields = {f"{side}_{k}": ((pairs, T), jnp.int32) for side in ("chosen", "rejected")
                  for k in ("tokens", "positions", "attention_mask", "response_mask")}
        fields.update(prompt_length=((pairs,), jnp.int32), record_index=((pairs,), jnp.int32),
                      example_mask=((pairs,), jnp.int32), margin=((pairs,), jnp.float32))
    elif args.program == "ppo":
        prompt_len = T - W

        def loss_fn(params, frozen, batch, normalisers, rng):
            del frozen, rng
            policy = nnx.merge(graphdef, params["policy"], rest)
            critic = nnx.merge(critic_graphdef, params["critic"], critic_rest)
            inputs = (batch["tokens"], batch["positions"], batch["attention_mask"])
            logps, entropy, _ = response_forward(policy, *inputs, prompt_len=prompt_len, temperature=1.0,
                                                 chunk_size=args.chunk)
            values = critic(*inputs).values[:, prompt_len - 1 : -1]
            num_tokens = normalisers["num_tokens"]
            pg, metrics = ppo_policy_loss(logps, batch["old_logps"], batch["advantages"], batch["loss_mask"],
                                          num_tokens=num_tokens, entropy=entropy)
            v_loss, _ = value_loss(values, batch["old_values"], batch["returns"], batch["loss_mask"], clip_eps=0.2,
                                   num_tokens=num_tokens)
            return pg + 0.5 * v_loss, metrics

        def normalisers_fn(batch):
            return {"num_tokens": jnp.sum(batch["loss_mask"].astype(jnp.float32))}

        rows = args.rows_per_device * n
        fields = {k: ((rows, T), jnp.int32) for k in ("tokens", "positions", "attention_mask")}
        fields.update({k: ((rows, W), jnp.float32) for k in ("loss_mask", "old_logps", "advantages", "old_values",
                                                             "returns")})
    else:
        prompt_len = T - W

        def loss_fn(params, frozen, batch, normalisers, rng):
            del rng
            policy = nnx.merge(graphdef, params, rest)
            inputs = (batch["tokens"], batch["positions"], batch["attention_mask"])
            forward = dict(prompt_len=prompt_len, temperature=1.0, chunk_size=args.chunk,
                           group=args.group if args.pack_groups else 1)
            logps, entropy, _ = response_forward(policy, *inputs, **forward)
            if args.ref_logps:
                ref_logps = batch["ref_logps"]
            else:
                reference = nnx.merge(graphdef, frozen["reference"], rest)
                ref_logps = jax.lax.stop_gradient(response_forward(reference, *inputs, **forward)[0])
            return ppo_policy_loss(logps, jax.lax.stop_gradient(logps), batch["advantages"], batch["loss_mask"],
                                   num_tokens=normalisers["num_tokens"], entropy=entropy, ref_logps=ref_logps,
                                   kl_coef=0.04, kl_kind="k3")

        def normalisers_fn(batch):
            return {"num_tokens": jnp.sum(batch["loss_mask"].astype(jnp.float32))}

        rows = args.rows_per_device * n
        fields = {k: ((rows, T), jnp.int32) for k in ("tokens", "positions", "attention_mask")}
        fields.update(loss_mask=((rows, W), jnp.float32), advantages=((rows,), jnp.float32))
        if args.ref_logps:
            fields["ref_logps"] = ((rows, W), jnp.float32)
    step = make_train_step(loss_fn, optimizer, normalisers_fn=normalisers_fn, schedule=schedule)
    jitted = jax.jit(step, donate_argnums=(0,), out_shardings=(state_shardings, None))
    frozen = {} if args.program == "ppo" or args.ref_logps else {"reference": params}
    return jitted, (state, frozen, batch_arrays(mesh, fields))


def rollout_program(args, mesh, config: models.ModelConfig):
    """The sampler's ``generate`` for groups and its abstract arguments."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: models.CausalLM(config, rngs=nnx.Rngs(0))))
    state = abstract_tree(state, tree_shardings(state, mesh))
    prompts = args.rows_per_device * mesh.size
    P = args.seq - args.response
    sampling = SamplingConfig(max_new_tokens=args.response, num_samples=args.group, stop_token_ids=(2,))
    prompt = batch_arrays(mesh, {"tokens": ((prompts, P), jnp.int32), "mask": ((prompts, P), jnp.int32)})
    rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    return (lambda *a: generate(graphdef, *a, config=sampling)), (state, prompt["tokens"], prompt["mask"], rng)


def decode_programs(args, config: models.ModelConfig) -> list[dict]:
    """Compile the decode step on each ``--decode-meshes`` entry; its figures."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: models.CausalLM(config, rngs=nnx.Rngs(0))))
    rows, slots = args.decode_rows, args.seq - 1
    sampling = SamplingConfig(max_new_tokens=args.response, stop_token_ids=(2,))
    loop = jax.eval_shape(lambda: new_loop_state(
        init_cache(config, batch=rows, max_len=slots), jnp.zeros((rows, config.vocab_size), jnp.float32),
        jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), bool), sampling))
    rng = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    # the loop state donated: inside the while loop the carry (the KV cache) is updated in place
    step = jax.jit(lambda weights, s, key: decode_step(nnx.merge(graphdef, weights), s, key, sampling),
                   donate_argnums=(1,))
    results = []
    for spec in args.decode_meshes:
        shape_text, _, weights_kind = spec.partition(":")
        shape = tuple(int(n) for n in shape_text.split(","))
        mesh = make_mesh(shape, devices=jax.devices()[: int(np.prod(shape))])
        shardings = tree_shardings(state, mesh)
        weights = abstract_tree(state, shardings)
        if weights_kind != "train":
            weights = abstract_tree(jax.eval_shape(compute_copy(args.dtype, shardings), weights), shardings)
        loop_shardings = jax.tree.map(
            lambda x: batch_sharding(mesh, x.ndim) if x.ndim else NamedSharding(mesh, PartitionSpec()), loop)
        loop_shardings = loop_shardings.replace(cache=cache_shardings(loop.cache, mesh))
        loop_args = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), loop,
                                 loop_shardings)
        start = time.perf_counter()
        with jax.set_mesh(mesh):
            compiled = step.lower(weights, loop_args, rng).compile()
        seconds = time.perf_counter() - start
        hlo = compiled.as_text()
        mem = compiled.memory_analysis()
        weight_bytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(weights))
        results.append({
            "mesh": list(shape), "weights": weights_kind or "compute_copy",
            "memory_total": mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes,
            "memory": {"argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
                       "alias": mem.alias_size_in_bytes, "temp": mem.temp_size_in_bytes},
            "weight_bytes_global": weight_bytes,
            "weight_dtypes": sorted({str(x.dtype) for x in jax.tree.leaves(weights) if len(x.shape) >= 2}),
            "cache_dtype": str(loop.cache.k.dtype),
            "collectives": collectives(hlo), "all_gather_elements": all_gather_elements(hlo),
            "compile_s": round(seconds, 1),
        })
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--program", choices=("dpo", "grpo", "ppo", "rollout", "decode"), default="dpo")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seq", type=int, default=512, help="tokens per row (prompt + response)")
    parser.add_argument("--response", type=int, default=256, help="response window / new tokens")
    parser.add_argument("--chunk", type=int, default=128, help="logprob_chunk_size")
    parser.add_argument("--rows-per-device", type=int, default=1, help="pairs, rows or prompts per device")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt (rollout; grpo with --pack-groups)")
    parser.add_argument("--pack-groups", action="store_true", help="grpo: each group's rows as one packed row")
    parser.add_argument("--ref-logps", action="store_true",
                        help="grpo: the reference's log-probs as inputs, as the online trainer's update takes them")
    parser.add_argument("--param-dtype", default="float32")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--no-constraints", action="store_true")
    parser.add_argument("--hlo", help="write the compiled HLO text here")
    parser.add_argument("--decode-meshes", nargs="*", default=[],
                        help="also compile the decode step on these meshes (d,f,t; :train for the training weights)")
    parser.add_argument("--decode-rows", type=int, default=16, help="rows decoded (the global batch)")
    args = parser.parse_args()

    config = model_config(args)
    if args.program == "decode":  # the decode step on --decode-meshes alone
        print(json.dumps({"program": "decode", "devices": jax.device_count(), "layers": args.layers,
                          "decode_rows": args.decode_rows, "decode": decode_programs(args, config)}))
        return
    mesh = make_mesh()
    build = rollout_program if args.program == "rollout" else train_program
    fn, fn_args = build(args, mesh, config)
    start = time.perf_counter()
    # The sampler is always called under its mesh (ScoredSampler); the train step is not:
    # the decoder reads the mesh from its inputs' shardings.
    on_mesh = jax.set_mesh(mesh) if args.program == "rollout" else contextlib.nullcontext()
    with activation_constraints(not args.no_constraints), on_mesh:
        lowered = (fn if hasattr(fn, "lower") else jax.jit(fn)).lower(*fn_args)
    with captured_stderr() as log:
        compiled = lowered.compile()
    seconds = time.perf_counter() - start
    mem = compiled.memory_analysis()
    hlo = compiled.as_text()
    if args.hlo:
        with open(args.hlo, "w", encoding="utf-8") as f:
            f.write(hlo)
    memory = {
        "argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
        "alias": mem.alias_size_in_bytes, "temp": mem.temp_size_in_bytes,
    }
    memory["total"] = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    layer_params = sum(int(np.prod(s)) for s in layer_shapes(config))
    print(json.dumps({
        "program": args.program, "devices": jax.device_count(), "constraints": not args.no_constraints,
        "layers": args.layers, "seq": args.seq, "dtype": args.dtype, "param_dtype": args.param_dtype,
        "memory": memory, "per_device_gb": memory["total"] / GB,
        "layer_weight_bytes_compute": layer_params * jnp.dtype(args.dtype).itemsize,
        "collectives": collectives(hlo),
        "all_gather_elements": all_gather_elements(hlo),
        "involuntary_remat": log.text.count("Involuntary full rematerialization"),
        "compile_s": round(seconds, 1),
        "decode": decode_programs(args, config),
    }))


def layer_shapes(config: models.ModelConfig):
    D, N, K, H, F = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                     config.intermediate_size)
    return [(D, N, H), (D, K, H), (D, K, H), (N, H, D), (D, F), (D, F), (F, D)]


@contextlib.contextmanager
def captured_stderr():
    """What XLA's C++ writes to fd 2 inside the block (its partitioner warnings), passed
    on to stderr afterwards; ``.text`` holds it."""
    class Log:
        text = ""

    log = Log()
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield log
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            log.text = tmp.read().decode("utf-8", "replace")
    sys.stderr.write(log.text)


if __name__ == "__main__":
    main()
