"""The start-up hardware report (:mod:`alignax.parallel.hardware`): it names the platform,
warns of what only an accelerator does while on CPU, and ``distributed.require_accelerator``
refuses a CPU run in one line with exit 2 before anything is written."""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import jax
import pytest

from alignax.estimate import PEAK_FLOPS
from alignax.parallel import hardware
from tests.test_cli import run_cli, write_recipe


def _config(attention="xla", shape=(1, 1, 1), dcn_shape=None, require=False):
    return SimpleNamespace(model=SimpleNamespace(attention=attention), mesh=SimpleNamespace(shape=shape,
                           dcn_shape=dcn_shape), distributed=SimpleNamespace(require_accelerator=require))


def test_the_start_up_report_names_platform_kind_and_counts(caplog):
    with caplog.at_level(logging.INFO, logger="alignax"):
        found = hardware.announce(_config(attention="cudnn"))
    assert found.platform == "cpu" and found.device_kind == jax.local_devices()[0].device_kind
    want = (f"hardware: platform cpu ({found.device_kind}), {jax.local_device_count()} local device(s) of "
            f"{jax.device_count()}, process 0 of 1")
    assert want in caplog.messages
    assert "hardware: model.attention=cudnn needs a GPU (cuDNN); this run is on CPU" in caplog.messages


def test_cpu_warnings_name_the_keys_and_accelerators_get_none():
    cpu = hardware.Hardware("cpu", "cpu", local_devices=8, devices=8, processes=1, process_index=0)
    gpu = dataclasses.replace(cpu, platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
    assert hardware.cpu_warnings(cpu, attention="xla", mesh_shape=(8, 1, 1), dcn_shape=None) == []  # data parallel
    (splash,) = hardware.cpu_warnings(cpu, attention="splash", mesh_shape=(8, 1, 1), dcn_shape=None)
    assert splash.startswith("model.attention=splash needs a TPU")
    (fsdp,) = hardware.cpu_warnings(cpu, attention="xla", mesh_shape=(2, -1, 1), dcn_shape=None)
    assert fsdp.startswith("mesh.shape=[2, -1, 1] splits the model over 4 CPU devices")
    (slices,) = hardware.cpu_warnings(cpu, attention="xla", mesh_shape=(1, 1, 1), dcn_shape=(2, 1, 1))
    assert slices.startswith("mesh.dcn_shape=[2, 1, 1] is a multi-slice mesh")
    assert hardware.cpu_warnings(gpu, attention="cudnn", mesh_shape=(1, 4, 2), dcn_shape=(2, 1, 1)) == []


@pytest.mark.parametrize("kind, key", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                       ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA H100 PCIe", None),
                                       ("TPU v4", "v4"), ("TPU v5 lite", "v5e"), ("TPU v5", "v5p"),
                                       ("TPU v6 lite", "v6e"), ("cpu", None)])
def test_device_kinds_map_to_the_peak_tables(kind, key):
    assert hardware.chip(kind) == key
    assert set(hardware.HBM_BANDWIDTH) == set(PEAK_FLOPS)


def test_require_accelerator_refuses_a_cpu_run_in_one_line_with_exit_2(tmp_path, capsys):
    recipe = write_recipe(tmp_path, str(tmp_path / "no-model-is-read"))
    code, err = run_cli(capsys, "train", str(recipe), "distributed.require_accelerator=true")
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(
        "alignax: config error: distributed.require_accelerator=true, but this run is on CPU"), err
    assert not (tmp_path / "run").exists()  # refused before output_dir was claimed
