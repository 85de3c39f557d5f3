"""Run by tests/test_distill.py on 8 fake CPU devices: a distillation teacher on devices of its
own (``placement.reference: submesh``, its top-k log-probs riding back in each batch) against
the same run with the teacher on the training devices. Prints one JSON line of measured results.

``--online`` (tests/test_distill_online.py, 4 fake devices): on-policy distillation's sampled
estimator, the teacher's log-probs of the sampled tokens coming back from its 2 devices.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile

import jax

from alignax.trainers.api import build_trainer, train
from tests.support.toy_model import make_toy_model
from tests.support.trainer_helpers import WORDS, tiny_config


def run(tmp: str, student: str, teacher: str, placement: dict, shape: list[int]) -> dict:
    config = tiny_config(tmp, "distill", steps=3, model_dir=student, checkpoint={"enabled": False},
                         mesh={"shape": shape}, placement=placement,
                         distill={"teacher": {"name": teacher, "random_init": None, "seed": 0}, "top_k": 4})
    records = [{"messages": [{"role": "user", "content": f"what is {w}"}, {"role": "assistant", "content": "ok"}]}
               for w in WORDS * 3]
    trainer = build_trainer(config, records=records)
    _, frozen = trainer.start()
    batch = trainer.place_batch(next(trainer.data.iterator("train")))
    devices = {d.id for x in jax.tree.leaves(trainer.reference) for d in x.sharding.device_set}
    where = {"teacher_devices": sorted(devices),
             "frozen_keys": sorted(frozen), "teacher_in_batch": sorted(batch.get("ref_logps", {}))}
    result = train(config, records=records)
    return {"loss": [h["loss"] for h in result.history],
            "teacher_agreement": [h["teacher_agreement"] for h in result.history], **where}


def run_online(tmp: str, student: str, teacher: str, placement: dict, shape: list[int]) -> dict:
    from tests.test_distill_online import REWARDS, prompts  # the online test's records and rewards

    config = tiny_config(tmp, "onpolicy-distill", steps=3, model_dir=student, checkpoint={"enabled": False},
                         mesh={"shape": shape}, placement=placement, data={"batch_size": 4, "eval_fraction": 0.0},
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
    online = sys.argv[1:] == ["--online"]
    shape = [1, 2, 1] if online else [2, 2, 1]  # the training mesh's, and the sub-mesh's
    assert jax.device_count() == 2 * math.prod(shape), jax.device_count()
    run_one = run_online if online else run
    with tempfile.TemporaryDirectory() as tmp:
        student = make_toy_model(f"{tmp}/student", seed=5, layers=1)
        teacher = make_toy_model(f"{tmp}/teacher", seed=3, layers=2)
        submesh = {"reference": "submesh", "submesh": shape}
        out = {"device": run_one(f"{tmp}/device", student, teacher, {}, shape),
               "submesh": run_one(f"{tmp}/submesh", student, teacher, submesh, shape)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
