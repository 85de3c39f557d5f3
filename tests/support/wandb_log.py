"""Read a wandb run file (``run-<id>.wandb``) back, as a test checks what an offline run logged.

wandb 0.31 writes it from its Go core and ships no Python reader. The format is LevelDB's
log format with a 7-byte header: ``:W&B``, the magic ``0xBEE1`` (little-endian) and a version
byte; then 32 KiB blocks of chunks, each ``crc32c (4) | length (2, little-endian) | type (1)
| data``, type 1 a whole record, 2/3/4 its first/middle/last part; a block's tail shorter
than a chunk header is zero padding. Each record is a ``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

_BLOCK, _HEADER, _CHUNK = 32 * 1024, 7, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: str) -> Iterator[object]:
    """The ``Record`` messages of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    if data[:4] != b":W&B" or int.from_bytes(data[4:6], "little") != 0xBEE1:
        raise ValueError(f"{path}: not a wandb run file (header {data[:7]!r})")
    pos, parts = _HEADER, []
    while pos + _CHUNK <= len(data):
        if _BLOCK - pos % _BLOCK < _CHUNK:  # the block's zero-padded tail
            pos += _BLOCK - pos % _BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:  # a zeroed chunk: padding to the block's end
            pos += _BLOCK - pos % _BLOCK
            continue
        if pos + _CHUNK + length > len(data):  # a chunk the writer has not finished: read it next time
            break
        parts.append(data[pos + _CHUNK:pos + _CHUNK + length])
        pos += _CHUNK + length
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def history(path: str) -> list[dict[str, float]]:
    """Each ``wandb.log`` call's figures (``_step`` included), in order."""
    out = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            out.append(row)
    return out


def config(path: str) -> dict[str, object]:
    """The run config, as the file's config records set it."""
    out: dict[str, object] = {}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        items = record.config.update if kind == "config" else record.run.config.update if kind == "run" else ()
        for item in items:
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def exit_code(path: str, *, wait_s: float = 30.0) -> int:
    """The exit code the run was finished with (its ``exit`` record; 0: finished, else failed).

    wandb's service process writes the file: ``run.finish()`` returns once the service has the
    exit, and the record reaches the file a moment later (seen missing right after ``finish``
    about one read in four under load; it is there when the process ends, as wandb's exit hook
    waits for the service). So the file is read again for up to ``wait_s`` seconds before a
    missing record is an error."""
    deadline = time.monotonic() + wait_s
    while True:
        codes = [record.exit.exit_code for record in records(path) if record.WhichOneof("record_type") == "exit"]
        if codes:
            return codes[-1]
        if time.monotonic() > deadline:
            raise ValueError(f"{path}: the run has no exit record after {wait_s:g} s (it was not finished)")
        time.sleep(0.2)
