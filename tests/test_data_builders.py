"""Real data from the installed packages: reasoning-gym pairs and prompts, champ-dataset pairs."""

from __future__ import annotations

import importlib.util
import itertools
import os
import re

import numpy as np
import pytest
import reasoning_gym

from alignax.data import DataConfig, build_dataset, champ_pairs, reasoning_gym_pairs, reasoning_gym_prompts
from alignax.data.builders import generate as generate_records
from alignax.data.builders import parse_generator_spec
from reasoning_gym.utils import extract_answer
from alignax.rewards.verifiers import verifier_rewards

_spec = importlib.util.spec_from_file_location(
    "tiny_tokenizer", os.path.join(os.path.dirname(__file__), "data", "tiny_tokenizer.py")
)
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)


def _tag(text):
    match = re.fullmatch(r"<answer>(.*)</answer>", text, re.DOTALL)
    assert match, text
    return match.group(1)


@pytest.mark.parametrize("task,options", [("chain_sum", {}), ("basic_arithmetic", {"max_terms": 3}), ("countdown", {})])
def test_reasoning_gym_pairs_scored_by_the_task(task, options):
    size = 8 if task == "countdown" else 60
    records = reasoning_gym_pairs(task, size=size, seed=4, **options)
    task_data = reasoning_gym.create_dataset(task, size=size, seed=4, **options)  # the scorer, independently
    entries = {task_data[i]["question"]: task_data[i] for i in range(size)}
    assert len(records) >= size * 0.8
    for record in records:
        entry = entries[record["prompt"]]
        assert task_data.score_answer(_tag(record["chosen"]), entry) == 1.0
        assert task_data.score_answer(_tag(record["rejected"]), entry) < 1.0
        assert record["rejected_score"] == task_data.score_answer(_tag(record["rejected"]), entry)
        assert record["answer"] == entry["answer"] and record["task"] == task
    assert len({r["prompt"] for r in records}) == len(records)
    assert reasoning_gym_pairs(task, size=size, seed=4, **options) == records  # deterministic
    assert reasoning_gym_pairs(task, size=size, seed=5, **options) != records


def test_reasoning_gym_prompts_keep_answers_and_metadata():
    records = reasoning_gym_prompts("chain_sum", size=20, seed=1)
    task_data = reasoning_gym.create_dataset("chain_sum", size=20, seed=1)
    first = task_data[0]
    assert records[0] == {"prompt": first["question"], "answer": first["answer"], "task": "chain_sum", "metadata": first["metadata"]}
    with pytest.raises(ValueError, match="unknown reasoning-gym task 'chain_sums'; valid: .*chain_sum"):
        reasoning_gym_prompts("chain_sums", size=2)


def test_champ_pairs_follow_the_human_labels():
    import champ_dataset

    records = champ_pairs()
    data = champ_dataset.load("v0")
    expected = 0
    for problem in data.problems.values():
        labels = [a.start_idx is None for a in (problem.fws_annotations or {}).values()]
        expected += sum(labels) * (len(labels) - sum(labels))
    assert len(records) == expected > 0
    for record in records:
        problem = data.problems[record["problem_id"]]
        chosen = problem.fws_annotations[record["chosen_source"]]
        rejected = problem.fws_annotations[record["rejected_source"]]
        assert chosen.start_idx is None and chosen.text == record["chosen"]
        assert rejected.start_idx is not None and rejected.text == record["rejected"]
        assert record["prompt"].endswith(problem.text) and record["answer"] == problem.answer
    capped = champ_pairs(max_pairs_per_problem=1)
    assert len(capped) == len({r["problem_id"] for r in records})


def test_generator_spec_builds_batches():
    bpe = tiny.bpe_tokenizer()
    config = DataConfig(paths="reasoning_gym:chain_sum?size=40&seed=2&max_terms=3", format="preference",
                        batch_size=8, max_length=96, max_prompt_length=80, eval_fraction=0.25)
    it = build_dataset(config, bpe, process_index=0, process_count=1)
    assert it.stats["records"] == it.stats["kept"] == len(reasoning_gym_pairs("chain_sum", size=40, seed=2, max_terms=3))
    batch = next(it)
    assert batch["chosen_tokens"].shape == (8, 96)
    chosen = [bpe.decode(t[m == 1]) for t, m in zip(batch["chosen_tokens"], batch["chosen_response_mask"])]
    assert all(re.fullmatch(r"<answer>-?\d+</answer><\|im_end\|>", c) for c in chosen), chosen


def test_prompt_generator_references_score_with_the_verifier():
    bpe = tiny.bpe_tokenizer()
    config = DataConfig(paths="reasoning_gym:chain_sum?size=16&seed=9", format="prompt", batch_size=4, max_prompt_length=128)
    batch = next(build_dataset(config, bpe, process_index=0, process_count=1))
    refs = batch["references"]
    rewards, parts = verifier_rewards([f"<answer>{r['answer']}</answer>" for r in refs], refs)
    np.testing.assert_array_equal(rewards, np.ones(4, np.float32))
    assert batch["prompt_attention_mask"].sum(axis=1).min() > 0


def test_generator_spec_parsing_and_errors():
    assert parse_generator_spec("reasoning_gym:chain_sum?size=10&seed=3&allow_negation=true&name=x") == (
        "reasoning_gym", "chain_sum", {"size": 10, "seed": 3, "allow_negation": True, "name": "x"}
    )
    assert parse_generator_spec("champ") == ("champ", None, {})
    tok = tiny.word_tokenizer()
    with pytest.raises(ValueError, match="gives formats preference, unpaired; data.format is 'sft'"):
        build_dataset(DataConfig(paths="champ", format="sft"), tok)
    with pytest.raises(ValueError, match="names no task"):
        build_dataset(DataConfig(paths="reasoning_gym", format="prompt"), tok)


def test_pairs_are_distinct_answers():
    records = reasoning_gym_pairs("chain_sum", size=30, seed=0)
    assert all(r["chosen"] != r["rejected"] for r in records)
    # wrong answers are near misses of the right one for numeric tasks
    gaps = [abs(int(_tag(r["rejected"])) - int(r["answer"])) for r in records]
    assert all(g in (1, 2, 3, 5, 9, 10, 11, 100) for g in gaps), gaps
    assert len(set(itertools.islice(gaps, 30))) > 1


def test_reasoning_gym_sft_and_unpaired_specs_carry_verified_answers():
    sft = generate_records("reasoning_gym:chain_sum?size=12&seed=1", "sft")
    dataset = reasoning_gym.create_dataset("chain_sum", size=12, seed=1)
    assert 0 < len(sft) <= 12
    for record in sft:
        user, assistant = record["messages"]
        assert user["role"] == "user" and assistant["role"] == "assistant"
        entry = next(dataset[i] for i in range(len(dataset)) if dataset[i]["question"] == user["content"])
        assert dataset.score_answer(extract_answer(assistant["content"]), entry) == 1.0
    pairs = reasoning_gym_pairs("chain_sum", size=12, seed=1)
    unpaired = generate_records("reasoning_gym:chain_sum?size=12&seed=1", "unpaired")
    assert len(unpaired) == 2 * len(pairs)
    for pair, good, bad in zip(pairs, unpaired[0::2], unpaired[1::2]):
        assert (good["completion"], good["label"]) == (pair["chosen"], True)
        assert (bad["completion"], bad["label"]) == (pair["rejected"], False)
        assert good["prompt"] == bad["prompt"] == pair["prompt"]


def test_reasoning_gym_text_spec_is_the_verified_conversation_as_plain_text():
    sft = generate_records("reasoning_gym:chain_sum?size=6&seed=1", "sft")
    text = generate_records("reasoning_gym:chain_sum?size=6&seed=1", "text")
    assert len(text) == len(sft) > 0
    for plain, conversation in zip(text, sft):
        user, assistant = conversation["messages"]
        assert plain["text"] == f"{user['content']}\n{assistant['content']}" and plain["answer"] == conversation["answer"]
    bpe = tiny.bpe_tokenizer()
    batch = next(build_dataset(DataConfig(paths="reasoning_gym:chain_sum?size=6&seed=1", format="text", batch_size=2,
                                          max_length=256, max_prompt_length=8), bpe, process_index=0, process_count=1))
    assert batch["tokens"].shape == (2, 256)
    np.testing.assert_array_equal(batch["response_mask"][:, 0], [0, 0])
    np.testing.assert_array_equal(batch["response_mask"][:, 1:].sum(1), batch["attention_mask"].sum(1) - 1)
    with pytest.raises(ValueError, match="gives formats preference, unpaired; data.format is 'text'"):
        build_dataset(DataConfig(paths="champ", format="text"), tiny.word_tokenizer())
