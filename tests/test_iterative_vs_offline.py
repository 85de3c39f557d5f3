"""tools/studies/iterative_vs_offline.py on the toy model: one round of iterative DPO (pairs sampled
from the starting policy, labelled by the "yes"-share reward) against offline DPO on as many
fixed pairs for the same prompts; both arms train, and are judged on the held-out prompts."""

from __future__ import annotations

import json

import pytest

from alignax.data import write_jsonl
from tests.support.rl_toy import toy_prompts
from tools.studies import iterative_vs_offline as tool  # tools/ is a namespace package beside tests/


def test_both_arms_train_on_the_same_number_of_pairs_for_the_same_prompts(tmp_path, toy_model):
    prompts = toy_prompts(24)
    write_jsonl(prompts, tmp_path / "prompts.jsonl")
    # the fixed set: a pair for every training prompt, all "yes" against all "no"
    write_jsonl([{"prompt": r["prompt"], "chosen": "yes yes yes", "rejected": "no no no"} for r in prompts[:16]],
                tmp_path / "offline.jsonl")
    args = tool.parse_args(["--out", str(tmp_path / "out"), "--model", toy_model,
                            "--prompts", str(tmp_path / "prompts.jsonl"),
                            "--offline-pairs", str(tmp_path / "offline.jsonl"),
                            "--reward-function", "tests.support.rl_toy:yes_share", "--success-threshold", "0.5",
                            "--train-prompts", "16", "--eval-prompts", "8", "--samples", "4",
                            "--max-prompt-length", "24", "--max-new-tokens", "6", "--batch-size", "4",
                            "--steps", "4", "--lr", "1e-2", "--beta", "0.5"])
    report = tool.run(args)
    with open(tmp_path / "out" / "iterative_vs_offline.json") as f:
        assert json.load(f) == json.loads(json.dumps(report))

    iterative, offline = report["iterative"], report["offline"]
    assert 0 < iterative["pairs"] <= 16 and iterative["sampled_prompts"] == 16
    assert offline["pairs"] == iterative["pairs"]
    with open(tmp_path / "out" / "iterative" / "round_0" / "pairs.jsonl") as f:
        sampled = [json.loads(line) for line in f]
    with open(tmp_path / "out" / "offline" / "pairs.jsonl") as f:
        fixed = [json.loads(line) for line in f]
    assert len(fixed) == len(sampled) == offline["pairs"]
    # the same prompts, in the iterative round's order; the offline pairs are the fixed set's
    assert [p["prompt"] for p in fixed] == [p["prompt"] for p in sampled]
    assert offline["pairs_on_iterative_prompts"] == len(sampled)
    assert all(p["chosen"] == "yes yes yes" and p["rejected"] == "no no no" for p in fixed)
    assert all(p["chosen_reward"] > p["rejected_reward"] for p in sampled)  # labelled by the reward

    # both arms start from the same judged policy on the 8 held-out prompts, and each trained:
    # DPO toward "yes" raises the held-out reward (a run that ignored its pairs would not)
    assert report["held_out_prompts"] == 8
    for arm in (iterative, offline):
        assert arm["reward_before"] == report["start"]["reward"]
        assert arm["reward_after"] > arm["reward_before"]
    assert set(report["seconds"]) == {"eval_start", "iterative_sample", "iterative_dpo", "eval_iterative",
                                      "offline_dpo", "eval_offline", "total"}
    assert len(report["loadavg"]["start"]) == 3


def test_too_few_offline_pairs_is_an_error_naming_the_set(tmp_path):
    write_jsonl([{"prompt": "hi there", "chosen": "yes", "rejected": "no"}], tmp_path / "offline.jsonl")
    args = tool.parse_args(["--offline-pairs", str(tmp_path / "offline.jsonl")])
    sampled = [{"prompt": "hi there"}, {"prompt": "bye now"}]
    with pytest.raises(ValueError, match=r"offline.jsonl has pairs for 1 of the 2 training prompts; the iterative "
                                         r"round has 2 pairs"):
        tool.offline_pairs(args, ["hi there", "bye now"], sampled)
