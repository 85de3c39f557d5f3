"""Run by tests/test_placement.py on 8 fake CPU devices: frozen models on devices of their
own (``placement.reference|reward_models: submesh``) against the same runs with them on the
training devices. Prints one JSON line of measured results.

- DPO (a live reference), training on a (2, 2, 1) mesh of the first 4 devices, the
  reference on ``placement.submesh: [2, 2, 1]`` (the other 4): where every array lies, the
  compiled step's inputs (no reference among them; argument bytes per device), which
  devices the reference's program runs on, three steps' figures and the state after them.
- KTO (its reference's completion and KL log-probs ride in the batch), the same layout:
  two steps' figures against the device-placed run's.
- A DPO run through ``alignax.trainers.api.train`` with checkpoints, stopped after 2 steps
  and resumed to 4 (its reference restored onto the sub-mesh), against 4 steps in one go.
- Iterative DPO's round trainer with ``iterative.reference: original`` builds that
  reference on the sub-mesh.
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
from alignax.trainers.api import build_trainer, train
from alignax.trainers.iterative import _RoundTrainer
from tests.support.rl_toy import toy_config, toy_prompts
from tests.support.toy_model import make_toy_model
from tests.support.trainer_helpers import separable_pairs, tiny_config, unpaired_feedback

SUBMESH = {"reference": "submesh", "submesh": [2, 2, 1]}  # the offline checks' layout: 4 training, 4 apart


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
        config = tiny_config(tmp, "dpo", steps=3, model_dir=model_dir, preference={"beta": 0.5},
                             checkpoint={"enabled": False}, mesh={"shape": [2, 2, 1]}, placement=placement)
        trainer = build_trainer(config, records=separable_pairs(32))
    state, frozen = trainer.start()
    reference = trainer.reference
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


def kto(model_dir: str, placement: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        config = tiny_config(tmp, "kto", steps=2, model_dir=model_dir, checkpoint={"enabled": False},
                             mesh={"shape": [2, 2, 1]}, placement=placement)
        return [{k: float(v) for k, v in row.items() if k != "step"}
                for row in train(config, records=unpaired_feedback(32)).history]


def resumed_dpo(model_dir: str) -> dict:
    """Losses and params of a DPO run stopped after 2 steps and resumed to 4, and of 4 in one go."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        def run(name, steps):
            config = tiny_config(f"{tmp}/{name}", "dpo", steps=steps, model_dir=model_dir, preference={"beta": 0.5},
                                 mesh={"shape": [2, 2, 1]}, placement=SUBMESH)  # saves every 2 steps
            return train(config, records=separable_pairs(32))

        run("split", 2)
        resumed, whole = run("split", 4), run("whole", 4)
    out["resumed_steps"] = [row["step"] for row in resumed.history]
    out["resumed_losses"] = [row["loss"] for row in resumed.history]
    out["whole_losses"] = [row["loss"] for row in whole.history]
    out["max_param_diff"] = max_diff(resumed.loop.state.params, whole.loop.state.params)
    return out


def iterative_reference(model_dir: str) -> dict:
    """The round trainer's original-model reference (``iterative.reference: original``)."""
    with tempfile.TemporaryDirectory() as tmp:
        pairs = f"{tmp}/pairs.jsonl"  # a round reads its pairs from its data file
        with open(pairs, "w") as f:
            f.writelines(json.dumps(record) + "\n" for record in separable_pairs(16))
        config = tiny_config(tmp, "dpo", steps=1, model_dir=model_dir, checkpoint={"enabled": False},
                             mesh={"shape": [2, 2, 1]}, placement=SUBMESH, data={"paths": [pairs]})
        trainer = _RoundTrainer(config, config)
        state, _ = trainer.start()
        reference = trainer.reference
    return {"devices": device_ids(reference), "max_diff_to_initial": max_diff(reference, state.params)}


def grpo(model_dir: str, scorer_dir: str, placement: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = toy_config(tmp, model_dir, "grpo", steps=2, checkpoint={"enabled": False},
                            mesh={"shape": [1, 6, 1]}, placement=placement, data={"batch_size": 6, "eval_fraction": 0.0},
                            grpo={"kl_coef": 0.1}, rewards={"reward_models": [scorer_dir]})
        trainer = build_trainer(config, records=toy_prompts(24))
        result = trainer.train()
    reference = trainer.actors.submesh_reference
    return {"history": result.history, "params": jax.device_get(nnx.state(result.model, nnx.Param)),
            "reference_devices": device_ids(reference) if reference is not None else None,
            "reward_model_devices": device_ids(trainer.actors.sampler.scorer.reward_models.states),
            "params_devices": device_ids(nnx.state(result.model, nnx.Param))}


def main() -> int:
    assert jax.device_count() == 8, jax.devices()
    out = {}
    with tempfile.TemporaryDirectory() as model_dir, tempfile.TemporaryDirectory() as scorer_dir:
        make_toy_model(model_dir)
        save_pretrained(from_pretrained(model_dir, kind="reward", new_head=True, seed=3), scorer_dir)
        arms = {"device": dpo(model_dir, {}),
                "submesh": dpo(model_dir, SUBMESH)}
        for name, arm in arms.items():
            out.update({f"dpo/{name}/{k}": v for k, v in arm.items() if k != "params"})
        out["dpo/max_param_diff"] = max_diff(arms["device"]["params"], arms["submesh"]["params"])
        out["kto/device"], out["kto/submesh"] = kto(model_dir, {}), kto(model_dir, SUBMESH)
        out.update({f"resume/{k}": v for k, v in resumed_dpo(model_dir).items()})
        out.update({f"iterative/{k}": v for k, v in iterative_reference(model_dir).items()})
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
