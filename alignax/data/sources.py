"""Record sources: JSONL, JSON, Parquet and local Hugging Face ``datasets`` folders.

Every source is a grain ``RandomAccessDataSource`` (``__len__``, ``__getitem__``,
``__repr__``) whose items are plain ``dict`` records, and it knows where each record lives
(``source.where(i)`` -> ``"train.jsonl, line 17"``) so that a bad record is reported by
file and line (or row). Reading a record that cannot be decoded raises
:class:`BadRecordError`; the pipeline turns that into an error or a counted skip.

Supported paths (:func:`open_source`):

- ``*.jsonl`` / ``*.json``: one JSON object per line (blank lines ignored); a ``.json`` file
  whose first character is ``[`` is read as one JSON array of objects.
- ``*.parquet``: rows of a Parquet file (pyarrow; nested columns come back as lists/dicts).
- a folder written by ``datasets.Dataset.save_to_disk`` (``state.json`` listing Arrow
  stream files), or by ``DatasetDict.save_to_disk`` (``dataset_dict.json`` and one such
  folder per split), read with pyarrow alone — the ``datasets`` package is not needed.
- a hub-style repository folder of ``.parquet`` / ``.jsonl`` / ``.json`` data files; the
  split's files are those whose path has a folder named ``split`` or whose file name
  starts with ``split`` (``data/train-00000-of-00002.parquet``, ``test.jsonl``); when no
  file names any split, every data file belongs to ``train``.
"""

from __future__ import annotations

import bisect
import json
import mmap
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from alignax.config import ConfigError

DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")


class BadRecordError(ConfigError):
    """A record that cannot be used: where it is, which field, and why.

    ``reason`` is a short key used to count skips (``malformed``, ``not_utf8``,
    ``missing_field``, ``empty``, ``identical``, ``too_long``, ``invalid``).
    """

    def __init__(self, reason: str, field: str | None, message: str, where: str | None = None):
        self.reason = reason
        self.field = field
        self.detail = message
        self.where = where
        super().__init__(self._text())
        self.reason = reason  # ConfigError's initialiser set its own (None)

    def _text(self) -> str:
        parts = [self.where] if self.where else []
        if self.field is not None:
            parts.append(f"field {self.field!r}")
        parts.append(self.detail)
        return ": ".join(parts)

    def located(self, where: str) -> BadRecordError:
        """The same error with its location (file and line/row) filled in."""
        return BadRecordError(self.reason, self.field, self.detail, where)


def _surrogate_field(value: Any, path: str) -> str | None:
    """Path of the first string holding an undecodable byte (a lone surrogate)."""
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, Mapping):
        for key, item in value.items():
            found = _surrogate_field(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found = _surrogate_field(item, f"{path}[{i}]")
            if found:
                return found
    return None


_SURROGATE = re.compile("[\udc80-\udcff]")


def _check_record(record: Any) -> dict:
    if not isinstance(record, dict):
        raise BadRecordError("malformed", None, f"expected a JSON object, got {type(record).__name__}")
    return record


class JsonlSource:
    """Records of a JSON-lines file, indexed by byte offset so any line is read directly.

    ``where(i)`` gives the file (as ``name`` calls it, default its path) and its 1-based
    line number. Invalid UTF-8 is reported with the field that holds it; a line that is
    not a JSON object is ``malformed``.
    """

    def __init__(self, path: str | os.PathLike, name: str | None = None):
        self.path = os.fspath(path)
        self.name = name or self.path
        with open(self.path, "rb") as f:
            # Memory-mapped, so a large file is paged in on demand, not held in memory.
            size = os.fstat(f.fileno()).st_size
            self._data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        offsets, lines = [], []
        start, line_no = 0, 0
        while start < size:
            end = self._data.find(b"\n", start)
            end = size if end < 0 else end
            line_no += 1
            if self._data[start:end].strip():
                offsets.append((start, end))
                lines.append(line_no)
            start = end + 1
        self._offsets = offsets
        self._lines = lines

    def __len__(self) -> int:
        return len(self._offsets)

    def where(self, index: int) -> str:
        return f"{self.name}, line {self._lines[index]}"

    def __getitem__(self, index: int) -> dict:
        start, end = self._offsets[index]
        raw = self._data[start:end]
        text = raw.decode("utf-8", errors="surrogateescape")
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            if _SURROGATE.search(text):
                col = _SURROGATE.search(text).start() + 1
                raise BadRecordError("not_utf8", None, f"invalid UTF-8 byte at column {col}") from None
            raise BadRecordError("malformed", None, f"malformed JSON ({e.msg} at column {e.colno})") from None
        record = _check_record(record)
        bad = _surrogate_field(record, "")
        if bad is not None:
            raise BadRecordError("not_utf8", bad, "invalid UTF-8 byte in the text")
        return record

    def __repr__(self) -> str:
        return f"JsonlSource({self.name!r}, records={len(self)})"


class ListSource:
    """Records held in memory (a JSON array file, or records built by a generator)."""

    def __init__(self, records: Sequence[Any], name: str, unit: str = "item"):
        self.records = list(records)
        self.name = name
        self.unit = unit

    def __len__(self) -> int:
        return len(self.records)

    def where(self, index: int) -> str:
        return f"{self.name}, {self.unit} {index}"

    def __getitem__(self, index: int) -> dict:
        return _check_record(self.records[index])

    def __repr__(self) -> str:
        return f"ListSource({self.name!r}, records={len(self)})"


def _decode_binary(value: Any, path: str) -> Any:
    """Arrow binary values become ``str``; invalid UTF-8 raises naming the field."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadRecordError("not_utf8", path, f"invalid UTF-8 byte at offset {e.start}") from None
    if isinstance(value, dict):
        return {k: _decode_binary(v, f"{path}.{k}" if path else k) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_binary(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return value


class ArrowTableSource:
    """Rows of a pyarrow ``Table`` (from Parquet or Arrow stream files); ``where`` names the row."""

    def __init__(self, table: pa.Table, name: str):
        self.table = table
        self.name = name

    def __len__(self) -> int:
        return self.table.num_rows

    def where(self, index: int) -> str:
        return f"{self.name}, row {index}"

    def __getitem__(self, index: int) -> dict:
        row = self.table.slice(index, 1).to_pylist()[0]
        return _decode_binary(row, "")

    def __repr__(self) -> str:
        return f"ArrowTableSource({self.name!r}, rows={len(self)})"


class ConcatSource:
    """Several sources as one; ``where(i)`` is the owning source's location."""

    def __init__(self, sources: Sequence[Any]):
        self.sources = list(sources)
        self._starts = list(np.cumsum([0] + [len(s) for s in self.sources]))

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _locate(self, index: int) -> tuple[Any, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} out of range for {len(self)} records")
        k = bisect.bisect_right(self._starts, index) - 1
        return self.sources[k], index - int(self._starts[k])

    def where(self, index: int) -> str:
        source, local = self._locate(index)
        return source.where(local)

    def __getitem__(self, index: int) -> dict:
        source, local = self._locate(index)
        return source[local]

    def __repr__(self) -> str:
        return f"ConcatSource({', '.join(repr(s) for s in self.sources)})"


def _open_file(path: str, name: str):
    if path.endswith(".parquet"):
        try:
            table = pq.read_table(path, memory_map=True)
        except (pa.ArrowException, OSError) as e:  # pyarrow's own errors, raised on a truncated or foreign file
            raise BadRecordError("malformed", None, f"not a readable Parquet file ({' '.join(str(e).split())})",
                                 name) from None
        return ArrowTableSource(table, name)
    if path.endswith(".json"):
        with open(path, "rb") as f:
            head = f.read(4096).lstrip()
        if head.startswith(b"["):
            with open(path, "rb") as f:
                raw = f.read()
            try:
                records = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise BadRecordError("not_utf8", None, f"invalid UTF-8 byte at offset {e.start}", name) from None
            except json.JSONDecodeError as e:
                raise BadRecordError(
                    "malformed", None, f"malformed JSON ({e.msg} at line {e.lineno})", name
                ) from None
            return ListSource(records, name, unit="item")
    if path.endswith((".jsonl", ".json")):
        return JsonlSource(path, name)
    raise ConfigError(f"unsupported data file {name!r}; expected one of {', '.join(DATA_FILE_SUFFIXES)}")


def _read_arrow_stream(path: str) -> pa.Table:
    with pa.memory_map(path) as source:
        return pa.ipc.open_stream(source).read_all()


def _saved_dataset(folder: str, name: str) -> ArrowTableSource:
    with open(os.path.join(folder, "state.json"), encoding="utf-8") as f:
        state = json.load(f)
    files = [os.path.join(folder, entry["filename"]) for entry in state["_data_files"]]
    tables = [_read_arrow_stream(p) for p in files]
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    return ArrowTableSource(table, name)


def _split_matches(rel_path: str, split: str) -> bool:
    parts = rel_path.replace(os.sep, "/").split("/")
    if split in parts[:-1]:
        return True
    return re.match(rf"{re.escape(split)}(?:[-_.]|$)", parts[-1]) is not None


def _repo_files(folder: str, split: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.endswith(DATA_FILE_SUFFIXES) and name not in ("dataset_info.json", "state.json"):
                found.append(os.path.relpath(os.path.join(root, name), folder))
    known = ("train", "validation", "valid", "test", "eval", "dev")
    named = [p for p in found if any(_split_matches(p, s) for s in known + (split,))]
    if named:
        chosen = [p for p in found if _split_matches(p, split)]
    else:
        chosen = found if split == "train" else []
    return [os.path.join(folder, p) for p in chosen]


def open_source(path: str | os.PathLike, *, split: str = "train", name: str | None = None):
    """A grain random-access source of dict records for a file or a dataset folder.

    Args:
      path: a data file (``.jsonl``, ``.json``, ``.parquet``) or a folder (see the module
        docstring for the folder layouts understood).
      split: which split of a folder to read (``train``, ``test``, ...).
      name: what errors and ``where`` call ``path`` (default: ``path``); for a local copy
        of an object-store URI, the URI (``gs://bucket/data`` for ``/tmp/staged/data``,
        and ``gs://bucket/data/train.jsonl`` for a file under it).

    Raises ``FileNotFoundError`` for a missing path and ``ValueError`` naming the folder
    and the splits it has when the split is not there.
    """
    path = os.fspath(path)
    name = os.fspath(name) if name is not None else path

    def named(local: str) -> str:  # a file under ``path`` as ``name`` calls it
        return name.rstrip("/") + local[len(path):].replace(os.sep, "/") if name != path else local

    if not os.path.exists(path):
        raise FileNotFoundError(f"data path {name!r} does not exist")
    if os.path.isfile(path):
        return _open_file(path, name)
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        with open(os.path.join(path, "dataset_dict.json"), encoding="utf-8") as f:
            splits = json.load(f)["splits"]
        if split not in splits:
            raise ValueError(f"{name} has splits {', '.join(splits)}; no split {split!r} (data.split)")
        return _saved_dataset(os.path.join(path, split), f"{name}/{split}")
    if os.path.isfile(os.path.join(path, "state.json")):
        return _saved_dataset(path, name)
    files = _repo_files(path, split)
    if not files:
        raise ValueError(
            f"{name} holds no {', '.join(DATA_FILE_SUFFIXES)} data files for split {split!r} "
            "(nor a save_to_disk state.json / dataset_dict.json)"
        )
    sources = [_open_file(f, named(f)) for f in files]
    return sources[0] if len(sources) == 1 else ConcatSource(sources)
