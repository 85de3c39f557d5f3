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

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from alignax import models
from alignax.models import moe
from alignax.trainers.api import train
from alignax.trainers.engine import step as step_module
from alignax.trainers.engine.step import init_train_state, make_train_step
from alignax.trainers.offline import distill as distill_task
from tests.support.rl_toy import toy_config, toy_prompts
from tests.support.trainer_helpers import separable_pairs, sft_conversations, tiny_config, unpaired_feedback

COEF = 0.5  # large, so the term stands out of a float32 loss
MOE = dict(model_type="qwen3_moe", vocab_size=32, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
           num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=COEF)

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


# gkd's run (27 s on 2 cores) is slow: test_gkd_mixed_branches_return_their_router_objective
# checks the same lax.cond branches in a step of a few seconds
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "gkd" else n for n in RUNS])
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


# ------------------------------------------------------------ fast checks of the pieces


def test_router_objective_sums_models_and_averages_each_models_passes():
    """Worked by hand: the policy's two passes (aux 2 and 4, coef 0.1) give 0.1 x 3 once, the
    critic's pass (aux 3, coef 0.2) 0.6 of its own: 0.9; logged aux 3 and 3."""
    record = [("policy", 0.1 * 2.0, 2.0), ("critic", 0.2 * 3.0, 3.0), ("policy", 0.1 * 4.0, 4.0)]
    scaled, plain = moe.router_objective([(m, jnp.float32(s), jnp.float32(p)) for m, s, p in record])
    assert float(scaled) == pytest.approx(0.9, rel=1e-6)
    assert {k: float(v) for k, v in plain.items()} == pytest.approx({"policy": 3.0, "critic": 3.0})
    assert float(moe.router_objective([])[0]) == 0.0


def test_a_pass_traced_inside_a_cond_is_refused_by_the_outer_record():
    def loss(x):
        with moe.collect_router_losses():
            return jax.lax.cond(x > 0, lambda: _recorded(x), lambda: _recorded(-x))

    with pytest.raises(ValueError, match="inside a jax.lax.cond/scan/jit within the loss"):
        jax.jit(loss)(jnp.float32(1.0))
    with moe.collect_router_losses() as record:  # the same trace: recorded
        _recorded(jnp.float32(2.0))
    assert [(m, float(s), float(p)) for m, s, p in record] == [("policy", 0.5 * 2.0, 2.0)]


def _recorded(x):
    moe.record_router_loss(x, 0.5)
    return x


def test_gkd_mixed_branches_return_their_router_objective():
    """distill._mixed at lmbda 0.5: each lax.cond branch runs a mixture student; the step's
    loss is the branch's task loss plus coef x the branch's aux, recorded once (it crashed
    with an escaped tracer when the branches recorded into the step's record)."""
    config = models.ModelConfig.from_hf_config(MOE)
    model = models.create_model(config, seed=0)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jnp.arange(12, dtype=jnp.int32).reshape(2, 6) % MOE["vocab_size"]
    mask = jnp.ones_like(tokens)

    def task(sign):
        def loss(params, frozen, batch, *rest_args):
            logits = nnx.merge(graphdef, params, rest)(batch, None, mask).logits
            task_loss = sign * jnp.mean(logits)
            return task_loss, {"task": task_loss}
        return loss

    mixed = distill_task._mixed(0.5, task(1.0), task(-1.0))
    step = jax.jit(make_train_step(mixed, optax.sgd(0.0), normalisers_fn=lambda b: {}))
    aux = float(nnx.merge(graphdef, params, rest)(tokens, None, mask).router_aux_loss)
    for seed in range(4):
        _, out = step(init_train_state(params, optax.sgd(0.0), jax.random.key(seed)), {}, tokens)
        metrics = {k: float(v) for k, v in out.metrics.items()}
        assert metrics["moe/aux_loss"] == pytest.approx(aux, rel=1e-5)
        assert metrics["loss"] - metrics["task"] == pytest.approx(COEF * aux, rel=1e-4)


def test_router_coef_on_a_qwen3_moe_config_without_num_experts():
    """transformers' Qwen3MoeConfig defaults num_experts to 128: such a config has experts."""
    from alignax.trainers.config import ModelSpec
    from alignax.trainers.engine.setup import _with_router_coef

    hf = {k: v for k, v in MOE.items() if k not in ("num_experts",)}
    assert models.ModelConfig.from_hf_config(hf).num_experts == 128
    assert _with_router_coef(hf, ModelSpec(name="x", router_aux_loss_coef=0.25))["router_aux_loss_coef"] == 0.25
    with pytest.raises(ValueError, match=r"model\.router_aux_loss_coef=0\.25 is for mixture-of-experts"):
        _with_router_coef({**hf, "model_type": "qwen3"}, ModelSpec(name="x", router_aux_loss_coef=0.25))
