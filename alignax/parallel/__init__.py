"""Mesh construction, the logical-axis rules table and sharding helpers."""

from alignax.parallel.sharding import (
    LOGICAL_AXIS_RULES,
    MESH_AXES,
    abstract_tree,
    activation_constraints,
    batch_sharding,
    constrain,
    create_sharded,
    logical_to_spec,
    make_mesh,
    place_array,
    shard_model,
    shard_tree,
    tree_shardings,
)

__all__ = [
    "LOGICAL_AXIS_RULES",
    "MESH_AXES",
    "abstract_tree",
    "activation_constraints",
    "batch_sharding",
    "constrain",
    "create_sharded",
    "logical_to_spec",
    "make_mesh",
    "place_array",
    "shard_model",
    "shard_tree",
    "tree_shardings",
]
