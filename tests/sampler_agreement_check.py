"""Run by tests/test_sampler_agreement.py on 8 fake CPU devices: the sampler/learner
log-prob gap of one GRPO rollout of the toy model with training and sampling on a
(2, 2, 2) mesh, and with training on (1, 8, 1) and the sampler on its own (2, 1, 4)
(``rollout.mesh``), each computing in float32 and in bfloat16. For each it prints the
rollout's ``agreement/<dtype>/*`` figures and the same statistics recomputed here with
NumPy from the batch's arrays, as one JSON line."""

from __future__ import annotations

import json
import sys
import tempfile

import jax
import numpy as np

from alignax.trainers.online import grpo
from alignax.trainers.online.trainer import OnlineTrainer
from tests.support.rl_toy import toy_config, toy_prompts
from tests.support.toy_model import make_toy_model

SETTINGS = {"mesh": {"mesh": {"shape": [2, 2, 2]}},
            "own_mesh": {"mesh": {"shape": [1, 8, 1]}, "rollout": {"mesh": [2, 1, 4]}}}


def one_rollout(model_dir, dtype: str, sections: dict) -> dict:
    """The agreement figures of one priced rollout (the separate old-log-prob pass) and
    what NumPy makes of the same arrays; in bfloat16 also ``learner_bf16_error``, the
    learner's largest difference from a float32 pass over the same sequences on the same
    mesh (the test's bound is twice it: test_sampler_agreement.bf16_bound says why)."""
    rollout = {"temperature": 0.7, **sections.get("rollout", {})}

    def trainer_in(tmp, compute: str):
        config = toy_config(tmp, model_dir, "grpo", steps=1, checkpoint={"enabled": False},
                            precision={"compute_dtype": compute}, data={"eval_fraction": 0.0},
                            **{**sections, "rollout": rollout})
        return OnlineTrainer(config, grpo.build_algorithm(config), records=toy_prompts(16), single_pass=False)

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        trainer = trainer_in(tmp, dtype)
        state, frozen = trainer.start()
        batches = trainer.data.iterator("train")
        batch = trainer.collect(state, frozen, next(batches), batches)
    mask = np.asarray(jax.device_get(batch.response_mask)) > 0
    if dtype == "bfloat16":
        with tempfile.TemporaryDirectory() as tmp:
            reference = trainer_in(tmp, "float32")
            placed = tuple(reference.actors.place(a) for a in batch.groups.full_sequences())
            float32 = reference.actors.forward(reference.actors.whole_policy(reference.start()[0].params), *placed)[0]
        error = np.abs(np.asarray(jax.device_get(batch.recomputed), np.float64) - np.asarray(jax.device_get(float32)))
        out["learner_bf16_error"] = float(error[mask].max())
    gap = np.abs(np.asarray(jax.device_get(batch.recomputed), np.float64)
                 - np.asarray(jax.device_get(batch.rollout.sampler_logps), np.float64))[mask]
    return {**out, "figures": {k: v for k, v in batch.figures.items() if k.startswith("agreement/")},
            "numpy": {"mean": float(gap.mean()), "max": float(gap.max()), "share": float(np.mean(gap > 1e-3)),
                      "tokens": int(mask.sum())},
            "sampler_devices": len(trainer.actors.sampler_mesh.devices.flat),
            "sampler_mesh": [int(n) for n in trainer.actors.sampler_mesh.devices.shape],
            "train_mesh": [int(n) for n in trainer.mesh.devices.shape]}


def main() -> int:
    assert jax.device_count() == 8, jax.devices()
    out = {}
    with tempfile.TemporaryDirectory() as model_dir:
        make_toy_model(model_dir)
        for name, sections in SETTINGS.items():
            for dtype in ("float32", "bfloat16"):
                out[f"{name}/{dtype}"] = one_rollout(model_dir, dtype, sections)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
