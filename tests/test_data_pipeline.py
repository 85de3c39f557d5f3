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

from alignax.data import DataConfig, build_dataset, open_source, prepare_dataset, write_jsonl

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
    with pytest.raises(ValueError, match="does not match this dataset \\(seed: saved 1, now 2\\)"):
        it.set_state(state)


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_shards_partition_each_global_batch(tok, prompt_file, process_count):
    prepared = prepare_dataset(_config(prompt_file, seed=5), tok)
    whole = _take(prepared.iterator(process_index=0, process_count=1), 8)
    shards = [_take(prepared.iterator(process_index=p, process_count=process_count), 8) for p in range(process_count)]
    for step in range(8):
        parts = [shard[step] for shard in shards]
        assert all(len(part) == 4 // process_count for part in parts)
        assert sorted(sum(parts, [])) == sorted(whole[step])  # same global batch, rows split


def test_eval_split_is_held_out_and_padded(tok, prompt_file):
    prepared = prepare_dataset(_config(prompt_file, eval_fraction=0.25, seed=11), tok)
    assert prepared.stats["train"] == 15 and prepared.stats["eval"] == 5
    train_ids = set(sum(_take(prepared.iterator("train", process_index=0, process_count=1), 3), []))
    eval_rows = []
    for p in range(2):
        batches = list(prepared.iterator("eval", process_index=p, process_count=2))
        assert len(batches) == 2  # 5 examples -> 2 global batches of 4, the last padded
        for b in batches:
            assert b["prompt_tokens"].shape == (2, 16)
        eval_rows += [i for b in batches for i in _ids(b)]
        masks = [m for b in batches for m in b["example_mask"]]
        assert sum(masks) in (2, 3)
    assert sorted(eval_rows) == sorted(int(i) for i in prepared.eval_indices)
    assert len(eval_rows) == 5 and not train_ids & set(eval_rows)
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
