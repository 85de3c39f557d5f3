"""The LLM judge reward (alignax.rewards.judge): its score is the verdict tokens'
log-probability computed by hand in a separate forward pass of the judge, and it enters the
online reward as the weighted ``judge`` component."""

import math

import jax
import numpy as np
import pytest
from flax import nnx

from alignax.models import from_pretrained
from alignax.rewards.composite import RewardConfig, RewardScorer
from alignax.rewards.judge import Judge
from tests.data.tiny_tokenizer import ids

RUBRIC = "{prompt} is {completion}"


def _by_hand(logits_of, head, verdict):
    """``sum_i log p(verdict_i | head, verdict_<i)`` from the full logits of one row (right
    padding after it changes no logit before it: the mask is causal)."""
    tokens = np.zeros((1, 32), np.int32)
    tokens[0, :len(head) + len(verdict)] = head + verdict
    logits = np.asarray(logits_of(tokens), np.float64)[0]
    total = 0.0
    for i, token in enumerate(verdict):
        row = logits[len(head) + i - 1]
        total += row[token] - (np.log(np.sum(np.exp(row - row.max()))) + row.max())
    return total


@pytest.fixture(scope="module")
def judge(toy_model):
    return Judge(toy_model, rubric=RUBRIC, verdicts=("yes ok", "no"))


def test_the_judge_score_is_the_verdict_log_probability_by_hand(judge, toy_model):
    graphdef, state = nnx.split(from_pretrained(toy_model))
    logits_of = jax.jit(lambda t: nnx.merge(graphdef, state)(t).logits)
    prompts, completions = ["what is two", "hi there"], ["four", "bye now sure"]
    head = [ids("<|im_start|>", "user", "\n", "what", "is", "two", "is", "four", "<|im_end|>", "\n",
                "<|im_start|>", "assistant", "\n"),
            ids("<|im_start|>", "user", "\n", "hi", "there", "is", "bye", "now", "sure", "<|im_end|>", "\n",
                "<|im_start|>", "assistant", "\n")]
    assert judge.judge_prompt_ids(prompts[0], completions[0]) == head[0]
    logps = judge.verdict_logps(prompts, completions)
    for r in range(2):
        np.testing.assert_allclose(logps[r, 0], _by_hand(logits_of, head[r], ids("yes", "ok")), atol=1e-4)
        np.testing.assert_allclose(logps[r, 1], _by_hand(logits_of, head[r], ids("no")), atol=1e-4)
    references = [{"prompt": p} for p in prompts]
    np.testing.assert_allclose(judge.score(completions, references), logps[:, 0], atol=1e-6)
    judge.score_kind = "normalized"
    try:
        expected = [math.exp(a) / (math.exp(a) + math.exp(b)) for a, b in logps]
        np.testing.assert_allclose(judge.score(completions, references), expected, atol=1e-6)
    finally:
        judge.score_kind = "logp"


def test_the_judge_is_a_weighted_reward_component(judge, toy_model):
    section = RewardConfig(verifier_weight=0.0, judge_model=toy_model, judge_weight=0.5, judge_rubric=RUBRIC,
                           judge_verdicts=("yes ok", "no"))
    scorer = RewardScorer(section, max_new_tokens=4, stop_token_ids=(1,))
    completions = ["four", "bye now"]
    references = [{"prompt": "what is two"}, {"prompt": [{"role": "user", "content": "hi there"}]}]
    mask = np.ones((2, 4), np.int32)
    total, components = scorer.score(completions, references, np.zeros((2, 4), np.int32), mask)
    expected = 0.5 * judge.score(completions, [{"prompt": "what is two"}, {"prompt": "hi there"}])
    np.testing.assert_allclose(components["judge"], expected, rtol=1e-6)
    np.testing.assert_allclose(total, expected, rtol=1e-6)


def test_judge_settings_are_checked(toy_model):
    with pytest.raises(ValueError, match="must contain {completion}"):
        Judge(toy_model, rubric="{prompt}")
    with pytest.raises(ValueError, match="two different non-empty texts"):
        Judge(toy_model, verdicts=("yes", "yes"))
    with pytest.raises(FileNotFoundError, match="rewards.judge_model 'no/such' is neither"):
        Judge("no/such")
