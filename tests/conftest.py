"""Test-session settings, applied before jax is first imported.

- No hub access: HF_HUB_OFFLINE=1 (the Makefile sets it too; set here so a bare
  ``pytest`` behaves the same).
- A persistent XLA compilation cache under .pytest_cache: many tests compile the same
  tiny-model programs (init, train step, eval), and both xdist workers and the
  subprocess mesh checks share it, so each is compiled once per session.
- Cheaper CPU code generation: the suite's models are tiny, so compiling dominates and
  running is cheap. LLVM at optimisation level 0 cuts a trainer test's time by about a
  third (39 s -> 25 s for the KTO reference test); XLA CPU's classic elemental emitters
  instead of its MLIR fusion emitters (``--xla_cpu_use_fusion_emitters=false``) halve
  XLA's compile time again (test_kl.py plus one trainer test: 23 s -> 11.5 s of backend
  compile). Both are about how XLA turns the program into CPU code; the numeric tests pass
  under them (one float64 comparison in the ops tests allows 5e-6 for level 0's summation
  order; the emitter flag needed no tolerance change). Subprocess checks inherit both
  (tests/fake_devices.py). The emitter flag is gone from the XLA of jaxlib 0.11 (where an
  unknown XLA flag ends the process: "Unknown flag in XLA_FLAGS" on 0.11.2), so it is set
  for older jaxlib only.
"""

import os
from importlib.metadata import version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(ROOT, ".pytest_cache", "jax-compilation"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
FAST_CODEGEN = ["--xla_backend_optimization_level=0"]
if tuple(int(part) for part in version("jaxlib").split(".")[:2]) < (0, 11):
    FAST_CODEGEN.append("--xla_cpu_use_fusion_emitters=false")
for _flag in FAST_CODEGEN:
    if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def toy_model(tmp_path_factory):
    """The toy word-level model folder (tests/support/toy_model.py), written once per session."""
    from tests.support.toy_model import make_toy_model

    return make_toy_model(tmp_path_factory.mktemp("toy-model"))


@pytest.fixture(scope="session")
def toy_moe_model(tmp_path_factory):
    """The toy model as a Qwen3-MoE (4 experts, top 2; tests/support/toy_model.py)."""
    from tests.support.toy_model import make_toy_model

    return make_toy_model(tmp_path_factory.mktemp("toy-moe-model"), experts=4)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under ``--dist loadgroup``, a test without an ``xdist_group`` of its own joins its
    file's group: a file's module fixtures and caches (a trained run, a model, its jitted
    programs) are built once, on one worker, instead of on each worker its tests land on
    (measured before: 16 files split over both workers). Runs before xdist reads the marks."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(os.path.splitext(os.path.basename(str(item.fspath)))[0]))


# Where the suite's time goes: with ALIGNAX_TEST_JAX_TIMES=FILE, each test appends one JSON
# line to FILE with its wall time and the seconds jax spent tracing, lowering to MLIR and
# compiling (XLA) in this process (subprocess checks are not seen), and the CPU seconds it
# used: its own ("cpu") and those of the subprocesses it waited for ("cpu_children"), which
# a loaded machine does not inflate as it does wall time. Used to find what to trim; off by
# default.
_JAX_TIMES = os.environ.get("ALIGNAX_TEST_JAX_TIMES")
if _JAX_TIMES:
    import json
    import resource
    import time
    from collections import defaultdict

    _spent: dict = defaultdict(float)

    def _listen(event: str, duration: float, **_) -> None:
        _spent[event.rsplit("/", 1)[-1]] += duration

    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_listen)

    def _cpu(who: int) -> float:
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        _spent.clear()
        start, cpu, children = time.perf_counter(), _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
        yield
        row = {"test": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", ""),
               "wall": round(time.perf_counter() - start, 3),
               "cpu": round(_cpu(resource.RUSAGE_SELF) - cpu, 3),
               "cpu_children": round(_cpu(resource.RUSAGE_CHILDREN) - children, 3),
               **{k: round(v, 3) for k, v in _spent.items()}}
        with open(_JAX_TIMES, "a") as f:
            f.write(json.dumps(row) + "\n")

