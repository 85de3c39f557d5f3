"""End-to-end runs of the offline trainers on tiny models: SFT, reward model, DPO family.

Each run goes through the real entry (``alignax.trainers.run.train``): data pipeline,
jitted step, eval, checkpoints and metrics files.
"""

import json
import os

import numpy as np
import pytest

from alignax.checkpoint import Checkpointer
from alignax.metrics import read_jsonl
from alignax.trainers.run import evaluate, export, train
from tests.trainer_helpers import separable_pairs, sft_conversations, tiny_config, unpaired_feedback


def finite(history, key):
    values = [h[key] for h in history if key in h]
    assert values, f"no {key} logged"
    assert all(np.isfinite(values)), f"{key} not finite: {values}"
    return values


def test_dpo_learns_a_separable_preference(tmp_path):
    config = tiny_config(tmp_path, "dpo", data_format="preference", steps=30,
                         dpo={"beta": 0.5}, train={"eval_every": 0})
    result = train(config, records=separable_pairs(96))
    before, after = result.eval_history[0], result.eval_history[-1]
    assert before["step"] == 0 and after["step"] == 30
    assert before["eval/rewards/accuracies"] == 0.0  # policy == reference: every margin is 0
    assert after["eval/rewards/accuracies"] >= 0.9  # 24 held-out pairs; chance is 0.5
    assert after["eval/loss"] < before["eval/loss"] < 0.7
    finite(result.history, "loss")
    rows = read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
    assert rows[0]["data/train"] == 72 and rows[0]["data/eval"] == 24
    assert any("rewards/margins" in r for r in rows) and any("perf/tokens_per_s" in r for r in rows)


@pytest.mark.parametrize(
    "section",
    [
        {"loss": "dpo", "variant": "ipo"},
        {"loss": "dpo", "reference": "precomputed"},
        {"loss": "simpo", "beta": 2.0},
        {"loss": "orpo"},
    ],
    ids=["ipo", "precomputed-reference", "simpo", "orpo"],
)
def test_preference_losses_run_end_to_end(tmp_path, section):
    config = tiny_config(tmp_path, "dpo", data_format="preference", steps=3, dpo=section,
                         checkpoint={"enabled": False})
    result = train(config, records=separable_pairs(32))
    finite(result.history, "loss")
    assert "eval/rewards/accuracies" in result.eval_history[-1]


def test_precomputed_reference_matches_live_reference(tmp_path):
    records = separable_pairs(32)
    live = train(tiny_config(tmp_path / "live", "dpo", data_format="preference", steps=3,
                             checkpoint={"enabled": False}), records=records)
    pre = train(tiny_config(tmp_path / "pre", "dpo", data_format="preference", steps=3,
                            dpo={"reference": "precomputed"}, checkpoint={"enabled": False}), records=records)
    for a, b in zip(live.history, pre.history):
        np.testing.assert_allclose(a["loss"], b["loss"], rtol=1e-5)


def test_kto_runs_on_unpaired_feedback(tmp_path):
    config = tiny_config(tmp_path, "dpo", data_format="unpaired", steps=3, dpo={"loss": "kto"},
                         checkpoint={"enabled": False})
    result = train(config, records=unpaired_feedback(32))
    finite(result.history, "loss")
    finite(result.history, "kl")


def test_sft_lowers_held_out_nll(tmp_path):
    config = tiny_config(tmp_path, "sft", data_format="sft", steps=12, checkpoint={"enabled": False})
    result = train(config, records=sft_conversations(48))
    before, after = result.eval_history[0], result.eval_history[-1]
    assert after["eval/nll"] < before["eval/nll"] - 1.0
    np.testing.assert_allclose(after["eval/ppl"], np.exp(after["eval/nll"]), rtol=1e-6)


def test_reward_model_learns_held_out_pairs(tmp_path):
    config = tiny_config(tmp_path, "reward", data_format="preference", steps=20, checkpoint={"enabled": False})
    result = train(config, records=separable_pairs(64))
    assert result.eval_history[-1]["eval/accuracy"] >= 0.9
    finite(result.history, "loss")


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path):
    records = separable_pairs(48)
    full = train(tiny_config(tmp_path / "full", "dpo", data_format="preference", steps=6), records=records)
    first = train(tiny_config(tmp_path / "split", "dpo", data_format="preference", steps=3), records=records)
    resumed = train(tiny_config(tmp_path / "split", "dpo", data_format="preference", steps=6), records=records)
    assert first.loop.last_step == 3 and [h["step"] for h in resumed.history] == [4, 5, 6]
    assert [h["loss"] for h in full.history[3:]] == [h["loss"] for h in resumed.history]
    assert [h["grad_norm"] for h in full.history[3:]] == [h["grad_norm"] for h in resumed.history]
    ckpt = Checkpointer(str(tmp_path / "split" / "checkpoints"))
    assert ckpt.has_reference() and ckpt.latest_step() == 6
    ckpt.close()


def test_eval_and_export_from_a_checkpoint(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(tmp_path, "dpo", data_format="preference", steps=2)
    records = separable_pairs(32)
    result = train(config, records=records)
    figures = evaluate(config, records=records)
    np.testing.assert_allclose(figures["rewards/accuracies"], result.eval_history[-1]["eval/rewards/accuracies"])
    out = export(config)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokens = np.array([[1, 17, 300, 42, 9]])
    ours = np.asarray(result.model(tokens).logits)
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    with open(os.path.join(out, "tokenizer_config.json")) as f:
        assert json.load(f)


def test_bad_algorithm_data_pairing_is_a_clear_error(tmp_path):
    config = tiny_config(tmp_path, "dpo", data_format="sft", steps=1)
    with pytest.raises(ValueError, match="dpo.loss=dpo needs data.format=preference"):
        train(config, records=sft_conversations(16))
