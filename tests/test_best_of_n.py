"""Best-of-N selection (alignax.best_of_n, evaluation.best_of_n): the best-of-k estimator
against enumeration of every subset, a perfect verifier's best-of-N equal to pass@N, step
aggregations by hand, and on the toy model: the oracle column, the reward selector, and a
PRM selector whose step scores are each prefix's score computed alone."""

import dataclasses
import itertools
import math

import jax
import numpy as np
import pytest
from flax import nnx

from alignax.best_of_n import BestOfNConfig, Selectors, best_of_k
from alignax.rewards.process import aggregate_step_scores
from alignax.evaluation import EvaluationConfig, evaluate_model, pass_at_k
from alignax.models import save_pretrained
from alignax.trainers.engine.setup import build_model, load_tokenizer
from tests.support.rl_toy import toy_config
from tests.test_evaluation import COUNTS, prompt_set, scripted_records


def _enumerated(scores, correct, k):
    """Mean over every k-subset of the mean correctness of its top-scored samples."""
    values = []
    for subset in itertools.combinations(range(len(scores)), k):
        top = max(scores[i] for i in subset)
        values.append(np.mean([correct[i] for i in subset if scores[i] == top]))
    return np.mean(values)


def test_best_of_k_matches_enumeration_of_every_subset_with_ties():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 3, size=(5, 6)).astype(float)  # few levels: many ties
    correct = rng.integers(0, 2, size=(5, 6)).astype(float)
    for k in range(1, 7):
        expected = [_enumerated(s, c, k) for s, c in zip(scores, correct)]
        np.testing.assert_allclose(best_of_k(scores, correct, k), expected, atol=1e-12, err_msg=f"k={k}")
    # k = 1 is any sample's correctness, whatever the selector
    np.testing.assert_allclose(best_of_k(scores, correct, 1), correct.mean(axis=1))


def test_a_perfect_verifier_selects_pass_at_n():
    # pass@2 of n=5 samples with c=2 correct, by hand: 1 - C(3,2)/C(5,2) = 0.7
    correct = np.array([[1, 1, 0, 0, 0]], float)
    np.testing.assert_allclose(best_of_k(correct, correct, 2), [0.7])
    for n in range(1, 7):
        for c in range(n + 1):
            verdicts = np.array([[1.0] * c + [0.0] * (n - c)])
            for k in range(1, n + 1):
                np.testing.assert_allclose(best_of_k(verdicts, verdicts, k), pass_at_k(n, c, k), atol=1e-12)


def test_step_aggregations_by_hand():
    probs = np.array([[0.9, 0.2, 0.7, 0.0], [0.5, 0.0, 0.8, 0.0], [0.3, 0.3, 0.3, 0.3]])
    mask = np.array([[1, 0, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]])
    np.testing.assert_allclose(aggregate_step_scores(probs, mask, "min"), [0.0, 0.5, 0.0])
    np.testing.assert_allclose(aggregate_step_scores(probs, mask, "product"), [0.0, 0.4, 0.0])
    np.testing.assert_allclose(aggregate_step_scores(probs, mask, "last"), [0.0, 0.8, 0.0])
    np.testing.assert_allclose(aggregate_step_scores(probs[:1], np.array([[1, 0, 1, 0]]), "product"), [0.63])
    assert BestOfNConfig(n=6).sizes() == [1, 2, 4, 6] and BestOfNConfig(n=8).sizes() == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="has no selector"):
        BestOfNConfig(n=4, by_reward=False)


@pytest.fixture(scope="module")
def toy(tmp_path_factory, toy_model):
    root = tmp_path_factory.mktemp("bon")
    config = toy_config(root / "run", toy_model, "grpo", steps=1, rewards={
        "functions": {"tests.test_evaluation:scripted": 1.0}})
    prm = build_model(config.model, kind="reward")  # the toy trunk with a fresh score head
    save_pretrained(prm, str(root / "prm"))
    return build_model(config.model), load_tokenizer(config.model), config, str(root / "prm"), prm


def test_best_of_n_on_the_toy_model(toy):
    model, tokenizer, config, prm_dir, _ = toy
    settings = EvaluationConfig(max_prompts=None, success_threshold=1.0,
                                best_of_n=BestOfNConfig(n=4, prm=prm_dir, step_delimiter="yes"))
    figures = evaluate_model(model, tokenizer, config, prompts=prompt_set(5), records=scripted_records(COUNTS),
                             evaluation=settings)
    for k in (1, 2, 4):
        oracle = np.mean([1 - math.comb(4 - c, k) / math.comb(4, k) for c in COUNTS])
        assert figures[f"best_of_n/oracle@{k}"] == pytest.approx(oracle)
        assert figures[f"best_of_n/reward@{k}"] == pytest.approx(oracle)  # the reward is the verdict here
    for name in ("prm_min", "prm_product", "prm_last"):
        assert figures[f"best_of_n/{name}@1"] == pytest.approx(sum(COUNTS) / 40)  # one sample: no choice
        assert 0.0 <= figures[f"best_of_n/{name}@4"] <= figures["best_of_n/oracle@4"] + 1e-9


def test_prm_selector_scores_each_step_prefix(toy):
    """The PRM's step probabilities of sampled completions are the sigmoid of each prefix's
    own reward (a separate forward pass per prefix)."""
    model, tokenizer, config, prm_dir, prm = toy
    from alignax.evaluation import build_sampler, prompt_batches
    from alignax.parallel.sharding import mesh_for_shape

    mesh = mesh_for_shape(config.mesh.shape)
    graphdef, state = nnx.split(model)
    sampler = build_sampler(graphdef, tokenizer, config, mesh=mesh, vocab_size=model.config.vocab_size)
    batch = next(iter(prompt_batches(config, tokenizer, prompts=prompt_set(2), records=scripted_records(COUNTS))))
    sampling = dataclasses.replace(sampler.config, greedy=False, num_samples=3)
    groups, _, _ = sampler.sample(state, batch, jax.random.key(1), config=sampling)
    selectors = Selectors(BestOfNConfig(n=3, prm=prm_dir, step_delimiter="yes"), tokenizer,
                          vocab_size=model.config.vocab_size)
    probs, step_mask = selectors.prm_step_probs(groups)
    tokens, positions, attention = groups.full_sequences()
    width = groups.prompt_tokens.shape[1]
    prm_graphdef, prm_state = nnx.split(prm)
    reward_of = jax.jit(lambda t, p, a: nnx.merge(prm_graphdef, prm_state)(t, p, a).rewards)
    checked = 0
    for r, t in zip(*np.nonzero(step_mask)):
        prefix_attention = attention[r:r + 1].copy()
        prefix_attention[0, width + t + 1:] = 0  # the prefix ending at this step's end token
        reward = float(reward_of(tokens[r:r + 1], positions[r:r + 1], prefix_attention)[0])
        assert probs[r, t] == pytest.approx(1 / (1 + math.exp(-reward)), abs=1e-5)
        checked += 1
    assert checked >= groups.size  # every completion has at least its last step
    scores = selectors.scores(groups)
    np.testing.assert_allclose(scores["prm_last"], [probs[r, np.flatnonzero(step_mask[r])[-1]]
                                                    for r in range(groups.size)])


def test_a_trained_prm_is_grpos_process_reward(tmp_path, toy, toy_model):
    """grpo.advantage=process with grpo.process_reward_model: the step rewards the advantages
    read are the PRM's probability of each step (its prefix scored alone) at the step's end."""
    from tests.test_online_variants import run_steps

    _, _, _, prm_dir, prm = toy
    prm_graphdef, prm_state = nnx.split(prm)
    reward_of = jax.jit(lambda t, p, a: nnx.merge(prm_graphdef, prm_state)(t, p, a).rewards)
    run = run_steps(tmp_path, toy_model, "grpo", grpo={
        "advantage": "process", "step_delimiter": "no", "process_reward_model": prm_dir,
        "process_reward_aggregation": "step"})
    ro, inputs = run.updates[0]["rollout"], run.inputs[0]
    tokens, positions, attention = (np.asarray(a) for a in (ro.tokens, ro.positions, ro.attention_mask))
    step_mask, width = inputs["step_mask"], run.trainer.actors.prompt_len
    expected = np.zeros(step_mask.shape)
    for r in range(step_mask.shape[0]):
        ends = np.flatnonzero(step_mask[r])
        probs = []
        for t in ends:
            prefix = attention[r:r + 1].copy()
            prefix[0, width + t + 1:] = 0
            probs.append(1 / (1 + math.exp(-float(reward_of(tokens[r:r + 1], positions[r:r + 1], prefix)[0]))))
        expected[r, ends] = probs
    assert step_mask.sum() > step_mask.shape[0]  # some completion has several steps
    np.testing.assert_allclose(inputs["step_rewards"], expected, atol=1e-5)


def test_prm_aggregations_sit_on_the_last_step(toy):
    from alignax.rewards.process import ProcessRewardModel

    prm = ProcessRewardModel(toy[3], aggregation="product")
    probs = np.array([[0.5, 0.9, 0.4, 0.7], [0.2, 0.3, 0.6, 0.1], [0.5, 0.5, 0.5, 0.5]])
    prm.step_probs = lambda groups: probs
    step_mask = np.array([[1, 0, 1, 0], [0, 1, 0, 0], [0, 0, 0, 0]])
    np.testing.assert_allclose(prm.step_rewards(None, step_mask), [[0, 0, 0.2, 0], [0, 0.3, 0, 0], [0, 0, 0, 0]])
    prm.aggregation = "step"
    np.testing.assert_allclose(prm.step_rewards(None, step_mask), [[0.5, 0, 0.4, 0], [0, 0.3, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize("aggregation", ["min", "product", "last"])
def test_a_prm_is_a_reward_component(toy, aggregation):
    """``rewards.prm`` (what ``monitor.gold.rewards.prm`` scores the gold set with): each
    completion's ``prm`` component is its steps' probabilities, each the sigmoid of its
    prefix scored alone, steps ending at a "yes" token and at the last token (found here
    by hand), reduced by the aggregation, times ``prm_weight``; the total is that alone."""
    from alignax.evaluation import build_sampler, prompt_batches
    from alignax.parallel.sharding import mesh_for_shape
    from alignax.rewards.composite import RewardConfig

    model, tokenizer, config, prm_dir, prm = toy
    config = dataclasses.replace(config, rewards=RewardConfig(
        verifier_weight=0.0, prm=prm_dir, prm_weight=0.5, prm_aggregation=aggregation, step_delimiter="yes"))
    graphdef, state = nnx.split(model)
    sampler = build_sampler(graphdef, tokenizer, config, mesh=mesh_for_shape(config.mesh.shape),
                            vocab_size=model.config.vocab_size)
    batch = next(iter(prompt_batches(config, tokenizer, prompts=prompt_set(2), records=scripted_records(COUNTS))))
    groups, _, _ = sampler.sample(state, batch, jax.random.key(3),
                                  config=dataclasses.replace(sampler.config, greedy=False, num_samples=4))
    tokens, positions, attention = groups.full_sequences()
    width, yes = groups.prompt_tokens.shape[1], tokenizer.convert_tokens_to_ids("yes")
    prm_graphdef, prm_state = nnx.split(prm)
    reward_of = jax.jit(lambda t, p, a: nnx.merge(prm_graphdef, prm_state)(t, p, a).rewards)
    several = 0
    for r in range(groups.size):
        length = int(groups.response_mask[r].sum())
        ends = sorted({t for t in range(length) if groups.tokens[r, t] == yes} | {length - 1})
        several += len(ends) > 1
        probs = []
        for t in ends:
            prefix = attention[r:r + 1].copy()
            prefix[0, width + t + 1:] = 0
            probs.append(1 / (1 + math.exp(-float(reward_of(tokens[r:r + 1], positions[r:r + 1], prefix)[0]))))
        want = {"min": min(probs), "product": math.prod(probs), "last": probs[-1]}[aggregation]
        assert groups.components["prm"][r] == pytest.approx(0.5 * want, abs=1e-5)
    assert several  # some completion has several steps: the aggregation is not vacuous
    np.testing.assert_allclose(groups.rewards, groups.components["prm"])
