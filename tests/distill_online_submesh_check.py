"""Run by tests/test_distill_online.py on 4 fake CPU devices: on-policy distillation's sampled
estimator with the teacher on devices of its own (``placement.reference: submesh``: its log-probs
of the sampled tokens come back to the training devices) against the same run with the teacher
on the training devices. Prints one JSON line of measured results.
"""

from __future__ import annotations

import json
import tempfile

import jax

from alignax.trainers.api import build_trainer, train
from tests.support.toy_model import make_toy_model
from tests.test_distill_online import REWARDS, prompts
from tests.support.trainer_helpers import WORDS, tiny_config


def run(tmp: str, student: str, teacher: str, placement: dict) -> dict:
    config = tiny_config(tmp, "onpolicy-distill", steps=3, model_dir=student, checkpoint={"enabled": False},
                         mesh={"shape": [1, 2, 1]}, placement=placement, data={"batch_size": 4, "eval_fraction": 0.0},
                         rollout={"max_new_tokens": 4, "num_samples": 2}, rewards=REWARDS,
                         onpolicy_distill={"estimator": "sampled"},
                         distill={"teacher": {"name": teacher, "random_init": None, "seed": 0}})
    trainer = build_trainer(config, records=prompts(WORDS))
    _, frozen = trainer.start()
    devices = {d.id for x in jax.tree.leaves(trainer.reference) for d in x.sharding.device_set}
    result = train(config, records=prompts(WORDS))
    return {"loss": [h["loss"] for h in result.history], "kl": [h["kl/ref_k1"] for h in result.history],
            "teacher_devices": sorted(devices), "frozen_keys": sorted(frozen)}


def main() -> int:
    assert jax.device_count() == 4, jax.device_count()
    with tempfile.TemporaryDirectory() as tmp:
        student = make_toy_model(f"{tmp}/student", seed=5, layers=1)
        teacher = make_toy_model(f"{tmp}/teacher", seed=3, layers=2)
        out = {"device": run(f"{tmp}/device", student, teacher, {}),
               "submesh": run(f"{tmp}/submesh", student, teacher, {"reference": "submesh", "submesh": [1, 2, 1]})}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
