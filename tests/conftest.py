"""Test-session settings, applied before jax is first imported.

- No hub access: HF_HUB_OFFLINE=1 (the Makefile sets it too; set here so a bare
  ``pytest`` behaves the same).
- A persistent XLA compilation cache under .pytest_cache: many tests compile the same
  tiny-model programs (init, train step, eval), and both xdist workers and the
  subprocess mesh checks share it, so each is compiled once per session.
- LLVM at optimisation level 0 for the generated CPU code: the suite's models are tiny, so
  compiling dominates and running is cheap; level 0 cuts a trainer test's time by about a
  third (39 s -> 25 s for the KTO reference test) and changes no HLO pass, only how the
  CPU code is generated. Subprocess checks inherit it (tests/fake_devices.py).
"""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(ROOT, ".pytest_cache", "jax-compilation"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
FAST_CODEGEN = "--xla_backend_optimization_level=0"
if FAST_CODEGEN not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_CODEGEN}".strip()


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def toy_model(tmp_path_factory):
    """The toy word-level model folder (tests/toy_model.py), written once per session."""
    from tests.toy_model import make_toy_model

    return make_toy_model(tmp_path_factory.mktemp("toy-model"))
