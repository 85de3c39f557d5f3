"""Frozen models and the optimiser state in host memory (alignax/parallel/placement.py,
the ``placement:`` section).

- ``placement.reference: host`` and ``placement.optimizer_state: host`` on a bfloat16 DPO
  run (Adam's moments and a float32 master copy): the reference and the optimiser state lie
  in ``pinned_host`` memory before and after each step, the compiled step takes them there
  (input shardings; the ``S(5)`` memory space of its entry layout) and writes the updated
  state back there (output shardings), the program lowered for TPU moves exactly those
  arrays in and the state out (``annotate_device_placement``; none in the device-placed
  run), donation still frees the old state, and two steps' figures and the whole state
  equal the device-placed run's within 1e-6.
- Online RL: the trainer places the KL reference, the reward models and the optimiser
  state; the reference's forward and the reward models' scores from host-held weights equal
  those from device-held ones bit for bit, and their programs move exactly those weights in.
- ``submesh`` (tests/submesh_check.py on 8 fake devices): a DPO reference and a GRPO
  reference and reward model on devices of their own; the training step's program touches
  none of those devices and its arguments shrink by exactly the reference's bytes per device
  (less the log-probs that now ride in the batch), the reference's program runs on the
  sub-mesh only, and the runs step as the device-placed ones do (KTO too); a resumed run
  restores its reference onto the sub-mesh; iterative DPO builds its original-model
  reference there. The two-process version
  (each process sets its last devices apart) is tests/test_multihost.py's GRPO job.
- The keys are refused where there is no such model, and a sub-mesh that would leave a
  process no training device, or not split evenly over the processes, is refused.

What CPU cannot show: host and device memory are the same RAM there, so no memory is
saved (the compiled program's memory_analysis counts a pinned_host argument in its
argument bytes on CPU); on a GPU or TPU the device's peak should drop by the placed arrays'
size (less what is moved back in at the peak), at the cost of host-device transfers.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alignax.config import ConfigError
from alignax.parallel.placement import HOST_MEMORY, PlacementConfig, place, split_devices
from alignax.trainers.api import build_trainer, load_config
from tests.fake_devices import run_check
from tests.support.rl_toy import toy_config, toy_prompts
from tests.support.trainer_helpers import separable_pairs, tiny_config

HOST_SPACE = "S(5)"  # XLA's memory space of pinned host memory, in the compiled program's layouts


def kinds(tree) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def moves(traced, to: str) -> int:
    """How many arrays the program moves into memory ``to`` (``device``: of its arguments;
    ``pinned_host``: anywhere, its results written back there). The CPU backend lowers
    ``jax.device_put(x, jax.memory.Space.Device)`` to nothing (host and device memory are
    one there), so the program is lowered for TPU, where each move is an
    ``annotate_device_placement`` custom call (none at all when no array of the program lies
    in host memory)."""
    text = traced.lower(lowering_platforms=("tpu",)).as_text()
    operand = r"%arg\d+" if to == "device" else r"%[\w#]+"
    return len(re.findall(rf'@annotate_device_placement\({operand}\).*_xla_buffer_placement = "{to}"', text))


def entry_layout(compiled) -> str:
    """The compiled program's ``entry_computation_layout={...}`` (its parameters' and
    results' layouts, memory spaces included)."""
    header = compiled.as_text().splitlines()[0]
    return header[header.index("entry_computation_layout"):]


HOST_PLACEMENT = {"reference": "host", "optimizer_state": "host"}


@pytest.fixture(scope="module")
def dpo_steps(tmp_path_factory, toy_model):
    """Two DPO steps (bfloat16 params: the optimiser state holds Adam's moments and a float32
    master copy) with everything on the device, and with the reference and the optimiser
    state in host memory: ``{where: {...}}`` (the memory kinds seen along the way, the traced
    step, whether the step let go of the donated optimiser state, each step's metrics, the
    state after them)."""
    records = separable_pairs(16)
    out = {}
    for where, placement in (("device", {}), ("host", HOST_PLACEMENT)):
        config = tiny_config(tmp_path_factory.mktemp(where), "dpo", steps=2, model_dir=toy_model,
                             preference={"beta": 0.5}, placement=placement, checkpoint={"enabled": False},
                             precision={"param_dtype": "bfloat16", "compute_dtype": "bfloat16"})
        trainer = build_trainer(config, records=records)
        state, frozen = trainer.start()
        seen = {"reference": [kinds(frozen["reference"])], "opt_state": [kinds(state.opt_state)]}
        batches = trainer.data.iterator("train")
        batch = trainer.placer(next(batches))
        traced = trainer.step.trace(state, frozen, batch)
        compiled = traced.lower().compile()  # the step the loop runs: one compile per arm
        batch_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(batch))
        donated = jax.tree.leaves(state.opt_state)
        metrics = []
        for _ in range(2):
            state, step_out = compiled(state, frozen, batch)
            metrics.append(jax.device_get(step_out.metrics))
            seen["reference"].append(kinds(frozen["reference"]))
            seen["opt_state"].append(kinds(state.opt_state))
            batch = trainer.placer(next(batches))
        out[where] = {"config": config, "batch_bytes": batch_bytes,
                      "seen": seen, "traced": traced, "compiled": compiled, "donated": all(x.is_deleted() for x in donated),
                      "metrics": metrics, "params_kinds": kinds(state.params), "state": jax.device_get(state)}
    return out


def test_host_placed_reference_and_optimizer_state_stay_in_host_memory_and_the_step_moves_them(dpo_steps):
    host = dpo_steps["host"]
    assert host["seen"] == {"reference": [{HOST_MEMORY}] * 3, "opt_state": [{HOST_MEMORY}] * 3}
    assert host["params_kinds"] == {"device"}  # the trained params are not moved
    compiled = host["compiled"]
    (state_shardings, frozen_shardings, _), _ = compiled.input_shardings
    reference = jax.tree.leaves(frozen_shardings["reference"])
    opt_state = jax.tree.leaves(state_shardings.opt_state)
    assert {s.memory_kind for s in reference + opt_state} == {HOST_MEMORY}
    assert {s.memory_kind for s in jax.tree.leaves(compiled.output_shardings[0].opt_state)} == {HOST_MEMORY}
    assert {s.memory_kind for s in jax.tree.leaves(state_shardings.params)} == {"device"}
    assert HOST_SPACE in entry_layout(compiled)
    # each reference and optimiser-state array is moved in; the updated optimiser state goes back out
    assert moves(host["traced"], "device") == len(reference) + len(opt_state)
    assert moves(host["traced"], HOST_MEMORY) == len(opt_state)
    assert host["donated"]  # the host-held optimiser state is donated to the step as on the device

    device = dpo_steps["device"]
    assert device["seen"] == {"reference": [{"device"}] * 3, "opt_state": [{"device"}] * 3}
    assert HOST_SPACE not in entry_layout(device["compiled"])
    assert moves(device["traced"], "device") == moves(device["traced"], HOST_MEMORY) == 0
    assert device["donated"]


def test_host_placement_steps_as_the_device_placement_does(dpo_steps):
    """Both steps' figures, and the whole state after them (params, moments, master copy),
    within 1e-6 of the device-placed run's (measured: equal)."""
    device, host = dpo_steps["device"], dpo_steps["host"]
    assert device["metrics"][0]["loss"] == pytest.approx(np.log(2), abs=1e-3)  # policy == reference at step 0 ...
    assert device["metrics"][0]["grad_norm"] > 0  # ... with a gradient to follow
    for step in range(2):
        for key, value in device["metrics"][step].items():
            np.testing.assert_allclose(host["metrics"][step][key], value, rtol=0, atol=1e-6, err_msg=f"{step} {key}")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                         rtol=0, atol=1e-6), host["state"], device["state"])


def test_online_reference_and_reward_models_in_host_memory(tmp_path, toy_model):
    """A GRPO run with a KL and a reward model, both placed on the host (and its optimiser
    state): the trainer holds them in pinned_host memory; the reference's forward (the rollout's reference
    log-probs) and the reward models' scores equal those of device-held copies, and their
    compiled programs take the host-held weights (``S(5)``)."""
    from alignax.models import from_pretrained, save_pretrained

    scorer_dir = str(tmp_path / "scorer")
    save_pretrained(from_pretrained(toy_model, kind="reward", new_head=True, seed=3), scorer_dir)
    config = toy_config(tmp_path, toy_model, "grpo", steps=1, checkpoint={"enabled": False},
                        grpo={"kl_coef": 0.1}, rewards={"reward_models": [scorer_dir]},
                        placement={"reference": "host", "reward_models": "host", "optimizer_state": "host"})
    trainer = build_trainer(config, records=toy_prompts(8))
    rms = trainer.actors.sampler.scorer.reward_models
    assert kinds(rms.states) == {HOST_MEMORY}
    state, frozen = trainer.start()
    assert kinds(frozen["reference"]) == kinds(state.opt_state) == {HOST_MEMORY}

    rng, width = np.random.default_rng(0), trainer.actors.prompt_len + trainer.actors.max_new  # a rollout's rows
    tokens = jnp.asarray(rng.integers(3, 32, size=(4, width)), jnp.int32)
    attention = jnp.asarray(np.arange(width)[None] < rng.integers(4, width + 1, size=(4, 1)), jnp.int32)
    positions = jnp.maximum(jnp.cumsum(attention, axis=-1) - 1, 0)
    on_device = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")), frozen["reference"])
    host_logps = trainer.actors.forward(frozen["reference"], tokens, positions, attention)[0]
    device_logps = trainer.actors.forward(on_device, tokens, positions, attention)[0]
    np.testing.assert_array_equal(np.asarray(host_logps), np.asarray(device_logps))
    traced = trainer.actors.forward.trace(frozen["reference"], tokens, positions, attention)
    assert moves(traced, "device") == len(jax.tree.leaves(frozen["reference"]))
    assert moves(trainer.actors.forward.trace(on_device, tokens, positions, attention), "device") == 0

    score = rms.score_fn()
    device_states = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")), rms.states)
    host_scores = score(rms.states, tokens, positions, attention)
    np.testing.assert_array_equal(np.asarray(host_scores), np.asarray(score(device_states, tokens, positions, attention)))
    assert np.ptp(np.asarray(host_scores)) > 0
    assert moves(score.trace(rms.states, tokens, positions, attention), "device") == len(jax.tree.leaves(rms.states))
    assert kinds(rms.states) == {HOST_MEMORY}  # scoring does not move the held copy


def test_place_keeps_the_partition_specs():
    mesh = jax.make_mesh((1,), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    tree = {"w": jax.device_put(np.arange(4.0, dtype=np.float32), sharding), "n": None}
    held = place(tree, "host")
    assert held["w"].sharding == sharding.with_memory_kind(HOST_MEMORY) and held["n"] is None
    assert place(tree, "device") is tree


def test_placement_keys_are_refused_where_there_is_no_such_model():
    def refused(data, overrides, key):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(data=data, overrides=overrides)

    prompts = {"algorithm": "grpo", "data": {"format": "prompt"}}
    refused({"algorithm": "sft"}, ["placement.reference=host"], "placement.reference")
    refused({"algorithm": "dpo", "preference": {"loss": "simpo"}}, ["placement.reference=host"], "placement.reference")
    refused({"algorithm": "dpo", "preference": {"reference": "precomputed"}}, ["placement.reference=host"],
            "placement.reference")
    refused({**prompts, "grpo": {"kl_coef": 0.0}}, ["placement.reference=host"], "placement.reference")
    refused({"algorithm": "dpo", "lora": {"rank": 4}}, ["placement.reference=host"], "placement.reference")
    refused(prompts, ["placement.reward_models=host"], "placement.reward_models")
    load_config(data={"algorithm": "dpo"}, overrides=["placement.reference=host"])
    load_config(data={**prompts, "grpo": {"kl_coef": 0.1}}, overrides=["placement.reference=host"])

    # the sub-mesh: its shape with a model on it, and only there
    refused({"algorithm": "dpo"}, ["placement.submesh=[1,2,1]"], "placement.submesh")
    refused({"algorithm": "dpo"}, ["placement.reference=submesh"], "placement.submesh")
    refused({"algorithm": "dpo"}, ["placement.reference=submesh", "placement.submesh=[1,-1,1]"], "placement.submesh")
    refused({"algorithm": "dpo"}, ["placement.reference=submesh", "placement.submesh=[1,2,1]",
                                   "mesh.dcn_shape=[2,1,1]"], "mesh.dcn_shape")
    refused({"algorithm": "dpo", "rewards": {"reward_models": ["rm"]}},
            ["placement.reward_models=submesh", "placement.submesh=[1,2,1]"], "placement.reward_models")
    load_config(data={"algorithm": "dpo"}, overrides=["placement.reference=submesh", "placement.submesh=[1,2,1]"])


def test_a_submesh_takes_the_last_devices_of_each_process():
    """``placement.submesh`` of size S over P processes: the last S / P devices of each
    process (both meshes then give each process one contiguous block of rows)."""
    from types import SimpleNamespace

    devices = [SimpleNamespace(id=p * 100 + i, process_index=p) for p in range(2) for i in range(4)]
    config = PlacementConfig(reference="submesh", submesh=(1, 4, 1))
    training, apart = split_devices(config, devices)
    assert [d.id for d in training] == [0, 1, 100, 101] and [d.id for d in apart] == [2, 3, 102, 103]
    assert split_devices(PlacementConfig(), devices) == (devices, None)
    assert split_devices(PlacementConfig(submesh=(1, 4, 1)), devices) == (devices, None)  # no model placed there
    for shape in ((1, 8, 1), (1, 3, 1)):  # no training device left; 3 does not split over 2 processes
        with pytest.raises(ValueError, match=r"placement\.submesh"):
            split_devices(dataclasses.replace(config, submesh=shape), devices)


@pytest.fixture(scope="module")
def submesh_runs():
    return run_check("submesh_check.py")


def test_a_reference_on_a_submesh_leaves_the_training_devices_and_their_step(submesh_runs):
    r = submesh_runs
    assert r["dpo/device/reference_devices"] == r["dpo/device/params_devices"] == [0, 1, 2, 3]
    assert r["dpo/submesh/reference_devices"] == r["dpo/submesh/reference_program_devices"] == [4, 5, 6, 7]
    assert r["dpo/submesh/params_devices"] == r["dpo/submesh/step_input_devices"] == [0, 1, 2, 3]
    assert r["dpo/submesh/frozen_keys"] == [] and "ref_logps" in r["dpo/submesh/batch_keys"]
    assert r["dpo/submesh/ref_logps_devices"] == [0, 1, 2, 3]  # the log-probs came back to the training mesh
    # the step's arguments lost exactly the reference's bytes on a device, less the log-probs riding in the batch
    saved = r["dpo/device/step_argument_bytes"] - r["dpo/submesh/step_argument_bytes"]
    assert r["dpo/device/reference_bytes_per_device"] > 0
    assert saved == r["dpo/device/reference_bytes_per_device"] - r["dpo/submesh/ref_logps_bytes_per_device"]


def test_a_submesh_reference_steps_as_a_device_reference(submesh_runs):
    """DPO: three steps' figures and the params after them within 1e-6 (measured: equal).
    GRPO with a KL and a reward model on the sub-mesh: two rollouts' figures within 1e-6 and
    the params within 1e-4 (measured 1.0e-5 after two Adam steps at lr 2e-2: the reference's
    log-probs summed on 2 devices instead of 6 differ in the last bits)."""
    r = submesh_runs
    for device, submesh in zip(r["dpo/device/metrics"], r["dpo/submesh/metrics"]):
        for key, value in device.items():
            assert submesh[key] == pytest.approx(value, abs=1e-6), key
    assert r["dpo/device/metrics"][-1]["loss"] < r["dpo/device/metrics"][0]["loss"] - 0.1  # it learns
    assert r["dpo/max_param_diff"] <= 1e-6
    assert r["grpo/submesh/reference_devices"] == r["grpo/submesh/reward_model_devices"] == [6, 7]
    assert r["grpo/device/reward_model_devices"] == r["grpo/submesh/params_devices"] == [0, 1, 2, 3, 4, 5]
    for key in ("reward/total", "reward/reward_model", "kl/ref_seq", "loss", "grad_norm"):
        np.testing.assert_allclose(r[f"grpo/submesh/history/{key}"], r[f"grpo/device/history/{key}"], atol=1e-6,
                                   err_msg=key)
    assert r["grpo/device/history/kl/ref_seq"][-1] > 0.01  # the reference's log-probs are read
    assert r["grpo/max_param_diff"] < 1e-4


def test_kto_a_resumed_run_and_iterative_dpo_read_a_submesh_reference(submesh_runs):
    """KTO's two reference passes (completion and KL partner) ride in the batch: two steps'
    figures equal the device-placed run's; a DPO run stopped after 2 steps and resumed (its
    reference restored onto the sub-mesh) ends as 4 steps in one go (measured: equal); the
    iterative round trainer's original-model reference is built on the sub-mesh."""
    r = submesh_runs
    for device, submesh in zip(r["kto/device"], r["kto/submesh"]):
        for key, value in device.items():
            if not key.startswith("perf/"):
                assert submesh[key] == pytest.approx(value, abs=1e-6), key
    assert r["kto/device"][-1]["rewards/chosen"] != 0  # the reference's log-probs are read
    assert r["resume/resumed_steps"] == [3, 4]
    np.testing.assert_allclose(r["resume/resumed_losses"], r["resume/whole_losses"][2:], atol=1e-6)
    assert r["resume/max_param_diff"] <= 1e-6
    assert r["iterative/devices"] == [4, 5, 6, 7] and r["iterative/max_diff_to_initial"] == 0.0


def test_the_states_are_the_compiled_steps_arguments(dpo_steps):
    """alignax.estimate: the compiled DPO step's arguments are the params, the optimiser
    state (Adam's moments and the master copy) and the reference the estimate counts, plus
    the batch and a few scalars. With them in host memory the estimate moves them to its
    host lines, while the CPU's memory_analysis still counts them among the arguments
    (host memory is device memory there): the saving does not show on CPU."""
    from alignax.estimate import estimate, model_config_for

    device, host = dpo_steps["device"], dpo_steps["host"]
    config = device["config"]
    result = estimate(config, model=model_config_for(config), devices=1, mesh=(1, 1, 1))
    states = sum(result.items[k] for k in ("policy weights", "policy optimizer moments", "policy master weights",
                                           "reference"))
    arguments = device["compiled"].memory_analysis().argument_size_in_bytes
    assert arguments == pytest.approx(states + device["batch_bytes"], rel=0.01)

    placed = estimate(host["config"], model=model_config_for(config), devices=1, mesh=(1, 1, 1))
    assert sorted(placed.host) == ["policy master weights", "policy optimizer moments", "reference"]
    assert sum(placed.host.values()) + placed.items["policy weights"] == pytest.approx(states)
    assert host["compiled"].memory_analysis().argument_size_in_bytes == arguments
