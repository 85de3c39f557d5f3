"""Typed YAML configs: values checked against annotations, errors naming the key."""

import dataclasses
import datetime
import glob
import math
import os
import sys
import textwrap
from typing import Literal

import pytest
import yaml

from alignax.config import (
    ConfigError,
    YamlLoader,
    apply_overrides,
    from_dict,
    load_callable,
    load_yaml,
    to_dict,
    yaml_load,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Inner:
    beta: float = 0.1
    variant: Literal["sigmoid", "ipo"] = "sigmoid"
    layers: tuple[int, ...] = (1, 2)


@dataclasses.dataclass(frozen=True)
class Outer:
    name: str
    steps: int = 10
    flag: bool = False
    limit: float | None = None
    inner: Inner = dataclasses.field(default_factory=Inner)
    weights: dict[str, float] = dataclasses.field(default_factory=dict)


def test_builds_nested_dataclasses_and_converts_types():
    cfg = from_dict(Outer, {"name": "x", "steps": 3, "limit": 2, "inner": {"beta": 1, "layers": [4, 5]},
                            "weights": {"a": 1}})
    assert cfg == Outer(name="x", steps=3, limit=2.0, inner=Inner(beta=1.0, layers=(4, 5)), weights={"a": 1.0})
    assert isinstance(cfg.inner.beta, float)
    assert to_dict(cfg)["inner"] == {"beta": 1.0, "variant": "sigmoid", "layers": [4, 5]}


def test_unknown_key_names_path_and_valid_keys():
    with pytest.raises(ConfigError, match=r"unknown config key 'inner.bta' \(did you mean 'beta'\?\); valid keys here: beta, variant, layers"):
        from_dict(Outer, {"name": "x", "inner": {"bta": 0.2}})


@pytest.mark.parametrize(
    "data, message",
    [
        ({"name": "x", "steps": "ten"}, "steps: expected an integer, got 'ten'"),
        ({"name": "x", "steps": 1.5}, "steps: expected an integer, got 1.5"),
        ({"name": "x", "flag": "yes"}, "flag: expected true or false"),
        ({"name": "x", "inner": {"variant": "hinge"}}, r"inner.variant: 'hinge' is not a valid choice; valid: 'sigmoid', 'ipo'"),
        ({"name": "x", "inner": {"layers": [1, "a"]}}, r"inner.layers\[1\]: expected an integer"),
        ({"name": "x", "limit": "big"}, "limit: expected float | null"),
        ({"name": "x", "inner": 3}, "inner: expected a mapping of Inner fields"),
        ({}, "missing required config key"),
    ],
)
def test_ill_typed_values_name_their_path(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(Outer, data)


def test_dotted_overrides_parse_yaml_scalars():
    data = apply_overrides({"name": "x", "inner": {"beta": 0.1}}, ["inner.beta=0.5", "steps=7", "flag=true",
                                                                   "inner.layers=[3, 4]", "limit=null"])
    cfg = from_dict(Outer, data)
    assert (cfg.inner.beta, cfg.steps, cfg.flag, cfg.inner.layers, cfg.limit) == (0.5, 7, True, (3, 4), None)
    with pytest.raises(ConfigError, match="dotted.key=value"):
        apply_overrides({}, ["steps"])
    with pytest.raises(ConfigError, match="'name' is a value, not a section"):
        apply_overrides({"name": "x"}, ["name.first=1"])


# --- numbers: YAML 1.2 floats in files and overrides, the field's type decides ----------


@dataclasses.dataclass(frozen=True)
class Numbers:
    rate: float = 0.1
    steps: int = 10
    name: str = "run"
    bound: float | None = None
    extra: dict = dataclasses.field(default_factory=dict)


FLOAT_FORMS = [
    ("1e-3", 1e-3), ("1E-3", 1e-3), ("5e-7", 5e-7), ("1.0e+3", 1000.0), ("1.0e3", 1000.0), ("1.5", 1.5),
    ("1.", 1.0), (".5", 0.5), ("-.5", -0.5), ("-2e-4", -2e-4), ("+1e3", 1000.0), ("+.5e-3", 5e-4),
    ("1_000.5", 1000.5), ("3", 3.0), (".inf", math.inf), ("-.inf", -math.inf),
]


@pytest.mark.parametrize("text, expected", FLOAT_FORMS)
def test_float_forms_in_a_yaml_file(tmp_path, text, expected):
    path = tmp_path / "c.yaml"
    path.write_text(f"rate: {text}\nextra: {{eps: {text}}}\n")
    raw = load_yaml(str(path))
    cfg = from_dict(Numbers, raw)
    assert cfg.rate == expected and type(cfg.rate) is float
    # an untyped (Any) value is a number too, as YAML 1.2 reads it
    assert cfg.extra["eps"] == expected and not isinstance(cfg.extra["eps"], str)


@pytest.mark.parametrize("text, expected", FLOAT_FORMS)
def test_float_forms_in_overrides(text, expected):
    cfg = from_dict(Numbers, apply_overrides({}, [f"rate={text}", f"bound={text}"]))
    assert cfg.rate == expected and cfg.bound == expected


def test_readme_override_and_nested_keys():
    data = apply_overrides({"optim": {"learning_rate": 1.0e-6}}, ["optim.learning_rate=5e-7"])
    assert data == {"optim": {"learning_rate": 5e-7}}


def test_loader_keeps_yaml_1_1_behaviour_for_everything_but_floats_and_booleans():
    assert yaml_load("a: 1_000\nb: 0x10\nc: true\nd: null\ne: 2024-01-02\nf: '1e-3'") == {
        "a": 1000, "b": 16, "c": True, "d": None, "e": datetime.date(2024, 1, 2), "f": "1e-3"}
    # booleans as YAML 1.2: true/false only; 1.1's on/off/yes/no stay text (a Literal choice)
    assert yaml_load("[true, False, TRUE, on, off, yes, no, On, Y]") == [
        True, False, True, "on", "off", "yes", "no", "On", "Y"]
    assert yaml.safe_load("off") is False  # what the stock loader would have made of it
    assert apply_overrides({}, ["rollout.pack_groups=off"]) == {"rollout": {"pack_groups": "off"}}
    # not numbers: stay text
    for text in ["1e", "e3", "1.2.3", "1:30.5", "inf", "nan", "1e-3x", "v1e3", "1-2"]:
        assert yaml_load(text) == text, text
    assert math.isnan(yaml_load(".nan"))
    # every character a float can start with has the (replaced) float resolver
    for first in "-+.0123456789":
        tags = [tag for tag, _ in YamlLoader.yaml_implicit_resolvers[first]]
        assert "tag:yaml.org,2002:float" in tags, first
    # the stock SafeLoader is untouched
    assert yaml.safe_load("1e-3") == "1e-3"


def test_float_field_takes_numeric_text_and_inf_but_not_nan():
    cfg = from_dict(Numbers, {"rate": "1e-3", "bound": " -2E-4 "})
    assert (cfg.rate, cfg.bound) == (1e-3, -2e-4)
    for text in ["inf", "-inf", "+Infinity", ".inf"]:
        assert math.isinf(from_dict(Numbers, {"rate": text}).rate), text
    for nan in [".nan", "nan", float("nan")]:
        with pytest.raises(ConfigError, match="rate: NaN is not a usable value"):
            from_dict(Numbers, {"rate": nan})
    with pytest.raises(ConfigError, match=r"rate: NaN is not a usable value"):
        from_dict(Numbers, apply_overrides({}, ["rate=.nan"]))
    for bad in ["1e-3x", "fast", "1:30.5", "0x10", True]:
        with pytest.raises(ConfigError, match=r"rate: expected a number"):
            from_dict(Numbers, {"rate": bad})


def test_int_field_takes_whole_numbers_in_any_notation():
    assert from_dict(Numbers, apply_overrides({}, ["steps=1e3"])).steps == 1000
    assert from_dict(Numbers, {"steps": 2.0}).steps == 2
    assert from_dict(Numbers, {"steps": "1_000"}).steps == 1000
    assert from_dict(Numbers, {"steps": "1.5e2"}).steps == 150
    assert from_dict(Numbers, {"steps": "100000000000000000001"}).steps == 10**20 + 1  # exact, from text
    cases = [(2.5, "2.5"), ("1e-3", "'1e-3'"), (math.inf, "inf"), ("inf", "'inf'"), (True, "True"),
             ("ten", "'ten'")]
    for bad, shown in cases:
        with pytest.raises(ConfigError, match=rf"^steps: expected an integer, got {shown}$"):
            from_dict(Numbers, {"steps": bad})
    with pytest.raises(ConfigError, match=r"steps: expected an integer, got 1e\+20, too large"):
        from_dict(Numbers, apply_overrides({}, ["steps=1e20"]))


def test_int_field_in_a_yaml_file_names_the_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 2.5e-1\n")
    with pytest.raises(ConfigError, match=r"^steps: expected an integer, got 0.25$"):
        from_dict(Numbers, load_yaml(str(path)))


@dataclasses.dataclass(frozen=True)
class Labelled:
    label: str | None = None


def test_str_field_keeps_quoted_text_and_refuses_a_bare_number(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("name: '1e-3'\n")
    assert from_dict(Numbers, load_yaml(str(path))).name == "1e-3"
    assert from_dict(Numbers, apply_overrides({}, ["name='5e-7'"])).name == "5e-7"
    assert from_dict(Numbers, {"name": "1e-3"}).name == "1e-3"
    path.write_text("name: 1e-3\n")
    with pytest.raises(ConfigError, match=r"^name: expected a string, got the number 0.001; quote the value"):
        from_dict(Numbers, load_yaml(str(path)))
    with pytest.raises(ConfigError, match=r"name: expected a string, got the number 7; quote"):
        from_dict(Numbers, apply_overrides({}, ["name=7"]))
    # the advice survives an Optional
    with pytest.raises(ConfigError, match=r"^label: expected str \| null, got 0.001; quote the value to keep it"):
        from_dict(Labelled, {"label": 1e-3})
    with pytest.raises(ConfigError, match=r"^bound: expected float \| null, got nan; NaN is not a usable value"):
        from_dict(Numbers, {"bound": float("nan")})


def test_override_with_invalid_yaml_names_the_override():
    with pytest.raises(ConfigError, match=r"override 'rate=\[1, 2': the value is not valid YAML"):
        apply_overrides({}, ["rate=[1, 2"])


def test_recipes_in_configs_read_the_same_as_before():
    """configs/*.yaml use 1.1-style floats (5.0e-6); the 1.2 loader reads them identically."""
    paths = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
    assert paths
    for path in paths:
        with open(path, encoding="utf-8") as f:
            assert load_yaml(path) == yaml.safe_load(f), path


# --- an optional section's own errors, and long values ---------------------------------


@pytest.mark.parametrize("override,message", [
    ("lora.rank=0", "lora.rank must be >= 1; got 0"),
    ("lora.alpha=-1", "lora.alpha must be > 0; got -1.0"),
    ("lora.targets=[nope]", "lora.targets: unknown 'nope'; valid: q, k, v, o, gate, up, down, lm_head, all"),
    ("lora.dropout=1.5", "lora.dropout must be in [0, 1); got 1.5"),
    ("lora.quantize=nf3", "lora.quantize: 'nf3' is not a valid choice; valid: 'none', 'int8', 'nf4'"),
    ("lora.rank=abc", "lora.rank: expected an integer, got 'abc'"),
])
def test_a_bad_lora_value_names_its_field_and_rule(override, message):
    """``lora: LoraConfig | null``: a mapping can only be the section, so its own error
    comes through (it used to read ``lora: expected LoraConfig | null, got {...}``)."""
    from alignax.trainers.api import load_config

    with pytest.raises(ConfigError) as info:
        load_config(os.path.join(ROOT, "configs", "tiny-dpo-lora.yaml"), [override])
    assert str(info.value) == message
    with pytest.raises(ConfigError, match=r"^lora: expected LoraConfig \| null, got 5$"):  # not a mapping at all
        load_config(os.path.join(ROOT, "configs", "tiny-dpo-lora.yaml"), ["lora=5"])


def test_a_long_bad_value_is_cut_in_the_message():
    value = "9" * 100_000 + "x"
    with pytest.raises(ConfigError) as info:
        from_dict(Outer, {"name": "n", "limit": value})
    message = str(info.value)
    assert message == f"limit: expected float | null, got '{'9' * 199}... (100,003 characters)"
    with pytest.raises(ConfigError) as info:
        from_dict(Outer, {"name": "n", "x" * 5000: 1})
    assert len(str(info.value)) < 400 and "(5,002 characters)" in str(info.value)


# --- load_callable ----------------------------------------------------------------------


@pytest.fixture
def fake_module(tmp_path, monkeypatch):
    (tmp_path / "fake_rewards_pkg").mkdir()
    (tmp_path / "fake_rewards_pkg" / "__init__.py").write_text("")
    (tmp_path / "fake_rewards_pkg" / "scores.py").write_text(textwrap.dedent("""
        THRESHOLD = 0.5

        def length_score(texts):
            return [len(t) for t in texts]

        class Scorer:
            @staticmethod
            def score(texts):
                return [1.0 for _ in texts]
    """))
    (tmp_path / "fake_rewards_pkg" / "broken.py").write_text("import a_dependency_that_is_not_there\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "fake_rewards_pkg"
    for name in [m for m in sys.modules if m.startswith("fake_rewards_pkg")]:
        del sys.modules[name]


def test_load_callable_finds_functions_and_dotted_attributes(fake_module):
    assert load_callable("fake_rewards_pkg.scores:length_score")(["ab", "c"]) == [2, 1]
    assert load_callable("fake_rewards_pkg.scores:Scorer.score")(["x"]) == [1.0]
    assert load_callable(" fake_rewards_pkg.scores : length_score ")(["abc"]) == [3]
    from alignax.rewards import verifiers
    assert load_callable("alignax.rewards.verifiers:format_reward") is verifiers.format_reward


@pytest.mark.parametrize("spec", ["fake_rewards_pkg.scores", "fake_rewards_pkg.scores.length_score",
                                  "a:b:c", ":length_score", "fake_rewards_pkg.scores:", "pkg/mod:f",
                                  "fake_rewards_pkg.scores:length score", ""])
def test_load_callable_malformed_spec(fake_module, spec):
    with pytest.raises(ConfigError, match=r"callable spec .* is malformed: .*expected 'package.module:function'"):
        load_callable(spec)


def test_load_callable_errors_name_the_spec_and_the_fix(fake_module):
    with pytest.raises(ValueError, match=r"callable spec 'fake_rewards_pkg.nope:f': no module named "
                                         r"'fake_rewards_pkg.nope'; the part before the colon must be an importable"):
        load_callable("fake_rewards_pkg.nope:f")
    with pytest.raises(ConfigError, match=r"no module named 'no_such_pkg_xyz'"):
        load_callable("no_such_pkg_xyz.mod:f")
    with pytest.raises(ConfigError, match=r"'fake_rewards_pkg.scores' has no attribute 'lenght_score'; "
                                          r"did you mean 'fake_rewards_pkg.scores:length_score'\?"):
        load_callable("fake_rewards_pkg.scores:lenght_score")
    with pytest.raises(ConfigError, match=r"'fake_rewards_pkg.scores.Scorer' has no attribute 'scor'; "
                                          r"did you mean 'fake_rewards_pkg.scores:Scorer.score'\?"):
        load_callable("fake_rewards_pkg.scores:Scorer.scor")
    with pytest.raises(ConfigError, match=r"has no attribute 'zzz'$"):
        load_callable("fake_rewards_pkg.scores:zzz")
    with pytest.raises(ConfigError, match=r"'fake_rewards_pkg.scores:THRESHOLD' names a float, not a function"):
        load_callable("fake_rewards_pkg.scores:THRESHOLD")
    with pytest.raises(ConfigError, match=r"module 'fake_rewards_pkg.broken' was found but importing it failed: "
                                          r"No module named 'a_dependency_that_is_not_there'") as info:
        load_callable("fake_rewards_pkg.broken:f")
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


@pytest.mark.parametrize("override,message", [
    ("grpo.off_policy_mask_threshold=0", "grpo.off_policy_mask_threshold must be > 0 nats"),
    ("grpo.off_policy_mask_threshold=-0.1", "grpo.off_policy_mask_threshold must be > 0 nats"),
    ("grpo.top_entropy_quantile=0", r"grpo.top_entropy_quantile must be in \(0, 1\]"),
    ("grpo.top_entropy_quantile=1.5", r"grpo.top_entropy_quantile must be in \(0, 1\]"),
])
def test_a_policy_update_threshold_outside_its_range_is_refused_at_load(override, message):
    """Refused when the config loads, not at the first traced step: a threshold of 0 would mask
    on-policy sequences on the float32 rounding between the pricing pass and the update's own
    forward (two compiled programs of the same weights), so it is not "mask any drift"."""
    from alignax.trainers.api import load_config

    with pytest.raises(ConfigError, match=message):
        load_config(os.path.join(ROOT, "configs", "tiny-grpo.yaml"), [override])
    with pytest.raises(ConfigError, match=message.replace("grpo.", "ppo.")):  # PPO's section, its own name
        load_config(os.path.join(ROOT, "configs", "tiny-ppo.yaml"), [override.replace("grpo.", "ppo.")])
    assert load_config(os.path.join(ROOT, "configs", "tiny-grpo.yaml"),
                       ["grpo.off_policy_mask_threshold=1e-5", "grpo.top_entropy_quantile=1"]).grpo.top_entropy_quantile == 1


@pytest.mark.parametrize("override,message", [
    ("rollout.rejection={token: [0.5]}", "rollout.rejection.token: expected 2 items, got 1"),
    ("rollout.rejection={token: 3}", "rollout.rejection.token: expected a list, got 3"),
    ("rollout.rejection={token: [a, 2]}", "rollout.rejection.token[0]: expected a number, got 'a'"),
    ("rollout.rejection=tokn", "rollout.rejection: expected 'token' | 'sequence' | 'geometric' | "
                               "{str: [float, float]} | null, got 'tokn'"),
])
def test_a_bad_mapping_in_a_union_names_its_entry_and_rule(override, message):
    """``rollout.rejection: Literal[...] | dict[str, tuple[float, float]] | None``: a mapping can
    only be the ``dict`` option, so its entry's own error comes through (it used to read
    ``rollout.rejection: expected 'token' | 'sequence' | 'geometric' | dict | null, got {...}``),
    and the union's message spells the mapping's shape."""
    from alignax.trainers.api import load_config

    with pytest.raises(ConfigError) as info:
        load_config(os.path.join(ROOT, "configs", "tiny-grpo.yaml"), [override])
    assert str(info.value) == message
