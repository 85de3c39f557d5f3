"""Run by tests/test_trainers_mesh.py on 8 fake CPU devices: one DPO step of the real
trainer on a (2, 2, 2) mesh (FSDP over parameters and optimiser state, batch over data)
against the same step on one device; and 4 pairs on (1, 8, 1), fewer rows than batch
devices (placed whole on each device), against one device. Prints one JSON line of measured differences.
``--lora``: the same with LoRA adapters (rank 4 on every projection), the adapters trained;
and a QLoRA (NF4 base) DPO run on the mesh against one device (``qlora_*``).
"""

from __future__ import annotations

import json
import sys
import tempfile

import jax
import numpy as np
from flax import nnx

from alignax.trainers.api import train
from tests.support.toy_model import make_toy_model
from tests.support.trainer_helpers import separable_pairs, tiny_config


def run(model_dir, shape, quantize=None, batch_size=None):
    lora = {"lora": {"rank": 4, "alpha": 8}} if "--lora" in sys.argv else {}
    if quantize is not None:  # the QLoRA check
        lora = {"lora": {"rank": 4, "alpha": 8, "quantize": quantize}}
    data = {} if batch_size is None else {"data": {"batch_size": batch_size}}
    with tempfile.TemporaryDirectory() as tmp:
        config = tiny_config(tmp, "dpo", steps=2, model_dir=model_dir, checkpoint={"enabled": False},
                             mesh={"shape": list(shape)}, train={"grad_accum_steps": 2}, **lora, **data)
        result = train(config, records=separable_pairs(40))
    params = nnx.state(result.model, nnx.Param)
    return result, params


def main() -> int:
    assert jax.device_count() == 8, jax.devices()
    with tempfile.TemporaryDirectory() as model_dir:
        make_toy_model(model_dir)
        single, single_params = run(model_dir, (1, 1, 1))
        sharded, sharded_params = run(model_dir, (2, 2, 2))
        few = {}
        if "--lora" not in sys.argv:  # a batch the batch devices do not divide (4 pairs, micro-batches of 2, on 8)
            few = {f"few_rows_loss_{name}": [h["loss"] for h in run(model_dir, shape, batch_size=4)[0].history]
                   for name, shape in (("single", (1, 1, 1)), ("sharded", (1, 8, 1)))}
        qlora = {}
        if "--lora" in sys.argv:
            q_single, q_single_params = run(model_dir, (1, 1, 1), quantize="nf4")
            q_sharded, q_sharded_params = run(model_dir, (2, 2, 2), quantize="nf4")
            qlora = {
                "qlora_loss_single": [h["loss"] for h in q_single.history],
                "qlora_loss_sharded": [h["loss"] for h in q_sharded.history],
                # the trained adapters (the NF4 base is frozen: dequantised by merging on export)
                "qlora_max_adapter_diff": max(
                    float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in
                    zip(jax.tree.leaves(q_single.loop.state.params), jax.tree.leaves(q_sharded.loop.state.params))),
            }
    specs = {
        "/".join(map(str, path)): str(leaf.sharding.spec)
        for path, leaf in jax.tree_util.tree_leaves_with_path(sharded_params)
    }
    diffs = [
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(jax.tree.leaves(single_params), jax.tree.leaves(sharded_params))
    ]
    out = {
        "devices": jax.device_count(),
        "loss_single": [h["loss"] for h in single.history],
        "loss_sharded": [h["loss"] for h in sharded.history],
        **few,
        "eval_accuracy_single": single.eval_history[-1]["eval/rewards/accuracies"],
        "eval_accuracy_sharded": sharded.eval_history[-1]["eval/rewards/accuracies"],
        "max_param_diff": max(diffs),
        "embed_spec": next(v for k, v in specs.items() if "embed" in k),
        "specs": specs,
        "num_devices_of_embed": len(next(
            leaf for path, leaf in jax.tree_util.tree_leaves_with_path(sharded_params)
            if "embed" in "/".join(map(str, path))
        ).sharding.device_set),
        **qlora,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
