"""How well each advantage estimator's policy gradient points at the true one, on a toy
autoregressive bandit small enough to enumerate.

Each of ``--prompts`` prompts has its own policy: ``T`` tokens from ``V`` with independent
softmaxes per position (logits ``theta [P, T, V]``, drawn by ``--seed``, so the prompts differ
in how often they earn the reward); token 0 is the end of the completion, so lengths vary
(the completion is every token up to and including the first 0, as the sampler's response
mask). Two reward components, as ``rewards:`` would give them: ``answer`` = 1 when the
completion holds the token 1 at least twice, and ``format`` = the share of its tokens that are
2; the total is ``answer + 0.5 * format`` (GDPO reads the two apart with weights 1 and 0.5).

A batch is the ``--prompts`` prompts with ``--groups`` samples each. Each estimator of
:data:`alignax.estimators.ESTIMATORS` (those a sampled batch can feed: ReMax and process
supervision need a greedy decode or step rewards) turns the batch's rewards into per-token
advantages ``A [R, T]``; the batch's policy gradient is
``g = (1/R) sum_i sum_t mask_it A_it grad log pi_t(y_it)`` with ``grad log pi_t(y) = e_y - pi_t``.
Over ``--batches`` batches: ``cosine`` between the mean ``g`` and the true gradient of the
expected total reward summed over the prompts (every one of each prompt's ``V^T`` token
arrays enumerated) and ``snr``
``||E g||^2 / E ||g - E g||^2`` (per batch; both free of the estimators' scales, so GPG's
rescaling or GRPO's std division do not count). A higher SNR is a less noisy gradient;
a cosine below 1 is the bias that a std division, a batch whitening or GDPO's component
normalisation brings.

    HF_HUB_OFFLINE=1 .venv/bin/python tools/studies/estimator_variance.py --out docs/results/estimator_variance.json

Prints one JSON object and writes it to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

from alignax.estimators import ESTIMATORS  # noqa: E402
from alignax.trainers.config import GRPOSection  # noqa: E402

SKIPPED = {"remax": "needs a greedy decode per prompt", "process": "needs step rewards"}
WEIGHTS = np.array([1.0, 0.5], np.float32)  # answer, format


def completion_mask(tokens: jnp.ndarray) -> jnp.ndarray:
    """``[..., T]`` 1 up to and including the first end token (0)."""
    ended_before = jnp.cumsum(tokens == 0, axis=-1) - (tokens == 0)
    return (ended_before == 0).astype(jnp.float32)


def components(tokens: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    """``[..., 2]``: answer (token 1 at least twice) and format (share of 2s)."""
    answer = (jnp.sum((tokens == 1) * mask, -1) >= 2).astype(jnp.float32)
    fmt = jnp.sum((tokens == 2) * mask, -1) / jnp.maximum(mask.sum(-1), 1.0)
    return jnp.stack([answer, fmt], -1)


def true_gradient(theta: jnp.ndarray) -> jnp.ndarray:
    """``d E[total] / d theta [T, V]`` of one prompt's policy, enumerating all ``V^T`` token arrays."""
    T, V = theta.shape
    tokens = jnp.array(list(itertools.product(range(V), repeat=T)))
    logp = jax.nn.log_softmax(theta)
    probs = jnp.exp(jnp.sum(logp[jnp.arange(T), tokens], -1))
    mask = completion_mask(tokens)
    total = components(tokens, mask) @ WEIGHTS
    score = (jax.nn.one_hot(tokens, V) - jnp.exp(logp)) * mask[..., None]  # [S, T, V]
    return jnp.einsum("s,s,stv->tv", probs, total, score)


def batch_gradient(name: str, theta, key, prompts: int, group: int):
    """One batch's policy gradient ``[P, T, V]`` under estimator ``name`` (``theta [P, T, V]``)."""
    _, T, V = theta.shape
    rows = prompts * group
    ids = jnp.repeat(jnp.arange(prompts), group)
    logp = jax.nn.log_softmax(theta)[ids]  # [R, T, V]
    pi = jnp.exp(logp)
    tokens = jax.random.categorical(key, logp)  # [R, T]
    mask = completion_mask(tokens)
    parts = components(tokens, mask)
    sampled = jnp.take_along_axis(logp, tokens[..., None], -1)[..., 0]
    x = types.SimpleNamespace(
        rewards=parts @ WEIGHTS, loss_mask=mask, group_ids=ids,
        old_logps=sampled, stat_logps=sampled, sum_pi_squared=jnp.sum(pi * pi, -1), is_weights=None,
        reward_components=parts, reward_weights=jnp.asarray(WEIGHTS), baseline=jnp.zeros(rows))
    section = GRPOSection()  # every estimator option at its default (a new option cannot go missing here)
    adv = ESTIMATORS[name].advantages(x, section, prompts)
    score = jax.nn.one_hot(tokens, V) - pi  # [R, T, V]
    per_row = jnp.einsum("rt,rtv->rtv", adv * mask, score) / rows
    return jax.ops.segment_sum(per_row, ids, num_segments=prompts)


def measure(name: str, theta, truth, *, prompts: int, group: int, batches: int, seed: int) -> dict:
    keys = jax.random.split(jax.random.key(seed + 1), batches)
    grads = jax.jit(jax.vmap(lambda k: batch_gradient(name, theta, k, prompts, group)))(keys)
    g = np.asarray(grads, np.float64).reshape(batches, -1)
    mean = g.mean(0)
    t = np.asarray(truth, np.float64).reshape(-1)
    noise = float(np.mean(np.sum((g - mean) ** 2, 1)))
    return {"cosine": float(mean @ t / (np.linalg.norm(mean) * np.linalg.norm(t))),
            "snr": float(mean @ mean / noise) if noise > 0 else None}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=6, help="T, tokens per completion")
    parser.add_argument("--vocab", type=int, default=4, help="V (token 0 ends a completion)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 8], help="samples per prompt (G)")
    parser.add_argument("--batches", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=str, default=None)
    args = parser.parse_args(argv)
    theta = jax.random.normal(jax.random.key(args.seed), (args.prompts, args.tokens, args.vocab))
    truth = jnp.stack([true_gradient(t) for t in theta])
    names = [n for n in ESTIMATORS if n not in SKIPPED]
    result = {"command": "tools/studies/estimator_variance.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "jax": jax.__version__, "tokens": args.tokens, "vocab": args.vocab, "prompts": args.prompts,
              "batches": args.batches, "seed": args.seed, "skipped": SKIPPED,
              "by_group": {str(G): {n: measure(n, theta, truth, prompts=args.prompts, group=G, batches=args.batches,
                                               seed=args.seed) for n in names} for G in args.groups}}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
