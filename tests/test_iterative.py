"""Iterative DPO (alignax.trainers.iterative) on the toy task: two rounds of pairs sampled
from the current policy and labelled by the reward raise the held-out reward and accuracy;
a round stopped half way resumes to the same weights as the uninterrupted run."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest

from alignax.models import read_safetensors
from alignax import config as config_io
from alignax.trainers.api import evaluate, export, load_config, train
from alignax.trainers.engine import rundir
from alignax.trainers.iterative import IterativeTrainer, round_config, round_done
from tests.support.rl_toy import toy_prompts
from tests.support.trainer_helpers import CONFIGS

# The tests share module fixtures (built once per worker): keep them on one xdist worker.
pytestmark = pytest.mark.xdist_group("iterative")

SECTIONS = dict(
    rollout={"max_new_tokens": 6, "num_samples": 4, "temperature": 1.0},
    rewards={"verifier_weight": 0.0, "format_weight": 0.0, "functions": {"tests.support.rl_toy:yes_share": 1.0}},
    evaluation={"max_prompts": None, "success_threshold": 0.5},
    data={"batch_size": 8, "eval_fraction": 0.25},
    preference={"beta": 0.5},
    optim={"learning_rate": 1e-2},
    train={"save_every": 2},
)


def config_for(path, toy_model, rounds=2, steps=4):
    """configs/tiny-iterative-dpo.yaml on the toy model, labelled by the "yes"-share reward
    instead of the recipe's judge."""
    raw = config_io.load_yaml(os.path.join(CONFIGS, "tiny-iterative-dpo.yaml"))
    raw["rewards"] = SECTIONS["rewards"]
    raw["model"] = {"name": str(toy_model)}
    raw["data"]["max_prompt_length"] = 24
    raw["iterative"]["rounds"] = rounds
    raw.update({k: {**raw.get(k, {}), **v} for k, v in SECTIONS.items() if k != "rewards"})
    raw.update(output_dir=str(path), logging={"console": False, "tensorboard": False})
    raw["train"].update(total_steps=steps)
    raw["data"]["read_threads"] = 0
    return load_config(data=raw)


@pytest.fixture(scope="module")
def full(tmp_path_factory, toy_model):
    path = tmp_path_factory.mktemp("iterative-full")
    train(config_for(path, toy_model), records=toy_prompts(32))
    with open(os.path.join(path, "rounds.json")) as f:
        return path, {int(k): v for k, v in json.load(f).items()}


def test_two_rounds_raise_held_out_reward_and_accuracy(full):
    path, rounds = full
    start, first, second = rounds[-1], rounds[0], rounds[1]
    assert second["eval/reward"] >= first["eval/reward"] > start["eval/reward"]
    assert second["eval/accuracy"] > start["eval/accuracy"] + 0.2
    assert first["pairs"] > 0 and second["sample_reward"] > first["sample_reward"]  # round 1 samples the better policy
    with open(os.path.join(path, "round_1", "pairs.jsonl")) as f:
        pair = json.loads(f.readline())
    assert pair["chosen_reward"] > pair["rejected_reward"]


def test_a_round_stopped_half_way_resumes_to_the_same_weights(full, tmp_path, toy_model):
    path, _ = full
    records = toy_prompts(32)
    config = config_for(tmp_path, toy_model)
    shutil.copytree(os.path.join(path, "round_0"), os.path.join(tmp_path, "round_0"))  # round 0 done
    round1, _ = IterativeTrainer(config, records=records).prepare_round(1)  # pairs from round 0's policy
    with open(round1.data.paths[0]) as ours, open(os.path.join(path, "round_1", "pairs.jsonl")) as theirs:
        assert ours.read() == theirs.read()
    train(dataclasses.replace(round1, train=dataclasses.replace(round1.train, total_steps=2)))  # stopped at step 2
    assert not round_done(config, 1)
    train(config, records=records)  # round 1 resumes at step 2
    ours = read_safetensors(os.path.join(tmp_path, "round_1", "export", "model.safetensors"))
    theirs = read_safetensors(os.path.join(path, "round_1", "export", "model.safetensors"))
    assert ours.keys() == theirs.keys()
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)


def test_the_run_directory_holds_one_configs_rounds(tmp_path, toy_model):
    """Rounds done under one config are not reused by another without --allow-changes, and
    --overwrite removes them (no training here: the claim is checked before any round)."""
    first = config_for(tmp_path, toy_model)
    trainer = IterativeTrainer(first, records=toy_prompts(8))
    with rundir.claim(first) as run:
        trainer._claim(run)  # writes config.yaml
    os.makedirs(tmp_path / "round_0" / "checkpoints")
    changed = dataclasses.replace(first, preference=dataclasses.replace(first.preference, beta=0.25))
    with pytest.raises(rundir.RunDirectoryError, match=r"holds rounds \(round_0\).*preference.beta: 0.5 -> 0.25"):
        IterativeTrainer(changed, records=toy_prompts(8)).train()
    allowed = dataclasses.replace(changed, checkpoint=dataclasses.replace(changed.checkpoint, allow_changes=True))
    with rundir.claim(allowed) as run:
        IterativeTrainer(allowed, records=toy_prompts(8))._claim(run)
    assert (tmp_path / "round_0").exists()
    fresh = dataclasses.replace(changed, checkpoint=dataclasses.replace(changed.checkpoint, overwrite=True))
    with rundir.claim(fresh) as run:
        IterativeTrainer(fresh, records=toy_prompts(8))._claim(run)
    assert not (tmp_path / "round_0").exists()
    assert round_config(fresh, 0).checkpoint.overwrite is False  # a round never removes its own resume point


def test_export_and_eval_read_the_last_finished_round(full, tmp_path, toy_model):
    path, rounds = full
    config = config_for(path, toy_model)
    destination = export(config, str(tmp_path / "out"))
    ours = read_safetensors(os.path.join(destination, "model.safetensors"))
    theirs = read_safetensors(os.path.join(path, "round_1", "export", "model.safetensors"))
    assert all(np.array_equal(ours[name], theirs[name]) for name in theirs)
    figures = evaluate(config, records=toy_prompts(32))
    assert figures["reward"] == rounds[1]["eval/reward"] and figures["accuracy"] == rounds[1]["eval/accuracy"]
    with pytest.raises(FileNotFoundError, match=r"round 5 of iterative DPO has not finished \(finished: \[0, 1\]\)"):
        export(config, str(tmp_path / "five"), step=5)
    with pytest.raises(FileNotFoundError, match="no round of iterative DPO has finished"):
        export(config_for(tmp_path / "empty", toy_model))
