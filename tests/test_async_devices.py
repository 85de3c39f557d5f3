"""The asynchronous sampler on devices of its own (``rollout.async.devices``): the learner
on the rest, the weights moved device to device after each update, and the same run as
the time-sliced schedule. The runs are tests/async_devices_check.py's, on 8 fake CPU
devices in a subprocess."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from alignax.config import ConfigError
from alignax.trainers.api import load_config
from alignax.trainers.config import AsyncSection, RolloutSection
from alignax.trainers.engine.setup import split_sampler_devices
from tests.fake_devices import run_check


@pytest.fixture(scope="module")
def runs():
    return run_check("async_devices_check.py")


def test_the_sampler_on_its_own_devices_trains_like_the_time_sliced_schedule(runs):
    """4 + 4 devices against 4 time-sliced ones at staleness 1: the same programs on the same
    mesh shapes, so the same samples, figures and parameters bit for bit (measured: every
    figure and parameter sum equal, max parameter difference 0.0; CPU, jax 0.10.2)."""
    assert runs["devices"] == 8
    assert runs["split"]["history"] == runs["sliced"]["history"]
    assert runs["split"]["param_sums"] == runs["sliced"]["param_sums"]
    assert runs["max_param_diff"] == 0.0
    assert [h["async/staleness"] for h in runs["split"]["history"]] == [0.0, 1.0, 1.0]
    assert min(h["grad_norm"] for h in runs["split"]["history"]) > 0  # it trained


def test_staleness_stays_within_the_bound_on_its_own_devices(runs):
    assert [h["async/staleness"] for h in runs["split_k2"]["history"]] == [0.0, 1.0, 2.0]
    # rollout 2 was sampled with older weights than at staleness 1: another sample
    assert runs["split_k2"]["history"][2] != runs["split"]["history"][2]


def test_weights_move_to_the_samplers_devices_without_the_host(runs):
    """The sampler's copy lies on devices 4..7 only (the learner's state on 0..3); making it
    under transfer guards that refuse every host<->device transfer succeeds; the compiled
    program that lays it out has no host callback and no host memory; the values are the
    parameters'."""
    w = runs["weights"]
    assert w["training_devices"] == [0, 1, 2, 3]
    assert w["sampler_mesh_devices"] == w["copy_devices"] == [4, 5, 6, 7]
    assert w["copy_specs_match_mesh"] and w["copy_equals_params"]
    assert w["host_callbacks"] == 0 and w["host_memory_space"] == 0


def _devices(per_process: list[int]):
    return [SimpleNamespace(id=p * 100 + i, process_index=p) for p, n in enumerate(per_process) for i in range(n)]


def _config(devices: int, staleness: int = 1):
    return SimpleNamespace(rollout=RolloutSection(async_=AsyncSection(max_staleness=staleness, devices=devices)))


def test_the_samplers_group_is_the_last_of_each_process_and_disjoint_from_the_learners():
    devices = _devices([4, 4])
    learner, sampler = split_sampler_devices(_config(4), devices)
    assert [d.id for d in learner] == [0, 1, 100, 101] and [d.id for d in sampler] == [2, 3, 102, 103]
    assert not {d.id for d in learner} & {d.id for d in sampler} and len(learner) + len(sampler) == 8
    assert split_sampler_devices(_config(0), devices) == (devices, None)  # time-sliced
    assert split_sampler_devices(_config(4, staleness=0), devices) == (devices, None)


def test_one_device_per_process_is_one_group_time_sliced(caplog):
    devices = _devices([1, 1])
    assert split_sampler_devices(_config(2), devices) == (devices, None)
    assert "one device per process is one group" in caplog.text


@pytest.mark.parametrize("count, per_process", [(2, [4, 4]), (6, [4, 4]), (3, [4, 4]), (8, [4, 4])])
def test_a_group_that_does_not_split_evenly_is_refused_naming_the_key(count, per_process):
    with pytest.raises(ConfigError, match=rf"rollout\.async\.devices={count}.*\[4, 4\] training devices, so use 4"):
        split_sampler_devices(_config(count), _devices(per_process))


@pytest.mark.parametrize("overrides, message", [
    (["rollout.async.devices=4"], "rollout.async.devices=4 gives the sampler devices of its own"),
    (["rollout.async.devices=4", "rollout.async.max_staleness=1", "rollout.old_logps=sampler",
      "rollout.mesh=[2,1,1]"], r"rollout.mesh=\[2, 1, 1\] spans 2 devices; the sampler's group \(rollout.async.devices\) "
                               "has 4"),
    (["rollout.async.devices=-1"], "rollout.async.devices must be >= 0"),
])
def test_async_devices_settings_that_cannot_work_are_refused(overrides, message):
    with pytest.raises((ConfigError, ValueError), match=message.replace(".", r"\.") if "\\" not in message else message):
        load_config(data={"algorithm": "grpo", "data": {"format": "prompt"}}, overrides=overrides)


def test_a_matching_rollout_mesh_is_accepted():
    config = load_config(data={"algorithm": "grpo", "data": {"format": "prompt"}},
                         overrides=["rollout.async.devices=4", "rollout.async.max_staleness=1",
                                    "rollout.old_logps=sampler", "rollout.mesh=[2,1,2]"])
    assert dataclasses.asdict(config.rollout.async_) == {"max_staleness": 1, "devices": 4}
