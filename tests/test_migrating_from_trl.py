"""docs/migrating-from-trl.md: every alignax key its tables name exists in the run config, and
every ``key: value`` it gives loads (through the config loader and its cross-field rules) under
the algorithm of the key's section."""

from __future__ import annotations

import os
import re

import pytest

from alignax.trainers.api import load_config
from alignax.trainers.validation import schema_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "migrating-from-trl.md")
SECTIONS = {"preference": "dpo", "grpo": "grpo", "ppo": "ppo", "rollout": "grpo", "rewards": "grpo", "data": "dpo",
            "optim": "dpo", "train": "dpo", "precision": "dpo"}
FORMATS = {"dpo": "preference", "grpo": "prompt", "ppo": "prompt"}
KEY = re.compile(r"`((%s)\.[a-z_]+(?:\.[a-z_]+)*)(?::\s*([^`]+))?`" % "|".join(SECTIONS))


def table_rows() -> list[tuple[str, str]]:
    """``(TRL column, alignax column)`` of every table row on the page."""
    rows = []
    for line in open(PAGE, encoding="utf-8").read().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and not set(cells[0]) <= {"-"} and cells[0] != "TRL 1.16":
            rows.append((cells[0], cells[1]))
    return rows


def named_keys() -> list[tuple[str, str | None]]:
    return [(m.group(1), m.group(3)) for _, alignax in table_rows() for m in KEY.finditer(alignax)]


def test_the_tables_name_keys_and_say_what_is_missing():
    rows = table_rows()
    assert len(rows) > 50
    for trl, alignax in rows:
        # each row maps to a key, or says it is missing
        assert KEY.search(alignax) or alignax.startswith(("not yet", "not supported")), (trl, alignax)
    assert len(named_keys()) > 35


@pytest.mark.parametrize("key,value", sorted(set(named_keys()), key=str))
def test_every_alignax_key_loads(key, value):
    assert key in set(schema_keys()), f"docs/migrating-from-trl.md names {key}, which the run config lacks"
    if value is None:
        return
    section, field = key.split(".", 1)
    algorithm = SECTIONS[section]
    data_format = "unpaired" if (key, value) == ("preference.loss", "kto") else FORMATS[algorithm]
    raw = {"algorithm": algorithm, "data": {"format": data_format}}
    # the key's value, as YAML gives it, under its section
    node = raw.setdefault(section, {})
    node[field] = {"true": True, "false": False}.get(value, value)
    config = load_config(data=raw)
    got = getattr(getattr(config, section), field)
    assert str(got) == value or got == pytest.approx(float(value)), (key, got, value)
