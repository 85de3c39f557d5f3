"""The load-balancing loss of a mixture-of-experts model in each kind of trainer, one step on
the toy Qwen3-MoE (tests/support/toy_model.py, 4 experts, top 2).

Each algorithm trains one step twice from the same weights and data, with
``model.router_aux_loss_coef`` at ``COEF`` and at 0: the first step's loss differs by exactly
``COEF x`` the logged ``moe/aux_loss`` of each trained model, and the step records one pass
per trained model (a frozen reference or teacher, KTO's stop-gradient KL-partner pass add
nothing). PPO's separate critic (a mixture too) adds its own term: the loss holds both (a mean
over the passes of all models, as before, would hold half of each). GKD at ``lmbda`` 0.5 runs the student inside a ``lax.cond``.
"""

from __future__ import annotations

import contextlib

import pytest

from alignax.trainers.api import train
from alignax.trainers.engine import step as step_module
from tests.support.rl_toy import toy_config, toy_prompts
from tests.support.trainer_helpers import separable_pairs, sft_conversations, tiny_config, unpaired_feedback

COEF = 0.5  # large, so the term stands out of a float32 loss

# algorithm -> (trained models that record a pass: {name: passes}, records)
RUNS = {
    "sft": ({"policy": 1}, lambda: sft_conversations(8)),
    "dpo": ({"policy": 1}, lambda: separable_pairs(8)),
    "kto": ({"policy": 1}, lambda: unpaired_feedback(8)),
    "gkd": ({"policy": 1}, lambda: sft_conversations(8)),
    "ppo": ({"policy": 1, "critic": 1}, lambda: toy_prompts(8)),
}


def _config(tmp_path, name, model, teacher, coef):
    overrides = (f"model.router_aux_loss_coef={coef}",)
    common = dict(checkpoint={"enabled": False}, optim={"learning_rate": 1e-3}, data={"eval_fraction": 0.0})
    if name == "ppo":  # one update a step: the step's loss is the initial weights' loss
        return toy_config(tmp_path, model, "ppo", steps=1, overrides=overrides,
                          ppo={"epochs": 1, "minibatches": 1, "critic": "separate", "critic_init": "policy"},
                          data={"eval_fraction": 0.0}, checkpoint={"enabled": False})
    if name == "gkd":
        common["distill"] = {"teacher": {"name": teacher, "random_init": None, "seed": 0}, "lmbda": 0.5}
        common["data"] = {"eval_fraction": 0.0, "max_response_length": 2}
    return tiny_config(tmp_path, name, steps=1, model_dir=model, overrides=overrides, **common)


@pytest.fixture
def recorded_passes(monkeypatch):
    """The models of each record the train step opens (one per trace of its loss)."""
    seen: list[list[str]] = []
    real = step_module.collect_router_losses

    @contextlib.contextmanager
    def spy():
        with real() as record:
            yield record
        seen.append([model for model, _, _ in record])

    monkeypatch.setattr(step_module, "collect_router_losses", spy)
    return seen


@pytest.mark.parametrize("name", list(RUNS))
def test_one_step_adds_coef_times_each_trained_models_aux(tmp_path, toy_moe_model, toy_model, recorded_passes, name):
    models, records = RUNS[name]
    first = {}
    for coef in (COEF, 0.0):
        result = train(_config(tmp_path / str(coef), name, toy_moe_model, toy_model, coef), records=records())
        first[coef] = result.history[0]
    logged = {"policy": first[COEF]["moe/aux_loss"]}
    if "critic" in models:
        logged["critic"] = first[COEF]["moe/critic_aux_loss"]
    assert all(1.0 <= aux <= 4.0 for aux in logged.values()), logged  # k=2 uniform .. all on one expert: E=4
    assert first[0.0]["moe/aux_loss"] == pytest.approx(logged["policy"], rel=1e-5)  # the same weights and rows
    if name == "gkd":
        assert first[COEF]["on_policy"] == first[0.0]["on_policy"]  # the same coin
    assert first[COEF]["loss"] - first[0.0]["loss"] == pytest.approx(COEF * sum(logged.values()), rel=1e-3)
    want = [name for name, passes in models.items() for _ in range(passes)]
    assert recorded_passes and all(sorted(seen) == sorted(want) for seen in recorded_passes), recorded_passes
