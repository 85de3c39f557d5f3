"""Orbax checkpoints of a training run: train state, frozen reference, data iterator, config.

Layout under ``directory``::

    reference/            the frozen reference policy, written once and never again
    <step>/state/         params (policy, and value/reward heads where present), optimiser
                          state, step, RNG key data, controller state — one pytree
    <step>/meta/          JSON: data-iterator state, resolved config, counters, and the
                          path of the reference it was trained against

Saves are asynchronous (the train loop continues while arrays are written) and atomic:
Orbax writes into a temporary directory and renames it only when every item is on disk,
so an interrupted save never leaves a step that ``latest_step`` would pick. ``keep``
bounds how many steps stay on disk. Arrays are restored onto whatever sharding the
abstract target carries, so a run saved on one mesh resumes on another.
"""

from __future__ import annotations

import glob
import os
import shutil
from collections.abc import Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

REFERENCE_DIR = "reference"


class Checkpointer:
    """Save and restore a run's checkpoints under one directory."""

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        # Leftovers of an interrupted save are removed here, before anything is written:
        # Orbax's own cleanup runs in the background and could delete the reference while
        # save_reference is writing it into this directory.
        for leftover in glob.glob(os.path.join(self.directory, "*.orbax-checkpoint-tmp*")):
            shutil.rmtree(leftover, ignore_errors=True)
        options = ocp.CheckpointManagerOptions(
            preservation_policy=ocp.checkpoint_managers.LatestN(n=keep),
            enable_async_checkpointing=async_save, create=True, cleanup_tmp_directories=False,
        )
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for item, save, restore, handler in (
            ("state", ocp.args.StandardSave, ocp.args.StandardRestore, ocp.StandardCheckpointHandler),
            ("meta", ocp.args.JsonSave, ocp.args.JsonRestore, ocp.JsonCheckpointHandler),
        ):
            registry.add(item, save, handler)
            registry.add(item, restore, handler)
        self._manager = ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)

    # ---- the frozen reference -------------------------------------------------------
    @property
    def reference_path(self) -> str:
        return os.path.join(self.directory, REFERENCE_DIR)

    def has_reference(self) -> bool:
        return os.path.isdir(self.reference_path)

    def save_reference(self, reference_params: Any) -> None:
        """Write the frozen reference once; later calls are no-ops (it never changes)."""
        if self.has_reference():
            return
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(self.reference_path, reference_params)

    def restore_reference(self, abstract_params: Any) -> Any:
        """The reference restored onto the shardings of ``abstract_params``."""
        if not self.has_reference():
            raise FileNotFoundError(f"no frozen reference saved under {self.reference_path}")
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(self.reference_path, abstract_params)

    # ---- steps ----------------------------------------------------------------------
    def save(self, step: int, state: Any, meta: Mapping[str, Any], *, force: bool = False) -> bool:
        """Start saving ``state`` (a pytree of arrays) and ``meta`` (JSON-able) at ``step``."""
        meta = dict(meta, reference=REFERENCE_DIR if self.has_reference() else None)
        return self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=force,
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict[str, Any]]:
        """``(state, meta)`` of ``step`` (the latest when ``None``), arrays placed like
        ``abstract_state`` (a pytree of ``jax.ShapeDtypeStruct`` with shardings, or arrays)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {self.directory}")
        abstract_state = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()),
        )
        return restored.state, dict(restored.meta)

    def wait(self) -> None:
        """Block until every asynchronous save has committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
