"""Formats: tokenisation, masks, truncation, and bad records (alignax.data.formats/pipeline).

Masks are checked token by token against sequences written out by hand from the ChatML
template on a word-level tokenizer (one token per word, ``\\n`` its own token), where
pad == eos == ``<|im_end|>`` as in SmolLM2.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from alignax.data import BadRecordError, DataConfig, Encoder, prepare_dataset

_spec = importlib.util.spec_from_file_location(
    "tiny_tokenizer", os.path.join(os.path.dirname(__file__), "data", "tiny_tokenizer.py")
)
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

S, E, NL = "<|im_start|>", "<|im_end|>", "\n"
EOS = tiny.IDS[E]


@pytest.fixture(scope="module")
def tok():
    return tiny.word_tokenizer()


@pytest.fixture(scope="module")
def bpe():
    return tiny.bpe_tokenizer()


def encoder(tok, fmt="preference", **kw):
    kw.setdefault("max_length", 24)
    kw.setdefault("max_prompt_length", 16)
    return Encoder(tok, format=fmt, **kw)


def test_tokenizer_pad_is_eos(tok):
    assert tok.pad_token_id == tok.eos_token_id == EOS


# ------------------------------------------------------------------ preference


PROMPT = [S, "user", NL, "hi", "there", E, NL, S, "assistant", NL]


def test_preference_text_through_chat_template_exact_arrays(tok):
    enc = encoder(tok)
    out = enc.arrays(enc.encode({"prompt": "hi there", "chosen": "yes", "rejected": "no now"}))
    chosen = PROMPT + ["yes", E]
    rejected = PROMPT + ["no", "now", E]
    for name, words in (("chosen", chosen), ("rejected", rejected)):
        n = len(words)
        want_tokens = tiny.ids(*words) + [EOS] * (24 - n)
        np.testing.assert_array_equal(out[f"{name}_tokens"], want_tokens)
        np.testing.assert_array_equal(out[f"{name}_attention_mask"], [1] * n + [0] * (24 - n))
        np.testing.assert_array_equal(out[f"{name}_positions"], list(range(n)) + [0] * (24 - n))
        # response = the words after the generation prompt, the final <|im_end|> included
        want_mask = [0] * len(PROMPT) + [1] * (n - len(PROMPT)) + [0] * (24 - n)
        np.testing.assert_array_equal(out[f"{name}_response_mask"], want_mask)
        assert out[f"{name}_tokens"].dtype == np.int32 and out[f"{name}_tokens"].shape == (24,)


def test_pad_equal_eos_keeps_the_final_eos_in_the_mask(tok):
    enc = encoder(tok)
    out = enc.arrays(enc.encode({"prompt": "hi", "chosen": "yes", "rejected": "no"}))
    tokens, mask, attn = out["chosen_tokens"], out["chosen_response_mask"], out["chosen_attention_mask"]
    last = int(attn.sum()) - 1
    # the real end-of-turn token and the padding after it are the same id ...
    assert tokens[last] == EOS and tokens[last + 1] == EOS
    # ... but only the real one is a response token
    assert mask[last] == 1 and mask[last + 1 :].sum() == 0 and attn[last + 1 :].sum() == 0


def test_preference_plain_text_without_template(tok):
    enc = encoder(tok, apply_chat_template=False)
    e = enc.encode({"prompt": "hi there", "chosen": "yes", "rejected": "no now"})
    assert e.prompt == tiny.ids("hi", "there")
    assert e.responses["chosen"] == (tiny.ids("yes", E), [1, 1])  # eos appended
    assert e.responses["rejected"] == (tiny.ids("no", "now", E), [1, 1, 1])


def test_preference_system_prompt(tok):
    enc = encoder(tok, system_prompt="be brief")
    e = enc.encode({"prompt": "hi", "chosen": "yes", "rejected": "no"})
    assert e.prompt == tiny.ids(S, "system", NL, "be", "brief", E, NL, S, "user", NL, "hi", E, NL, S, "assistant", NL)


def test_preference_conversations_sharing_a_prefix(tok):
    enc = encoder(tok)
    user = {"role": "user", "content": "hi there"}
    full = enc.encode(
        {
            "chosen": [user, {"role": "assistant", "content": "yes"}],
            "rejected": [user, {"role": "assistant", "content": "no now"}],
        }
    )
    explicit = enc.encode({"prompt": [user], "chosen": [{"role": "assistant", "content": "yes"}], "rejected": "no now"})
    assert full.prompt == explicit.prompt == tiny.ids(*PROMPT)
    assert full.responses == explicit.responses
    assert full.responses["chosen"] == (tiny.ids("yes", E), [1, 1])


def test_preference_multi_turn_response_masks_only_assistant_turns(tok):
    enc = encoder(tok, max_length=40)
    e = enc.encode(
        {
            "prompt": "hi",
            "chosen": [
                {"role": "assistant", "content": "yes"},
                {"role": "user", "content": "now"},
                {"role": "assistant", "content": "bye"},
            ],
            "rejected": "no",
        }
    )
    ids, mask = e.responses["chosen"]
    words = ["yes", E, NL, S, "user", NL, "now", E, NL, S, "assistant", NL, "bye", E]
    assert ids == tiny.ids(*words)
    assert mask == [1, 1] + [0] * 10 + [1, 1]


# ------------------------------------------------------------------------- sft


def test_sft_masks_assistant_turns_only(tok):
    enc = encoder(tok, "sft", max_length=48, max_prompt_length=32)
    e = enc.encode(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "what is two plus two"},
                {"role": "assistant", "content": "four"},
                {"role": "user", "content": "ok"},
                {"role": "assistant", "content": "sure"},
            ]
        }
    )
    words = [S, "system", NL, "be", "brief", E, NL, S, "user", NL, "what", "is", "two", "plus", "two", E, NL,
             S, "assistant", NL, "four", E, NL, S, "user", NL, "ok", E, NL, S, "assistant", NL, "sure", E]
    trained = {20, 21, 32, 33}  # four <|im_end|> ... sure <|im_end|>
    out = enc.arrays(e)
    n = len(words)
    np.testing.assert_array_equal(out["tokens"][:n], tiny.ids(*words))
    np.testing.assert_array_equal(out["response_mask"], [int(i in trained) for i in range(48)])
    np.testing.assert_array_equal(out["attention_mask"], [1] * n + [0] * (48 - n))
    assert set(out) == {"tokens", "positions", "attention_mask", "response_mask"}


def test_sft_with_smollm2_template_and_bpe(bpe):
    """SmolLM2's template inserts a default system turn; masks still cover exactly the replies."""
    enc = Encoder(bpe, format="sft", max_length=256, max_prompt_length=128)
    messages = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "The answer is 42."},
        {"role": "user", "content": "how?"},
        {"role": "assistant", "content": "there"},
    ]
    e = enc.encode({"messages": messages})
    ids, mask = e.responses["response"]
    full = e.prompt + ids
    assert bpe.decode(full) == bpe.apply_chat_template(messages, tokenize=False).rstrip("\n")
    assert bpe.decode(e.prompt) == bpe.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert bpe.decode([t for t, m in zip(ids, mask) if m]) == f"The answer is 42.{E}there{E}"
    assert ids[-1] == bpe.eos_token_id == bpe.pad_token_id and mask[-1] == 1


def test_preference_prompt_matches_generation_prompt_with_bpe(bpe):
    enc = Encoder(bpe, format="preference", max_length=256, max_prompt_length=128)
    prompt_enc = Encoder(bpe, format="prompt", max_prompt_length=128)
    record = {"prompt": "how are you?", "chosen": "The answer is <answer>42</answer>.", "rejected": "hello"}
    e = enc.encode(record)
    p = prompt_enc.encode({"prompt": record["prompt"]})
    assert e.prompt == p.prompt  # DPO trains on the same prompt ids the sampler is given
    ids, mask = e.responses["chosen"]
    assert bpe.decode(ids) == record["chosen"] + E and all(mask)


# -------------------------------------------------------------- unpaired, prompt


def test_unpaired_label_and_arrays(tok):
    enc = encoder(tok, "unpaired")
    out = enc.arrays(enc.encode({"prompt": "hi", "completion": "bye", "label": True}))
    words = [S, "user", NL, "hi", E, NL, S, "assistant", NL, "bye", E]
    np.testing.assert_array_equal(out["tokens"][: len(words)], tiny.ids(*words))
    np.testing.assert_array_equal(out["response_mask"][: len(words) + 1], [0] * 9 + [1, 1, 0])
    assert out["label"] == 1
    assert enc.encode({"prompt": "hi", "completion": "bye", "label": 0}).label == 0


def test_prompt_format_left_pads_and_keeps_the_record(tok):
    enc = encoder(tok, "prompt", max_prompt_length=12)
    record = {"question": "what is two plus two", "answer": "4", "metadata": {"source_dataset": "chain_sum"}}
    out = enc.arrays(enc.encode(record))
    words = [S, "user", NL, "what", "is", "two", "plus", "two", E, NL, S, "assistant", NL]
    assert len(words) == 13  # over 12: keeps the end
    np.testing.assert_array_equal(out["prompt_tokens"], tiny.ids(*words[1:]))
    enc = encoder(tok, "prompt", max_prompt_length=16)
    out = enc.arrays(enc.encode(record))
    np.testing.assert_array_equal(out["prompt_tokens"], [EOS] * 3 + tiny.ids(*words))
    np.testing.assert_array_equal(out["prompt_attention_mask"], [0] * 3 + [1] * 13)
    np.testing.assert_array_equal(out["prompt_positions"], [0] * 3 + list(range(13)))
    assert out["reference"]["answer"] == "4" and out["reference"]["metadata"] == {"source_dataset": "chain_sum"}
    assert out["reference"]["prompt"] == "what is two plus two"
    mapped = encoder(tok, "prompt", field_map={"prompt": "q", "answer": "a"}).encode({"q": "hi", "a": "1"})
    assert mapped.reference["answer"] == "1"


# ------------------------------------------------------------------ truncation


def _record(prompt_words: int, response_words: int) -> dict:
    return {"prompt": " ".join(["hi"] * prompt_words), "chosen": " ".join(["yes"] * response_words), "rejected": "no"}


def test_keep_end_cuts_prompt_start_to_max_prompt_length(tok):
    enc = encoder(tok, apply_chat_template=False, max_length=20, max_prompt_length=4)
    e = enc.encode({"prompt": "what is two plus two", "chosen": "four", "rejected": "no"})
    assert e.prompt == tiny.ids("is", "two", "plus", "two") and e.truncated_prompt and not e.truncated_response


def test_keep_end_cuts_prompt_to_fit_max_length(tok):
    enc = encoder(tok, apply_chat_template=False, max_length=8, max_prompt_length=6)
    e = enc.encode({"prompt": "what is two plus two", "chosen": "yes yes yes", "rejected": "no"})
    # response: yes yes yes <eos> = 4 tokens, so the prompt keeps its last 8 - 4 = 4
    assert e.prompt == tiny.ids("is", "two", "plus", "two")
    assert e.responses["chosen"][0] == tiny.ids("yes", "yes", "yes", E)
    assert e.truncated_prompt and not e.truncated_response


def test_truncate_response_cuts_the_end(tok):
    enc = encoder(tok, apply_chat_template=False, truncation="truncate_response", max_length=8, max_prompt_length=6)
    e = enc.encode({"prompt": "what is two plus two", "chosen": "yes yes yes", "rejected": "no"})
    assert e.prompt == tiny.ids("what", "is", "two", "plus", "two")
    assert e.responses["chosen"] == (tiny.ids("yes", "yes", "yes"), [1, 1, 1])  # eos cut off
    assert e.responses["rejected"] == (tiny.ids("no", E), [1, 1])  # fits, untouched
    assert e.truncated_response and not e.truncated_prompt


def test_max_response_length_cuts_responses(tok):
    enc = encoder(tok, apply_chat_template=False, max_length=20, max_prompt_length=6, max_response_length=2)
    e = enc.encode({"prompt": "hi", "chosen": "yes yes yes", "rejected": "no"})
    assert e.responses["chosen"][0] == tiny.ids("yes", "yes") and e.truncated_response


def test_reject_policy_raises_too_long_naming_the_field(tok):
    enc = encoder(tok, apply_chat_template=False, truncation="reject", max_length=8, max_prompt_length=3)
    with pytest.raises(BadRecordError, match=r"field 'prompt': prompt has 5 tokens; max_prompt_length is 3") as info:
        enc.encode({"prompt": "what is two plus two", "chosen": "yes", "rejected": "no"})
    assert info.value.reason == "too_long"
    with pytest.raises(BadRecordError, match=r"field 'chosen': prompt \+ response have 9 tokens"):
        enc.encode({"prompt": "hi", "chosen": "yes " * 7, "rejected": "no"})


def test_truncations_are_counted(tok, tmp_path):
    path = tmp_path / "t.jsonl"
    records = [
        {"prompt": "what is two plus two", "chosen": "four", "rejected": "no"},  # prompt cut
        {"prompt": "hi", "chosen": "yes yes yes yes yes yes yes yes", "rejected": "no"},  # response cut
        {"prompt": "hi", "chosen": "yes", "rejected": "no"},  # fits
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(paths=str(path), apply_chat_template=False, max_length=8, max_prompt_length=3, batch_size=1)
    stats = prepare_dataset(cfg, tok).stats
    assert stats["truncated/prompt"] == 1 and stats["truncated/response"] == 1 and stats["kept"] == 3
    rejecting = prepare_dataset(
        DataConfig(paths=str(path), apply_chat_template=False, max_length=8, max_prompt_length=3, batch_size=1,
                   truncation="reject", on_bad_record="skip"),
        tok,
    ).stats
    assert rejecting["skipped/too_long"] == 2 and rejecting["kept"] == 1 and rejecting["truncated/prompt"] == 0


# ------------------------------------------------------------------ bad records

GOOD = {"prompt": "hi", "chosen": "yes", "rejected": "no"}
BAD_LINES = {
    # case: (raw line, reason, expected text in the message)
    "malformed": (b'{"prompt": "hi", "chosen": "yes", ', "malformed", "malformed JSON"),
    "missing": (json.dumps({"prompt": "hi", "chosen": "yes"}).encode(), "missing_field", "field 'rejected'"),
    "empty": (json.dumps({"prompt": "hi", "chosen": "  ", "rejected": "no"}).encode(), "empty", "field 'chosen': empty"),
    "identical": (json.dumps({"prompt": "hi", "chosen": "yes", "rejected": "yes"}).encode(), "identical", "field 'rejected': identical"),
    "not_utf8": (b'{"prompt": "hi", "chosen": "y\xffs", "rejected": "no"}', "not_utf8", "field 'chosen': invalid UTF-8"),
    "too_long": (json.dumps({"prompt": "hi " * 20, "chosen": "yes", "rejected": "no"}).encode(), "too_long", "field 'prompt': prompt has"),
    "bad_message": (json.dumps({"prompt": [{"role": "user"}], "chosen": "yes", "rejected": "no"}).encode(), "missing_field", "field 'prompt[0].content'"),
}


def _write_lines(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write(line + b"\n")


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_bad_record_error_names_file_line_and_field(tok, tmp_path, case):
    raw, reason, text = BAD_LINES[case]
    path = tmp_path / "bad.jsonl"
    _write_lines(path, [json.dumps(GOOD).encode(), b"", raw])  # line 2 blank: the bad one is line 3
    cfg = DataConfig(paths=str(path), truncation="reject", max_length=24, max_prompt_length=16, batch_size=1)
    with pytest.raises(BadRecordError) as info:
        prepare_dataset(cfg, tok)
    message = str(info.value)
    assert message.startswith(f"{path}, line 3: "), message
    assert text in message and info.value.reason == reason


def test_bad_records_skipped_and_counted(tok, tmp_path):
    path = tmp_path / "bad.jsonl"
    _write_lines(path, [json.dumps(GOOD).encode()] + [raw for raw, _, _ in BAD_LINES.values()] + [json.dumps(GOOD).encode()])
    cfg = DataConfig(paths=str(path), truncation="reject", on_bad_record="skip", max_length=24, max_prompt_length=16, batch_size=2)
    prepared = prepare_dataset(cfg, tok)
    stats = prepared.stats
    assert stats["records"] == 9 and stats["kept"] == 2 and stats["skipped"] == 7
    assert stats["skipped/missing_field"] == 2
    for reason in ("malformed", "empty", "identical", "not_utf8", "too_long"):
        assert stats[f"skipped/{reason}"] == 1, reason
    assert json.loads(json.dumps(stats)) == stats  # loggable as it is
    assert list(prepared.train_indices) == [0, 8]
    batch = next(prepared.iterator(process_index=0, process_count=1))
    assert batch["chosen_tokens"].shape == (2, 24)


def test_non_utf8_in_parquet_binary_column_names_row_and_field(tok, tmp_path):
    path = str(tmp_path / "bad.parquet")
    table = pa.table(
        {
            "prompt": pa.array([b"hi", b"hi"], pa.binary()),
            "chosen": pa.array([b"yes", b"y\xffs"], pa.binary()),
            "rejected": pa.array([b"no", b"no"], pa.binary()),
        }
    )
    pq.write_table(table, path)
    cfg = DataConfig(paths=path, batch_size=1, max_length=24, max_prompt_length=16)
    with pytest.raises(BadRecordError, match=rf"^{path}, row 1: field 'chosen': invalid UTF-8 byte at offset 1"):
        prepare_dataset(cfg, tok)


def test_identical_after_tokenisation_is_caught(tok):
    # two different strings that the word tokenizer maps to the same ids ([UNK])
    enc = encoder(tok)
    with pytest.raises(BadRecordError, match="field 'rejected': tokenises identically"):
        enc.encode({"prompt": "hi", "chosen": "zebra", "rejected": "giraffe"})


def test_config_errors_name_the_field_and_choices():
    with pytest.raises(ValueError, match=r"unknown data.format 'pairs'; valid: preference, unpaired, sft, prompt, text"):
        DataConfig(paths="x.jsonl", format="pairs")
    with pytest.raises(ValueError, match=r"unknown data.truncation 'left'; valid: keep_end, truncate_response, reject"):
        DataConfig(paths="x.jsonl", truncation="left")
    with pytest.raises(ValueError, match=r"unknown data.on_bad_record 'warn'; valid: error, skip"):
        DataConfig(paths="x.jsonl", on_bad_record="warn")
    with pytest.raises(ValueError, match="max_prompt_length \\(64\\) must be < data.max_length \\(64\\)"):
        DataConfig(paths="x.jsonl", max_length=64, max_prompt_length=64)
    with pytest.raises(ValueError, match="field_map names answer, not fields of format 'preference'"):
        Encoder(tiny.word_tokenizer(), format="preference", field_map={"answer": "a"})


def test_unpaired_batches_carry_kto_mismatched_pairs(tok, tmp_path):
    path = tmp_path / "kto.jsonl"
    records = [
        {"prompt": "hi", "completion": "yes", "label": True},
        {"prompt": "what is", "completion": "no now", "label": False},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig(paths=str(path), format="unpaired", apply_chat_template=False, shuffle=False,
                     max_length=6, max_prompt_length=3, batch_size=2)
    prepared = prepare_dataset(cfg, tok)
    assert prepared.stats["label/desirable"] == 1 and prepared.stats["label/undesirable"] == 1
    assert (prepared.kl_partner(0), prepared.kl_partner(1)) == (1, 0)  # two records: each other's
    batch = next(prepared.iterator(process_index=0, process_count=1))
    np.testing.assert_array_equal(batch["label"], [1, 0])
    np.testing.assert_array_equal(batch["tokens"], [tiny.ids("hi", "yes", E, E, E, E), tiny.ids("what", "is", "no", "now", E, E)])
    # prompt i + completion of its partner: "hi no now <eos>", "what is yes <eos>"
    np.testing.assert_array_equal(batch["kl_tokens"], [tiny.ids("hi", "no", "now", E, E, E), tiny.ids("what", "is", "yes", E, E, E)])
    np.testing.assert_array_equal(batch["kl_response_mask"], [[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0]])
    np.testing.assert_array_equal(batch["kl_attention_mask"], [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(batch["kl_positions"], [[0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 0, 0]])


def _kto_records(n):
    words = ["hi", "there", "bye", "now", "two", "four", "ok", "sure"]
    # records 2k and 2k+1 share a prompt (as unpaired data made from pairs does)
    return [{"prompt": f"what is {words[(i // 2) % 8]} {words[(i // 16) % 8]}", "completion": ("yes " if i % 2 else "no ") + words[i % 8],
             "label": bool(i % 2)} for i in range(n)]


def test_kto_mismatched_row_is_a_function_of_the_record_not_the_batch(tok):
    """A record's KL row is the same in shuffled batches, ordered passes, any batch size
    and any process count: precomputed reference log-probs stay paired with it."""
    records = _kto_records(40)
    cfg = DataConfig(format="unpaired", apply_chat_template=False, max_length=10, max_prompt_length=6, batch_size=4,
                     eval_fraction=0.25, read_threads=0, seed=5)
    prepared = prepare_dataset(cfg, tok, records=records)
    train, held_out = set(prepared.train_indices.tolist()), set(prepared.eval_indices.tolist())
    partners = {i: prepared.kl_partner(i) for i in train | held_out}
    for i, j in partners.items():
        assert j != i and records[j]["prompt"] != records[i]["prompt"]  # mismatched, never its sibling
        assert (j in train) == (i in train)  # within its own split
    assert sorted(partners[i] for i in train) == sorted(train)  # each completion used once
    # a seeded permutation, not the file order's neighbour
    assert sum(partners[i] in (i + 1, i + 2) for i in train) < len(train) // 2
    rows = {}

    def collect(batch):
        for r, index in enumerate(batch["record_index"]):
            row = {k: batch[k][r] for k in ("kl_tokens", "kl_response_mask", "kl_attention_mask", "kl_positions")}
            if int(index) in rows:
                for k, v in row.items():
                    np.testing.assert_array_equal(v, rows[int(index)][k])
            rows[int(index)] = row

    for batch in prepared.iterator("train", ordered=True, process_index=0, process_count=1):
        collect(batch)
    shuffled = prepared.iterator("train", process_index=0, process_count=1)
    for _ in range(20):  # more than two epochs, reshuffled
        collect(next(shuffled))
    for p in range(2):
        collect(next(prepared.iterator("train", process_index=p, process_count=2)))
    small = prepare_dataset(dataclasses.replace(cfg, batch_size=2), tok, records=records)
    for _ in range(5):
        collect(next(small.iterator("train", process_index=0, process_count=1)))
    for i in train:
        prompt_ids = tok.encode(records[i]["prompt"])
        completion_ids = tok.encode(records[partners[i]]["completion"]) + [EOS]
        n = len(prompt_ids) + len(completion_ids)
        np.testing.assert_array_equal(rows[i]["kl_tokens"][:n], prompt_ids + completion_ids)
        np.testing.assert_array_equal(rows[i]["kl_response_mask"][:n], [0] * len(prompt_ids) + [1] * len(completion_ids))
    other_seed = prepare_dataset(dataclasses.replace(cfg, seed=6), tok, records=records)
    assert any(other_seed.kl_partner(i) != partners[i] for i in other_seed.train_indices)


def test_kto_single_record_split_is_its_own_partner(tok):
    cfg = DataConfig(format="unpaired", apply_chat_template=False, max_length=10, max_prompt_length=6, batch_size=1)
    prepared = prepare_dataset(cfg, tok, records=_kto_records(1))
    assert prepared.kl_partner(0) == 0
    batch = next(prepared.iterator(process_index=0, process_count=1))
    np.testing.assert_array_equal(batch["kl_tokens"], batch["tokens"])


# ------------------------------------------------------------------ margin


def test_preference_margin_is_carried_as_a_float_per_pair(tok):
    enc = encoder(tok)
    out = enc.arrays(enc.encode({**GOOD, "margin": 2}))
    assert out["margin"].dtype == np.float32 and out["margin"] == 2.0
    assert enc.arrays(enc.encode(GOOD))["margin"] == 0.0  # absent: 0
    assert enc.encode({**GOOD, "margin": None}).margin is None
    mapped = encoder(tok, field_map={"margin": "gap"})
    assert mapped.encode({**GOOD, "gap": -0.5}).margin == -0.5
    for bad in ("big", True, float("nan"), [1.0]):
        with pytest.raises(BadRecordError, match=r"field 'margin': must be a finite number"):
            enc.encode({**GOOD, "margin": bad})
    cfg = DataConfig(format="preference", batch_size=2, max_length=24, max_prompt_length=16, read_threads=0, shuffle=False)
    prepared = prepare_dataset(cfg, tok, records=[{**GOOD, "margin": 1.5}, GOOD, {**GOOD, "margin": 0.25}])
    assert prepared.stats["margin/present"] == 2
    batch = next(prepared.iterator(process_index=0, process_count=1))
    assert batch["margin"].dtype == np.float32
    np.testing.assert_array_equal(batch["margin"], [1.5, 0.0])


def test_required_margin_names_the_record_and_field(tok, tmp_path):
    path = tmp_path / "graded.jsonl"
    _write_lines(path, [json.dumps({**GOOD, "margin": 1.0}).encode(), json.dumps(GOOD).encode()])
    cfg = DataConfig(paths=str(path), batch_size=1, max_length=24, max_prompt_length=16)
    with pytest.raises(BadRecordError, match=rf"^{path}, line 2: field 'margin': record has no 'margin' "
                                             r"\(for margin, required here\)") as info:
        prepare_dataset(cfg, tok, required_fields=("margin",))
    assert info.value.reason == "missing_field"
    _write_lines(path, [json.dumps({**GOOD, "margin": None}).encode()])
    with pytest.raises(BadRecordError, match=r"line 1: field 'margin': is null \(margin is required here\)"):
        prepare_dataset(cfg, tok, required_fields=("margin",))
    with pytest.raises(ValueError, match="required_fields names label, not optional fields of format 'preference'"):
        prepare_dataset(cfg, tok, required_fields=("label",))


# ------------------------------------------------------------------ text


def test_text_trains_every_token_after_the_first(tok):
    enc = encoder(tok, "text", max_length=8, max_prompt_length=4)
    e = enc.encode({"text": "what is two plus four"})
    assert e.prompt == tiny.ids("what") and not e.truncated_response
    out = enc.arrays(e)
    assert set(out) == {"tokens", "positions", "attention_mask", "response_mask"}  # as format sft
    np.testing.assert_array_equal(out["tokens"], tiny.ids("what", "is", "two", "plus", "four", E, E, E))
    np.testing.assert_array_equal(out["response_mask"], [0, 1, 1, 1, 1, 1, 0, 0])  # eos appended and trained
    np.testing.assert_array_equal(out["attention_mask"], [1] * 6 + [0, 0])
    np.testing.assert_array_equal(out["positions"], [0, 1, 2, 3, 4, 5, 0, 0])
    assert enc.encode({"text": f"hi there {E}"}).responses["response"] == (tiny.ids("there", E), [1, 1])  # no second eos
    mapped = encoder(tok, "text", field_map={"text": "content"})
    assert mapped.encode({"content": "hi there"}).prompt == tiny.ids("hi")


def test_text_truncation_and_bad_records(tok):
    enc = encoder(tok, "text", max_length=8, max_prompt_length=4, max_response_length=3)
    e = enc.encode({"text": "what is two plus four"})  # 6 tokens; 1 + 3 fit
    assert e.truncated_response and e.prompt + e.responses["response"][0] == tiny.ids("what", "is", "two", "plus")
    rejecting = encoder(tok, "text", max_length=8, max_prompt_length=4, truncation="reject")
    with pytest.raises(BadRecordError, match=r"field 'text': text has 9 tokens; at most .* = 8 fit") as info:
        rejecting.encode({"text": "what is two plus four and two plus"})
    assert info.value.reason == "too_long"
    for record, reason, text in [
        ({"content": "hi"}, "missing_field", "field 'text': record has no 'text'"),
        ({"text": ["hi"]}, "invalid", "field 'text': must be a string, got list"),
        ({"text": "  "}, "empty", "field 'text': empty text"),
        ({"text": E}, "empty", "field 'text': fewer than 2 tokens"),
    ]:
        with pytest.raises(BadRecordError, match=text) as info:
            enc.encode(record)
        assert info.value.reason == reason


def test_text_batches_through_the_pipeline(tok, tmp_path):
    path = tmp_path / "text.jsonl"
    _write_lines(path, [json.dumps({"text": "hi there"}).encode(), json.dumps({"text": 3}).encode(),
                        json.dumps({"text": "two plus two"}).encode()])
    cfg = DataConfig(paths=str(path), format="text", max_length=6, max_prompt_length=2, batch_size=2, shuffle=False)
    with pytest.raises(BadRecordError, match=rf"^{path}, line 2: field 'text': must be a string, got int"):
        prepare_dataset(cfg, tok)
    prepared = prepare_dataset(dataclasses.replace(cfg, on_bad_record="skip"), tok)
    assert prepared.stats["skipped/invalid"] == 1 and prepared.stats["kept"] == 2
    batch = next(prepared.iterator(process_index=0, process_count=1))
    assert {k: v.shape for k, v in batch.items()} == {
        "tokens": (2, 6), "positions": (2, 6), "attention_mask": (2, 6), "response_mask": (2, 6),
        "example_mask": (2,), "record_index": (2,),
    }
    np.testing.assert_array_equal(batch["response_mask"], [[0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0]])


def test_text_needs_no_chat_template():
    plain = tiny.word_tokenizer()
    plain.chat_template = None
    assert Encoder(plain, format="text").encode({"text": "hi there"}).prompt == tiny.ids("hi")


def test_sft_conversations_that_cannot_be_masked(tok):
    enc = encoder(tok, "sft")
    with pytest.raises(BadRecordError, match="field 'messages': no non-empty assistant message"):
        enc.encode({"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(BadRecordError, match="field 'messages': the conversation starts with an assistant message"):
        enc.encode({"messages": [{"role": "assistant", "content": "hi"}]})
    with pytest.raises(BadRecordError, match="field 'messages': must be a list of messages, got str"):
        enc.encode({"messages": "hi"})
    with pytest.raises(BadRecordError, match=r"field 'messages\[1\].content': must be a string, got int"):
        enc.encode({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 3}]})


def test_template_needed_for_chat_formats():
    plain = tiny.word_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="format 'sft' with apply_chat_template=True needs a tokenizer with a chat_template"):
        Encoder(plain, format="sft")
    Encoder(plain, format="preference", apply_chat_template=False)  # raw text needs none
