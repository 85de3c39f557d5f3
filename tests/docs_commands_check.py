"""Check the shell commands and YAML snippets of README.md and docs/ without running them.

Run in a subprocess by tests/test_readme.py (one interpreter and one import of jax for
all of them): reads a JSON list of ``{"kind": "shell" | "yaml", ...}`` items from the file
named by ``argv[1]`` and prints one JSON line, a list of ``{"ok": bool, "why": str}`` in
the same order. What "checked" means per command, since most of them train for minutes:

- ``make TARGET``: the Makefile defines TARGET.
- ``alignax SUBCOMMAND ...``: ``alignax.cli.main`` parses the command and loads the config
  with its overrides (every key, type and cross-field rule); ``train``, ``eval`` and
  ``export`` stop there, ``estimate`` runs (it is arithmetic, milliseconds); ``generate``
  and ``judge`` parse their flags and stop before reading a model (``eval --suite`` after
  checking its flags and suite names), ``label`` and ``best-of-n`` load their recipe.
- ``python tools/....py ...``: the script runs up to its ``argparse`` call, which parses
  the command's options and stops it (an unknown or misspelt option fails).
- a shell program (``{"kind": "script"}``: a loop, a quoted program over several lines):
  ``bash -n`` parses it.
- a YAML snippet: each top-level key, as its own alternative, merged into the recipe its
  marker names (``<!-- checked against configs/X.yaml with a.b=c -->`` just above the
  fence; default ``configs/tiny-grpo.yaml``) must load as a valid config.

Anything else is a failure asking for a check, so that no block goes unchecked.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Checked(BaseException):
    """Raised where a command would start its real work: everything before it passed."""


def makefile_targets() -> set[str]:
    with open(os.path.join(ROOT, "Makefile"), encoding="utf-8") as f:
        return set(re.findall(r"^([A-Za-z][\w-]*):", f.read(), re.M))


def strip_wrappers(words: list[str]) -> list[str]:
    """The command without ``VAR=value`` prefixes, ``env``, ``nice -n N`` and ``/usr/bin/time -v``."""
    while words:
        if re.fullmatch(r"[A-Za-z_]\w*=.*", words[0], re.S) or words[0] == "env":  # a quoted value may hold spaces
            words = words[1:]
        elif words[0] == "nice":
            words = words[3:] if words[1:2] == ["-n"] else words[1:]
        elif words[0] == "/usr/bin/time":
            words = words[2:] if words[1:2] == ["-v"] else words[1:]
        else:
            return words
    return words


def check_cli(argv: list[str]) -> str | None:
    from alignax import cli, eval_suites, generate, judging, math_shepherd
    from alignax.trainers import api

    def stop(*args, **kwargs):
        raise Checked

    def suites_then_stop(source, suites, out, options, **kwargs):
        eval_suites.resolve(suites)  # the suite names (the flags were checked before)
        raise Checked

    def label_after_config(recipe, solutions, out, *, overrides=(), **kwargs):
        api.load_config(recipe, overrides)  # the recipe and its overrides load
        raise Checked

    saved = (api.train, api.evaluate, api.export, generate.run, judging.run, math_shepherd.label_file,
             generate.best_of_n_file, eval_suites.run)
    api.train = api.evaluate = api.export = generate.run = judging.run = stop
    math_shepherd.label_file = generate.best_of_n_file = label_after_config
    eval_suites.run = suites_then_stop
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            code = cli.main(argv)
    except Checked:
        return None
    except SystemExit as exit_:  # argparse: a bad command line
        return f"exit {exit_.code}: {err.getvalue()[-1000:]}"
    finally:
        (api.train, api.evaluate, api.export, generate.run, judging.run, math_shepherd.label_file,
         generate.best_of_n_file, eval_suites.run) = saved
    return None if code == 0 else f"exit {code}: {err.getvalue()[-1000:]}"


def check_script(script: str, argv: list[str]) -> str | None:
    path = os.path.join(ROOT, script)
    if not os.path.isfile(path):
        return f"{script} does not exist"
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Checked

    argparse.ArgumentParser.parse_args = parse_then_stop
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv, sys.path[0:0] = [path, *argv], [os.path.dirname(path)]
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            runpy.run_path(path, run_name="__main__")
    except Checked:
        return None
    except SystemExit as exit_:
        return f"exit {exit_.code}: {err.getvalue()[-1000:]}"
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv, sys.path[:] = saved_argv, saved_path
    return f"{script} ran to the end without parsing its command line: no check applies"


def check_shell(command: str) -> str | None:
    words = strip_wrappers(shlex.split(command, comments=True))
    if not words:
        return None
    program, args = words[0], words[1:]
    if program == "make":
        missing = [t for t in args if not t.startswith("-") and "=" not in t and t not in makefile_targets()]
        return f"the Makefile has no target {missing}" if missing else None
    if os.path.basename(program) == "alignax":
        return check_cli(args)
    if os.path.basename(program).startswith("python") and args and args[0].endswith(".py"):
        return check_script(args[0], args[1:])
    return f"no check for {program!r}: add one to tests/docs_commands_check.py"


def check_yaml(snippet: str, recipe: str, overrides: list[str]) -> str | None:
    import yaml

    from alignax import config as config_io
    from alignax.trainers import api
    from tests.support.trainer_helpers import merge_sections

    # each top-level key with its indented lines is one alternative (a block may show two ways)
    alternatives = re.split(r"\n(?=[A-Za-z_])", snippet.strip())
    for alternative in alternatives:
        try:
            data = merge_sections(config_io.load_yaml(os.path.join(ROOT, recipe)), yaml.safe_load(alternative))
            api.load_config(data=config_io.apply_overrides(data, overrides))
        except Exception as err:  # noqa: BLE001 - reported with the snippet that failed
            return f"{alternative.strip()!r} on {recipe} {overrides}: {type(err).__name__}: {err}"
    return None


def check_script_syntax(script: str) -> str | None:
    done = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=60)
    return None if done.returncode == 0 else f"bash -n: {done.stderr.strip()[-1000:]}"


def check(item: dict) -> str | None:
    if item["kind"] == "shell":
        return check_shell(item["command"])
    if item["kind"] == "script":
        return check_script_syntax(item["script"])
    return check_yaml(item["snippet"], item["recipe"], item["overrides"])


def main() -> None:
    os.chdir(ROOT)
    with open(sys.argv[1], encoding="utf-8") as f:
        items = json.load(f)
    results = []
    for item in items:
        try:
            why = check(item)
        except Exception as err:  # noqa: BLE001 - one bad command must not hide the others
            why = f"{type(err).__name__}: {err}"
        results.append({"ok": why is None, "why": why or ""})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
