"""End-to-end runs of the offline trainers on tiny models: SFT, reward model, DPO family.

Each run goes through the real entry (``alignax.trainers.run.train``) with a recipe from
configs/tiny-*.yaml: data pipeline, jitted step, eval, checkpoints and metrics files.
Tests that assert learning, resume or export train the toy word-level model
(tests/toy_model.py) on synthetic records whose right answer is known; the recipes
themselves run on reasoning-gym data with SmolLM2's tokenizer.
"""

import glob
import json
import os

import numpy as np
import pytest

from alignax.checkpoint import Checkpointer
from alignax.metrics import read_jsonl
from alignax.trainers.config import load_config
from alignax.trainers.run import evaluate, export, train
from tests.trainer_helpers import CONFIGS, separable_pairs, sft_conversations, tiny_config


def finite(history, key):
    values = [h[key] for h in history if key in h]
    assert values, f"no {key} logged"
    assert all(np.isfinite(values)), f"{key} not finite: {values}"
    return values


def test_every_recipe_parses():
    paths = sorted(glob.glob(os.path.join(CONFIGS, "*.yaml")))
    assert len(paths) >= 8
    for path in paths:
        config = load_config(path)
        assert config.algorithm in ("sft", "reward", "dpo", "ppo", "grpo"), path


def test_dpo_learns_a_separable_preference(tmp_path, toy_model):
    config = tiny_config(tmp_path, "dpo", steps=30, model_dir=toy_model, dpo={"beta": 0.5}, train={"save_every": 0})
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
    config = tiny_config(tmp_path, recipe, steps=2, dpo=section, checkpoint={"enabled": False})
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
    pre = train(tiny_config(tmp_path / "pre", "dpo", steps=3, model_dir=toy_model, dpo={"reference": "precomputed"},
                            checkpoint={"enabled": False}), records=records)
    assert len(live.history) == len(pre.history) == 3
    for a, b in zip(live.history, pre.history):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)
    np.testing.assert_allclose(live.eval_history[-1]["eval/loss"], pre.eval_history[-1]["eval/loss"], rtol=1e-5)


def test_sft_lowers_held_out_nll(tmp_path, toy_model):
    config = tiny_config(tmp_path, "sft", steps=30, model_dir=toy_model, checkpoint={"enabled": False},
                         optim={"learning_rate": 2e-2})
    result = train(config, records=sft_conversations(48))
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
    full = train(tiny_config(tmp_path / "full", "dpo", steps=6, model_dir=toy_model), records=records)
    first = train(tiny_config(tmp_path / "split", "dpo", steps=3, model_dir=toy_model), records=records)
    resumed = train(tiny_config(tmp_path / "split", "dpo", steps=6, model_dir=toy_model), records=records)
    assert first.loop.last_step == 3 and [h["step"] for h in resumed.history] == [4, 5, 6]
    assert [h["loss"] for h in full.history[3:]] == [h["loss"] for h in resumed.history]
    assert [h["grad_norm"] for h in full.history[3:]] == [h["grad_norm"] for h in resumed.history]
    ckpt = Checkpointer(str(tmp_path / "split" / "checkpoints"))
    assert ckpt.has_reference() and ckpt.latest_step() == 6
    ckpt.close()


def test_eval_and_export_from_a_checkpoint(tmp_path, toy_model):
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(tmp_path, "dpo", steps=2, model_dir=toy_model)
    records = separable_pairs(32)
    result = train(config, records=records)
    figures = evaluate(config, records=records)
    np.testing.assert_allclose(figures["rewards/accuracies"], result.eval_history[-1]["eval/rewards/accuracies"])
    np.testing.assert_allclose(figures["loss"], result.eval_history[-1]["eval/loss"], rtol=1e-6)
    out = export(config)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokens = np.array([[1, 17, 3, 12, 9]])
    ours = np.asarray(result.model(tokens).logits)
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        assert json.load(f)


def test_bad_algorithm_data_pairing_is_a_clear_error(tmp_path):
    config = tiny_config(tmp_path, "dpo", steps=1, data={"format": "sft"})
    with pytest.raises(ValueError, match="dpo.loss=dpo needs data.format=preference"):
        train(config, records=sft_conversations(16))


def test_scoring_a_response_window_equals_scoring_every_position(toy_model):
    """The LM head may run on each row's response window only: same sequence log-probs."""
    from alignax.models import from_pretrained
    from alignax.trainers.common import response_logps, sequence_logps

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
    full = sequence_logps(*response_logps(model, tokens, positions, attention, response))
    windowed = sequence_logps(*response_logps(model, tokens, positions, attention, response, window=6))
    np.testing.assert_allclose(windowed[0], full[0], rtol=1e-6)
    np.testing.assert_array_equal(windowed[1], full[1])
    # a window running past the end of a row is cut there, not wrapped
    np.testing.assert_allclose(sequence_logps(*response_logps(model, tokens, positions, attention, response,
                                                              window=10))[0], full[0], rtol=1e-6)
