"""Typed YAML configs: values checked against annotations, errors naming the key."""

import dataclasses
from typing import Literal

import pytest

from alignax.config import ConfigError, apply_overrides, from_dict, to_dict


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
