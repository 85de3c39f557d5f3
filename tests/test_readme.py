"""README.md and docs/ stay true: every fenced code block is run or checked, every path named exists.

- ```python blocks run as-is, each in a fresh interpreter (its own namespace), from the
  repository root, with the hub offline.
- ```bash blocks train for minutes, so their commands are checked the cheaper way
  tests/docs_commands_check.py describes (make targets exist, ``alignax`` commands parse and
  their configs load, tool scripts accept their options, ``alignax estimate`` runs). A block
  that is a shell program rather than a list of commands (a loop, a quoted program over
  several lines) is checked by ``bash -n``: it parses.
- A ```python block marked ``<!-- fragment -->`` just above (a piece of a larger file) is
  compiled, not run.
- ```yaml blocks are merged into a recipe and must load as a valid config.
- Blocks without a language are drawings (the layout tree): not code, not run.
- Paths into the repository (``tools/...py``, ``configs/...yaml``, ``docs/...``) and relative
  links between pages must exist.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PAGES = [README, *sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))]
FENCE = re.compile(r"^([ \t]*)```(\w*)[ \t]*\n(.*?)^\1```[ \t]*$", re.S | re.M)
# <!-- checked against configs/X.yaml with a.b=c d.e=f --> above a ```yaml block
MARKER = re.compile(r"<!--\s*checked against (\S+)(?: with (.*?))?\s*-->\s*$")
FRAGMENT = re.compile(r"<!--\s*fragment\b.*-->\s*$")
SHELL_KEYWORDS = {"for", "while", "until", "if", "case", "do", "done", "then", "fi", "function"}
DEFAULT_RECIPE = "configs/tiny-grpo.yaml"
MAX_README_LINES = 250
# Pages the README links to that other branches of this round write (configuration: the config
# room; accelerators: installs and the hardware report; reliability: each fault and its test).
def relative(path: str) -> str:
    return os.path.relpath(path, ROOT)


def code_blocks(markdown: str) -> list[dict]:
    """Each fenced block: its language, the heading above it, the fence's line, its code
    (dedented by the fence's indent) and the text just above the fence."""
    blocks = []
    for match in FENCE.finditer(markdown):
        indent, language, body = match.groups()
        before = markdown[: match.start()]
        headings = re.findall(r"^#+[ \t]+(.+?)[ \t]*$", before, re.M)
        code = "".join(line[len(indent):] if line.startswith(indent) else line
                       for line in body.splitlines(keepends=True))
        above = before.rstrip("\n").rsplit("\n", 1)[-1]
        blocks.append({"language": language, "heading": headings[-1] if headings else "(top)",
                       "line": before.count("\n") + 1, "code": code, "above": above})
    return blocks


def page_blocks() -> list[tuple[str, dict]]:
    out = []
    for page in PAGES:
        with open(page, encoding="utf-8") as f:
            out.extend((relative(page), block) for block in code_blocks(f.read()))
    return out


BLOCKS = page_blocks()
PYTHON = [(page, b) for page, b in BLOCKS if b["language"] == "python" and not FRAGMENT.search(b["above"])]
FRAGMENTS = [(page, b) for page, b in BLOCKS if b["language"] == "python" and FRAGMENT.search(b["above"])]


def shell_commands(code: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, blank and comment lines dropped."""
    joined = re.sub(r"[ \t]*\\\n[ \t]*", " ", code)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def is_shell_program(commands: list[str]) -> bool:
    """Whether a block's lines are one shell program (a loop, a quoted program over several
    lines) rather than commands that stand alone."""
    for command in commands:
        try:
            words = shlex.split(command, comments=True)
        except ValueError:  # a quote that closes on a later line
            return True
        if words and (words[0] in SHELL_KEYWORDS or words[-1] in ("&", "do", "then")):
            return True
    return False


def check_items() -> list[tuple[str, dict]]:
    """``(where, item)`` for every shell command (or shell program) and YAML block of the pages."""
    items = []
    for page, block in BLOCKS:
        where = f"{page}:{block['line']}"
        if block["language"] in ("bash", "sh", "shell", "console"):
            commands = shell_commands(block["code"])
            if is_shell_program(commands):
                items.append((where, {"kind": "script", "script": block["code"]}))
            else:
                items.extend((where, {"kind": "shell", "command": c}) for c in commands)
        elif block["language"] in ("yaml", "yml"):
            marker = MARKER.search(block["above"])
            recipe = marker.group(1) if marker else DEFAULT_RECIPE
            overrides = marker.group(2).split() if marker and marker.group(2) else []
            items.append((where, {"kind": "yaml", "snippet": block["code"], "recipe": recipe, "overrides": overrides}))
    return items


ITEMS = check_items()


def test_the_extraction_finds_the_blocks():
    text = ("# A\n```python\nx = 1\n```\ntext\n```bash\nls \\\n  -l  # long\n```\n## B\n- item\n\n  ```python\n"
            "  y = 2\n  ```\n<!-- checked against configs/tiny-dpo.yaml with a=1 b=2 -->\n```yaml\nk: v\n```\n")
    blocks = code_blocks(text)
    assert [(b["language"], b["heading"], b["line"], b["code"]) for b in blocks] == [
        ("python", "A", 2, "x = 1\n"), ("bash", "A", 6, "ls \\\n  -l  # long\n"), ("python", "B", 13, "y = 2\n"),
        ("yaml", "B", 17, "k: v\n")]
    assert shell_commands(blocks[1]["code"]) == ["ls -l  # long"]
    assert MARKER.search(blocks[3]["above"]).groups() == ("configs/tiny-dpo.yaml", "a=1 b=2")
    assert FRAGMENT.search("<!-- fragment: a piece of trainers/api.py -->") and not FRAGMENT.search(blocks[3]["above"])
    assert is_shell_program(["for p in 0 1; do", "done"]) and is_shell_program(['python -c "', 'print(1)"'])
    assert not is_shell_program(["make test", ".venv/bin/alignax train configs/dpo.yaml"])
    assert any(b["heading"] == "Front door 2: the functional core in your own code" for _, b in PYTHON)


def test_every_block_has_a_language_the_test_knows():
    known = {"python", "bash", "sh", "shell", "console", "yaml", "yml", ""}
    unknown = [f"{page}:{b['line']} ```{b['language']}" for page, b in BLOCKS if b["language"] not in known]
    assert not unknown, f"blocks this test neither runs nor checks: {unknown}"


def test_the_readme_is_a_front_door():
    with open(README, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move detail into docs/ (at most " \
                                           f"{MAX_README_LINES})"


def run_block(code: str, tmp_path, suffix: str = "") -> subprocess.CompletedProcess:
    script = tmp_path / "readme_block.py"
    script.write_text(code + suffix, encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_python_fragments_compile():
    for page, block in FRAGMENTS:  # none may be the case: a page with no fragment
        compile(block["code"], f"{page}:{block['line']}", "exec")


@pytest.mark.parametrize("page, block", PYTHON, ids=[f"{p}:{b['line']}" for p, b in PYTHON])
def test_python_block_runs(page, block, tmp_path):
    result = run_block(block["code"], tmp_path)
    assert result.returncode == 0, (
        f"{page}:{block['line']} (under '{block['heading']}') fails as written:\n{result.stderr[-4000:]}")


def test_functional_core_block_computes_what_it_says(tmp_path):
    (code,) = [b["code"] for page, b in PYTHON
               if page == "README.md" and b["heading"] == "Front door 2: the functional core in your own code"
               and "ppo_policy_loss" in b["code"]]
    check = """
import math
assert adv.shape == rewards.shape and grads.shape == logps.shape, (adv.shape, grads.shape)
assert math.isfinite(float(loss)) and float(metrics["kl"]) > 0
assert float(abs(grads * (1 - mask)).max()) == 0.0  # no gradient on padding
"""
    result = run_block(code, tmp_path, check)
    assert result.returncode == 0, result.stderr[-4000:]


def run_checker(items: list[dict]) -> list[dict]:
    """tests/docs_commands_check.py's verdict on each item, in one subprocess."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(items, f)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "docs_commands_check.py"), f.name],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        os.unlink(f.name)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@functools.cache
def checked() -> list[dict]:
    return run_checker([item for _, item in ITEMS])


@pytest.mark.parametrize("index", range(len(ITEMS)), ids=[f"{where}:{i}" for i, (where, _) in enumerate(ITEMS)])
def test_command_or_snippet_is_checked(index):
    where, item = ITEMS[index]
    verdict = checked()[index]
    what = item.get("command") or item.get("snippet") or item.get("script")
    assert verdict["ok"], f"{where}: {what!r}: {verdict['why']}"


def test_the_checker_fails_what_is_wrong():
    """The check is not vacuous: a misspelt option, a wrong key, a missing target, a missing
    script, a command it has no check for, a wrong YAML key and a shell program that does not
    parse each fail; a right command and a shell program that parses pass."""
    verdicts = run_checker([
        {"kind": "shell", "command": ".venv/bin/python tools/studies/fsdp_memory.py --no-such-flag"},
        {"kind": "shell", "command": ".venv/bin/alignax train configs/tiny-dpo.yaml train.no_such_key=1"},
        {"kind": "shell", "command": "make no-such-target"},
        {"kind": "shell", "command": "python tools/no_such_tool.py"},
        {"kind": "shell", "command": "curl https://example.com"},
        {"kind": "yaml", "snippet": "rollout: {no_such_key: 1}\n", "recipe": DEFAULT_RECIPE, "overrides": []},
        {"kind": "script", "script": "for p in 0 1; do\n  echo $p\n"},
        {"kind": "shell", "command": "HF_HUB_OFFLINE=1 nice -n 19 .venv/bin/python tools/studies/fsdp_memory.py "
                                     "--devices 8 --programs dpo"},
        {"kind": "script", "script": "for p in 0 1; do\n  echo \"$p\n\" &\ndone; wait\n"},
    ])
    assert [v["ok"] for v in verdicts] == [False] * 7 + [True] * 2, verdicts
    assert "no-such-flag" in verdicts[0]["why"] and "no_such_key" in verdicts[1]["why"], verdicts


def is_module_attribute(path: str) -> bool:
    """``tests/test_x.some_function``: a name inside a module that exists."""
    module = path.split(".", 1)[0] + ".py"
    return "." in path and not path.endswith(".py") and os.path.isfile(os.path.join(ROOT, module))


PATH = re.compile(r"(?<![\w./-])((?:tools|configs|docs|notebooks|tests|alignax)/[\w./*<>-]*)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize("page", [relative(p) for p in PAGES])
def test_every_path_and_link_exists(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        text = f.read()
    # a pattern (tiny-*.yaml) or a placeholder (<out>) names no one file; what a command
    # writes (--out PATH) need not exist yet
    named = {m.group(1).rstrip(".-") for m in PATH.finditer(text)
             if "*" not in m.group(1) and "<" not in m.group(1)
             and not re.search(r"--out[ =]$", text[max(0, m.start() - 6):m.start()])}
    linked = {os.path.normpath(os.path.join(os.path.dirname(page), target))
              for target in LINK.findall(text) if "://" not in target}
    missing = sorted(p for p in named | linked
                     if not os.path.exists(os.path.join(ROOT, p)) and not is_module_attribute(p))
    assert not missing, f"{page} names paths that do not exist: {missing}"
