"""Meshes, the one logical-axis rules table, and helpers that place pytrees on a mesh.

Mesh axes are ``("data", "fsdp", "tensor")``:

- ``data``: pure data parallelism (parameters replicated over it);
- ``fsdp``: data parallelism whose parameters and optimizer state are sharded over it
  (ZeRO-3 style; XLA all-gathers a layer's weights when it runs);
- ``tensor``: Megatron-style tensor parallelism (heads, MLP width and vocab split).

A mesh may add an ``expert`` axis (``make_mesh(shape, ("data", "fsdp", "expert", "tensor"))``):
mixture-of-experts weights (``[E, ...]``, :mod:`alignax.models.moe`) split their experts over
it, each device running its experts on every token and the per-expert sums reduced across
it. Without one (the trainers' meshes) the experts split over ``fsdp`` instead, where
``E`` divides it (the model dim otherwise), and are gathered like any FSDP weight.

Parameters name their dims with logical axes (``embed``, ``heads``, ...; see
alignax/models/layers.py); :data:`LOGICAL_AXIS_RULES` maps each name to mesh axes. A mesh
axis is dropped from a dim when it does not divide the dim (e.g. 3 kv heads on
``tensor=2``) or is already used by an earlier dim, so every rule yields a valid sharding
on every mesh; such a dim is replicated over that axis instead.

Activations name their dims too (``batch``, ``length``, ``activation_embed``, ...; the
``activation_*`` names are MaxText's) and the decoder pins them with :func:`constrain` at
every layer boundary. That is what makes ``fsdp`` FSDP once compiled: with only the
parameters sharded, XLA is free to keep a weight where it lies and move the activations to
it (all-reducing partial sums over ``fsdp``, memory per device rising with the device
count); with the residual stream pinned to ``[batch over (data, fsdp), length, embed
replicated]``, the only way to run a layer is to all-gather its weights, and only weight
gradients are reduced over ``fsdp`` (tests/test_fsdp_compile.py, tools/studies/fsdp_memory.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from alignax.config import ConfigError

log = logging.getLogger("alignax")

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or axes, or None = replicated). The only table.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),  # activations and data [B, ...]
    ("length", None),
    # Activation dims other than batch and length. The residual stream is replicated on
    # its model dim, so each layer all-gathers its fsdp-sharded weights (FSDP); heads,
    # MLP width and vocab follow the weights' tensor split (Megatron).
    ("activation_embed", None),
    # Embedding rows just looked up: batch over data only, while their model dim is still
    # on fsdp where the table keeps it (alignax/models/modeling.py, Decoder).
    ("activation_lookup_batch", "data"),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("activation_experts", "expert"),  # [B, T, E, F] expert hidden states follow their weights
    # Parameter dims.
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("experts", ("expert", "fsdp")),  # stacked expert weights [E, ...]; "expert" is an optional mesh axis
    ("layers", None),
    ("norm", None),
    ("positions", None),
    ("labels", None),
    ("lora_rank", None),  # the inner dim of LoRA adapters (alignax.models.lora)
)


def make_mesh(
    shape: Sequence[int] | None = None,
    axis_names: Sequence[str] = MESH_AXES,
    *,
    devices: Sequence[jax.Device] | None = None,
    dcn_shape: Sequence[int] | None = None,
) -> Mesh:
    """A device mesh with ``AxisType.Auto`` axes (what logical rules + ``jax.jit`` need).

    ``shape`` defaults to ``(1, n_devices, 1)``: all devices on ``fsdp``. One entry may
    be ``-1`` and is inferred from the device count.

    ``dcn_shape``: a multi-slice mesh (see :func:`hybrid_mesh`); ``shape`` is then the
    mesh within one slice.
    """
    devices = list(jax.devices() if devices is None else devices)
    axis_names = tuple(axis_names)
    if dcn_shape is not None:
        return hybrid_mesh(shape, dcn_shape, axis_names, devices=devices)
    shape = _complete_shape(shape, axis_names, len(devices))
    return jax.make_mesh(tuple(shape), axis_names, axis_types=(AxisType.Auto,) * len(axis_names), devices=devices)


def _complete_shape(shape: Sequence[int] | None, axis_names: tuple[str, ...], n: int) -> tuple[int, ...]:
    """``shape`` with its ``-1`` inferred from ``n`` devices (the default: all on ``fsdp``),
    checked to use exactly ``n``."""
    if shape is None:
        shape = tuple(n if a == "fsdp" else 1 for a in axis_names)
        if "fsdp" not in axis_names:
            shape = (n,) + (1,) * (len(axis_names) - 1)
    shape = list(shape)
    if len(shape) != len(axis_names):
        raise ConfigError(
            f"mesh shape {tuple(shape)} has {len(shape)} axes; axis_names {axis_names} has {len(axis_names)}"
        )
    if shape.count(-1) > 1:
        raise ConfigError(f"at most one mesh axis may be -1; got shape {tuple(shape)}")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if n % known:
            raise ConfigError(f"cannot infer -1 in mesh shape {tuple(shape)} from {n} devices")
        shape[shape.index(-1)] = n // known
    if math.prod(shape) != n:
        raise ConfigError(f"mesh shape {tuple(shape)} needs {math.prod(shape)} devices; {n} are available")
    return tuple(shape)


def hybrid_mesh(
    shape: Sequence[int] | None,
    dcn_shape: Sequence[int],
    axis_names: Sequence[str] = MESH_AXES,
    *,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A multi-slice mesh: ``shape`` within each slice (ICI, the fast links; one entry may
    be ``-1``), ``dcn_shape`` across slices (DCN, the data-centre network); each axis has
    ``shape[i] * dcn_shape[i]`` devices, the slices laid out as blocks along it, so an axis
    whose ``dcn_shape`` entry is 1 never leaves a slice. Put the DCN factor on ``data`` (or
    ``fsdp``): only gradients (or weight gathers) then cross slices.

    Slices are the devices' ``slice_index`` where they report more than one (TPU
    multi-slice); otherwise (CPU, GPU, one TPU slice) each process is one slice. Built by
    ``jax.experimental.mesh_utils.create_hybrid_device_mesh``.
    """
    devices = list(jax.devices() if devices is None else devices)
    axis_names, dcn_shape = tuple(axis_names), tuple(dcn_shape)
    if len(dcn_shape) != len(axis_names) or any(d < 1 for d in dcn_shape):
        raise ValueError(f"mesh.dcn_shape={dcn_shape}: give one size >= 1 per mesh axis {axis_names}")
    reported = {getattr(device, "slice_index", None) for device in devices}
    granule = "slice_index" if len(reported - {None}) > 1 else "process_index"
    slices: dict[int, int] = {}
    for device in devices:
        key = getattr(device, granule)
        slices[key] = slices.get(key, 0) + 1
    unit = "slices" if granule == "slice_index" else "processes (one slice each where devices report one slice)"
    if math.prod(dcn_shape) != len(slices):
        raise ValueError(f"mesh.dcn_shape={dcn_shape} spans {math.prod(dcn_shape)} slices; the {len(devices)} "
                         f"devices are in {len(slices)} {unit}")
    sizes = set(slices.values())
    if len(sizes) != 1:
        raise ValueError(f"mesh.dcn_shape={dcn_shape}: the slices hold different device counts "
                         f"({dict(sorted(slices.items()))}); a multi-slice mesh needs equal slices")
    per_slice = sizes.pop()
    try:
        shape = _complete_shape(shape, axis_names, per_slice)
    except ValueError as err:
        raise ValueError(f"mesh.shape={shape if shape is None else tuple(shape)} is the mesh within one slice when mesh.dcn_shape={dcn_shape} "
                         f"is set, and each of the {len(slices)} slices has {per_slice} devices "
                         f"(mesh.shape x mesh.dcn_shape must equal the {len(devices)} devices): {err}") from None
    array = mesh_utils.create_hybrid_device_mesh(shape, dcn_shape, devices,
                                                 process_is_granule=granule == "process_index")
    return Mesh(array, axis_names, axis_types=(AxisType.Auto,) * len(axis_names))



def mesh_for_shape(shape: Sequence[int], dcn_shape: Sequence[int] | None = None, *,
                   devices: Sequence[jax.Device] | None = None) -> Mesh:
    """:func:`make_mesh` of ``shape`` (and ``dcn_shape``, a multi-slice mesh) over
    ``devices`` (default: every device); a single-slice shape with fewer devices than
    given uses the first ones (with a warning) instead of failing."""
    devices = list(jax.devices() if devices is None else devices)
    if dcn_shape is not None:
        return make_mesh(shape, dcn_shape=dcn_shape, devices=devices)
    shape = tuple(shape)
    size = int(np.prod(shape))
    if -1 not in shape and 0 < size < len(devices):
        log.warning("mesh %s uses %d of %d devices", shape, size, len(devices))
        return make_mesh(shape, devices=devices[:size])
    return make_mesh(shape, devices=devices)


def _dividing_axes(axes: Sequence[str], dim: int, sizes: Mapping[str, int]) -> list[str]:
    """The mesh axes of ``axes``, in order, that split a dimension of ``dim``: each kept
    one's size times those kept before it divides ``dim``; the others are dropped."""
    kept, size = [], 1
    for axis in axes:
        if dim % (size * sizes[axis]) == 0:
            kept.append(axis)
            size *= sizes[axis]
    return kept


def logical_to_spec(
    names: Sequence[str | None],
    shape: Sequence[int] | None = None,
    mesh: Mesh | None = None,
    *,
    rules=LOGICAL_AXIS_RULES,
) -> PartitionSpec:
    """Map logical dim names to a ``PartitionSpec`` through ``rules``.

    With ``shape`` and ``mesh``, a mesh axis whose size does not divide the dim (or the
    product so far) is dropped, as is a mesh axis already used by an earlier dim. Mesh
    axes not in ``mesh`` are dropped too. Unknown logical names raise.
    """
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for i, name in enumerate(names):
        if name is None:
            spec.append(None)
            continue
        if name not in table:
            raise ValueError(f"logical axis {name!r} has no rule; known: {', '.join(table)}")
        target = table[name]
        targets = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        kept = [axis for axis in targets if axis not in used and (mesh is None or axis in mesh.shape)]
        if mesh is not None and shape is not None:
            kept = _dividing_axes(kept, shape[i], mesh.shape)
        used.update(kept)
        spec.append(None if not kept else (kept[0] if len(kept) == 1 else tuple(kept)))
    return PartitionSpec(*spec)


_CONSTRAINTS_ON = contextvars.ContextVar("alignax_activation_constraints", default=True)


@contextlib.contextmanager
def activation_constraints(enabled: bool = True) -> Iterator[None]:
    """Turn :func:`constrain` on or off for what is traced inside the block.

    Off, the decoder compiles as it did before it constrained its activations (XLA's
    propagation alone decides): for measuring what the constraints buy
    (tools/studies/fsdp_memory.py). Read at trace time, so a function already compiled keeps
    what it was traced with.
    """
    token = _CONSTRAINTS_ON.set(bool(enabled))
    try:
        yield
    finally:
        _CONSTRAINTS_ON.reset(token)


def _constraint_mesh(x) -> AbstractMesh | None:
    """The mesh to constrain ``x`` on: the one in context (``jax.set_mesh``), else the one
    ``x`` lives on (its inputs were placed there), if every axis of it is ``Auto``."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    if mesh is None or mesh.empty or any(t != AxisType.Auto for t in mesh.axis_types):
        return None
    return mesh


def constrain(x: jax.Array, names: Sequence[str | None], *, rules=LOGICAL_AXIS_RULES) -> jax.Array:
    """``x`` pinned to the logical axes ``names`` (one per dim) through the rules.

    The mesh comes from the context (``with jax.set_mesh(mesh):``, as the sampler runs)
    or, without one, from ``x`` itself: an array computed from inputs placed on a mesh
    carries that mesh in its type, so a train step jitted over sharded inputs gets its
    constraints without entering the mesh. With no mesh (one device, unplaced inputs),
    inside ``shard_map`` (manual axes), on ``Explicit`` axes, or under
    ``activation_constraints(False)``, this is the identity. A dim whose mesh axes do not
    divide it is replicated (:func:`logical_to_spec`). Values never change; only where
    XLA keeps them.
    """
    if not _CONSTRAINTS_ON.get():
        return x
    if len(names) != x.ndim:
        raise ValueError(f"{len(names)} axis names {tuple(names)} for an array of shape {x.shape}")
    mesh = _constraint_mesh(x)
    if mesh is None:
        return x
    spec = logical_to_spec(names, x.shape, mesh, rules=rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def batch_shards(x: jax.Array) -> int:
    """Into how many blocks the rows (dim 0) of ``x`` split over the ``batch`` axes of the
    mesh in context or the one ``x`` lies on, as :func:`constrain` would place them; 1
    without a mesh. Read at trace time."""
    mesh = _constraint_mesh(x) if _CONSTRAINTS_ON.get() and x.ndim else None
    if mesh is None:
        return 1
    spec = logical_to_spec(("batch",), (x.shape[0],), mesh)[0]
    axes = () if spec is None else ((spec,) if isinstance(spec, str) else tuple(spec))
    return math.prod(mesh.shape[a] for a in axes)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def tree_shardings(tree, mesh: Mesh, *, rules=LOGICAL_AXIS_RULES):
    """A ``NamedSharding`` for every array in ``tree``, from the rules.

    ``nnx.Variable`` leaves with ``out_sharding`` metadata (model state, and optax state
    built from it: ``optax.adam(...).init(nnx.state(model, nnx.Param))`` keeps the
    Variables) get the rule's sharding, wrapped in the same Variable type so the result
    matches ``tree``'s structure (usable as ``jax.jit`` ``out_shardings``); every other
    array (step counters, scalars) is replicated.
    """

    def one(x):
        if _is_variable(x):
            value = x.get_value()
            names = x.get_metadata().get("out_sharding")
            if names is None or not hasattr(value, "shape"):
                return x.replace(NamedSharding(mesh, PartitionSpec()))
            if len(names) != len(value.shape):
                raise ValueError(f"axis names {names} do not match a value of shape {value.shape}")
            return x.replace(NamedSharding(mesh, logical_to_spec(names, value.shape, mesh, rules=rules)))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, tree, is_leaf=_is_variable)


def abstract_tree(tree, shardings):
    """``tree``'s arrays as ``jax.ShapeDtypeStruct`` carrying ``shardings`` (a tree of the
    same structure, e.g. :func:`tree_shardings`'s), ``nnx.Variable`` leaves kept as
    Variables: what ``jax.jit(...).lower`` takes to compile a program for arrays that are
    never allocated."""
    def one(x, s):
        if _is_variable(x):
            v = x.get_value()
            return x.replace(jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s.get_value()))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    return jax.tree.map(one, tree, shardings, is_leaf=_is_variable)


def shard_tree(tree, mesh: Mesh, *, rules=LOGICAL_AXIS_RULES):
    """``jax.device_put`` every array of ``tree`` with :func:`tree_shardings`."""
    return jax.device_put(tree, tree_shardings(tree, mesh, rules=rules))


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of ``[B, T, ...]`` data: batch over ``("data", "fsdp")``, the rest replicated."""
    batch_axes = tuple(a for a in ("data", "fsdp") if a in mesh.shape)
    return NamedSharding(mesh, PartitionSpec(batch_axes or None, *([None] * (ndim - 1))))


def fit_rows(sharding: NamedSharding, rows: int) -> NamedSharding:
    """``sharding`` of a ``[rows, ...]`` batch with the mesh axes of its first dim that do
    not divide ``rows`` dropped, in order, as :func:`logical_to_spec` drops them for
    activations: the rows are then whole on the devices of a dropped axis (e.g. 4 pairs on
    8 devices run whole on each) instead of the placement failing."""
    first = sharding.spec[0] if len(sharding.spec) else None
    if first is None:
        return sharding
    axes = (first,) if isinstance(first, str) else tuple(first)
    kept = _dividing_axes(axes, rows, sharding.mesh.shape)
    if len(kept) == len(axes):
        return sharding
    spec = PartitionSpec(None if not kept else kept[0] if len(kept) == 1 else tuple(kept), *sharding.spec[1:])
    return NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)


def shard_model(model: nnx.Module, mesh: Mesh, *, rules=LOGICAL_AXIS_RULES) -> nnx.Module:
    """Move an existing model's state onto ``mesh`` by the rules (in place; returns it)."""
    nnx.update(model, shard_tree(nnx.state(model), mesh, rules=rules))
    return model


def create_sharded(constructor: Callable[[], nnx.Module], mesh: Mesh, *, rules=LOGICAL_AXIS_RULES) -> nnx.Module:
    """Build ``constructor()`` directly sharded: each parameter is initialised on the
    devices that hold it (``jax.jit`` with ``out_shardings`` from the rules), so the full
    model never sits on one device.
    """
    abstract = nnx.eval_shape(constructor)
    graphdef, abstract_state = nnx.split(abstract)
    shardings = tree_shardings(abstract_state, mesh, rules=rules)

    def init():
        return nnx.state(constructor())

    state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def place_array(value: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array put on devices with ``sharding`` (each process provides the full array)."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
