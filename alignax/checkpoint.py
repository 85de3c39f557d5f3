"""Orbax checkpoints of a training run: train state, frozen reference, data iterator, config.

Layout under ``directory``::

    reference/            the frozen reference policy, written once and never again
    reference/alignax_digest.json   SHA-256 of every file of the reference
    <step>/state/         params (policy, and value/reward heads where present), optimiser
                          state, step, RNG key data, controller state — one pytree
    <step>/meta/          JSON: data-iterator state, resolved config, counters, and the
                          path of the reference it was trained against
    <step>/alignax_digest.json      SHA-256 (and size) of every other file of the step

Saves are asynchronous (the train loop continues while arrays are written) and atomic:
Orbax writes into a temporary directory and renames it only when every item is on disk,
so an interrupted save never leaves a step that ``latest_step`` would pick. ``keep``
bounds how many steps stay on disk. Arrays are restored onto whatever sharding the
abstract target carries, so a run saved on one mesh resumes on another. ``directory`` may
be an object-store URI (``gs://...``): it is handed to Orbax as an ``etils.epath.Path``
and never made a local path; the digests below are read and written through epath too.

Integrity. Orbax stores no checksums, so a checkpoint whose bytes were damaged on disk
(flipped bits, a truncated file, a garbled JSON) could load silently as garbage or fail
with an error that names no file. Each step therefore gets a digest manifest: once a
step's save has committed — noticed at :meth:`Checkpointer.wait`, at the next
:meth:`Checkpointer.save` and at :meth:`Checkpointer.close` — the SHA-256 of every file
in the step directory is written (atomically, by process 0 only) to
``<step>/alignax_digest.json``. It lives inside the step directory, which Orbax treats as
one unit: item discovery only looks at subdirectories, and keep-N rotation deletes the
manifest together with its step. The reference gets the same manifest once it is saved.

:meth:`Checkpointer.restore` without a step tries the steps newest first. A step is taken
when its files match its manifest and both items restore; a step without a manifest
(written by an older version, or the process died before the manifest was written) is
checked by the restore alone. A step that fails is logged as a WARNING naming the step and
the file, and the next older step is tried; when none is intact,
:class:`CorruptCheckpointError` lists every step and why. After a fallback the corrupt
newer steps are deleted (with a warning): otherwise the next saves of the resumed run
(whose step numbers the corrupt steps already hold) would be refused, and keep-N rotation
would count the corrupt steps and delete the intact ones, leaving nothing to fall back to.
So keep-N always counts steps that were intact when the run resumed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from alignax import paths
from alignax.config import ConfigError
from alignax.parallel import multihost

REFERENCE_DIR = "reference"
DIGEST_FILE = "alignax_digest.json"
_DIGEST_VERSION = 1
_CHUNK = 8 << 20  # bytes hashed at a time: checkpoint files can be gigabytes

log = logging.getLogger("alignax")


class CorruptCheckpointError(ConfigError):
    """A checkpoint (a step, or the reference) whose files fail their digest or restore."""


class CheckpointWriteError(RuntimeError):
    """A save that failed (a full disk, a lost bucket), asynchronous or not: the message
    names the step and the folder it was being written to; :attr:`step` is that step."""

    def __init__(self, step: int | None, path: str, cause: BaseException):
        self.step = step
        super().__init__(f"writing checkpoint step {step} to {path} failed ({type(cause).__name__}: {cause})")


class CheckpointMismatchError(ConfigError):
    """A checkpoint that does not fit the state it is restored into (another model shape,
    another optimiser): the message names the first parameter that differs."""


def _path_name(path: tuple) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _shapes(tree: Any) -> dict[str, tuple[int, ...] | None]:
    """Leaf path -> shape (``None`` where a leaf has none, e.g. a PRNG key's metadata)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    return {_path_name(path): (tuple(leaf.shape) if getattr(leaf, "shape", None) is not None else None)
            for path, leaf in leaves if leaf is not None}


def fit_problem(saved: Any, abstract: Any) -> str | None:
    """How the saved state's structure (Orbax metadata) differs from ``abstract``'s, naming
    the first differing leaf (parameters first), or None when every shape matches."""
    have, want = _shapes(saved), _shapes(abstract)
    order = sorted(set(have) | set(want), key=lambda k: (not k.startswith("params"), k))
    for key in order:
        if key not in have:
            return f"{key} is in the model but not in the checkpoint"
        if key not in want:
            return f"{key} is in the checkpoint but not in the model"
        if have[key] is not None and want[key] is not None and have[key] != want[key]:
            return f"{key} has shape {have[key]} in the checkpoint and {want[key]} in the model"
    return None


def _file_sha256(path: str) -> str:
    sha = hashlib.sha256()
    with epath.Path(path).open("rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def _digest_files(root: str) -> list[str]:
    """Every file under ``root`` but the manifest (and its temporaries), relative, sorted."""
    out = []

    # iterdir, not walk: fsspec's walk names folders without their gs:// prefix
    def visit(folder: epath.Path, prefix: str) -> None:
        for entry in folder.iterdir():
            if entry.is_dir():
                visit(entry, f"{prefix}{entry.name}/")
            elif not entry.name.startswith(DIGEST_FILE):
                out.append(prefix + entry.name)

    visit(epath.Path(root), "")
    return sorted(out)


def _size(path: str) -> int:
    return epath.Path(path).stat().length


def write_digest(root: str) -> str:
    """Write ``root``'s digest manifest (size and SHA-256 of every file) atomically;
    returns its path."""
    files = {rel.replace(os.sep, "/"): {"size": _size(os.path.join(root, rel)),
                                        "sha256": _file_sha256(os.path.join(root, rel))}
             for rel in _digest_files(root)}
    path = os.path.join(root, DIGEST_FILE)
    paths.write_text(path, json.dumps({"version": _DIGEST_VERSION, "algorithm": "sha256", "files": files}, indent=1))
    return path


def check_digest(root: str, *, base: str) -> str | None:
    """The first problem of ``root`` against its manifest (paths relative to ``base``),
    ``None`` when every file matches or when there is no manifest."""
    path = os.path.join(root, DIGEST_FILE)
    if not epath.Path(path).exists():
        return None

    def rel(name: str) -> str:
        return os.path.relpath(os.path.join(root, name), base)

    try:
        manifest = json.loads(epath.Path(path).read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("algorithm") != "sha256" or not isinstance(files, dict):
            raise ValueError("unknown manifest format")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{rel(DIGEST_FILE)}: unreadable digest manifest ({type(exc).__name__}: {exc})"
    for name, want in sorted(files.items()):
        file = os.path.join(root, name)
        if not epath.Path(file).is_file():
            return f"{rel(name)}: missing"
        size = _size(file)
        if size != want["size"]:
            return f"{rel(name)}: size {size} bytes, {want['size']} when saved (truncated or overwritten)"
        if _file_sha256(file) != want["sha256"]:
            return f"{rel(name)}: SHA-256 does not match the digest written at save time"
    extra = sorted(set(n.replace(os.sep, "/") for n in _digest_files(root)) - set(files))
    if extra:
        return f"{rel(extra[0])}: not in the digest written at save time"
    return None


class Checkpointer:
    """Save and restore a run's checkpoints under one directory.

    After :meth:`restore`, :attr:`restored_step` is the step that was actually restored
    (older than the latest when newer steps were corrupt)."""

    def __init__(self, directory: str, *, keep: int = 3, async_save: bool = True):
        self.directory = paths.resolve(directory)  # a gs:// (or other remote) URI stays one
        epath.Path(self.directory).mkdir(parents=True, exist_ok=True)
        # Leftovers of an interrupted save are removed here, before anything is written:
        # Orbax's own cleanup runs in the background and could delete the reference while
        # save_reference is writing it into this directory.
        if jax.process_index() == 0:
            for leftover in epath.Path(self.directory).glob("*.orbax-checkpoint-tmp*"):
                with contextlib.suppress(OSError):
                    leftover.rmtree()
        if jax.process_count() > 1:
            multihost.barrier("alignax: checkpoint directory ready")
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
        self._manager = ocp.CheckpointManager(epath.Path(self.directory), options=options, handler_registry=registry)
        self._undigested: set[int] = set()  # steps this object saved whose manifest is not written yet
        self._writing: int | None = None  # the step of the save in flight (None: none, or it committed)
        self._failed: CheckpointWriteError | None = None  # a failed save, once known: every later save raises it
        self.restored_step: int | None = None

    # ---- the frozen reference -------------------------------------------------------
    @property
    def reference_path(self) -> str:
        return os.path.join(self.directory, REFERENCE_DIR)

    def has_reference(self) -> bool:
        return epath.Path(self.reference_path).is_dir()

    def save_reference(self, reference_params: Any) -> None:
        """Write the frozen reference once, with its digest manifest; later calls are
        no-ops (it never changes)."""
        if multihost.process_zero_says(self.has_reference()):  # one answer for all: the save is collective
            return
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(epath.Path(self.reference_path), reference_params)
        if jax.process_index() == 0:
            write_digest(self.reference_path)

    def restore_reference(self, abstract_params: Any) -> Any:
        """The reference restored onto the shardings of ``abstract_params``.

        Its files are checked against the digest manifest first (a reference saved without
        one is checked by the restore alone); there is no fallback, so damage raises
        :class:`CorruptCheckpointError` naming the file."""
        if not self.has_reference():
            raise FileNotFoundError(f"no frozen reference saved under {self.reference_path}")
        problem = (check_digest(self.reference_path, base=self.directory)
                   if jax.process_index() == 0 else None)
        if not multihost.all_agree(problem is None):
            raise CorruptCheckpointError(
                f"the frozen reference under {self.directory} is corrupt: "
                f"{problem or 'digest mismatch reported by process 0'}")
        try:
            with ocp.StandardCheckpointer() as checkpointer:
                return checkpointer.restore(epath.Path(self.reference_path), abstract_params)
        except Exception as exc:
            raise CorruptCheckpointError(
                f"the frozen reference {self.reference_path} could not be restored: "
                f"{type(exc).__name__}: {exc}") from exc

    # ---- steps ----------------------------------------------------------------------
    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def save(self, step: int, state: Any, meta: Mapping[str, Any], *, force: bool = False) -> bool:
        """Start saving ``state`` (a pytree of arrays) and ``meta`` (JSON-able) at ``step``.

        The previous save is waited for (Orbax would wait for it anyway) so that its
        digest manifest is written before the next one starts. A save that fails, now or
        in the background, raises :class:`CheckpointWriteError` naming its own step (here,
        or at the next :meth:`save`, :meth:`wait` or :meth:`check_for_errors`)."""
        if self._failed is not None:
            raise self._failed
        if self._undigested:
            self.wait()
        meta = dict(meta, reference=REFERENCE_DIR if self.has_reference() else None)
        self._writing = step
        try:
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                force=force,
            )
        except Exception as err:
            raise self._failure(err) from err
        if saved:
            self._undigested.add(step)
        else:
            self._writing = None
        return saved

    def _failure(self, err: BaseException) -> CheckpointWriteError:
        """The failed save's error (the first one: Orbax raises it again on every later call)."""
        if self._failed is None:
            where = self.step_path(self._writing) if self._writing is not None else self.directory
            self._failed = CheckpointWriteError(self._writing, where, err)
        return self._failed

    def _write_digests(self) -> None:
        """Write the manifest of every committed step this object saved (call once no save
        is in flight). A step rotated away before its manifest was written is skipped."""
        committed = set(self._manager.all_steps())
        for step in sorted(self._undigested):
            path = self.step_path(step)
            if jax.process_index() == 0 and step in committed and epath.Path(path).is_dir():
                write_digest(path)
        self._undigested.clear()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def verify(self, step: int) -> str | None:
        """What is wrong with ``step`` (``None``: nothing found): its files against its
        digest manifest, and its meta parsed. A step without a manifest has only its meta
        checked; its arrays are checked by :meth:`restore`."""
        if self._undigested:
            self.wait()
        if step not in self.all_steps():
            return f"step {step}: no such checkpoint under {self.directory}"
        problem = check_digest(self.step_path(step), base=self.directory)
        if problem is not None:
            return f"step {step}: {problem}"
        try:
            self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        except Exception as exc:
            return self._restore_problem(step, "meta", exc)
        return None

    def _restore_problem(self, step: int, item: str, exc: Exception) -> str:
        item_dir = os.path.join(self.step_path(step), item)
        files = [f.name for f in (epath.Path(item_dir).iterdir() if epath.Path(item_dir).is_dir() else [])
                 if f.name != "commit_success.txt"]
        where = os.path.relpath(os.path.join(item_dir, files[0]) if len(files) == 1 else item_dir,
                                self.directory)
        message = " ".join(str(exc).split())
        if len(message) > 500:
            message = message[:500] + " ..."
        return f"step {step}: item {item!r} ({where}) failed to restore: {type(exc).__name__}: {message}"

    def _check_fit(self, step: int, abstract_state: Any) -> None:
        """Raise :class:`CheckpointMismatchError` when ``step`` holds another structure than
        ``abstract_state`` (unreadable metadata is left to the restore, as corruption)."""
        try:
            saved = self._manager.item_metadata(step)["state"]
        except Exception:  # noqa: BLE001 - a damaged step; the restore names what is wrong
            return
        if saved is None:
            return
        problem = fit_problem(saved, abstract_state)
        if problem is not None:
            raise CheckpointMismatchError(
                f"checkpoint step {step} under {self.directory} does not fit this run: {problem}. A run resumes "
                "only with the model and optimiser it was trained with (see config.yaml in the run directory); "
                "start over with --overwrite, or use another output_dir")

    def delete_after(self, step: int) -> list[int]:
        """Delete every step newer than ``step`` (resuming from an earlier step); returns them."""
        newer = [s for s in self.all_steps() if s > step]
        for s in newer:
            log.warning("deleting checkpoint step %d (%s): resuming from the earlier step %d", s,
                        self.step_path(s), step)
            self._manager.delete(s)
        return newer

    def _try_restore(self, step: int, abstract_state: Any) -> tuple[tuple[Any, dict[str, Any]] | None, str | None]:
        """``((state, meta), None)`` for an intact step, ``(None, problem)`` otherwise."""
        problem = (check_digest(self.step_path(step), base=self.directory)
                   if jax.process_index() == 0 else None)
        if not multihost.all_agree(problem is None):
            return None, f"step {step}: {problem or 'digest mismatch reported by process 0'}"
        self._check_fit(step, abstract_state)
        result, problem = None, None
        try:
            item = "meta"  # first: it is small, and a garbled one spares reading the arrays
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
            if not isinstance(meta, Mapping):
                raise ValueError(f"expected a JSON object, found {type(meta).__name__}")
            item = "state"
            state = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))).state
            result = state, dict(meta, step=step)
        except Exception as exc:
            problem = self._restore_problem(step, item, exc)
        if not multihost.all_agree(problem is None):
            return None, problem or f"step {step}: restore failed on another process"
        return result, None

    def restore(self, abstract_state: Any, step: int | None = None, *,
                discard_corrupt: bool = True) -> tuple[Any, dict[str, Any]]:
        """``(state, meta)`` of ``step``, arrays placed like ``abstract_state`` (a pytree of
        ``jax.ShapeDtypeStruct`` with shardings, or arrays).

        ``step=None``: the newest intact step. Steps are tried newest first; a step is
        intact when its files match its digest manifest and both items restore (a step
        with no manifest — written by an older version, or whose process died before the
        manifest was written — is verified by attempting the restore only). Each step that
        fails is logged as a WARNING naming the step and the file; when none is intact,
        :class:`CorruptCheckpointError` lists them all. With ``discard_corrupt`` the failed
        steps newer than the restored one are then deleted (see the module docstring).

        An explicit ``step`` that is corrupt raises :class:`CorruptCheckpointError` naming
        the step and file; there is no fallback to another step.

        ``meta["step"]`` and :attr:`restored_step` are the step actually restored."""
        if self._undigested:
            self.wait()
        abstract_state = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
        steps = self.all_steps()
        if step is not None:
            if step not in steps:
                found = f"; steps there: {', '.join(map(str, sorted(steps)))}" if steps else ""
                raise FileNotFoundError(f"no checkpoint of step {step} under {self.directory}{found}")
            result, problem = self._try_restore(step, abstract_state)
            if result is None:
                raise CorruptCheckpointError(f"checkpoint under {self.directory} is corrupt: {problem}")
            self.restored_step = step
            return result
        if not steps:
            raise FileNotFoundError(f"no checkpoint under {self.directory}")
        problems: dict[int, str] = {}
        for candidate in sorted(steps, reverse=True):
            result, problem = self._try_restore(candidate, abstract_state)
            if result is not None:
                break
            problems[candidate] = problem
            log.warning("checkpoint %s is corrupt, trying an older step: %s",
                        self.step_path(candidate), problem)
        else:
            raise CorruptCheckpointError(
                f"no intact checkpoint under {self.directory}; every step failed:\n"
                + "\n".join(f"  {problem}" for _, problem in sorted(problems.items())))
        self.restored_step = candidate
        if problems:
            log.warning("restored step %d of %s, the newest intact one", candidate, self.directory)
            if discard_corrupt:
                for bad in sorted(problems):
                    log.warning("deleting corrupt checkpoint step %d (%s) so that the run continues "
                                "after step %d and keep-N rotation counts intact steps only",
                                bad, self.step_path(bad), candidate)
                    self._manager.delete(bad)
        return result

    def wait(self) -> None:
        """Block until every asynchronous save has committed, and write their digests."""
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            raise self._failure(err) from err
        self._writing = None
        self._write_digests()

    def check_for_errors(self) -> None:
        """Raise the :class:`CheckpointWriteError` of a save that has already failed,
        without waiting for one still writing.

        Orbax's own ``check_for_errors`` cannot tell: its finalize thread consumes the
        background error (and logs it) before a caller sees it. So a save in flight that
        has ended is waited for here (at once), which raises its failure or writes its
        digest. With several processes that is left to the next save or the end of the run:
        Orbax's "in progress" flag is per process, and ``wait`` is a collective that every
        process must reach at the same step."""
        if self._failed is not None:
            raise self._failed
        try:
            self._manager.check_for_errors()
        except Exception as err:
            raise self._failure(err) from err
        if self._writing is not None and jax.process_count() == 1 and not self._manager.is_saving_in_progress():
            self.wait()

    def close(self) -> None:
        """Wait for the saves in flight and release Orbax's threads. After a failed save
        (already raised to the run) nothing is raised again: the run is stopping on it."""
        if self._failed is None:
            try:
                self.wait()
            except CheckpointWriteError:
                self._close_after_failure()
                raise
            self._manager.close()
        else:
            self._close_after_failure()

    def _close_after_failure(self) -> None:
        try:
            self._manager.close()  # joins the background threads, which re-raise the failure
        except Exception as err:  # noqa: BLE001 - the failure is known and reported
            log.debug("closing the checkpoint manager after a failed save: %s", err)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
