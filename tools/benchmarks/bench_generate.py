"""Decode throughput: alignax's jitted sampler vs transformers' PyTorch ``generate``.

Same weights (SmolLM2-135M-Instruct from ``alignax.models.load``'s cache, or a random
SmolLM2-shaped Llama with ``--random``), same prompts (64 token ids), same number of
new tokens: no stop token on either side, so every row generates exactly
``--new-tokens`` tokens. Greedy by default (``--mode sample``: temperature 1, no
truncation). Each side's time is the median of ``--repeats`` whole-generation calls,
alternating the two sides so a change in machine load hits both; alignax's compile time
is measured on the first call and reported separately (excluded from tokens/s).

    HF_HUB_OFFLINE=1 .venv/bin/python tools/benchmarks/bench_generate.py            # prints JSON

``tokens_per_s = batch * new_tokens / median seconds`` (prefill included on both sides).
transformers runs once per ``--torch-threads`` setting (default: torch's own default and
1 thread; on a shared, oversubscribed machine PyTorch's spinning OpenMP workers can make
more threads much slower) and ``ratio`` is taken against its fastest setting:
``ratio = alignax tokens/s / best transformers tokens/s``. The JSON records the load
average before each batch size and at the end, since other processes share the CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402

from alignax.models import from_hf_state_dict, from_pretrained  # noqa: E402
from alignax.sampling import SamplingConfig, generate  # noqa: E402

SMOLLM2_SHAPE = dict(
    model_type="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def _models(args):
    """``(alignax model, torch model, source)`` on identical float32 weights."""
    policy = dict(scan_layers=args.scan_layers, dtype=args.dtype)
    if args.random:
        hf_cfg = transformers.LlamaConfig(**{k: v for k, v in SMOLLM2_SHAPE.items() if k != "model_type"})
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(hf_cfg).eval()
        tensors = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
        return from_hf_state_dict(SMOLLM2_SHAPE, tensors, **policy), hf, "random SmolLM2-shaped llama"
    from alignax.models.registry import local_model_path

    path = local_model_path("smollm2-135m-instruct")
    ours = from_pretrained(path, **policy)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, hf, f"smollm2-135m-instruct ({path})"


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_batch(graphdef, state, hf, batch: int, args, vocab: int) -> dict:
    load = os.getloadavg()
    rng = np.random.RandomState(batch)
    prompts = rng.randint(3, vocab, (batch, args.prompt_len)).astype(np.int32)
    mask = np.ones_like(prompts)
    config = SamplingConfig(
        max_new_tokens=args.new_tokens, greedy=args.mode == "greedy", stop_token_ids=(), pad_id=0, temperature=1.0
    )
    tokens_j, mask_j = jnp.asarray(prompts), jnp.asarray(mask)
    key = jax.random.key(0)

    def run_ours():
        out = generate(graphdef, state, tokens_j, mask_j, key, config=config)
        jax.block_until_ready(out.tokens)
        return out

    if args.mode == "sample":
        sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    else:
        sampling = dict(do_sample=False)
    gen_cfg = transformers.GenerationConfig(
        max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, eos_token_id=None, pad_token_id=0, **sampling
    )
    prompts_t, mask_t = torch.tensor(prompts, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

    def run_theirs():
        with torch.inference_mode():
            return hf.generate(prompts_t, attention_mask=mask_t, generation_config=gen_cfg)

    first = _timed(run_ours)
    out = run_ours()
    torch.set_num_threads(args.torch_threads[-1])
    theirs = run_theirs()
    n_ours = int(np.asarray(out.lengths).sum())
    n_theirs = int(theirs[:, args.prompt_len :].numel())
    expected = batch * args.new_tokens
    if n_ours != expected or n_theirs != expected:
        raise RuntimeError(f"token counts differ: alignax {n_ours}, transformers {n_theirs}, expected {expected}")
    agree = None
    if args.mode == "greedy":
        agree = float(np.mean(np.asarray(out.tokens) == theirs[:, args.prompt_len :].numpy()))

    # alternate the sides so a change in load hits both
    ours_t, theirs_t = [], {n: [] for n in args.torch_threads}
    for _ in range(args.repeats):
        ours_t.append(_timed(run_ours))
        for threads in args.torch_threads:
            torch.set_num_threads(threads)
            theirs_t[threads].append(_timed(run_theirs))
    ours_s = statistics.median(ours_t)
    theirs_s = {n: statistics.median(t) for n, t in theirs_t.items()}
    best = min(theirs_s, key=theirs_s.get)
    return {
        "batch": batch,
        "alignax_tokens_per_s": expected / ours_s,
        "transformers_tokens_per_s": expected / theirs_s[best],
        "ratio": theirs_s[best] / ours_s,
        "transformers_best_threads": best,
        "transformers_tokens_per_s_by_threads": {str(n): expected / t for n, t in theirs_s.items()},
        "alignax_seconds": ours_t,
        "transformers_seconds_by_threads": {str(n): t for n, t in theirs_t.items()},
        "alignax_compile_seconds": first - ours_s,
        "greedy_token_agreement": agree,
        "load_average_before": load,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", choices=("greedy", "sample"), default="greedy")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="alignax compute dtype")
    parser.add_argument("--scan-layers", action="store_true", help="alignax: layers under lax.scan")
    parser.add_argument("--random", action="store_true", help="random SmolLM2-shaped weights instead of the real ones")
    parser.add_argument("--torch-threads", type=int, nargs="+", default=None,
                        help="torch.set_num_threads settings to time (default: torch's default and 1)")
    parser.add_argument("--output", help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.torch_threads is None:
        args.torch_threads = sorted({torch.get_num_threads(), 1}, reverse=True)

    start = time.perf_counter()
    load_before = os.getloadavg()
    model, hf, source = _models(args)
    graphdef, state = nnx.split(model)
    results = [bench_batch(graphdef, state, hf, b, args, model.config.vocab_size) for b in args.batch_sizes]
    report = {
        "benchmark": "decode tokens/s, alignax generate vs transformers generate",
        "model": source,
        "mode": args.mode,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "alignax": {"dtype": args.dtype, "param_dtype": "float32", "scan_layers": args.scan_layers},
        "transformers": {"dtype": "float32", "torch_threads": args.torch_threads},
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "versions": {"jax": jax.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "jax_backend": jax.default_backend()},
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "seconds_total": time.perf_counter() - start,
        "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
