"""``alignax.trainers.api``: train, evaluate and export for every algorithm, and the
exports load in transformers with the trained model's outputs.

One tiny run per algorithm on the toy model (sft, reward, dpo, kto, grpo, ppo with a
separate critic), then ``evaluate`` and ``export`` from its checkpoint as ``alignax eval``
and ``alignax export`` do.
"""

import ast
import json
import os

import numpy as np
import pytest

from alignax.trainers.api import ALGORITHMS, evaluate, export, train
from tests.support.rl_toy import toy_config, toy_prompts
from tests.support.trainer_helpers import separable_pairs, sft_conversations, step_solutions, tiny_config, unpaired_feedback

pytestmark = pytest.mark.xdist_group("api")

TOKENS = np.array([[1, 17, 3, 12, 9, 4]])


def _run(name, tmp_path, toy_model):
    """``(config, records, the figure every evaluation of it reports)``."""
    if name in ("grpo", "ppo"):
        sections = {"ppo": {"epochs": 1}} if name == "ppo" else {}
        return toy_config(tmp_path, toy_model, name, steps=1, **sections), toy_prompts(16), "reward"
    records = {"sft": sft_conversations, "reward": separable_pairs, "prm": step_solutions, "dpo": separable_pairs,
               "kto": unpaired_feedback}[name](32)
    key = {"sft": "nll", "reward": "accuracy", "prm": "step_accuracy", "dpo": "rewards/accuracies",
           "kto": "loss"}[name]
    return tiny_config(tmp_path, name, steps=1, model_dir=toy_model), records, key


# The algorithms run through train/evaluate/export below, and those run in a file of their own.
RUN_HERE = ("sft", "reward", "prm", "dpo", "kto", "grpo", "ppo")
RUN_ELSEWHERE = {"iterative_dpo": "test_iterative.py", "distill": "test_distill.py", "gkd": "test_distill.py",
                 "onpolicy_distill": "test_distill_online.py"}


def test_every_algorithm_of_the_map_is_trained_evaluated_and_exported_by_a_test():
    """A new entry of the map fails here until a test runs it end to end (kto is dpo's loss)."""
    assert set(ALGORITHMS) == (set(RUN_HERE) - {"kto"}) | set(RUN_ELSEWHERE)
    for name, file in RUN_ELSEWHERE.items():
        text = open(os.path.join(os.path.dirname(__file__), file), encoding="utf-8").read()
        functions = {f.name: f for f in ast.parse(text).body if isinstance(f, ast.FunctionDef)}
        assert any(_runs_end_to_end(test, functions) for test in functions.values()), (name, file)
        assert name in text or name.replace("_", "-") in text, (name, file)


def _called(node) -> set[str]:
    return {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}


def _runs_end_to_end(test, functions) -> bool:
    """A test that calls the api's ``evaluate`` and ``export``, with ``train`` called by the
    test itself or by a fixture it takes."""
    if not test.name.startswith("test_"):
        return False
    trained = "train" in _called(test) or any(
        "train" in _called(functions[a.arg]) for a in test.args.args if a.arg in functions)
    return trained and {"evaluate", "export"} <= _called(test)


# DPO's train, evaluate and export through the API: tests/test_trainers.py::
# test_eval_and_export_from_a_checkpoint (in the default run, with evaluate's figures equal
# to the run's own); here in the slow run only.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "dpo" else n for n in RUN_HERE])
def test_train_evaluate_export_for_every_algorithm(tmp_path, toy_model, name):
    config, records, key = _run(name, tmp_path / "run", toy_model)
    with pytest.raises(FileNotFoundError, match="no checkpoint under .*checkpoints"):
        export(config, str(tmp_path / "nothing"))  # nothing trained yet: no silent export of the start
    result = train(config, records=records)
    figures = evaluate(config, records=records)
    assert key in figures and np.isfinite(figures[key]), figures
    assert result.eval_history and f"eval/{key}" in result.eval_history[-1]

    out = export(config, str(tmp_path / "export"), critic=name == "ppo")
    if name == "grpo":  # no critic to export: refused, not an empty folder
        with pytest.raises(ValueError, match="only ppo.critic=separate has a critic model"):
            export(config, str(tmp_path / "export-critic"), critic=True)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(out))
    with open(os.path.join(out, "config.json")) as f:
        architecture = json.load(f)["architectures"][0]
    torch = pytest.importorskip("torch", reason="the PyTorch reference (pinned test extras; not in `make test-latest`)")
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    with torch.no_grad():
        if name in ("reward", "prm"):
            assert architecture.endswith("ForSequenceClassification")
            hf = AutoModelForSequenceClassification.from_pretrained(out, local_files_only=True).eval()
            theirs = hf(torch.tensor(TOKENS)).logits.numpy()[:, 0]
            ours = np.asarray(result.model(TOKENS).rewards)
        else:
            assert architecture.endswith("ForCausalLM")
            hf = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
            theirs = hf(torch.tensor(TOKENS)).logits.numpy()
            ours = np.asarray(result.model(TOKENS).logits)
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    if name == "ppo":  # the separate critic, on request, as a sequence-classification checkpoint
        critic = AutoModelForSequenceClassification.from_pretrained(os.path.join(out, "critic"),
                                                                    local_files_only=True)
        assert critic.config.num_labels == 1
