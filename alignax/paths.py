"""Run-directory paths that may live on an object store (``gs://``, ``s3://``, ...).

A run's ``output_dir`` (checkpoints, ``config.yaml``, metrics, evaluation reports,
exports) is either a local directory or an object-store URI. Every file operation on it
goes through ``etils.epath.Path``, which serves both: local paths are made absolute as
before, and a remote URI stays a URI — ``os.path.abspath("gs://b/run")`` would turn it
into a local folder ``./gs:/b/run`` on every host.

What an object store cannot do, and what is done instead:

- **Atomic rename.** A local file is written to a temporary name and renamed into place
  (:func:`write_text`); an object-store upload is committed whole when it closes, so the
  object is written directly and a reader never sees half of it.
- **Append.** :class:`alignax.metrics.JsonlWriter` rewrites the whole object on each write.
- **Exclusive create.** The run-directory lock (:mod:`alignax.trainers.engine.rundir`) is a
  check-then-write there: a run started after another is refused as on a local disk, but two
  started at the same moment could both pass (logged as a warning).
- **Writers that need a local file** (Hugging Face export, tokenizers) write into a local
  temporary directory that is copied up afterwards (:func:`local_directory_for`).
- **Readers that need a local file** (safetensors memory maps, tokenizers, parquet and
  Arrow readers): a model folder or data file given as a URI (``model.name``,
  ``data.paths``, reward, critic, judge and PRM paths) is copied once per process into a
  local staging directory and read there (:func:`staged`).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import io
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from etils import epath
from etils.epath import backend as epath_backend
from etils.epath import gpath

from alignax.config import ConfigError

# The URI schemes etils.epath serves (through gcsfs/s3fs/adlfs, or TensorFlow's gfile).
REMOTE_SCHEMES = ("gs://", "s3://", "az://", "hf://")
_COPY_CHUNK = 8 << 20
# The package a scheme's store is read through (by etils' fsspec backend), and the extra that
# installs it: etils' own "Please install gcsfs" names neither the path nor the extra.
_STORE_PACKAGES = {"gs://": ("gcsfs", "alignax[gcs]")}
_STAGED: dict[str, str] = {}  # URI -> its local copy, for this process


def is_remote(path: str | os.PathLike) -> bool:
    """Whether ``path`` names an object-store location rather than a local file."""
    return os.fspath(path).startswith(REMOTE_SCHEMES)


def resolve(path: str | os.PathLike) -> str:
    """``path`` as a run names it: absolute when local (as ``os.path.abspath``), unchanged
    when remote."""
    text = os.fspath(path)
    return text if is_remote(text) else os.path.abspath(text)


def as_path(path: str | os.PathLike) -> epath.Path:
    """:func:`resolve`'s answer as an ``epath.Path`` (what file operations go through). A
    ``gs://`` path without gcsfs installed is a ``ConfigError`` naming the path and the extra."""
    text = resolve(path)
    for scheme, (package, extra) in _STORE_PACKAGES.items():
        # only etils' fsspec backend needs the package (a test's stand-in store does not)
        backend = gpath._PREFIX_TO_BACKEND.get(scheme[:-3])  # noqa: SLF001 - no public query
        if (text.startswith(scheme) and isinstance(backend, epath_backend._FileSystemSpecBackend)  # noqa: SLF001
                and importlib.util.find_spec(package) is None):
            raise ConfigError(f"{text} needs the {package} package, which is not installed: "
                              f"pip install '{extra}' (make install-tpu includes it)")
    return epath.Path(text)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old content or the new, never a
    part (:func:`writing`)."""
    with writing(path, "w") as f:
        f.write(text)


@contextlib.contextmanager
def writing(path: str | os.PathLike, mode: str = "wb") -> Iterator[Any]:
    """A file to write ``path`` whole or not at all, local or remote: locally
    :func:`atomic_open`; on an object store a buffer uploaded in one piece when the block ends
    (an upload the store commits whole; nothing is uploaded if the block raises)."""
    target = as_path(path)
    if not is_remote(target):
        with atomic_open(target, mode) as f:
            yield f
        return
    buffer = io.StringIO() if mode == "w" else io.BytesIO()
    yield buffer
    if mode == "w":
        target.write_text(buffer.getvalue(), encoding="utf-8")
    else:
        target.write_bytes(buffer.getvalue())


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[Any]:
    """A local file opened for writing (``mode`` ``"w"`` or ``"wb"``) that appears at ``path``
    whole or not at all: written to a temporary file beside it, flushed to disk and renamed
    into place when the block ends; an exception in the block removes the temporary file
    and leaves ``path`` as it was."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb'; got {mode!r}")
    if is_remote(path):
        raise ValueError(f"{path}: atomic_open writes local files; an object store commits an upload whole "
                         "(write it through paths.as_path)")
    # unique per process and thread (two threads may write one path); the "{path}.tmp-" prefix is
    # what readers of a directory skip (the checkpoint digest)
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(tmp, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
        try:  # the rename itself on disk, not only in the page cache
            os.fsync(directory)
        finally:
            os.close(directory)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def local_directory_for(destination: str | os.PathLike) -> Iterator[str]:
    """A local directory in which to write the files meant for ``destination`` (for writers
    that only know local files): ``destination`` itself (created) when it is local; for a
    remote one a temporary directory whose files are copied there, file by file, when the
    block ends without an error."""
    if not is_remote(destination):
        local = resolve(destination)
        os.makedirs(local, exist_ok=True)
        yield local
        return
    target = as_path(destination)
    with tempfile.TemporaryDirectory(prefix="alignax-upload-") as staging:
        yield staging
        for dirpath, _, files in os.walk(staging):
            rel = os.path.relpath(dirpath, staging)
            folder = target if rel == "." else target / rel
            folder.mkdir(parents=True, exist_ok=True)
            for name in files:  # streamed: an exported model can be gigabytes
                with open(os.path.join(dirpath, name), "rb") as src, (folder / name).open("wb") as dst:
                    shutil.copyfileobj(src, dst, _COPY_CHUNK)


def staged(path: str | os.PathLike, *, key: str = "path") -> str:
    """A local path holding what ``path`` names: ``path`` itself when local; for a URI, a
    copy of the object (or of every object under it, a folder) in a staging directory of
    this process, made on first use and reused after (removed when the process exits).

    Each process of a job copies for itself (processes on one host do not share the copy;
    a copy lasts one run, so an object rewritten between runs is read anew). A URI with
    nothing under it is a ``FileNotFoundError`` naming ``key`` (the config key it came from).
    """
    text = os.fspath(path)
    if not is_remote(text):
        return text
    uri = text.rstrip("/")
    if uri in _STAGED:
        return _STAGED[uri]
    source = epath.Path(uri)
    if not source.exists():
        raise FileNotFoundError(f"{key}={text}: nothing there (no object, no folder) on the store")
    target = os.path.join(_staging_root(), str(len(_STAGED)), source.name)
    _copy_down(source, target)
    _STAGED[uri] = target
    return target


def _staging_root() -> str:
    if "root" not in _staging_root.__dict__:
        root = tempfile.mkdtemp(prefix="alignax-staged-")
        atexit.register(shutil.rmtree, root, True)
        _staging_root.root = root
    return _staging_root.root


def _copy_down(source: epath.Path, target: str) -> None:
    """``source`` (an object, or a folder of them, recursively) copied to local ``target``."""
    if source.is_dir():
        os.makedirs(target, exist_ok=True)
        for child in source.iterdir():
            _copy_down(child, os.path.join(target, child.name))
        return
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with source.open("rb") as src, open(target, "wb") as dst:  # streamed: weights can be gigabytes
        shutil.copyfileobj(src, dst, _COPY_CHUNK)
