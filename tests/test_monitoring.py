"""Online-RL monitoring (alignax/trainers/online/monitoring.py): each alarm raised exactly
when its condition holds, a saved-and-restored alarm history alarming like the live one,
and the figures of one rollout against values worked out by hand."""

import json
import math

import numpy as np
import pytest

from alignax.sampling.scored import Groups
from alignax.trainers.online.monitoring import AlarmSettings, Alarms, rollout_figures

QUIET = dict(entropy=1.0, length=10.0, reward=0.0)  # figures that raise nothing on their own


def feed(alarms, kls=None, entropies=None, lengths=None, rewards=None, start=1):
    """Update ``alarms`` once per value; returns the alarm dicts."""
    n = max(len(x) for x in (kls, entropies, lengths, rewards) if x is not None)
    out = []
    for i in range(n):
        out.append(alarms.update(
            start + i,
            kl=kls[i] if kls is not None else 0.0,
            entropy=entropies[i] if entropies is not None else QUIET["entropy"],
            length=lengths[i] if lengths is not None else QUIET["length"],
            reward=rewards[i] if rewards is not None else QUIET["reward"],
        ))
    return out


def raised(outs, name):
    return [o[f"alarm/{name}"] for o in outs]


# ----------------------------------------------------------------------- kl_acceleration


def test_kl_acceleration_raised_once_the_window_shows_growing_increments():
    # window 5: six values, increments .25 .5 .75 1 1.25 (each larger than the last; binary
    # fractions, so float rounding cannot decide a comparison)
    kls = [0.25, 0.5, 1.0, 1.75, 2.75, 4.0, 5.5]
    outs = feed(Alarms(), kls=kls)
    assert raised(outs, "kl_acceleration") == [0, 0, 0, 0, 0, 1, 1]
    assert raised(outs, "entropy_collapse") == [0] * 7 and raised(outs, "length_drift") == [0] * 7


@pytest.mark.parametrize("kls", [
    [0.5, 0.75, 1.0, 1.25, 1.5, 1.75],  # steady growth: increments equal, not accelerating
    [0.25, 0.5, 1.0, 1.75, 2.75, 3.75],  # the last increment (1) does not exceed the one before
    [4.0, 2.75, 1.75, 1.0, 0.5, 0.25],  # falling
    [0.75, 0.5, 1.0, 1.75, 2.75, 4.0],  # first increment negative
    [x / 1024 for x in (0.25, 0.5, 1.0, 1.75, 2.75, 4.0)],  # accelerating but below kl_floor (0.01)
])
def test_kl_acceleration_not_raised_otherwise(kls):
    assert raised(feed(Alarms(), kls=kls), "kl_acceleration") == [0] * 6


def test_kl_acceleration_reads_only_the_last_window():
    # an early dip leaves the window after one more step; then the last six values accelerate
    kls = [8.0, 0.25, 0.5, 1.0, 1.75, 2.75, 4.0]
    assert raised(feed(Alarms(), kls=kls), "kl_acceleration") == [0, 0, 0, 0, 0, 0, 1]
    # a shorter window needs fewer steps: window 2 = three values, two growing increments
    outs = feed(Alarms(AlarmSettings(window=2)), kls=[0.25, 0.5, 1.0, 1.25])
    assert raised(outs, "kl_acceleration") == [0, 0, 1, 0]


# ----------------------------------------------------------------------- entropy_collapse


def test_entropy_collapse_below_the_fraction_of_the_first_value():
    # first entropy 2.0; threshold 0.2 x 2.0 = 0.4 (strictly below)
    outs = feed(Alarms(), entropies=[2.0, 1.0, 0.41, 0.4, 0.39, 0.1, 3.0])
    assert raised(outs, "entropy_collapse") == [0, 0, 0, 0, 1, 1, 0]
    # another fraction
    outs = feed(Alarms(AlarmSettings(entropy_fraction=0.5)), entropies=[2.0, 1.01, 0.99])
    assert raised(outs, "entropy_collapse") == [0, 0, 1]


def test_entropy_collapse_waits_for_a_first_value_and_ignores_a_zero_one():
    outs = feed(Alarms(), entropies=[None, None, 2.0, 0.3])  # the first *measured* entropy is 2.0
    assert raised(outs, "entropy_collapse") == [0, 0, 0, 1]
    outs = feed(Alarms(), entropies=[0.0, -1.0, 0.0])
    assert raised(outs, "entropy_collapse") == [0, 0, 0]


# ----------------------------------------------------------------------- length_drift


def test_length_drift_when_length_moves_and_the_task_reward_does_not_rise():
    # window 5: compares the newest value with the one 5 steps before
    lengths = [10, 11, 12, 13, 14, 16]  # +60% > 50%
    assert raised(feed(Alarms(), lengths=lengths, rewards=[0.3] * 6), "length_drift") == [0] * 5 + [1]
    assert raised(feed(Alarms(), lengths=lengths, rewards=[0.3, 0.3, 0.3, 0.3, 0.3, 0.2]),
                  "length_drift") == [0] * 5 + [1]  # reward fell
    shrink = [10, 9, 8, 7, 6, 4]  # -60%: a drift either way
    assert raised(feed(Alarms(), lengths=shrink, rewards=[0.3] * 6), "length_drift") == [0] * 5 + [1]


@pytest.mark.parametrize("lengths, rewards", [
    ([10, 11, 12, 13, 14, 16], [0.3, 0.3, 0.3, 0.3, 0.3, 0.31]),  # the task reward rose: learning
    ([10, 11, 12, 13, 14, 15], [0.3] * 6),  # +50% is not more than 50%
    ([10, 11, 12, 13, 16], [0.3] * 5),  # the window is not full yet
    ([0.2, 0.2, 0.2, 0.2, 0.2, 0.6], [0.3] * 6),  # +0.4 tokens, measured against 1 token (not 0.2): 40%
])
def test_length_drift_not_raised_otherwise(lengths, rewards):
    assert raised(feed(Alarms(), lengths=lengths, rewards=rewards), "length_drift") == [0] * len(lengths)


# ----------------------------------------------------------------------- no_signal


def test_no_signal_counts_zero_gradient_rollouts_and_stops_the_run_at_the_streak_limit():
    from alignax.trainers.engine.loop import StalledRunError

    alarms = Alarms(max_stalled_streak=3)
    outs = [alarms.update(i + 1, kl=None, grad_norm=g, **QUIET) for i, g in enumerate([0.0, 0.0, 0.5, 0.0, 0.0])]
    assert raised(outs, "no_signal") == [1, 1, 0, 1, 1]  # a gradient resets the count
    resumed = Alarms(max_stalled_streak=3)
    resumed.set_state(json.loads(json.dumps(alarms.state())))  # two in a row, carried by the checkpoint
    with pytest.raises(StalledRunError, match=r"3 rollouts in a row had an exactly zero gradient \(step 6.*"
                                              r"train\.max_stalled_streak=3"):
        resumed.update(6, kl=None, grad_norm=0.0, **QUIET)
    unlimited = Alarms()  # max_stalled_streak 0: watched, never stopped
    assert raised([unlimited.update(i, kl=None, grad_norm=0.0, **QUIET) for i in range(9)], "no_signal") == [1] * 9
    assert raised(feed(Alarms(max_stalled_streak=1), kls=[0.0] * 3), "no_signal") == [0] * 3  # not watched


# ----------------------------------------------------------------------- saved state


def test_saved_and_restored_alarms_alarm_like_the_live_ones():
    """A run resumed from a checkpoint (JSON meta) raises the same alarms at the same steps
    as the run that never stopped; a fresh history would not."""
    kls = [0.25, 0.5, 1.0, 1.75, 2.75, 4.0, 5.5, 7.25]
    entropies = [2.0, 1.5, 1.0, 0.8, 0.5, 0.3, 0.2, 0.1]
    lengths = [10, 11, 12, 13, 14, 16, 17, 18]
    rewards = [0.3] * 8
    cut = 3
    live = Alarms()
    live_outs = feed(live, kls, entropies, lengths, rewards)

    first = Alarms()
    feed(first, kls[:cut], entropies[:cut], lengths[:cut], rewards[:cut])
    saved = json.loads(json.dumps(first.state()))  # what the checkpoint meta holds
    assert saved["first_entropy"] == 2.0 and saved["kl"] == kls[:cut]
    resumed = Alarms()
    resumed.set_state(saved)
    resumed_outs = feed(resumed, kls[cut:], entropies[cut:], lengths[cut:], rewards[cut:], start=cut + 1)
    assert resumed_outs == live_outs[cut:]
    assert resumed.state() == live.state()
    # every alarm fires after the cut, so the restored history is what makes them fire
    for name in ("kl_acceleration", "entropy_collapse", "length_drift"):
        assert max(raised(resumed_outs, name)) == 1.0, name
    fresh_outs = feed(Alarms(), kls[cut:], entropies[cut:], lengths[cut:], rewards[cut:], start=cut + 1)
    assert fresh_outs != resumed_outs


def test_without_a_reference_the_kl_alarm_is_never_fed():
    """``kl=None`` (no reference model): the KL history stays as it is and kl_acceleration
    stays down, even after a history that was accelerating (a checkpoint of an older run);
    the other alarms work as before, and the state still round-trips."""
    kls = [0.25, 0.5, 1.0, 1.75, 2.75]  # one more accelerating value would raise it
    alarms = Alarms()
    feed(alarms, kls=kls)
    saved = json.loads(json.dumps(alarms.state()))
    resumed = Alarms()
    resumed.set_state(saved)
    # entropy: the restored first value is 1.0 (QUIET), so below 0.2 collapses
    outs = feed(resumed, kls=[None] * 6, entropies=[1.0, 0.5, 0.3, 0.19, 0.1, 0.05], start=6)
    assert raised(outs, "kl_acceleration") == [0] * 6
    assert raised(outs, "entropy_collapse") == [0, 0, 0, 1, 1, 1]
    assert resumed.state()["kl"] == kls and len(resumed.state()["length"]) == 6
    # a reference-free run from the start keeps an empty KL history, and resumes from it
    fresh = Alarms()
    feed(fresh, kls=[None] * 8)
    assert fresh.state()["kl"] == []
    again = Alarms()
    again.set_state(json.loads(json.dumps(fresh.state())))
    assert again.state() == fresh.state()


def test_state_keeps_only_the_window():
    alarms = Alarms(AlarmSettings(window=2))
    feed(alarms, kls=[1.0, 2.0, 3.0, 4.0, 5.0])
    assert alarms.state()["kl"] == [3.0, 4.0, 5.0]
    restored = Alarms(AlarmSettings(window=2))
    restored.set_state({"kl": [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]})
    assert restored.state()["kl"] == [3.0, 4.0, 5.0]


# ----------------------------------------------------------------------- rollout figures

BIG = 1e3  # garbage off the response mask: must not reach any figure


def hand_rollout():
    """4 rows (2 groups of 2), 3 response tokens, values chosen for hand arithmetic."""
    mask = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], np.float32)  # lengths 3 2 1 3; 9 tokens
    off = mask == 0
    groups = Groups(
        prompt_tokens=np.zeros((4, 2), np.int32), prompt_mask=np.ones((4, 2), np.int32),
        tokens=np.ones((4, 3), np.int32), response_mask=mask.astype(np.int32),
        sampler_logps=np.zeros((4, 3), np.float32), stopped=np.array([True, True, False, True]),
        references=[{}] * 4, completions=["a"] * 4,
        rewards=np.array([1.0, 0.0, 0.5, 0.5], np.float32),
        components={"answer": np.array([1.0, 0.0, 1.0, 1.0], np.float32),
                    "format": np.array([0.1, 0.1, 0.0, 0.2], np.float32)},
    )
    rewards_after_kl = np.array([0.9, -0.1, 0.4, 0.5], np.float32)
    seq_kl = np.array([0.3, 0.1, 0.0, 0.2], np.float32)
    old_logps = np.where(off, BIG, -1.0).astype(np.float32)
    ref_logps = np.where(off, -BIG, -1.5).astype(np.float32)  # log-ratio 0.5 on every response token
    recomputed = np.where(off, BIG, -1.0).astype(np.float32)
    sampler = np.array([[-1.1, -0.9, -1.0], [-1.0, -1.0, 0.0], [-1.0, 0.0, 0.0], [-1.0, -1.0, -1.4]], np.float32)
    sampler = np.where(off, -BIG, sampler)  # sampler - trainer: -.1 .1 0 | 0 0 | 0 | 0 0 -.4
    entropy = np.where(off, BIG, np.array([[1, 2, 3], [1, 1, 0], [2, 0, 0], [0, 0, 0]], np.float32))
    advantages = np.where(off, BIG, np.array([[1, 1, 1], [-1, -1, 0], [0.5, 0, 0], [-0.5, -0.5, -0.5]],
                                             np.float32))
    return dict(groups=groups, rewards=rewards_after_kl, seq_kl=seq_kl, old_logps=old_logps, ref_logps=ref_logps,
                recomputed=recomputed, sampler_logps=sampler, response_mask=mask, entropy=entropy,
                advantages=advantages)


def test_rollout_figures_by_hand():
    r = hand_rollout()
    figures = rollout_figures(r["groups"], r["rewards"], r["seq_kl"], r["old_logps"], r["ref_logps"],
                              r["recomputed"], r["sampler_logps"], r["response_mask"], r["entropy"],
                              r["advantages"], group_size=2)
    k3 = math.exp(-0.5) - 1 + 0.5  # 0.1065
    expected = {
        "reward/total": 0.5,
        "reward/std": math.sqrt(0.125),  # population std of 1, 0, .5, .5
        "reward/after_kl": 0.425,
        "reward/answer": 0.75,
        "reward/format": 0.1,
        "response/length_mean": 2.25,
        "response/length_min": 1.0,
        "response/length_max": 3.0,
        "response/stop_rate": 0.75,
        "response/truncation_rate": 0.25,
        "kl/ref_seq": 0.15,
        "kl/ref_k1": 0.5,
        "kl/ref_k3": k3,
        "entropy": 10 / 9,
        "mismatch/sampler_trainer_abs": 0.6 / 9,
        "mismatch/sampler_trainer_max": 0.4,
        "advantages/mean": 0.0,  # 3 - 2 + .5 - 1.5
        "advantages/abs_mean": 7 / 9,
        "groups/zero_variance_fraction": 0.5,  # (1, 0) varies, (.5, .5) does not
    }
    # mismatch k3 is KL(sampler || trainer) per token, with d = sampler - trainer: exp(-d) - 1 + d
    diffs = [-0.1, 0.1, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.4]  # sampler - trainer on the 9 tokens
    expected["mismatch/sampler_trainer_k3"] = sum(math.exp(-d) - 1 + d for d in diffs) / 9
    assert set(expected) <= set(figures), sorted(set(expected) - set(figures))
    for key, value in expected.items():
        assert figures[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert all(isinstance(v, float) and np.isfinite(v) for v in figures.values())


def test_rollout_figures_without_groups_or_response():
    r = hand_rollout()
    figures = rollout_figures(r["groups"], r["rewards"], r["seq_kl"], r["old_logps"], r["ref_logps"],
                              r["recomputed"], r["sampler_logps"], r["response_mask"], r["entropy"],
                              r["advantages"], group_size=1)
    assert "groups/zero_variance_fraction" not in figures  # no groups to compare (PPO, ReMax)
    empty = np.zeros_like(r["response_mask"])
    figures = rollout_figures(r["groups"], r["rewards"], r["seq_kl"], r["old_logps"], r["ref_logps"],
                              r["recomputed"], r["sampler_logps"], empty, r["entropy"], r["advantages"],
                              group_size=2)
    for key in ("kl/ref_k1", "kl/ref_k3", "entropy", "mismatch/sampler_trainer_abs", "mismatch/sampler_trainer_max",
                "advantages/abs_mean", "response/length_mean"):
        assert figures[key] == 0.0, key  # an empty mask averages to 0, never NaN or the garbage


def test_rollout_figures_without_a_reference_have_no_kl():
    r = hand_rollout()
    args = (r["recomputed"], r["sampler_logps"], r["response_mask"], r["entropy"], r["advantages"])
    with_ref = rollout_figures(r["groups"], r["rewards"], r["seq_kl"], r["old_logps"], r["ref_logps"], *args,
                               group_size=2)
    without = rollout_figures(r["groups"], r["rewards"], None, r["old_logps"], None, *args, group_size=2)
    assert {k for k in with_ref if k.startswith("kl/")} == {"kl/ref_seq", "kl/ref_k1", "kl/ref_k3"}
    assert not [k for k in without if k.startswith("kl/")]
    assert without == {k: v for k, v in with_ref.items() if not k.startswith("kl/")}  # the rest unchanged
    with pytest.raises(ValueError, match="both None"):
        rollout_figures(r["groups"], r["rewards"], r["seq_kl"], r["old_logps"], None, *args, group_size=2)


def test_rollout_figures_without_advantages_have_no_advantage_figures():
    """A loss that reads no advantage (exact on-policy distillation) passes ``None``: no
    ``advantages/*`` figure (not a constant 0), every other figure unchanged."""
    r = hand_rollout()
    head = (r["groups"], r["rewards"], r["seq_kl"], r["old_logps"], r["ref_logps"], r["recomputed"],
            r["sampler_logps"], r["response_mask"], r["entropy"])
    with_advantages = rollout_figures(*head, r["advantages"], group_size=2)
    without = rollout_figures(*head, None, group_size=2)
    assert {k for k in with_advantages if k.startswith("advantages/")} == {"advantages/mean", "advantages/abs_mean"}
    assert without == {k: v for k, v in with_advantages.items() if not k.startswith("advantages/")}
