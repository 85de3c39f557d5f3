"""Mesh and logical-axis rules. The 8-device checks run in a subprocess
(tests/parallel_mesh_check.py), because XLA's fake device count must be set before jax
is imported and this process has already imported it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

from alignax.parallel import LOGICAL_AXIS_RULES, MESH_AXES, logical_to_spec, make_mesh
from tests.fake_devices import subprocess_env

HERE = os.path.dirname(os.path.abspath(__file__))


def test_sharded_model_on_eight_fake_devices():
    env = subprocess_env(8)
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "parallel_mesh_check.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert results["devices"] == 8
    # 2 layers x 9 tensors + embed, final norm, lm_head in the loop layout; stacked: 9 + 3
    assert results["params_checked_scan=False"] == 21
    assert results["params_checked_scan=True"] == 12
    assert results["created_params_checked"] == 12
    assert results["max_abs_diff_scan=False"] <= 1e-5 and results["max_abs_diff_scan=True"] <= 1e-5
    assert results["max_abs_diff_cached_prefill"] <= 1e-5


def test_logical_rules():
    mesh = AbstractMesh((2, 2, 2), MESH_AXES, axis_types=(AxisType.Auto,) * 3)
    assert logical_to_spec(("embed", "heads", "head_dim"), (8, 4, 2), mesh) == P("fsdp", "tensor", None)
    assert logical_to_spec(("layers", "mlp", "embed"), (3, 8, 8), mesh) == P(None, "tensor", "fsdp")
    assert logical_to_spec(("batch", "length"), (8, 5), mesh) == P(("data", "fsdp"), None)
    # 3 kv heads cannot split over tensor=2: replicated on that dim instead of an invalid sharding
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), (8, 3, 2), mesh) == P("fsdp", None, None)
    # batch of 2 takes only "data"; "fsdp" would need 4
    assert logical_to_spec(("batch", "length"), (2, 5), mesh) == P("data", None)
    # a mesh axis is used once per array
    assert logical_to_spec(("vocab", "heads"), (8, 8), mesh) == P("tensor", None)
    # without a mesh: the raw table
    assert logical_to_spec(("vocab", "embed")) == P("tensor", "fsdp")
    with pytest.raises(ValueError, match="logical axis 'no_such_axis' has no rule"):
        logical_to_spec(("no_such_axis",))
    assert dict(LOGICAL_AXIS_RULES)["embed"] == "fsdp"


def test_make_mesh():
    n = jax.device_count()
    mesh = make_mesh()
    assert mesh.axis_names == MESH_AXES and mesh.shape["fsdp"] == n
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert make_mesh((1, -1, 1)).shape["fsdp"] == n
    with pytest.raises(ValueError, match=f"needs {8 * n} devices; {n} are available"):
        make_mesh((2, 4 * n, 1))
    with pytest.raises(ValueError, match="has 2 axes; axis_names"):
        make_mesh((1, 1))
