"""Math-Shepherd step labels (alignax.math_shepherd) on a toy policy whose success
probability after each prefix is known exactly: the toy model with every weight zero
samples each of its 32 token ids with probability 1/32, and a completion (one token) is
correct after prefix i when it is one of SUCCESS[i]'s words, so p_i = |SUCCESS[i]| / 32.

Bound: with K = 512 completions per prefix, Hoeffding gives P(|c_i / K - p_i| >= eps) <=
2 exp(-2 K eps^2) = 1e-3 for eps = sqrt(ln(2000) / 1024) = 0.086; the hard label of a
prefix with p_i >= 1/32 is wrong with probability (31/32)^512 < 1e-7, and exact at p_i = 0.
"""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from alignax.evaluation import build_sampler
from alignax.math_shepherd import hoeffding_epsilon, label_solutions, labels_from_counts
from alignax.parallel.sharding import mesh_for_shape
from alignax.trainers.engine.setup import build_model, load_tokenizer
from tests.support.rl_toy import toy_config

SUCCESS = {0: {"yes"}, 1: {"yes", "no", "hi", "there", "bye", "now", "ok", "sure"}, 2: set(), 3: {"yes"}}
K = 512


def prefix_words(completions, references):
    """1 when the completion's last word is one that succeeds after the reference's prefix."""
    return [float(text.split()[-1:] != [] and text.split()[-1] in SUCCESS[ref["shepherd_prefix"]])
            for text, ref in zip(completions, references)]


def test_labels_from_counts_by_hand():
    assert labels_from_counts([0, 3, 8], 8, "hard") == [0.0, 1.0, 1.0]
    assert labels_from_counts([0, 3, 8], 8, "soft") == [0.0, 0.375, 1.0]
    assert hoeffding_epsilon(512, 1e-3) == math.sqrt(math.log(2000) / 1024)


def test_soft_and_hard_labels_match_the_known_success_probabilities(tmp_path, toy_model):
    config = toy_config(tmp_path, toy_model, "grpo", steps=1, rollout={"max_new_tokens": 1},
                        rewards={"functions": {"tests.test_math_shepherd:prefix_words": 1.0}})
    model = build_model(config.model)
    graphdef, state = nnx.split(model)
    state = jax.tree.map(jnp.zeros_like, state)  # every weight 0: uniform next-token distribution
    tokenizer = load_tokenizer(config.model)
    assert np.allclose(nnx.merge(graphdef, state)(jnp.ones((1, 3), jnp.int32)).logits, 0.0)
    sampler = build_sampler(graphdef, tokenizer, config, mesh=mesh_for_shape(config.mesh.shape),
                            vocab_size=model.config.vocab_size)
    solution = {"prompt": "what is two plus two", "steps": ["two plus two", "is four", "ok", "yes"]}
    (record,) = label_solutions(sampler, state, [solution], num_samples=K, max_prompt_length=24, estimator="soft",
                                batch_prefixes=3, success_threshold=1.0)
    exact = [len(SUCCESS[i]) / 32 for i in range(3)]
    assert record["steps"] == solution["steps"] and record["shepherd_samples"] == K
    eps = hoeffding_epsilon(K, 1e-3)
    assert all(abs(y - p) <= eps for y, p in zip(record["labels"][:3], exact)), (record["labels"], exact)
    assert record["labels"][2] == 0.0  # p = 0: no completion can succeed
    assert labels_from_counts(record["shepherd_correct"], K, "hard") == [1.0, 1.0, 0.0]
    assert record["labels"][3] == 1.0  # the last step: the verdict on the whole solution ("yes" ends it)


def test_alignax_label_writes_prm_data_from_a_recipe(tmp_path, capsys):
    """``alignax label``: a recipe's policy, sampler settings and verifier label the steps of
    generated chain_sum solutions; the output is format-steps data a PRM run reads."""
    from alignax import cli
    from alignax.data import DataConfig, prepare_dataset
    from alignax.trainers.api import load_config

    out = tmp_path / "labels.jsonl"
    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny-grpo.yaml")
    assert cli.main(["label", recipe, "reasoning_gym:chain_sum?size=2&seed=3", "--out", str(out),
                     "--num-samples", "2", "--estimator", "hard", "rollout.max_new_tokens=4"]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with open(out, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    assert figures["solutions"] == len(records) and figures["samples_per_prefix"] == 2
    assert figures["prefixes"] == sum(len(r["steps"]) - 1 for r in records) > 0
    for r in records:
        assert len(r["labels"]) == len(r["steps"]) and set(r["labels"]) <= {0.0, 1.0}  # hard labels
        assert r["shepherd_samples"] == 2 and len(r["shepherd_correct"]) == len(r["steps"]) - 1
    config = load_config(recipe)
    data = prepare_dataset(DataConfig(paths=(str(out),), format="steps", max_length=256, max_prompt_length=128,
                                      batch_size=1), load_tokenizer(config.model))
    assert data.stats["kept"] == len(records)
    assert cli.main(["label", recipe, "x.jsonl", "--out", str(out), "--estimator", "medium"]) == 2
    assert "--estimator 'medium': valid: hard, soft" in capsys.readouterr().err
