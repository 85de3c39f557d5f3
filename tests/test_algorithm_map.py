"""The algorithm map (alignax/trainers/algorithms.py) is the only place that knows an algorithm.

- No module outside the map and its entries' own modules spells an algorithm's name as a
  value of ``algorithm`` (compared, matched, assigned, or said in a message).
- A toy online family, defined here, needs one new module and one entry: copied into a
  scratch copy of the package, it loads, validates and is estimated with no other file
  touched.
- Every entry's facts agree with the schema and with the recipes in configs/.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

from alignax import config as config_io
from alignax.config import ConfigError
from alignax.models import MODEL_KINDS
from alignax.trainers import algorithms
from alignax.trainers.algorithms import ALGORITHMS, ENTRIES
from alignax.trainers.config import TrainConfig
from tests.support.scratch_package import changed_files, run_against_copy, scratch_copy
from tests.support.trainer_helpers import CONFIGS

ROOT = Path(__file__).resolve().parent.parent
NAMES = set(ALGORITHMS)
_SAID = re.compile(r"\balgorithm[ =:]+'?(" + "|".join(sorted(NAMES, key=len, reverse=True)) + r")\b")


def _allowed_files() -> set[Path]:
    """The map and the modules of its entries' builders."""
    files = {Path(algorithms.__file__).resolve()}
    for entry in ENTRIES:
        files.add(Path(sys.modules[entry.make.__module__].__file__).resolve())
    return files


def _mentions_algorithm(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "algorithm") or (
        isinstance(node, ast.Attribute) and node.attr == "algorithm")


def _names_in(node: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in NAMES}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _renames_sections(node: ast.Dict) -> bool:
    """A table of old section names -> new ones (``dpo`` and ``reward`` were sections too)."""
    sections = {f.name for f in dataclasses.fields(TrainConfig)}
    return all(isinstance(v, ast.Constant) and v.value in sections for v in node.values)


def algorithm_literals(path: Path, root: Path = ROOT) -> list[str]:
    """``file:line: what`` for each place ``path`` spells an algorithm's name as an algorithm."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings, found = _docstrings(tree), []
    for node in ast.walk(tree):
        names: set[str] = set()
        if isinstance(node, ast.Compare) and any(map(_mentions_algorithm, [node.left, *node.comparators])):
            names = _names_in(node)  # algorithm == "dpo", config.algorithm in ("grpo", "ppo")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and node.args[0].value == "algorithm":
            names = _names_in(node)  # Is("algorithm", "grpo")
        elif isinstance(node, ast.keyword) and node.arg == "algorithm":
            names = _names_in(node.value)  # replace(config, algorithm="dpo")
        elif isinstance(node, ast.Dict) and not _renames_sections(node):
            keys = _names_in(ast.List([k for k in node.keys if k], ast.Load()))
            names = keys if len(keys) > 1 else set()  # {"sft": ..., "prm": ...}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            names = set(_SAID.findall(node.value)) | ({"iterative_dpo"} & set(re.findall(r"\w+", node.value)))
        if names:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {', '.join(sorted(names))}")
    return sorted(found, key=lambda hit: int(hit.split(":")[1]))


def test_no_algorithm_name_outside_the_map_and_its_entries():
    allowed = _allowed_files()
    found = [hit for path in sorted((ROOT / "alignax").rglob("*.py")) if path.resolve() not in allowed
             for hit in algorithm_literals(path)]
    assert not found, "algorithm names outside alignax/trainers/algorithms.py:\n" + "\n".join(found)


def test_the_grep_finds_each_kind_of_literal(tmp_path):
    """The check above is not vacuous: each way of spelling an algorithm is caught."""
    sample = tmp_path / "sample.py"
    sample.write_text(textwrap.dedent('''\
        """A docstring may say algorithm: dpo."""
        if config.algorithm == "dpo": pass
        online = algorithm in ("grpo", "ppo")
        rule = Is("algorithm", "sft")
        changed = replace(config, algorithm="prm")
        table = {"sft": 1, "reward": 2}
        message = f"algorithm {name}: iterative_dpo writes files"
        message = "set algorithm=ppo"
        '''))
    hits = algorithm_literals(sample, tmp_path)
    assert [h.split(":", 1)[1] for h in hits] == ["2: dpo", "3: grpo, ppo", "4: sft", "5: prm", "6: reward, sft",
                                                  "7: iterative_dpo", "8: ppo"], hits


# ---------------------------------------------------------------------------- a new family
TOY_MODULE = '''\
"""A toy online family: REINFORCE with the group mean as baseline, from GRPO's section."""

from alignax.trainers.online import grpo


def build_algorithm(config):
    return grpo.build_algorithm(config)
'''
TOY_ENTRY = '''
ENTRIES = (*ENTRIES, Algorithm("toy_reinforce", "online", ("causal_lm",), toy.build_algorithm, ("grpo",),
                               _formats("prompt"), reference=Above("grpo.kl_coef", 0)))
ALGORITHMS = {a.name: a for a in ENTRIES}
'''
TOY_CHECK = '''\
import warnings
import pytest
from alignax.config import ConfigError
from alignax.estimate import estimate, model_config_for
from alignax.trainers import validation
from alignax.trainers.api import algorithm, load_config

config = load_config(data={"algorithm": "toy_reinforce", "data": {"format": "prompt"}})
assert algorithm("toy_reinforce").make(config).name == "grpo"
with pytest.raises(ConfigError, match="ppo.gamma applies to algorithm=ppo only; got algorithm=toy_reinforce"):
    load_config(data={"algorithm": "toy_reinforce", "data": {"format": "prompt"}, "ppo": {"gamma": 0.9}})
with pytest.raises(ConfigError, match="data.format=sft does not fit algorithm toy_reinforce"):
    load_config(data={"algorithm": "toy_reinforce", "data": {"format": "sft"}})
assert validation.ONLINE(config) and validation.LIVE_REFERENCE(config)
result = estimate(config, model=model_config_for(config, "llama-2-7b"), devices=1, mesh=(1, 1, 1))
assert result.online and result.items["reference"] > 0 and "KV cache" in result.items
print("toy ok")
'''


def test_a_new_online_family_is_one_module_and_one_entry(tmp_path):
    scratch_copy(tmp_path, new_files={"trainers/online/toy.py": TOY_MODULE}, edits={
        "trainers/algorithms.py": ("from alignax.trainers.online import grpo, ppo",
                                   "from alignax.trainers.online import grpo, ppo, toy")})
    map_file = tmp_path / "alignax" / "trainers" / "algorithms.py"
    map_file.write_text(map_file.read_text().replace(
        "\nALGORITHMS: dict[str, Algorithm] = {a.name: a for a in ENTRIES}\n",
        "\nALGORITHMS: dict[str, Algorithm] = {a.name: a for a in ENTRIES}\n" + TOY_ENTRY))
    touched = changed_files(ROOT / "alignax", tmp_path / "alignax")
    assert touched == ["trainers/algorithms.py", "trainers/online/toy.py"], touched
    run_against_copy(tmp_path, TOY_CHECK, "toy ok")


# ---------------------------------------------------------------------------- the entries' facts
def test_every_entry_agrees_with_the_schema_and_the_recipes():
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for entry in ENTRIES:
        assert set(entry.model_kinds) <= set(MODEL_KINDS), entry.name
        assert entry.sections and set(entry.sections) <= fields, (entry.name, entry.sections)
        # an entry's own rows name keys of its own sections only
        for r in entry.rules:
            assert all(k.split(".")[0] in entry.sections for k in r.keys), (entry.name, r.keys)
    recipes = {}
    for path in sorted(glob.glob(os.path.join(CONFIGS, "tiny-*.yaml"))):
        raw = config_io.load_yaml(path)
        recipes.setdefault(raw["algorithm"], []).append(config_io.from_dict(TrainConfig, raw))
    assert set(recipes) == set(ALGORITHMS), "an algorithm without a tiny recipe, or a recipe of no algorithm"
    for name, configs in recipes.items():
        for config in configs:
            formats, _ = ALGORITHMS[name].data_formats(config)
            assert config.data.format in formats, (name, config.data.format, formats)


@pytest.mark.parametrize("name,reference", [("dpo", True), ("iterative_dpo", True), ("grpo", True), ("ppo", True),
                                            ("sft", False), ("reward", False), ("prm", False)])
def test_each_entry_says_whether_its_recipe_holds_a_reference(name, reference):
    """Worked out from the recipes: DPO (loss dpo) and iterative DPO hold one, GRPO and PPO
    with their KL (coef > 0); SFT and reward models never."""
    path = os.path.join(CONFIGS, f"tiny-{name.replace('_', '-')}.yaml")
    config = config_io.from_dict(TrainConfig, config_io.load_yaml(path))
    assert bool(ALGORITHMS[name].reference(config)) is reference


@pytest.mark.parametrize("recipe,overrides", [("grpo", []), ("ppo", []), ("onpolicy-distill", []),
                                              ("onpolicy-distill", ["onpolicy_distill.estimator=sampled"])])
def test_the_estimators_reference_in_update_is_the_trainers(recipe, overrides):
    """Two places say whether an online run's frozen model runs inside the update: the map's
    ``reference_in_update`` (what ``alignax estimate`` counts) and the built algorithm's
    (what the collector skips). They must agree, or the estimate counts passes that never run."""
    from alignax.trainers.api import load_config

    config = load_config(os.path.join(CONFIGS, f"tiny-{recipe}.yaml"), overrides)
    entry = ALGORITHMS[config.algorithm]
    built = entry.make(config)
    assert bool(entry.reference_in_update(config)) is built.reference_in_update
    if recipe == "onpolicy-distill":
        assert built.reference_in_update is (config.onpolicy_distill.estimator == "exact")


# ---------------------------------------------------------------------------- a new DPO variant
def test_a_new_dpo_variant_is_one_function_and_one_entry(monkeypatch):
    """A toy variant, the linear loss ``-b (r_c - r_r)``, put in the variant table alone:
    ``preference.variant`` accepts it and ``dpo_loss`` computes it (numbers by hand)."""
    import numpy as np

    from alignax.losses import preference as pref
    from alignax.trainers.api import load_config

    def linear(r, beta, eps, dpop_lambda):
        return -beta * (r.chosen - r.rejected)

    monkeypatch.setitem(pref.DPO_VARIANT_TABLE, "toy_linear", pref.DPOVariant(linear))
    config = load_config(data={"algorithm": "dpo", "preference": {"variant": "toy_linear"}})
    assert config.preference.variant == "toy_linear"
    # pairs: (pol_c, pol_r, ref_c, ref_r) = (-1, -3, -2, -2) and (-4, -1, -3, -2); beta 0.5
    loss, metrics = pref.dpo_loss(np.array([-1.0, -4.0]), np.array([-3.0, -1.0]), np.array([-2.0, -3.0]),
                                  np.array([-2.0, -2.0]), beta=0.5, variant="toy_linear")
    # r_c - r_r: (1 - (-1)) = 2 and (-1 - 1) = -2 -> losses -1 and 1 -> mean 0
    assert float(loss) == 0.0 and float(metrics["rewards/accuracies"]) == 0.5
    monkeypatch.delitem(pref.DPO_VARIANT_TABLE, "toy_linear")
    with pytest.raises(ConfigError, match="preference.variant=toy_linear is not a DPO variant"):
        load_config(data={"algorithm": "dpo", "preference": {"variant": "toy_linear"}})
