"""``algorithm: kto | simpo | cpo | orpo | ipo``: the names TRL users reach for, each the dpo
entry with its loss set (alignax.trainers.algorithms.ALIASES)."""

from __future__ import annotations

import pytest

from alignax import config as config_io
from alignax.config import ConfigError
from alignax.trainers.algorithms import ALGORITHMS, ALIASES
from alignax.trainers.api import load_config

BASE = {"output_dir": "runs/x", "data": {"paths": ["pairs.jsonl"], "format": "preference"}}


@pytest.mark.parametrize(("alias", "keys"), [
    ("kto", {"loss": "kto"}), ("simpo", {"loss": "simpo"}), ("cpo", {"loss": "cpo"}), ("orpo", {"loss": "orpo"}),
    ("ipo", {"loss": "dpo", "variant": "ipo"}),
])
def test_an_alias_loads_as_the_dpo_entry_with_its_loss(alias, keys):
    data = {**BASE, "data": {**BASE["data"], "format": "unpaired" if alias == "kto" else "preference"}}
    got = load_config(data={**data, "algorithm": alias})
    want = load_config(data={**data, "algorithm": "dpo", "preference": keys})
    assert got == want and got.algorithm == "dpo"
    assert config_io.to_dict(got) == config_io.to_dict(want)  # config.yaml: the expanded form


def test_an_alias_with_its_other_keys_and_a_conflicting_loss():
    got = load_config(data={**BASE, "algorithm": "simpo", "preference": {"simpo_gamma": 0.7}})
    assert (got.preference.loss, got.preference.simpo_gamma) == ("simpo", 0.7)
    with pytest.raises(ConfigError, match="algorithm: orpo is algorithm: dpo with preference.loss: orpo; the recipe "
                                          "sets preference.loss: kto"):
        load_config(data={**BASE, "algorithm": "orpo", "preference": {"loss": "kto"}})
    # the alias by override, as `alignax train recipe.yaml algorithm=ipo` gives it
    assert load_config(data={**BASE, "algorithm": "dpo"}, overrides=("algorithm=ipo",)).preference.variant == "ipo"


def test_aliases_are_not_entries_and_an_unknown_name_lists_both():
    assert not set(ALIASES) & set(ALGORITHMS)
    assert all(target in ALGORITHMS for target, _ in ALIASES.values())
    with pytest.raises(ConfigError, match="'nope' is not a valid choice; valid: .*'dpo'.*'kto'.*'ipo'"):
        load_config(data={**BASE, "algorithm": "nope"})
