"""End-to-end runs of the offline trainers on tiny models: SFT, reward model, DPO family.

Each run goes through the real entry (``alignax.trainers.api.train``) with a recipe from
configs/tiny-*.yaml: data pipeline, jitted step, eval, checkpoints and metrics files.
Tests that assert learning, resume or export train the toy word-level model
(tests/support/toy_model.py) on synthetic records whose right answer is known; the recipes
themselves run on reasoning-gym data with SmolLM2's tokenizer.
"""

import glob
import json
import os

import jax
import numpy as np
import pytest

from alignax.checkpoint import Checkpointer
from alignax.config import ConfigError
from alignax.data import BadRecordError
from alignax.metrics import read_jsonl
from alignax.trainers.api import load_config
from alignax.trainers.api import build_trainer, evaluate, export, train
from alignax.trainers.offline import reward as reward_task
from tests.support.compiled import jitted
from tests.support.references import log_sigmoid
from tests.support.trainer_helpers import CONFIGS, WORDS, separable_pairs, sft_conversations, tiny_config, unpaired_feedback


def finite(history, key):
    values = [h[key] for h in history if key in h]
    assert values, f"no {key} logged"
    assert all(np.isfinite(values)), f"{key} not finite: {values}"
    return values


def test_every_recipe_parses_and_every_algorithm_has_its_tiny_recipe():
    from alignax.trainers.api import ALGORITHMS

    paths = sorted(glob.glob(os.path.join(CONFIGS, "*.yaml")))
    algorithm_of = {os.path.basename(path): load_config(path).algorithm for path in paths}  # each one loads
    for name in ALGORITHMS:  # the suite's small run of each algorithm (tests/trainer_helpers.py tiny_config)
        tiny = f"tiny-{name.replace('_', '-')}.yaml"
        assert algorithm_of.get(tiny) == name, f"{tiny}: algorithm {algorithm_of.get(tiny)!r}, expected {name!r}"


def test_dpo_learns_a_separable_preference(tmp_path, toy_model):
    config = tiny_config(tmp_path, "dpo", steps=30, model_dir=toy_model, preference={"beta": 0.5}, train={"save_every": 0})
    result = train(config, records=separable_pairs(96))
    before, after = result.eval_history[0], result.eval_history[-1]
    assert before["step"] == 0 and after["step"] == 30
    assert before["eval/rewards/accuracies"] == 0.0  # policy == reference: every margin is 0
    assert after["eval/rewards/accuracies"] >= 0.9  # held-out pairs; chance is 0.5
    assert after["eval/loss"] < before["eval/loss"] < 0.7
    finite(result.history, "loss")
    rows = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    assert rows[0]["data/train"] + rows[0]["data/eval"] == 96 and rows[0]["data/eval"] == 24
    assert any("rewards/margins" in r for r in rows) and any("perf/tokens_per_s" in r for r in rows)


# slow: each loss is checked against its paper's formula through the trainer by
# tests/test_offline_variants.py (test_first_step_loss_is_the_papers_formula), KTO end to
# end with evaluation and export by tests/test_api.py, and the tiny DPO and KTO recipes on
# their reasoning-gym data by the schema sweep (tests/test_config_schema.py).
@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, section",
    [
        ("dpo", {"loss": "dpo", "variant": "ipo"}),
        ("dpo", {"loss": "simpo", "beta": 2.0}),
        ("dpo", {"loss": "orpo"}),
        ("kto", {}),
    ],
    ids=["ipo", "simpo", "orpo", "kto"],
)
def test_recipes_run_end_to_end_on_reasoning_gym_data(tmp_path, recipe, section):
    config = tiny_config(tmp_path, recipe, steps=2, preference=section, checkpoint={"enabled": False})
    result = train(config)
    finite(result.history, "loss")
    assert result.data_stats["records"] > 0 and result.data_stats["skipped"] == 0
    assert "eval/loss" in result.eval_history[-1]
    if recipe == "kto":
        finite(result.history, "kl")


def test_precomputed_reference_matches_live_reference(tmp_path, toy_model):
    records = separable_pairs(32)
    live = train(tiny_config(tmp_path / "live", "dpo", steps=3, model_dir=toy_model, checkpoint={"enabled": False}),
                 records=records)
    pre = train(tiny_config(tmp_path / "pre", "dpo", steps=3, model_dir=toy_model, preference={"reference": "precomputed"},
                            checkpoint={"enabled": False}), records=records)
    assert len(live.history) == len(pre.history) == 3
    for a, b in zip(live.history, pre.history):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
    np.testing.assert_allclose(live.eval_history[-1]["eval/loss"], pre.eval_history[-1]["eval/loss"], rtol=1e-5)


def test_kto_precomputed_reference_matches_live_on_shuffled_data(tmp_path, toy_model):
    """The KL rows' reference log-probs, precomputed per record in file order, belong to the
    same mismatched sequences as the policy's rows in shuffled batches: every step's loss
    and KL reference point equal the live reference's."""
    records = unpaired_feedback(40)
    runs = {}
    for reference in ("live", "precomputed"):
        config = tiny_config(tmp_path / reference, "kto", steps=4, model_dir=toy_model, checkpoint={"enabled": False},
                             preference={"reference": reference}, optim={"learning_rate": 3e-2})
        assert config.data.shuffle
        runs[reference] = train(config, records=records)
    live, pre = runs["live"].history, runs["precomputed"].history
    assert len(live) == len(pre) == 4
    for a, b in zip(live, pre):
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)
        np.testing.assert_allclose(b["kl"], a["kl"], rtol=1e-4, atol=1e-6)
    assert live[0]["kl"] == 0.0  # policy == reference at the first step
    assert max(h["kl"] for h in live[1:]) > 1e-3  # later, the reference point is in play
    np.testing.assert_allclose(runs["precomputed"].eval_history[-1]["eval/kl"],
                               runs["live"].eval_history[-1]["eval/kl"], rtol=1e-4, atol=1e-6)


def _graded_pairs(n: int) -> list[dict]:
    """Separable pairs with Llama 2 style margins (0, 1/3, 2/3, 1 in turn)."""
    return [dict(r, margin=[0.0, 1 / 3, 2 / 3, 1.0][i % 4]) for i, r in enumerate(separable_pairs(n))]


def test_reward_margin_enters_the_bradley_terry_loss(tmp_path, toy_model):
    records = _graded_pairs(32)
    config = tiny_config(tmp_path, "reward", steps=1, model_dir=toy_model, checkpoint={"enabled": False},
                         reward_model={"use_margin": True})
    first = train(config, records=records).history[0]["loss"]
    # The same first batch scored by the same initial reward model, outside the trainer.
    trainer = build_trainer(config, records=records)
    batch = next(trainer.data.iterator("train"))
    model = jitted(trainer.model_from(trainer.params))
    chosen, rejected = (np.asarray(model(batch[f"{s}_tokens"], batch[f"{s}_positions"],
                                         batch[f"{s}_attention_mask"]).rewards, np.float64)
                        for s in ("chosen", "rejected"))
    margins = [records[i]["margin"] for i in batch["record_index"]]
    np.testing.assert_allclose(batch["margin"], margins, rtol=1e-6)
    assert len(set(margins)) > 1
    with_margin = np.mean([-log_sigmoid(c - r - m) for c, r, m in zip(chosen, rejected, margins)])
    without = np.mean([-log_sigmoid(c - r) for c, r in zip(chosen, rejected)])
    np.testing.assert_allclose(first, with_margin, rtol=1e-5)
    assert with_margin - without > 0.05  # positive margins raise the loss: the margin is in it
    # without use_margin the same batch's loss is plain Bradley-Terry
    plain = reward_task.make_task(tiny_config(tmp_path / "plain", "reward", model_dir=toy_model),
                                  trainer.graphdef, trainer.rest)
    placed = trainer.placer(batch)
    loss, _ = jax.jit(plain.loss_fn)(trainer.params, {}, placed, plain.normalisers_fn(placed), None)
    np.testing.assert_allclose(float(loss), without, rtol=1e-5)


def test_reward_margin_is_required_of_every_record_with_use_margin(tmp_path):
    config = tiny_config(tmp_path, "reward", reward_model={"use_margin": True})
    assert reward_task.make_task(config, None, None).required_fields == ("margin",)
    config = tiny_config(tmp_path, "reward")
    assert reward_task.make_task(config, None, None).required_fields == ()


def test_reward_use_margin_with_a_record_lacking_one_is_an_error(tmp_path, toy_model):
    records = _graded_pairs(16)
    del records[5]["margin"]
    config = tiny_config(tmp_path, "reward", model_dir=toy_model, reward_model={"use_margin": True})
    with pytest.raises(BadRecordError, match=r"^records, record 5: field 'margin': record has no 'margin'"):
        build_trainer(config, records=records)


def test_sft_on_raw_text_is_continued_pretraining(tmp_path, toy_model):
    rng = np.random.default_rng(0)
    records = [{"text": " ".join(["hi", "there"] + [str(w) for w in rng.choice(WORDS, 3)])} for _ in range(32)]
    config = tiny_config(tmp_path, "sft", steps=20, model_dir=toy_model, checkpoint={"enabled": False},
                         data={"format": "text"}, optim={"learning_rate": 2e-2})
    result = train(config, records=records)
    before, after = result.eval_history[0], result.eval_history[-1]
    assert after["eval/nll"] < before["eval/nll"] - 1.0
    finite(result.history, "loss")


def test_sft_lowers_held_out_nll(tmp_path, toy_model):
    config = tiny_config(tmp_path, "sft", steps=30, model_dir=toy_model, checkpoint={"enabled": False},
                         optim={"learning_rate": 2e-2})
    # The eval split holds out whole prompts, so the held-out answers must follow from what
    # train teaches without having seen the prompt: every prompt gets the same two-word answer.
    rng = np.random.default_rng(0)
    records = [{"messages": [{"role": "user", "content": f"what is {' '.join(rng.choice(WORDS, 3))}"},
                             {"role": "assistant", "content": f"{WORDS[0]} {WORDS[1]}"}]} for _ in range(48)]
    result = train(config, records=records)
    before, after = result.eval_history[0], result.eval_history[-1]
    assert after["eval/nll"] < before["eval/nll"] - 1.0
    np.testing.assert_allclose(after["eval/ppl"], np.exp(after["eval/nll"]), rtol=1e-6)


def test_reward_model_learns_held_out_pairs(tmp_path, toy_model):
    config = tiny_config(tmp_path, "reward", steps=20, model_dir=toy_model, checkpoint={"enabled": False})
    result = train(config, records=separable_pairs(64))
    assert result.eval_history[-1]["eval/accuracy"] >= 0.9
    finite(result.history, "loss")


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path, toy_model):
    records = separable_pairs(48)
    # (the uninterrupted run saves nothing: saving does not touch the steps)
    full = train(tiny_config(tmp_path / "full", "dpo", steps=6, model_dir=toy_model, checkpoint={"enabled": False}),
                 records=records)
    first = train(tiny_config(tmp_path / "split", "dpo", steps=3, model_dir=toy_model), records=records)
    resumed = train(tiny_config(tmp_path / "split", "dpo", steps=6, model_dir=toy_model), records=records)
    assert first.loop.last_step == 3 and [h["step"] for h in resumed.history] == [4, 5, 6]
    assert [h["loss"] for h in full.history[3:]] == [h["loss"] for h in resumed.history]
    assert [h["grad_norm"] for h in full.history[3:]] == [h["grad_norm"] for h in resumed.history]
    ckpt = Checkpointer(str(tmp_path / "split" / "checkpoints"))
    assert ckpt.has_reference() and ckpt.latest_step() == 6
    ckpt.close()


def test_a_resumed_precomputed_run_makes_its_table_once_from_the_saved_reference(tmp_path, toy_model, monkeypatch):
    """A precomputed reference is one pass over the data: a resumed run makes it once, from
    the reference its checkpoint holds (not once from the fresh params, then again)."""
    from alignax.trainers.offline.trainer import OfflineTrainer

    records = separable_pairs(32)
    config = lambda steps: tiny_config(tmp_path / "run", "dpo", steps=steps, model_dir=toy_model,  # noqa: E731
                                       preference={"reference": "precomputed"})
    train(config(2), records=records)
    passes = []
    make_table = OfflineTrainer.precompute_reference
    monkeypatch.setattr(OfflineTrainer, "precompute_reference",
                        lambda self, *a, **k: passes.append(1) or make_table(self, *a, **k))
    resumed = train(config(4), records=records)
    assert [h["step"] for h in resumed.history] == [3, 4] and len(passes) == 1


def test_eval_and_export_from_a_checkpoint(tmp_path, toy_model):
    config = tiny_config(tmp_path, "dpo", steps=2, model_dir=toy_model)
    records = separable_pairs(32)
    result = train(config, records=records)
    figures = evaluate(config, records=records)
    np.testing.assert_allclose(figures["rewards/accuracies"], result.eval_history[-1]["eval/rewards/accuracies"])
    np.testing.assert_allclose(figures["loss"], result.eval_history[-1]["eval/loss"], rtol=1e-6)
    out = export(config)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    torch = pytest.importorskip("torch", reason="the PyTorch reference (pinned test extras; not in `make test-latest`)")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokens = np.array([[1, 17, 3, 12, 9]])
    ours = np.asarray(jitted(result.model)(tokens).logits)
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        assert json.load(f)


def test_bad_algorithm_data_pairing_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="data.format=sft does not fit preference.loss=dpo: it reads data.format=preference"):
        tiny_config(tmp_path, "dpo", steps=1, data={"format": "sft"})


def test_scoring_a_response_window_equals_scoring_every_position(toy_model):
    """The LM head may run on each row's response window only: same sequence log-probs."""
    from alignax.models import from_pretrained
    from alignax.trainers.engine.setup import response_logps, sequence_logps

    model = from_pretrained(toy_model)
    rng = np.random.default_rng(0)
    b, t = 4, 20
    tokens = rng.integers(3, 22, size=(b, t)).astype(np.int32)
    attention = np.ones((b, t), np.int32)
    response = np.zeros((b, t), np.int32)
    for row, (start, length) in enumerate([(5, 3), (9, 6), (2, 1), (12, 6)]):
        response[row, start : start + length] = 1
        attention[row, start + length :] = 0  # right padding after the response
    positions = np.maximum(np.cumsum(attention, 1) - 1, 0)

    def scored(window=None):  # one compiled program per window
        return jax.jit(lambda *a: sequence_logps(*response_logps(model, *a, window=window)))(tokens, positions,
                                                                                            attention, response)

    full, windowed = scored(), scored(window=6)
    np.testing.assert_allclose(windowed[0], full[0], rtol=1e-6)
    np.testing.assert_array_equal(windowed[1], full[1])
    # a window running past the end of a row is cut there, not wrapped
    np.testing.assert_allclose(scored(window=10)[0], full[0], rtol=1e-6)


def test_a_diverged_run_stops_with_an_alarm_and_keeps_its_good_checkpoint(tmp_path, toy_model):
    """Learning rate 1e6: the weights blow up, the logits collapse and the gradient vanishes;
    the run must not exit as if it had trained."""
    from alignax.trainers.engine.loop import StalledRunError

    config = tiny_config(tmp_path, "sft", steps=30, model_dir=toy_model,
                         optim={"learning_rate": 1e6, "warmup_steps": 0}, train={"save_every": 1},
                         checkpoint={"keep": 2})
    with pytest.raises(StalledRunError, match="updates in a row stalled") as err:
        train(config, records=sft_conversations(32))
    stopped = int(str(err.value).split("(step ")[1].split(":")[0])
    assert stopped < 30
    with Checkpointer(os.path.join(config.output_dir, "checkpoints")) as ckpt:
        kept = ckpt.latest_step()
    # no checkpoint of the stalled streak: the newest one predates it
    assert kept is not None and kept <= stopped - config.train.max_stalled_streak
    rows = [r for r in read_jsonl(os.path.join(config.output_dir, "metrics.jsonl")) if "grad_norm" in r]
    assert rows[-1]["grad_norm"] == 0.0 or rows[-1]["loss"] == rows[-2]["loss"]
