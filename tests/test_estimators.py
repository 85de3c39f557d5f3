"""The advantage estimators of alignax/estimators against NumPy references written from each
paper's formula (loops over groups and positions, float64), jitted and not: values, groups of
one sample, rows without a loss token, unequal groups in any order; no gradient flows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alignax.estimators.gdpo import gdpo_advantages, normalize_then_sum
from alignax.estimators.gpg import gpg_advantages
from alignax.estimators.grpo_passk import passk_advantages
from alignax.estimators.opo import opo_advantages
from alignax.estimators.optimal_token_baseline import otb_advantages, sum_pi_squared, token_statistics
from alignax.estimators.reinforce_plus_plus_baseline import reinforce_pp_baseline_advantages

# groups 0 (4 rows), 1 (1 row: a group of one), 2 (3 rows), listed out of order
GROUP_IDS = np.array([0, 2, 0, 1, 2, 0, 2, 0])
NUM_GROUPS = 3
REWARDS = np.array([1.0, 0.5, 3.0, 2.0, -1.0, 3.0, 0.25, 0.0])  # group 0 ties at its best (3.0)
MASK = np.array([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0],
                 [0, 0, 0, 0, 0],  # group 2's second row has no loss token
                 [1, 1, 1, 1, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], np.float64)


def both(fn, *args, **kwargs):
    """``fn`` run eagerly and under ``jax.jit`` (static keywords closed over); both must agree."""
    eager = np.asarray(fn(*args, **kwargs))
    jitted = np.asarray(jax.jit(lambda *a: fn(*a, **kwargs))(*args))
    np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-6)
    return eager


def members(g, group_ids=GROUP_IDS):
    return np.flatnonzero(np.asarray(group_ids) == g)


def num_groups_of(group_ids):
    return int(np.max(group_ids)) + 1


def std(x, unbiased=True):
    x = np.asarray(x, np.float64)
    return 0.0 if len(x) < 2 else float(np.std(x, ddof=1 if unbiased else 0))


# ----------------------------------------------------------------------------- grpo_passk
def passk_np(rewards, eps=1e-6, unbiased=True, group_ids=GROUP_IDS):
    out = np.zeros(len(rewards))
    for g in range(num_groups_of(group_ids)):
        idx = members(g, group_ids)
        if len(idx) < 2:
            continue
        order = sorted(idx, key=lambda i: (-rewards[i], i))  # best first, first index on ties
        margin = rewards[order[0]] - rewards[order[1]]
        out[order[0]] = margin / (std(rewards[idx], unbiased) + eps)
    return out


@pytest.mark.parametrize("rewards", [REWARDS, np.array([1.0, 0.5, 0.0, 2.0, -1.0, 3.0, 0.25, 0.0])])
@pytest.mark.parametrize("unbiased", [True, False])
def test_passk_credits_only_the_best_by_its_margin(rewards, unbiased):
    got = both(passk_advantages, jnp.asarray(rewards), group_ids=GROUP_IDS, num_groups=NUM_GROUPS,
               unbiased_std=unbiased)
    np.testing.assert_allclose(got, passk_np(rewards, unbiased=unbiased), rtol=1e-5, atol=1e-6)
    assert got[3] == 0.0  # the group of one


def test_passk_numbers_by_hand():
    # group 2 = rows 1, 4, 6: rewards 0.5, -1, 0.25 -> best row 1, margin 0.25, std = 0.8036 (ddof 1)
    got = np.asarray(passk_advantages(jnp.asarray(REWARDS), group_ids=GROUP_IDS, num_groups=3))
    assert got[1] == pytest.approx(0.25 / (np.std([0.5, -1.0, 0.25], ddof=1) + 1e-6), rel=1e-5)
    assert got[2] == 0.0 and got[5] == 0.0  # a tie at the top: no margin
    assert np.count_nonzero(got) == 1


# ----------------------------------------------------------------------------- REINFORCE++-baseline
def rpp_baseline_np(rewards, mask, group_ids=GROUP_IDS):
    centred = np.zeros(len(rewards))
    for g in range(num_groups_of(group_ids)):
        idx = members(g, group_ids)
        baseline = rewards[idx].mean() if len(idx) > 1 else 0.0  # verl: a group of one keeps its reward
        centred[idx] = rewards[idx] - baseline
    tokens = np.repeat(centred[:, None], mask.shape[1], 1)
    values = tokens[mask > 0]
    mean, var = values.mean(), values.var(ddof=1)
    return np.where(mask > 0, (tokens - mean) / np.sqrt(var + 1e-8), 0.0)


def test_reinforce_plus_plus_baseline_whitens_over_tokens():
    got = both(reinforce_pp_baseline_advantages, jnp.asarray(REWARDS), jnp.asarray(MASK), group_ids=GROUP_IDS,
               num_groups=NUM_GROUPS)
    np.testing.assert_allclose(got, rpp_baseline_np(REWARDS, MASK), rtol=1e-5, atol=1e-6)
    assert np.all(got[4] == 0.0)  # the empty row
    # differs from sequence-level whitening (grpo.advantage reinforce_pp with the baseline)
    from alignax.advantages import group_advantages
    seq = np.asarray(group_advantages(jnp.asarray(REWARDS), method="reinforce_pp", group_ids=GROUP_IDS,
                                      num_groups=NUM_GROUPS, subtract_group_mean=True))
    assert np.max(np.abs(got[0, 0] - seq[0])) > 1e-2


# ----------------------------------------------------------------------------- OPO
def opo_np(rewards, mask, group_ids=GROUP_IDS):
    lengths = mask.sum(1)
    out = np.zeros_like(mask)
    for g in range(num_groups_of(group_ids)):
        idx = members(g, group_ids)
        total = lengths[idx].sum()
        baseline = (lengths[idx] * rewards[idx]).sum() / total if len(idx) > 1 and total > 0 else 0.0
        for i in idx:
            out[i] = (rewards[i] - baseline) * mask[i]
    return out


def test_opo_length_weighted_baseline():
    got = both(opo_advantages, jnp.asarray(REWARDS), jnp.asarray(MASK), group_ids=GROUP_IDS, num_groups=NUM_GROUPS)
    np.testing.assert_allclose(got, opo_np(REWARDS, MASK), rtol=1e-6, atol=1e-6)
    # by hand, group 0: lengths 3, 5, 4, 2; rewards 1, 3, 3, 0 -> b = (3 + 15 + 12 + 0) / 14
    assert got[0, 0] == pytest.approx(1.0 - 30.0 / 14.0, rel=1e-6)
    assert np.all(got[3, :2] == 2.0)  # a group of one: baseline 0
    # a group whose rows have no loss token: baseline 0, no NaN
    empty = np.asarray(opo_advantages(jnp.ones(2), jnp.zeros((2, 3)), group_ids=np.array([0, 0]), num_groups=1))
    assert np.all(empty == 0.0)


# ----------------------------------------------------------------------------- GPG
def gpg_np(rewards, group_ids=GROUP_IDS, valid="nonzero_reward"):
    if valid == "nonzero_reward":  # verl: B - M = samples with a non-zero reward
        n_valid = np.count_nonzero(rewards)
    else:  # the authors' code: B - M = samples of groups whose rewards' std is > 0
        n_valid = sum(len(members(g, group_ids)) for g in range(num_groups_of(group_ids))
                      if len(members(g, group_ids)) > 1 and np.std(rewards[members(g, group_ids)]) > 0)
    alpha = len(rewards) / max(1, n_valid)
    out = np.zeros(len(rewards))
    for g in range(num_groups_of(group_ids)):
        idx = members(g, group_ids)
        baseline = rewards[idx].mean() if len(idx) > 1 else 0.0
        out[idx] = alpha * (rewards[idx] - baseline)
    return out


@pytest.mark.parametrize("rewards", [REWARDS, np.zeros(8), np.array([0, 0, 1.0, 0, 0, 0, 0, 0])])
def test_gpg_rescales_by_the_share_of_rewarded_samples(rewards):
    got = both(gpg_advantages, jnp.asarray(rewards), group_ids=GROUP_IDS, num_groups=NUM_GROUPS)
    np.testing.assert_allclose(got, gpg_np(rewards), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rewards", [REWARDS, np.zeros(8), np.ones(8), np.array([0, 0, 1.0, 0, 0, 0, 0, 0]),
                                     np.array([1.0, 0, 1, 1, 0, 1, 0, 1])])
def test_gpg_counts_the_samples_of_varied_groups_as_the_authors_code(rewards):
    got = both(gpg_advantages, jnp.asarray(rewards), group_ids=GROUP_IDS, num_groups=NUM_GROUPS,
               valid="varied_group")
    np.testing.assert_allclose(got, gpg_np(rewards, valid="varied_group"), rtol=1e-6, atol=1e-6)


def test_gpg_valid_samples_by_hand():
    # groups: 0 = rows 0, 2, 5, 7; 1 = row 3 (alone); 2 = rows 1, 4, 6. Rewards: group 0 all
    # correct (1, 1, 1, 1), group 1 a lone 0, group 2 varied (0, 1, 0).
    r = jnp.array([1.0, 0, 1, 0, 1, 1, 0, 1])
    verl = np.asarray(gpg_advantages(r, group_ids=GROUP_IDS, num_groups=3))
    authors = np.asarray(gpg_advantages(r, group_ids=GROUP_IDS, num_groups=3, valid="varied_group"))
    # verl: 5 non-zero rewards -> alpha = 8 / 5; the authors: only group 2's 3 samples -> alpha = 8 / 3
    assert verl[4] == pytest.approx(8 / 5 * (1 - 1 / 3)) and authors[4] == pytest.approx(8 / 3 * (1 - 1 / 3))
    assert verl[0] == authors[0] == 0.0  # the all-correct group has no advantage either way
    with pytest.raises(ValueError, match="valid must be one of nonzero_reward, varied_group; got 'all'"):
        gpg_advantages(r, group_ids=GROUP_IDS, num_groups=3, valid="all")


def test_gpg_numbers_by_hand():
    # one rewarded sample of 8: alpha = 8; group 0 = rows 0, 2, 5, 7 with rewards 0, 1, 0, 0 -> mean 0.25
    got = np.asarray(gpg_advantages(jnp.array([0, 0, 1.0, 0, 0, 0, 0, 0]), group_ids=GROUP_IDS, num_groups=3))
    assert got[2] == pytest.approx(8 * 0.75) and got[0] == pytest.approx(-8 * 0.25)


# ----------------------------------------------------------------------------- OTB
def otb_np(rewards, mask, old_logps, spsq, skip_observations=False, eps=1e-8, group_ids=GROUP_IDS, is_weights=None):
    rows, width = mask.shape
    w = (1 - 2 * np.exp(old_logps) + spsq) * mask
    if is_weights is not None:  # verl: w_per_timestep * rollout_is_weights**2
        w = w * np.asarray(is_weights, np.float64) ** 2
    cum = np.cumsum(w, axis=1)
    pos = (np.cumsum(mask, 1) - 1).astype(int) if skip_observations else np.tile(np.arange(width), (rows, 1))
    returns = rewards[:, None] * mask
    adv = np.zeros_like(mask)
    for g in range(num_groups_of(group_ids)):
        idx = [i for i in members(g, group_ids) if mask[i].sum() > 0]
        lengths = {i: mask[i].sum() for i in idx}
        for i in idx:
            for t in range(width):
                if not mask[i, t]:
                    continue
                others = [(j, s) for j in idx for s in range(width) if mask[j, s] and pos[j, s] == pos[i, t]]
                reached = len(others)
                if len(idx) < 2 or reached < 2 and lengths[i] == max(lengths.values()):
                    baseline = 0.0  # a group of one, or the unique longest completion's tail
                else:
                    baseline = sum(returns[j, s] * cum[j, s] for j, s in others) / (sum(cum[j, s] for j, s in others)
                                                                                    + eps)
                adv[i, t] = returns[i, t] - baseline
    return adv


def otb_inputs(seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=MASK.shape + (7,)) * 2
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    tokens = rng.integers(0, 7, size=MASK.shape)
    old_logps = np.log(np.take_along_axis(probs, tokens[..., None], -1)[..., 0])
    return logits, old_logps, (probs ** 2).sum(-1)


def test_sum_pi_squared_from_logits():
    logits, _, spsq = otb_inputs()
    np.testing.assert_allclose(np.asarray(sum_pi_squared(jnp.asarray(logits))), spsq, rtol=1e-5)
    scaled = np.exp(logits / 0.5) / np.exp(logits / 0.5).sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(sum_pi_squared(jnp.asarray(logits), temperature=0.5)),
                               (scaled ** 2).sum(-1), rtol=1e-5)


def test_token_statistics_are_the_sampled_log_prob_and_sum_pi_squared_of_one_distribution():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(3, 5, 11)) * 3
    tokens = rng.integers(0, 11, size=(3, 5))
    for temperature in (1.0, 0.6):
        z = logits / temperature
        probs = np.exp(z - z.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        logp, spsq = token_statistics(jnp.asarray(logits), jnp.asarray(tokens), temperature=temperature)
        want_logp = np.log(np.take_along_axis(probs, tokens[..., None], -1)[..., 0])
        np.testing.assert_allclose(np.asarray(logp), want_logp, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(spsq), (probs ** 2).sum(-1), rtol=1e-5)
        assert logp.dtype == spsq.dtype == jnp.float32


@pytest.mark.parametrize("skip", [False, True])
def test_optimal_token_baseline(skip):
    _, old_logps, spsq = otb_inputs()
    mask = MASK.copy()
    if skip:
        mask[0, 1] = mask[2, 0] = mask[2, 2] = 0  # observation tokens inside trajectories
    got = both(otb_advantages, jnp.asarray(REWARDS), jnp.asarray(mask), jnp.asarray(old_logps), jnp.asarray(spsq),
               group_ids=GROUP_IDS, num_groups=NUM_GROUPS, skip_observations=skip)
    np.testing.assert_allclose(got, otb_np(REWARDS, mask, old_logps, spsq, skip), rtol=1e-5, atol=1e-5)
    assert np.all(got[3, :2] == 2.0)  # a group of one: the return itself
    assert np.all(got[4] == 0.0)  # the empty row
    assert np.all(got[2, 4:] == REWARDS[2]) or skip  # group 0's unique longest row past the second longest


@pytest.mark.parametrize("skip", [False, True])
def test_optimal_token_baseline_with_rollout_correction_weights(skip):
    """verl's OTB under rollout IS: each token's energy times its weight squared; the weights
    move the baseline (a token far from 1 counts more or less in the running sum)."""
    _, old_logps, spsq = otb_inputs(2)
    weights = np.random.default_rng(3).uniform(0.2, 2.0, size=MASK.shape)
    mask = MASK.copy()
    if skip:
        mask[0, 1] = mask[2, 0] = 0
    args = (jnp.asarray(REWARDS), jnp.asarray(mask), jnp.asarray(old_logps), jnp.asarray(spsq))
    got = both(otb_advantages, *args, group_ids=GROUP_IDS, num_groups=NUM_GROUPS, skip_observations=skip,
               is_weights=jnp.asarray(weights))
    want = otb_np(REWARDS, mask, old_logps, spsq, skip, is_weights=weights)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert np.max(np.abs(want - otb_np(REWARDS, mask, old_logps, spsq, skip))) > 1e-3
    ones = otb_advantages(*args, group_ids=GROUP_IDS, num_groups=NUM_GROUPS, skip_observations=skip,
                          is_weights=jnp.ones(MASK.shape))
    np.testing.assert_allclose(np.asarray(ones), otb_np(REWARDS, mask, old_logps, spsq, skip), rtol=1e-5, atol=1e-5)


def test_tool_integrated_otb_differs_where_observations_shift_positions():
    _, old_logps, spsq = otb_inputs(1)
    mask = MASK.copy()
    mask[2, 0] = 0
    args = (jnp.asarray(REWARDS), jnp.asarray(mask), jnp.asarray(old_logps), jnp.asarray(spsq))
    columns = np.asarray(otb_advantages(*args, group_ids=GROUP_IDS, num_groups=3))
    ranks = np.asarray(otb_advantages(*args, group_ids=GROUP_IDS, num_groups=3, skip_observations=True))
    assert np.max(np.abs(columns - ranks)) > 1e-3
    np.testing.assert_allclose(  # without observation tokens the two agree
        np.asarray(otb_advantages(jnp.asarray(REWARDS), jnp.asarray(MASK), *args[2:], group_ids=GROUP_IDS,
                                  num_groups=3)),
        np.asarray(otb_advantages(jnp.asarray(REWARDS), jnp.asarray(MASK), *args[2:], group_ids=GROUP_IDS,
                                  num_groups=3, skip_observations=True)), rtol=1e-6)


# ----------------------------------------------------------------------------- GDPO
COMPONENTS = np.stack([np.array([1.0, 0, 1, 1, 0, 0, 1, 1]),  # an answer score
                       np.array([0.1, 0.2, 0.1, 0.3, 0.9, 0.1, 0.4, 0.2])], axis=1)  # a format score
WEIGHTS = np.array([1.0, 0.5])


def gdpo_np(components, weights, unbiased=True, eps=1e-6, group_ids=GROUP_IDS):
    summed = np.zeros(len(components))
    for k in range(components.shape[1]):
        for g in range(num_groups_of(group_ids)):
            idx = members(g, group_ids)
            x = components[idx, k]
            if len(idx) < 2 or np.all(x == x[0]):
                continue  # GRPO's convention: a constant group (or one sample) is exactly 0
            summed[idx] += weights[k] * (x - x.mean()) / (std(x, unbiased) + eps)
    if np.all(summed == summed[0]):
        return summed, np.zeros_like(summed)
    return summed, (summed - summed.mean()) / (std(summed, unbiased) + eps)


@pytest.mark.parametrize("unbiased", [True, False])
def test_gdpo_normalises_each_component_then_whitens_the_weighted_sum(unbiased):
    summed_np, adv_np = gdpo_np(COMPONENTS, WEIGHTS, unbiased)
    summed = both(normalize_then_sum, jnp.asarray(COMPONENTS), jnp.asarray(WEIGHTS), group_ids=GROUP_IDS,
                  num_groups=NUM_GROUPS, unbiased_std=unbiased)
    np.testing.assert_allclose(summed, summed_np, rtol=1e-5, atol=1e-6)
    got = both(gdpo_advantages, jnp.asarray(COMPONENTS), jnp.asarray(WEIGHTS), group_ids=GROUP_IDS,
               num_groups=NUM_GROUPS, unbiased_std=unbiased)
    np.testing.assert_allclose(got, adv_np, rtol=1e-5, atol=1e-6)
    assert summed[3] == 0.0  # the group of one


def test_gdpo_is_not_grpo_of_the_weighted_total():
    """The point of GDPO: a small-spread component keeps its say (it is normalised alone)."""
    from alignax.advantages import group_advantages
    total = COMPONENTS @ WEIGHTS
    grpo = np.asarray(group_advantages(jnp.asarray(total), method="grpo", group_ids=GROUP_IDS, num_groups=3))
    got = np.asarray(gdpo_advantages(jnp.asarray(COMPONENTS), jnp.asarray(WEIGHTS), group_ids=GROUP_IDS,
                                     num_groups=3))
    assert np.max(np.abs(got - grpo)) > 0.1
    # the weight matters (scaling one component's weight changes the advantages) ...
    other = np.asarray(gdpo_advantages(jnp.asarray(COMPONENTS), jnp.array([1.0, 2.0]), group_ids=GROUP_IDS,
                                       num_groups=3))
    assert np.max(np.abs(got - other)) > 0.1
    # ... but a component's scale does not (it is normalised away)
    rescaled = np.asarray(gdpo_advantages(jnp.asarray(COMPONENTS * np.array([1.0, 10.0])), jnp.asarray(WEIGHTS),
                                          group_ids=GROUP_IDS, num_groups=3))
    np.testing.assert_allclose(rescaled, got, rtol=1e-4, atol=1e-5)


def test_gdpo_refuses_weights_that_do_not_match_the_components():
    with pytest.raises(ValueError, match=r"have 2 columns; weights \(3,\) must have one per column"):
        normalize_then_sum(jnp.asarray(COMPONENTS), jnp.ones(3), group_ids=GROUP_IDS, num_groups=3)


# ----------------------------------------------------------------------------- no gradient
def test_no_gradient_flows_through_any_estimator():
    _, old_logps, spsq = otb_inputs()
    fns = {
        "passk": lambda r: passk_advantages(r, group_ids=GROUP_IDS, num_groups=3).sum(),
        "rpp": lambda r: reinforce_pp_baseline_advantages(r, MASK, group_ids=GROUP_IDS, num_groups=3).sum(),
        "opo": lambda r: opo_advantages(r, MASK, group_ids=GROUP_IDS, num_groups=3).sum(),
        "gpg": lambda r: gpg_advantages(r, group_ids=GROUP_IDS, num_groups=3).sum(),
        "otb": lambda r: otb_advantages(r, MASK, old_logps, spsq, group_ids=GROUP_IDS, num_groups=3).sum(),
        "gdpo": lambda r: gdpo_advantages(jnp.stack([r, r * r], 1), WEIGHTS, group_ids=GROUP_IDS,
                                          num_groups=3).sum(),
    }
    for name, fn in fns.items():
        grad = np.asarray(jax.grad(fn)(jnp.asarray(REWARDS)))
        assert np.all(grad == 0.0), name


def test_the_variance_study_feeds_every_estimator_it_measures():
    """``tools/studies/estimator_variance.py`` builds the rollout inputs itself: each estimator it
    measures takes them (an input an estimator started reading, like OTB's ``is_weights``,
    broke the whole study with nothing failing) and gives a gradient of the right shape. Traced
    only (``jax.eval_shape``): a missing input fails at trace time, and the study's own run
    measures the values."""
    from tests.support.tools import load_tool

    study = load_tool("studies/estimator_variance.py")
    theta = jax.ShapeDtypeStruct((2, 5, 7), jnp.float32)
    names = [n for n in study.ESTIMATORS if n not in study.SKIPPED]
    assert {"optimal_token_baseline", "gdpo", "grpo"} <= set(names)
    for name in names:
        grad = jax.eval_shape(lambda t, name=name: study.batch_gradient(name, t, jax.random.key(1), prompts=2, group=3),
                              theta)
        assert grad.shape == theta.shape and grad.dtype == jnp.float32, name
