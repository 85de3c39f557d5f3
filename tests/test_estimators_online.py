"""Each advantage estimator of alignax/estimators selected from YAML (``grpo.advantage``) and run
for one rollout step of the real trainer on the toy model: the advantages the trainer computed
equal the NumPy reference of tests/test_estimators.py on the rollout's own inputs, and the
update differs from the default GRPO's on the same rollout (so the option cannot be ignored).

The runs share the seed, records and model, so every estimator sees the default's samples
(checked); the reward is a hash of the completion text, so every group's rewards vary.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_estimators import gdpo_np, gpg_np, opo_np, otb_np, passk_np, rpp_baseline_np
from tests.test_online_variants import assert_same_rollout, assert_update_differs, run_steps

pytestmark = pytest.mark.xdist_group("estimators_online")

TWO_REWARDS = {"functions": {"tests.support.rl_toy:hashed_reward": 1.0, "tests.support.rl_toy:yes_share": 0.5}}
RUNS = {
    "base": {},
    "grpo_passk": {"grpo": {"advantage": "grpo_passk"}},
    "reinforce_plus_plus_baseline": {"grpo": {"advantage": "reinforce_plus_plus_baseline"}},
    "opo": {"grpo": {"advantage": "opo"}},
    "gpg": {"grpo": {"advantage": "gpg", "policy_loss": "pg"}},
    # the "yes"-share reward: zeros in varied groups, so the two counts of valid samples differ
    "gpg_varied_group": {"grpo": {"advantage": "gpg", "policy_loss": "pg", "gpg_valid": "varied_group"},
                         "rewards": {"functions": {"tests.support.rl_toy:yes_share": 1.0}}},
    "optimal_token_baseline": {"grpo": {"advantage": "optimal_token_baseline"}},
    "tir_optimal_token_baseline": {"grpo": {"advantage": "tir_optimal_token_baseline"}},
    "otb_chunked": {"grpo": {"advantage": "optimal_token_baseline"}, "model": {"logprob_chunk_size": 3}},
    "otb_unpacked": {"grpo": {"advantage": "optimal_token_baseline"}, "rollout": {"pack_groups": "off"}},
    "base_two_rewards": {"rewards": TWO_REWARDS},
    "gdpo": {"grpo": {"advantage": "gdpo"}, "rewards": TWO_REWARDS},
    "normalize_then_sum": {"grpo": {"reward_aggregation": "normalize_then_sum"}, "rewards": TWO_REWARDS},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, toy_model):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = run_steps(tmp_path_factory.mktemp(name), toy_model, "grpo", **RUNS[name])
        return cache[name]

    return get


def rollout_of(run):
    x = run.inputs[0]
    return x, np.asarray(x["rewards"], np.float64), np.asarray(x["loss_mask"], np.float64), x["group_ids"]


def check(run, base, expected):
    assert_same_rollout(run, base)
    np.testing.assert_allclose(run.advantages[0], expected, rtol=1e-4, atol=1e-5)
    assert_update_differs(run, base)


def test_grpo_passk_in_the_trainer(runs):
    run = runs("grpo_passk")
    _, rewards, mask, ids = rollout_of(run)
    check(run, runs("base"), passk_np(rewards, group_ids=ids)[:, None] * mask)
    assert np.count_nonzero(run.advantages[0].sum(1)) == len(np.unique(ids))  # one credited row per group


def test_reinforce_plus_plus_baseline_in_the_trainer(runs):
    run = runs("reinforce_plus_plus_baseline")
    _, rewards, mask, ids = rollout_of(run)
    check(run, runs("base"), rpp_baseline_np(rewards, mask, group_ids=ids))


def test_opo_in_the_trainer(runs):
    run = runs("opo")
    _, rewards, mask, ids = rollout_of(run)
    assert len(np.unique(mask.sum(1))) > 1  # lengths differ, so the length weighting matters
    check(run, runs("base"), opo_np(rewards, mask, group_ids=ids))


def test_gpg_in_the_trainer(runs):
    run = runs("gpg")
    _, rewards, mask, ids = rollout_of(run)
    check(run, runs("base"), gpg_np(rewards, group_ids=ids)[:, None] * mask)


def test_gpg_varied_group_in_the_trainer(runs):
    run = runs("gpg_varied_group")
    _, rewards, mask, ids = rollout_of(run)
    expected = gpg_np(rewards, group_ids=ids, valid="varied_group")
    # the option matters on this rollout: verl's count would give other advantages (the
    # rewards differ from the other runs', so the update is not compared with theirs)
    assert np.abs(expected - gpg_np(rewards, group_ids=ids)).max() > 1e-2
    np.testing.assert_allclose(run.advantages[0], expected[:, None] * mask, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["optimal_token_baseline", "tir_optimal_token_baseline"])
def test_optimal_token_baseline_in_the_trainer(runs, name):
    run = runs(name)
    x, rewards, mask, ids = rollout_of(run)
    spsq, stat_logps = np.asarray(x["sum_pi_squared"], np.float64), np.asarray(x["stat_logps"], np.float64)
    # sum_v pi(v)^2 is a probability of two draws agreeing: at least pi(y)^2, at most 1
    on = mask > 0
    assert np.all(spsq[on] <= 1 + 1e-6) and np.all(spsq[on] >= np.exp(stat_logps[on]) ** 2 - 1e-6)
    # synchronous, recomputed old log-probs: the statistic's pass is the learner's pi_old
    np.testing.assert_allclose(stat_logps[on], np.asarray(x["old_logps"], np.float64)[on], atol=1e-5)
    assert np.all(spsq[on] < 1 - 1e-3)  # the toy policy is not deterministic: the statistic is live
    check(run, runs("base"), otb_np(rewards, mask, stat_logps, spsq, name.startswith("tir"), group_ids=ids))
    assert np.std(run.advantages[0][on]) > 0
    assert not np.allclose(run.advantages[0], (run.advantages[0].sum(1) / np.maximum(mask.sum(1), 1))[:, None] * mask,
                           atol=1e-4)  # a baseline per token: advantages vary along a row


def test_sum_pi_squared_in_chunks_of_positions_is_the_same(runs):
    """``model.logprob_chunk_size`` computes the statistic a few positions at a time (never the
    rollout's whole ``[R, N, V]`` logits): the same numbers."""
    whole, chunked = runs("optimal_token_baseline").inputs[0], runs("otb_chunked").inputs[0]
    np.testing.assert_array_equal(whole["loss_mask"], chunked["loss_mask"])
    np.testing.assert_allclose(chunked["sum_pi_squared"], whole["sum_pi_squared"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(chunked["stat_logps"], whole["stat_logps"], rtol=1e-5, atol=1e-6)


def test_token_statistics_with_shared_prompt_packing_are_the_unpacked_ones(runs):
    """``rollout.pack_groups`` (``auto`` packs the toy's groups) runs the statistic's forward
    packed, as the log-probs' (each group's prompt once, its completions as segments): the
    same ``sum pi^2``, log-probs and advantages as unpacked rows, position for position."""
    packed, unpacked = runs("optimal_token_baseline"), runs("otb_unpacked")  # pack_groups auto packs the toy's
    assert packed.trainer.actors.pack_group > 1 and unpacked.trainer.actors.pack_group == 1
    assert_same_rollout(packed, unpacked)
    p, u = packed.inputs[0], unpacked.inputs[0]
    on = u["loss_mask"] > 0
    np.testing.assert_allclose(p["sum_pi_squared"][on], u["sum_pi_squared"][on], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(p["stat_logps"][on], u["stat_logps"][on], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(packed.advantages[0], unpacked.advantages[0], rtol=1e-4, atol=1e-5)


def test_gdpo_in_the_trainer_and_normalize_then_sum_is_the_same(runs):
    run, base = runs("gdpo"), runs("base_two_rewards")
    x, rewards, mask, ids = rollout_of(run)
    components, weights = np.asarray(x["reward_components"], np.float64), np.asarray(x["reward_weights"])
    np.testing.assert_array_equal(weights, [1.0, 0.5])  # rewards.functions' weights, in order
    np.testing.assert_allclose(components @ weights, rewards, rtol=1e-6)  # unweighted, summing to the total
    assert np.all(components[:, 1] >= 0) and np.all(components[:, 1] <= 1)  # yes_share, before its weight
    check(run, base, gdpo_np(components, weights, group_ids=ids)[1][:, None] * mask)
    trl = runs("normalize_then_sum")
    assert_same_rollout(trl, run)
    np.testing.assert_array_equal(trl.advantages[0], run.advantages[0])


def test_tool_integrated_otb_on_trajectories_skips_the_observations(tmp_path):
    """A multi-turn run (the toy agent with ChattyEnv's observation turns): the trainer's
    ``tir_optimal_token_baseline`` advantages are the reference's with positions counted over
    the policy's own tokens, and differ from counting columns (observations shift them)."""
    import jax

    from alignax.trainers.api import build_trainer
    from tests.support.toy_agent import agent_config, lookup_records, make_agent_model

    config = agent_config(tmp_path / "run", make_agent_model(tmp_path / "model"), steps=1,
                          env={"name": "tests.support.toy_agent:ChattyEnv"},
                          grpo={"advantage": "tir_optimal_token_baseline", "kl_coef": 0.0})
    trainer = build_trainer(config, records=lookup_records(16))
    state, frozen = trainer.start()
    batches = trainer.data.iterator("train")
    batch = trainer.collect(state, frozen, next(batches), batches)
    x = {k: None if v is None else np.asarray(v, np.float64)
         for k, v in vars(jax.device_get(batch.inputs)).items()}
    mask, ids = x["loss_mask"], x["group_ids"].astype(int)
    observations = (batch.groups.response_mask > 0) & (batch.groups.actions() == 0)
    assert observations.any() and len(np.unique(x["rewards"])) > 1
    args = (x["rewards"], mask, x["stat_logps"], x["sum_pi_squared"])
    np.testing.assert_allclose(batch.rollout.advantages, otb_np(*args, True, group_ids=ids), rtol=1e-4, atol=1e-5)
    assert np.max(np.abs(otb_np(*args, True, group_ids=ids) - otb_np(*args, False, group_ids=ids))) > 1e-3
