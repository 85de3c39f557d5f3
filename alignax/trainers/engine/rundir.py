"""A run's output directory: who holds it, what it already contains, and its configs.

Before a run reads a model or data, :func:`claim` decides whether it may use
``output_dir``, so that nothing is lost or mixed without a word:

- **One run at a time.** A lock file (``.alignax.lock``: host, pid, start time) is taken
  with an exclusive create. A second run on the directory is refused, naming the holder.
  A lock left by a crash is taken over: on the same host when its process is gone, from
  another host when its heartbeat (the lock file's modification time, refreshed every
  ``HEARTBEAT_S`` by a daemon thread of the holder) is older than ``STALE_AFTER_S``.
- **Resume, or say why not.** A directory that holds a run (checkpoints, metrics) is
  resumed when ``checkpoint.resume`` is on and it has checkpoints. A run stopped before its
  first checkpoint (``kill -9``, a crash) has nothing to resume: with the same config (no
  change of what is trained) it starts over, its metrics replaced, so that the same
  command restarts it. Otherwise it is refused unless ``checkpoint.overwrite`` is set,
  which removes that run's files first.
- **Say what changed.** Resuming compares the new config with the run's ``config.yaml``:
  keys that only change how a run is watched or laid out (logging, evaluation, checkpoint
  cadence, the mesh and the process count; ``train.total_steps`` under a constant learning
  rate) pass; any other change — a
  longer run under a decaying schedule included, since it moves the schedule — is refused
  unless ``checkpoint.allow_changes`` is set, and then logged; a change of what the saved
  data position counts (``data.batch_size``, ``data.paths``, ``data.seed``...) is refused
  even then. (A change of model shape is refused when the checkpoint is restored, naming the
  parameter; see :meth:`alignax.checkpoint.Checkpointer.restore`.)
- **Config history.** The resolved config is written only once the run has been accepted
  and restored (:meth:`RunDirectory.write_config`); a different earlier ``config.yaml`` is
  kept as ``config.<n>.yaml``.

Claims are re-entrant within a process (``alignax.trainers.api.train`` claims before
building the trainer, the trainer's session claims again), and only process 0 of a
multi-process run holds the lock and writes files.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
import yaml
from etils import epath

from alignax import config as config_io
from alignax import paths
from alignax.trackers import TRACKER_IDS
from alignax.config import ConfigError
from alignax.parallel import multihost
from alignax.trainers.config import TrainConfig, rename_sections

log = logging.getLogger("alignax")

LOCK_NAME = ".alignax.lock"
CONFIG_NAME = "config.yaml"
HEARTBEAT_S = 60.0
STALE_AFTER_S = 600.0

# Files and folders a run writes into output_dir (see alignax.trainers.engine.session);
# --overwrite removes these and nothing else.
RUN_ARTEFACTS = ("checkpoints", "metrics.jsonl", "tensorboard", "evaluation", "export",
                 "wandb", "mlruns", TRACKER_IDS,  # experiment trackers (alignax.trackers)
                 "alarms.jsonl", "gold_best", "gold.json", "gold.png",  # the monitor (online.guard)
                 "async_in_flight")  # unsampled rollouts' weights (online.schedule)

# Keys that change how a run is watched or saved, never what it computes: a resumed run
# may change them freely.
_FREE_PREFIXES = ("logging.", "evaluation.", "checkpoint.", "output_dir",
                  "mesh.", "distributed.")  # a run resumes on another mesh or process count
# Keys the saved data position (a count of global batches into one shuffled dataset,
# alignax.data.pipeline) depends on: a resume cannot change them, even with allow_changes.
_POSITION_KEYS = ("data.paths", "data.split", "data.seed", "data.shuffle", "data.batch_size", "data.eval_fraction")
_FREE_KEYS = frozenset({"train.log_every", "train.eval_every", "train.save_every", "train.eval_batches",
                        "train.max_nonfinite_streak", "train.max_stalled_streak"})


class RunDirectoryError(ConfigError):
    """``output_dir`` cannot be used as asked (held by another run, holds a run that would
    be lost, or a resume with unapproved changes); the message says what to do."""


# ---------------------------------------------------------------------------- the lock
def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


class _Lock:
    """An exclusive-create lock file with a heartbeat thread.

    On an object store (``gs://``...) there is no exclusive create: the lock is checked,
    then written, so a run started while another holds the directory is refused as on a
    local disk, but two started within the same moment could both pass; the heartbeat
    rewrites the object (no ``utime`` there)."""

    def __init__(self, path: str):
        self.path = path
        self.remote = paths.is_remote(path)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holder(self) -> dict[str, Any] | None:
        try:
            return json.loads(epath.Path(self.path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable: a lock being written, or garbage; judged by its age

    def _stale(self, holder: dict[str, Any]) -> str | None:
        """Why the held lock is stale (its run is gone), or None when it may be alive."""
        try:
            age = time.time() - epath.Path(self.path).stat().mtime
        except FileNotFoundError:
            return "removed meanwhile"
        if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
            if not _process_alive(holder["pid"]):
                return f"process {holder['pid']} on this host has exited"
            return None
        if age > STALE_AFTER_S:
            return f"no heartbeat for {age:.0f} s"
        return None

    def acquire(self) -> None:
        me = {"host": socket.gethostname(), "pid": os.getpid(),
              "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        if self.remote:
            log.warning("%s is on an object store, which has no exclusive create: the run lock is checked and "
                        "then written, so two runs started at the same moment could both take it", self.path)
        for _ in range(3):
            try:
                if self.remote:
                    if epath.Path(self.path).exists():
                        raise FileExistsError(self.path)
                    epath.Path(self.path).write_text(json.dumps(me), encoding="utf-8")
                else:
                    fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        json.dump(me, f)
            except FileExistsError:
                holder = self.holder()
                if holder is None:
                    continue
                why = self._stale(holder)
                if why is None:
                    raise RunDirectoryError(
                        f"{os.path.dirname(self.path)} is in use by another run (host {holder.get('host', '?')}, "
                        f"pid {holder.get('pid', '?')}, since {holder.get('started', '?')}); wait for it to end, "
                        f"use another output_dir, or remove {self.path} if that run is gone") from None
                log.warning("taking over the stale lock %s (held by host %s pid %s: %s)", self.path,
                            holder.get("host", "?"), holder.get("pid", "?"), why)
                epath.Path(self.path).unlink(missing_ok=True)
                continue
            self._me = me
            self._thread = threading.Thread(target=self._beat, name="alignax-lock-heartbeat", daemon=True)
            self._thread.start()
            return
        raise RunDirectoryError(f"could not take the lock {self.path} (other runs keep taking it)")

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                if self.remote:
                    epath.Path(self.path).write_text(json.dumps(self._me), encoding="utf-8")
                else:
                    os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        holder = self.holder()
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            epath.Path(self.path).unlink(missing_ok=True)


# ---------------------------------------------------------------------------- what is there
def checkpoint_steps(output_dir: str) -> list[int]:
    """Committed checkpoint steps under ``output_dir/checkpoints`` (read from the folder
    names, without Orbax: cheap enough to decide before a model loads)."""
    directory = epath.Path(paths.resolve(output_dir)) / "checkpoints"
    if not directory.is_dir():
        return []
    return sorted(int(entry.name) for entry in directory.iterdir() if entry.name.isdigit() and entry.is_dir())


def config_changes(saved: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key, saved value, new value)`` for every dotted key that differs."""
    a, b = config_io.dotted(saved), config_io.dotted(new)
    missing = object()
    changes = []
    for key in sorted(set(a) | set(b)):
        old, now = a.get(key, missing), b.get(key, missing)
        if old != now:
            changes.append((key, None if old is missing else old, None if now is missing else now))
    return changes


def _is_free(key: str) -> bool:
    return key in _FREE_KEYS or key.startswith(_FREE_PREFIXES)


def describe_changes(changes: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{key}: {old!r} -> {new!r}" for key, old, new in changes)


def saved_config_changes(path: str, config: TrainConfig) -> tuple[list, list]:
    """``(bound, free)``: how ``config`` differs from the ``config.yaml`` saved in ``path``
    (none saved: no changes), split into changes of what is trained and the rest (with a
    constant learning rate, a longer run is free)."""
    saved_path = paths.as_path(path) / CONFIG_NAME
    if not saved_path.exists():
        return [], []
    # a run saved before a section was renamed compares under the new names
    saved = rename_sections(config_io.yaml_load(saved_path.read_text(encoding="utf-8")) or {}, warn=False)
    changes = config_changes(saved, config_io.to_dict(config))
    constant_lr = config.optim.schedule == "constant" and saved.get("optim", {}).get("schedule") == "constant"
    bound = [c for c in changes if not (_is_free(c[0]) or (constant_lr and c[0] == "train.total_steps"))]
    return bound, [c for c in changes if c not in bound]


# ---------------------------------------------------------------------------- the directory
class RunDirectory:
    """A claimed ``output_dir``; see the module docstring. Build with :func:`claim`."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self.path = config.output_dir
        self.root = paths.as_path(config.output_dir)  # every file operation; gs://... stays remote
        self.writer = jax.process_index() == 0
        self._lock = _Lock(os.path.join(self.path, LOCK_NAME)) if self.writer else None

    def _open(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        error: RunDirectoryError | None = None
        try:
            if self._lock is not None:
                self._lock.acquire()
            self._check()
        except RunDirectoryError as err:
            error = err
        except BaseException:
            self.close()
            raise
        if jax.process_count() > 1:  # one verdict for all, and the others wait for an --overwrite
            refused = multihost.allgather_rows(np.array([error is not None], np.int32))
            if refused.any() and error is None:
                error = RunDirectoryError(f"{self.path}: process {int(np.argmax(refused))} refused the output "
                                          "directory (its log says why)")
        if error is not None:
            self.close()
            raise error

    def _check(self) -> None:
        config, ck = self.config, self.config.checkpoint
        steps = checkpoint_steps(self.path)
        artefacts = [name for name in RUN_ARTEFACTS if (self.root / name).exists()]
        if ck.overwrite:
            if self.writer and (artefacts or self._configs()):
                self._remove_run(artefacts, "checkpoint.overwrite")
            return
        resuming = ck.enabled and ck.resume and bool(steps)
        if not resuming:
            if self._stopped_before_first_save(artefacts):
                if self.writer:
                    self._remove_run(artefacts, "no completed checkpoint to resume from, starting the run over")
                return
            if artefacts:
                held = f"checkpoints at steps {', '.join(map(str, steps))}" if steps else ", ".join(artefacts)
                why = ("checkpoint.resume=false" if steps and not ck.resume
                       else "checkpoint.enabled=false" if steps else "there is no checkpoint to resume from")
                raise RunDirectoryError(
                    f"{self.path} already holds a run ({held}) and {why}: a new run would mix with it or "
                    "lose it. Resume it (checkpoint.resume=true), choose another output_dir, or replace it with "
                    "--overwrite (checkpoint.overwrite=true)")
            return
        if ck.resume_step is not None and ck.resume_step not in steps:
            raise RunDirectoryError(f"checkpoint.resume_step={ck.resume_step}: no such step under "
                                    f"{os.path.join(self.path, 'checkpoints')}; steps there: "
                                    f"{', '.join(map(str, steps))}")
        bound, free = saved_config_changes(self.path, config)
        fixed = [c for c in bound if c[0] in _POSITION_KEYS]
        if fixed:
            raise RunDirectoryError(
                f"resuming {self.path} (latest step {steps[-1]}) with {describe_changes(fixed)}: its checkpoints "
                "hold a position in the data read with the saved value (a count of batches into one shuffled "
                "dataset), so a resume cannot change it, not even with --allow-changes. Undo the change, or "
                "start over with --overwrite or another output_dir")
        if bound and not ck.allow_changes:
            raise RunDirectoryError(
                f"resuming {self.path} (latest step {steps[-1]}) with a config that changes what is trained: "
                f"{describe_changes(bound)}. Resume with these changes with --allow-changes "
                "(checkpoint.allow_changes=true), undo them, or start over with --overwrite")
        if bound:
            log.warning("resuming %s with changes (checkpoint.allow_changes): %s", self.path, describe_changes(bound))
        if free:
            log.info("resuming %s with changed settings: %s", self.path, describe_changes(free))

    def _stopped_before_first_save(self, artefacts: list[str]) -> bool:
        """Whether ``output_dir`` holds a run killed before its first checkpoint, that this
        config would train again: nothing to lose or mix (a run that ends saves a last step;
        one that exported had one), and an automatic restart must not need --overwrite. A
        run that saved no checkpoints on purpose (``checkpoint.enabled=false``) is not one."""
        ck = self.config.checkpoint
        if not (artefacts and ck.enabled and ck.resume) or "export" in artefacts:
            return False
        bound, free = saved_config_changes(self.path, self.config)
        return not bound and all(key != "checkpoint.enabled" for key, _, _ in free)

    def _configs(self) -> list[str]:
        return sorted(name for name in (entry.name for entry in self.root.iterdir())
                      if name == CONFIG_NAME or (name.startswith("config.") and name.endswith(".yaml")))

    def _remove_run(self, artefacts: list[str], why: str) -> None:
        log.warning("%s: removing the earlier run in %s (%s)", why, self.path, ", ".join(artefacts + self._configs()))
        for name in artefacts + self._configs():
            path = self.root / name
            if path.is_dir():
                path.rmtree()
            else:
                path.unlink()

    def write_config(self) -> None:
        """Write the resolved config as ``config.yaml``; an earlier one that differs is kept
        as ``config.<n>.yaml`` (n = 1, 2, ... in the order they were replaced)."""
        if not self.writer:
            return
        text = yaml.safe_dump(config_io.to_dict(self.config), sort_keys=False)
        path = self.root / CONFIG_NAME
        if path.exists():
            if path.read_text(encoding="utf-8") == text:
                return
            n = 1
            while (self.root / f"config.{n}.yaml").exists():
                n += 1
            path.replace(self.root / f"config.{n}.yaml")
        paths.write_text(path, text)

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()


_CLAIMED: dict[str, list] = {}  # realpath -> [RunDirectory, depth]


@contextlib.contextmanager
def claim(config: TrainConfig) -> Iterator[RunDirectory]:
    """Claim ``config.output_dir`` for a training run (re-entrant within this process)."""
    key = config.output_dir if paths.is_remote(config.output_dir) else os.path.realpath(config.output_dir)
    if key in _CLAIMED:
        entry = _CLAIMED[key]
        entry[1] += 1
        try:
            yield entry[0]
        finally:
            entry[1] -= 1
        return
    run_dir = RunDirectory(config)
    run_dir._open()
    _CLAIMED[key] = [run_dir, 1]
    try:
        yield run_dir
    finally:
        del _CLAIMED[key]
        run_dir.close()
