"""Formats: tokenisation, masks, truncation, and bad records (alignax.data.formats/pipeline).

Masks are checked token by token against sequences written out by hand from the ChatML
template on a word-level tokenizer (one token per word, ``\\n`` its own token), where
pad == eos == ``<|im_end|>`` as in SmolLM2.
"""

from __future__ import annotations

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
    with pytest.raises(ValueError, match=r"unknown data.format 'pairs'; valid: preference, unpaired, sft, prompt"):
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
    batch = next(prepared.iterator(process_index=0, process_count=1))
    np.testing.assert_array_equal(batch["label"], [1, 0])
    np.testing.assert_array_equal(batch["tokens"], [tiny.ids("hi", "yes", E, E, E, E), tiny.ids("what", "is", "no", "now", E, E)])
    # prompt i + completion of row i+1: "hi no now <eos>", "what is yes <eos>"
    np.testing.assert_array_equal(batch["kl_tokens"], [tiny.ids("hi", "no", "now", E, E, E), tiny.ids("what", "is", "yes", E, E, E)])
    np.testing.assert_array_equal(batch["kl_response_mask"], [[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0]])
    np.testing.assert_array_equal(batch["kl_attention_mask"], [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 0, 0]])
    assert "_kl_parts" not in batch


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
