"""The accelerator extras' exact versions: resolve them against the registry, write or check
``constraints-accel.txt``.

``pyproject.toml`` names the extras (``cuda12``: jax's CUDA 12 plugin with its cuDNN, cuBLAS
and NCCL wheels; ``tpu``: libtpu and ``gcs``; ``gcs``: gcsfs for ``gs://`` paths) with jax's
own extras, which pin the plugin to jax's version. ``constraints.txt`` pins jax (the CPU set
``make install`` freezes); ``constraints-accel.txt`` pins every further package those extras
bring, so ``make install-gpu`` / ``make install-tpu`` install one known set.

    python3 tools/launch/accelerator_pins.py            # check: the pins resolve (needs PyPI)
    python3 tools/launch/accelerator_pins.py --write    # regenerate constraints-accel.txt

A check resolves the extras with both constraint files through ``pip install --dry-run``
(wheel metadata only, nothing installed; about 30 s): a pin the registry lacks, or one that
conflicts with another, fails it. An unreachable registry is an error, never a pass.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXTRAS = ("cuda12", "tpu")
CONSTRAINTS = os.path.join(ROOT, "constraints.txt")
ACCEL_CONSTRAINTS = os.path.join(ROOT, "constraints-accel.txt")
HEADER = """\
# Exact versions of what the accelerator extras (alignax[cuda12], alignax[tpu]) add to
# constraints.txt's set, for its jax. `make install-gpu` / `make install-tpu` install with both
# files; regenerate with `make constraints-accel` (tools/launch/accelerator_pins.py --write).
"""


def normalise(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: str) -> dict[str, str]:
    """``{name: version}`` of a constraints file's ``name==version`` lines."""
    found = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if "==" in line:
                name, version = line.split("==", 1)
                found[normalise(name)] = version.strip()
    return found


def extra_requirements(extra: str) -> list[str]:
    """The requirement strings of ``alignax[extra]`` from pyproject.toml, with references to
    alignax's own extras (``alignax[gcs]``) expanded."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    if extra not in extras:
        raise KeyError(f"pyproject.toml has no extra {extra!r}; extras: {', '.join(extras)}")
    out = []
    for requirement in extras[extra]:
        own = re.fullmatch(r"alignax\[([\w,-]+)\]", requirement.replace(" ", ""))
        out += [r for name in own.group(1).split(",") for r in extra_requirements(name)] if own else [requirement]
    return out


def resolve(requirements: list[str], constraint_files: list[str], *, timeout_s: int = 300) -> dict[str, str]:
    """``{name: version}`` of everything pip would install for ``requirements`` under the
    constraint files, on this interpreter's platform (wheel metadata only), names as their
    metadata spells them (as ``pip freeze`` prints them). A pip failure
    (no such version, a conflict, an unreachable registry) raises with pip's last lines."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                   "--disable-pip-version-check", "--report", report, *requirements]
        for path in constraint_files:
            command += ["-c", path]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as err:
            raise RuntimeError(f"pip did not resolve {requirements} in {timeout_s} s (is PyPI reachable?)") from err
        if done.returncode != 0 or not os.path.exists(report):
            tail = "\n".join(line for line in done.stderr.splitlines() if "is ignored: it is neither" not in line)
            raise RuntimeError(f"pip could not resolve {requirements} with {constraint_files} "
                               f"(exit {done.returncode}; is PyPI reachable?):\n{tail[-3000:]}")
        with open(report, encoding="utf-8") as f:
            installed = json.load(f)["install"]
    return {item["metadata"]["name"]: item["metadata"]["version"] for item in installed}


def accelerator_requirements() -> list[str]:
    return [r for extra in EXTRAS for r in extra_requirements(extra)]


def write() -> dict[str, str]:
    """Resolve the extras under constraints.txt alone and write what they add."""
    cpu = pins(CONSTRAINTS)
    resolved = resolve(accelerator_requirements(), [CONSTRAINTS])
    added = {name: version for name, version in sorted(resolved.items(), key=lambda item: normalise(item[0]))
             if normalise(name) not in cpu}
    with open(ACCEL_CONSTRAINTS, "w", encoding="utf-8") as f:
        f.write(HEADER + "".join(f"{name}=={version}\n" for name, version in added.items()))
    return added


def check() -> dict[str, str]:
    """Resolve the extras under both files; every package they add must be pinned in
    constraints-accel.txt at the version resolved. Returns the resolution, by normalised name."""
    cpu, accel = pins(CONSTRAINTS), pins(ACCEL_CONSTRAINTS)
    resolved = {normalise(name): version for name, version in
                resolve(accelerator_requirements(), [CONSTRAINTS, ACCEL_CONSTRAINTS]).items()}
    unpinned = sorted(f"{name}=={version}" for name, version in resolved.items() if name not in cpu | accel)
    if unpinned:
        raise RuntimeError(f"constraints-accel.txt does not pin {', '.join(unpinned)}: run make constraints-accel")
    return resolved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="regenerate constraints-accel.txt")
    args = parser.parse_args()
    result = write() if args.write else check()
    print(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
