"""Run by tests/test_placement.py on 8 fake CPU devices: frozen models on devices of their
own (``placement.reference|reward_models: submesh``) against the same runs with them on the
training devices. Prints one JSON line of measured results.

- DPO (a live reference), training on a (2, 2, 1) mesh of the first 4 devices, the
  reference on ``placement.submesh: [2, 2, 1]`` (the other 4): where every array lies, the
  compiled step's inputs (no reference among them; argument bytes per device), which
  devices the reference's program runs on, three steps' figures and the state after them.
- GRPO with a KL to the reference and a reward model, training on (1, 6, 1), both frozen
  models on ``[1, 2, 1]``: where they lie, and two rollouts' figures and params (the
  reference's log-probs and the reward model's scores come back from the sub-mesh).
"""

from __future__ import annotations

import json
import tempfile

import jax
import numpy as np
from flax import nnx

from alignax.models import from_pretrained, save_pretrained
from alignax.trainers.api import build_trainer
from tests.rl_toy import toy_config, toy_prompts
from tests.toy_model import make_toy_model
from tests.trainer_helpers import separable_pairs, tiny_config


def device_ids(tree) -> list[int]:
    """The ids of the devices holding ``tree``'s arrays (or named by its shardings)."""
    return sorted({d.id for x in jax.tree.leaves(tree) for d in getattr(x, "sharding", x).device_set})


def bytes_on(tree, device) -> int:
    """The bytes of ``tree``'s shards that ``device`` holds."""
    return sum(shard.data.nbytes for x in jax.tree.leaves(tree) for shard in x.addressable_shards
               if shard.device == device)


def max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def dpo(model_dir: str, placement: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = tiny_config(tmp, "dpo", steps=3, model_dir=model_dir, dpo={"beta": 0.5},
                             checkpoint={"enabled": False}, mesh={"shape": [2, 2, 1]}, placement=placement)
        trainer = build_trainer(config, records=separable_pairs(32))
    state, reference = trainer.start()
    frozen = trainer.frozen_inputs(reference)
    batches = trainer.data.iterator("train")
    batch = trainer.place_batch(next(batches))
    compiled = trainer.step.lower(state, frozen, batch).compile()
    out = {"reference_devices": device_ids(reference), "params_devices": device_ids(state.params),
           "frozen_keys": sorted(frozen), "batch_keys": sorted(batch),
           "step_input_devices": device_ids(compiled.input_shardings[0]),
           "step_argument_bytes": int(compiled.memory_analysis().argument_size_in_bytes),
           "reference_bytes_per_device": bytes_on(reference, jax.devices()[0])}
    if trainer.submesh_reference is not None:
        forward = trainer.submesh_reference.forward.lower(reference, trainer.submesh_reference.placer(
            next(trainer.data.iterator("train")))).compile()
        out["reference_program_devices"] = device_ids(forward.input_shardings[0])
        out["ref_logps_devices"] = device_ids(batch["ref_logps"])
        out["ref_logps_bytes_per_device"] = bytes_on(batch["ref_logps"], jax.devices()[0])
    metrics = []
    for _ in range(3):
        state, step_out = compiled(state, frozen, batch)
        metrics.append({k: float(v) for k, v in jax.device_get(step_out.metrics).items()})
        batch = trainer.place_batch(next(batches))
    out["metrics"] = metrics
    out["params"] = jax.device_get(state.params)
    return out


def grpo(model_dir: str, scorer_dir: str, placement: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = toy_config(tmp, model_dir, "grpo", steps=2, checkpoint={"enabled": False},
                            mesh={"shape": [1, 6, 1]}, placement=placement, data={"batch_size": 6, "eval_fraction": 0.0},
                            grpo={"kl_coef": 0.1}, rewards={"reward_models": [scorer_dir]})
        trainer = build_trainer(config, records=toy_prompts(24))
        result = trainer.train()
    reference = trainer.submesh_reference
    return {"history": result.history, "params": jax.device_get(nnx.state(result.model, nnx.Param)),
            "reference_devices": device_ids(reference) if reference is not None else None,
            "reward_model_devices": device_ids(trainer.scorer.reward_models.states),
            "params_devices": device_ids(nnx.state(result.model, nnx.Param))}


def main() -> int:
    assert jax.device_count() == 8, jax.devices()
    out = {}
    with tempfile.TemporaryDirectory() as model_dir, tempfile.TemporaryDirectory() as scorer_dir:
        make_toy_model(model_dir)
        save_pretrained(from_pretrained(model_dir, kind="reward", new_head=True, seed=3), scorer_dir)
        arms = {"device": dpo(model_dir, {}),
                "submesh": dpo(model_dir, {"reference": "submesh", "submesh": [2, 2, 1]})}
        for name, arm in arms.items():
            out.update({f"dpo/{name}/{k}": v for k, v in arm.items() if k != "params"})
        out["dpo/max_param_diff"] = max_diff(arms["device"]["params"], arms["submesh"]["params"])
        online = {"device": grpo(model_dir, scorer_dir, {}),
                  "submesh": grpo(model_dir, scorer_dir, {"reference": "submesh", "reward_models": "submesh",
                                                          "submesh": [1, 2, 1]})}
    keys = ("reward/total", "reward/reward_model", "kl/ref_seq", "loss", "grad_norm")
    for name, arm in online.items():
        out.update({f"grpo/{name}/{k}": v for k, v in arm.items() if k not in ("history", "params")})
        out.update({f"grpo/{name}/history/{k}": [h.get(k) for h in arm["history"]] for k in keys})
    out["grpo/max_param_diff"] = max_diff(online["device"]["params"], online["submesh"]["params"])
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
