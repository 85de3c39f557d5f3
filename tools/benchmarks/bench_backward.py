"""Gradient step of the SmolLM2 trunk: ``alignax.models.dense`` vs JAX's own autodiff rule.

Every projection of the decoder goes through ``dense``, a matmul whose backward is written
as the two plain products ``dx = dy W^T`` and ``dW = x^T dy``. The comparison is the same
model with ``dense`` swapped for a plain ``lax.dot_general`` that JAX differentiates itself
(what the layers used before). Both variants run in this process, alternating, on the same
random SmolLM2-shaped weights: the gradient of the summed token log-probs of
``batch x seq`` random tokens, jitted. Prints one JSON object with the minimum step time
of each and their ratio.

    .venv/bin/python tools/benchmarks/bench_backward.py [--layers 30 --batch 16 --seq 128 --rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tools/: bench_common
import bench_common as common  # noqa: E402


def autodiff_dense(x, w, *, in_axes=1, transposed=False, out_dtype=None):
    """``dense``'s forward as one ``dot_general``, differentiated by JAX's generic rule."""
    import jax

    x_axes = list(range(x.ndim - in_axes, x.ndim))
    w_axes = list(range(w.ndim - in_axes, w.ndim)) if transposed else list(range(in_axes))
    return jax.lax.dot_general(x, w, ((x_axes, w_axes), ((), ())), preferred_element_type=out_dtype)


def time_gradient(variant: str, args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import alignax.models.layers as layers
    import alignax.models.modeling as modeling
    from alignax.models.config import ModelConfig
    from alignax.models.dense import dense

    matmul = dense if variant == "dense" else autodiff_dense
    layers.dense = modeling.dense = matmul  # read when the step is traced below
    try:
        hf = dict(common.SHAPES["smollm2-135m"], model_type="llama", max_position_embeddings=2048,
                  num_hidden_layers=args.layers)
        config = ModelConfig.from_hf_config(hf)
        graphdef, params = nnx.split(modeling.create_model(config, seed=0))
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.seq)))
        mask = jnp.ones(tokens.shape, jnp.int32)

        def loss(p):
            model = nnx.merge(graphdef, p)
            hidden = model(tokens, None, mask, return_logits=False).hidden
            return modeling.token_logprobs_from_hidden(hidden[:, :-1], model, tokens[:, 1:]).sum()

        step = jax.jit(jax.grad(loss))
        start = time.perf_counter()
        jax.block_until_ready(step(params))
        first = time.perf_counter() - start
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(step(params))
            times.append(time.perf_counter() - start)
    finally:
        layers.dense = modeling.dense = dense
    return {"first_call_s": round(first, 3), "step_times_s": [round(t, 4) for t in times]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (autodiff, then dense)")
    args = parser.parse_args(argv)
    results = {"autodiff": [], "dense": []}
    for _ in range(args.rounds):
        for variant in ("autodiff", "dense"):
            results[variant].append(time_gradient(variant, args))
    best = {v: min(t for r in runs for t in r["step_times_s"]) for v, runs in results.items()}
    print(json.dumps({
        "benchmark": "trunk_gradient", "shape": "smollm2-135m", "layers": args.layers, "batch": args.batch,
        "seq": args.seq, "dtype": "float32", "loadavg_1m": round(os.getloadavg()[0], 2),
        "autodiff": results["autodiff"], "dense": results["dense"],
        "autodiff_step_s_min": best["autodiff"], "dense_step_s_min": best["dense"],
        "speedup": round(best["autodiff"] / best["dense"], 3),
    }, indent=1))


if __name__ == "__main__":
    main()
