"""One process of the multi-slice mesh check (tests/test_multislice.py).

    python tests/multislice_check.py PROCESS_ID NUM_PROCESSES PORT

CPU devices have no ``slice_index``, so each process is one slice. Builds the run's mesh
from config sections with ``mesh.dcn_shape`` set, and prints one JSON line: for each mesh,
its axis sizes, the process index of every device in mesh order, and a column sum computed
on the mesh (checked against NumPy by the test); then the messages of the shapes that do
not fit the device count.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from tests.fake_devices import leave_processes


def main() -> None:
    process_id, num_processes, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    from alignax.parallel.multihost import DistributedConfig, initialize
    from alignax.trainers.config import MeshSection
    from alignax.trainers.engine.setup import build_mesh

    initialize(DistributedConfig(coordinator=f"127.0.0.1:{port}", num_processes=num_processes,
                                 process_id=process_id))
    data = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    meshes = {}
    for name, section in {"data_across": MeshSection(shape=(1, -1, 1), dcn_shape=(2, 1, 1)),
                          "fsdp_across": MeshSection(shape=(1, 2, 2), dcn_shape=(1, 2, 1))}.items():
        mesh = build_mesh(section)
        sharding = NamedSharding(mesh, PartitionSpec(("data", "fsdp"), "tensor"))
        x = jax.make_array_from_callback(data.shape, sharding, lambda index: data[index])
        total = jax.jit(lambda a: jnp.sum(a, axis=0), out_shardings=NamedSharding(mesh, PartitionSpec()))(x)
        meshes[name] = {"axes": dict(mesh.shape), "processes": np.vectorize(lambda d: d.process_index)(
            mesh.devices).tolist(), "column_sums": np.asarray(total.addressable_data(0)).tolist()}
    errors = {}
    for name, section in {"too_many_slices": MeshSection(dcn_shape=(4, 1, 1)),
                          "slice_shape": MeshSection(shape=(1, 3, 1), dcn_shape=(2, 1, 1))}.items():
        try:
            build_mesh(section)
        except ValueError as err:
            errors[name] = str(err)
    print(json.dumps({"process": jax.process_index(), "meshes": meshes, "errors": errors}), flush=True)


if __name__ == "__main__":
    main()
    leave_processes()
