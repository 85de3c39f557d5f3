"""Generation-based evaluation (alignax.evaluation): the pass@k estimator against
hand-worked values and brute-force enumeration; greedy accuracy and pass@k of the toy
model under a reward function whose verdicts the prompt records set (so every expected
figure is known exactly, whatever the model writes); padded batches; the JSON report.
"""

import itertools
import json
import math

import numpy as np
import pytest

from alignax import evaluation
from alignax.data import DataConfig, prepare_dataset
from alignax.evaluation import EvaluationConfig, evaluate_model, pass_at_k, write_report
from alignax.trainers.engine.setup import build_model, load_tokenizer
from tests.support.rl_toy import toy_config
from tests.support.toy_model import TOY_WORDS
from tests.support.trainer_helpers import tiny_config

N_SAMPLES = 4


def scripted(completions, references):
    """1 for the first ``reference["correct"]`` samples of each prompt, else 0: the number of
    correct samples of a prompt is whatever its record says. Samples of one prompt are
    consecutive rows (the sampler's group-contiguous layout)."""
    out, index = [], 0
    for r, ref in enumerate(references):
        index = index + 1 if r and ref["id"] == references[r - 1]["id"] else 0
        out.append(1.0 if index < ref["correct"] else 0.0)
    return out


def scripted_records(correct_counts):
    words = [w for w in TOY_WORDS if w not in ("yes", "no")]
    return [{"prompt": f"{words[i % len(words)]} {words[(3 * i) % len(words)]}", "answer": "yes", "task": "toy",
             "id": i, "correct": c} for i, c in enumerate(correct_counts)]


# Record 0 is correct in every sample: padding (copies of the first example) would lift every figure.
COUNTS = [4, 0, 1, 0, 2, 0, 0, 3, 0, 0]


@pytest.fixture(scope="module")
def toy(tmp_path_factory, toy_model):
    config = toy_config(tmp_path_factory.mktemp("eval"), toy_model, "grpo", steps=1, rewards={
        "functions": {"tests.test_evaluation:scripted": 1.0}})
    return build_model(config.model), load_tokenizer(config.model), config


def prompt_set(batch_size=4):
    return DataConfig(format="prompt", max_prompt_length=24, batch_size=batch_size, read_threads=0)


def expected_pass_at_k(counts, n, k):
    return float(np.mean([1 - math.comb(n - c, k) / math.comb(n, k) for c in counts]))


# ---------------------------------------------------------------------- the estimator
def test_pass_at_k_hand_worked_values():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10
    np.testing.assert_allclose(pass_at_k(5, 2, 2), 0.7)
    # n=10, c=3, k=4: 1 - C(7,4)/C(10,4) = 1 - 35/210
    np.testing.assert_allclose(pass_at_k(10, 3, 4), 5 / 6)
    # k=1 is the share of correct samples; no correct sample: 0; fewer wrong than k: 1
    np.testing.assert_allclose(pass_at_k(8, np.array([0, 3, 8]), 1), [0.0, 3 / 8, 1.0])
    np.testing.assert_allclose(pass_at_k(6, np.array([0, 4, 5]), 3), [0.0, 1.0, 1.0])
    # large n: the product form stays finite where the binomials would overflow floats
    np.testing.assert_allclose(pass_at_k(2000, 1, 1000), 0.5)


def test_pass_at_k_matches_brute_force_enumeration():
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(samples, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                np.testing.assert_allclose(pass_at_k(n, c, k), brute, atol=1e-12, err_msg=f"n={n} c={c} k={k}")


def test_pass_at_k_rejects_impossible_arguments():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="correct counts"):
        pass_at_k(4, 5, 2)


def test_config_validation():
    with pytest.raises(ValueError, match="evaluation.prompts.format must be prompt"):
        EvaluationConfig(prompts=DataConfig(format="preference"))
    with pytest.raises(ValueError, match="pass_k"):
        EvaluationConfig(pass_k=(0, 2))
    assert EvaluationConfig(pass_k=[4, 1, 4]).pass_k == (1, 4)


# ---------------------------------------------------------------------- on the toy model
def test_greedy_and_sampled_figures_are_exact_and_padding_free(toy):
    model, tokenizer, config = toy
    settings = EvaluationConfig(max_prompts=None, pass_k=(1, 2, 4), success_threshold=1.0)
    # 10 prompts in batches of 4: the last batch holds 2 padding copies of record 0 (all correct)
    figures = evaluate_model(model, tokenizer, config, prompts=prompt_set(4), records=scripted_records(COUNTS),
                             evaluation=settings)
    assert figures["prompts"] == 10
    # greedy: one sample per prompt, correct when its record allows at least one
    assert figures["accuracy"] == pytest.approx(4 / 10)  # with padding it would be 6/12
    assert figures["reward"] == pytest.approx(4 / 10)
    assert figures["reward/fn/tests.test_evaluation:scripted"] == pytest.approx(4 / 10)
    for k in (1, 2, 4):
        assert figures[f"pass@{k}"] == pytest.approx(expected_pass_at_k(COUNTS, N_SAMPLES, k)), k
    assert figures["sampled/accuracy"] == pytest.approx(sum(COUNTS) / (10 * N_SAMPLES))  # 10/40
    assert figures["sampled/reward"] == pytest.approx(sum(COUNTS) / (10 * N_SAMPLES))
    assert figures["stop_rate"] + figures["truncation_rate"] == pytest.approx(1.0)
    assert 1 <= figures["length"] <= config.rollout.max_new_tokens
    assert 1 <= figures["sampled/length"] <= config.rollout.max_new_tokens

    # a batch size that divides the set (no padding) gives the same figures
    unpadded = evaluate_model(model, tokenizer, config, prompts=prompt_set(5), records=scripted_records(COUNTS),
                              evaluation=settings)
    for key in ("accuracy", "reward", "pass@1", "pass@2", "pass@4", "sampled/accuracy"):
        assert unpadded[key] == pytest.approx(figures[key]), key


def test_max_prompts_takes_the_first_prompts(toy):
    model, tokenizer, config = toy
    settings = EvaluationConfig(max_prompts=5, success_threshold=1.0)
    figures = evaluate_model(model, tokenizer, config, prompts=prompt_set(4), records=scripted_records(COUNTS),
                             evaluation=settings)
    assert figures["prompts"] == 5
    assert figures["accuracy"] == pytest.approx(3 / 5)  # counts 4, 0, 1, 0, 2


def test_the_runs_eval_split_is_the_default_prompt_set(toy):
    model, tokenizer, config = toy
    counts = [(i * 7) % 5 for i in range(40)]  # 0..4 correct samples
    records = scripted_records(counts)
    # eval_fraction 0.25 holds out whole prompt groups: the 40 records have 11 prompts (i % 11),
    # so the held-out set is 11 records, never a prompt that also sits in train
    split = prepare_dataset(config.data, tokenizer, records=records).eval_indices
    settings = EvaluationConfig(max_prompts=None, pass_k=(2,), success_threshold=1.0)
    figures = evaluate_model(model, tokenizer, config, records=records, evaluation=settings)
    held_out = [counts[i] for i in split]
    assert figures["prompts"] == len(held_out) == 11
    assert figures["accuracy"] == pytest.approx(np.mean([c > 0 for c in held_out]))
    # n = max(pass_k) = 2 samples: a prompt allowing more has both correct
    assert figures["pass@2"] == pytest.approx(expected_pass_at_k([min(c, 2) for c in held_out], 2, 2))


def test_missing_prompts_or_verdicts_are_clear_errors(toy, tmp_path, toy_model):
    model, tokenizer, config = toy
    with pytest.raises(ValueError, match="needs a verdict"):  # a reward function has no verdict of its own
        evaluate_model(model, tokenizer, config, prompts=prompt_set(), records=scripted_records(COUNTS),
                       evaluation=EvaluationConfig(pass_k=(2,)))
    # the run's own evaluation settings: max_prompts 4 (tests/support/rl_toy.py), counts 4, 0, 1, 0
    no_verdict = evaluate_model(model, tokenizer, config, prompts=prompt_set(), records=scripted_records(COUNTS))
    assert "accuracy" not in no_verdict
    assert no_verdict["prompts"] == 4 and no_verdict["reward"] == pytest.approx(2 / 4)
    dpo = tiny_config(tmp_path, "dpo", model_dir=toy_model)  # preference data, no prompts of its own
    with pytest.raises(ValueError, match="set evaluation.prompts"):
        evaluate_model(model, tokenizer, dpo, records=scripted_records(COUNTS))


# ---------------------------------------------------------------------- the report
def test_report_round_trips(tmp_path):
    figures = {"accuracy": 0.3125, "pass@4": 2 / 3, "reward/fn/x:y": -1.5e-7, "prompts": 128.0}
    path = write_report(str(tmp_path / "run" / "evaluation" / "step.json"), figures, step=16, model="runs/demo/grpo",
                        evaluation=EvaluationConfig(pass_k=(1, 4)), counts=np.arange(3))
    with open(path) as f:
        report = json.load(f)
    assert report["figures"] == figures  # floats survive exactly
    assert report["step"] == 16 and report["model"] == "runs/demo/grpo"
    assert report["evaluation"]["pass_k"] == [1, 4] and report["evaluation"]["max_prompts"] == 128
    assert report["counts"] == [0, 1, 2]
    assert evaluation.report_path("runs/x", 16) == "runs/x/evaluation/step_00000016.json"
