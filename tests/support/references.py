"""NumPy references for the functional core's tests, each written from its paper's formula.

Plain Python loops in float64 over the entries a formula sums, sharing no code with
``alignax``: a test compares the library against these, so they stay the obvious
transcription of the definition, not a second vectorised implementation. Per-token
arrays are ``[B, T]`` with ``mask`` truthy on response tokens; sequence arrays ``[B]``.
"""

from __future__ import annotations

import math

import numpy as np

AGGREGATION_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


# --------------------------------------------------------------------------- scalars


def log_sigmoid(x: float) -> float:
    """``log s(x) = -log(1 + e^-x)``, evaluated on the side where ``exp`` cannot overflow."""
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    """The logistic ``s(x) = 1 / (1 + e^-x)``."""
    return math.exp(log_sigmoid(x))


def clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def mean(xs) -> float:
    """``(1/n) sum_i x_i`` of a non-empty list."""
    xs = [float(x) for x in xs]
    return sum(xs) / len(xs)


def variance(xs, ddof: int = 0) -> float:
    """``sum_i (x_i - mean)^2 / (n - ddof)``; 0 when ``n <= ddof`` (nothing to spread)."""
    xs = [float(x) for x in xs]
    if len(xs) <= ddof:
        return 0.0
    m = mean(xs)
    return sum((x - m) ** 2 for x in xs) / (len(xs) - ddof)


def masked_values(x, mask) -> list[float]:
    """The entries of ``x`` under a truthy ``mask``, row by row."""
    x, mask = np.asarray(x, np.float64), np.asarray(mask)
    return [float(x[idx]) for idx in np.ndindex(x.shape) if mask[idx]]


# --------------------------------------------------------------------------- aggregation


def aggregate(x, mask, mode, *, num_tokens=None, num_seqs=None, norm_length=None) -> float:
    """A per-token ``[B, T]`` loss reduced to a scalar, each mode from its definition.

    With ``L_i = sum_t m_it`` and ``S`` the rows with ``L_i > 0``:
    ``token-sum`` ``sum_it x m``; ``token-mean`` ``sum_it x m / sum_it m`` (DAPO);
    ``seq-mean-token-mean`` ``mean_{i in S} sum_t x m / L_i`` (GRPO);
    ``seq-mean-token-sum`` ``sum_it x m / |S|``; ``seq-mean-token-sum-norm``
    ``sum_it x m / (|S| T)`` (Dr. GRPO, Liu et al. 2025). ``num_tokens`` / ``num_seqs`` /
    ``norm_length`` replace ``sum m`` / ``|S|`` / ``T``; an empty count divides by 1.
    """
    x, mask = np.asarray(x, np.float64), np.asarray(mask)
    batch, length = x.shape
    lengths = [sum(1 for t in range(length) if mask[i, t]) for i in range(batch)]
    sums = [sum(x[i, t] for t in range(length) if mask[i, t]) for i in range(batch)]
    n_tok = sum(lengths) if num_tokens is None else num_tokens
    n_seq = sum(1 for n in lengths if n > 0) if num_seqs is None else num_seqs
    if mode == "token-sum":
        return sum(sums)
    if mode == "token-mean":
        return sum(sums) / max(n_tok, 1)
    if mode == "seq-mean-token-mean":
        return sum(s / n for s, n in zip(sums, lengths) if n > 0) / max(n_seq, 1)
    if mode == "seq-mean-token-sum":
        return sum(sums) / max(n_seq, 1)
    if mode == "seq-mean-token-sum-norm":
        budget = length if norm_length is None else norm_length
        return sum(sums) / (max(n_seq, 1) * budget)
    raise ValueError(mode)


# --------------------------------------------------------------------------- KL


def kl_of_log_ratio(r: float, kind: str) -> float:
    """Schulman 2020, "Approximating KL Divergence": one sample of KL(pi || pi_ref).

    ``r = log pi(a) - log pi_ref(a)`` with ``a ~ pi``: ``k1 = r``, ``k2 = r^2 / 2``,
    ``k3 = (pi_ref/pi - 1) - log(pi_ref/pi) = e^-r - 1 + r``, ``abs = |r|``.
    """
    if kind == "k1":
        return r
    if kind == "k2":
        return 0.5 * r * r
    if kind == "k3":
        return math.exp(-r) - 1.0 + r
    if kind == "abs":
        return abs(r)
    raise ValueError(kind)


def kl_estimate(logps, ref_logps, kind, clamp=None) -> np.ndarray:
    """:func:`kl_of_log_ratio` per entry, the log-ratio clipped to ``[-clamp, clamp]`` if given."""
    out = np.zeros(np.shape(logps))
    for idx in np.ndindex(out.shape):
        r = float(logps[idx]) - float(ref_logps[idx])
        out[idx] = kl_of_log_ratio(r if clamp is None else clip(r, -clamp, clamp), kind)
    return out


def sequence_kl(logps, ref_logps, mask, kind) -> np.ndarray:
    """``KL_i = sum_{t : m_it > 0} k(log pi_it - log pi_ref_it)``, one number per row."""
    batch, length = np.shape(logps)
    out = np.zeros(batch)
    for i in range(batch):
        for t in range(length):
            if mask[i][t] > 0:
                out[i] += kl_of_log_ratio(float(logps[i][t]) - float(ref_logps[i][t]), kind)
    return out


# --------------------------------------------------------------------------- policy objective


def ppo_clip(ratio: float, advantage: float, eps_low: float, eps_high: float) -> float:
    """One token's clipped surrogate loss (Schulman et al. 2017, eq. 7, negated):

    ``l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))``; ``eps_high > eps_low`` is
    DAPO's clip-higher (Yu et al. 2025). GSPO uses it with its sequence ratio ``s_i``.
    """
    return max(-advantage * ratio, -advantage * clip(ratio, 1.0 - eps_low, 1.0 + eps_high))


# --------------------------------------------------------------------------- advantages


def gae(rewards, values, mask, gamma, lam) -> tuple[np.ndarray, np.ndarray]:
    """GAE (Schulman et al. 2016) by the textbook backward recursion, row by row.

    Over the response tokens of a row (masked ones skipped), ``t'`` the next one:
    ``delta_t = r_t + gamma V_t' - V_t``, ``A_t = delta_t + gamma lam A_t'``, with
    ``V_t' = A_t' = 0`` after the last; returns ``R_t = A_t + V_t``; 0 off the mask.
    """
    rewards, values, mask = (np.asarray(a, np.float64) for a in (rewards, values, mask))
    advantages = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        next_value, next_adv = 0.0, 0.0  # nothing after the last response token
        for t in reversed(range(rewards.shape[1])):
            if mask[b, t] == 0:
                continue
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            advantages[b, t] = delta + gamma * lam * next_adv
            next_value, next_adv = values[b, t], advantages[b, t]
    returns = np.where(mask > 0, advantages + values, 0.0)
    return advantages, returns


def group_advantages(rewards, group_ids, method, eps=1e-6, ddof=1, baseline=None, subtract_group_mean=False):
    """Sequence advantages from explicit groups (a dict of member lists), flat ``[N]``.

    For a group with mean ``mu`` and std ``sigma`` (``ddof`` 1: the sample std):
    ``grpo`` ``(r - mu) / (sigma + eps)`` (Shao et al. 2024, §4.1.2); ``dr_grpo``
    ``r - mu`` (Liu et al. 2025); ``rloo`` ``r_i - mean_{j != i} r_j`` (Ahmadian et al.
    2024); ``remax`` ``r - baseline`` (Li et al. 2023); ``reinforce_pp`` whitens over the
    whole batch (Hu 2025), after subtracting each group's mean with
    ``subtract_group_mean``. A group of one, or of equal rewards, gets 0.
    """
    rewards = [float(x) for x in np.asarray(rewards, np.float64)]
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(np.asarray(group_ids).tolist()):
        groups.setdefault(g, []).append(i)

    def std(xs):
        return variance(xs, ddof) ** 0.5

    if method == "remax":
        return np.asarray(rewards) - np.asarray(baseline, np.float64)
    if method == "reinforce_pp":
        values = list(rewards)
        if subtract_group_mean:
            for members in groups.values():
                m = mean([rewards[i] for i in members])
                for i in members:
                    values[i] = rewards[i] - m
        m, s = mean(values), std(values)
        if s == 0.0:
            return np.zeros(len(values))
        return np.array([(v - m) / (s + eps) for v in values])
    out = [0.0] * len(rewards)
    for members in groups.values():
        xs = [rewards[i] for i in members]
        if len(xs) < 2 or max(xs) == min(xs):
            continue  # zero-variance or singleton group: 0
        m = mean(xs)
        for i in members:
            if method == "grpo":
                out[i] = (rewards[i] - m) / (std(xs) + eps)
            elif method == "dr_grpo":
                out[i] = rewards[i] - m
            elif method == "rloo":
                out[i] = rewards[i] - mean([rewards[j] for j in members if j != i])
            else:
                raise ValueError(method)
    return np.asarray(out)


# --------------------------------------------------------------------------- preference pairs


def dpo_pair_loss(variant: str, pc: float, pr: float, rc: float, rr: float, *, beta: float, eps: float = 0.0,
                  lam: float = 0.0) -> float:
    """One pair's loss of the DPO family from its paper: ``pc/pr`` the policy's and ``rc/rr``
    the reference's log-probs of the chosen and rejected response (summed, or length-averaged
    where the caller normalises), ``eps`` the label smoothing / flip rate, ``lam`` DPOP's lambda."""
    chosen, rejected = pc - rc, pr - rr  # implicit rewards / beta: log pi(y)/pi_ref(y)
    h = chosen - rejected
    z = beta * h
    if variant == "sigmoid":  # Rafailov et al. 2023 eq. 7; eps > 0: Mitchell's conservative DPO
        return -(1 - eps) * log_sigmoid(z) - eps * log_sigmoid(-z)
    if variant == "hinge":  # SLiC-HF with the reference-normalised margin
        return max(0.0, 1.0 - z)
    if variant == "ipo":  # Azar et al. 2023 eq. 17 with tau = beta
        return (h - 1.0 / (2.0 * beta)) ** 2
    if variant == "robust":  # Chowdhury et al. 2024: unbiased under flip rate eps
        return ((1 - eps) * -log_sigmoid(z) - eps * -log_sigmoid(-z)) / (1 - 2 * eps)
    if variant == "dpop":  # Pal et al. 2024 eq. 3
        return -log_sigmoid(beta * (h - lam * max(0.0, rc - pc)))
    if variant == "exo_pair":  # Ji et al. 2024: KL(p_theta || p_label) over the two responses
        e = eps if eps > 0 else 1e-3
        p = sigmoid(z)  # the model's probability that the chosen response wins
        return p * (math.log(p) - math.log(1 - e)) + (1 - p) * (math.log(1 - p) - math.log(e))
    if variant == "nca_pair":  # Chen et al. 2024
        return -log_sigmoid(beta * chosen) - 0.5 * log_sigmoid(-beta * chosen) - 0.5 * log_sigmoid(-beta * rejected)
    if variant == "sppo_hard":  # Wu et al. 2024: (log ratio - eta (P - 1/2))^2, P = 1 and 0, eta = 1/beta
        eta = 1.0 / beta
        return (chosen - eta * (1.0 - 0.5)) ** 2 + (rejected - eta * (0.0 - 0.5)) ** 2
    if variant == "apo_zero":  # D'Oosterlinck et al. 2024 eq. 7
        return (1.0 - sigmoid(beta * chosen)) + sigmoid(beta * rejected)
    if variant == "apo_down":  # eq. 8
        return sigmoid(beta * chosen) + (1.0 - sigmoid(z))
    raise ValueError(f"no reference for DPO variant {variant!r}")


# --------------------------------------------------------------------------- gradients


def finite_difference(fn, x, h=1e-6) -> np.ndarray:
    """Central differences ``(f(x + h e_k) - f(x - h e_k)) / 2h`` for every entry ``k``."""
    x = np.asarray(x, np.float64)
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[idx] += h
        down[idx] -= h
        grad[idx] = (fn(up) - fn(down)) / (2 * h)
    return grad
