"""Frozen models held in host memory (alignax/parallel/placement.py, the ``placement:`` section).

- ``placement.reference: host``: a DPO run's reference lies in ``pinned_host`` memory before
  and after a step, the compiled step takes it there (its input shardings, and the
  ``S(5)`` host memory space in the program's entry layout, which the device run lacks),
  and the step's loss, metrics and updated params equal the device-placed run's.
- Online RL: the KL reference's forward takes a host-held reference, and reward models
  held in host memory score exactly as device-held ones do; the trainer places both.
- The keys are refused where there is no such model.

What CPU cannot show: host and device memory are the same RAM there, so no memory is
saved (the compiled program's memory_analysis counts a pinned_host argument in its
argument bytes on CPU); on a GPU or TPU the device's peak should drop by the reference's
size, at the cost of one host-to-device transfer per program run.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alignax.config import ConfigError
from alignax.parallel.placement import HOST_MEMORY, place
from alignax.trainers.api import build_trainer, load_config
from tests.rl_toy import toy_config, toy_prompts
from tests.trainer_helpers import separable_pairs, tiny_config

HOST_SPACE = "S(5)"  # XLA's memory space of pinned host memory, in the compiled program's layouts


def kinds(tree) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def moved_in(traced) -> int:
    """How many of the program's arguments it moves into device memory. The CPU backend
    lowers ``jax.device_put(x, jax.memory.Space.Device)`` to nothing (host and device
    memory are one there), so the program is lowered for TPU, where each move is an
    ``annotate_device_placement`` custom call on the argument (none when no argument lies
    in host memory)."""
    text = traced.lower(lowering_platforms=("tpu",)).as_text()
    return len(re.findall(r'@annotate_device_placement\(%arg\d+\).*_xla_buffer_placement = "device"', text))


def entry_layout(compiled) -> str:
    """The compiled program's ``entry_computation_layout={...}`` (its parameters' and
    results' layouts, memory spaces included)."""
    header = compiled.as_text().splitlines()[0]
    return header[header.index("entry_computation_layout"):]


@pytest.fixture(scope="module")
def dpo_steps(tmp_path_factory, toy_model):
    """One DPO step with the reference on the device and one with it in host memory:
    ``{where: (memory kinds of the reference before and after the step, the traced step,
    its metrics, the params after it and their memory kinds)}``."""
    records = separable_pairs(16)
    out = {}
    for where in ("device", "host"):
        config = tiny_config(tmp_path_factory.mktemp(where), "dpo", steps=1, model_dir=toy_model,
                             dpo={"beta": 0.5}, placement={"reference": where}, checkpoint={"enabled": False})
        trainer = build_trainer(config, records=records)
        state, reference = trainer.start()
        frozen = trainer.frozen_inputs(reference)
        before = kinds(frozen["reference"])
        batch = trainer.placer(next(trainer.data.iterator("train")))
        traced = trainer.step.trace(state, frozen, batch)
        state, step_out = trainer.step(state, frozen, batch)
        out[where] = (before, kinds(frozen["reference"]), traced, jax.device_get(step_out.metrics),
                      jax.device_get(state.params), kinds(state.params))
    return out


def test_a_host_placed_reference_stays_in_host_memory_and_the_step_moves_it_in(dpo_steps):
    before, after, traced, _, _, params_kinds = dpo_steps["host"]
    assert before == after == {HOST_MEMORY}
    assert params_kinds == {"device"}  # the trained params are not moved
    compiled = traced.lower().compile()
    (_, frozen_shardings, _), _ = compiled.input_shardings
    reference = jax.tree.leaves(frozen_shardings["reference"])
    assert {s.memory_kind for s in reference} == {HOST_MEMORY}
    assert HOST_SPACE in entry_layout(compiled)
    assert moved_in(traced) == len(reference)  # each reference array, and nothing else

    before, after, traced, _, _, _ = dpo_steps["device"]
    assert before == after == {"device"}
    assert HOST_SPACE not in entry_layout(traced.lower().compile())
    assert moved_in(traced) == 0


def test_a_host_placed_reference_steps_as_the_device_placed_one(dpo_steps):
    *_, device_metrics, device_params, _ = dpo_steps["device"]
    *_, host_metrics, host_params, _ = dpo_steps["host"]
    assert device_metrics["loss"] == pytest.approx(np.log(2), abs=1e-6)  # policy == reference at step 0 ...
    assert device_metrics["grad_norm"] > 0  # ... yet it has a gradient to follow
    for key, value in device_metrics.items():
        np.testing.assert_allclose(host_metrics[key], value, rtol=0, atol=1e-6, err_msg=key)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-6), host_params, device_params)


def test_online_reference_and_reward_models_in_host_memory(tmp_path, toy_model):
    """A GRPO run with a KL and a reward model, both placed on the host: the trainer holds
    them in pinned_host memory; the reference's forward (the rollout's reference
    log-probs) and the reward models' scores equal those of device-held copies, and their
    compiled programs take the host-held weights (``S(5)``)."""
    from alignax.models import from_pretrained, save_pretrained

    scorer_dir = str(tmp_path / "scorer")
    save_pretrained(from_pretrained(toy_model, kind="reward", new_head=True, seed=3), scorer_dir)
    config = toy_config(tmp_path, toy_model, "grpo", steps=1, checkpoint={"enabled": False},
                        grpo={"kl_coef": 0.1}, rewards={"reward_models": [scorer_dir]},
                        placement={"reference": "host", "reward_models": "host"})
    trainer = build_trainer(config, records=toy_prompts(8))
    rms = trainer.scorer.reward_models
    assert kinds(rms.states) == {HOST_MEMORY}
    _, frozen = trainer.start()
    assert kinds(frozen["reference"]) == {HOST_MEMORY}

    rng, width = np.random.default_rng(0), trainer.prompt_len + trainer.max_new  # a rollout's rows
    tokens = jnp.asarray(rng.integers(3, 32, size=(4, width)), jnp.int32)
    attention = jnp.asarray(np.arange(width)[None] < rng.integers(4, width + 1, size=(4, 1)), jnp.int32)
    positions = jnp.maximum(jnp.cumsum(attention, axis=-1) - 1, 0)
    on_device = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")), frozen["reference"])
    host_logps = trainer._reference_forward(frozen["reference"], tokens, positions, attention)[0]
    device_logps = trainer._reference_forward(on_device, tokens, positions, attention)[0]
    np.testing.assert_array_equal(np.asarray(host_logps), np.asarray(device_logps))
    traced = trainer._reference_forward.trace(frozen["reference"], tokens, positions, attention)
    assert moved_in(traced) == len(jax.tree.leaves(frozen["reference"]))
    assert moved_in(trainer._reference_forward.trace(on_device, tokens, positions, attention)) == 0

    score = rms.score_fn()
    device_states = jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind("device")), rms.states)
    host_scores = score(rms.states, tokens, positions, attention)
    np.testing.assert_array_equal(np.asarray(host_scores), np.asarray(score(device_states, tokens, positions, attention)))
    assert np.ptp(np.asarray(host_scores)) > 0
    assert moved_in(score.trace(rms.states, tokens, positions, attention)) == len(jax.tree.leaves(rms.states))
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
    refused({"algorithm": "dpo", "dpo": {"loss": "simpo"}}, ["placement.reference=host"], "placement.reference")
    refused({"algorithm": "dpo", "dpo": {"reference": "precomputed"}}, ["placement.reference=host"],
            "placement.reference")
    refused({**prompts, "grpo": {"kl_coef": 0.0}}, ["placement.reference=host"], "placement.reference")
    refused({"algorithm": "dpo", "lora": {"rank": 4}}, ["placement.reference=host"], "placement.reference")
    refused(prompts, ["placement.reward_models=host"], "placement.reward_models")
    load_config(data={"algorithm": "dpo"}, overrides=["placement.reference=host"])
    load_config(data={**prompts, "grpo": {"kl_coef": 0.1}}, overrides=["placement.reference=host"])
