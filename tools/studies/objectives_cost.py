"""What each registered policy objective (``alignax.losses.OBJECTIVES``, ``grpo.policy_loss``)
costs and does on one off-policy batch.

On a synthetic batch ``[--rows, --tokens]`` (log-probs of a sampled token, an older policy's
log-probs drifted by ``N(0, --drift)`` nats per token, sequence advantages ``N(0, 1)``, every
row's response a random length), for every objective with its defaults:

- ``ms``: median wall time of the jitted ``value_and_grad`` of the loss over ``--repeats``
  calls after a compiling one, and ``ms_vs_ppo``, its ratio to PPO-clip's in the same run
  (the objectives are interleaved round by round, so a slow spell of the shared machine falls
  on every one);
- ``zero_grad_share``: the share of response tokens whose gradient is exactly 0 (clipped,
  masked or dropped by the objective);
- ``grad_norm_vs_ppo``: the gradient's norm over PPO-clip's.

Prints one JSON object and writes it to ``--out``:

    HF_HUB_OFFLINE=1 .venv/bin/python tools/studies/objectives_cost.py --out docs/results/objectives_cost.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from alignax.losses import OBJECTIVES

# keys an objective cannot do without (no paper default): the value the study uses
REQUIRED = {"dro_beta": 0.1}


def batch(rows: int, tokens: int, drift: float, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(tokens // 4, tokens + 1, rows)
    mask = (np.arange(tokens)[None, :] < lengths[:, None]).astype(np.float32)
    logps = -rng.exponential(1.0, (rows, tokens)).astype(np.float32)
    old = np.minimum(logps + rng.normal(0.0, drift, (rows, tokens)), -1e-3).astype(np.float32)
    adv = rng.normal(size=rows).astype(np.float32)
    return [jnp.asarray(x) for x in (logps, old, adv, mask)]


def compiled(name: str):
    entry = OBJECTIVES[name]
    extra = {k: REQUIRED[k] for k in entry.required}

    def loss(logps, old, adv, mask):
        return entry.loss(logps, old, adv, mask, **extra)[0]

    return jax.jit(jax.value_and_grad(loss))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--drift", type=float, default=0.1, help="std of log pi_theta - log pi_old per token (nats)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)

    data = batch(args.rows, args.tokens, args.drift)
    mask = np.asarray(data[3]) > 0
    fns = {name: compiled(name) for name in OBJECTIVES}
    grads = {name: np.asarray(jax.block_until_ready(fn(*data))[1]) for name, fn in fns.items()}  # compiles
    times = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*data))
            times[name].append(time.perf_counter() - start)
    ppo_ms = statistics.median(times["ppo"]) * 1e3
    ppo_norm = float(np.linalg.norm(grads["ppo"]))
    rows = {}
    for name in fns:
        ms = statistics.median(times[name]) * 1e3
        rows[name] = dict(ms=round(ms, 3), ms_vs_ppo=round(ms / ppo_ms, 3),
                          zero_grad_share=round(float(np.mean(grads[name][mask] == 0)), 4),
                          grad_norm_vs_ppo=round(float(np.linalg.norm(grads[name])) / ppo_norm, 4))
    result = dict(rows=args.rows, tokens=args.tokens, drift=args.drift, repeats=args.repeats,
                  response_tokens=int(mask.sum()), backend=jax.default_backend(), jax=jax.__version__,
                  machine=platform.machine(), required_keys=REQUIRED, objectives=rows)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
