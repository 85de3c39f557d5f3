"""Run several mesh check scripts in one process on 8 fake CPU devices.

    python tests/mesh_checks.py mesh_dpo_check mesh_dpo_check:--lora mesh_grpo_check ...

Each argument names a check module of tests/ (``module`` or ``module:--flag``); its ``main``
runs with that flag as its command line and its one JSON line is collected. Prints one JSON
line ``{argument: result}``. One interpreter start and one import of jax, flax and alignax
serve all the (2, 2, 2) mesh equalities (tests/fake_devices.mesh_equality).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys

from tests.fake_devices import last_json_line


def main() -> int:
    results = {}
    for spec in sys.argv[1:]:
        name, _, flag = spec.partition(":")
        module = importlib.import_module(f"tests.{name}")
        out = io.StringIO()
        sys.argv = [module.__file__, *([flag] if flag else [])]
        with contextlib.redirect_stdout(out):
            code = module.main()
        if code:
            print(out.getvalue()[-2000:], file=sys.stderr)
            return code
        results[spec] = last_json_line(out.getvalue())
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
