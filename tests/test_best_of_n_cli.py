"""``alignax best-of-n``: N samples a prompt from a recipe's policy, the best by its rewards."""

from __future__ import annotations

import json

import pytest
import yaml

from alignax import cli
from alignax import config as config_io
from alignax.data import write_jsonl
from tests.support.rl_toy import toy_config, toy_prompts, yes_share


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, toy_model):
    base = tmp_path_factory.mktemp("best-of-n")
    config = toy_config(base / "run", toy_model, "grpo", steps=1, rollout={"temperature": 1.0})
    path = base / "recipe.yaml"
    path.write_text(yaml.safe_dump(config_io.to_dict(config)))
    prompts = base / "prompts.jsonl"
    write_jsonl(toy_prompts(6, seed=5), prompts)
    return str(path), str(prompts)


def _run(recipe, n, out, capsys, *extra):
    path, prompts = recipe
    assert cli.main(["best-of-n", path, prompts, "--out", str(out), "--n", str(n), *extra]) == 0
    figures = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with open(out, encoding="utf-8") as f:
        return figures, [json.loads(line) for line in f]


def test_the_kept_completion_is_the_best_scored_of_n(recipe, tmp_path, capsys):
    figures, lines = _run(recipe, 4, tmp_path / "best.jsonl", capsys)
    assert figures["prompts"] == len(lines) == 6 and [line["record"] for line in lines] == list(range(6))
    for line in lines:
        assert len(line["rewards"]) == 4 and line["reward"] == max(line["rewards"])
        # the recipe's reward function, recomputed on the kept text, is the reward written
        assert line["reward"] == pytest.approx(yes_share([line["completion"]], [None])[0])
    assert figures["mean_best_reward"] >= figures["mean_sample_reward"]
    assert figures["mean_best_reward"] > figures["mean_sample_reward"]  # some prompt's samples differ


def test_one_sample_is_its_own_best_and_the_seed_repeats(recipe, tmp_path, capsys):
    figures, lines = _run(recipe, 1, tmp_path / "one.jsonl", capsys)
    assert all(line["rewards"] == [line["reward"]] for line in lines)
    assert figures["mean_best_reward"] == pytest.approx(figures["mean_sample_reward"])
    _, again = _run(recipe, 4, tmp_path / "a.jsonl", capsys)
    _, same = _run(recipe, 4, tmp_path / "b.jsonl", capsys)
    assert again == same


def test_no_checkpoint_and_bad_n_are_one_line(recipe, tmp_path, capsys):
    path, prompts = recipe
    assert cli.main(["best-of-n", path, prompts, "--out", str(tmp_path / "x.jsonl"), "--n", "0"]) == 2
    assert "--n 0: expected a positive number" in capsys.readouterr().err
    assert cli.main(["best-of-n", path, prompts, "--out", str(tmp_path / "x.jsonl"), "--checkpoint"]) == 2
    assert "no checkpoint under" in capsys.readouterr().err
