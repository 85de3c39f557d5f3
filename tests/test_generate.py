"""``alignax generate``: completions of a model or a run's checkpoint for a prompt file."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx

from alignax import cli
from alignax.data import write_jsonl
from alignax.models.registry import load
from alignax.sampling import SamplingConfig, generate, left_pad
from tests.support.trainer_helpers import sft_conversations, tiny_config

PROMPTS = [{"prompt": "what is the cat"}, {"prompt": "the dog ran"}, {"prompt": "yes no"}]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("generate") / "prompts.jsonl"
    write_jsonl(PROMPTS, path)
    return str(path)


def _lines(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_greedy_completions_of_a_model_folder_are_the_samplers_own(toy_model, prompt_file, tmp_path, capsys):
    out = tmp_path / "out.jsonl"
    assert cli.main(["generate", toy_model, prompt_file, "--out", str(out), "--greedy", "--max-new-tokens", "6",
                     "--batch-size", "2"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    lines = _lines(out)
    assert [(r["record"], r["sample"], r["prompt"]) for r in lines] == [(i, 0, p["prompt"]) for i, p in
                                                                        enumerate(PROMPTS)]
    # independently: the chat-templated prompt, one greedy generate call, decoded
    model, tokenizer = load(toy_model)
    for record, line in zip(PROMPTS, lines):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": record["prompt"]}],
                                            add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5: a BatchEncoding
        tokens, mask = left_pad([ids], pad_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        graphdef, state = nnx.split(model)
        config = SamplingConfig(max_new_tokens=6, greedy=True, stop_token_ids=(tokenizer.eos_token_id,),
                                pad_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
        o = jax.device_get(generate(graphdef, state, tokens, mask, jax.random.key(0), config=config))
        want = tokenizer.decode(o.tokens[0][o.response_mask[0] > 0].tolist(), skip_special_tokens=True)
        assert line["completion"] == want and line["tokens"] == int(o.lengths[0])
        assert line["finish"] == ("stop" if o.stopped[0] else "length")


def test_sampling_writes_g_samples_a_prompt_the_same_for_the_same_seed(toy_model, prompt_file, tmp_path):
    def run(seed, name):
        out = tmp_path / name
        assert cli.main(["generate", toy_model, prompt_file, "--out", str(out), "--num-samples", "3",
                         "--temperature", "1.5", "--max-new-tokens", "8", "--seed", str(seed)]) == 0
        return _lines(out)

    first, again, other = run(0, "a.jsonl"), run(0, "b.jsonl"), run(1, "c.jsonl")
    assert [(r["record"], r["sample"]) for r in first] == [(i, g) for i in range(3) for g in range(3)]
    assert first == again
    assert [r["completion"] for r in first] != [r["completion"] for r in other]
    assert all(1 <= r["tokens"] <= 8 and r["finish"] in ("stop", "length") for r in first)
    assert len({r["completion"] for r in first}) > 3  # samples of one prompt differ


def test_a_recipe_generates_from_its_checkpoint_as_its_export_does(toy_model, prompt_file, tmp_path):
    from alignax.trainers.api import export, train

    config = tiny_config(tmp_path / "run", "sft", model_dir=toy_model, steps=2, optim={"learning_rate": 5e-2},
                         train={"save_every": 2})
    train(config, records=sft_conversations(32))
    recipe = tmp_path / "recipe.yaml"
    with open(os.path.join(config.output_dir, "config.yaml")) as f:
        recipe.write_text(f.read())
    exported = export(config)
    flags = ["--greedy", "--max-new-tokens", "6"]
    assert cli.main(["generate", str(recipe), prompt_file, "--out", str(tmp_path / "ckpt.jsonl"), *flags]) == 0
    assert cli.main(["generate", exported, prompt_file, "--out", str(tmp_path / "export.jsonl"), *flags]) == 0
    assert cli.main(["generate", toy_model, prompt_file, "--out", str(tmp_path / "base.jsonl"), *flags]) == 0
    from_checkpoint, from_export = _lines(tmp_path / "ckpt.jsonl"), _lines(tmp_path / "export.jsonl")
    assert from_checkpoint == from_export
    assert [r["completion"] for r in from_checkpoint] != [r["completion"] for r in _lines(tmp_path / "base.jsonl")]


@pytest.mark.parametrize(("flags", "message"), [
    (["--top-p", "2"], "--top-p 2: expected a value in (0, 1]"),
    (["--num-samples", "0"], "--num-samples 0: expected a positive integer"),
    (["--temperature", "0"], "--temperature 0: expected > 0 (or --greedy)"),
    (["optim.learning_rate=1"], "dotted overrides (optim.learning_rate=1) configure a recipe"),
    (["--max-new-tokens", "256"], "--max-new-tokens 256 leaves no room for a prompt in the model's context of 256"),
    (["--max-prompt-length", "300"], "--max-prompt-length 300 + --max-new-tokens 256 exceed the model's context"),
])
def test_bad_flags_are_one_line_and_exit_2(toy_model, prompt_file, flags, message, capsys):
    assert cli.main(["generate", toy_model, prompt_file, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_missing_prompt_file_is_one_line_naming_it(toy_model, tmp_path, capsys):
    missing = str(tmp_path / "nope.jsonl")
    assert cli.main(["generate", toy_model, missing, "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and missing in err[0], err


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--num-samples", "--greedy", "--temperature", "--top-p", "--max-new-tokens", "--step", "--out"):
        assert flag in text


def test_a_recipes_prompts_are_encoded_as_its_training_data(toy_model, prompt_file):
    """generate and best-of-n read a recipe's prompt file with its data settings: its system
    prompt reaches the prompt tokens (a fresh prompt set would drop it)."""
    from alignax.data import DataConfig
    from alignax.generate import GenerateOptions, prompt_rows

    tokenizer = load(toy_model)[1]
    options = GenerateOptions(max_new_tokens=4, batch_size=4)
    plain = next(prompt_rows(prompt_file, tokenizer, options, 64))
    system = next(prompt_rows(prompt_file, tokenizer, options, 64, DataConfig(system_prompt="yes no yes",
                                                                             packing=True, format="sft")))
    lengths = lambda b: b["prompt_attention_mask"].sum(axis=1)  # noqa: E731
    assert (lengths(system) > lengths(plain)).all()  # the system turn is there; packing off for a prompt set
