"""Each registered policy objective, and verl's bypass mode, on the real online trainer.

One rollout step of two epochs on the toy model (tests/support/toy_model.py): the first
update is on-policy, the second off it, where the objectives differ. Every run sees the
same rollout as the default PPO-clip run (the rollout depends only on the policy and the
seed), and each test checks that

(a) the trainer built the registry's loss with the keys set in YAML (``grpo.<key>``);
(b) the second update's policy term is that loss, with those keys, on the update's own
    recorded log-probs, old log-probs, advantages and mask (the formulas themselves are
    checked against NumPy in tests/test_objectives.py); and
(c) that term differs from the default's on the same tokens, so an ignored option fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alignax.losses.objectives import OBJECTIVES
from tests.test_online_variants import assert_same_rollout, run_steps

pytestmark = pytest.mark.xdist_group("objectives_online")

OPTIONS = {
    "gpg": {},
    "dppo_tv": {"clip_eps_low": 0.01, "clip_eps_high": 0.01},
    "dppo_kl": {"clip_eps_low": 1e-4, "clip_eps_high": 1e-4},
    "clip_cov": {"clip_cov_ratio": 0.5, "clip_cov_lb": 0.0},
    "kl_cov": {"kl_cov_ratio": 0.5, "kl_cov_coef": 3.0},
    "geo_mean": {"clip_eps_low": 0.05},
    "dro": {"dro_beta": 0.5},
    "vespo": {"vespo_k_pos": 4.0},
}
# bypass mode: the sampler's log-probs as the old ones; REINFORCE with an explicit, sequence-level
# IS weight and a geometric-mean rejection mask
BYPASS = {"rollout": {"old_logps": "sampler", "tis_cap": 1.5, "tis_level": "sequence", "rejection": "geometric",
                      "rejection_bounds": [0.8, 1.25]}}
# verl's k2 / k3 rejection criteria, chained, in bypass mode without an IS weight
DIVERGENCES = {"seq_max_k2": 0.15, "token_k3": 0.05}
# verl's k1 criteria chained ("token_k1,seq_mean_k1"), each with its own ratio bounds
CHAINED_K1 = {"token": [0.7, 1.4], "geometric": [0.8, 1.25]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, toy_model):
    cache = {}

    def get(name):
        if name not in cache:
            if name == "default":
                spec = dict(grpo={"epochs": 2})
            elif name == "bypass_pg":
                spec = dict(grpo={"epochs": 2, "policy_loss": "pg"}, **BYPASS)
            elif name == "divergences_pg":
                spec = dict(grpo={"epochs": 2, "policy_loss": "pg"},
                            rollout={"old_logps": "sampler", "rejection_divergences": DIVERGENCES})
            elif name == "chained_k1_pg":
                spec = dict(grpo={"epochs": 2, "policy_loss": "pg"},
                            rollout={"old_logps": "sampler", "rejection": CHAINED_K1})
            elif name == "batch_normalized_pg":
                spec = dict(grpo={"epochs": 2, "policy_loss": "pg"},
                            rollout={**BYPASS["rollout"], "tis_batch_normalize": True})
            elif name == "icepop_pg":
                spec = dict(grpo={"epochs": 2, "policy_loss": "pg"},
                            rollout={"old_logps": "sampler", "tis_cap": 1.4, "tis_lower": 0.7})
            elif name == "sampler_pg":
                spec = dict(grpo={"epochs": 2, "policy_loss": "pg"}, rollout={"old_logps": "sampler"})
            else:
                spec = dict(grpo={"epochs": 2, "policy_loss": name, **OPTIONS[name]})
            cache[name] = run_steps(tmp_path_factory.mktemp(name), toy_model, "grpo", **spec)
        return cache[name]

    return get


def recompute(run, update, loss_fn, **keywords):
    """The policy term ``loss_fn`` gives on what the update recorded."""
    ro = update["rollout"]
    f = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    aggregation = run.trainer.algorithm.objective.aggregation
    _, metrics = loss_fn(f(update["logps"]), f(ro.old_logps), f(ro.advantages), f(ro.loss_mask),
                         aggregation=aggregation, norm_length=ro.loss_mask.shape[1], **keywords)
    return float(metrics["pg_loss"])


def second_update(run):
    """``(update, rollout, logps float64, mask, log rho)`` of ``run``'s second update (bypass
    mode: ``rho = pi_theta / pi_sampler``, ``log rho`` 0 off the mask)."""
    second = run.updates[1]
    ro, logps = second["rollout"], second["logps"].astype(np.float64)
    mask = ro.loss_mask > 0
    return second, ro, logps, mask, np.where(mask, logps - ro.sampler_logps, 0.0)


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_each_objective_reaches_the_update(runs, name):
    run, default = runs(name), runs("default")
    assert_same_rollout(run, default)
    entry, objective = OBJECTIVES[name], run.trainer.algorithm.objective
    assert objective.loss_fn is entry.loss and dict(objective.keywords) == OPTIONS[name]
    second = run.updates[1]
    keywords = dict(OPTIONS[name])
    if entry.rng:
        keywords["key"] = jax.random.key(0)  # the draw: checked below through the selection's size
    got = float(second["metrics"]["pg_loss"])
    if not entry.rng:
        np.testing.assert_allclose(got, recompute(run, second, entry.loss, **keywords), rtol=2e-4, atol=1e-6)
    else:
        assert second["metrics"]["cov_selected"] > 0
    # the default PPO-clip on the same recorded tokens gives another policy term
    ppo = recompute(run, second, OBJECTIVES["ppo"].loss)
    assert abs(got - ppo) > 1e-4, (name, got, ppo)


def test_bypass_reinforce_weighs_by_the_current_policy_over_the_sampler(runs):
    """rollout.old_logps: sampler with pg and rollout.tis_cap: the update's policy term is
    -agg(keep * min(prod pi_theta / pi_sampler, 1.5) * A * logp), rows out of the geometric bounds
    dropped; without the correction (sampler old log-probs alone) it is plain -agg(A logp)."""
    run, plain = runs("bypass_pg"), runs("sampler_pg")
    assert_same_rollout(run, plain)
    second, ro, logps, mask, log_rho = second_update(run)
    np.testing.assert_array_equal(ro.old_logps, ro.sampler_logps)  # bypass: old = the sampler's
    seq = log_rho.sum(1)
    weight = np.minimum(np.exp(seq), 1.5)[:, None]
    geo = seq / np.maximum(mask.sum(1), 1)
    keep = ((np.exp(geo) >= 0.8) & (np.exp(geo) <= 1.25))[:, None]
    per_row = (-(weight * keep) * ro.advantages * np.where(mask, logps, 0.0)).sum(1) / np.maximum(mask.sum(1), 1)
    want = per_row[mask.any(1)].mean()  # seq-mean-token-mean, GRPO's default
    np.testing.assert_allclose(second["metrics"]["pg_loss"], want, rtol=2e-4, atol=1e-6)
    assert 0 < second["metrics"]["rejected"] < 1
    assert abs(second["metrics"]["pg_loss"] - plain.updates[1]["metrics"]["pg_loss"]) > 1e-4


def test_batch_normalized_weights_average_one_over_the_completions(runs):
    """rollout.tis_batch_normalize with bypass_pg's sequence-level weight: the update's policy
    term is bypass_pg's with each row's weight divided by the mean of the rows' weights (every
    row with a token: the rejected ones count, as in verl), and that mean is logged."""
    run, unnormalized = runs("batch_normalized_pg"), runs("bypass_pg")
    assert_same_rollout(run, unnormalized)
    second, ro, logps, mask, log_rho = second_update(run)
    assert len(ro.loss_mask) == len(run.inputs[0]["loss_mask"])  # one micro-batch: the mean is the rollout's
    seq = log_rho.sum(1)
    weight = np.minimum(np.exp(seq), 1.5)
    mean = weight[mask.any(1)].mean()
    geo = seq / np.maximum(mask.sum(1), 1)
    keep = (np.exp(geo) >= 0.8) & (np.exp(geo) <= 1.25)
    assert abs(mean - 1) > 1e-3 and 0 < keep[mask.any(1)].mean() < 1
    w = (weight / mean * keep)[:, None]
    per_row = (-w * ro.advantages * np.where(mask, logps, 0.0)).sum(1) / np.maximum(mask.sum(1), 1)
    metrics = second["metrics"]
    np.testing.assert_allclose(metrics["pg_loss"], per_row[mask.any(1)].mean(), rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["tis_batch_norm_factor"], mean, rtol=1e-5)
    assert abs(metrics["pg_loss"] - unnormalized.updates[1]["metrics"]["pg_loss"]) > 1e-5


def test_icepop_weighs_by_the_ratio_inside_its_bounds_and_zero_outside(runs):
    """rollout.tis_lower 0.7 with tis_cap 1.4 (token level) in bypass mode: the update's policy
    term is -agg(w * A * logp) with w = pi_theta / pi_sampler inside [0.7, 1.4] and 0 outside
    (verl's rollout_is_threshold "0.7_1.4"); without it, plain -agg(A logp)."""
    run, plain = runs("icepop_pg"), runs("sampler_pg")
    assert_same_rollout(run, plain)
    second = run.updates[1]
    ro, logps = second["rollout"], second["logps"].astype(np.float64)
    mask = ro.loss_mask > 0
    rho = np.exp(np.where(mask, logps - ro.sampler_logps, 0.0))
    inside = (rho >= 0.7) & (rho <= 1.4)
    assert 0 < inside[mask].mean() < 1  # the bounds zero some tokens, not all
    w = np.where(inside, rho, 0.0)
    per_row = (-w * ro.advantages * np.where(mask, logps, 0.0)).sum(1) / np.maximum(mask.sum(1), 1)
    metrics = second["metrics"]
    np.testing.assert_allclose(metrics["pg_loss"], per_row[mask.any(1)].mean(), rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["tis_out_of_bounds"], 1 - inside[mask].mean(), atol=1e-6)
    assert abs(metrics["pg_loss"] - plain.updates[1]["metrics"]["pg_loss"]) > 1e-4


def test_divergence_rejection_drops_the_tokens_it_bounds(runs):
    """rollout.rejection_divergences {seq_max_k2, token_k3} in bypass mode: the second update's
    policy term is -agg(keep * A * logp) with keep from k2 = (log rho)^2 / 2 (the row's max) and
    k3 = rho - 1 - log rho (per token), rho = pi_theta / pi_sampler; without it, plain -agg(A logp)."""
    run, plain = runs("divergences_pg"), runs("sampler_pg")
    assert_same_rollout(run, plain)
    second, ro, logps, mask, log_rho = second_update(run)
    k2_max = np.where(mask, 0.5 * log_rho ** 2, 0.0).max(1, keepdims=True)
    k3 = np.expm1(log_rho) - log_rho
    keep_k2, keep_k3 = k2_max <= DIVERGENCES["seq_max_k2"], k3 <= DIVERGENCES["token_k3"]
    keep = keep_k2 & keep_k3
    per_row = (-keep.astype(float) * ro.advantages * np.where(mask, logps, 0.0)).sum(1) / np.maximum(mask.sum(1), 1)
    want = per_row[mask.any(1)].mean()  # seq-mean-token-mean, GRPO's default
    metrics = second["metrics"]
    np.testing.assert_allclose(metrics["pg_loss"], want, rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["rejected"], 1 - keep[mask].mean(), atol=1e-6)
    for name, kept in (("seq_max_k2", np.broadcast_to(keep_k2, mask.shape)), ("token_k3", keep_k3)):
        assert 0 < 1 - kept[mask].mean() < 1, name  # each bound cuts somewhere, not everywhere
        np.testing.assert_allclose(metrics[f"rejected_{name}"], 1 - kept[mask].mean(), atol=1e-6)
    assert abs(metrics["pg_loss"] - plain.updates[1]["metrics"]["pg_loss"]) > 1e-4


def test_chained_ratio_bounds_drop_what_either_criterion_drops(runs):
    """rollout.rejection {token: [0.7, 1.4], geometric: [0.8, 1.25]} in bypass mode: the second
    update's policy term is -agg(keep * A * logp) with keep the AND of the token ratio's bounds
    and the row's geometric mean's, rho = pi_theta / pi_sampler; it differs from the term with
    either criterion alone (each drops tokens the other keeps) and from none."""
    run, plain = runs("chained_k1_pg"), runs("sampler_pg")
    assert_same_rollout(run, plain)
    second, ro, logps, mask, log_rho = second_update(run)
    (t_lo, t_hi), (g_lo, g_hi) = CHAINED_K1["token"], CHAINED_K1["geometric"]
    keep_token = (np.exp(log_rho) >= t_lo) & (np.exp(log_rho) <= t_hi)
    geo = np.exp(log_rho.sum(1, keepdims=True) / np.maximum(mask.sum(1, keepdims=True), 1))
    keep_geo = np.broadcast_to((geo >= g_lo) & (geo <= g_hi), mask.shape)

    def term(keep):  # seq-mean-token-mean, GRPO's default
        per_row = (-keep.astype(float) * ro.advantages * np.where(mask, logps, 0.0)).sum(1) / np.maximum(mask.sum(1), 1)
        return per_row[mask.any(1)].mean()

    metrics = second["metrics"]
    np.testing.assert_allclose(metrics["pg_loss"], term(keep_token & keep_geo), rtol=2e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["rejected"], 1 - (keep_token & keep_geo)[mask].mean(), atol=1e-6)
    for name, kept in (("token", keep_token), ("geometric", keep_geo)):
        np.testing.assert_allclose(metrics[f"rejected_{name}"], 1 - kept[mask].mean(), atol=1e-6)
    assert np.any((keep_token & ~keep_geo)[mask]) and np.any((keep_geo & ~keep_token)[mask])
    for single in (keep_token, keep_geo):
        assert abs(metrics["pg_loss"] - term(single)) > 1e-4
    assert abs(metrics["pg_loss"] - plain.updates[1]["metrics"]["pg_loss"]) > 1e-4


# ---------------------------------------------------------------------------------------
# The adaptive entropy coefficient (Skywork-OR1)
# ---------------------------------------------------------------------------------------

C0, DELTA = 0.01, 0.005


def entropy_run(tmp_path, toy_model, target, steps=3, **sections):
    grpo = {"entropy_coef": C0, "entropy_coef_delta": DELTA} if target is not None else {"entropy_coef": C0}
    if target is not None:
        grpo["target_entropy"] = target
    return run_steps(tmp_path, toy_model, "grpo", steps=steps, **{**sections, "grpo": {**grpo,
                                                                                    **sections.get("grpo", {})}})


def applied(run):
    return [float(u["metrics"]["entropy_coef"]) for u in run.updates]


def test_adaptive_entropy_coef_moves_toward_the_target(tmp_path, toy_model):
    """Target far above the toy policy's entropy: c steps up by delta every rollout and is
    applied (0.01, 0.015, 0.02). Target 0 (below any entropy): c steps down and is applied only
    on the first rollout, whose previous entropy counts as the target (0.01, 0, 0)."""
    up = entropy_run(tmp_path / "up", toy_model, 100.0)
    np.testing.assert_allclose(applied(up), [C0, C0 + DELTA, C0 + 2 * DELTA], rtol=1e-6)
    state = up.trainer.algorithm.objective.entropy_control
    assert state is not None and state.target == 100.0
    down = entropy_run(tmp_path / "down", toy_model, 0.0)
    np.testing.assert_allclose(applied(down), [C0, 0.0, 0.0], atol=1e-9)
    # the coefficient reaches the loss: the same first update as a fixed 0.01 (same rollout), a
    # different second one (0.015 against 0.01)
    fixed = entropy_run(tmp_path / "fixed", toy_model, None, steps=2)
    assert "entropy_coef" not in fixed.updates[0]["metrics"]
    assert up.updates[0]["metrics"]["grad_norm"] == pytest.approx(fixed.updates[0]["metrics"]["grad_norm"], rel=1e-6)
    assert up.updates[1]["metrics"]["grad_norm"] != pytest.approx(fixed.updates[1]["metrics"]["grad_norm"], rel=1e-6)


def test_adaptive_entropy_coef_resumes_exactly(tmp_path, toy_model):
    """Its state is in the checkpoint: 2 rollouts, stop, resume for a third = 3 in one go."""
    from alignax.trainers.api import train
    from tests.support.rl_toy import toy_config
    from tests.test_online_variants import HASHED, RECORDS, SGD

    sections = dict(rewards=HASHED, optim=SGD, data={"eval_fraction": 0.0}, train={"save_every": 1},
                    grpo={"entropy_coef": C0, "target_entropy": 100.0, "entropy_coef_delta": DELTA})
    full = train(toy_config(tmp_path / "full", toy_model, "grpo", steps=3, checkpoint={"enabled": False}, **sections),
                 records=RECORDS)
    train(toy_config(tmp_path / "split", toy_model, "grpo", steps=2, **sections), records=RECORDS)
    resumed = train(toy_config(tmp_path / "split", toy_model, "grpo", steps=3, **sections), records=RECORDS)
    assert [h["step"] for h in resumed.history] == [3]
    assert resumed.history[0]["entropy_coef"] == pytest.approx(C0 + 2 * DELTA, rel=1e-6)
    assert full.history[2]["entropy_coef"] == resumed.history[0]["entropy_coef"]
    for a, b in zip(jax.tree.leaves(jax.device_get(full.loop.state.extra)),
                    jax.tree.leaves(jax.device_get(resumed.loop.state.extra))):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(jax.device_get(full.loop.state.params)),
                    jax.tree.leaves(jax.device_get(resumed.loop.state.params))):
        np.testing.assert_array_equal(a, b)
