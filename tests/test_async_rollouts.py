"""Asynchronous, bounded-staleness rollouts (``rollout.async.max_staleness``;
alignax/trainers/online/schedule.py) on the toy word model and the "yes"-share task of
tests/support/rl_toy.py."""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import numpy as np
import pytest

from alignax.config import ConfigError
from alignax.trainers.api import build_trainer as make_trainer
from alignax.trainers.api import train
from alignax.trainers.online.collect import Sampled
from alignax.trainers.online.schedule import (AsyncSchedule, SamplerFailedError, StaleSampleError, sampled_from_json,
                                              sampled_to_json)
from tests.support.rl_toy import SAMPLER_FAULT, toy_config, toy_prompts

FIGURES = ("reward/total", "loss", "grad_norm", "entropy", "response/length_mean")


def async_config(tmp_path, toy_model, *, staleness: int, steps: int, **sections):
    rollout = {"old_logps": "sampler", "async": {"max_staleness": staleness}, **sections.pop("rollout", {})}
    return toy_config(tmp_path, toy_model, "grpo", steps=steps, rollout=rollout, **sections)


def copied(state):
    """A copy of ``state`` with buffers of its own (the update donates the one it is given)."""
    return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state)


@contextlib.contextmanager
def first_step(tmp_path, toy_model, staleness: int, **sections):
    """``(trainer, schedule, state, frozen, batches, first batch)``: a fresh run's first
    rollout collected by its :class:`AsyncSchedule` (not yet learned from); closed after."""
    config = async_config(tmp_path, toy_model, staleness=staleness, steps=2, checkpoint={"enabled": False},
                          **sections)
    trainer = make_trainer(config, records=toy_prompts(32))
    schedule = AsyncSchedule(trainer.collector, staleness)
    try:
        state, frozen = trainer.start()
        batches = trainer.data.iterator("train")
        yield trainer, schedule, state, frozen, batches, schedule.collect(state, frozen, next(batches), batches)
    finally:
        schedule.close()


def run_steps(trainer, steps: int, schedule: AsyncSchedule | None):
    """``(params, figures of each step)`` of ``steps`` rollout steps from a fresh state,
    collected by ``schedule`` (``None``: the synchronous ``trainer.collect``)."""
    trainer.schedule = schedule
    state, frozen = trainer.start()
    batches = trainer.data.iterator("train")
    history = []
    try:
        for _ in range(steps):
            state, out = trainer.rollout_step(state, frozen, next(batches), batches)
            history.append(out.metrics)
    finally:
        if schedule is not None:
            schedule.close()
    return jax.device_get(state.params), history


def test_staleness_zero_through_the_schedule_equals_the_synchronous_loop_bit_for_bit(tmp_path, toy_model):
    config = async_config(tmp_path, toy_model, staleness=0, steps=3, checkpoint={"enabled": False})
    sync = make_trainer(config, records=toy_prompts(32))
    sync_params, sync_history = run_steps(sync, 3, None)
    scheduled = make_trainer(config, records=toy_prompts(32))
    params, history = run_steps(scheduled, 3, AsyncSchedule(scheduled.collector, 0))
    for key in FIGURES:
        assert [h[key] for h in history] == [h[key] for h in sync_history], key
    assert [h["async/staleness"] for h in history] == [0.0, 0.0, 0.0]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(sync_params)):
        np.testing.assert_array_equal(a, b)


def test_staleness_one_trains_on_the_recorded_behaviour_log_probs(tmp_path, toy_model):
    with first_step(tmp_path, toy_model, 1) as (trainer, schedule, state, frozen, batches, first):
        state, _ = trainer.learn(state, frozen, first)
        schedule.finish()
        behind: Sampled = schedule.in_flight[0].result()  # rollout 1, sampled with version 0's weights
        assert (behind.rollout_index, behind.version) == (1, 0)

        def loss_of(sampled):
            batch = trainer.collector.price(state, frozen, sampled)
            recorded = sampled.groups.sampler_logps
            np.testing.assert_array_equal(np.asarray(batch.rollout.old_logps), recorded.astype(np.float32))
            losses = []
            trainer.learn(copied(state), frozen, batch,
                          observe=lambda mb, out: losses.append(float(out.metrics["loss"])))
            return losses[0]

        shifted = dataclasses.replace(behind, groups=dataclasses.replace(
            behind.groups, sampler_logps=(behind.groups.sampler_logps - 0.3 * behind.groups.response_mask).astype(
                behind.groups.sampler_logps.dtype)))
        # lower behaviour log-probs raise every ratio pi_theta / pi_behaviour: the loss moves
        assert loss_of(behind) != loss_of(shifted)


def test_no_sample_is_older_than_the_bound(tmp_path, toy_model):
    result = train(async_config(tmp_path, toy_model, staleness=2, steps=5, checkpoint={"enabled": False}),
                   records=toy_prompts(32))
    assert [h["async/staleness"] for h in result.history] == [0.0, 1.0, 2.0, 2.0, 2.0]


def test_a_sample_past_the_bound_is_refused_before_it_is_used(tmp_path, toy_model):
    with first_step(tmp_path, toy_model, 1) as (trainer, schedule, state, frozen, batches, first):
        state, _ = trainer.learn(state, frozen, first)
        schedule.finish()
        # version 1 now; rollout 1's samples claimed to come from version -1: 2 versions old
        stale = sampled_to_json(dataclasses.replace(schedule.in_flight[0].result(), version=-1))
        schedule.set_in_flight([stale])
        refused = r"policy version -1 \(staleness 2\); rollout.async.max_staleness is 1"
        with pytest.raises(StaleSampleError, match=refused):
            schedule.collect(state, frozen, next(batches), batches)


def test_in_flight_samples_round_trip_through_json_exactly(tmp_path, toy_model):
    config = async_config(tmp_path, toy_model, staleness=1, steps=1, checkpoint={"enabled": False})
    trainer = make_trainer(config, records=toy_prompts(32))
    state, _ = trainer.start()
    batch = next(trainer.data.iterator("train"))
    sampled = trainer.collector.sample(trainer.actors.sampling_state(state.params), batch, iter(()),
                                       rollout_index=3, version=2)
    back = sampled_from_json(sampled_to_json(sampled))
    for name in ("tokens", "sampler_logps", "rewards", "stopped", "response_mask", "prompt_tokens"):
        got, want = getattr(back.groups, name), getattr(sampled.groups, name)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    assert back.groups.completions == sampled.groups.completions and (back.rollout_index, back.version) == (3, 2)


@pytest.mark.parametrize("staleness", [1, 2])
def test_resume_with_samples_in_flight_repeats_the_uninterrupted_run(tmp_path, toy_model, staleness):
    records = toy_prompts(32)
    full = train(async_config(tmp_path / "full", toy_model, staleness=staleness, steps=4,
                              checkpoint={"enabled": False}), records=records)
    first = train(async_config(tmp_path / "split", toy_model, staleness=staleness, steps=2), records=records)
    resumed = train(async_config(tmp_path / "split", toy_model, staleness=staleness, steps=4), records=records)
    assert first.loop.last_step == 2 and [h["step"] for h in resumed.history] == [3, 4]
    for key in (*FIGURES, "async/staleness"):
        assert [h[key] for h in full.history[2:]] == [h[key] for h in resumed.history], key


@pytest.mark.parametrize("sections, message", [
    (dict(rollout={"old_logps": "recompute"}),
     "rollout.async.max_staleness=1 with rollout.old_logps=recompute and no rollout.tis_cap"),
    (dict(grpo={"dynamic_sampling": True}), "rollout.async.max_staleness=1 with grpo.dynamic_sampling=true"),
])
def test_async_combinations_that_cannot_work_are_refused_naming_the_keys(tmp_path, toy_model, sections, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        async_config(tmp_path, toy_model, staleness=1, steps=1, **sections)


def test_recompute_with_a_tis_cap_is_accepted(tmp_path, toy_model):
    config = async_config(tmp_path, toy_model, staleness=1, steps=1, rollout={"old_logps": "recompute", "tis_cap": 2.0})
    assert config.rollout.async_.max_staleness == 1


def test_a_step_that_fails_before_its_update_is_saved_as_not_begun(tmp_path, toy_model):
    """The loop saves a failed step's checkpoint with the data position before its prompts:
    the rollouts that step queued are not carried, the one it took is."""
    with first_step(tmp_path, toy_model, 1) as (trainer, schedule, state, frozen, batches, first):
        assert schedule.in_flight_state() == []  # the first step read rollouts 0 and 1's prompts
        state, _ = trainer.learn(state, frozen, first)
        schedule.finish()
        assert [item["rollout_index"] for item in schedule.in_flight_state()] == [1]
        schedule.collect(state, frozen, next(batches), batches)  # queues rollout 2, takes rollout 1
        assert [item["rollout_index"] for item in schedule.in_flight_state()] == [1]


def test_a_failed_sampler_stops_the_run_and_the_resumed_run_repeats_the_uninterrupted_one(tmp_path, toy_model):
    """The reward function raises on the fourth scored batch (the first is the evaluation at the start) (rollout 2, sampled on the thread
    with version 1's weights): the run stops with one line naming the rollout; the checkpoint
    it saves on the way out carries rollout 2 unsampled (its prompts, and version 1's sampler
    weights in a file), and the resumed run repeats the uninterrupted run bit for bit."""
    records, steps = toy_prompts(32), 4
    rewards = {"functions": {"tests.support.rl_toy:yes_share_with_a_fault": 1.0}}
    SAMPLER_FAULT.update(fail_on_batch=None, batches=0)
    full = train(async_config(tmp_path / "full", toy_model, staleness=1, steps=steps, rewards=rewards,
                              checkpoint={"enabled": False}), records=records)
    SAMPLER_FAULT.update(fail_on_batch=3, batches=0)  # batch 0: the evaluation at the start
    kept = {"keep": 1}  # the resumed run's checkpoint of step 4 replaces step 2's, which it resumed from
    in_flight = tmp_path / "split" / "async_in_flight"
    try:
        with pytest.raises(SamplerFailedError) as failed:
            train(async_config(tmp_path / "split", toy_model, staleness=1, steps=steps, rewards=rewards,
                               checkpoint=kept), records=records)
        assert re.fullmatch(r"rollout 2: the sampler thread failed \(sampling with policy version 1\): "
                            r"RewardFunctionError: .*ConnectionError: the verifier dropped scored batch 3.*",
                            str(failed.value)), str(failed.value)
        assert "\n" not in str(failed.value)
        # the checkpoint of step 2 carries rollout 2 unsampled, with version 1's weights
        assert sorted(p.name for p in in_flight.iterdir()) == ["step_2.version_1.process_0.npz"]
        resumed = train(async_config(tmp_path / "split", toy_model, staleness=1, steps=steps, rewards=rewards,
                                     checkpoint=kept), records=records)
    finally:
        SAMPLER_FAULT.update(fail_on_batch=None, batches=0)
    saved = 2  # the failed run stopped where the learner came to rollout 2, saving the state from before it
    assert [h["step"] for h in resumed.history] == [3, 4]
    # consumed: the resumed run sampled rollout 2 again, and the checkpoint that needed the
    # weights is no longer kept (keep 1), so async_in_flight/ is gone from the run directory
    assert not in_flight.exists()
    for key in (*FIGURES, "async/staleness"):
        assert [h[key] for h in full.history[saved:]] == [h[key] for h in resumed.history], key
    for a, b in zip(jax.tree.leaves(jax.device_get(full.loop.state.params)),
                    jax.tree.leaves(jax.device_get(resumed.loop.state.params))):
        np.testing.assert_array_equal(a, b)


def _shifted(sampled: Sampled, nats: float) -> Sampled:
    """``sampled`` with its recorded behaviour log-probs lowered by ``nats`` on response tokens."""
    g = sampled.groups
    lower = (g.sampler_logps - nats * g.response_mask).astype(g.sampler_logps.dtype)
    return dataclasses.replace(sampled, groups=dataclasses.replace(g, sampler_logps=lower))


@pytest.mark.parametrize("weight", ["ratio", "none"])
def test_importance_weighted_kl_at_staleness_one_weighs_by_the_behaviour_policy(tmp_path, toy_model, weight):
    """``grpo.kl_importance_weight: ratio`` with ``max_staleness: 1`` (validation accepts it):
    on rollout 1, sampled with version 0's weights and learned by version 1, the KL term is
    the mean over response tokens of ``w k3`` with ``w = pi_learner / pi_behaviour`` from the
    recorded sampler log-probs (a NumPy reference from DeepSeek-V3.2 eq. 8 and Schulman's
    k3), so lowering the recorded log-probs by 0.3 nats multiplies it by ``e^0.3``; unweighted
    (``none``) it does not move."""
    with first_step(tmp_path, toy_model, 1, grpo={"kl_importance_weight": weight, "kl_coef": 0.1}) as (
            trainer, schedule, state, frozen, batches, first):
        assert trainer.config.rollout.async_.max_staleness == 1
        state, _ = trainer.learn(state, frozen, first)
        schedule.finish()
        behind: Sampled = schedule.in_flight[0].result()
        assert (behind.rollout_index, behind.version) == (1, 0)

        def kl_term(sampled):
            batch = trainer.collector.price(state, frozen, sampled)
            seen = []
            result = trainer.learn(copied(state), frozen, batch,
                                   observe=lambda mb, out: seen.append(float(out.metrics["kl"])))[1]
            return seen[0], batch, result

        kl, batch, result = kl_term(behind)
        learner = np.asarray(result.recomputed, np.float64)  # the update's forward pass: version 1's log-probs
        ref = np.asarray(batch.rollout.ref_logps, np.float64)
        behaviour = behind.groups.sampler_logps.astype(np.float64)
        mask = np.asarray(batch.rollout.loss_mask, np.float64)
        k3 = np.exp(ref - learner) - (ref - learner) - 1.0
        w = np.exp(learner - behaviour) if weight == "ratio" else np.ones_like(k3)
        assert np.max(np.abs(learner - behaviour) * mask) > 1e-3  # off-policy: the weights are not all 1
        np.testing.assert_allclose(kl, np.sum(w * k3 * mask) / np.sum(mask), rtol=1e-5)
        shifted, _, _ = kl_term(_shifted(behind, 0.3))
        np.testing.assert_allclose(shifted, kl * (np.exp(0.3) if weight == "ratio" else 1.0), rtol=1e-5)


def test_optimal_token_baseline_of_a_stale_rollout_reads_the_learners_policy(tmp_path, toy_model):
    """Staleness 1 with the sampler's log-probs as the old ones: the optimal token baseline's
    ``pi(y)`` and ``sum pi^2`` are both the learner's at pricing (version 1), not the sampler's
    ``pi(y)`` (version 0) beside the learner's ``sum pi^2``; the advantages are the NumPy
    reference's on that pair (alignax/estimators/optimal_token_baseline.py says why)."""
    from tests.test_estimators import otb_np

    with first_step(tmp_path, toy_model, 1, grpo={"advantage": "optimal_token_baseline"}) as (
            trainer, schedule, state, frozen, batches, first):
        state, _ = trainer.learn(state, frozen, first)
        schedule.finish()
        behind: Sampled = schedule.in_flight[0].result()
        assert (behind.rollout_index, behind.version) == (1, 0)
        batch = trainer.collector.price(state, frozen, behind)
        x = {k: None if v is None else np.asarray(v, np.float64)
             for k, v in vars(jax.device_get(batch.inputs)).items()}
        on = x["loss_mask"] > 0
        actors = trainer.actors
        placed = tuple(actors.place(a) for a in behind.groups.full_sequences())
        learner = np.asarray(actors.forward(actors.whole_policy(state.params), *placed)[0], np.float64)
        np.testing.assert_allclose(x["stat_logps"][on], learner[on], atol=1e-5)
        sampler = behind.groups.sampler_logps.astype(np.float64)
        np.testing.assert_array_equal(x["old_logps"], sampler)  # the loss's old log-probs stay the sampler's
        assert np.max(np.abs(x["stat_logps"] - sampler)[on]) > 1e-3  # one update apart: the pair is not theirs
        expected = otb_np(x["rewards"], x["loss_mask"], x["stat_logps"], x["sum_pi_squared"], False,
                          group_ids=x["group_ids"].astype(int))
        np.testing.assert_allclose(np.asarray(batch.rollout.advantages), expected, rtol=1e-4, atol=1e-5)
        mixed = otb_np(x["rewards"], x["loss_mask"], sampler, x["sum_pi_squared"], False,
                       group_ids=x["group_ids"].astype(int))
        assert np.max(np.abs(mixed - expected)) > 1e-5  # the mixed pair would give other advantages


def test_optimal_token_baseline_of_a_stale_rollout_squares_the_decoupled_weights(tmp_path, toy_model):
    """Staleness 1 in verl's decoupled mode (recomputed old log-probs, rollout.tis_cap 1.5): the
    optimal token baseline multiplies each token's energy by the square of its weight
    min(pi_old / pi_sampler, 1.5), pi_old the learner's at pricing and pi_sampler version 0's
    (verl's compute_optimal_token_baseline_advantage with its rollout_is_weights)."""
    from tests.test_estimators import otb_np

    with first_step(tmp_path, toy_model, 1, grpo={"advantage": "optimal_token_baseline"},
                    rollout={"old_logps": "recompute", "tis_cap": 1.5}) as (
            trainer, schedule, state, frozen, batches, first):
        state, _ = trainer.learn(state, frozen, first)
        schedule.finish()
        behind: Sampled = schedule.in_flight[0].result()
        batch = trainer.collector.price(state, frozen, behind)
        x = {k: None if v is None else np.asarray(v, np.float64)
             for k, v in vars(jax.device_get(batch.inputs)).items()}
        mask = x["loss_mask"]
        on = mask > 0
        sampler = behind.groups.sampler_logps.astype(np.float64)
        weights = np.where(on, np.minimum(np.exp(x["stat_logps"] - sampler), 1.5), 1.0)
        np.testing.assert_allclose(x["is_weights"][on], weights[on], rtol=1e-5)
        assert np.max(np.abs(weights - 1)[on]) > 1e-2 and np.any(weights[on] == 1.5)  # stale, and capped somewhere
        ids = x["group_ids"].astype(int)
        expected = otb_np(x["rewards"], mask, x["stat_logps"], x["sum_pi_squared"], False, group_ids=ids,
                          is_weights=weights)
        np.testing.assert_allclose(np.asarray(batch.rollout.advantages), expected, rtol=1e-4, atol=1e-5)
        unweighted = otb_np(x["rewards"], mask, x["stat_logps"], x["sum_pi_squared"], False, group_ids=ids)
        assert np.max(np.abs(unweighted - expected)) > 1e-5
