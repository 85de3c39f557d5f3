"""Installs for the hardware a run is named for: the accelerator extras resolve against their
pins (on PyPI), the pins follow constraints.txt's jax, ``make install-gpu`` / ``install-tpu``
install them, the launch recipes call those installs and require an accelerator, and a
``gs://`` path without gcsfs names the extra that installs it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

from alignax import paths
from alignax.config import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools", "launch"))
import accelerator_pins  # noqa: E402  (tools/launch is no package)


@pytest.mark.registry
@pytest.mark.xdist_group("registry")
def test_the_accelerator_extras_resolve_against_their_pins_on_pypi():
    """``pip install --dry-run`` of alignax[cuda12] + alignax[tpu] under both constraint
    files (wheel metadata from PyPI, ~30 s): a pin the registry lacks, a conflict, or a
    package the extras bring that no file pins fails here; so does an unreachable registry."""
    resolved = accelerator_pins.check()
    jax = accelerator_pins.pins(accelerator_pins.CONSTRAINTS)["jax"]
    assert resolved["jax"] == resolved["jaxlib"] == jax
    assert resolved["jax-cuda12-plugin"] == resolved["jax-cuda12-pjrt"] == jax
    assert "nvidia-cudnn-cu12" in resolved and "libtpu" in resolved and "gcsfs" in resolved


def test_the_pins_follow_constraints_jax():
    """Offline: constraints-accel.txt's plugin is constraints.txt's jax, its libtpu is the one
    the installed jax's ``tpu`` extra asks for, and no package is pinned in both files."""
    cpu = accelerator_pins.pins(accelerator_pins.CONSTRAINTS)
    accel = accelerator_pins.pins(accelerator_pins.ACCEL_CONSTRAINTS)
    assert accel["jax-cuda12-plugin"] == accel["jax-cuda12-pjrt"] == cpu["jax"]
    assert not set(cpu) & set(accel)
    # the installed jax's own tpu extra names the libtpu it takes: read in the pinned venv (make
    # install); `make test-latest` runs another jax on purpose, whose extra is not the pins'
    if importlib.metadata.version("jax") == cpu["jax"]:
        wants = [Requirement(r) for r in importlib.metadata.requires("jax")]
        (libtpu,) = [r for r in wants if r.name == "libtpu" and r.marker.evaluate({"extra": "tpu"})]
        assert libtpu.specifier.contains(accel["libtpu"]), (libtpu, accel["libtpu"])
    else:
        assert os.path.basename(os.path.dirname(os.path.dirname(sys.executable))).startswith(".venv-"), (
            f"jax {importlib.metadata.version('jax')} is not constraints.txt's {cpu['jax']} outside a "
            "make test-latest venv: the pinned install is not what the pins say")
    assert accelerator_pins.extra_requirements("tpu") == ["jax[tpu]", "gcsfs"]
    assert accelerator_pins.extra_requirements("cuda12") == ["jax[cuda12]"]


def test_make_install_gpu_and_tpu_install_the_extras_with_both_pin_files():
    for target, extra in (("install-gpu", "cuda12"), ("install-tpu", "tpu")):
        plan = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        (install,) = [line for line in plan.splitlines() if "pip install" in line and "-e " in line]
        assert f"-e '.[{extra}]'" in install, install
        assert "-c constraints.txt -c constraints-accel.txt" in install, install
        assert "[test]" not in plan  # a pod does not install the test suite's torch


def test_the_launch_recipes_call_the_accelerator_install_and_require_an_accelerator():
    with open(os.path.join(ROOT, "tools", "launch", "tpu_vm.sh"), encoding="utf-8") as f:
        tpu = f.read()
    with open(os.path.join(ROOT, "tools", "launch", "slurm.sbatch"), encoding="utf-8") as f:
        slurm = f.read()
    code = [[line for line in text.splitlines() if not line.lstrip().startswith("#")] for text in (tpu, slurm)]
    for lines, target in zip(code, ("install-tpu", "install-gpu")):
        installs = [m for line in lines for m in re.findall(r"make (?:-C \S+ )?([\w-]+)", line)]
        assert installs == [target], installs  # the accelerator install, never the CPU one
        (train,) = [line for line in lines if "alignax train" in line]
        assert train.rstrip('"').endswith("distributed.require_accelerator=true"), train


def test_a_gs_path_without_gcsfs_names_the_extra(monkeypatch):
    if importlib.util.find_spec("gcsfs") is not None:
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gcsfs" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^gs://bucket/run needs the gcsfs package.*pip install 'alignax\[gcs\]'"):
        paths.as_path("gs://bucket/run")
    assert str(paths.as_path("s3://bucket/run")) == "s3://bucket/run"  # other stores: etils' own message
