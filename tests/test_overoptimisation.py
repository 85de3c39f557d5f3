"""The over-optimisation study (tools/studies/overoptimisation.py, Gao et al. 2022): the analytic
best-of-N KL against the exact KL of the best-of-N distribution, the sample KL estimator
against log-probs worked in NumPy from the models' logits, and the tool end to end on the
toy model (a "yes"-share gold reward, a proxy reward model trained on gold-labelled pairs,
best-of-N and GRPO against the proxy)."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from alignax.best_of_n import best_of_n_kl
from alignax.data import write_jsonl
from tests.support.rl_toy import toy_prompts
from tests.support.tools import load_tool as load_tool_file



def load_tool():
    return load_tool_file("studies/overoptimisation.py", "overoptimisation_tool")


def exact_best_of_n_kl(n: int, outcomes: int) -> float:
    """KL(best-of-n || pi) for ``pi`` uniform over ``outcomes`` answers with distinct
    scores: the i-th lowest is picked with ``(i/M)^n - ((i-1)/M)^n``."""
    i = np.arange(1, outcomes + 1, dtype=np.float64)
    p = 1.0 / outcomes
    q = (i / outcomes) ** n - ((i - 1) / outcomes) ** n
    q = q[q > 0]  # (i/M)^n underflows for large n: those answers are never picked
    return float(np.sum(q * np.log(q / p)))


def test_best_of_n_kl_is_the_kl_of_the_best_of_n_distribution():
    assert best_of_n_kl(1) == 0.0
    assert best_of_n_kl(2) == pytest.approx(math.log(2) - 0.5)  # 0.1931..., by hand
    for n in (2, 4, 16, 64):
        # the discrete KL tends to the formula as the answers get many (continuous scores)
        assert best_of_n_kl(n) == pytest.approx(exact_best_of_n_kl(n, 200_000), abs=2e-4)
        assert exact_best_of_n_kl(n, 50) < best_of_n_kl(n)  # fewer answers: below the bound
    with pytest.raises(ValueError, match="n >= 1"):
        best_of_n_kl(0)


def test_sample_kl_by_hand():
    tool = load_tool()
    logps = np.array([[-1.0, -2.0, -5.0], [-0.5, -0.25, 0.0]], np.float32)
    ref = np.array([[-1.5, -1.0, -9.0], [-1.0, -1.0, 0.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
    # row 0: (0.5) + (-1.0) = -0.5 (the third token is padding); row 1: 0.5 + 0.75 + 0 = 1.25
    assert tool.sample_kl(logps, ref, mask) == pytest.approx((-0.5 + 1.25) / 2)


ARGS = ["--gold-function", "tests.support.rl_toy:yes_share", "--max-prompt-length", "24", "--max-new-tokens", "6",
        "--batch-size", "8", "--eval-prompts", "8", "--pair-prompts", "24", "--label-samples", "4",
        "--rm-steps", "6", "--rm-lr", "1e-2", "--n-max", "8", "--rl-steps", "4", "--rl-every", "2",
        "--rl-group", "4", "--rl-lr", "2e-2", "--rl-samples", "4"]


@pytest.fixture(scope="module")
def study(tmp_path_factory, toy_model):
    path = tmp_path_factory.mktemp("overopt")
    write_jsonl(toy_prompts(40), path / "prompts.jsonl")
    tool = load_tool()
    args = tool.parse_args(["--out", str(path / "out"), "--model", toy_model, "--prompts",
                            str(path / "prompts.jsonl"), *ARGS])
    report = tool.run(args)
    return tool, args, report


def test_the_study_writes_gold_and_proxy_against_kl(study):
    tool, args, report = study
    with open(os.path.join(args.out, "overoptimisation.json")) as f:
        assert json.load(f) == json.loads(json.dumps(report))
    assert report["pairs"]["count"] >= 2 and report["pairs"]["prompts"] == 24
    # best-of-N: N doubles up to n_max, KL is the analytic best-of-N KL
    bon = report["best_of_n"]
    assert [p["n"] for p in bon] == [1, 2, 4, 8]
    for p in bon:
        assert p["kl"] == pytest.approx(math.log(p["n"]) - (p["n"] - 1) / p["n"])
        assert p["sqrt_kl"] == pytest.approx(math.sqrt(p["kl"]))
        assert np.isfinite(p["proxy"]) and 0.0 <= p["gold"] <= 1.0
    # selecting by the proxy: the expected proxy of the pick grows with N (the expected
    # maximum of a larger subset), strictly while the proxy tells samples apart
    proxies = [p["proxy"] for p in bon]
    assert all(b > a for a, b in zip(proxies, proxies[1:])), proxies
    # RL: the start and each checkpoint; the start is the reference (KL 0 exactly),
    # training on the proxy moves away from it and raises the proxy
    rl = report["rl"]
    assert [p["step"] for p in rl] == [0, 2, 4]
    assert rl[0]["kl"] == 0.0
    assert rl[-1]["kl"] > 0.05 and rl[-1]["proxy"] > rl[0]["proxy"]
    assert all(0.0 <= p["gold"] <= 1.0 for p in rl)


def test_the_sample_kl_reads_the_sampled_tokens_log_probs(study, toy_model):
    """The tool's KL of a trained policy against the reference equals the mean over samples
    of sum_t log pi - log pi_ref, the log-probs taken in NumPy from each model's logits."""
    import jax
    from flax import nnx

    from alignax.models import from_pretrained

    tool, args, _ = study
    config = tool.policy_config(args, os.path.join(args.out, "check"), tool.gold_rewards(args),
                                os.path.join(args.out, "prompts.jsonl"))
    base = from_pretrained(toy_model)
    measure = tool.Measure(config, tool.load_tokenizer(config), base, os.path.join(args.out, "proxy"))
    trained = from_pretrained(toy_model)
    graphdef, state = nnx.split(trained)
    state = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), state)
    trained = nnx.merge(graphdef, state)
    groups, _, _ = measure.sample(state, args.rl_samples, seed=3)  # the shapes the study compiled
    kl = measure.kl(state, groups)

    tokens, positions, attention = groups.full_sequences()
    prompt = groups.prompt_tokens.shape[1]

    def sequence_logps(model):
        logits = np.asarray(model(tokens, positions, attention).logits, np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        total = np.zeros(len(tokens))
        for r in range(len(tokens)):
            for t in np.flatnonzero(groups.response_mask[r]):
                total[r] += logp[r, prompt + t - 1, tokens[r, prompt + t]]
        return total

    expected = np.mean(sequence_logps(trained) - sequence_logps(base))
    assert abs(expected) > 0.01  # the perturbation moved the policy
    assert kl == pytest.approx(expected, rel=1e-4, abs=1e-5)
