"""Multi-slice meshes (``mesh.dcn_shape``): ICI within a slice, DCN across slices, built
with ``create_hybrid_device_mesh``; on CPU each process is a slice (2 processes x 4 fake
devices, gloo collectives)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from alignax.config import ConfigError
from alignax.parallel.sharding import hybrid_mesh
from alignax.trainers.api import load_config
from tests.fake_devices import last_json_line, subprocess_env
from tests.support.trainer_helpers import CONFIGS

HERE = os.path.dirname(os.path.abspath(__file__))


def _two_processes() -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multislice_check.py"), str(p), "2", port],
                              env=subprocess_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in range(2)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-2000:] + err[-4000:]
        results.append(last_json_line(out))
    return results


@pytest.mark.xdist_group("multihost")
def test_each_slice_is_a_block_along_the_dcn_axis():
    """dcn_shape (2,1,1) over 2 processes: data=2 spans the slices, fsdp=4 stays in one;
    dcn_shape (1,2,1) with a (1,2,2) slice: fsdp=4 is two blocks of 2, one per slice. The
    mesh computes (a column sum of an array sharded over it equals NumPy's), and shapes that
    do not fit the devices are refused naming the keys."""
    data = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    results = _two_processes()
    assert [r["process"] for r in results] == [0, 1]
    for r in results:
        across = r["meshes"]["data_across"]
        assert across["axes"] == {"data": 2, "fsdp": 4, "tensor": 1}
        assert np.asarray(across["processes"])[..., 0].tolist() == [[0, 0, 0, 0], [1, 1, 1, 1]]
        fsdp = r["meshes"]["fsdp_across"]
        assert fsdp["axes"] == {"data": 1, "fsdp": 4, "tensor": 2}
        assert fsdp["processes"] == [[[0, 0], [0, 0], [1, 1], [1, 1]]]
        for mesh in r["meshes"].values():
            np.testing.assert_allclose(mesh["column_sums"], data.sum(0))
        assert "mesh.dcn_shape=(4, 1, 1) spans 4 slices; the 8 devices are in 2 processes" in r["errors"][
            "too_many_slices"]
        assert ("mesh.shape=(1, 3, 1) is the mesh within one slice when mesh.dcn_shape=(2, 1, 1) is set, and each "
                "of the 2 slices has 4 devices") in r["errors"]["slice_shape"]


def test_dcn_shape_is_validated_and_one_slice_is_a_plain_mesh():
    config = os.path.join(CONFIGS, "tiny-dpo.yaml")
    with pytest.raises(ConfigError, match=r"mesh.dcn_shape=\[1, 0, 1\]: the fsdp entry is 0"):
        load_config(config, overrides=["mesh.dcn_shape=[1,0,1]"])
    assert load_config(config, overrides=["mesh.dcn_shape=[1,1,1]"]).mesh.dcn_shape == (1, 1, 1)
    mesh = hybrid_mesh((1, -1, 1), (1, 1, 1))  # this process: one slice
    assert dict(mesh.shape)["fsdp"] == len(mesh.devices.flat)
    with pytest.raises(ValueError, match="mesh.dcn_shape=.2, 1, 1. spans 2 slices; the .* devices are in 1 processes"):
        hybrid_mesh((1, -1, 1), (2, 1, 1))
