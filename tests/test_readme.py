"""The README's Python stays true: every ```python block runs as-is.

Each block runs in a fresh interpreter (its own namespace, no state from other tests),
from the repository root, with the hub offline.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def python_blocks(markdown: str) -> list[tuple[str, int, str]]:
    """``(heading above the block, line number of the fence, code)`` per ```python block."""
    blocks = []
    for match in FENCE.finditer(markdown):
        before = markdown[: match.start()]
        headings = re.findall(r"^#+[ \t]+(.+?)[ \t]*$", before, re.M)
        blocks.append((headings[-1] if headings else "(top)", before.count("\n") + 1, match.group(1)))
    return blocks


with open(README, encoding="utf-8") as _f:
    BLOCKS = python_blocks(_f.read())


def test_the_extraction_finds_the_blocks():
    assert python_blocks("# A\n```python\nx = 1\n```\ntext\n```bash\nls\n```\n## B\n```python\ny = 2\n```\n") == [
        ("A", 2, "x = 1\n"), ("B", 10, "y = 2\n")]
    assert any(heading == "The functional core in your own code" for heading, _, _ in BLOCKS)


def run_block(code: str, tmp_path, suffix: str = "") -> subprocess.CompletedProcess:
    script = tmp_path / "readme_block.py"
    script.write_text(code + suffix, encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("heading, line, code", BLOCKS, ids=[f"line{line}" for _, line, _ in BLOCKS])
def test_readme_python_block_runs(heading, line, code, tmp_path):
    result = run_block(code, tmp_path)
    assert result.returncode == 0, (
        f"README.md:{line} (under '{heading}') fails as written:\n{result.stderr[-4000:]}")


def test_functional_core_block_computes_what_it_says(tmp_path):
    (code,) = [c for heading, _, c in BLOCKS if heading == "The functional core in your own code"]
    check = """
import math
assert adv.shape == rewards.shape and grads.shape == logps.shape, (adv.shape, grads.shape)
assert math.isfinite(float(loss)) and float(metrics["kl"]) > 0
assert float(abs(grads * (1 - mask)).max()) == 0.0  # no gradient on padding
"""
    result = run_block(code, tmp_path, check)
    assert result.returncode == 0, result.stderr[-4000:]
