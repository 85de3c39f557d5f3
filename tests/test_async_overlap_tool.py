"""tools/studies/async_overlap.py's recipe selection (``--model``): each recipe's defaults and the
configuration its runs train with. Nothing here trains (the SmolLM2 study takes an hour)."""

from __future__ import annotations

import json

import pytest

from tests.support.tools import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("studies/async_overlap.py")


def test_each_recipe_has_its_own_defaults_and_settings(tool):
    tiny = tool.parse_args([])
    assert (tiny.model, tiny.devices, tiny.layouts, tiny.latency) == ("tiny", 8, ("sliced", "split"), 0.2)
    assert tool.settings_of(tiny) == list(tool.SETTINGS)
    smol = tool.parse_args(["--model", "smollm2"])
    assert (smol.devices, smol.layouts, smol.latency) == (1, ("sliced",), 0.0)
    assert tool.settings_of(smol) == [("sliced", 0), ("sliced", 1), ("sliced", 2)]
    assert tool.parse_args(["--model", "smollm2", "--devices", "8", "--layouts", "sliced", "split"]).devices == 8
    for bad in (["--layouts", "sliced", "split"],  # a split needs a sampler's half
                ["--devices", "8", "--layouts", "split"],  # no synchronous baseline to compare with
                ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            tool.parse_args(["--model", "smollm2", *bad])


def test_smollm2_runs_the_demo_grpo_recipe_from_the_base_model(tool, tmp_path):
    config = tool.config_for(2, 5, 1, False, str(tmp_path), model="smollm2")
    assert (config.model.name, config.model.random_init) == ("smollm2-135m-instruct", None)  # the real weights
    assert (config.data.batch_size, config.rollout.num_samples, config.rollout.max_new_tokens) == (4, 6, 24)
    assert config.data.paths == (tool.DEMO_PROMPTS,)
    assert (config.rewards.verifier_weight, config.rewards.format_weight) == (1.0, 0.2)
    assert not config.rewards.functions
    assert (config.rollout.async_.max_staleness, config.rollout.old_logps, config.train.total_steps) == (2, "sampler", 5)
    tiny = tool.config_for(1, 5, 8, True, str(tmp_path), layout="split")
    assert tiny.model.random_init is not None and tiny.rewards.verifier_weight == 0.0
    assert json.loads(json.dumps(dict(tiny.rewards.functions))) == {"bench_common:even_char_share": 1.0,
                                                                    "async_overlap:slow_zero_reward": 1.0}
    assert (tiny.rollout.async_.devices, tiny.mesh.shape[0]) == (4, 4)
