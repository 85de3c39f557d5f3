"""What a data section's config says before any record is read.

- :func:`key_rules`: which keys of a ``DataConfig`` a run reads, by its ``format`` (rows of
  the config's key table, :mod:`alignax.trainers.validation`).
- :func:`data_file_problem`: a cheap look at a section's local files: is one empty, and do
  its first record's fields fit the section's ``format``? (asked of ``data``,
  ``ppo.ptx_data`` and ``evaluation.prompts`` when a config loads). The pipeline reads the
  whole file later and names any bad record with its line or row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from alignax.config import ALWAYS, NEVER, Above, Check, Is, IsNot, Rule, get, rule, show
from alignax.data.builders import is_generator_spec
from alignax.data.formats import DEFAULT_FIELDS, FORMATS, OPTIONAL_FIELDS
from alignax.data.pipeline import DataConfig
from alignax.data.sources import DATA_FILE_SUFFIXES


def _paths_read_from_disk(prefix: str) -> Check:
    return Check(
        f"a {prefix}.paths entry that is a file or folder (not a generator spec)",
        lambda c: any(not is_generator_spec(p) for p in (get(c, f"{prefix}.paths") or ())),
        lambda c: f"{prefix}.paths={show(get(c, prefix + '.paths'))}",
    )


def key_rules(prefix: str) -> list[Rule]:
    """The rows of a ``DataConfig`` at ``prefix`` (``data``, ``ppo.ptx_data``, ``evaluation.prompts``)."""
    fmt = f"{prefix}.format"
    return [
        rule(prefix, ALWAYS),
        rule([f"{prefix}.max_length", f"{prefix}.max_response_length"], IsNot(fmt, "prompt"),
             "prompt batches are max_prompt_length wide; the response budget is rollout.max_new_tokens"),
        rule(f"{prefix}.step_delimiter", Is(fmt, "steps"), "it separates the steps of a step-labelled solution"),
        rule(f"{prefix}.apply_chat_template", Is(fmt, "preference", "unpaired", "prompt", "steps"),
             "sft messages always go through the chat template; text never does"),
        rule(f"{prefix}.system_prompt", IsNot(fmt, "text"), "plain text has no conversation to put it in"),
        rule(f"{prefix}.split", _paths_read_from_disk(prefix), "a generator spec has no splits"),
        rule(f"{prefix}.packing", Is(fmt, "sft", "text") if prefix == "data" else NEVER,
             "whole sft or text examples pack into the rows of a training stream (alignax.data.example_packing)"),
        rule(f"{prefix}.prefetch_batches", Above(f"{prefix}.read_threads", 0),
             "batches are prefetched by the reading threads"),
    ]


def first_record(path: str) -> tuple[str, Any]:
    """``("empty", why)``, ``("record", field names of the first record)``, or
    ``("unknown", None)`` (a type or content this cheap look does not read: the data
    pipeline reads it, and reports what is wrong with the file and line)."""
    try:
        size = os.path.getsize(path)
        if size == 0:
            return "empty", "0 bytes"
        if path.endswith(".parquet"):
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(path).metadata
            if meta.num_rows == 0:
                return "empty", "a Parquet file of 0 rows"
            return "record", list(meta.schema.to_arrow_schema().names)
        if not path.endswith((".jsonl", ".json")):
            return "unknown", None
        with open(path, "rb") as f:
            head = f.read(1 << 16)
            if path.endswith(".json") and head.lstrip().startswith(b"["):
                text = (head + f.read(1 << 20)).decode("utf-8", errors="replace")
                start = text.index("[") + 1
                while start < len(text) and text[start].isspace():
                    start += 1
                if text[start:start + 1] == "]":
                    return "empty", "an empty JSON array"
                record, _ = json.JSONDecoder().raw_decode(text, start)
            else:
                f.seek(0)
                for line in f:
                    if line.strip():
                        record = json.loads(line.decode("utf-8"))
                        break
                else:
                    return "empty", "only blank lines"
    except Exception:  # noqa: BLE001 - unreadable or malformed: the pipeline reports it with its line/row
        return "unknown", None
    return ("record", list(record)) if isinstance(record, dict) else ("unknown", None)


def fields_for(keys: Sequence[str], fmt: str, field_map: dict[str, str]) -> list[str] | None:
    """The record keys that fill format ``fmt``'s fields (alignax.data.formats), or None
    when a field the format needs is absent."""
    found = []
    for field, candidates in DEFAULT_FIELDS[fmt].items():
        candidates = (field_map[field],) if field in field_map else candidates
        key = next((k for k in candidates if k in keys), None)
        if key is not None:
            found.append(key)
        elif field not in OPTIONAL_FIELDS.get(fmt, ()):
            return None
    return found


def data_file_problem(section: DataConfig | None, prefix: str, reader: str, formats: tuple[str, ...]) -> str | None:
    """The first problem of the local data files of ``section`` (a ``DataConfig`` at
    ``prefix``: ``data``, ``ppo.ptx_data``, ...) in words, or None: a file that is empty, or
    whose first record has the fields of another format than ``section.format`` (``reader``
    reads ``formats``; the message says which to set). Generator specs, folders and missing
    files are left to the pipeline, which names them."""
    if section is None:
        return None
    fmt, field_map = section.format, dict(section.field_map)
    for i, path in enumerate(section.paths):
        if is_generator_spec(path) or not os.path.isfile(path):
            continue  # a generator, a folder, or a missing file (the data pipeline names it)
        if not path.endswith(DATA_FILE_SUFFIXES):
            continue
        kind, what = first_record(path)
        where = f"{prefix}.paths[{i}] {path}"
        if kind == "empty":
            return f"{where}: the data file is empty ({what}); it holds no records"
        if kind != "record" or fmt not in DEFAULT_FIELDS:
            continue
        keys = what
        mine = fields_for(keys, fmt, field_map)
        others = {f: m for f in FORMATS if f != fmt and f in DEFAULT_FIELDS
                  for m in [fields_for(keys, f, {})] if m is not None}
        reads = (f"{reader} reads {prefix}.format={fmt}" if fmt in formats else f"{prefix}.format is {fmt}")
        if others:
            other, fields = max(others.items(), key=lambda kv: len(kv[1]))
            if mine is None or len(fields) > len(mine):
                own = {k for c in DEFAULT_FIELDS[fmt].values() for k in c} | set(field_map.values())
                shown = [k for k in fields if k not in own] or fields
                fix = f"; set {prefix}.format={other}" if other in formats else ""
                return (f"{where}: its records look like format '{other}' (fields {', '.join(shown)}) but "
                        f"{reads}{fix}")
        if mine is None and section.on_bad_record == "error":
            needed = [f"{field} ({' or '.join((field_map[field],) if field in field_map else names)})"
                      for field, names in DEFAULT_FIELDS[fmt].items() if field not in OPTIONAL_FIELDS.get(fmt, ())]
            return (f"{where}: its first record has fields {', '.join(map(str, keys)) or 'none'}; {reads}, whose "
                    f"records need {', '.join(needed)} (rename a field with {prefix}.field_map)")
    return None
