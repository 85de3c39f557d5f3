"""Run by tests/test_distill.py on 8 fake CPU devices: a distillation teacher on devices of its
own (``placement.reference: submesh``, its top-k log-probs riding back in each batch) against
the same run with the teacher on the training devices. Prints one JSON line of measured results.
"""

from __future__ import annotations

import json
import tempfile

import jax

from alignax.trainers.api import build_trainer, train
from tests.support.toy_model import make_toy_model
from tests.support.trainer_helpers import WORDS, tiny_config


def run(tmp: str, student: str, teacher: str, placement: dict) -> dict:
    config = tiny_config(tmp, "distill", steps=3, model_dir=student, checkpoint={"enabled": False},
                         mesh={"shape": [2, 2, 1]}, placement=placement,
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


def main() -> int:
    assert jax.device_count() == 8, jax.device_count()
    with tempfile.TemporaryDirectory() as tmp:
        student = make_toy_model(f"{tmp}/student", seed=5, layers=1)
        teacher = make_toy_model(f"{tmp}/teacher", seed=3, layers=2)
        out = {"device": run(f"{tmp}/device", student, teacher, {}),
               "submesh": run(f"{tmp}/submesh", student, teacher, {"reference": "submesh", "submesh": [2, 2, 1]})}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
