"""Rule-based rewards (alignax.rewards.verifiers) on hand-made completions."""

from __future__ import annotations

import numpy as np
import pytest

from alignax.rewards.verifiers import (answer_reward, extract_answer, format_reward, length_closeness,
                                      numeric_closeness, verifier_rewards)

REF = {"answer": "-4", "task": "chain_sum"}


def test_extract_answer_takes_the_last_tag():
    assert extract_answer("<think>hmm</think><answer> 12 </answer>") == "12"
    assert extract_answer("<answer>1</answer> no, <answer>2</answer>") == "2"
    assert extract_answer("12") is None
    assert extract_answer("<final>7</final>", tag="final") == "7"


def test_answer_reward_uses_the_task_scorer():
    completions = [
        "<think>4 - 1 - 7</think><answer>-4</answer>",
        "<answer> -4 </answer>",
        "<answer>-4.00</answer>",  # chain_sum compares decimals
        "<answer>5</answer>",
        "-4",  # no tag: nothing extracted
        "<answer>-44</answer>",  # partial credit: len('-4') / len('-44')
        "<answer>1</answer> wait <answer>-4</answer>",
    ]
    scores, errors = answer_reward(completions, [REF] * len(completions))
    np.testing.assert_allclose(scores, [1, 1, 1, 0, 0, 2 / 3, 1], rtol=1e-6)
    assert scores.dtype == np.float32 and not errors.any()


def test_task_from_metadata_or_default():
    refs = [{"answer": "7", "metadata": {"source_dataset": "basic_arithmetic"}}, {"answer": "7"}]
    scores, _ = answer_reward(["<answer>7</answer>", "<answer>7</answer>"], refs, task="chain_sum")
    np.testing.assert_array_equal(scores, [1, 1])


def test_scorer_failure_on_model_output_is_zero_and_flagged():
    ref = {"answer": "2 × 433", "task": "prime_factorization", "metadata": {"number": 866, "factors": [2, 433]}}
    scores, errors = answer_reward(["<answer>2 × 433</answer>", "<answer>2 x</answer>"], [ref, ref])
    np.testing.assert_array_equal(scores, [1, 0])
    np.testing.assert_array_equal(errors, [0, 1])


def test_format_reward_lenient_and_strict():
    completions = [
        "<think>x</think>\n<answer>3</answer>",
        "so <answer>3</answer>",
        "<answer></answer>",
        "<answer>1</answer><answer>2</answer>",
        "<answer>3</answer> trailing",
        "3",
    ]
    np.testing.assert_array_equal(format_reward(completions), [1, 1, 0, 1, 1, 0])
    np.testing.assert_array_equal(format_reward(completions, strict=True), [1, 0, 0, 0, 0, 0])


def test_verifier_rewards_weights_and_components():
    completions = ["<answer>-4</answer>", "-4", "<answer>3</answer>"]
    rewards, parts = verifier_rewards(completions, [REF] * 3, answer_weight=1.0, format_weight=0.5)
    np.testing.assert_allclose(rewards, [1.5, 0.0, 0.5])
    np.testing.assert_array_equal(parts["answer"], [1, 0, 0])
    np.testing.assert_array_equal(parts["format"], [1, 0, 1])
    np.testing.assert_array_equal(parts["correct"], [1, 0, 0])
    np.testing.assert_array_equal(parts["scorer_error"], [0, 0, 0])
    assert rewards.dtype == np.float32 and rewards.shape == (3,)


def test_clear_errors_for_references_the_scorer_cannot_use():
    with pytest.raises(ValueError, match="reference 1 \\(task 'chain_sum'\\) has no 'answer'.*keys: task"):
        answer_reward(["a", "b"], [REF, {"task": "chain_sum"}])
    with pytest.raises(ValueError, match="reference 0 names no reasoning-gym task"):
        answer_reward(["a"], [{"answer": "1"}])
    with pytest.raises(ValueError, match="reference 0 \\(task 'number_format'\\) lacks 'metadata'"):
        answer_reward(["<answer>1</answer>"], [{"answer": "1", "task": "number_format"}])
    with pytest.raises(ValueError, match="unknown reasoning-gym task 'chainsum'"):
        answer_reward(["a"], [{"answer": "1", "task": "chainsum"}])
    with pytest.raises(ValueError, match="2 completions but 1 references"):
        verifier_rewards(["a", "b"], [REF])
    with pytest.raises(TypeError, match="not one string"):
        format_reward("<answer>1</answer>")


def test_last_number_extraction_is_a_fallback_for_untagged_answers():
    assert extract_answer("4 + 3 = 7.", extraction="tag_or_last_number") == "7"
    assert extract_answer("<answer>5</answer> then 9", extraction="tag_or_last_number") == "5"  # a tag wins
    assert extract_answer("it is -12.5 or so", extraction="tag_or_last_number") == "-12.5"
    assert extract_answer("no digits here", extraction="tag_or_last_number") is None
    assert extract_answer("4 + 3 = 7.") is None  # the default reads tags only
    with pytest.raises(ValueError, match="valid: tag, tag_or_last_number"):
        extract_answer("7", extraction="number")
    reference = {"answer": "7", "task": "chain_sum", "metadata": {}}
    _, parts = verifier_rewards(["4 + 3 = 7.", "4 + 3 = 8."], [reference, reference], extraction="tag_or_last_number")
    assert parts["correct"].tolist() == [1.0, 0.0] and parts["format"].tolist() == [0.0, 0.0]


def test_with_task_fills_only_records_that_name_none():
    from alignax.rewards.process import outcome_on_last_step
    from alignax.rewards.verifiers import with_task

    records = [{"answer": "7"}, {"answer": "7", "task": "basic_arithmetic"},
               {"answer": "7", "metadata": {"source_dataset": "chain_sum"}}]
    filled = with_task(records, "chain_sum")
    assert filled[0]["task"] == "chain_sum" and filled[1] is records[1] and filled[2] is records[2]
    assert with_task(records, None) == records
    # the process rewards read the task from the record: rewards.task reaches them this way
    steps = [["so", "<answer>7</answer>"]]
    with pytest.raises(ValueError, match="names no reasoning-gym task"):
        outcome_on_last_step(steps, records[:1])
    assert outcome_on_last_step(steps, with_task(records[:1], "chain_sum"))[0][-1] == 1.0


def test_numeric_closeness_grades_near_misses_worked_by_hand():
    refs = [{"answer": "17"}] * 5
    completions = ["<answer>17</answer>", "so it is 15", "<answer>20</answer> then 17", "no number here", "-3"]
    # exact; |15-17| = 2 -> 1/3; the tag wins over a later number: |20-17| = 3 -> 1/4; none -> 0; |-3-17| = 20 -> 1/21
    np.testing.assert_allclose(numeric_closeness(completions, refs), [1.0, 1 / 3, 1 / 4, 0.0, 1 / 21], rtol=1e-6)
    assert numeric_closeness(["<answer>17</answer>"], refs[:1], extraction="tag")[0] == 1.0
    assert numeric_closeness(["17"], refs[:1], extraction="tag")[0] == 0.0  # no tag, and only the tag is read
    with pytest.raises(ValueError, match="reference 0 has no numeric 'answer'"):
        numeric_closeness(["1"], [{"answer": "seven"}])


def test_length_closeness_worked_by_hand():
    refs = [{"answer": "17"}, {"answer": 17}, {"answer": "seven"}]
    # |2-2| = 0 -> 1; "so 17" is 5 long: |5-2| = 3 -> 1/4; "" against "seven": 5 -> 1/6
    np.testing.assert_allclose(length_closeness(["42", "so 17", ""], refs), [1.0, 1 / 4, 1 / 6], rtol=1e-6)
    with pytest.raises(ValueError, match="reference 1 has no 'answer'"):
        length_closeness(["a", "b"], [{"answer": "x"}, {"task": "chain_sum"}])
