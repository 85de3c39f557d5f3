"""Run by tests/test_agents.py on 8 fake CPU devices: a multi-turn GRPO step (turns,
observations, rows ending at different turns) of the real trainer on a (2, 2, 2) mesh
against the same step on one device, same seed. Prints one JSON line."""

from __future__ import annotations

import json
import sys
import tempfile

import jax
import numpy as np
from flax import nnx

from alignax.trainers.api import train
from tests.support.toy_agent import agent_config, agent_tokenizer, lookup_records, make_agent_model


def run(model_dir, shape):
    tok = agent_tokenizer()
    stops = [tok.convert_tokens_to_ids(w) for w in ("<|im_end|>", "yes", "no", "ok", "sure", "hi", "is")]
    with tempfile.TemporaryDirectory() as tmp:
        config = agent_config(tmp, model_dir, steps=1, mesh={"shape": list(shape)},
                              env={"name": "tests.support.toy_agent:ChattyEnv"}, rollout={"stop_token_ids": stops},
                              data={"eval_fraction": 0.0})
        result = train(config, records=lookup_records(16))
    return result, nnx.state(result.model, nnx.Param)


def main() -> int:
    assert jax.device_count() == 8, jax.devices()
    with tempfile.TemporaryDirectory() as model_dir:
        make_agent_model(model_dir, layers=1)  # how the layers stack is not what this checks
        single, single_params = run(model_dir, (1, 1, 1))
        sharded, sharded_params = run(model_dir, (2, 2, 2))
    keys = ("reward/total", "loss", "grad_norm", "response/length_mean", "entropy", "env/turns_per_trajectory",
            "env/model_token_fraction")
    diff = np.concatenate([np.abs(np.asarray(x) - np.asarray(y)).ravel()
                           for x, y in zip(jax.tree.leaves(single_params), jax.tree.leaves(sharded_params))])
    out = {"devices": jax.device_count(),
           **{f"single/{k}": single.history[-1][k] for k in keys},
           **{f"sharded/{k}": sharded.history[-1][k] for k in keys},
           "max_param_diff": float(diff.max()),
           "sharded_param_devices": max(len(x.sharding.device_set) for x in jax.tree.leaves(sharded_params))}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
