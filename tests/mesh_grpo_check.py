"""Run by tests/test_online_mesh.py on 8 fake CPU devices: GRPO steps (sampling included)
of the real trainer on a (2, 2, 2) mesh against the same steps on one device, same seed.
Prints one JSON line of measured differences.
"""

from __future__ import annotations

import json
import sys
import tempfile

import jax
import numpy as np
from flax import nnx

from alignax.trainers.api import train
from tests.rl_toy import toy_config, toy_prompts
from tests.toy_model import make_toy_model


def run(model_dir, shape):
    with tempfile.TemporaryDirectory() as tmp:
        config = toy_config(tmp, model_dir, "grpo", steps=2, checkpoint={"enabled": False},
                            mesh={"shape": list(shape)}, grpo={"minibatches": 2})
        result = train(config, records=toy_prompts(24))
    return result, nnx.state(result.model, nnx.Param)


def param_diffs(a, b) -> dict[str, float]:
    """Largest and 99.9th-percentile absolute difference over every parameter entry."""
    diff = np.concatenate([np.abs(np.asarray(x) - np.asarray(y)).ravel()
                           for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))])
    return {"max_param_diff": float(diff.max()), "param_diff_p999": float(np.quantile(diff, 0.999))}


def main() -> int:
    assert jax.device_count() == 8, jax.devices()
    with tempfile.TemporaryDirectory() as model_dir:
        make_toy_model(model_dir)
        single, single_params = run(model_dir, (1, 1, 1))
        sharded, sharded_params = run(model_dir, (2, 2, 2))
    keys = ("reward/total", "loss", "grad_norm", "kl/ref_seq", "response/length_mean", "entropy")
    out = {
        "devices": jax.device_count(),
        **{f"single/{k}": [h[k] for h in single.history] for k in keys},
        **{f"sharded/{k}": [h[k] for h in sharded.history] for k in keys},
        **param_diffs(single_params, sharded_params),
        "sharded_param_devices": max(len(x.sharding.device_set) for x in jax.tree.leaves(sharded_params)),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
