"""Checks a run makes before any model is read: config values out of range, malformed
overrides, local data files and model folders (alignax/trainers/validation.py,
alignax/config.py), and reward functions that fail (alignax/rewards/composite.py).

Fast: configs are only loaded and validated; nothing is trained, no model is built.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from alignax.config import ConfigError, apply_overrides
from alignax.rewards.composite import RewardConfig, RewardFunctionError, RewardScorer, _reward_values
from alignax.trainers.api import load_config

GRPO = {"algorithm": "grpo", "data": {"format": "prompt"}}
DPO = {"algorithm": "dpo"}
PREFERENCE = {"prompt": "2 + 2?", "chosen": "4", "rejected": "5"}
PROMPT = {"prompt": "2 + 2?", "answer": "4", "task": "chain_sum"}


def refused(data: dict, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(data=data, overrides=overrides)
    return str(info.value)


def with_data(base: dict, **data) -> dict:
    return {**base, "data": {**base.get("data", {}), **data}}


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# ---------------------------------------------------------------------------- 1. checkpoint.keep
def test_checkpoint_keep_zero_is_refused():
    message = refused(DPO, ["checkpoint.keep=0"])
    assert "checkpoint.keep=0" in message and "checkpoint.keep >= 1" in message
    assert "checkpoint.keep=-2" in refused(DPO, ["checkpoint.keep=-2"])
    assert load_config(data=DPO, overrides=["checkpoint.keep=1"]).checkpoint.keep == 1


# ---------------------------------------------------------------------------- 2. mesh.shape
@pytest.mark.parametrize("shape, expected", [
    ("[1, 0, 1]", "mesh.shape=[1, 0, 1]: the fsdp entry is 0"),
    ("[-3, 1, 1]", "mesh.shape=[-3, 1, 1]: the data entry is -3"),
    ("[1, 2, -5]", "mesh.shape=[1, 2, -5]: the tensor entry is -5"),
    ("[-1, -1, 1]", "mesh.shape=[-1, -1, 1]: 2 entries are -1 (data, fsdp); at most one"),
])
def test_bad_mesh_shapes_are_refused(shape, expected):
    assert expected in refused(DPO, [f"mesh.shape={shape}"])


def test_good_mesh_shapes_load():
    for shape in ("[1, -1, 1]", "[2, 2, 1]", "[-1, 1, 1]", "[1, 1, 1]"):
        load_config(data=DPO, overrides=[f"mesh.shape={shape}"])


# ---------------------------------------------------------------------------- 3. overrides
@pytest.mark.parametrize("item, expected", [
    ("=5", "override '=5': the key before '=' is empty"),
    (" =5", "override ' =5': the key before '=' is empty"),
    ("dpo..beta=0.2", "override 'dpo..beta=0.2': the key 'dpo..beta' has two dots in a row"),
    (".x=1", "override '.x=1': the key '.x' starts with a dot"),
    ("a.b.=1", "override 'a.b.=1': the key 'a.b.' ends with a dot"),
    ("dpo.be ta=1", "override 'dpo.be ta=1': the key part 'be ta' holds a space"),
    ("dpo. beta=1", "override 'dpo. beta=1': the key part ' beta' holds a space"),
    ("optim.learning$rate=1", "override 'optim.learning$rate=1': the key part 'learning$rate' holds '$'"),
    ("--dpo.beta=1", "override '--dpo.beta=1': the key part '--dpo' starts with '-'"),
    ("steps", "override 'steps' must look like dotted.key=value"),
    ("name.first=1", "override 'name.first=1': 'name' is a value, not a section"),
    ("data.paths=[unclosed", "override 'data.paths=[unclosed': the value is not valid YAML (expected ',' or ']'"),
])
def test_malformed_overrides_name_the_override_and_the_fault(item, expected):
    with pytest.raises(ConfigError) as info:
        apply_overrides({"name": "x"}, [item])
    assert str(info.value).startswith(expected), str(info.value)
    assert "\n" not in str(info.value)


def test_well_formed_overrides_still_apply():
    data = apply_overrides({}, [" dpo.beta =0.2", "model.random_init.hidden_size=32", "data.field_map.prompt=q",
                                "a-b=1", "x=a b"])
    assert data == {"dpo": {"beta": 0.2}, "model": {"random_init": {"hidden_size": 32}},
                    "data": {"field_map": {"prompt": "q"}}, "a-b": 1, "x": "a b"}
    with pytest.raises(ConfigError, match=r"^override 'dpo\.\.beta=0\.2'"):
        load_config(data=DPO, overrides=["dpo..beta=0.2"])


# ---------------------------------------------------------------------------- 4. data files
@pytest.mark.parametrize("content, why", [
    ("", "0 bytes"),
    ("\n  \n\t\n", "only blank lines"),
])
def test_an_empty_data_file_is_refused_naming_key_and_file(tmp_path, content, why):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    message = refused(with_data(GRPO, paths=[str(path)]))
    assert f"data.paths[0] {path}: the data file is empty ({why})" in message


def test_empty_json_array_and_parquet_files_are_refused(tmp_path):
    array = tmp_path / "prompts.json"
    array.write_text(" [ ]\n")
    assert f"data.paths[0] {array}: the data file is empty (an empty JSON array)" in refused(
        with_data(GRPO, paths=[str(array)]))
    table = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), table)
    good = write_jsonl(tmp_path / "good.jsonl", [PROMPT])
    assert f"data.paths[1] {table}: the data file is empty (a Parquet file of 0 rows)" in refused(
        with_data(GRPO, paths=[good, str(table)]))


def test_empty_ptx_and_evaluation_prompt_files_are_refused(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    ppo = {"algorithm": "ppo", "data": {"format": "prompt"}, "rollout": {"num_samples": 1},
           "ppo": {"ptx_coef": 0.1, "ptx_data": {"paths": [str(empty)], "format": "sft"}}}
    assert f"ppo.ptx_data.paths[0] {empty}: the data file is empty" in refused(ppo)
    grpo = {**GRPO, "evaluation": {"prompts": {"paths": ["reasoning_gym:chain_sum", str(empty)], "format": "prompt"}}}
    assert f"evaluation.prompts.paths[1] {empty}: the data file is empty" in refused(grpo)


def test_a_preference_file_given_to_grpo_names_both_formats(tmp_path):
    path = write_jsonl(tmp_path / "pairs.jsonl", [PREFERENCE] * 3)
    message = refused(with_data(GRPO, paths=[path]))
    assert (f"data.paths[0] {path}: its records look like format 'preference' (fields chosen, rejected) but "
            "algorithm grpo reads data.format=prompt") in message


def test_the_first_non_blank_record_decides_and_other_readers_are_named(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n\n" + json.dumps(PROMPT) + "\n")
    message = refused({**DPO, "data": {"paths": [str(prompts)]}})
    assert "its records look like format 'prompt' (fields answer) but preference.loss=dpo reads data.format=preference" \
        in message
    unpaired = write_jsonl(tmp_path / "kto.jsonl", [{"prompt": "p", "completion": "c", "label": True}])
    message = refused({**DPO, "data": {"paths": [unpaired]}})
    assert "format 'unpaired' (fields completion, label) but preference.loss=dpo reads data.format=preference" in message
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "raw"}])
    message = refused({"algorithm": "sft", "data": {"format": "sft", "paths": [text]}})
    assert "format 'text' (fields text) but algorithm sft reads data.format=sft; set data.format=text" in message
    ptx = write_jsonl(tmp_path / "ptx.jsonl", [PREFERENCE])
    ppo = {"algorithm": "ppo", "data": {"format": "prompt"}, "rollout": {"num_samples": 1},
           "ppo": {"ptx_coef": 0.1, "ptx_data": {"paths": [ptx], "format": "sft"}}}
    assert "ppo.ptx_data.paths[0]" in refused(ppo) and "PPO-ptx's SFT loss reads ppo.ptx_data.format=sft" \
        in refused(ppo)


def test_a_parquet_and_a_json_array_file_are_read_by_their_first_record(tmp_path):
    table = tmp_path / "pairs.parquet"
    pq.write_table(pa.table({k: [v] for k, v in PREFERENCE.items()}), table)
    assert "its records look like format 'preference'" in refused(with_data(GRPO, paths=[str(table)]))
    array = tmp_path / "pairs.json"
    array.write_text(json.dumps([PREFERENCE, PREFERENCE], indent=1))
    assert "its records look like format 'preference'" in refused(with_data(GRPO, paths=[str(array)]))


def test_a_record_with_no_field_of_its_format_is_refused_unless_bad_records_are_skipped(tmp_path):
    path = write_jsonl(tmp_path / "odd.jsonl", [{"q": "2 + 2?", "a": "4"}])
    message = refused(with_data(GRPO, paths=[path]))
    assert f"data.paths[0] {path}: its first record has fields q, a; algorithm grpo reads data.format=prompt" \
        in message and "prompt (prompt or question)" in message
    load_config(data=with_data(GRPO, paths=[path], on_bad_record="skip"))
    load_config(data=with_data(GRPO, paths=[path], field_map={"prompt": "q", "answer": "a"}))


def test_good_files_generators_folders_and_missing_paths_load(tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [PROMPT, {"question": "1 + 1?", "answer": "2"}])
    renamed = write_jsonl(tmp_path / "renamed.jsonl", [{"query": "1 + 1?"}])
    load_config(data=with_data(GRPO, paths=[prompts, "reasoning_gym:chain_sum?size=8", str(tmp_path)]))
    load_config(data=with_data(GRPO, paths=[renamed], field_map={"prompt": "query"}))
    # a missing file is named by the data pipeline when it opens it (train(records=...) may
    # replace data.paths, and recipes may name files a tool writes later)
    load_config(data=with_data(GRPO, paths=[str(tmp_path / "later.jsonl")]))
    pairs = write_jsonl(tmp_path / "pairs.jsonl", [PREFERENCE, {"chosen": "a", "rejected": "b"}])
    load_config(data={**DPO, "data": {"paths": [pairs]}})
    malformed = tmp_path / "bad.jsonl"
    malformed.write_text("{not json\n")  # the pipeline reports it with its line
    load_config(data=with_data(GRPO, paths=[str(malformed)]))


# ---------------------------------------------------------------------------- 5. model folders
def make_folder(path, *files: str):
    path.mkdir()
    for name in files:
        (path / name).write_text("{}")
    return str(path)


def test_a_model_folder_without_tokenizer_files_is_refused_listing_what_is_missing(tmp_path):
    folder = make_folder(tmp_path / "model", "config.json", "model.safetensors")
    message = refused({**DPO, "model": {"name": folder}})
    assert f"model.name={folder}: the model folder lacks tokenizer files (tokenizer.json" in message
    empty = make_folder(tmp_path / "empty")
    message = refused({**DPO, "model": {"name": empty}})
    assert (f"model.name={empty}: the model folder lacks config.json; weights (model.safetensors or "
            "model.safetensors.index.json); tokenizer files") in message


def test_complete_model_folders_load(tmp_path):
    for name, files in {"fast": ("tokenizer.json", "model.safetensors"),
                        "bpe": ("vocab.json", "merges.txt", "model.safetensors.index.json"),
                        "spm": ("tokenizer.model", "model.safetensors")}.items():
        folder = make_folder(tmp_path / name, "config.json", *files)
        load_config(data={**DPO, "model": {"name": folder}})
    # random_init reads config.json and the tokenizer, not the weights
    fresh = make_folder(tmp_path / "fresh", "config.json", "tokenizer.json")
    load_config(data={**DPO, "model": {"name": fresh, "random_init": {"num_hidden_layers": 1}}})
    assert "lacks tokenizer files" in refused(
        {**DPO, "model": {"name": make_folder(tmp_path / "bare", "config.json"), "random_init": {"hidden_size": 8}}})
    # registry names and paths that are not folders are left to the model loader
    load_config(data={**DPO, "model": {"name": "smollm2-135m-instruct"}})
    load_config(data={**DPO, "model": {"name": str(tmp_path / "not-yet-exported")}})


# ---------------------------------------------------------------------------- 6. rewards.task
def test_rewards_task_is_checked_at_load_and_read_by_the_verifier():
    config = load_config(data={**GRPO, "rewards": {"task": "chain_sum"}})
    assert config.rewards.task == "chain_sum"
    message = refused({**GRPO, "rewards": {"task": "chainsum"}})
    assert "rewards.task=chainsum: unknown reasoning-gym task 'chainsum' (did you mean 'chain_sum'" in message
    assert "rewards.task applies to" in refused({**DPO, "rewards": {"task": "chain_sum"}})
    assert "rewards.task applies to" in refused({**GRPO, "rewards": {"task": "chain_sum", "verifier_weight": 0,
                                                                      "functions": {"tests.support.rl_toy:yes_share": 1}}})


def _score(section: RewardConfig, completions, references):
    scorer = RewardScorer(section, max_new_tokens=4, stop_token_ids=[0])
    n = len(completions)
    return scorer.score(completions, references, np.zeros((n, 4), np.int32), np.ones((n, 4), np.int32))


def test_the_scorer_passes_rewards_task_to_records_that_name_none():
    refs = [{"answer": "7"}, {"answer": "7", "task": "chain_sum"}]
    total, parts = _score(RewardConfig(task="chain_sum"), ["<answer>7</answer>", "<answer>7</answer>"], refs)
    np.testing.assert_array_equal(parts["answer"], [1, 1])
    with pytest.raises(ValueError, match=r"reference 0 names no reasoning-gym task: .*or set rewards\.task"):
        _score(RewardConfig(), ["<answer>7</answer>"], refs[:1])


# ---------------------------------------------------------------------------- 7. reward functions
def picky_reward(completions, references):
    """1.0 per completion; raises on one containing "boom"."""
    del references
    out = []
    for text in completions:
        if "boom" in text:
            raise KeyError("no score for this")
        out.append(1.0)
    return out


def batch_only_reward(completions, references):
    if len(completions) > 2:
        raise MemoryError("too many at once")
    return [0.0] * len(completions)


def test_a_reward_function_that_raises_names_entry_completion_and_exception():
    spec = "tests.test_preflight:picky_reward"
    completions = ["fine", "also fine", "then boom, it broke " + "x" * 100, "boom again"]
    with pytest.raises(RewardFunctionError) as info:
        _score(RewardConfig(verifier_weight=0.0, functions={spec: 1.0}), completions, [{}] * 4)
    message = str(info.value)
    assert message.startswith(f"rewards.functions entry '{spec}' raised KeyError: 'no score for this' on "
                              "completion 2 (of 4); completion starts 'then boom, it broke x")
    assert isinstance(info.value, ConfigError) and isinstance(info.value.__cause__, KeyError)
    total, parts = _score(RewardConfig(verifier_weight=0.0, functions={spec: 1.0}), completions[:2], [{}] * 2)
    np.testing.assert_array_equal(total, [1, 1])


def text_reward(completions, references):
    del references
    return ["1.0" if "yes" in c else "0.0" for c in completions]


def test_a_reward_function_returning_other_than_numbers_names_its_entry():
    """Strings (even numeric ones), None, or another count: the entry is named, not a bare
    NumPy conversion error."""
    spec = "tests.test_preflight:text_reward"
    with pytest.raises(RewardFunctionError, match=rf"rewards.functions entry '{spec}' returned list of str "
                                                  r"\(first: '0.0'\); expected 2 numbers"):
        _score(RewardConfig(verifier_weight=0.0, functions={spec: 1.0}), ["no", "yes"], [{}] * 2)
    for returned, message in (([None, 1.0], "returned list of NoneType"), ([1.0], r"returned shape \(1,\)"),
                              ([[1.0], [2.0, 3.0]], "returned a ragged list")):
        with pytest.raises(RewardFunctionError, match=message):
            _reward_values("my.rewards:score", returned, 2)
    np.testing.assert_array_equal(_reward_values("my.rewards:score", [True, 0.5], 2), [1.0, 0.5])


def test_a_reward_function_failing_only_on_the_batch_says_so():
    spec = "tests.test_preflight:batch_only_reward"
    with pytest.raises(RewardFunctionError, match=r"raised MemoryError: too many at once on the batch of 3 "
                                                  r"completions, but on none of them alone"):
        _score(RewardConfig(verifier_weight=0.0, functions={spec: 1.0}), ["a", "b", "c"], [{}] * 3)


def test_a_reward_function_that_fails_to_import_is_a_config_error_naming_the_spec():
    with pytest.raises(ConfigError, match=r"callable spec 'no_such_pkg_xyz\.rewards:score': no module named "
                                          r"'no_such_pkg_xyz'"):
        RewardScorer(RewardConfig(functions={"no_such_pkg_xyz.rewards:score": 1.0}), max_new_tokens=4,
                     stop_token_ids=[0])
    with pytest.raises(ConfigError, match=r"callable spec 'tests\.test_preflight:picky_rewardz': "
                                          r".*did you mean 'tests\.test_preflight:picky_reward'"):
        RewardScorer(RewardConfig(functions={"tests.test_preflight:picky_rewardz": 1.0}), max_new_tokens=4,
                     stop_token_ids=[0])
