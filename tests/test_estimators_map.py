"""The registries walked: every advantage estimator (alignax/estimators) and every policy
objective (alignax/losses/objectives) has its own module and tests; a new estimator is one
module and one entry; each loads from YAML, validates through the map's ``grpo`` entry and is
estimated by ``alignax estimate``; the README's algorithm list is the registries' rendering.
"""

from __future__ import annotations

import ast
import importlib
import sys
from functools import cache
from pathlib import Path

import pytest

from alignax.estimators import ESTIMATORS
from tests.support.scratch_package import run_against_copy, scratch_copy

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import readme_algorithms  # noqa: E402  (tools/readme_algorithms.py)


@cache
def words_in_tests() -> dict[str, set[str]]:
    """``{tests/file: the string constants and names it uses}`` over tests/test_*.py but this file."""
    out = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        if path.name == Path(__file__).name:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        out[path.name] = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)} | {
            n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    return out


def files_using(*words: str) -> list[str]:
    """The test files that use every one of ``words`` (as a string or a name)."""
    return [name for name, used in words_in_tests().items() if set(words) <= used]


# ----------------------------------------------------------------------------- the walk
@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_every_estimator_has_its_own_module_and_tests(name):
    entry = ESTIMATORS[name]
    module = importlib.import_module(f"alignax.estimators.{name}")  # its own module, named after it
    assert module.ESTIMATOR is entry, f"alignax/estimators/{name}.py's ESTIMATOR is not the registry's entry {name!r}"
    assert entry.advantages.__module__ == module.__name__, \
        f"estimator {name!r} computes in {entry.advantages.__module__}, not its own module {module.__name__}"
    assert files_using(name), f"no test under tests/ selects estimator {name!r} (e.g. grpo.advantage: {name})"


def objective_registry() -> dict:
    try:
        return dict(importlib.import_module(readme_algorithms.OBJECTIVES_MODULE).OBJECTIVES)
    except (ImportError, AttributeError) as err:
        pytest.fail(f"{readme_algorithms.OBJECTIVES_MODULE}.OBJECTIVES, the policy objectives' registry (branch "
                    f"verlloss, issue 37), is missing from this tree: {err}")


def test_every_objective_has_its_own_module_and_tests():
    registry = objective_registry()
    assert registry, "the policy objectives' registry is empty"
    problems = []
    for name, entry in registry.items():
        loss = entry.loss
        module = sys.modules[loss.__module__]
        if not module.__name__.startswith("alignax.losses.") or module.__name__ == readme_algorithms.OBJECTIVES_MODULE:
            problems.append(f"objective {name!r}: its loss {loss.__name__} lives in {module.__name__}, not a module of "
                            "its own under alignax/losses/")
        if not files_using(name):
            problems.append(f"objective {name!r}: no test under tests/ selects it (e.g. grpo.policy_loss: {name})")
        if not files_using(loss.__name__):
            problems.append(f"objective {name!r}: no test under tests/ calls its loss {loss.__name__}")
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------------------- a new estimator
TOY_MODULE = '''\
"""A toy estimator: the reward minus the batch's best, on every loss token."""

import jax.numpy as jnp

from alignax.estimators.base import Estimator, per_token


def advantages(x, section, num_groups):
    return per_token(x.rewards - jnp.max(x.rewards), x.loss_mask)


ESTIMATOR = Estimator("toy_best", advantages, "the reward minus the batch's best", min_group_size=1)
'''
TOY_CHECK = '''\
import jax.numpy as jnp
import numpy as np
from alignax.estimate import estimate, model_config_for
from alignax.trainers.api import algorithm, load_config
from alignax.trainers.online.algorithm import AdvantageInputs

config = load_config(data={"algorithm": "grpo", "data": {"format": "prompt", "batch_size": 2},
                           "rollout": {"num_samples": 1}, "grpo": {"advantage": "toy_best"}})
built = algorithm("grpo").make(config)
zeros = jnp.zeros((2, 3))
x = AdvantageInputs(rewards=jnp.array([1.0, 3.0]), loss_mask=jnp.ones((2, 3)), group_ids=jnp.arange(2),
                    old_logps=zeros, ref_logps=None, old_values=zeros, kl_coef=jnp.asarray(0.0),
                    baseline=jnp.zeros(2), step_rewards=zeros, step_mask=zeros)
adv, _ = built.advantages(x)
assert np.array_equal(np.asarray(adv), [[-2.0] * 3, [0.0] * 3]), adv
assert built.min_group_size == 1
result = estimate(config, model=model_config_for(config, "llama-2-7b"), devices=1, mesh=(1, 1, 1))
assert result.online
print("toy ok")
'''


def test_a_new_estimator_is_one_module_and_one_entry(tmp_path):
    touched = scratch_copy(tmp_path, new_files={"estimators/toy_best.py": TOY_MODULE}, edits={
        "estimators/__init__.py": ("    gdpo,\n", "    gdpo,\n    toy_best,\n")})  # the import
    registry = tmp_path / "alignax" / "estimators" / "__init__.py"
    registry.write_text(registry.read_text().replace(  # the entry
        "    gdpo.ESTIMATOR,\n)", "    gdpo.ESTIMATOR,\n    toy_best.ESTIMATOR,\n)", 1))
    assert touched == ["estimators/__init__.py", "estimators/toy_best.py"]
    run_against_copy(tmp_path, TOY_CHECK, "toy ok")


# ----------------------------------------------------------------------------- YAML, the map, estimate
def test_each_estimator_loads_from_yaml_and_is_estimated(tmp_path):
    from alignax.config import ConfigError
    from alignax.estimate import estimate, model_config_for
    from alignax.trainers.api import load_config

    totals = {}
    for name in ESTIMATORS:
        path = tmp_path / f"{name}.yaml"
        path.write_text(f"algorithm: grpo\ndata: {{format: prompt}}\ngrpo:\n  advantage: {name}\n")
        config = load_config(str(path))
        assert config.grpo.advantage == name
        result = estimate(config, model=model_config_for(config, "llama-2-7b"), devices=1, mesh=(1, 1, 1))
        totals[name] = result.total
        # the optimal token baseline's sum pi^2 is one more forward pass over the rollout (which
        # runs in single-update mode too, where the old log-probs' pass does not)
        model = model_config_for(config, "llama-2-7b")
        one_pass = (2 * (result.parameters - model.vocab_size * model.hidden_size) * config.data.batch_size
                    * config.rollout.num_samples * (config.data.max_prompt_length + config.rollout.max_new_tokens))
        extra = result.flops.get("sum pi^2 forward", 0.0)
        assert extra == (one_pass if ESTIMATORS[name].token_stats else 0.0), (name, extra)
    # the estimators change what the rollout computes, not what the training step holds
    assert len(set(totals.values())) == 1, totals
    with pytest.raises(ConfigError, match="grpo.advantage=best_of is not an advantage estimator; valid: grpo, "):
        load_config(data={"algorithm": "grpo", "data": {"format": "prompt"}, "grpo": {"advantage": "best_of"}})


def test_the_map_checks_the_estimators_needs():
    from alignax.config import ConfigError
    from alignax.trainers.api import load_config

    base = {"algorithm": "grpo", "data": {"format": "prompt"}}
    with pytest.raises(ConfigError, match="rollout.num_samples=1: grpo.advantage=opo compares the samples of a prompt; "
                                          "set rollout.num_samples >= 2 .or grpo.advantage=remax."):
        load_config(data={**base, "rollout": {"num_samples": 1}, "grpo": {"advantage": "opo"}})
    with pytest.raises(ConfigError, match="rewards.clip=.-1.0, 1.0. clips the total reward, which grpo.advantage=gdpo "
                                          "never reads"):
        load_config(data={**base, "grpo": {"advantage": "gdpo"}, "rewards": {"clip": [-1.0, 1.0]}})
    with pytest.raises(ConfigError, match="grpo.reward_aggregation applies to grpo.advantage=grpo only; got "
                                          "grpo.advantage=rloo"):
        load_config(data={**base, "grpo": {"advantage": "rloo", "reward_aggregation": "normalize_then_sum"}})
    with pytest.raises(ConfigError, match="grpo.scale_rewards=batch picks grpo advantages' std; "
                                          "grpo.reward_aggregation=normalize_then_sum normalises each component"):
        load_config(data={**base, "grpo": {"reward_aggregation": "normalize_then_sum", "scale_rewards": "batch"}})
    with pytest.raises(ConfigError, match="grpo.kl_placement=reward subtracts the KL from the total reward, which "
                                          "grpo.advantage=gdpo never reads"):
        load_config(data={**base, "grpo": {"advantage": "gdpo", "kl_placement": "reward"}})
    load_config(data={**base, "grpo": {"advantage": "gdpo", "unbiased_std": False}})
    load_config(data={**base, "grpo": {"advantage": "grpo_passk", "unbiased_std": False}})


# ----------------------------------------------------------------------------- the README
def test_the_readme_algorithm_list_is_the_registries_rendering():
    """README.md carries tools/readme_algorithms.py's block between its markers (the lead adds
    it at the merge: ``python tools/readme_algorithms.py`` prints it)."""
    block = readme_algorithms.readme_block((ROOT / "README.md").read_text(encoding="utf-8"))
    assert block is not None, (f"README.md lacks the generated algorithm list: put the output of "
                               f"`python tools/readme_algorithms.py` in it ({readme_algorithms.BEGIN} ... "
                               f"{readme_algorithms.END})")
    if not hasattr(importlib.import_module("alignax.losses"), "objectives"):
        objective_registry()  # fails naming the missing registry
    assert block == readme_algorithms.render(), "README.md's algorithm list differs: rerun tools/readme_algorithms.py"


def test_the_rendering_lists_every_registry():
    """The rendering lists the map's algorithms and the estimators of this tree, and the
    objectives it is given (the registry's names at the merge; two toy names here)."""
    from alignax.losses.preference import DPO_VARIANT_TABLE
    from alignax.trainers.algorithms import ALIASES
    from alignax.trainers.api import ALGORITHMS

    text = readme_algorithms.render(objective_names=["toy_clip", "toy_pg"])
    lines = text.splitlines()
    assert lines[1].startswith("- **algorithms** (`algorithm:`): " + ", ".join(f"`{n}`" for n in ALGORITHMS) +
                               "; and as aliases ")
    assert all(f"`{alias}` (`{target}` with `" in lines[1] for alias, (target, _) in ALIASES.items())
    assert lines[:1] + lines[2:] == [
        readme_algorithms.BEGIN,
        "- **DPO variants** (`preference.variant:`): " + ", ".join(f"`{n}`" for n in DPO_VARIANT_TABLE),
        "- **advantage estimators** (`grpo.advantage:`): " + ", ".join(f"`{n}`" for n in ESTIMATORS),
        "- **policy objectives** (`grpo.policy_loss:`): `toy_clip`, `toy_pg`",
        readme_algorithms.END]


# ----------------------------------------------------------------------------- docs/migrating-from-verl.md
def test_the_verl_table_names_every_verl_estimator_and_its_keys_load():
    import re

    from alignax.trainers.api import load_config

    page = (ROOT / "docs" / "migrating-from-verl.md").read_text(encoding="utf-8")
    section = page.split("## Advantage estimators", 1)[1].split("\n## ", 1)[0]
    for entry in ESTIMATORS.values():
        if entry.verl_name and re.fullmatch(r"\w+", entry.verl_name):
            assert f"`{entry.verl_name}`" in section, f"verl's {entry.verl_name} has no row"
    named = re.findall(r"`grpo\.advantage: (\w+)`", section)
    assert set(named) == set(ESTIMATORS) - {"process"}, set(ESTIMATORS) ^ set(named)  # verl has no process supervision
    for name in named:
        assert load_config(data={"algorithm": "grpo", "data": {"format": "prompt"},
                                 "grpo": {"advantage": name}}).grpo.advantage == name
