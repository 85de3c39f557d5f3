"""Run by tests/test_online_mesh.py on 8 fake CPU devices: PPO steps with a separate critic
(sampling, the KL penalty, GAE, 2 epochs x 2 minibatches of policy + value updates) on a
(2, 2, 2) mesh against the same steps on one device, same seed. Prints one JSON line of
measured differences.

The bound on the parameter differences is derived as tests/mesh_grpo_check.py derives
GRPO's: a third run, on one device, adds Gaussian noise of float32's reduction-order size
(``sqrt(K) * 2**-24 * rms(g)``, K from :func:`reduction_length`) to every gradient, the
policy's and the critic's, through the trainer's own optimiser (``noisy_gradients``); the
mesh may move the parameters no further from one device than that noise does. Entries
whose gradient is exactly 0 get no noise (``exact_zeros``): the critic reads the
embedding but has no LM head, so the rows of tokens a minibatch lacks get exactly 0 in
any summation order, and noise there moved them by up to 0.10 (8 Adam updates at lr
2e-2 on noise alone) against the mesh's 1.0e-6.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile

import jax
import numpy as np

from alignax.trainers.api import build_trainer
from tests.mesh_grpo_check import noisy_gradients
from tests.support.rl_toy import toy_config, toy_prompts
from tests.support.toy_model import make_toy_model

KEYS = ("reward/total", "response/length_mean", "loss", "grad_norm", "value/loss", "pg_loss", "kl/ref_seq",
        "entropy", "advantages/abs_mean", "approx_kl", "epochs_run")


def ppo_config(tmp, model_dir, shape, pack_groups):
    return toy_config(tmp, model_dir, "ppo", steps=2, checkpoint={"enabled": False},
                      mesh={"shape": list(shape)}, data={"eval_fraction": 0.0},
                      rewards={"functions": {"tests.support.rl_toy:hashed_reward": 1.0}},
                      rollout={"pack_groups": pack_groups},
                      ppo={"critic": "separate", "epochs": 2, "minibatches": 2})


def reduction_length(config) -> int:
    """K, the longest sum an update's gradient element is made of: a kernel's gradient (the
    policy's or the critic's) sums one term per token of the minibatch's rows, ``rows *
    (prompt + response tokens)`` with ``rows = batch_size * num_samples / minibatches``
    (4 * 32 = 128 here); the mesh splits these sums (rows over its 4 batch shards)."""
    rows = config.data.batch_size * config.rollout.num_samples // config.ppo.minibatches
    return rows * (config.data.max_prompt_length + config.rollout.max_new_tokens)


def run(model_dir, shape, pack_groups="auto", noise: bool = False):
    """``(result, params on the host, params as placed, the trainer's packed group size,
    the float32 noise's {reduction_length, noise_relative} or None)``; ``noise``: every
    gradient perturbed by float32's reduction-order noise (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        config = ppo_config(tmp, model_dir, shape, pack_groups)
        length = reduction_length(config)
        relative = float(np.sqrt(length) * 2.0**-24)
        with noisy_gradients(relative, exact_zeros=True) if noise else contextlib.nullcontext():
            trainer = build_trainer(config, records=toy_prompts(24))
            result = trainer.train()
    noise_model = {"reduction_length": length, "noise_relative": relative} if noise else None
    return (result, jax.device_get(result.loop.state.params), result.loop.state.params, trainer.actors.pack_group,
            noise_model)


def diffs(a, b) -> dict[str, float]:
    """Largest and 99.9th-percentile absolute difference over every parameter entry."""
    d = np.concatenate([np.abs(np.asarray(x) - np.asarray(y)).ravel()
                        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))])
    return {"max": float(d.max()), "p999": float(np.quantile(d, 0.999))}


def main() -> int:
    assert jax.device_count() == 8, jax.devices()
    with tempfile.TemporaryDirectory() as model_dir:
        make_toy_model(model_dir)
        # A minibatch's 4 rows are 2 groups of 2: packed, 2 rows, which the mesh's 4 batch
        # devices (data x fsdp) do not split, so pack_groups=auto leaves them unpacked there
        # (packing.packed_group_size); one device runs the same unpacked rows.
        single, single_params, _, _, _ = run(model_dir, (1, 1, 1), pack_groups="off")
        sharded, sharded_params, sharded_device, sharded_pack, _ = run(model_dir, (2, 2, 2))
        noisy, noisy_params, _, _, noise = run(model_dir, (1, 1, 1), pack_groups="off", noise=True)
    policy, critic = diffs(single_params["policy"], sharded_params["policy"]), diffs(
        single_params["critic"], sharded_params["critic"])
    noisy_policy, noisy_critic = diffs(single_params["policy"], noisy_params["policy"]), diffs(
        single_params["critic"], noisy_params["critic"])
    out = {
        "devices": jax.device_count(), "sharded_pack_group": sharded_pack,
        **{f"single/{k}": [h[k] for h in single.history] for k in KEYS},
        **{f"sharded/{k}": [h[k] for h in sharded.history] for k in KEYS},
        "policy_max_diff": policy["max"], "policy_p999_diff": policy["p999"],
        "critic_max_diff": critic["max"], "critic_p999_diff": critic["p999"],
        **{f"float32_noise/{k}": v for k, v in noise.items()},
        "float32_noise/reward/total": [h["reward/total"] for h in noisy.history],
        "float32_noise/policy_max_diff": noisy_policy["max"], "float32_noise/policy_p999_diff": noisy_policy["p999"],
        "float32_noise/critic_max_diff": noisy_critic["max"], "float32_noise/critic_p999_diff": noisy_critic["p999"],
        "sharded_policy_devices": max(len(x.sharding.device_set) for x in jax.tree.leaves(sharded_device["policy"])),
        "sharded_critic_devices": max(len(x.sharding.device_set) for x in jax.tree.leaves(sharded_device["critic"])),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
