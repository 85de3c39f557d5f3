"""Where frozen models and the optimiser state live between uses (the ``placement:`` section).

``host``: a model's weights are held in host memory (``pinned_host``, JAX's memory kinds)
with the partition specs they have on the device, so each device holds none of them
between uses; every jitted program that runs the model moves them into device memory
inside the program (:func:`to_device`, right before the forward pass) and XLA frees that
copy once the forward is done. The price is one host-to-device transfer of the weights
per program run (per micro-batch of a step whose loss reads the reference); on a GPU or
TPU it overlaps with compute only as far as XLA's scheduler manages.

``optimizer_state: host``: the optimiser state (Adam's moments, and the float32 master
copy of bfloat16 params) is held in pinned host memory between steps; the step moves it in
after its backward pass, right before the optimiser's update
(``alignax.trainers.engine.step.make_train_step``), and its outputs go back to host memory
(the step's ``out_shardings``, :func:`place_optimizer_state`): one round trip per step.

``submesh``: a frozen model lives on devices of its own (``placement.submesh``, a mesh
shape ``[data, fsdp, tensor]``): the last ``size / P`` devices of each of the ``P``
processes are set apart for it and the training mesh (``mesh:``, and ``rollout.mesh``)
spans the rest (:func:`split_devices`). The model is built there directly (sharded over
the sub-mesh as over a training mesh) and runs there: its inputs are placed on the
sub-mesh from the host batch, and only its outputs (log-probs or scores, a few numbers a
row) come back to the training mesh (:func:`rows_to`), through each process's host memory,
since multi-controller JAX cannot reshard between disjoint sets of devices. The training
devices hold none of its weights and no transfer of them ever happens; the price is the
devices set apart, and that its forward passes run there rather than spread over every
device (JAX dispatches asynchronously, so they overlap with the training devices' work only
as far as the trainer's order of calls lets them).

``device`` (the default): the weights stay in device memory, as without this module.

The CPU backend has the same memory kinds, so a CPU run takes the same code path (its
"host" and "device" are the same RAM: CPU shows the placement and the transfers in the
compiled program, not a saving).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from alignax.config import ConfigError
from alignax.parallel.multihost import local_rows, place_rows

Where = Literal["device", "host"]
FrozenWhere = Literal["device", "host", "submesh"]
HOST_MEMORY = "pinned_host"
SUBMESH_ROLES = ("reference", "reward_models")


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """Which memory holds the frozen models of a run.

    Fields:
      reference: the frozen reference policy (DPO family and KTO with ``preference.reference:
        live``; GRPO and PPO with a KL to the reference): ``device`` | ``host`` (held in
        pinned host memory, moved to the device inside each program that runs it) |
        ``submesh`` (on the devices of ``submesh``; its log-probs come back).
      reward_models: the reward models of online training (``rewards.reward_models``):
        ``device`` | ``host`` | ``submesh``, as for ``reference``.
      optimizer_state: the optimiser's state (moments, master weights): ``device`` |
        ``host`` (held in pinned host memory between steps; each step moves it in and
        writes the updated state back to host memory).
      submesh: the shape ``[data, fsdp, tensor]`` of the devices set apart for the models
        placed on ``submesh`` (no ``-1``); its size must split evenly over the processes,
        each keeping at least one device for training. E.g. ``[1, 2, 1]`` on 8 devices: the
        reference sharded over the last 2, training over the first 6.
    """

    reference: FrozenWhere = "device"
    reward_models: FrozenWhere = "device"
    optimizer_state: Where = "device"
    submesh: tuple[int, int, int] | None = None

    def on_submesh(self, role: str) -> bool:
        """Whether the model of ``role`` (``reference`` | ``reward_models``) lives on the sub-mesh."""
        return getattr(self, role) == "submesh"

    @property
    def devices_apart(self) -> int:
        """How many devices the sub-mesh takes (0 when no model is placed on it)."""
        if self.submesh is None or not any(self.on_submesh(role) for role in SUBMESH_ROLES):
            return 0
        return int(np.prod(self.submesh))


def _is_array(x) -> bool:
    return isinstance(x, jax.Array)


def to_host(tree: Any) -> Any:
    """``tree`` with every array moved to pinned host memory, its partition spec (and mesh)
    kept; other leaves unchanged. Outside a jit."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding.with_memory_kind(HOST_MEMORY)) if _is_array(x) else x,
                        tree)


def place(tree: Any, where: FrozenWhere) -> Any:
    """``tree`` held where ``where`` says (``device``, and ``submesh`` for a tree already
    built on the sub-mesh: ``tree`` itself)."""
    return to_host(tree) if where == "host" and tree is not None else tree


def place_optimizer_state(state: Any, shardings: Any, where: Where) -> tuple[Any, Any]:
    """``(state, shardings)`` of a train state (``opt_state`` field) with the optimiser state
    held where ``where`` says: for ``host``, its arrays moved to host memory and its
    shardings saying so (the step's ``out_shardings``: each step writes it back there)."""
    if where != "host":
        return state, shardings
    held = jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), shardings.opt_state)
    return state._replace(opt_state=to_host(state.opt_state)), shardings._replace(opt_state=held)


def to_device(tree: Any) -> Any:
    """Inside a jitted program: ``tree``'s arrays moved into device memory (same
    shardings); arrays already there are passed through. Call it right before the forward
    pass that reads them, so the device copy lives only as long as that pass needs it."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)


def split_devices(config: PlacementConfig, devices: Sequence[jax.Device] | None = None
                  ) -> tuple[list[jax.Device], list[jax.Device] | None]:
    """``(the training mesh's devices, the sub-mesh's or None)`` of ``devices`` (default:
    every device): with ``config.submesh`` of size ``S`` over ``P`` processes, the last
    ``S / P`` devices of each process go to the sub-mesh, so both meshes give each process
    one contiguous block of rows (what :func:`rows_to` and the data loaders need)."""
    devices = list(jax.devices() if devices is None else devices)
    size = config.devices_apart  # (a role on "submesh" without a shape: alignax.trainers.validation refuses)
    if not size:
        return devices, None
    split = last_of_each_process(devices, size)
    if split is None:
        raise ConfigError(f"placement.submesh={list(config.submesh)} sets {size} devices apart, the same number from "
                         f"each of the {len(processes_of(devices))} processes, each keeping at least one for training; "
                         f"the processes have {[len(ds) for ds in processes_of(devices)]} devices")
    return split


def processes_of(devices: Sequence[jax.Device]) -> list[list[jax.Device]]:
    """``devices`` by process (in process order, each process's in the given order)."""
    return [[d for d in devices if d.process_index == p] for p in sorted({d.process_index for d in devices})]


def last_of_each_process(devices: Sequence[jax.Device], size: int
                         ) -> tuple[list[jax.Device], list[jax.Device]] | None:
    """``(the rest, the last size / P devices of each of the P processes)``, or ``None``
    when ``size`` does not split evenly over the processes or leaves one of them none: a
    group set apart so that every process holds one contiguous block of its rows (the
    sub-mesh's, the asynchronous sampler's)."""
    local = processes_of(devices)
    if size % len(local) or size // len(local) >= min(len(ds) for ds in local):
        return None
    per = size // len(local)
    return [d for ds in local for d in ds[:-per]], [d for ds in local for d in ds[-per:]]


def rows_to(mesh: Mesh, tree: Any) -> Any:
    """Arrays with rows over the batch axes of one mesh → the same global arrays with rows
    over ``mesh``'s batch axes. Each process moves its own rows through its host memory
    (``local_rows`` then ``place_rows``): multi-controller JAX cannot reshard between
    disjoint sets of devices, and what crosses (log-probs, scores) is small."""
    return jax.tree.map(lambda x: place_rows(local_rows(x), mesh), tree)


def twin_mesh(mesh: Mesh, counterpart: dict[jax.Device, jax.Device]) -> Mesh:
    """``mesh``'s shape, axes and axis types over the counterparts of its devices: where a
    program lays arrays out exactly as they will lie on ``mesh``, so that moving them
    there (:func:`move_shards`) is one copy per shard, device to device."""
    devices = np.vectorize(counterpart.__getitem__, otypes=[object])(mesh.devices)
    return Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)


def move_shards(tree: Any, mesh: Mesh, counterpart: dict[jax.Device, jax.Device]) -> Any:
    """``tree``'s arrays, laid out on a :func:`twin_mesh` of ``mesh``, moved onto ``mesh``:
    each addressable shard copied to its device's counterpart (``counterpart``: twin device
    -> ``mesh``'s device, both of one process) and the global arrays put together there
    with the same partition specs. Device to device, no host round trip, and each process
    moves only its own shards (no collective: multi-controller JAX has no reshard between
    disjoint sets of devices)."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [i for i, x in enumerate(leaves) if _is_array(x)]
    shards = [list(leaves[i].addressable_shards) for i in arrays]
    copies = iter(jax.device_put([s.data for ss in shards for s in ss],
                                 [counterpart[s.device] for ss in shards for s in ss]))
    for i, ss in zip(arrays, shards):
        x = leaves[i]
        leaves[i] = jax.make_array_from_single_device_arrays(
            x.shape, NamedSharding(mesh, x.sharding.spec, memory_kind=x.sharding.memory_kind),
            [next(copies) for _ in ss])
    return jax.tree.unflatten(treedef, leaves)
