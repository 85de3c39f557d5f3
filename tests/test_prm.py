"""Process reward models: the ``steps`` data format, the reward head read at step ends
(padding, packing), the per-step loss against a NumPy loop, chain_sum step labels from a
verifier, and a PRM trained on the toy model."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from alignax import ops
from alignax.data import DataConfig, Encoder, prepare_dataset
from alignax.data.builders import chain_sum_step_labels, reasoning_gym_steps
from alignax.data.sources import BadRecordError
from alignax.losses import prm_loss, prm_step_counts
from alignax.models import ModelConfig, create_model
from alignax.trainers.api import train
from alignax.trainers.offline import prm as prm_task
from tests.data.tiny_tokenizer import ids, word_tokenizer
from tests.support.trainer_helpers import step_solutions, tiny_config

TOK = word_tokenizer()


# ---------------------------------------------------------------------------- data
def test_steps_format_marks_each_step_end_with_its_label():
    encoder = Encoder(TOK, format="steps", max_length=24, max_prompt_length=16)
    record = {"question": "what is two plus two", "steps": ["two plus two", "is four"], "labels": [True, 0.25]}
    out = encoder.arrays(encoder.encode(record))
    prompt = ids("<|im_start|>", "user", "\n", "what", "is", "two", "plus", "two", "<|im_end|>", "\n",
                 "<|im_start|>", "assistant", "\n")
    response = ids("two", "plus", "two", "\n", "is", "four", "<|im_end|>")
    n = len(prompt) + len(response)
    assert out["tokens"][:n].tolist() == prompt + response and out["attention_mask"].sum() == n
    ends = [len(prompt) + 3, len(prompt) + 6]  # the delimiter of step 1, the end-of-turn token of step 2
    assert np.flatnonzero(out["step_mask"]).tolist() == ends
    np.testing.assert_array_equal(out["step_labels"][ends], [1.0, 0.25])
    assert out["step_labels"].sum() == 1.25 and "response_mask" not in out


@pytest.mark.parametrize("record, message", [
    ({"prompt": "hi", "steps": ["yes now", "no"], "labels": [1]},
     r"field 'labels': must be a list of one label per step \(2\); got 1 labels"),
    ({"prompt": "hi", "steps": ["yes now", "no"], "labels": [1, 1.5]},
     r"field 'labels\[1\]': must be true/false or a number in \[0, 1\], got 1.5"),
    ({"prompt": "hi", "steps": ["yes\nnow", "no"], "labels": [1, 0]},
     r"field 'steps\[0\]': contains the step delimiter '\\n' \(data.step_delimiter\)"),
    ({"prompt": "hi", "steps": ["yes", " "], "labels": [1, 0]}, r"field 'steps\[1\]': empty step"),
    ({"prompt": "hi", "steps": [], "labels": []}, r"field 'steps': must be a non-empty list"),
    ({"prompt": "hi", "labels": [1]}, r"field 'steps': record has no 'steps'"),
])
def test_a_bad_step_record_is_an_error_naming_record_and_field(record, message):
    good = {"prompt": "what is ok", "steps": ["yes ok"], "labels": [1]}
    config = DataConfig(format="steps", max_length=32, max_prompt_length=16, batch_size=2)
    with pytest.raises(BadRecordError, match=rf"^records, record 1: {message}"):
        prepare_dataset(config, TOK, records=[good, record])


def test_chain_sum_step_labels_come_from_the_verifier():
    steps = ["4 - 1 = 3", "3 - 7 = -4", "-4 + 7 = 3", "<answer>3</answer>"]
    assert chain_sum_step_labels("4 - 1 - 7 + 7", steps, 1.0) == [1, 1, 1, 1]
    slipped = ["4 - 1 = 3", "3 - 7 = -5", "-5 + 7 = 2", "<answer>2</answer>"]
    assert chain_sum_step_labels("4 - 1 - 7 + 7", slipped, 0.0) == [1, 0, 0, 0]
    wrong_term = ["4 - 2 = 2", "2 - 7 = -5", "-5 + 7 = 2", "<answer>3</answer>"]  # the answer right by luck
    assert chain_sum_step_labels("4 - 1 - 7 + 7", wrong_term, 1.0) == [0, 0, 0, 0]
    records = reasoning_gym_steps("chain_sum", size=6, seed=1, max_terms=4, max_digits=1)
    assert len(records) == 12
    for correct, slipped in zip(records[0::2], records[1::2]):
        assert correct["labels"] == [1] * len(correct["steps"]) and correct["first_error"] is None
        k = slipped["first_error"]  # the slipped step and everything after it are bad
        assert slipped["labels"] == [1] * k + [0] * (len(slipped["steps"]) - k)
        assert slipped["steps"][:k] == correct["steps"][:k] and slipped["steps"][k] != correct["steps"][k]
    with pytest.raises(ValueError, match="step-labelled solutions are built for chain_sum; got task 'countdown'"):
        reasoning_gym_steps("countdown", size=2)


# ---------------------------------------------------------------------------- loss
def _bce(s, y):
    p = 1.0 / (1.0 + math.exp(-s))
    return -(y * math.log(p) + (1 - y) * math.log(1 - p))


def _reference_loss(scores, labels, mask, mode, norm_length=None):
    """From the formula, one step at a time."""
    b, t = scores.shape
    per_row, total, steps = [], 0.0, 0
    for i in range(b):
        row = [_bce(scores[i, j], labels[i, j]) for j in range(t) if mask[i, j]]
        if row:
            per_row.append(row)
        total += sum(row)
        steps += len(row)
    return {"token-mean": total / steps, "token-sum": total,
            "seq-mean-token-mean": sum(sum(r) / len(r) for r in per_row) / len(per_row),
            "seq-mean-token-sum": total / len(per_row),
            "seq-mean-token-sum-norm": total / (len(per_row) * (norm_length or t))}[mode]


@pytest.mark.parametrize("mode", ops.AGGREGATION_MODES)
def test_prm_loss_matches_a_numpy_loop_on_soft_labels(mode):
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(4, 7)) * 3
    labels = rng.uniform(size=(4, 7))
    mask = (rng.uniform(size=(4, 7)) < 0.5).astype(np.float32)
    mask[2] = 0  # a row without steps counts in no denominator
    labels_off_steps = np.where(mask > 0, labels, 17.0)  # what lies off the step ends is never read
    loss, _ = jax.jit(lambda s, y, m: prm_loss(s, y, m, aggregation=mode))(scores, labels_off_steps, mask)
    np.testing.assert_allclose(float(loss), _reference_loss(scores, labels, mask, mode), rtol=1e-5)
    # split in two micro-batches with the full batch's normalisers, the halves sum to it
    norms = ops.aggregation_normalisers(jnp.asarray(mask))
    halves = [prm_loss(scores[i:i + 2], labels[i:i + 2], mask[i:i + 2], aggregation=mode, **norms)[0]
              for i in (0, 2)]
    np.testing.assert_allclose(float(sum(halves)), float(loss), rtol=1e-5)
    if mode == "seq-mean-token-sum-norm":  # Dr. GRPO's constant: a budget of 10 steps, not the row's 7
        loss = prm_loss(scores, labels, mask, aggregation=mode, norm_length=10)[0]
        np.testing.assert_allclose(float(loss), _reference_loss(scores, labels, mask, mode, norm_length=10), rtol=1e-5)


def test_prm_loss_of_bfloat16_scores_is_computed_in_float32():
    """A bfloat16 head's scores are read exactly and the BCE and sigmoid are formed in float32: the loss
    and ``mean_score`` are NumPy's float64 ones of the same (bf16-representable) values, not ones
    rounded to bf16 per step."""
    rng = np.random.default_rng(3)
    scores = jnp.asarray(rng.normal(size=(3, 6)) * 4, jnp.bfloat16)
    labels = rng.uniform(size=(3, 6)).astype(np.float32)
    mask = np.ones((3, 6), np.float32)
    loss, metrics = prm_loss(scores, labels, mask)
    x = np.asarray(scores.astype(jnp.float32), np.float64)
    want = np.mean(np.logaddexp(0.0, x) - labels * x)
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    # the mean predicted probability too: sigmoid in float32, not rounded to bf16 per step
    np.testing.assert_allclose(float(metrics["mean_score"]), np.mean(1 / (1 + np.exp(-x))), rtol=1e-6)


def test_prm_metrics_worked_by_hand():
    # row 0: labels good, good, bad; scores predict good, bad, bad -> first error 1 vs 2
    # row 1: labels good, good;      scores predict good, good     -> none vs none
    # row 2: labels bad;             scores predict good           -> 0 vs none
    scores = np.array([[2.0, -1.0, -3.0], [0.5, 0.1, 0.0], [1.0, 0.0, 0.0]])
    labels = np.array([[1.0, 0.9, 0.2], [1.0, 0.6, 0.0], [0.3, 0.0, 0.0]])
    mask = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0]], np.float32)
    _, metrics = prm_loss(scores, labels, mask)
    assert float(metrics["step_accuracy"]) == pytest.approx(4 / 6)  # row 0: 2 of 3, row 1: 2 of 2, row 2: 0 of 1
    assert float(metrics["first_error_accuracy"]) == pytest.approx(1 / 3)
    sigmoid = 1 / (1 + np.exp(-scores))
    assert float(metrics["mean_score"]) == pytest.approx(float(sigmoid[mask > 0].mean()), rel=1e-6)


def test_prm_metrics_count_only_rows_with_steps_and_divide_by_the_counts():
    """A row without a step is no solution (it counts in no denominator), and the metrics are
    the counts' plain ratios: one step, or one solution, is a whole denominator."""
    # row 0: one step, labelled bad, predicted bad (score 0 is predicted good; -1 bad): first errors 0 vs 0
    # row 1: no step at all (its label and score are never read)
    scores = np.array([[-1.0, 5.0], [-4.0, -4.0]])
    labels = np.array([[0.0, 1.0], [0.0, 0.0]])
    mask = np.array([[1, 0], [0, 0]], np.float32)
    _, metrics = prm_loss(scores, labels, mask)
    assert float(metrics["step_accuracy"]) == 1.0  # 1 of 1 step
    assert float(metrics["first_error_accuracy"]) == 1.0  # 1 of 1 solution, not 1 of 2 rows
    counts = {k: float(v) for k, v in prm_step_counts(scores, labels, mask).items()}
    assert counts == {"step_correct": 1.0, "steps": 1.0, "first_error_correct": 1.0, "solutions": 1.0}
    # the sums are float32 whatever the mask's dtype (as sft's token count): a boolean mask counts the same
    from_bool = prm_step_counts(scores, labels, mask > 0)
    assert all(v.dtype == jnp.float32 and float(v) == counts[k] for k, v in from_bool.items())


@pytest.mark.parametrize("batch", [1, 3])
def test_an_error_found_by_one_side_only_is_never_a_first_error_match(batch):
    """'None' is a first error of its own: a solution whose labels have a bad step at p and whose
    scores predict every step good (or the reverse) is not identified, for every p."""
    t, counts_of = 5, jax.jit(prm_step_counts)
    for p in range(t):
        labels = np.ones((batch, t), np.float32)
        labels[:, p] = 0.0
        scores = np.full((batch, t), 2.0)
        mask = np.ones((batch, t), np.float32)
        predicted_bad_at_p = np.where(labels > 0, 2.0, -2.0)
        for s, y in ((scores, labels), (predicted_bad_at_p, np.ones_like(labels))):
            counts = counts_of(s, y, mask)
            assert float(counts["first_error_correct"]) == 0.0, (p, batch)
            assert float(counts["solutions"]) == batch


# ---------------------------------------------------------------------------- the head
@pytest.fixture(scope="module")
def prm_model():
    hf = dict(model_type="llama", vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=64,
              rms_norm_eps=1e-5, tie_word_embeddings=False)
    return create_model(ModelConfig.from_hf_config(hf), kind="reward", seed=3)


@pytest.fixture(scope="module")
def forward(prm_model):
    """The model's forward, jitted (eager NNX dispatches op by op)."""
    graphdef, state = nnx.split(prm_model)

    @jax.jit
    def run(tokens, positions, attention, segments):
        out = nnx.merge(graphdef, state)(tokens, positions, attention, segment_ids=segments, per_token=True)
        return out.rewards, out.values

    def call(tokens, positions=None, attention=None, segments=None):
        tokens = np.asarray(tokens, np.int32)
        if positions is None:
            positions = np.maximum(np.cumsum(attention, axis=-1) - 1, 0).astype(np.int32)
        return jax.tree.map(np.asarray, run(tokens, positions, attention, segments))

    return call


def _prefix_scores(forward, rows, *, left: bool, width: int = 32, batch: int = 4):
    """The reward (last real token) of each row scored on its own, in one padded batch."""
    tokens = np.zeros((batch, width), np.int32)
    attention = np.zeros_like(tokens)
    for i, row in enumerate(rows):
        cols = slice(width - len(row), width) if left else slice(0, len(row))
        tokens[i, cols], attention[i, cols] = row, 1
    return forward(tokens, attention=attention)[0][:len(rows)]


def test_step_scores_are_each_prefix_scored_alone_under_padding_and_packing(forward):
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, 32, 5).tolist()
    a, b = rng.integers(3, 32, 7).tolist(), rng.integers(3, 32, 4).tolist()
    ends_a, ends_b = [1, 4, 6], [2, 3]  # step ends within each solution
    truth_a = _prefix_scores(forward, [prompt + a[:e + 1] for e in ends_a], left=False)
    truth_b = _prefix_scores(forward, [prompt + b[:e + 1] for e in ends_b], left=False)
    np.testing.assert_allclose(_prefix_scores(forward, [prompt + b[:e + 1] for e in ends_b], left=True), truth_b,
                               atol=1e-5)
    # one right-padded row per solution: the per-token scores at the step ends
    rows = np.zeros((4, 32), np.int32)
    attention = np.zeros_like(rows)
    for i, sol in enumerate((a, b)):
        rows[i, :len(prompt) + len(sol)], attention[i, :len(prompt) + len(sol)] = prompt + sol, 1
    values = forward(rows, attention=attention)[1]
    np.testing.assert_allclose(values[0, [len(prompt) + e for e in ends_a]], truth_a, atol=1e-5)
    np.testing.assert_allclose(values[1, [len(prompt) + e for e in ends_b]], truth_b, atol=1e-5)
    # packed: [prompt | a | b] with segment ids 0 / 1 / 2, positions restarting after the prompt
    p = len(prompt)
    packed = np.asarray([prompt + a + b], np.int32)
    segments = np.asarray([[0] * p + [1] * len(a) + [2] * len(b)], np.int32)
    positions = np.asarray([list(range(p)) + list(range(p, p + len(a))) + list(range(p, p + len(b)))], np.int32)
    values = forward(packed, positions, np.ones_like(packed), segments)[1]
    np.testing.assert_allclose(values[0, [p + e for e in ends_a]], truth_a, atol=1e-5)
    np.testing.assert_allclose(values[0, [p + len(a) + e for e in ends_b]], truth_b, atol=1e-5)


def test_the_prm_task_loss_is_the_bce_of_each_prefix_score(tmp_path, prm_model, forward):
    """The task reads the head at the step ends of the data's rows, nowhere else."""
    config = tiny_config(tmp_path, "prm", data={"max_length": 32, "max_prompt_length": 16, "batch_size": 4})
    records = step_solutions(4, seed=5)
    encoder = Encoder(TOK, format="steps", max_length=32, max_prompt_length=16)
    rows = [encoder.arrays(encoder.encode(r)) for r in records]
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    graphdef, params, rest = nnx.split(prm_model, nnx.Param, ...)
    task = prm_task.make_task(config, graphdef, rest)
    loss, _ = jax.jit(task.loss_fn)(params, {}, batch, task.normalisers_fn(batch), None)
    bces = []
    for r, row in zip(records, rows):
        ends = np.flatnonzero(row["step_mask"])
        scores = _prefix_scores(forward, [row["tokens"][:e + 1] for e in ends], left=False)
        bces += [_bce(float(s), y) for s, y in zip(scores, r["labels"])]
    np.testing.assert_allclose(float(loss), np.mean(bces), rtol=1e-5)


# ---------------------------------------------------------------------------- training
def test_a_prm_learns_held_out_step_labels(tmp_path, toy_model):
    config = tiny_config(tmp_path, "prm", steps=30, model_dir=toy_model, checkpoint={"enabled": False},
                         optim={"learning_rate": 1e-2}, data={"batch_size": 16})
    result = train(config, records=step_solutions(96))
    before, after = result.eval_history[0], result.eval_history[-1]
    assert after["eval/step_accuracy"] >= 0.9 > before["eval/step_accuracy"]
    assert after["eval/first_error_accuracy"] >= 0.8
    assert after["eval/loss"] < before["eval/loss"]
