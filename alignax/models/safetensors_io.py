"""Read and write the safetensors format with NumPy alone (no torch, bfloat16 included).

Format: 8-byte little-endian header length ``n``, ``n`` bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then
the raw little-endian tensor bytes (offsets relative to the end of the header). Every
field is validated on read, so a truncated or corrupt file raises
:class:`SafetensorsError` naming the file and what is wrong, never a partial dict.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping

import ml_dtypes
import numpy as np

from alignax import paths

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_CODES = {v: k for k, v in _DTYPES.items()}

_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A safetensors file that cannot be read as such."""


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of one file as read-only NumPy arrays backed by a memory map."""
    path = os.fspath(path)
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise FileNotFoundError(f"safetensors file not found: {path}") from e
    if size < 8:
        raise SafetensorsError(f"{path}: {size} bytes is too short for a safetensors file (no header)")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(size - 8, _MAX_HEADER):
            raise SafetensorsError(
                f"{path}: header length {n} exceeds the file ({size} bytes); file corrupt or truncated"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(f"{path}: header is not valid JSON ({e}); file corrupt") from e
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object; file corrupt")
    data_start = 8 + n
    data_size = size - data_start
    out: dict[str, np.ndarray] = {}
    mm = np.memmap(path, dtype=np.uint8, mode="r") if data_size > 0 else np.zeros(0, np.uint8)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise SafetensorsError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from e
        if code not in _DTYPES:
            raise SafetensorsError(
                f"{path}: tensor {name!r} has unsupported dtype {code!r}; known: {', '.join(_DTYPES)}"
            )
        dtype = _DTYPES[code]
        nbytes = math.prod(shape) * dtype.itemsize
        if not (0 <= begin <= end <= data_size) or end - begin != nbytes:
            raise SafetensorsError(
                f"{path}: tensor {name!r} ({code} {list(shape)}, {nbytes} bytes) has data_offsets "
                f"[{begin}, {end}] outside the {data_size} data bytes; file corrupt or truncated"
            )
        arr = np.frombuffer(mm, dtype=dtype, count=math.prod(shape), offset=data_start + begin) if nbytes else np.zeros(
            shape, dtype
        )
        out[name] = arr.reshape(shape)
    return out


def write_safetensors(
    path: str | os.PathLike, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None
) -> None:
    """Write ``tensors`` (name -> array) to ``path`` atomically (temp file + rename)."""
    path = os.fspath(path)
    header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    arrays = []
    offset = 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(np.asarray(tensors[name]))
        if arr.dtype not in _CODES:
            raise TypeError(f"tensor {name!r} has dtype {arr.dtype}, which safetensors cannot store")
        offsets = [offset, offset + arr.nbytes]
        header[name] = {"dtype": _CODES[arr.dtype], "shape": list(arr.shape), "data_offsets": offsets}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with paths.atomic_open(path) as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
