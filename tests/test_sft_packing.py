"""SFT packing (``data.packing``): several examples per row, kept apart by segment ids.

The property that matters: a packed batch trains on exactly the tokens of the unpacked rows
of the same examples with the same log-probs, so the token-level loss and its gradient are
the unpacked ones (1e-5); and the rows are a deterministic, resumable, process-sharded
stream that covers every example once per epoch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from alignax.config import ConfigError
from alignax.data import prepare_dataset
from alignax.data.example_packing import RowPlan, pack_row, plan_rows
from alignax.models.registry import load_tokenizer
from alignax.trainers.api import train
from alignax.trainers.engine.setup import build_model, split_params
from alignax.trainers.offline import sft
from tests.support.trainer_helpers import sft_conversations, tiny_config

WIDTH = 64


def test_plan_rows_is_first_fit_over_the_open_rows_and_keeps_every_example_once():
    #          0  1  2  3  4  5  6
    lengths = [6, 5, 3, 4, 2, 7, 1]
    assert plan_rows(lengths, 10) == [[0, 2, 6], [1, 3], [4, 5]]  # 6+3+1, 5+4, 2+7 (first fit)
    # two rows open: 4 (2 tokens) fits neither [0, 2] (1 left) nor [1, 3] (1 left), so [0, 2]
    # closes and 6 (1 token) can no longer join it: it goes into [1, 3]
    assert plan_rows(lengths, 10, open_rows=2) == [[0, 2], [1, 3, 6], [4, 5]]
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 40, size=500)
    rows = plan_rows(lengths, 64)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)
    assert sum(lengths) / (64 * len(rows)) > 0.9  # first-fit over 32 open rows fills them
    with pytest.raises(ValueError, match="example 0 has 65 tokens; a packed row holds 1 to 64"):
        plan_rows([65], 64)


def test_pack_row_restarts_positions_and_never_scores_an_examples_first_token():
    def example(n, first_scored):
        tokens = np.full(8, 9, np.int32)
        tokens[:n] = np.arange(1, n + 1) * 10
        attention = (np.arange(8) < n).astype(np.int32)
        response = attention.copy()
        response[:first_scored] = 0
        return {"tokens": tokens, "positions": np.where(attention, np.arange(8), 0).astype(np.int32),
                "attention_mask": attention, "response_mask": response}

    row = pack_row([example(3, 1), example(4, 0)], 10, pad_id=7)
    np.testing.assert_array_equal(row["tokens"], [10, 20, 30, 10, 20, 30, 40, 7, 7, 7])
    np.testing.assert_array_equal(row["positions"], [0, 1, 2, 0, 1, 2, 3, 0, 0, 0])
    np.testing.assert_array_equal(row["segment_ids"], [1, 1, 1, 2, 2, 2, 2, 0, 0, 0])
    np.testing.assert_array_equal(row["attention_mask"], [1, 1, 1, 1, 1, 1, 1, 0, 0, 0])
    # the second example's response mask was 1 on its first token: not scored by example 1's last state
    np.testing.assert_array_equal(row["response_mask"], [0, 1, 1, 0, 1, 1, 1, 0, 0, 0])
    with pytest.raises(ValueError, match="packed examples need 11 tokens; the row holds 10"):
        pack_row([example(7, 0), example(4, 0)], 10, pad_id=7)


@pytest.fixture(scope="module")
def packed(tmp_path_factory, toy_model):
    config = tiny_config(tmp_path_factory.mktemp("sft-packing"), "sft", model_dir=toy_model, steps=2,
                         data={"max_length": WIDTH, "packing": True, "batch_size": 4, "eval_fraction": 0.0})
    tokenizer = load_tokenizer(toy_model)
    prepared = prepare_dataset(config.data, tokenizer, records=sft_conversations(60))
    return config, prepared


def _rows(iterator, steps):
    plan = iterator._plan
    return [plan.row(k) for k in range(steps * iterator.global_batch_size)]


def test_each_epoch_packs_every_training_record_once(packed):
    config, prepared = packed
    it = prepared.iterator("train", process_index=0, process_count=1)
    plan = it._plan
    for epoch in range(3):
        start = sum(plan.rows_in(e) for e in range(epoch))
        records = np.concatenate([plan.row(start + k) for k in range(plan.rows_in(epoch))])
        assert sorted(records.tolist()) == sorted(prepared.train_indices.tolist())
    assert plan.rows_in(0) < len(prepared.train_indices) / 2  # several examples per row
    batch = next(it)
    assert batch["tokens"].shape == (4, WIDTH) and batch["examples"].min() >= 2
    lengths = prepared.lengths[np.concatenate(_rows(it, 1))]
    assert int(batch["attention_mask"].sum()) == int(lengths.sum())  # every token of the packed examples


def test_the_packed_stream_resumes_exactly_and_shards_over_processes(packed):
    _, prepared = packed
    it = prepared.iterator("train", process_index=0, process_count=1)
    for _ in range(5):
        next(it)
    state = it.get_state()
    assert state["fingerprint"]["packing"] is True
    expected = [next(it) for _ in range(4)]  # crosses into the next epoch (3 batches an epoch)
    assert it.steps_per_epoch < 9 and it.epoch >= 1
    resumed = prepared.iterator("train", process_index=0, process_count=1)
    resumed.set_state(state)
    # rows of another width, or of other example lengths, are another stream: refused
    for key, value in (("max_length", 32), ("lengths", "0" * 16)):
        with pytest.raises(ConfigError, match=f"{key}: saved"):
            resumed.set_state({**state, "fingerprint": {**state["fingerprint"], key: value}})
    halves = [prepared.iterator("train", process_index=p, process_count=2) for p in (0, 1)]
    for half in halves:
        half.set_state(state)
    for want in expected:
        got = next(resumed)
        parts = [next(h) for h in halves]
        for key in ("tokens", "segment_ids", "response_mask", "positions"):
            np.testing.assert_array_equal(got[key], want[key])
            np.testing.assert_array_equal(np.concatenate([p[key] for p in parts]), want[key])


def _loss_and_grad(task, params, batch):
    batch = jax.tree.map(jnp.asarray, batch)
    normalisers = task.normalisers_fn(batch)
    (loss, _), grad = jax.value_and_grad(task.loss_fn, has_aux=True)(params, None, batch, normalisers, None)
    return loss, grad


@pytest.mark.parametrize("aggregation", ["token-mean", "token-sum"])
def test_a_packed_batch_has_the_unpacked_loss_and_gradient(packed, aggregation):
    config, prepared = packed
    model = build_model(config.model)
    graphdef, params, rest = split_params(model)
    config = dataclasses.replace(config, sft=dataclasses.replace(config.sft, aggregation=aggregation))
    task = sft.make_task(config, graphdef, rest)
    it = prepared.iterator("train", process_index=0, process_count=1)
    batch = {k: v for k, v in next(it).items() if k != "references"}
    records = np.concatenate(_rows(it, 1))
    examples = [prepared.example(r) for r in records]
    unpacked = {k: np.stack([e[k] for e in examples]) for k in ("tokens", "positions", "attention_mask",
                                                                  "response_mask")}
    unpacked["example_mask"] = np.ones(len(examples), np.int32)
    loss_p, grad_p = _loss_and_grad(task, params, batch)
    loss_u, grad_u = _loss_and_grad(task, params, unpacked)
    np.testing.assert_allclose(float(loss_p), float(loss_u), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grad_p), jax.tree.leaves(grad_u)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # the segment mask is what makes them equal: without it, later examples attend to earlier ones
    loss_mixed, _ = _loss_and_grad(task, params, {k: v for k, v in batch.items() if k != "segment_ids"})
    assert abs(float(loss_mixed) - float(loss_u)) > 1e-3


def test_a_packed_sft_run_trains_and_the_config_refuses_what_packing_cannot_do(tmp_path, toy_model):
    result = train(tiny_config(tmp_path / "run", "sft", model_dir=toy_model, steps=3,
                               data={"max_length": WIDTH, "packing": True, "batch_size": 2, "eval_fraction": 0.0}),
                   records=sft_conversations(40))
    assert len(result.history) == 3 and all(np.isfinite(h["loss"]) for h in result.history)
    for overrides, message in (
        (("sft.aggregation=seq-mean-token-mean",), "sft.aggregation=seq-mean-token-mean with data.packing"),
        (("model.attention=auto",), "model.attention=auto with data.packing"),
    ):
        with pytest.raises(ConfigError, match=message):
            tiny_config(tmp_path, "sft", model_dir=toy_model, data={"packing": True}, overrides=overrides)
    with pytest.raises(ConfigError, match="data.packing"):
        tiny_config(tmp_path, "dpo", model_dir=toy_model, data={"packing": True})


def test_row_plan_stops_after_num_epochs():
    plan = RowPlan(np.arange(10), np.full(10, 5), 10, seed=0, shuffle=True, num_epochs=2)
    assert plan.total_rows() == 10 and plan.epoch_of(9) == 1
    with pytest.raises(IndexError, match="past the 2 epochs' 10 rows"):
        plan.row(10)


def test_a_row_plan_packs_each_epoch_in_its_own_shuffled_order_or_in_file_order():
    """``shuffle``: epoch ``e`` packs the records in ``default_rng([seed, e])``'s permutation
    (the record indices given, not their positions); without it, in file order every epoch."""
    indices, lengths = np.arange(100, 112), np.asarray([3, 7, 2, 5, 8, 1, 4, 6, 2, 9, 3, 5])

    def rows(plan, epoch):
        first = sum(plan.rows_in(e) for e in range(epoch))
        return [plan.row(first + k).tolist() for k in range(plan.rows_in(epoch))]

    in_order = RowPlan(indices, lengths, 10, seed=3, shuffle=False, num_epochs=2)
    expected = [[int(indices[i]) for i in row] for row in plan_rows(lengths, 10)]
    assert rows(in_order, 0) == rows(in_order, 1) == expected
    shuffled = RowPlan(indices, lengths, 10, seed=3, shuffle=True, num_epochs=2)
    for epoch in (0, 1):
        order = np.random.default_rng([3, epoch]).permutation(len(indices))
        assert rows(shuffled, epoch) == [[int(indices[order[i]]) for i in row] for row in plan_rows(lengths[order], 10)]
    assert rows(shuffled, 0) != rows(shuffled, 1) and rows(shuffled, 0) != expected


def test_plan_rows_and_pack_row_at_their_edges():
    """An example of exactly the row's width is one row; an empty one is refused; closing the
    oldest open row forgets that row's room (with one row open, then two)."""
    assert plan_rows([10], 10) == [[0]]
    with pytest.raises(ValueError, match="example 0 has 0 tokens"):
        plan_rows([0], 10)
    # open_rows=2: rows a (6) and b (9) open; 5 fits neither, so a closes and c opens with 5;
    # then 4 fits c (room 5), not b (room 1): a wrong room kept for b would take it there
    assert plan_rows([6, 9, 5, 4], 10, open_rows=2) == [[0], [1], [2, 3]]
    row = pack_row([{"tokens": np.arange(1, 11), "positions": np.arange(10), "attention_mask": np.ones(10, np.int32),
                     "response_mask": np.ones(10, np.int32)}], 10, pad_id=0)
    assert row["tokens"].tolist() == list(range(1, 11)) and row["segment_ids"].tolist() == [1] * 10
