"""What hardware a run is on, said once at start-up, and the refusal of a CPU run that asked
for an accelerator.

A pod whose workers installed the CPU build of jaxlib (or whose plugin failed to load)
trains on its host CPUs without an error: jax falls back to the CPU backend. So ``alignax
train`` logs the platform, device kind, device and process counts of every process before
any model is read, warns when the config asks for what only an accelerator does
(``model.attention: cudnn | splash``, a mesh splitting the model over CPU devices), and with
``distributed.require_accelerator: true`` refuses a CPU run in one line (a ``ConfigError``:
the CLI prints it and exits 2) — seconds after launch instead of hours into a slow run.

Also here: the chip's name from jax's ``device_kind`` (:func:`chip`) and its memory
bandwidth (:data:`HBM_BANDWIDTH`), for tools/accelerator_check.py's MFU and decode ceilings
beside :data:`alignax.estimate.PEAK_FLOPS`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

import jax

from alignax.config import ConfigError
from alignax.parallel.sharding import MESH_AXES, _complete_shape

log = logging.getLogger("alignax")

# HBM bandwidth per device (bytes/s), vendors' figures: the ceiling of a memory-bound decode
# step (every weight byte read once per token). Keys are those of alignax.estimate.PEAK_FLOPS.
HBM_BANDWIDTH = {"h100": 3.35e12, "h200": 4.8e12, "a100": 2.039e12, "v4": 1.228e12, "v5e": 0.819e12,
                 "v5p": 2.765e12, "v6e": 1.64e12}

# jax's device_kind -> the chip's key, first match wins (PCIe H100s have other peaks: no key).
_CHIP_KINDS = (("H100 PCIe", None), ("H100", "h100"), ("H200", "h200"), ("A100", "a100"), ("TPU v4", "v4"),
               ("TPU v5 lite", "v5e"), ("TPU v5e", "v5e"), ("TPU v5", "v5p"), ("TPU v6", "v6e"))


def chip(device_kind: str) -> str | None:
    """The peak tables' key of a ``device_kind`` (``"NVIDIA H100 80GB HBM3"`` -> ``"h100"``,
    ``"TPU v5 lite"`` -> ``"v5e"``); ``None`` for a chip the tables do not hold (CPUs)."""
    for fragment, name in _CHIP_KINDS:
        if fragment.lower() in device_kind.lower():
            return name
    return None


@dataclasses.dataclass(frozen=True)
class Hardware:
    """``platform``: jax's backend (``cpu`` | ``gpu`` | ``tpu``); ``device_kind``: the first
    local device's (``"NVIDIA H100 80GB HBM3"``, ``"TPU v5 lite"``, ``"cpu"``); device counts of
    this process and of the job; ``processes``: the job's process count."""

    platform: str
    device_kind: str
    local_devices: int
    devices: int
    processes: int
    process_index: int

    def line(self) -> str:
        return (f"platform {self.platform} ({self.device_kind}), {self.local_devices} local device(s) of "
                f"{self.devices}, process {self.process_index} of {self.processes}")


def detect() -> Hardware:
    """The hardware jax sees in this process (initialises jax's backends: call it after
    :func:`alignax.parallel.multihost.initialize`)."""
    local = jax.local_devices()
    return Hardware(platform=jax.default_backend(), device_kind=local[0].device_kind, local_devices=len(local),
                    devices=jax.device_count(), processes=jax.process_count(), process_index=jax.process_index())


def cpu_warnings(hardware: Hardware, *, attention: str, mesh_shape, dcn_shape) -> list[str]:
    """What a config asks of an accelerator while ``hardware`` is a CPU: the fused attention
    kernels (``model.attention``), and a mesh splitting the model over several CPU devices
    (``--xla_force_host_platform_device_count`` devices: they test a layout, they save no
    memory or time) or across slices (``mesh.dcn_shape``). Empty off CPU."""
    if hardware.platform != "cpu":
        return []
    found = []
    if attention in ("cudnn", "splash"):
        needs = "a GPU (cuDNN)" if attention == "cudnn" else "a TPU (Pallas splash kernel)"
        found.append(f"model.attention={attention} needs {needs}; this run is on CPU")
    try:  # the -1 axis as make_mesh reads it; a shape that does not fit is make_mesh's to refuse
        shape = _complete_shape(mesh_shape, MESH_AXES, hardware.devices)
    except ConfigError:
        shape = [max(size, 1) for size in mesh_shape]
    if shape[1] * shape[2] > 1:
        found.append(f"mesh.shape={list(mesh_shape)} splits the model over {shape[1] * shape[2]} CPU devices "
                     "(fsdp x tensor); on CPU that tests a layout and saves no memory or time")
    if dcn_shape is not None and math.prod(dcn_shape) > 1:
        found.append(f"mesh.dcn_shape={list(dcn_shape)} is a multi-slice mesh; this run is on CPU")
    return found


def announce(config: Any) -> Hardware:
    """Log this process's hardware and the config's CPU warnings; refuse (``ConfigError``,
    one line) a CPU run whose ``distributed.require_accelerator`` is true. ``config`` is a
    ``TrainConfig``; read: ``distributed.require_accelerator``, ``model.attention``,
    ``mesh.shape``, ``mesh.dcn_shape``."""
    hardware = detect()
    if config.distributed.require_accelerator and hardware.platform == "cpu":
        forced = os.environ.get("JAX_PLATFORMS")
        why = f"JAX_PLATFORMS={forced}" if forced else f"jax {jax.__version__} found no GPU or TPU backend"
        raise ConfigError(f"distributed.require_accelerator=true, but this run is on CPU ({why}); install the "
                          "accelerator build (make install-gpu or make install-tpu) or set "
                          "distributed.require_accelerator=false")
    log.info("hardware: %s", hardware.line())
    for warning in cpu_warnings(hardware, attention=config.model.attention, mesh_shape=config.mesh.shape,
                                dcn_shape=config.mesh.dcn_shape):
        log.warning("hardware: %s", warning)
    return hardware
