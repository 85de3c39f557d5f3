"""The config schema against the algorithms (alignax/trainers/validation.py).

- The key table covers every key of the schema, and names only keys that exist.
- The sweep: for each algorithm's tiny recipe (configs/tiny-*.yaml; KTO and PPO-ptx and
  generation-based evaluation of an offline run included), every key of the schema is set
  to a valid non-default value in turn; validation either refuses it with a message naming
  the key, or the key is read when that recipe runs. "Read" is measured once per recipe:
  one instrumented step (with eval) records every attribute read of the config's sections.
- One test per rule, with its message; every recipe in configs/ validates.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import glob
import os
import re
import sys
import types
import typing

import pytest
import yaml

from alignax import config as config_io
from alignax.config import ConfigError
from alignax.estimators import ESTIMATORS
from alignax.data.formats import FORMATS
from alignax.losses.objectives import OBJECTIVES
from alignax.losses.preference import DPO_VARIANTS
from alignax.trainers import algorithms, validation
from alignax.trainers.config import TrainConfig
from alignax.trainers.api import load_config
from tests.support.trainer_helpers import CONFIGS
from tests.support.trainer_helpers import merge_sections as _merge  # the one deep merge of recipes

SCHEMA = list(validation.schema_keys())

# ---------------------------------------------------------------------------- the recipes swept
# A base: configs/tiny-<recipe>.yaml with these sections merged over it.
GENERATOR = "reasoning_gym:chain_sum?size=16&seed=3"
EVAL_PROMPTS = {"paths": [GENERATOR], "format": "prompt", "max_prompt_length": 96, "batch_size": 4}
# held out: reasoning-gym's record i of seed s is record 0 of seed s + i, so a seed past the recipes' sizes
GOLD_PROMPTS = {"paths": ["reasoning_gym:chain_sum?size=8&seed=1000"], "format": "prompt", "max_prompt_length": 96,
                "batch_size": 4}
PTX_DATA = {"paths": [GENERATOR], "format": "sft", "max_length": 128, "max_prompt_length": 96, "batch_size": 4}
BASES = {
    # an offline policy evaluated by generation on a prompt set: rewards and rollout's budget are read
    "sft": ("sft", {"evaluation": {"prompts": EVAL_PROMPTS, "max_prompts": 4}, "rollout": {"max_new_tokens": 8}}),
    "reward": ("reward", {}),
    "prm": ("prm", {}),
    "dpo": ("dpo", {}),
    "dpo-lora": ("dpo-lora", {}),
    "kto": ("kto", {}),
    "grpo": ("grpo", {"evaluation": {"max_prompts": 4}}),
    # the monitor's gold signal (alignax.trainers.online.guard), scored by a function the
    # training reward (verifier and format) does not weigh: a gold scorer it shares is refused
    "grpo-gold": ("grpo", {"evaluation": {"max_prompts": 4}, "monitor": {"gold": {
        "prompts": GOLD_PROMPTS, "every": 1, "max_prompts": 4,
        "rewards": {"verifier_weight": 0.0, "functions": {"tests.support.rl_toy:yes_share": 1.0}}}}}),
    "grpo-calculator": ("grpo-calculator", {"evaluation": {"max_prompts": 4}}),
    "ppo": ("ppo", {"ppo": {"ptx_coef": 0.1, "ptx_data": PTX_DATA}, "evaluation": {"max_prompts": 4}}),
    "distill": ("distill", {}),
    "gkd": ("gkd", {}),
    "onpolicy-distill": ("onpolicy-distill", {}),
}
# A section the sweep sets from nothing (its keys under a base without it) starts valid.
SECTION_SEEDS = {"ppo.ptx_data": PTX_DATA, "distill.teacher": {"name": "smollm2-135m-instruct"}, "evaluation.prompts": EVAL_PROMPTS, "lora": {"rank": 2},
                 "monitor.gold.prompts": GOLD_PROMPTS}
# Keys read on a path one tiny step cannot reach, and where that path is tested.
READ_ELSEWHERE = {
    "data.on_bad_record": "read when a record is bad (tests/test_data.py)",
    "ppo.ptx_data.on_bad_record": "read when a record is bad (tests/test_data.py)",
    "evaluation.prompts.on_bad_record": "read when a record is bad (tests/test_data.py)",
    **{f"distributed.{key}": "read when a process joins a multi-process job (tests/test_multihost.py)"
       for key in ("coordinator", "num_processes", "process_id", "local_device_ids", "cpu_collectives",
                   "initialization_timeout_s", "shutdown_timeout_s")},
    "distributed.require_accelerator": "read at alignax train's start-up (tests/test_hardware.py)",
    "checkpoint.allow_changes": "read when a run resumes with a changed config (tests/test_run_directory.py)",
    "checkpoint.resume_step": "read when a run resumes (tests/test_run_directory.py, tests/test_cli.py)",
    **{f"logging.{tracker}{key}": "read when the run's writers start (tests/test_trackers.py)"
       for tracker, keys in (("wandb", ("", ".project", ".entity", ".name", ".mode", ".tags")),
                             ("mlflow", ("", ".tracking_uri", ".experiment", ".run_name"))) for key in keys},
    "monitor.gold.prompts.on_bad_record": "read when a record is bad (tests/test_data.py)",
    **{f"monitor.gold_divergence.{key}": "read from the second gold point on (tests/test_monitor_guard.py)"
       for key in ("window", "min_gold_drop", "min_proxy_rise")},
    **{f"preference.sync_ref.{key}": "read when preference.sync_ref is set (tests/test_preference_trainer.py)"
       for key in ("alpha", "tau")},
}


# Keys a recipe sets that its algorithm cannot use, dropped until the recipe drops them.
RECIPE_FIXES = {"reward": [("model", "logprob_chunk_size")]}


def base_raw(name: str) -> dict:
    recipe, extra = BASES[name]
    raw = config_io.load_yaml(os.path.join(CONFIGS, f"tiny-{recipe}.yaml"))
    for section, key in RECIPE_FIXES.get(recipe, ()):
        raw.get(section, {}).pop(key, None)
    return _merge(raw, copy.deepcopy(extra))


# ---------------------------------------------------------------------------- recording reads
def _config_classes() -> list[type]:
    found: list[type] = []

    def walk(cls):
        if cls in found:
            return
        found.append(cls)
        for tp in config_io.type_hints(cls).values():
            for arg in (tp, *typing.get_args(tp)):
                if dataclasses.is_dataclass(arg):
                    walk(arg)

    walk(TrainConfig)
    return found


# Reads that are not uses: dataclass machinery, serialisation, the configs' own checks, and
# validation (here, and the preference task's own check of its section).
_NOT_USES = {"__post_init__", "to_dict", "_jsonable", "asdict", "astuple", "replace", "unusable_keys",
             "check_section"}
_COMPREHENSIONS = {"<dictcomp>", "<listcomp>", "<setcomp>", "<genexpr>"}


class ReadRecorder:
    """While active, records the dotted key of every attribute read of ``config``'s
    sections (and of sections ``dataclasses.replace`` derives from them) made by run code."""

    def __init__(self, config: TrainConfig):
        self.paths: dict[int, tuple[object, str]] = {}
        self.reads: set[str] = set()
        self._register(config, "")

    def _register(self, obj, prefix: str) -> None:
        self.paths[id(obj)] = (obj, prefix)
        for field in dataclasses.fields(obj):
            value = object.__getattribute__(obj, field.name)
            if dataclasses.is_dataclass(value):
                self._register(value, f"{prefix}{config_io.key_name(field.name)}.")

    def _record(self, obj, name: str) -> None:
        entry = self.paths.get(id(obj))
        if entry is None or entry[0] is not obj:
            return
        frame = sys._getframe(2)
        while frame.f_code.co_name in _COMPREHENSIONS:
            frame = frame.f_back
        code = frame.f_code
        if code.co_name in _NOT_USES or code.co_filename in ("<string>", dataclasses.__file__, validation.__file__, config_io.__file__,
                                                                      algorithms.__file__):
            return
        self.reads.add(entry[1] + config_io.key_name(name))

    @contextlib.contextmanager
    def active(self):
        recorder, saved = self, {}
        for cls in _config_classes():
            names = frozenset(f.name for f in dataclasses.fields(cls))
            saved[cls] = cls.__dict__.get("__getattribute__")

            def getattribute(obj, name, _names=names):
                if name in _names:
                    recorder._record(obj, name)
                return object.__getattribute__(obj, name)

            cls.__getattribute__ = getattribute
        replace = dataclasses.replace

        def recording_replace(obj, /, **changes):
            new = replace(obj, **changes)
            entry = recorder.paths.get(id(obj))
            if entry is not None and entry[0] is obj:
                recorder._register(new, entry[1])
            return new

        dataclasses.replace = recording_replace
        try:
            yield self
        finally:
            dataclasses.replace = replace
            for cls, original in saved.items():
                if original is None:
                    del cls.__getattribute__
                else:
                    cls.__getattribute__ = original


_READS: dict[str, set[str]] = {}


@pytest.fixture(scope="module")
def reads(tmp_path_factory):
    """``reads(base)``: the keys one instrumented step (and its evaluations) of that base reads."""
    from alignax.trainers import api

    def run(name: str) -> set[str]:
        if name not in _READS:
            # one step; no TensorBoard writer (its import is most of a tiny run's time; the
            # logging.tensorboard key is read either way)
            raw = _merge(base_raw(name), {"output_dir": str(tmp_path_factory.mktemp(f"schema-{name}")),
                                          "train": {"total_steps": 1}, "logging": {"tensorboard": False}})
            config = load_config(data=raw)
            recorder = ReadRecorder(config)
            with recorder.active():
                api.train(config)
            _READS[name] = recorder.reads
        return _READS[name]

    return run


# ---------------------------------------------------------------------------- the sweep
def _field(key: str) -> tuple[type, dataclasses.Field]:
    cls, parts = TrainConfig, key.split(".")
    for part in parts[:-1]:
        tp = config_io.type_hints(cls)[config_io.field_name(part)]
        cls = tp if dataclasses.is_dataclass(tp) else next(
            a for a in typing.get_args(tp) if dataclasses.is_dataclass(a))
    name = config_io.field_name(parts[-1])
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    return config_io.type_hints(cls)[name], field


SWEEP_VALUES = {
    "algorithm": ["sft", "reward", "prm", "dpo", "iterative_dpo", "grpo", "ppo"],
    "output_dir": ["runs/elsewhere"],
    "model.name": ["runs/some-model"],
    "model.random_init": [{"num_hidden_layers": 1}],
    "model.remat": ["full", "dots_with_no_batch_dims_saveable", "offload_dots"],
    "mesh.shape": [[1, 1, 1]],
    "mesh.dcn_shape": [[1, 1, 1]],  # one process: one slice
    "rollout.mesh": [[1, 1, 1]],  # one device here: the sampler on its own (1, 1, 1) mesh
    "placement.submesh": [[1, 1, 1]],  # refused alone: no model is placed on it
    "logging.console_keys": [["loss"]],
    "preference.variant": list(DPO_VARIANTS),
    "preference.loss_weights": [[1.0]],  # one weight: refused unless preference.variant is a list
    "preference.sync_ref": [{"alpha": 0.5, "tau": 2}],
    "grpo.step_delimiter": ["\n\n"],
    "grpo.policy_loss": [name for name in OBJECTIVES if name != "ppo"],
    # a name, or several k1 criteria with their own bounds (verl's "token_k1,seq_mean_k1")
    "rollout.rejection": ["token", "sequence", "geometric", {"token": [0.5, 2.0], "geometric": [0.9, 1.1]}],
    "rollout.rejection_bounds": [[0.8, 1.25]],
    "rollout.tis_lower": [0.5],  # refused alone: IcePop's upper bound is rollout.tis_cap
    "rollout.rejection_divergences": [{"seq_max_k2": 2.5, "token_k3": 0.1}],
    "grpo.process_reward": ["alignax.rewards.process:well_formed_steps"],
    "ppo.critic_path": ["runs/reward-model"],
    "rollout.stop_token_ids": [[2]],
    "grpo.advantage": [name for name in ESTIMATORS if name != "grpo"],  # a name of the estimator registry
    "rewards.answer_tag": ["final"],
    "rewards.task": ["chain_sum"],
    "distributed.coordinator": ["10.0.0.1:1234"],
    "distributed.local_device_ids": [[0, 1]],
    "distributed.cpu_collectives": ["mpi"],
    "rewards.functions": [{"tests.support.rl_toy:yes_share": 1.0}],
    "rewards.reward_models": [["runs/reward-model"]],
    "rewards.clip": [[-1.0, 1.0]],
    "evaluation.pass_k": [[1, 2]],
    "ppo.ptx_data": [PTX_DATA],
    "distill.teacher": [{"name": "smollm2-135m-instruct", "random_init": {"num_hidden_layers": 1}}],
    "distill.teacher.name": ["runs/some-model"],
    "distill.teacher.remat": ["full"],
    "distill.teacher.random_init": [{"num_hidden_layers": 1}],
    "evaluation.prompts": [EVAL_PROMPTS],
    "evaluation.prompts.format": ["prompt"],  # the only format of a prompt set
    "monitor.gold.prompts": [GOLD_PROMPTS],
    "monitor.gold.prompts.format": ["prompt"],
    "precision.master_dtype": [None],  # its one other value: no master copy
    "evaluation.best_of_n.reward_models": [["runs/reward-model"]],
    "evaluation.best_of_n.prm": ["runs/prm"],
    "evaluation.best_of_n.prm_aggregation": [["min"]],
    "evaluation.best_of_n.step_delimiter": [" ; "],
    "rewards.judge_model": ["runs/judge"],
    "rewards.prm": ["runs/prm"],
    "rewards.step_delimiter": [" ; "],
    "rewards.judge_rubric": ["{prompt} {completion} ok?"],
    "rewards.judge_verdicts": [["ok", "no"]],
    "grpo.process_reward_model": ["runs/prm"],
    "lora": [{"rank": 2}],
    "lora.targets": [["q", "v"]],
    "env.name": ["calculator"],
    "env.kwargs": [{"max_digits": 50}],
    "logging.wandb": [{"mode": "offline"}],
    "logging.wandb.project": ["elsewhere"],
    "logging.wandb.entity": ["a-team"],
    "logging.wandb.name": ["a-run"],
    "logging.wandb.tags": [["a", "b"]],
    "logging.mlflow": [{"experiment": "elsewhere"}],
    "logging.mlflow.tracking_uri": ["file:///tmp/mlruns"],
    "logging.mlflow.experiment": ["elsewhere"],
    "logging.mlflow.run_name": ["a-run"],
}
DATA_VALUES = {
    "paths": [["tests/data/some.jsonl"]],
    "format": list(FORMATS),
    "split": ["test"],
    "field_map": [{"prompt": "question"}],
    "system_prompt": ["Answer briefly."],
    "truncation": ["truncate_response", "reject"],
    "on_bad_record": ["skip"],
    "on_duplicate": ["skip", "error"],
    "max_length": [100],
    "max_prompt_length": [64],
    "max_response_length": [16],
    "step_delimiter": [" ; "],
}


def sweep_values(key: str, current):
    """Valid values for ``key`` other than its default (its current value when already set)."""
    if key in SWEEP_VALUES:
        return SWEEP_VALUES[key]
    if key.startswith("monitor.gold.rewards.") and key.removeprefix("monitor.gold.") in SWEEP_VALUES:
        return SWEEP_VALUES[key.removeprefix("monitor.gold.")]  # the gold scorer is a reward config
    leaf = key.rpartition(".")[2]
    if key.rpartition(".")[0] in ("data", "ppo.ptx_data", "evaluation.prompts", "monitor.gold.prompts") \
            and leaf in DATA_VALUES:
        return DATA_VALUES[leaf]
    tp, field = _field(key)
    default = config_io.field_default(None, field)
    if current is not None and current != default:
        return [current]
    optional = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(optional) == 1:
        tp = optional[0]
    if typing.get_origin(tp) is typing.Literal:
        return [v for v in typing.get_args(tp) if v != default]
    if tp is bool:
        return [not default]
    if tp is int:
        return [2 if default is None else default + 1]
    if tp is float:
        return [0.5 if default in (None, 0.0) else default * 0.5]
    raise AssertionError(f"no sweep value for {key} ({tp}); add one to SWEEP_VALUES")


def with_key(raw: dict, key: str, value) -> dict:
    """``raw`` with ``key`` set to ``value`` (an optional section on the way is seeded)."""
    out = copy.deepcopy(raw)
    node, parts = out, key.split(".")
    for i, part in enumerate(parts[:-1]):
        prefix = ".".join(parts[: i + 1])
        if not isinstance(node.get(part), dict):
            node[part] = copy.deepcopy(SECTION_SEEDS.get(prefix, {}))
        node = node[part]
    node[parts[-1]] = copy.deepcopy(value)
    return out


def names_key(message: str, key: str) -> bool:
    """Whether ``message`` names ``key`` (or a section holding it) as a whole dotted key."""
    parts = key.split(".")
    # a top-level section's name alone is too common a word, unless it is an optional section
    # (``lora``) refused as a whole
    first = 1 if len(parts) > 1 and parts[0] not in SECTION_SEEDS else 0
    candidates = [".".join(parts[: i + 1]) for i in range(len(parts))][first:]
    return any(re.search(rf"(?<![\w.]){re.escape(k)}(?![\w])", message) for k in candidates)


def current_value(config: TrainConfig, key: str):
    value = config_io.get(config, key)
    return None if value is config_io.MISSING else value


def sweep(name: str, read: set[str]) -> list[str]:
    """The sweep of one base: the list of failures, in words (empty when all is well)."""
    raw = base_raw(name)
    base = config_io.from_dict(TrainConfig, raw)
    assert validation.problems(base) == [], f"base {name}: {validation.problems(base)}"
    failures = []
    for key in SCHEMA:
        for value in sweep_values(key, current_value(base, key)):
            try:
                config = config_io.from_dict(TrainConfig, with_key(raw, key, value))
            except (ConfigError, ValueError) as err:
                failures.append(f"{key}={value!r}: not a valid sweep value ({err}); fix SWEEP_VALUES")
                continue
            found = validation.problems(config)
            if found:
                if not any(names_key(p, key) for p in found):
                    failures.append(f"{key}={value!r}: refused without naming the key: {found}")
            elif key not in read and key not in READ_ELSEWHERE and not _set_as_default(config, key) \
                    and not _under_absent_section(base, key):
                failures.append(f"{key}={value!r}: accepted for {name} but never read by its run (a dead key: "
                                "wire it, or add its condition to validation.KEY_RULES)")
    return failures


def _under_absent_section(base: TrainConfig, key: str) -> bool:
    """A key under an optional section the base lacks: the base's run reads no key of it;
    the base that has the section checks them (test_every_optional_section_is_swept)."""
    return any(key.startswith(section + ".") and current_value(base, section) is None for section in SECTION_SEEDS)


def test_every_optional_section_is_swept():
    for section in SECTION_SEEDS:
        with_section = [name for name in BASES
                        if current_value(config_io.from_dict(TrainConfig, base_raw(name)), section) is not None]
        assert with_section, f"no base sets {section}: its keys are never checked against a run"


def _set_as_default(config: TrainConfig, key: str) -> bool:
    """An optional section's key set to its own default is not set (nothing to read)."""
    return key not in {k for k, _, _ in validation.set_keys(config)}


@pytest.mark.parametrize("name", list(BASES))
def test_every_key_is_refused_or_read(name, reads):
    failures = sweep(name, reads(name))
    assert not failures, f"{len(failures)} keys under base {name}:\n" + "\n".join(failures)


# ---------------------------------------------------------------------------- the table itself
def test_the_key_table_covers_the_whole_schema():
    uncovered = [k for k in SCHEMA if not any(r.covers(k) for r in validation.KEY_RULES)]
    assert not uncovered, f"keys with no row in validation.KEY_RULES: {uncovered}"
    named = {k for r in validation.KEY_RULES for k in r.keys}
    unknown = sorted(k for k in named if not any(s == k or s.startswith(k + ".") for s in SCHEMA))
    assert not unknown, f"validation.KEY_RULES names keys the schema lacks: {unknown}"


def test_set_keys_are_those_that_differ_from_their_defaults():
    config = load_config(data={"algorithm": "dpo", "preference": {"beta": 0.1, "loss": "dpo", "label_smoothing": 0.1}})
    assert [k for k, _, _ in validation.set_keys(config)] == ["algorithm", "preference.label_smoothing"]


def test_every_recipe_validates():
    paths = sorted(glob.glob(os.path.join(CONFIGS, "*.yaml")))
    assert len(paths) >= 15
    bad = {}
    for path in paths:
        found = validation.problems(config_io.from_dict(TrainConfig, config_io.load_yaml(path)))
        if found:
            bad[os.path.basename(path)] = found
    assert not bad, bad


def test_validation_runs_in_load_config_before_any_model_is_read():
    # a model that does not exist: the config error comes first, naming the key
    with pytest.raises(ConfigError, match=r"ppo\.gamma applies to algorithm=ppo only; got algorithm=grpo"):
        load_config(data={"algorithm": "grpo", "model": {"name": "/no/such/model"}, "data": {"format": "prompt"},
                          "ppo": {"gamma": 0.99}})


# ---------------------------------------------------------------------------- one test per rule
def refused(data: dict, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(data=data, overrides=overrides)
    return str(info.value)


GRPO = {"algorithm": "grpo", "data": {"format": "prompt"}}
PPO = {"algorithm": "ppo", "data": {"format": "prompt"}, "rollout": {"num_samples": 1}}
DPO = {"algorithm": "dpo"}
SFT = {"algorithm": "sft", "data": {"format": "sft"}}
REWARD = {"algorithm": "reward"}


def test_sections_of_other_algorithms_are_refused():
    message = refused(GRPO, ["ppo.kl_coef=0.1", "ppo.epochs=2"])
    assert "ppo.kl_coef, ppo.epochs apply to algorithm=ppo only; got algorithm=grpo" in message
    assert "grpo.clip_eps_low applies to algorithm=grpo only; got algorithm=ppo" in refused(
        PPO, ["grpo.clip_eps_low=0.2"])
    assert "preference.beta applies to algorithm=dpo|iterative_dpo only; got algorithm=sft" in refused(SFT, ["preference.beta=0.5"])
    assert "sft.aggregation applies to algorithm=sft only; got algorithm=dpo" in refused(
        DPO, ["sft.aggregation=token-sum"])
    assert "reward_model.center_coef applies to algorithm=reward only; got algorithm=dpo" in refused(
        DPO, ["reward_model.center_coef=0.01"])
    assert "reward_model.use_margin applies to algorithm=reward only; got algorithm=grpo" in refused(
        GRPO, ["reward_model.use_margin=true"])
    # left at their defaults, other sections are fine
    load_config(data={**GRPO, "ppo": {"kl_coef": 0.05}, "preference": {"beta": 0.1}})


def test_rollout_and_rewards_of_offline_runs_need_generation_based_evaluation():
    message = refused(DPO, ["rollout.temperature=0.7", "rewards.format_weight=0.2"])
    assert "rollout.temperature applies to algorithm=iterative_dpo|grpo|ppo|onpolicy_distill only; got algorithm=dpo" in message
    assert "rewards.format_weight applies to online training or generation-based evaluation" in message
    assert "got algorithm=dpo, evaluation.prompts=null" in message
    assert "rollout.max_new_tokens applies to online training or generation-based evaluation" in refused(
        SFT, ["rollout.max_new_tokens=32"])
    assert "evaluation.max_prompts applies to online training or generation-based evaluation" in refused(
        SFT, ["evaluation.max_prompts=8"])
    # with a prompt set to evaluate on, an offline policy's rewards, budget and stop ids are read ...
    prompts = {"evaluation": {"prompts": {"paths": ["p.jsonl"], "format": "prompt"}, "max_prompts": 8}}
    load_config(data={**SFT, **prompts, "rollout": {"max_new_tokens": 32, "stop_token_ids": [2]},
                      "rewards": {"format_weight": 0.2}})
    # ... but not its sampling settings (evaluation has its own), nor the training-only mask
    assert "rollout.top_p applies to algorithm=iterative_dpo|grpo|ppo|onpolicy_distill only" in refused(
        {**SFT, **prompts}, ["rollout.top_p=0.9"])
    assert "rewards.mask_truncated applies to algorithm=grpo|ppo|onpolicy_distill only" in refused(
        {**SFT, **prompts}, ["rewards.mask_truncated=true"])
    # a reward model does not generate
    assert "evaluation.prompts, evaluation.max_prompts apply to online training or generation-based evaluation" \
        in refused({**REWARD, **prompts})


def test_data_format_must_fit_the_algorithm():
    assert "data.format=sft does not fit preference.loss=dpo: it reads data.format=preference" in refused(
        {"algorithm": "dpo", "data": {"format": "sft"}})
    assert "data.format=preference does not fit preference.loss=kto: it reads data.format=unpaired" in refused(
        {"algorithm": "dpo", "preference": {"loss": "kto"}})
    assert "data.format=preference does not fit algorithm grpo: it reads data.format=prompt" in refused(
        {"algorithm": "grpo"})
    assert "data.format=prompt does not fit algorithm reward" in refused(
        {"algorithm": "reward", "data": {"format": "prompt"}})
    assert "does not fit algorithm sft" in refused({"algorithm": "sft"})
    if "text" in FORMATS:
        load_config(data={"algorithm": "sft", "data": {"format": "text"}})


def test_ppo_ptx_needs_both_its_weight_and_its_data():
    ptx = {"paths": ["sft.jsonl"], "format": "sft"}
    assert "ppo.ptx_coef applies to ppo.ptx_data set only; got ppo.ptx_data=null" in refused(
        PPO, ["ppo.ptx_coef=0.1"])
    message = refused({**PPO, "ppo": {"ptx_data": ptx}})
    assert "ppo.ptx_data applies to ppo.ptx_coef > 0 only; got ppo.ptx_coef=0.0" in message
    assert "ppo.ptx_data.paths" not in message  # the section is named once
    assert "ppo.ptx_data.format=preference: PPO-ptx's SFT loss reads ppo.ptx_data.format=sft" in refused(
        {**PPO, "ppo": {"ptx_coef": 0.1, "ptx_data": {"paths": ["p.jsonl"]}}})
    assert "ppo.ptx_data.eval_fraction is read by no run" in refused(
        {**PPO, "ppo": {"ptx_coef": 0.1, "ptx_data": {**ptx, "eval_fraction": 0.1}}})
    load_config(data={**PPO, "ppo": {"ptx_coef": 0.1, "ptx_data": ptx}})


def test_eval_batches_are_offline_only():
    assert "train.eval_batches applies to algorithm=sft|reward|prm|dpo|distill|gkd only; got algorithm=grpo" in refused(
        {**GRPO, "data": {"format": "prompt", "eval_fraction": 0.1}}, ["train.eval_batches=2"])
    load_config(data={**DPO, "data": {"eval_fraction": 0.1}, "train": {"eval_batches": 2}})
    # switching a shared feature off leaves its keys valid (one override turns it off)
    load_config(data={**DPO, "train": {"save_every": 10, "eval_every": 10}, "logging": {"console_keys": ["loss"]}},
                overrides=["checkpoint.enabled=false", "logging.console=false"])


def test_ppo_critic_keys():
    assert "ppo.critic_init applies to ppo.critic=separate only; got ppo.critic=shared" in refused(
        PPO, ["ppo.critic=shared", "ppo.critic_init=reward_model"])
    assert "ppo.critic_path applies to ppo.critic=separate and ppo.critic_init=reward_model only; " \
           "got ppo.critic_init=policy" in refused(PPO, ["ppo.critic_path=runs/rm"])
    assert "ppo.critic_init=reward_model needs ppo.critic_path" in refused(PPO, ["ppo.critic_init=reward_model"])
    load_config(data=PPO, overrides=["ppo.critic_init=reward_model", "ppo.critic_path=runs/rm"])
    load_config(data=PPO, overrides=["ppo.critic=shared", "ppo.critic_learning_rate=1e-4"])


def test_lora_ppo_critic_is_an_adapter_and_merging_is_for_rollouts():
    lora = {"lora": {"rank": 2}}
    assert "ppo.critic=adapter is an adapter and value head on the policy's frozen base: it needs a lora " \
           "section" in refused(PPO, ["ppo.critic=adapter"])
    assert "ppo.critic=separate with a lora section" in refused({**PPO, **lora})
    assert "ppo.critic=shared with a lora section" in refused({**PPO, **lora}, ["ppo.critic=shared"])
    load_config(data={**PPO, **lora}, overrides=["ppo.critic=adapter", "lora.merge_for_sampling=true"])
    assert "lora.merge_for_sampling applies to algorithm=grpo|ppo|onpolicy_distill only; got algorithm=dpo" in refused(
        {**DPO, **lora}, ["lora.merge_for_sampling=true"])


def test_kl_keys_need_the_kl_and_the_adaptive_controller():
    assert "ppo.kl_target applies to ppo.adaptive_kl=true only; got ppo.adaptive_kl=false" in refused(
        PPO, ["ppo.kl_target=3.0"])
    assert "grpo.kl_horizon applies to grpo.adaptive_kl=true only" in refused(GRPO, ["grpo.kl_horizon=100"])
    assert "grpo.kl_kind applies to grpo.kl_coef > 0 only; got grpo.kl_coef=0.0" in refused(
        GRPO, ["grpo.kl_coef=0", "grpo.kl_kind=k1"])
    assert "ppo.adaptive_kl applies to ppo.kl_coef > 0 only" in refused(PPO, ["ppo.kl_coef=0", "ppo.adaptive_kl=true"])
    assert "ppo.target_kl applies to ppo.epochs > 1 only; got ppo.epochs=1" in refused(
        PPO, ["ppo.epochs=1", "ppo.target_kl=0.05"])
    load_config(data=PPO, overrides=["ppo.adaptive_kl=true", "ppo.kl_target=3.0", "ppo.target_kl=0.05"])


def test_grpo_loss_and_advantage_keys():
    assert "grpo.dual_clip_c applies to grpo.policy_loss=ppo only; got grpo.policy_loss=gspo" in refused(
        GRPO, ["grpo.policy_loss=gspo", "grpo.dual_clip_c=3.0"])
    assert "grpo.clip_eps_high applies to grpo.policy_loss=ppo|gspo|cispo|dppo_tv|dppo_kl|clip_cov|geo_mean only; " \
        "got grpo.policy_loss=pg" in refused(
        GRPO, ["grpo.policy_loss=pg", "grpo.clip_eps_high=0.28"])
    assert "grpo.unbiased_std applies to grpo.advantage=grpo|process|grpo_passk|gdpo only; got grpo.advantage=reinforce_pp" in \
        refused(GRPO, ["grpo.advantage=reinforce_pp", "grpo.unbiased_std=false"])
    assert "grpo.reinforce_baseline applies to grpo.advantage=reinforce_pp only; got grpo.advantage=rloo" in \
        refused(GRPO, ["grpo.advantage=rloo", "grpo.reinforce_baseline=true"])
    assert "grpo.max_refills applies to grpo.dynamic_sampling=true only" in refused(GRPO, ["grpo.max_refills=2"])
    assert "grpo.step_delimiter applies to grpo.advantage=process only; got grpo.advantage=grpo" in refused(
        GRPO, ["grpo.step_delimiter=;"])
    assert "grpo.gpg_valid applies to grpo.advantage=gpg only; got grpo.advantage=grpo" in refused(
        GRPO, ["grpo.gpg_valid=varied_group"])
    load_config(data=GRPO, overrides=["grpo.advantage=reinforce_pp", "grpo.reinforce_baseline=true"])
    load_config(data=GRPO, overrides=["grpo.dynamic_sampling=true", "grpo.max_refills=2"])
    load_config(data=GRPO, overrides=["grpo.advantage=gpg", "grpo.gpg_valid=varied_group"])


@pytest.mark.parametrize("loss, key, bad, says", [
    ("sapo", "sapo_temperature_pos", "0", "must lie in (0.0, inf]"),
    ("sapo", "sapo_temperature_neg", "-1", "must lie in (0.0, inf]"),
    ("dro", "dro_beta", "0", "must be > 0"),
    ("ppo", "clip_eps_low", "-0.1", "must be >= 0"),
    ("clip_cov", "clip_cov_ratio", "2", "must be in (0, 1]"),
    ("vespo", "vespo_k_pos", "-1", "must be >= 0"),
])
def test_an_objectives_values_are_checked_at_load(loss, key, bad, says):
    """The loss's own hyper-parameter checks run when the config loads (a traced call, no
    compute), not at the first update after the model has loaded."""
    message = refused(GRPO, [f"grpo.policy_loss={loss}", f"grpo.{key}={bad}"])
    assert f"grpo.policy_loss={loss}: grpo.{key} {says}" in message
    load_config(data=GRPO, overrides=[f"grpo.policy_loss={loss}", f"grpo.{key}=0.5"])


def test_process_supervision_has_no_sequence_reward_for_a_kl():
    process = ["grpo.advantage=process"]
    assert "grpo.kl_placement applies to grpo.kl_coef > 0 and grpo.advantage other than process only; " \
           "got grpo.advantage=process" in refused(GRPO, [*process, "grpo.kl_placement=reward"])
    # the rollouts are still scored (logged rewards, dynamic sampling, evaluation): rewards.* are read
    load_config(data=GRPO, overrides=[*process, "grpo.step_delimiter=;", "rewards.mask_truncated=true",
                                      "rewards.answer_extraction=tag_or_last_number"])


def test_group_sizes_and_minibatches():
    assert "rollout.num_samples=1: grpo.advantage=grpo compares the samples of a prompt" in refused(
        GRPO, ["rollout.num_samples=1"])
    load_config(data=GRPO, overrides=["rollout.num_samples=1", "grpo.advantage=remax"])
    assert "grpo.minibatches=3 does not divide the 64 rollout rows (data.batch_size=8 x rollout.num_samples=8)" in \
        refused(GRPO, ["grpo.minibatches=3"])
    assert "train.grad_accum_steps=3 does not divide the 8 rows of a minibatch" in refused(
        PPO, ["ppo.minibatches=1", "train.grad_accum_steps=3"])
    assert "train.grad_accum_steps=3 does not divide data.batch_size=8 (algorithm dpo)" in refused(
        DPO, ["train.grad_accum_steps=3"])
    assert "rollout.pack_groups=on needs whole groups" in refused(
        GRPO, ["rollout.pack_groups=on", "data.batch_size=3", "grpo.minibatches=2", "rollout.num_samples=2"])
    assert "rollout.pack_groups applies to rollout.num_samples > 1 only" in refused(PPO, ["rollout.pack_groups=on"])


def test_tis_cap_needs_recomputed_old_logps_or_an_objective_without_a_ratio():
    """verl's bypass mode: with the sampler's log-probs as the old ones a ratio objective's
    ratio is the IS correction (a weight would count it twice); REINFORCE takes it explicitly."""
    assert ("rollout.tis_cap applies to rollout.old_logps=recompute or grpo.policy_loss=pg|gpg|dro only; got "
            "rollout.old_logps=sampler") in refused(GRPO, ["rollout.old_logps=sampler", "rollout.tis_cap=2.0"])
    load_config(data=GRPO, overrides=["rollout.tis_cap=2.0"])
    load_config(data=GRPO, overrides=["rollout.old_logps=sampler", "rollout.tis_cap=2.0", "grpo.policy_loss=pg",
                                      "rollout.tis_level=sequence", "rollout.rejection=geometric"])
    assert "rollout.tis_level applies to rollout.tis_cap" in refused(GRPO, ["rollout.tis_level=sequence"])
    assert "rollout.tis_batch_normalize applies to rollout.tis_cap" in refused(
        GRPO, ["rollout.tis_batch_normalize=true"])
    load_config(data=GRPO, overrides=["rollout.tis_cap=2.0", "rollout.tis_batch_normalize=true"])
    assert "rollout.tis_lower applies to rollout.tis_cap" in refused(GRPO, ["rollout.tis_lower=0.5"])
    load_config(data=GRPO, overrides=["rollout.tis_cap=2.0", "rollout.tis_lower=0.5"])
    assert "rollout.tis_lower must be > 0 and <= rollout.tis_cap (2.0)" in refused(
        GRPO, ["rollout.tis_cap=2.0", "rollout.tis_lower=3.0"])
    assert "rollout.rejection_bounds applies to rollout.rejection" in refused(GRPO, ["rollout.rejection_bounds=[0.8,1.2]"])


def test_chained_rejection_takes_its_own_bounds_per_criterion():
    """rollout.rejection as a mapping {criterion: [lo, hi]} (verl's chained k1 options): loads
    beside the k2 / k3 criteria; refused with a name it lacks, bounds out of order or not a
    pair, or rollout.rejection_bounds beside it (each criterion holds its own), naming the key."""
    config = load_config(data=GRPO, overrides=["rollout.rejection={token: [0.5, 2.0], geometric: [0.9, 1.1]}",
                                               "rollout.rejection_divergences={seq_max_k2: 2.5}"])
    assert config.rollout.rejection == {"token": (0.5, 2.0), "geometric": (0.9, 1.1)}
    assert "rollout.rejection has unknown criteria ['seq_mean_k1']; valid: token, sequence, geometric" in refused(
        GRPO, ["rollout.rejection={seq_mean_k1: [0.9, 1.1]}"])
    assert "rollout.rejection.sequence must be 0 < lo <= hi" in refused(
        GRPO, ["rollout.rejection={token: [0.5, 2.0], sequence: [2.0, 0.5]}"])
    assert refused(GRPO, ["rollout.rejection={token: 0.5}"]) == "rollout.rejection.token: expected a list, got 0.5"
    assert ("rollout.rejection_bounds applies to rollout.rejection=token|sequence|geometric only; got "
            "rollout.rejection={'token': (0.5, 2.0)}") in refused(
        GRPO, ["rollout.rejection={token: [0.5, 2.0]}", "rollout.rejection_bounds=[0.8,1.2]"])
    assert "rollout.rejection_bounds must be 0 < lo <= hi" in refused(
        GRPO, ["rollout.rejection=token", "rollout.rejection_bounds=[2.0,0.5]"])


def test_rejection_divergences_are_checked_by_name_and_bound():
    """verl's k2 / k3 rejection criteria: a mapping of known names to positive upper bounds,
    combinable with the k1 ratio bounds and with bypass mode."""
    config = load_config(data=GRPO, overrides=["rollout.rejection_divergences={seq_max_k2: 2.5, token_k3: 0.1}",
                                               "rollout.rejection=token", "rollout.old_logps=sampler"])
    assert config.rollout.rejection_divergences == {"seq_max_k2": 2.5, "token_k3": 0.1}
    assert ("rollout.rejection_divergences has unknown criteria ['seq_k3', 'token_k1']; valid: token_k2, token_k3, "
            "seq_sum_k2, seq_sum_k3, seq_mean_k2, seq_mean_k3, seq_max_k2, seq_max_k3") in refused(
        GRPO, ["rollout.rejection_divergences={seq_k3: 1.0, token_k1: 2.0}"])
    assert "rollout.rejection_divergences.seq_mean_k2 must be > 0" in refused(
        GRPO, ["rollout.rejection_divergences={seq_mean_k2: 0}"])


def test_dpo_family_keys():
    cases = [
        (["preference.loss=orpo", "preference.label_smoothing=0.1"], "preference.label_smoothing applies to (preference.loss=dpo and "
         "preference.variant=sigmoid|robust|exo_pair|aot|aot_unpaired) or preference.loss=simpo|cpo only; got "
         "preference.loss=orpo"),
        (["preference.variant=ipo", "preference.label_smoothing=0.1"], "got preference.variant=ipo"),
        (["preference.simpo_gamma=1.0"], "preference.simpo_gamma applies to preference.loss=simpo only; got preference.loss=dpo"),
        (["preference.loss=simpo", "preference.cpo_alpha=0.5"], "preference.cpo_alpha applies to preference.loss=cpo only; got preference.loss=simpo"),
        (["preference.kto_desirable_weight=2.0"], "preference.kto_desirable_weight applies to preference.loss=kto only"),
        (["preference.loss=cpo", "preference.variant=ipo"], "preference.variant applies to preference.loss=dpo only; got preference.loss=cpo"),
        (["preference.dpop_lambda=10"], "preference.dpop_lambda applies to preference.loss=dpo and preference.variant=dpop only; "
         "got preference.variant=sigmoid"),
        (["preference.loss=simpo", "preference.reference=precomputed"], "preference.reference applies to preference.loss=dpo|kto only"),
        (["preference.variant=nope"], "preference.variant=nope is not a DPO variant"),
    ]
    for overrides, expected in cases:
        assert expected in refused(DPO, overrides), overrides
    for ok in (["preference.loss=simpo", "preference.simpo_gamma=1.0", "preference.label_smoothing=0.1"],
               ["preference.variant=dpop", "preference.dpop_lambda=10"], ["preference.variant=robust", "preference.label_smoothing=0.1"],
               ["preference.reference=precomputed"]):
        load_config(data=DPO, overrides=ok)
    load_config(data={"algorithm": "dpo", "data": {"format": "unpaired"}},
                overrides=["preference.loss=kto", "preference.kto_undesirable_weight=2.0", "preference.reference=precomputed"])


def test_shared_sections_with_conditions():
    assert "optim.weight_decay applies to optim.name=adamw only; got optim.name=adam" in refused(
        DPO, ["optim.name=adam", "optim.weight_decay=0.1"])
    assert "optim.min_lr_ratio applies to optim.schedule=cosine|linear only; got optim.schedule=constant" in \
        refused(DPO, ["optim.schedule=constant", "optim.min_lr_ratio=0.1"])
    assert "model.logprob_chunk_size applies to algorithm other than reward/prm/distill/gkd/onpolicy_distill only" in refused(
        REWARD, ["model.logprob_chunk_size=32"])
    assert "model.seed applies to model.random_init set or algorithm=reward|prm only" in refused(DPO, ["model.seed=1"])
    assert "data.max_length applies to data.format other than prompt only; got data.format=prompt" in refused(
        GRPO, ["data.max_length=256"])
    assert "data.apply_chat_template applies to data.format=preference|unpaired|prompt|steps only; got data.format=sft" \
        in refused(SFT, ["data.apply_chat_template=false"])
    assert "data.split applies to a data.paths entry that is a file or folder" in refused(
        {**DPO, "data": {"paths": ["reasoning_gym:chain_sum"]}}, ["data.split=test"])
    assert "data.prefetch_batches applies to data.read_threads > 0 only" in refused(
        DPO, ["data.read_threads=0", "data.prefetch_batches=4"])
    load_config(data={**DPO, "data": {"paths": ["data/pairs"], "split": "test"}})


def test_rewards_keys_need_the_component_they_tune():
    assert "rewards.strict_format applies to rewards.format_weight != 0 only" in refused(
        GRPO, ["rewards.strict_format=true"])
    assert "rewards.ensemble_k applies to rewards.reward_models set and rewards.ensemble=mean_minus_std|" \
           "mean_minus_var only; got rewards.reward_models=[]" in refused(GRPO, ["rewards.ensemble_k=2"])
    assert "rewards.length_target applies to rewards.length_penalty_coef != 0 only" in refused(
        GRPO, ["rewards.length_target=64"])
    assert "rewards.overlong_scale applies to rewards.overlong_buffer set only" in refused(
        GRPO, ["rewards.overlong_scale=0.5"])
    assert "rewards.overlong_buffer=200 must be in (0, rollout.max_new_tokens=128]" in refused(
        GRPO, ["rewards.overlong_buffer=200"])
    assert "rewards: no reward source" in refused(GRPO, ["rewards.verifier_weight=0"])
    load_config(data=GRPO, overrides=["rewards.reward_models=[runs/rm]", "rewards.ensemble=mean_minus_std",
                                      "rewards.ensemble_k=2", "rewards.verifier_weight=0"])


def test_evaluation_keys():
    online = {**GRPO, "data": {"format": "prompt", "eval_fraction": 0.1}}
    assert "evaluation.temperature applies to evaluation.pass_k set or evaluation.best_of_n.n > 0 only; got evaluation.pass_k=[]" in refused(
        online, ["evaluation.temperature=0.6"])
    assert "evaluation.pass_k needs a verdict" in refused(online, ["evaluation.pass_k=[1,4]",
                                                                   "rewards.verifier_weight=0",
                                                                   "rewards.functions={'tests.support.rl_toy:yes_share': 1}"])
    assert "evaluation.prompts.shuffle is read by no run" in refused(
        online, ["evaluation.prompts={paths: [p.jsonl], format: prompt, shuffle: false}"])
    load_config(data=online, overrides=["evaluation.pass_k=[1,4]", "evaluation.temperature=0.6"])
    # an online run with no eval split keeps its evaluation settings (eval_fraction 0 switches evaluation off)
    load_config(data=GRPO, overrides=["evaluation.max_prompts=4"])


def test_several_problems_are_reported_together():
    message = refused(GRPO, ["ppo.gamma=0.9", "rollout.num_samples=1"])
    assert message.startswith("2 problems in the config:")
    assert "ppo.gamma applies" in message and "rollout.num_samples=1" in message


# ---------------------------------------------------------------------------- every variant of the online builders
# The instrumented runs read one setting of each switch; the builders of the online
# algorithms (no model) are cheap enough to sweep under every setting of their switches.
ONLINE_VARIANTS = {
    "grpo": [{}, *({"grpo": {"advantage": a}} for a in ("dr_grpo", "rloo", "reinforce_pp", "remax", "process")),
             *({"grpo": {"policy_loss": p}} for p in ("gspo", "cispo", "pg")),
             *({"grpo": {"policy_loss": p, **({"dro_beta": 0.1} if p == "dro" else {})}}
               for p in OBJECTIVES if p not in ("ppo", "gspo", "cispo", "pg")),
             {"grpo": {"dynamic_sampling": True}}, {"grpo": {"adaptive_kl": True}}, {"grpo": {"kl_coef": 0.0}}],
    "ppo": [{}, {"ppo": {"critic": "shared"}}, {"ppo": {"critic_init": "reward_model", "critic_path": "runs/rm"}},
            {"ppo": {"adaptive_kl": True}}, {"ppo": {"kl_placement": "loss"}}, {"ppo": {"kl_coef": 0.0}},
            {"ppo": {"ptx_coef": 0.1, "ptx_data": PTX_DATA}}],
}


def builder_reads(config: TrainConfig) -> set[str]:
    """The keys ``build_algorithm`` and the advantage function it returns read."""
    import jax
    import jax.numpy as jnp

    from alignax.trainers.online import grpo, ppo
    from alignax.trainers.online.algorithm import AdvantageInputs

    recorder = ReadRecorder(config)
    with recorder.active():
        algorithm = {"grpo": grpo.build_algorithm, "ppo": ppo.build_algorithm}[config.algorithm](config)
        rows, n = config.data.batch_size * config.rollout.num_samples, 3
        zeros = jnp.zeros((rows, n))
        jax.eval_shape(algorithm.advantages, AdvantageInputs(
            rewards=jnp.arange(rows, dtype=jnp.float32), loss_mask=jnp.ones((rows, n)),
            group_ids=jnp.repeat(jnp.arange(config.data.batch_size), config.rollout.num_samples),
            old_logps=zeros, ref_logps=zeros, old_values=zeros, kl_coef=jnp.asarray(0.1),
            baseline=jnp.zeros(rows), step_rewards=zeros, step_mask=zeros,
            reward_components=jnp.zeros((rows, 2)), reward_weights=jnp.ones(2), sum_pi_squared=zeros,
            stat_logps=zeros))
    return recorder.reads


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_online_section_keys_are_read_by_the_builder_wherever_accepted(algorithm):
    base = {"algorithm": algorithm, "data": {"format": "prompt", "batch_size": 2},
            "rollout": {"num_samples": 2}, "ppo": {"epochs": 2}} if algorithm == "ppo" else \
        {"algorithm": algorithm, "data": {"format": "prompt", "batch_size": 2}, "rollout": {"num_samples": 2}}
    keys = [k for k in SCHEMA if k.startswith(algorithm + ".") and not k.startswith("ppo.ptx_data.")]
    failures = []
    for variant in ONLINE_VARIANTS[algorithm]:
        raw = _merge(base, copy.deepcopy(variant))
        config = config_io.from_dict(TrainConfig, raw)
        assert validation.problems(config) == [], (variant, validation.problems(config))
        variant_reads = builder_reads(config)
        for key in keys:
            for value in sweep_values(key, current_value(config, key)):
                swept = config_io.from_dict(TrainConfig, with_key(raw, key, value))
                if validation.problems(swept) or _set_as_default(swept, key):
                    continue
                # a value can only change what is read through a switch (a choice, a flag, a null)
                tp, field = _field(key)
                switch = typing.get_origin(tp) is typing.Literal or tp is bool or field.default is None
                if key not in (builder_reads(swept) if switch else variant_reads):
                    failures.append(f"{variant}: {key}={value!r} accepted but not read by the builder")
    assert not failures, "\n".join(failures)


def test_env_keys_need_an_online_run_with_an_environment():
    def problems(**sections):
        raw = base_raw("grpo")
        raw.pop("rewards")
        return validation.problems(config_io.from_dict(TrainConfig, _merge(raw, sections)))

    assert problems(env={"name": "calculator"}) == []
    assert any("env.max_turns" in p and "env.name" in p for p in problems(env={"max_turns": 2}))
    assert any("rewards.format_weight" in p and "environment" in p
               for p in problems(env={"name": "calculator"}, rewards={"format_weight": 0.5}))
    assert any("grpo.advantage=process" in p for p in problems(env={"name": "calculator"},
                                                                grpo={"advantage": "process"}))
    assert any("env.max_turn_tokens=99" in p for p in problems(env={"name": "calculator", "max_turn_tokens": 99}))
    sft = _merge(base_raw("sft"), {"env": {"name": "calculator"}})
    assert any(names_key(p, "env.name") for p in validation.problems(config_io.from_dict(TrainConfig, sft)))


# ---------------------------------------------------------------------------- renamed sections
@pytest.mark.parametrize("old,new,key,value", [("dpo", "preference", "beta", 0.25),
                                               ("reward", "reward_model", "center_coef", 0.01)])
def test_an_old_section_name_loads_with_a_warning_naming_the_new_key(old, new, key, value):
    algorithm = "dpo" if new == "preference" else "reward"
    with pytest.warns(DeprecationWarning, match=rf"config section '{old}:' is now '{new}:' \({old}.<key> -> {new}"):
        from_yaml = load_config(data={"algorithm": algorithm, old: {key: value}})
    with pytest.warns(DeprecationWarning, match=f"'{new}:'"):
        from_override = load_config(data={"algorithm": algorithm}, overrides=[f"{old}.{key}={value}"])
    assert getattr(getattr(from_yaml, new), key) == getattr(getattr(from_override, new), key) == value
    with pytest.warns(DeprecationWarning, match=f"TrainConfig.{old} is now TrainConfig.{new}"):
        assert getattr(getattr(from_yaml, old), key) == value
    assert old not in {f.name for f in dataclasses.fields(TrainConfig)}  # the new name is the field


def test_a_section_under_both_names_merges_and_a_disagreement_names_both():
    with pytest.warns(DeprecationWarning):
        config = load_config(data={"algorithm": "dpo", "preference": {"beta": 0.3}}, overrides=["dpo.variant=ipo"])
    assert (config.preference.beta, config.preference.variant) == (0.3, "ipo")
    with pytest.warns(DeprecationWarning), pytest.raises(ConfigError, match=r"dpo.beta=0.5 and preference.beta=0.3: "
                                                                            r"'dpo:' is the old name of 'preference:'"):
        load_config(data={"algorithm": "dpo", "preference": {"beta": 0.3}}, overrides=["dpo.beta=0.5"])


def test_a_run_saved_before_the_rename_resumes_without_changes(tmp_path):
    from alignax.trainers.engine import rundir

    config = load_config(data={"algorithm": "dpo", "output_dir": str(tmp_path), "preference": {"beta": 0.3}})
    saved = config_io.to_dict(config)
    saved["dpo"] = saved.pop("preference")  # as a run of the last release wrote it
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    assert rundir.saved_config_changes(str(tmp_path), config) == ([], [])
