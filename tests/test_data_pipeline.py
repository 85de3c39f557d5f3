"""Sources and the grain pipeline: files and folders, shuffling, resume, process sharding, eval."""

from __future__ import annotations

import importlib.util
import json
import os

import grain
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from alignax.data import BadRecordError, DataConfig, build_dataset, open_source, prepare_dataset, write_jsonl

_spec = importlib.util.spec_from_file_location(
    "tiny_tokenizer", os.path.join(os.path.dirname(__file__), "data", "tiny_tokenizer.py")
)
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

FIXTURE_DICT = os.path.join(os.path.dirname(__file__), "data", "hf_saved_dict")


@pytest.fixture(scope="module")
def tok():
    return tiny.word_tokenizer()


# --------------------------------------------------------------------- sources


def test_jsonl_source_skips_blank_lines_and_knows_line_numbers(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"x": 1}\n\n  \n{"x": "é"}\n{"x": 3}')  # no final newline
    src = open_source(path)
    assert len(src) == 3 and [src[i]["x"] for i in range(3)] == [1, "é", 3]
    assert [src.where(i) for i in range(3)] == [f"{path}, line 1", f"{path}, line 4", f"{path}, line 5"]
    assert isinstance(src, grain.sources.RandomAccessDataSource)
    assert list(grain.MapDataset.source(src)) == [src[i] for i in range(3)]


def test_json_array_and_parquet_sources(tmp_path):
    records = [{"prompt": "hi", "chosen": [{"role": "assistant", "content": "yes"}], "n": i} for i in range(3)]
    (tmp_path / "a.json").write_text(json.dumps(records))
    src = open_source(tmp_path / "a.json")
    assert [src[i] for i in range(3)] == records and src.where(2) == f"{tmp_path / 'a.json'}, item 2"
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "a.parquet")
    src = open_source(tmp_path / "a.parquet")
    assert [src[i] for i in range(3)] == records and src.where(1) == f"{tmp_path / 'a.parquet'}, row 1"
    assert isinstance(src, grain.sources.RandomAccessDataSource)


def test_datasets_save_to_disk_folder_written_by_datasets(tok):
    """tests/data/hf_saved_dict was written by datasets 5.2.0 DatasetDict.save_to_disk."""
    train = open_source(FIXTURE_DICT, split="train")
    assert [train[i]["id"] for i in range(len(train))] == [0, 1, 2]
    assert train[0]["chosen"] == [{"role": "assistant", "content": "yes"}]
    assert train.where(2) == f"{FIXTURE_DICT}/train, row 2"
    test = open_source(FIXTURE_DICT, split="test")
    assert len(test) == 1 and test[0]["prompt"] == "now"
    with pytest.raises(ValueError, match="has splits train, test; no split 'validation'"):
        open_source(FIXTURE_DICT, split="validation")
    cfg = DataConfig(paths=FIXTURE_DICT, batch_size=3, max_length=24, max_prompt_length=16, shuffle=False)
    batch = next(build_dataset(cfg, tok, process_index=0, process_count=1))
    S, E, NL = "<|im_start|>", "<|im_end|>", "\n"
    words = [S, "user", NL, "hi", "there", E, NL, S, "assistant", NL, "yes", E]
    np.testing.assert_array_equal(batch["chosen_tokens"][0, : len(words)], tiny.ids(*words))
    assert batch["chosen_response_mask"][0].sum() == 2


def _write_stream(path, rows):
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def test_save_to_disk_layout_with_shards(tmp_path):
    folder = tmp_path / "saved"
    folder.mkdir()
    files = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    _write_stream(folder / files[0], [{"k": 0}, {"k": 1}])
    _write_stream(folder / files[1], [{"k": 2}])
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": f} for f in files], "_split": None}))
    (folder / "dataset_info.json").write_text("{}")
    src = open_source(folder)
    assert [src[i]["k"] for i in range(len(src))] == [0, 1, 2]


def test_repo_style_folder_splits(tmp_path):
    data = tmp_path / "repo" / "data"
    data.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"k": 0}, {"k": 1}]), data / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist([{"k": 2}]), data / "train-00001-of-00002.parquet")
    write_jsonl([{"k": 9}], data / "test-00000-of-00001.jsonl")
    (tmp_path / "repo" / "README.md").write_text("card")
    train = open_source(tmp_path / "repo")
    assert [train[i]["k"] for i in range(len(train))] == [0, 1, 2]
    assert train.where(2) == f"{data / 'train-00001-of-00002.parquet'}, row 0"
    test = open_source(tmp_path / "repo", split="test")
    assert len(test) == 1 and test[0]["k"] == 9
    plain = tmp_path / "plain"
    plain.mkdir()
    write_jsonl([{"k": 5}], plain / "part1.jsonl")
    write_jsonl([{"k": 6}], plain / "part2.jsonl")
    src = open_source(plain)  # no split names: everything is train
    assert [src[i]["k"] for i in range(len(src))] == [5, 6]
    with pytest.raises(ValueError, match="no .jsonl, .json, .parquet data files for split 'test'"):
        open_source(plain, split="test")


# -------------------------------------------------------------------- pipeline

N = 20


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    write_jsonl([{"prompt": " ".join(["hi"] * (1 + i % 3)), "answer": str(i), "id": i} for i in range(N)], path)
    return str(path)


def _config(path, **kw):
    kw.setdefault("format", "prompt")
    kw.setdefault("batch_size", 4)
    kw.setdefault("max_prompt_length", 16)
    return DataConfig(paths=path, **kw)


def _ids(batch):
    return [r["id"] for r, m in zip(batch["references"], batch["example_mask"]) if m]


def _take(iterator, steps):
    return [_ids(next(iterator)) for _ in range(steps)]


def test_prompt_batches_are_fixed_shape(tok, prompt_file):
    batch = next(build_dataset(_config(prompt_file), tok, process_index=0, process_count=1))
    assert {k: v.shape for k, v in batch.items() if k != "references"} == {
        "prompt_tokens": (4, 16), "prompt_positions": (4, 16), "prompt_attention_mask": (4, 16), "example_mask": (4,),
        "record_index": (4,),
    }
    assert len(batch["references"]) == 4


def test_ordered_iterator_reads_each_record_of_a_split_once_in_file_order(tok, prompt_file):
    prepared = prepare_dataset(_config(prompt_file, eval_fraction=0.25), tok)
    seen = []
    for batch in prepared.iterator("train", ordered=True, process_index=0, process_count=1):
        seen.extend(batch["record_index"][batch["example_mask"] > 0].tolist())
        for row, index in enumerate(batch["record_index"]):
            np.testing.assert_array_equal(batch["prompt_tokens"][row], prepared.example(index)["prompt_tokens"])
    assert seen == prepared.train_indices.tolist()


def test_each_epoch_is_a_new_permutation_and_seeded(tok, prompt_file):
    prepared = prepare_dataset(_config(prompt_file, seed=3), tok)
    it = prepared.iterator(process_index=0, process_count=1)
    assert it.steps_per_epoch == 5
    epochs = [sum(_take(it, 5), []) for _ in range(3)]
    assert it.epoch == 3
    for order in epochs:
        assert sorted(order) == list(range(N))
    assert epochs[0] != epochs[1] != epochs[2] and epochs[0] != list(range(N))
    again = sum(_take(prepare_dataset(_config(prompt_file, seed=3), tok).iterator(process_index=0, process_count=1), 10), [])
    assert again == epochs[0] + epochs[1]
    other = sum(_take(prepare_dataset(_config(prompt_file, seed=4), tok).iterator(process_index=0, process_count=1), 5), [])
    assert other != epochs[0]
    plain = prepare_dataset(_config(prompt_file, shuffle=False), tok).iterator(process_index=0, process_count=1)
    assert sum(_take(plain, 5), []) == list(range(N))


def test_restore_from_state_continues_identically(tok, prompt_file):
    config = _config(prompt_file, seed=7, read_threads=2, prefetch_batches=3)
    it = build_dataset(config, tok, process_index=0, process_count=1)
    _take(it, 7)  # into the second epoch
    state = json.loads(json.dumps(it.get_state()))
    continued = [next(it) for _ in range(6)]
    resumed_it = build_dataset(config, tok, process_index=0, process_count=1)
    resumed_it.set_state(state)
    assert resumed_it.step == 7
    resumed = [next(resumed_it) for _ in range(6)]
    for a, b in zip(continued, resumed):
        assert _ids(a) == _ids(b)
        np.testing.assert_array_equal(a["prompt_tokens"], b["prompt_tokens"])
    np.testing.assert_array_equal(resumed_it.batch(7)["prompt_tokens"], continued[0]["prompt_tokens"])


def test_state_of_another_dataset_is_rejected(tok, prompt_file):
    state = build_dataset(_config(prompt_file, seed=1), tok, process_index=0, process_count=1).get_state()
    it = build_dataset(_config(prompt_file, seed=2), tok, process_index=0, process_count=1)
    with pytest.raises(ValueError, match="into another dataset than this config reads \\(seed: saved 1, now 2\\)"):
        it.set_state(state)


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_shards_partition_each_global_batch(tok, prompt_file, process_count):
    prepared = prepare_dataset(_config(prompt_file, seed=5), tok)
    whole = _take(prepared.iterator(process_index=0, process_count=1), 8)
    shards = [_take(prepared.iterator(process_index=p, process_count=process_count), 8) for p in range(process_count)]
    for step in range(8):
        parts = [shard[step] for shard in shards]
        assert all(len(part) == 4 // process_count for part in parts)
        assert sum(parts, []) == whole[step]  # the global batch, in order, split in process blocks


def test_a_saved_position_resumes_on_any_process_count(tok, prompt_file):
    """A state saved by process 0 of 2 serves process 1 too, and one process, and four:
    after it, the processes' batches together are the uninterrupted run's global batches."""
    prepared = prepare_dataset(_config(prompt_file, seed=5), tok)
    whole = prepared.iterator(process_index=0, process_count=1)
    expected = _take(whole, 9)[5:]
    saver = prepared.iterator(process_index=0, process_count=2)
    _take(saver, 5)
    state = json.loads(json.dumps(saver.get_state()))
    for count in (1, 2, 4):
        shards = []
        for p in range(count):
            it = prepared.iterator(process_index=p, process_count=count)
            it.set_state(state)
            shards.append(_take(it, 4))
        for step in range(4):
            assert sum((shard[step] for shard in shards), []) == expected[step], (count, step)


def test_eval_split_is_held_out_and_padded(tok, prompt_file):
    prepared = prepare_dataset(_config(prompt_file, eval_fraction=0.25, seed=11), tok)
    # The split is by prompt: prompt_file has 3 prompts ("hi" x 1, 2, 3) of 7, 7 and 6
    # records, so eval is the first drawn group ("hi hi", records 1, 4, ..., 19), 7
    # records where round(0.25 * 20) = 5 asks for 5 (the per-record split gave 15/5).
    assert prepared.stats["train"] == 13 and prepared.stats["eval"] == 7
    assert prepared.eval_indices.tolist() == list(range(1, N, 3))
    train_ids = set(sum(_take(prepared.iterator("train", process_index=0, process_count=1), 3), []))
    eval_rows = []
    for p in range(2):
        batches = list(prepared.iterator("eval", process_index=p, process_count=2))
        assert len(batches) == 2  # 7 examples -> 2 global batches of 4, the last padded
        for b in batches:
            assert b["prompt_tokens"].shape == (2, 16)
        eval_rows += [i for b in batches for i in _ids(b)]
        masks = [m for b in batches for m in b["example_mask"]]
        assert sum(masks) in (3, 4)
    assert sorted(eval_rows) == sorted(int(i) for i in prepared.eval_indices)
    assert len(eval_rows) == 7 and not train_ids & set(eval_rows)
    assert sorted(set(int(i) for i in prepared.train_indices) | set(eval_rows)) == list(range(N))


def test_num_epochs_ends_the_stream(tok, prompt_file):
    it = build_dataset(_config(prompt_file, num_epochs=2), tok, process_index=0, process_count=1)
    assert len(list(it)) == 10


def test_batching_errors_name_the_problem(tok, prompt_file):
    with pytest.raises(ValueError, match="batch_size 4 is not divisible by the 3 JAX processes"):
        build_dataset(_config(prompt_file), tok, process_index=0, process_count=3)
    with pytest.raises(ValueError, match="the training split has 20 examples .*; data.batch_size is 32"):
        build_dataset(_config(prompt_file, batch_size=32), tok, process_index=0, process_count=1)
    with pytest.raises(FileNotFoundError, match="data path 'nowhere.jsonl' does not exist"):
        build_dataset(_config("nowhere.jsonl"), tok)


def test_default_process_from_jax(tok, prompt_file):
    it = build_dataset(_config(prompt_file), tok)
    assert (it.process_index, it.process_count, it.local_batch_size) == (0, 1, 4)


def test_state_round_trips_through_orbax(tok, prompt_file, tmp_path):
    import orbax.checkpoint as ocp

    config = _config(prompt_file, seed=2)
    it = build_dataset(config, tok, process_index=0, process_count=1)
    _take(it, 6)
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(6, args=ocp.args.Composite(data=ocp.args.JsonSave(it.get_state())))
        manager.wait_until_finished()
        restored = manager.restore(6, args=ocp.args.Composite(data=ocp.args.JsonRestore()))
    resumed = build_dataset(config, tok, process_index=0, process_count=1)
    resumed.set_state(restored["data"])
    assert _take(resumed, 3) == _take(it, 3)


# ------------------------------------------------------- duplicates, prompt-grouped split


def _pair(prompt, chosen, rejected, **extra):
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected, **extra}


# 10 records; lines 6 and 10 repeat line 2, line 8 repeats line 3 (an "id" the encoder
# does not read differs: the tokenised content is what counts). Lines 2 and 4 share a
# prompt with other responses, and line 9 differs from line 2 by its margin only: not
# duplicates.
DUPLICATE_RECORDS = [
    _pair("hi", "yes", "no"),
    _pair("what is two", "four", "two", id=1),
    _pair("what is two plus two", "four", "no"),
    _pair("what is two", "four now", "no"),
    _pair("bye", "bye now", "no"),
    _pair("what is two", "four", "two", id=2),
    _pair("is two four", "yes", "no"),
    _pair("what is two plus two", "four", "no"),
    _pair("what is two", "four", "two", margin=1.0),
    _pair("what is two", "four", "two"),
]


@pytest.fixture(scope="module")
def duplicate_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("dups") / "pairs.jsonl"
    write_jsonl(DUPLICATE_RECORDS, path)
    return str(path)


def _pairs_config(path, **kw):
    return DataConfig(paths=path, format="preference", apply_chat_template=False, max_length=16,
                      max_prompt_length=8, batch_size=2, **kw)


def test_duplicates_are_counted_and_kept_by_default(tok, duplicate_file):
    prepared = prepare_dataset(_pairs_config(duplicate_file), tok)
    assert prepared.stats["duplicates"] == 3
    assert prepared.stats["kept"] == 10 and prepared.stats["skipped"] == 0
    assert "skipped/duplicate" not in prepared.stats
    assert prepared.train_indices.tolist() == list(range(10))


def test_duplicates_can_be_skipped(tok, duplicate_file):
    prepared = prepare_dataset(_pairs_config(duplicate_file, on_duplicate="skip"), tok)
    stats = prepared.stats
    assert stats["duplicates"] == 3 and stats["skipped/duplicate"] == 3 and stats["skipped"] == 3
    assert stats["kept"] == 7 and stats["records"] == 10
    assert prepared.train_indices.tolist() == [0, 1, 2, 3, 4, 6, 8]  # the first of each kept
    assert json.loads(json.dumps(stats)) == stats


def test_a_duplicate_is_an_error_naming_both_records(tok, duplicate_file):
    with pytest.raises(BadRecordError) as err:
        prepare_dataset(_pairs_config(duplicate_file, on_duplicate="error"), tok)
    message = str(err.value)
    assert message.startswith(f"{duplicate_file}, line 6: duplicate of {duplicate_file}, line 2:"), message
    assert "data.on_duplicate='error'" in message and err.value.reason == "duplicate"


def test_no_duplicates_counts_zero_and_the_policy_is_validated(tok, prompt_file):
    prepared = prepare_dataset(_config(prompt_file, on_duplicate="error"), tok)  # answers differ: none
    assert prepared.stats["duplicates"] == 0 and prepared.stats["kept"] == N
    with pytest.raises(ValueError, match=r"unknown data.on_duplicate 'drop'; valid: keep, skip, error"):
        DataConfig(paths="x.jsonl", on_duplicate="drop")


def test_a_prompt_sets_duplicates_are_prompt_and_answer(tok, tmp_path):
    path = tmp_path / "prompts.jsonl"
    write_jsonl([{"prompt": "hi", "answer": "1", "id": 0}, {"prompt": "hi", "answer": "2", "id": 1},
                 {"prompt": "hi", "answer": "1", "id": 2}], path)
    assert prepare_dataset(_config(str(path)), tok).stats["duplicates"] == 1


# 40 unpaired records, 8 prompts of 5 records each, interleaved: a per-record split leaks.
REPEATED_PROMPTS = ["hi", "hi there", "what is two", "what is four", "bye", "bye now", "is two four", "ok sure"]
COMPLETIONS = ["yes", "no", "yes ok", "no now", "sure"]


def _repeated_records():
    return [{"prompt": REPEATED_PROMPTS[i % 8], "completion": COMPLETIONS[i // 8], "label": i % 2 == 0}
            for i in range(40)]


def _unpaired_config(**kw):
    kw.setdefault("max_length", 12)
    kw.setdefault("max_prompt_length", 8)
    return DataConfig(format="unpaired", apply_chat_template=False, batch_size=2, read_threads=0, **kw)


def _prompt_ids(prepared, indices):
    return {tuple(prepared.encoder.encode(prepared.source[int(i)]).prompt) for i in indices}


def test_split_keeps_each_prompt_on_one_side(tok):
    records = _repeated_records()
    for seed in range(5):
        config = _unpaired_config(eval_fraction=0.3, seed=seed)
        prepared = prepare_dataset(config, tok, records=records)
        assert prepared.stats["duplicates"] == 0
        assert not _prompt_ids(prepared, prepared.train_indices) & _prompt_ids(prepared, prepared.eval_indices)
        # whole groups of 5 until round(0.3 * 40) = 12 is reached: 15 records
        assert prepared.stats["eval"] == 15 and prepared.stats["train"] == 25
        assert sorted(prepared.train_indices.tolist() + prepared.eval_indices.tolist()) == list(range(40))
        # the former split, a seeded permutation of the records, put prompts on both sides
        order = np.random.default_rng(seed).permutation(40)
        old_eval, old_train = order[:12], order[12:]
        assert _prompt_ids(prepared, old_train) & _prompt_ids(prepared, old_eval)
        # KL partners stay within their split and off their own prompt
        for i in prepared.eval_indices:
            j = prepared.kl_partner(i)
            assert j in prepared.eval_indices and records[j]["prompt"] != records[i]["prompt"]


def test_split_is_seeded(tok):
    records = _repeated_records()
    splits = [prepare_dataset(_unpaired_config(eval_fraction=0.3, seed=s), tok, records=records).eval_indices.tolist()
              for s in (0, 0, 1, 2, 3)]
    assert splits[0] == splits[1]
    assert any(split != splits[0] for split in splits[2:])


def test_split_equals_the_per_record_split_when_every_prompt_is_unique(tok):
    """With no prompt repeated each group is one record, and the split is the former one."""
    words = ["hi", "there", "bye", "now", "what", "is", "two", "four"]
    records = [{"prompt": f"{words[i % 8]} {words[i // 8]}", "completion": "yes", "label": True} for i in range(30)]
    for fraction, seed in ((0.3, 0), (0.1, 4)):
        prepared = prepare_dataset(_unpaired_config(eval_fraction=fraction, seed=seed), tok, records=records)
        n_eval = round(fraction * 30)
        order = np.random.default_rng(seed).permutation(30)
        assert prepared.eval_indices.tolist() == sorted(order[:n_eval].tolist())
        assert prepared.train_indices.tolist() == sorted(order[n_eval:].tolist())


def test_split_groups_a_prompt_truncated_differently_by_its_responses(tok):
    # keep_end cuts "what is two plus four" (5 tokens) by the response's length: the
    # encoded prompts differ, the prompt is the same, and one side holds both records.
    records = []
    for k, prompt in enumerate(["what is two plus four", "what is four plus two", "is two plus four two",
                                "two plus two is four", "what is two plus two", "hi there bye now ok"]):
        records += [{"prompt": prompt, "completion": "yes", "label": True},
                    {"prompt": prompt, "completion": "no ok sure now", "label": False}]
    for seed in range(4):
        prepared = prepare_dataset(_unpaired_config(max_length=8, max_prompt_length=6, eval_fraction=0.3, seed=seed), tok, records=records)
        assert prepared.stats["truncated/prompt"] == 6
        assert len(_prompt_ids(prepared, [0, 1])) == 2  # the encoded prompts differ
        train = {records[i]["prompt"] for i in prepared.train_indices}
        held_out = {records[i]["prompt"] for i in prepared.eval_indices}
        assert held_out and not train & held_out


def test_split_never_empties_a_side(tok):
    records = [{"prompt": p, "completion": c, "label": True} for p in ("hi", "bye") for c in ("yes", "no", "sure")]
    for fraction in (0.01, 0.5, 0.9):
        prepared = prepare_dataset(_unpaired_config(eval_fraction=fraction), tok, records=records)
        assert prepared.stats["eval"] == 3 and prepared.stats["train"] == 3  # one group each
    assert prepare_dataset(_unpaired_config(), tok, records=records).stats["eval"] == 0


def test_single_prompt_with_an_eval_fraction_is_an_error(tok):
    records = [{"prompt": "hi", "completion": c, "label": True} for c in ("yes", "no", "sure", "ok")]
    with pytest.raises(ValueError, match="eval split cannot be separated by prompt"):
        prepare_dataset(_unpaired_config(eval_fraction=0.25), tok, records=records)
    assert prepare_dataset(_unpaired_config(), tok, records=records).stats["train"] == 4


def test_text_records_group_by_their_whole_text(tok):
    texts = ["hi there", "hi bye", "hi now", "hi there", "what is two", "hi bye"]
    config = DataConfig(format="text", max_length=8, max_prompt_length=4, batch_size=2, eval_fraction=0.5, seed=1)
    prepared = prepare_dataset(config, tok, records=[{"text": t} for t in texts])
    assert prepared.stats["duplicates"] == 2  # lines 4 and 6
    train = {texts[i] for i in prepared.train_indices}
    held_out = {texts[i] for i in prepared.eval_indices}
    assert held_out and train and not train & held_out  # the first token "hi" does not group them
