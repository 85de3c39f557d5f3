"""Forward-pass throughput of SmolLM2-135M: alignax (jitted JAX) vs transformers (PyTorch).

Both run the same weights, shapes and machine in the same process. Weights come from
``alignax.models.load("smollm2-135m-instruct")`` (the GGUF converted to HF safetensors in
the user cache); the scan variant and transformers read that same cached directory. Prints one JSON object:
tokens/s of each, their ratio, compile time of our forward with and without scan over
layers, and the max |logit difference| as a sanity check.

    HF_HUB_OFFLINE=1 .venv/bin/python tools/benchmarks/bench_forward.py [--batch 8 --seq 256 --iters 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import numpy as np


def _time(fn, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def bench_ours(model, tokens, positions, mask, *, iters: int):
    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)

    def forward(state, tokens, positions, mask):
        return nnx.merge(graphdef, state)(tokens, positions, mask).logits

    args = (state, jax.numpy.asarray(tokens), jax.numpy.asarray(positions), jax.numpy.asarray(mask))
    t0 = time.perf_counter()
    compiled = jax.jit(forward).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    logits = np.asarray(compiled(*args))  # warm-up
    times = _time(lambda: compiled(*args).block_until_ready(), iters)
    timing = {"step_s": round(min(times), 4), "step_s_median": round(float(np.median(times)), 4)}
    return {"compile_s": round(compile_s, 2), **timing}, logits


def bench_torch(directory, tokens, positions, mask, *, iters: int):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    t, p, m = (torch.tensor(x) for x in (tokens, positions, mask))

    def forward():
        with torch.no_grad():
            return model(input_ids=t, position_ids=p, attention_mask=m).logits

    logits = forward().numpy()  # warm-up
    times = _time(forward, iters)
    return {"step_s": round(min(times), 4), "step_s_median": round(float(np.median(times)), 4)}, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import jax

    from alignax.models import from_pretrained, load
    from alignax.models.registry import local_model_path

    loop_model, _ = load(args.model, param_dtype=args.dtype, dtype=args.dtype)
    directory = str(local_model_path(args.model))  # the cached HF-layout copy load() read
    scan_model = from_pretrained(directory, param_dtype=args.dtype, dtype=args.dtype, scan_layers=True)
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, 49152, (args.batch, args.seq)).astype(np.int64)
    mask = np.ones_like(tokens)
    positions = np.broadcast_to(np.arange(args.seq), tokens.shape).copy()
    n_tokens = args.batch * args.seq

    loop, ours_logits = bench_ours(loop_model, tokens, positions, mask, iters=args.iters)
    del loop_model
    scan, scan_logits = bench_ours(scan_model, tokens, positions, mask, iters=args.iters)
    del scan_model
    torch_res, torch_logits = bench_torch(directory, tokens, positions, mask, iters=args.iters)
    for res in (loop, scan, torch_res):
        res["tokens_per_s"] = round(n_tokens / res["step_s"], 1)
    result = {
        "benchmark": "forward_logits",
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
        "iters": args.iters,
        "platform": f"{platform.machine()} {jax.devices()[0].platform} x{jax.device_count()}, {os.cpu_count()} cpus",
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "alignax_loop": loop,
        "alignax_scan": scan,
        "transformers_torch": torch_res,
        "speedup_loop_vs_torch": round(loop["tokens_per_s"] / torch_res["tokens_per_s"], 3),
        "speedup_scan_vs_torch": round(scan["tokens_per_s"] / torch_res["tokens_per_s"], 3),
        "max_abs_logit_diff_vs_torch": float(np.abs(ours_logits - torch_logits).max()),
        "max_abs_logit_diff_scan_vs_loop": float(np.abs(scan_logits - ours_logits).max()),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
