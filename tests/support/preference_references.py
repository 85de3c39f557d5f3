"""NumPy references for issue 36's preference objectives, each from its paper's formula.

Float64 Python over whole batches (AOT sorts the batch, BCO shifts by the batch's mean
reward, mixtures add batch-level terms), sharing no code with ``alignax``. Inputs are
``[B]`` sequence log-probs and lengths, ``w`` the per-pair weights (0 drops a pair).
"""

from __future__ import annotations

import math

import numpy as np

from tests.support.references import dpo_pair_loss, log_sigmoid, sigmoid


def f_score(r: float, kind: str, alpha: float) -> float:
    """f-DPO's ``psi(r) = f'(exp r)`` without its constant (Wang et al. 2023, Table 1):
    reverse KL ``f(u) = u log u`` -> ``log u``; forward KL ``f(u) = -log u`` -> ``-1/u``;
    JS ``f(u) = u log u - (u + 1) log((u + 1)/2)`` -> ``log(2u/(1 + u))``, minus ``log 2``;
    alpha (TRL's parametrisation) ``f'(u) = (u^(alpha-1) - 1)/(alpha - 1)``, plus its 1/(alpha-1)."""
    u = math.exp(r)
    if kind == "reverse_kl":
        return math.log(u)
    if kind == "forward_kl":
        return -1.0 / u
    if kind == "js":
        return math.log(2.0 * u / (1.0 + u)) - math.log(2.0)
    if kind == "alpha":
        return math.exp(min((alpha - 1.0) * r, 80.0)) / (alpha - 1.0)
    raise ValueError(kind)


def smoothed(z: float, eps: float) -> float:
    return -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)


def variant_term(name, pc, pr, qc, qr, lc, lr, w, *, beta, eps=0.0, tau=0.05, f="reverse_kl", f_alpha=0.5,
                 bco_delta=None, scale=None, num_pairs=None) -> float:
    """One variant's batch loss ``sum_i w_i c_i l_i / N`` (sorting variants: over the kept
    sorted positions); ``pc/pr`` policy, ``qc/qr`` reference log-probs, ``lc/lr`` lengths."""
    pc, pr, qc, qr, lc, lr, w = ([float(v) for v in x] for x in (pc, pr, qc, qr, lc, lr, w))  # float64 throughout
    n = len(pc)
    keep = [i for i in range(n) if w[i] > 0]
    scale = [1.0] * n if scale is None else [float(v) for v in scale]
    denom = sum(w) if num_pairs is None else num_pairs
    chosen = [f_score(pc[i] - qc[i], f, f_alpha) for i in range(n)]
    rejected = [f_score(pr[i] - qr[i], f, f_alpha) for i in range(n)]
    if name in ("aot", "aot_unpaired"):
        if name == "aot":  # Melnyk et al. 2024: sorted policy margins against sorted reference margins
            a = sorted(pc[i] - pr[i] for i in keep)
            b = sorted(qc[i] - qr[i] for i in keep)
        else:  # sorted chosen log-ratios against sorted rejected log-ratios
            a = sorted(pc[i] - qc[i] for i in keep)
            b = sorted(pr[i] - qr[i] for i in keep)
        return sum(smoothed(beta * (x - y), eps) for x, y in zip(a, b)) / (denom if denom > 0 else 1.0)
    if name == "bco_pair" and bco_delta is None:
        bco_delta = bco_batch_delta(pc, pr, qc, qr, w, beta=beta, f=f, f_alpha=f_alpha)
    out = 0.0
    for i in keep:
        if name == "bco_pair":  # Jung et al. 2024 eq. 8: chosen a positive, rejected a negative example
            loss = -log_sigmoid(beta * chosen[i] - bco_delta) - log_sigmoid(-(beta * rejected[i] - bco_delta))
        elif name == "discopop":  # Lu et al. 2024 eq. 5
            z = beta * (chosen[i] - rejected[i])
            m = sigmoid(z / tau)
            loss = -log_sigmoid(z) * (1 - m) + math.exp(-z) * m
        elif name == "sigmoid_norm":  # TRL: the scores divided by the response lengths
            loss = -log_sigmoid(beta * (chosen[i] / max(lc[i], 1) - rejected[i] / max(lr[i], 1)))
        elif name == "sigmoid":
            loss = smoothed(beta * (chosen[i] - rejected[i]), eps)
        elif name == "hinge":
            loss = max(0.0, 1 - beta * (chosen[i] - rejected[i]))
        elif name == "robust":
            z = beta * (chosen[i] - rejected[i])
            loss = ((1 - eps) * -log_sigmoid(z) - eps * -log_sigmoid(-z)) / (1 - 2 * eps)
        elif name == "nca_pair":
            loss = (-log_sigmoid(beta * chosen[i]) - 0.5 * log_sigmoid(-beta * chosen[i])
                    - 0.5 * log_sigmoid(-beta * rejected[i]))
        elif name == "sppo_hard":
            loss = (chosen[i] - 0.5 / beta) ** 2 + (rejected[i] + 0.5 / beta) ** 2
        elif name == "exo_pair":
            e = eps if eps > 0 else 1e-3
            p = sigmoid(beta * (chosen[i] - rejected[i]))
            loss = p * (math.log(p) - math.log(1 - e)) + (1 - p) * (math.log(1 - p) - math.log(e))
        else:  # the variants that read plain log-ratios (tests/support/references.py)
            assert f == "reverse_kl", name
            loss = dpo_pair_loss(name, pc[i], pr[i], qc[i], qr[i], beta=beta, eps=eps, lam=50.0)
        out += w[i] * scale[i] * loss
    return out / (denom if denom > 0 else 1.0)


def bco_batch_delta(pc, pr, qc, qr, w, *, beta, f="reverse_kl", f_alpha=0.5) -> float:
    """BCO's reward shift as a mean over this batch: the weighted mean reward of both responses
    of the kept pairs, ``(mean_i b psi(r_c,i) + mean_i b psi(r_r,i)) / 2`` (a constant to the gradient)."""
    pc, pr, qc, qr, w = ([float(v) for v in x] for x in (pc, pr, qc, qr, w))
    total = sum(w)
    chosen = sum(w[i] * beta * f_score(pc[i] - qc[i], f, f_alpha) for i in range(len(pc))) / total
    rejected = sum(w[i] * beta * f_score(pr[i] - qr[i], f, f_alpha) for i in range(len(pc))) / total
    return 0.5 * (chosen + rejected)


def chosen_nll(pc, lc, w, num_tokens=None) -> float:
    """MPO's SFT term and RPO's NLL: ``-sum_i w_i log pi(y_c,i) / sum_i w_i |y_c,i|``."""
    pc, lc, w = ([float(v) for v in x] for x in (pc, lc, w))
    tokens = sum(w[i] * lc[i] for i in range(len(pc))) if num_tokens is None else num_tokens
    return -sum(w[i] * pc[i] for i in range(len(pc))) / (tokens if tokens > 0 else 1.0)


def objective(pc, pr, qc, qr, lc, lr, w, *, names, loss_weights=None, rpo_alpha=None, nll_pc=None, **kw) -> float:
    """``sum_k lambda_k L_k`` (+ ``rpo_alpha`` NLL): MPO's weighted mixture, RPO's term."""
    loss_weights = [1.0] * len(names) if loss_weights is None else loss_weights
    nll_pc = pc if nll_pc is None else nll_pc
    total = 0.0
    for name, lam in zip(names, loss_weights):
        total += lam * (chosen_nll(nll_pc, lc, w) if name == "sft" else variant_term(name, pc, pr, qc, qr, lc, lr,
                                                                                     w, **kw))
    if rpo_alpha is not None:
        total += rpo_alpha * chosen_nll(nll_pc, lc, w)
    return total


def ld_logps(token_logps, mask, other_mask, alpha) -> np.ndarray:
    """LD-DPO (Liu et al. 2024 eq. 9): the first ``min(|y_c|, |y_r|)`` response tokens count
    whole, the rest ``alpha``; ``other_mask`` is the pair's other response's mask."""
    out = []
    for row, m, o in zip(np.asarray(token_logps, np.float64), np.asarray(mask), np.asarray(other_mask)):
        shared = min(int(np.sum(m > 0)), int(np.sum(o > 0)))
        k, total = 0, 0.0
        for t in range(len(row)):
            if m[t] > 0:
                k += 1
                total += row[t] if k <= shared else alpha * row[t]
        out.append(total)
    return np.asarray(out)


def wpo_aligned(logits, targets, mask) -> np.ndarray:
    """WPO (Zhou et al. 2024 sec. 3.2): ``sum_t [log p(y_t) - log sum_v p(v)^2]`` over response tokens."""
    out = []
    for b in range(logits.shape[0]):
        total = 0.0
        for t in range(logits.shape[1]):
            if mask[b, t] > 0:
                z = np.asarray(logits[b, t], np.float64)
                p = np.exp(z - z.max())
                p /= p.sum()
                total += math.log(p[targets[b, t]]) - math.log(np.sum(p * p))
        out.append(total)
    return np.asarray(out)
