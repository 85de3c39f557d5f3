"""Advantages for policy-gradient alignment: GAE, group baselines, process supervision.

Everything here turns rewards (and values) into advantage *targets*: the outputs carry
no gradient (inputs are wrapped in ``stop_gradient``), and every function traces under
``jax.jit`` with static shapes.

- :func:`token_rewards` places a sequence score on the last response token and subtracts
  a per-token KL penalty (the PPO reward of Ziegler et al. 2019 / Ouyang et al. 2022).
- :func:`gae` is generalised advantage estimation (Schulman et al. 2016) as a reverse
  ``jax.lax.scan`` over time, for right-padded responses after masked-out prompts.
- :func:`group_advantages` computes sequence-level advantages from groups of samples per
  prompt: GRPO, Dr. GRPO, RLOO, REINFORCE++ (and its ``-baseline`` variant), ReMax.
- :func:`process_advantages` is GRPO with process supervision (DeepSeekMath §4.1.3).

Shapes: per-token arrays ``[B, T]`` with ``mask`` 1 on response tokens; sequence-level
rewards ``[P, G]`` (P prompts x G samples) or flat ``[N]`` with ``group_ids`` ``[N]``.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from alignax._checks import check_choice, check_rank, check_same_shape

Array = jax.Array

GROUP_METHODS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "remax")
REWARD_SCALES = ("group", "batch", "none")
RewardScale = Literal["group", "batch", "none"]
GroupMethod = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "remax"]


def _f32(x) -> Array:
    return jnp.asarray(jax.lax.stop_gradient(x), jnp.float32)


# --------------------------------------------------------------------------- per-token


def token_rewards(scores: Array, mask: Array, *, kl_penalty: Array | None = None) -> Array:
    """The PPO per-token reward: the sequence score on the last response token, minus KL.

    ``r_t = score * [t == last response token] - kl_penalty_t * mask_t``

    (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", §2.2;
    Ouyang et al. 2022, InstructGPT eq. 2.) ``kl_penalty`` is the already-scaled
    ``beta * KL_t``, e.g. from :func:`alignax.kl.kl_penalty`; its entries off the response
    are ignored.

    Args:
      scores: ``[B]`` sequence-level reward (reward model or verifier output).
      mask: ``[B, T]`` 1 on response tokens (the last 1 of a row gets the score).
      kl_penalty: optional ``[B, T]`` per-token penalty, subtracted on response tokens.

    Returns ``[B, T]`` float32 rewards; rows with no response token are all zeros.
    """
    check_rank(scores=(scores, 1), mask=(mask, 2))
    if np.shape(mask)[0] != np.shape(scores)[0]:
        raise ValueError(
            f"scores has shape {np.shape(scores)}; it must be [B] = [{np.shape(mask)[0]}] like mask {np.shape(mask)}"
        )
    valid = jnp.asarray(mask).astype(bool)
    t = valid.shape[1]
    # Index of the last response token: first 1 when the row is read backwards.
    last = t - 1 - jnp.argmax(valid[:, ::-1], axis=1)
    has_response = jnp.any(valid, axis=1)
    at_last = (jnp.arange(t)[None, :] == last[:, None]) & has_response[:, None]
    rewards = jnp.where(at_last, _f32(scores)[:, None], 0.0)
    if kl_penalty is not None:
        check_same_shape(kl_penalty=kl_penalty, mask=mask)
        rewards = rewards - jnp.where(valid, _f32(kl_penalty), 0.0)
    return rewards


def gae(
    rewards: Array, values: Array, mask: Array, *, gamma: float | Array, lam: float | Array
) -> tuple[Array, Array]:
    """Generalised advantage estimation over response tokens (Schulman et al. 2016).

    Over the response tokens of a row, in order, ``t`` and its successor ``t'``::

        delta_t = r_t + gamma * V_{t'} - V_t            (V_{t'} = 0 after the last response token)
        A_t     = delta_t + gamma * lam * A_{t'}        (A_{t'} = 0 after the last response token)
        R_t     = A_t + V_t                             (the value target)

    Implemented as a reverse ``jax.lax.scan`` over time that carries ``(V_{t'}, A_{t'})``
    and passes them *unchanged* through masked positions: prompt tokens before the
    response, padding after it, and any masked gap inside it are skipped, so their
    rewards and values never reach a response token and there is no bootstrap past the
    last response token (sequences end there; truncation is treated as termination).
    ``lam = 0`` gives the TD error ``delta_t``; ``gamma = lam = 1`` gives the undiscounted
    return-to-go minus ``V_t``.

    Args:
      rewards: ``[B, T]`` per-token rewards (e.g. :func:`token_rewards`); only response
        positions are read.
      values: ``[B, T]`` critic values ``V(s_t)`` for the same positions.
      mask: ``[B, T]`` 1 on response tokens.
      gamma: discount; lam: GAE lambda (keyword-only, may be traced scalars).

    Returns ``(advantages, returns)``, each ``[B, T]`` float32, 0 on masked positions.
    No gradient flows through them (they are targets).
    """
    check_rank(rewards=(rewards, 2))
    check_same_shape(rewards=rewards, values=values, mask=mask)
    valid = jnp.asarray(mask).astype(bool)
    rewards_f = _f32(rewards)
    values_f = _f32(values)
    gamma = jnp.asarray(gamma, jnp.float32)
    discount = gamma * jnp.asarray(lam, jnp.float32)

    def step(carry, xs):
        next_value, next_adv = carry
        reward_t, value_t, valid_t = xs
        delta = reward_t + gamma * next_value - value_t
        adv = delta + discount * next_adv
        # Masked positions pass the carry through untouched.
        carry = (jnp.where(valid_t, value_t, next_value), jnp.where(valid_t, adv, next_adv))
        return carry, jnp.where(valid_t, adv, 0.0)

    batch = rewards_f.shape[0]
    init = (jnp.zeros((batch,), jnp.float32), jnp.zeros((batch,), jnp.float32))
    xs = (rewards_f.T, values_f.T, valid.T)  # time-major [T, B]
    _, adv_tm = jax.lax.scan(step, init, xs, reverse=True)
    advantages = adv_tm.T
    returns = jnp.where(valid, advantages + values_f, 0.0)
    return advantages, returns


# --------------------------------------------------------------------------- groups


def _check_num_groups(num_groups) -> int:
    if isinstance(num_groups, bool) or not isinstance(num_groups, (int, np.integer)) or num_groups < 1:
        raise ValueError(
            f"num_groups must be a static Python int >= 1 (the number of prompts); got {num_groups!r}"
        )
    return int(num_groups)


def _check_group_ids(group_ids, num_groups: int, n: int, what: str) -> Array:
    check_rank(group_ids=(group_ids, 1))
    if np.shape(group_ids)[0] != n:
        raise ValueError(f"group_ids has shape {np.shape(group_ids)}; it must be [{n}], one id per row of {what}")
    if not jnp.issubdtype(jnp.asarray(group_ids).dtype, jnp.integer):
        raise ValueError(f"group_ids must be integers in [0, num_groups); got dtype {jnp.asarray(group_ids).dtype}")
    # Out-of-range ids would be silently dropped by the segment sums; check when concrete.
    try:
        concrete = np.asarray(group_ids)
    except jax.errors.TracerArrayConversionError:
        concrete = None
    if concrete is not None and concrete.size and (concrete.min() < 0 or concrete.max() >= num_groups):
        raise ValueError(
            f"group_ids must lie in [0, num_groups) = [0, {num_groups}); "
            f"got min {concrete.min()}, max {concrete.max()}"
        )
    return jnp.asarray(group_ids, jnp.int32)


class _GroupStats:
    """Per-element group statistics of ``x`` under ``valid`` (broadcast back to ``x``).

    ``count``: entries in the element's group; ``centred``: ``x - mean_group`` on valid
    entries; ``sq``: the group's sum of squared deviations; ``constant``: the group's
    valid entries are all equal (max == min), exactly, so callers can return exact zeros.
    """

    def __init__(self, x: Array, valid: Array, ids: Array, num_groups: int):
        def seg(values: Array) -> Array:
            return jax.ops.segment_sum(values, ids, num_segments=num_groups)

        count = seg(valid.astype(jnp.float32))
        mean = seg(jnp.where(valid, x, 0.0)) / jnp.maximum(count, 1.0)
        centred = jnp.where(valid, x - mean[ids], 0.0)
        sq = seg(jnp.square(centred))
        gmax = jax.ops.segment_max(jnp.where(valid, x, -jnp.inf), ids, num_segments=num_groups)
        gmin = jax.ops.segment_min(jnp.where(valid, x, jnp.inf), ids, num_segments=num_groups)
        self.count = count[ids]
        self.sq = sq[ids]
        self.constant = (gmax == gmin)[ids] | (count[ids] < 2)
        self.centred = centred


def _std(sq: Array, count: Array, unbiased: bool) -> Array:
    denom = count - 1.0 if unbiased else count
    return jnp.sqrt(sq / jnp.maximum(denom, 1.0))


def group_advantages(
    rewards: Array,
    *,
    method: GroupMethod,
    group_ids: Array | None = None,
    num_groups: int | None = None,
    baseline: Array | None = None,
    eps: float = 1e-6,
    unbiased_std: bool = True,
    subtract_group_mean: bool = False,
    scale: RewardScale = "group",
) -> Array:
    """Sequence-level advantages from a group of samples per prompt.

    Rewards come as ``[P, G]`` (P prompts, G samples each) or flat ``[N]`` with
    ``group_ids`` ``[N]`` in ``[0, num_groups)`` (any order, unequal group sizes; groups
    use segment sums with the static ``num_groups``). For a group ``g`` of size ``n``,
    mean ``mu_g`` and standard deviation ``sigma_g``:

    - ``grpo``: ``(r - mu_g) / (sigma_g + eps)`` (Shao et al. 2024, DeepSeekMath §4.1.2).
      ``sigma_g`` is the *unbiased* sample std (divide by ``n - 1``) by default, as in
      TRL and verl (``torch.std``), so a trainer ported from either sees the same
      numbers; ``unbiased_std=False`` divides by ``n``. The paper does not say which.
      ``scale`` (TRL's ``scale_rewards``) picks the divisor: ``group`` (``sigma_g``, the
      default), ``batch`` (the std of every reward of the batch, ``sigma_batch(r)``, as
      TRL's ``scale_rewards="batch"``: a hard prompt's small spread is not blown up to the
      size of an easy one's) or ``none`` (1, which is ``dr_grpo``).
    - ``dr_grpo``: ``r - mu_g``, no std division, which removes the question-difficulty
      bias (Liu et al. 2025, "Understanding R1-Zero-Like Training").
    - ``rloo``: ``r_i - (1/(n-1)) sum_{j != i} r_j = n/(n-1) (r_i - mu_g)``, the
      leave-one-out baseline (Ahmadian et al. 2024, "Back to Basics: Revisiting
      REINFORCE Style Optimization for Learning from Human Feedback in LLMs").
    - ``reinforce_pp``: REINFORCE++ (Hu 2025, arXiv:2501.03262): whitening over the
      whole batch, ``(r - mu_batch) / (sigma_batch + eps)``; groups are not used. With
      ``subtract_group_mean=True`` (REINFORCE++-baseline) the group mean is subtracted
      first, ``c = r - mu_g``, then ``c / (sigma_batch(c) + eps)``: the batch mean of
      ``c`` is zero by construction, so it is not subtracted a second time (that would
      only add rounding noise to groups whose ``c`` is exactly 0). Whitening here is
      per sequence; for the token-level version (discounted returns of per-token
      rewards with a KL penalty, whitened over tokens) use
      ``gae(rewards, zeros, mask, gamma=gamma, lam=1.0)`` then ``ops.masked_whiten``.
    - ``remax``: ``r - baseline``, with ``baseline`` the reward of the greedy rollout of
      the same prompt, same shape as ``rewards`` (Li et al. 2023, ReMax, Alg. 1).

    Exactness: a group whose rewards are all equal (tested as max == min, not with a
    tolerance) gets exactly 0 for grpo, dr_grpo, rloo and reinforce_pp-baseline; so does
    a group of one sample. For plain reinforce_pp the whole batch is the group: an
    all-equal batch gives exactly 0. Nothing here can produce NaN.

    Args:
      rewards: ``[P, G]`` or ``[N]`` sequence rewards.
      method: one of ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp``, ``remax``.
      group_ids: ``[N]`` int group of each flat reward (flat input only).
      num_groups: static number of groups, required with ``group_ids``.
      baseline: ``remax`` only, same shape as ``rewards``.
      eps: added to the std in ``grpo`` and ``reinforce_pp``.
      unbiased_std: Bessel-corrected std (default, as TRL and verl) or population std.
      subtract_group_mean: ``reinforce_pp`` only: the REINFORCE++-baseline variant.
      scale: ``grpo`` only: ``group`` | ``batch`` | ``none``, the std that divides.

    Returns float32 advantages, same shape as ``rewards``, without gradient.
    """
    check_choice("method", method, GROUP_METHODS)
    check_rank(rewards=(rewards, (1, 2)))
    if baseline is not None and method != "remax":
        raise ValueError(f"baseline is only used by method 'remax'; got method {method!r}")
    if subtract_group_mean and method != "reinforce_pp":
        raise ValueError(f"subtract_group_mean is only used by method 'reinforce_pp'; got method {method!r}")
    check_choice("scale", scale, REWARD_SCALES)
    if scale != "group" and method != "grpo":
        raise ValueError(f"scale={scale!r} is only used by method 'grpo'; got method {method!r}")
    shape = tuple(np.shape(rewards))
    r = _f32(rewards).reshape(-1)

    if method == "remax":
        if baseline is None:
            raise ValueError("method 'remax' needs baseline= (the greedy rollout's reward), same shape as rewards")
        check_same_shape(rewards=rewards, baseline=baseline)
        return (r - _f32(baseline).reshape(-1)).reshape(shape)

    needs_groups = method != "reinforce_pp" or subtract_group_mean
    if len(shape) == 2:
        if group_ids is not None or num_groups is not None:
            raise ValueError(
                f"rewards {shape} is [P, G] and already grouped by rows; group_ids/num_groups are for flat [N] rewards"
            )
        ids = jnp.repeat(jnp.arange(shape[0], dtype=jnp.int32), shape[1])
        n_groups = shape[0]
    elif needs_groups:
        if group_ids is None:
            raise ValueError(
                f"method {method!r} needs groups: pass rewards as [P, G] or flat [N] with group_ids [N] and num_groups"
            )
        if num_groups is None:
            raise ValueError("num_groups is required with group_ids (a static int: the number of prompts)")
        n_groups = _check_num_groups(num_groups)
        ids = _check_group_ids(group_ids, n_groups, shape[0], "rewards")
    else:  # plain reinforce_pp on flat rewards: groups unused
        ids = jnp.zeros((shape[0],), jnp.int32)
        n_groups = 1
    valid = jnp.ones_like(r, dtype=bool)

    if method == "reinforce_pp":
        if subtract_group_mean:
            group = _GroupStats(r, valid, ids, n_groups)
            centred = jnp.where(group.constant, 0.0, group.centred)
            batch = _GroupStats(centred, valid, jnp.zeros_like(ids), 1)
            adv = centred / (_std(batch.sq, batch.count, unbiased_std) + eps)
        else:
            batch = _GroupStats(r, valid, jnp.zeros_like(ids), 1)
            adv = jnp.where(batch.constant, 0.0, batch.centred / (_std(batch.sq, batch.count, unbiased_std) + eps))
        return adv.reshape(shape)

    group = _GroupStats(r, valid, ids, n_groups)
    if method == "grpo" and scale == "batch":
        batch = _GroupStats(r, valid, jnp.zeros_like(ids), 1)
        adv = group.centred / (_std(batch.sq, batch.count, unbiased_std) + eps)
    elif method == "grpo" and scale == "group":
        adv = group.centred / (_std(group.sq, group.count, unbiased_std) + eps)
    elif method in ("grpo", "dr_grpo"):  # grpo with scale "none" is dr_grpo
        adv = group.centred
    else:  # rloo
        adv = group.centred * group.count / jnp.maximum(group.count - 1.0, 1.0)
    return jnp.where(group.constant, 0.0, adv).reshape(shape)


def process_advantages(
    step_rewards: Array,
    step_mask: Array,
    mask: Array,
    *,
    group_ids: Array | None = None,
    num_groups: int | None = None,
    eps: float = 1e-6,
    unbiased_std: bool = True,
) -> Array:
    """GRPO with process supervision (Shao et al. 2024, DeepSeekMath §4.1.3).

    A process reward model scores each reasoning step; the reward of step ``j`` of
    output ``i`` sits at the step's last token ``index(j)``. Following the paper, all
    step rewards ``R`` of a group (every step of every output for the same question,
    pooled) are normalised, then each token's advantage sums the normalised rewards of
    the steps that end at or after it::

        r~_i^{index(j)} = (r_i^{index(j)} - mean(R)) / (std(R) + eps)
        A_{i,t}          = sum_{j : index(j) >= t} r~_i^{index(j)}

    Conventions: ``std`` is the unbiased sample std by default (as in
    :func:`group_advantages`); a group whose step rewards are all equal, or that has a
    single step, gets exactly 0. Only boundary tokens inside the response count
    (``step_mask & mask``). Response tokens after a row's last step boundary get 0 (no
    step ends at or after them); prompt and padding positions get 0. Without
    ``group_ids`` the whole batch is one group.

    Args:
      step_rewards: ``[B, T]`` reward of a step at its boundary token (read only there).
      step_mask: ``[B, T]`` 1 on step-boundary tokens.
      mask: ``[B, T]`` 1 on response tokens.
      group_ids: optional ``[B]`` int group (prompt) of each row, in ``[0, num_groups)``.
      num_groups: static number of groups, required with ``group_ids``.

    Returns ``[B, T]`` float32 advantages without gradient.
    """
    check_rank(step_rewards=(step_rewards, 2))
    check_same_shape(step_rewards=step_rewards, step_mask=step_mask, mask=mask)
    b, t = np.shape(step_rewards)
    valid = jnp.asarray(mask).astype(bool)
    is_step = jnp.asarray(step_mask).astype(bool) & valid
    if group_ids is None:
        if num_groups is not None:
            raise ValueError("num_groups is only used together with group_ids")
        row_ids = jnp.zeros((b,), jnp.int32)
        n_groups = 1
    else:
        if num_groups is None:
            raise ValueError("num_groups is required with group_ids (a static int: the number of prompts)")
        n_groups = _check_num_groups(num_groups)
        row_ids = _check_group_ids(group_ids, n_groups, b, "step_rewards")
    ids = jnp.broadcast_to(row_ids[:, None], (b, t)).reshape(-1)
    flat_valid = is_step.reshape(-1)
    group = _GroupStats(_f32(step_rewards).reshape(-1), flat_valid, ids, n_groups)
    normed = group.centred / (_std(group.sq, group.count, unbiased_std) + eps)
    normed = jnp.where(group.constant | ~flat_valid, 0.0, normed).reshape(b, t)
    # Sum over steps ending at or after t: a reverse cumulative sum along time.
    to_go = jax.lax.cumsum(normed, axis=1, reverse=True)
    return jnp.where(valid, to_go, 0.0)
