"""Run a check script on 8 fake CPU devices in a subprocess.

XLA's fake device count must be set before jax is imported, and the test process has
already imported it, so mesh checks live in scripts that print one JSON line of measured
results (and exit non-zero on a failed check).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def subprocess_env(devices: int, **extra: str) -> dict:
    """This process's environment for a child on ``devices`` fake CPU devices (the suite's
    other XLA flags kept), with the repository importable."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}",
                PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]), **extra)


def json_objects(text: str) -> list[dict]:
    """The JSON objects a check printed to stdout, in order. Libraries write to the same
    stdout from threads of their own (gloo announces its peers), on lines of their own or
    between a result and ``print``'s newline (seen: ``{...}[Gloo] Rank 0 is connected to 1
    peer ranks``), so each object is read from its first brace to its end (``raw_decode``)
    rather than as a whole line."""
    decoder, found = json.JSONDecoder(), []
    for line in text.splitlines():
        start = line.find("{")
        while start != -1:
            try:
                obj, end = decoder.raw_decode(line, start)
            except ValueError:
                start = line.find("{", start + 1)
                continue
            if isinstance(obj, dict):
                found.append(obj)
            start = line.find("{", end)
    return found


def last_json_line(text: str) -> dict:
    """The last JSON object of a check's stdout: its result (see :func:`json_objects`)."""
    return json_objects(text)[-1]


def run_check(script: str, *args: str, devices: int = 8, timeout: int = 900) -> dict:
    env = subprocess_env(devices)
    proc = subprocess.run([sys.executable, os.path.join(HERE, script), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return last_json_line(proc.stdout)


# The (2, 2, 2) mesh equalities against one device, each a check script of tests/. They run
# together in one subprocess (tests/mesh_checks.py): one interpreter start and one import for
# all. The tests that read them carry ``xdist_group("mesh-equality")`` so that one worker runs
# the subprocess once.
MESH_EQUALITIES = ("mesh_dpo_check", "mesh_dpo_check:--lora", "mesh_grpo_check", "mesh_ppo_check",
                   "mesh_agent_check")


@functools.cache
def _mesh_equalities() -> dict:
    return run_check("mesh_checks.py", *MESH_EQUALITIES, timeout=1800)


def mesh_equality(check: str) -> dict:
    """What check script ``check`` (an entry of MESH_EQUALITIES) measured."""
    return _mesh_equalities()[check]


def leave_processes() -> None:
    """End a multi-process check once every process has printed its results: a barrier
    over all processes, then exit without ``jax.distributed``'s shutdown at interpreter
    exit. That shutdown races when the processes finish together: seen twice in full suite
    runs, process 0 (the coordination service's host) exited first and process 1 then
    waited 150 s in its shutdown for a service that was gone (tests/test_multislice.py
    took 154 s instead of 3-9 s). The barrier keeps every process's output complete."""
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() > 1:
        multihost_utils.sync_global_devices("check done")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

