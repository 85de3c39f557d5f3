"""Math-Shepherd step labels (alignax.math_shepherd) on a toy policy whose success
probability after each prefix is known exactly: the toy model with every weight zero
samples each of its 32 token ids with probability 1/32, and a completion (one token) is
correct after prefix i when it is one of SUCCESS[i]'s words, so p_i = |SUCCESS[i]| / 32.

Bound: with K = 512 completions per prefix, Hoeffding gives P(|c_i / K - p_i| >= eps) <=
2 exp(-2 K eps^2) = 1e-3 for eps = sqrt(ln(2000) / 1024) = 0.086; the hard label of a
prefix with p_i >= 1/32 is wrong with probability (31/32)^512 < 1e-7, and exact at p_i = 0.
"""

import math

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
