"""The monitor's actions (alignax/trainers/online/guard.py) on synthetic metric streams, no
model: every alarm fires its action on a stream built to trip it and stays quiet on one
built not to; ``stop`` raises the exit-3 error naming the alarm; ``rollback`` restores the
gold-best checkpoint bit for bit and applies the learning-rate and KL factors; the KL budget
stops or raises beta; events reach alarms.jsonl; the defaults are today's alarms."""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from alignax import kl as kl_lib
from alignax.trainers import monitor_settings
from alignax.trainers.config import MonitorSection
from alignax.trainers.engine.step import TrainState
from alignax.trainers.online.guard import EXIT_STATUS, AlarmStopError, Guard
from alignax.trainers.online.monitoring import AlarmSettings, Alarms

QUIET = {"kl/ref_seq": 0.5, "entropy": 1.0, "response/length_mean": 10.0, "reward/total": 0.0,
         "grad_norm_max": 1.0, "clipfrac_low": 0.0, "clipfrac_high": 0.0, "update_skipped": 0.0, "epochs_run": 1.0}


def make_state(value: float, coef: float = 0.1, rollouts: int = 0) -> TrainState:
    """A train state whose params and optimiser moments are filled with ``value``."""
    params = {"w": jnp.full((3, 4), value, jnp.float32), "b": jnp.arange(4, dtype=jnp.float32) * value}
    return TrainState(step=jnp.asarray(rollouts, jnp.int32), params=params,
                      opt_state={"mu": jax_tree_scale(params, 0.5)}, rng=jnp.zeros((2,), jnp.uint32),
                      nonfinite_streak=jnp.zeros((), jnp.int32), nonfinite_total=jnp.zeros((), jnp.int32),
                      extra={"kl_coef": kl_lib.KLControllerState(coef=jnp.asarray(coef, jnp.float32)),
                             "rollouts": jnp.asarray(rollouts, jnp.int32)})


def jax_tree_scale(tree, factor):
    return {k: v * factor for k, v in tree.items()}


class ScriptedGold:
    """A gold scorer returning the scripted scores in turn, recording the params it saw."""

    def __init__(self, scores):
        self.scores, self.seen = list(scores), []

    def score(self, params):
        self.seen.append(np.asarray(params["w"])[0, 0].item())
        return {"gold/score": self.scores.pop(0)}


class LearningRate:
    def __init__(self):
        self.factors = []

    def __call__(self, factor):
        self.factors.append(factor)


def make_guard(tmp_path, monitor: MonitorSection, gold=None):
    alarms = Alarms(AlarmSettings.from_monitor(monitor))
    lr = LearningRate()
    guard = Guard(monitor, str(tmp_path), alarms=alarms, gold=gold, scale_learning_rate=lr)
    return guard, alarms, lr


def run_stream(guard, alarms, stream, state=None, start=1):
    """Feed each step's figures through the alarms then the guard (as the trainer and the
    loop do); returns the last state and each step's metrics."""
    state = make_state(1.0) if state is None else state
    out = []
    for i, figures in enumerate(stream):
        step = start + i
        metrics = {**QUIET, **figures}
        metrics.update(alarms.update(step, kl=metrics["kl/ref_seq"], entropy=metrics["entropy"],
                                     length=metrics["response/length_mean"], reward=metrics["reward/total"],
                                     grad_norm=metrics["grad_norm_max"]))
        state = guard(step, state, metrics)
        out.append(metrics)
    return state, out


def events(tmp_path):
    path = os.path.join(tmp_path, "alarms.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line) for line in open(path, encoding="utf-8")]


# Each alarm: the monitor settings that arm it, a stream that trips it at its last step, and
# one that does not trip it.
ACCEL = [0.25, 0.5, 1.0, 1.75, 2.75, 4.0]
TRIPS = {
    "kl_acceleration": ({}, [{"kl/ref_seq": v} for v in ACCEL], [{"kl/ref_seq": 0.5 + 0.25 * i} for i in range(6)]),
    "entropy_collapse": ({}, [{"entropy": 2.0}, {"entropy": 0.3}], [{"entropy": 2.0}, {"entropy": 1.9}]),
    "length_drift": ({"window": 2}, [{"response/length_mean": v} for v in (10.0, 10.0, 20.0)],
                     [{"response/length_mean": v} for v in (10.0, 10.0, 12.0)]),
    "no_signal": ({"streak": 2}, [{"grad_norm_max": 0.0}] * 2, [{"grad_norm_max": 0.0}, {"grad_norm_max": 1.0}]),
    "clip_fraction": ({"max": 0.2, "window": 2}, [{"clipfrac_low": 0.1, "clipfrac_high": 0.2}] * 2,
                      [{"clipfrac_low": 0.1, "clipfrac_high": 0.05}] * 2),
    "nonfinite_rate": ({"max": 0.6, "window": 2}, [{"update_skipped": 1.0}] * 2,
                       [{"update_skipped": 1.0}, {"update_skipped": 0.0}]),
}


def armed(name: str, action: str, **settings) -> MonitorSection:
    monitor = MonitorSection()
    return dataclasses.replace(monitor, **{name: dataclasses.replace(getattr(monitor, name), action=action,
                                                                      **settings)})


@pytest.mark.parametrize("name", list(TRIPS))
def test_warn_fires_on_the_tripping_stream_only(tmp_path, name):
    settings, trip, quiet = TRIPS[name]
    guard, alarms, _ = make_guard(tmp_path / "trip", armed(name, "warn", **settings))
    state, out = run_stream(guard, alarms, trip)
    assert [m[f"alarm/{name}"] for m in out][-1] == 1.0
    assert [(e["alarm"], e["action"], e["step"]) for e in events(tmp_path / "trip")][-1] == (name, "warn", len(trip))
    np.testing.assert_array_equal(state.params["w"], make_state(1.0).params["w"])  # warn changes nothing

    guard, alarms, _ = make_guard(tmp_path / "quiet", armed(name, "warn", **settings))
    _, out = run_stream(guard, alarms, quiet)
    assert all(m.get(f"alarm/{name}", 0.0) == 0.0 for m in out)
    assert events(tmp_path / "quiet") == []


@pytest.mark.parametrize("name", list(TRIPS))
def test_stop_raises_the_exit_3_error_naming_the_alarm(tmp_path, name):
    settings, trip, quiet = TRIPS[name]
    guard, alarms, _ = make_guard(tmp_path / "quiet", armed(name, "stop", **settings))
    run_stream(guard, alarms, quiet)  # no stop
    guard, alarms, _ = make_guard(tmp_path / "trip", armed(name, "stop", **settings))
    with pytest.raises(AlarmStopError) as info:
        run_stream(guard, alarms, trip)
    assert info.value.exit_code == EXIT_STATUS == 3
    message = str(info.value)
    assert f"monitor.{name}.action=stop" in message and f"step {len(trip)}" in message and "\n" not in message
    assert [e["action"] for e in events(tmp_path / "trip")][-2:] == ["stop", "stop"]  # the alarm, then the stop


@pytest.mark.parametrize("name", list(TRIPS))
def test_rollback_restores_the_gold_best_checkpoint_and_applies_the_factors(tmp_path, name):
    settings, trip, _ = TRIPS[name]
    monitor = armed(name, "rollback", **settings)
    monitor = dataclasses.replace(monitor, gold=dataclasses.replace(monitor.gold, every=1),
                                  rollback=dataclasses.replace(monitor.rollback, lr_factor=0.25, kl_factor=3.0))
    # gold: 0.2 at the start, then 0.5 at step 1 (the best), then lower: step 1's state is restored
    gold = ScriptedGold([0.2, 0.5] + [0.1] * len(trip))
    guard, alarms, lr = make_guard(tmp_path, monitor, gold)
    guard.begin(make_state(0.0, coef=0.1))
    states = [make_state(float(i), coef=0.1 * (i + 1), rollouts=i) for i in range(1, len(trip) + 1)]
    restored = None
    for i, figures in enumerate(trip):
        _, out = run_stream(guard, alarms, [figures], state=states[i], start=i + 1)
        restored = _
    best = states[0]
    np.testing.assert_array_equal(restored.params["w"], best.params["w"])  # bit for bit
    np.testing.assert_array_equal(restored.params["b"], best.params["b"])
    np.testing.assert_array_equal(restored.opt_state["mu"]["w"], best.opt_state["mu"]["w"])
    assert float(restored.extra["kl_coef"].coef) == np.float32(0.2) * np.float32(3.0)  # step 1's coef x kl_factor
    assert int(restored.extra["rollouts"]) == len(trip)  # the run's counters go on
    assert lr.factors == [0.25] and guard.rollbacks == 1 and out[-1]["guard/rollbacks"] == 1.0
    rollback = [e for e in events(tmp_path) if e["action"] == "rollback" and "restored_step" in e]
    assert rollback and rollback[-1]["restored_step"] == 1 and rollback[-1]["alarm"] == name


@pytest.mark.parametrize("name", list(TRIPS))
def test_rollback_does_nothing_on_the_quiet_stream(tmp_path, name):
    settings, _, quiet = TRIPS[name]
    monitor = armed(name, "rollback", **settings)
    monitor = dataclasses.replace(monitor, gold=dataclasses.replace(monitor.gold, every=1))
    guard, alarms, lr = make_guard(tmp_path, monitor, ScriptedGold([0.2, 0.5] + [0.1] * len(quiet)))
    guard.begin(make_state(0.0))
    last = make_state(float(len(quiet)), rollouts=len(quiet))
    state, out = run_stream(guard, alarms, quiet[:-1])
    state, final = run_stream(guard, alarms, quiet[-1:], state=last, start=len(quiet))
    assert state is last and guard.rollbacks == 0 and lr.factors == []  # the state the step gave goes on
    assert all(m.get(f"alarm/{name}", 0.0) == 0.0 and m["guard/rollbacks"] == 0.0 for m in out + final)
    assert events(tmp_path) == []


# gold_divergence (gold points every rollout, window 1): the proxy rises 0.2 -> 0.3 while the
# gold falls 0.6 -> 0.4 at step 3; quiet: the gold rises with the proxy
GOLD_TRIP, GOLD_QUIET, PROXIES = [0.5, 0.55, 0.6, 0.4], [0.5, 0.6, 0.7, 0.8], [0.1, 0.2, 0.3]


@pytest.mark.parametrize("action", ["warn", "stop", "rollback"])
def test_gold_divergence_acts_on_the_tripping_stream_only(tmp_path, action):
    def guarded(directory, golds):
        monitor = armed("gold_divergence", action, window=1, min_gold_drop=0.05)
        monitor = dataclasses.replace(monitor, gold=dataclasses.replace(monitor.gold, every=1))
        guard, alarms, lr = make_guard(directory, monitor, ScriptedGold(golds))
        guard.begin(make_state(0.0))
        return guard, alarms, lr

    def stream(guard, alarms):
        states = [make_state(float(i), rollouts=i) for i in range(1, 4)]
        out = []
        for i, (proxy, state) in enumerate(zip(PROXIES, states)):
            state, metrics = run_stream(guard, alarms, [{"reward/total": proxy}], state=state, start=i + 1)
            out += metrics
        return state, out

    guard, alarms, lr = guarded(tmp_path / "quiet", GOLD_QUIET)
    state, out = stream(guard, alarms)
    assert [m["alarm/gold_divergence"] for m in out] == [0.0, 0.0, 0.0] and events(tmp_path / "quiet") == []
    assert float(state.params["w"][0, 0]) == 3.0 and lr.factors == []
    guard, alarms, lr = guarded(tmp_path / "trip", GOLD_TRIP)
    if action == "stop":
        with pytest.raises(AlarmStopError, match="monitor.gold_divergence.action=stop: step 3: the proxy reward rose"):
            stream(guard, alarms)
        return
    state, out = stream(guard, alarms)
    assert [m["alarm/gold_divergence"] for m in out] == [0.0, 0.0, 1.0]
    assert [(e["step"], e["alarm"], e["action"]) for e in events(tmp_path / "trip")][0] == (3, "gold_divergence",
                                                                                              action)
    if action == "warn":
        assert float(state.params["w"][0, 0]) == 3.0 and lr.factors == []
    else:  # step 2's state: the best gold (0.6)
        assert float(state.params["w"][0, 0]) == 2.0 and lr.factors == [0.5] and guard.rollbacks == 1


def test_rollback_past_max_rollbacks_stops(tmp_path):
    monitor = armed("entropy_collapse", "rollback")
    monitor = dataclasses.replace(monitor, rollback=dataclasses.replace(monitor.rollback, max_rollbacks=1))
    guard, alarms, _ = make_guard(tmp_path, monitor, ScriptedGold([0.5, 0.1, 0.1]))
    guard.begin(make_state(0.0))
    state, _ = run_stream(guard, alarms, [{"entropy": 2.0}, {"entropy": 0.1}])  # the first rollback
    assert guard.rollbacks == 1
    with pytest.raises(AlarmStopError, match=r"max_rollbacks=1"):
        run_stream(guard, alarms, [{"entropy": 0.1}], state=state, start=3)


def test_gold_divergence_fires_when_proxy_rises_while_gold_falls(tmp_path):
    def run(golds, proxies, directory):
        monitor = armed("gold_divergence", "stop", window=1, min_gold_drop=0.05)
        monitor = dataclasses.replace(monitor, gold=dataclasses.replace(monitor.gold, every=1))
        guard, alarms, _ = make_guard(directory, monitor, ScriptedGold(golds))
        guard.begin(make_state(0.0))
        return run_stream(guard, alarms, [{"reward/total": p} for p in proxies])

    run([0.5, 0.6, 0.7, 0.8], [0.1, 0.2, 0.3], tmp_path / "both-rise")  # gold follows the proxy: quiet
    run([0.5, 0.6, 0.58, 0.4], [0.1, 0.2, 0.15], tmp_path / "both-fall")  # gold falls but so does the proxy
    run([0.5, 0.6, 0.57, 0.56], [0.1, 0.2, 0.3], tmp_path / "small-drop")  # a drop within min_gold_drop
    with pytest.raises(AlarmStopError, match=r"step 3: the proxy reward rose 0.2 -> 0.3 while the gold score fell "
                                              r"0.6 -> 0.4 \(steps 2 -> 3\)"):
        run([0.5, 0.55, 0.6, 0.4], [0.1, 0.2, 0.3], tmp_path / "diverge")
    line = json.loads(open(tmp_path / "diverge" / "alarms.jsonl").readline())
    assert (line["step"], line["alarm"], line["action"]) == (3, "gold_divergence", "stop")


def test_gold_points_carry_proxy_and_sqrt_kl(tmp_path):
    monitor = dataclasses.replace(MonitorSection(), gold=dataclasses.replace(MonitorSection().gold, every=2))
    gold = ScriptedGold([0.1, 0.3])
    guard, alarms, _ = make_guard(tmp_path, monitor, gold)
    assert guard.begin(make_state(0.0)) == {"gold/score": 0.1, "gold/sqrt_kl": 0.0, "gold/best": 0.1}
    _, out = run_stream(guard, alarms, [{"reward/total": 0.2, "kl/ref_seq": 1.0},
                                        {"reward/total": 0.4, "kl/ref_seq": 2.25}])
    assert "gold/score" not in out[0]  # every 2 rollouts
    assert out[1]["gold/score"] == 0.3 and out[1]["gold/proxy"] == pytest.approx(0.3)  # mean of 0.2 and 0.4
    assert out[1]["gold/sqrt_kl"] == 1.5 and out[1]["gold/best"] == 0.3
    guard.finish()
    saved = json.load(open(tmp_path / "gold.json"))
    assert [p["step"] for p in saved["points"]] == [0, 2]
    assert open(tmp_path / "gold.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_kl_budget_stops_or_raises_beta(tmp_path):
    over, under = [{"kl/ref_seq": 0.5}, {"kl/ref_seq": 2.0}], [{"kl/ref_seq": 0.5}, {"kl/ref_seq": 0.9}]
    budget = MonitorSection().kl_budget
    stop = dataclasses.replace(MonitorSection(), kl_budget=dataclasses.replace(budget, max=1.0))
    guard, alarms, _ = make_guard(tmp_path / "under", stop)
    run_stream(guard, alarms, under)
    guard, alarms, _ = make_guard(tmp_path / "stop", stop)
    with pytest.raises(AlarmStopError, match=r"monitor.kl_budget.action=stop: step 2: KL to the reference 2 nats"):
        run_stream(guard, alarms, over)
    raise_beta = dataclasses.replace(MonitorSection(), kl_budget=dataclasses.replace(
        budget, max=1.0, action="raise_beta", beta_factor=2.0))
    guard, alarms, _ = make_guard(tmp_path / "beta", raise_beta)
    state, out = run_stream(guard, alarms, over + over[1:], state=make_state(1.0, coef=0.25))
    assert float(state.extra["kl_coef"].coef) == 1.0  # 0.25 x 2 x 2: raised at each rollout over budget
    assert [m.get("guard/kl_coef_raised", 0.0) for m in out] == [0.0, 1.0, 1.0]
    assert [e["action"] for e in events(tmp_path / "beta")] == ["raise_beta", "raise_beta"]
    guard, alarms, _ = make_guard(tmp_path / "beta-under", raise_beta)
    state, out = run_stream(guard, alarms, under, state=make_state(1.0, coef=0.25))
    assert float(state.extra["kl_coef"].coef) == 0.25 and events(tmp_path / "beta-under") == []
    assert all("guard/kl_coef_raised" not in m and "alarm/kl_budget" not in m for m in out)


def test_the_defaults_are_the_former_warn_only_alarms():
    monitor = MonitorSection()
    assert AlarmSettings.from_monitor(monitor) == AlarmSettings(length_window=5)
    assert set(monitor_settings.actions(monitor).values()) == {"warn"}
    assert monitor.clip_fraction.max is None and monitor.nonfinite_rate.max is None and monitor.kl_budget.max is None


def test_guard_state_round_trips_through_a_checkpoint_meta(tmp_path):
    monitor = dataclasses.replace(MonitorSection(), gold=dataclasses.replace(MonitorSection().gold, every=1))
    guard, alarms, _ = make_guard(tmp_path, monitor, ScriptedGold([0.1, 0.2]))
    guard.begin(make_state(0.0))
    run_stream(guard, alarms, [{"reward/total": 0.3}])
    saved = json.loads(json.dumps(guard.state()))
    resumed, _, _ = make_guard(tmp_path, monitor, ScriptedGold([]))
    resumed.set_state(saved)
    assert resumed.state() == guard.state() and resumed.best_gold == 0.2


def test_a_resumed_run_drops_a_gold_best_its_abandoned_run_saved_later(tmp_path):
    """The run saved its meta at step 1 (best gold 0.2 there), went on to save a new gold-best
    at step 2, and stopped before its step-2 checkpoint. Resumed from step 1, that step-2
    state is not this run's: it is deleted, a rollback before the next gold point stops
    instead of restoring it, and the next best saves (at a step the abandoned run used)."""
    monitor = dataclasses.replace(MonitorSection(), gold=dataclasses.replace(MonitorSection().gold, every=1))
    guard, alarms, _ = make_guard(tmp_path, monitor, ScriptedGold([0.1, 0.2, 0.9]))
    guard.begin(make_state(0.0))
    run_stream(guard, alarms, [{"reward/total": 0.3}], state=make_state(1.0, rollouts=1))
    saved = json.loads(json.dumps(guard.state()))  # the meta of checkpoint step 1
    run_stream(guard, alarms, [{"reward/total": 0.3}], state=make_state(2.0, rollouts=2), start=2)
    assert guard.best.step() == 2  # the abandoned run's new best
    guard.finish()
    resumed, alarms2, _ = make_guard(tmp_path, armed("entropy_collapse", "rollback"), ScriptedGold([0.5]))
    resumed.set_state(saved)
    assert resumed.best.step() is None and resumed.best_gold is None
    # the gold point of the replayed step 2 saves the best again (step 2 was the abandoned run's)
    resumed.monitor = dataclasses.replace(resumed.monitor, gold=dataclasses.replace(resumed.monitor.gold, every=1))
    run_stream(resumed, alarms2, [{"reward/total": 0.3}], state=make_state(5.0, rollouts=2), start=2)
    assert resumed.best.step() == 2 and resumed.best_gold == 0.5
    restored, _ = resumed.best.restore(make_state(0.0))
    assert float(restored.params["w"][0, 0]) == 5.0
