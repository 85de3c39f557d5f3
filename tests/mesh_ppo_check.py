"""Run by tests/test_online_mesh.py on 8 fake CPU devices: PPO steps with a separate critic
(sampling, the KL penalty, GAE, 2 epochs x 2 minibatches of policy + value updates) on a
(2, 2, 2) mesh against the same steps on one device, same seed. Prints one JSON line of
measured differences.
"""

from __future__ import annotations

import json
import sys
import tempfile

import jax
import numpy as np

from alignax.trainers.api import build_trainer
from tests.support.rl_toy import toy_config, toy_prompts
from tests.support.toy_model import make_toy_model

KEYS = ("reward/total", "response/length_mean", "loss", "grad_norm", "value/loss", "pg_loss", "kl/ref_seq",
        "entropy", "advantages/abs_mean", "approx_kl", "epochs_run")


def run(model_dir, shape, pack_groups="auto"):
    """``(result, params on the host, params as placed, the trainer's packed group size)``."""
    with tempfile.TemporaryDirectory() as tmp:
        config = toy_config(tmp, model_dir, "ppo", steps=2, checkpoint={"enabled": False},
                            mesh={"shape": list(shape)}, data={"eval_fraction": 0.0},
                            rewards={"functions": {"tests.support.rl_toy:hashed_reward": 1.0}},
                            rollout={"pack_groups": pack_groups},
                            ppo={"critic": "separate", "epochs": 2, "minibatches": 2})
        trainer = build_trainer(config, records=toy_prompts(24))
        result = trainer.train()
    return result, jax.device_get(result.loop.state.params), result.loop.state.params, trainer.actors.pack_group


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
        single, single_params, _, _ = run(model_dir, (1, 1, 1), pack_groups="off")
        sharded, sharded_params, sharded_device, sharded_pack = run(model_dir, (2, 2, 2))
    policy, critic = diffs(single_params["policy"], sharded_params["policy"]), diffs(
        single_params["critic"], sharded_params["critic"])
    out = {
        "devices": jax.device_count(), "sharded_pack_group": sharded_pack,
        **{f"single/{k}": [h[k] for h in single.history] for k in KEYS},
        **{f"sharded/{k}": [h[k] for h in sharded.history] for k in KEYS},
        "policy_max_diff": policy["max"], "policy_p999_diff": policy["p999"],
        "critic_max_diff": critic["max"], "critic_p999_diff": critic["p999"],
        "sharded_policy_devices": max(len(x.sharding.device_set) for x in jax.tree.leaves(sharded_device["policy"])),
        "sharded_critic_devices": max(len(x.sharding.device_set) for x in jax.tree.leaves(sharded_device["critic"])),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
