"""tools/examples/own_loop.py, the README's loop of your own over the public seam, runs for
an offline and an online recipe (test_readme only checks that its options parse)."""

import math
import os
import re

import pytest

from tests.support.tools import load_tool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def own_loop():
    return load_tool("examples/own_loop.py")


@pytest.mark.parametrize("recipe, figure", [("tiny-dpo", "loss"), ("tiny-grpo", "reward/total")])
def test_own_loop_steps_a_recipe_through_start_and_step(tmp_path, capsys, recipe, figure):
    own_loop().main([os.path.join(ROOT, "configs", f"{recipe}.yaml"), f"output_dir={tmp_path}", "--steps", "2"])
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split(":")[0] for s in steps] == ["step 1", "step 2"], lines
    for line in steps:
        value = float(re.search(rf"{re.escape(figure)}=(\S+)", line).group(1))
        assert math.isfinite(value), line
