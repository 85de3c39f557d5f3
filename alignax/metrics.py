"""Metric writers: console (progress bar with ETA and key figures), JSONL, TensorBoard.

A trainer calls ``writer.write(step, metrics)`` with a flat ``dict[str, float]`` and
``writer.close()`` at the end. Names follow the common conventions (``loss``,
``rewards/chosen``, ``rewards/margins``, ``logps/chosen``, ``perf/tokens_per_s``, ...);
the writers never rename them. Values are converted to Python floats once, on the host.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from alignax import paths


def to_host(metrics: Mapping[str, object]) -> dict[str, float]:
    """Device scalars → Python floats (one transfer for the whole dict)."""
    import jax

    values = jax.device_get(dict(metrics))
    return {k: float(np.asarray(v)) for k, v in values.items()}


class MetricWriter(Protocol):
    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class JsonlWriter:
    """One JSON object per line: ``{"step": s, "time": unix_seconds, **metrics}``.

    Non-finite values are written as strings ("nan", "inf") so every line stays valid
    JSON. Lines are flushed as written, so a killed run keeps what it logged. An object
    store (``gs://``...) cannot append: there the file is rewritten whole at each write
    (what was there before the run included).
    """

    def __init__(self, path: str):
        self.path = path
        self._file = None
        if paths.is_remote(path):
            target = paths.as_path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            self._lines = target.read_text(encoding="utf-8") if target.exists() else ""
        else:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": int(step), "time": round(time.time(), 3)}
        for key, value in metrics.items():
            value = float(value)
            row[key] = value if math.isfinite(value) else str(value)
        if self._file is None:
            self._lines += json.dumps(row) + "\n"
            paths.write_text(self.path, self._lines)
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def read_jsonl(path: str) -> list[dict[str, float]]:
    """Rows written by :class:`JsonlWriter`, non-finite strings turned back to floats."""
    rows = []
    for line in paths.as_path(path).read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        rows.append({k: float(v) if isinstance(v, str) else v for k, v in row.items()})
    return rows


class TensorBoardWriter:
    """Scalars into TensorBoard event files under ``logdir`` (via tensorboardX, which
    writes ``gs://`` and ``s3://`` itself; other object stores are refused)."""

    def __init__(self, logdir: str):
        from tensorboardX import SummaryWriter
        from tensorboardX.record_writer import REGISTERED_FACTORIES

        scheme = logdir.split("://", 1)[0] if paths.is_remote(logdir) else None
        if scheme is not None and scheme not in REGISTERED_FACTORIES:
            raise ValueError(f"logging.tensorboard: TensorBoard cannot write to {logdir} (tensorboardX writes "
                             f"local paths and {', '.join(f'{k}://' for k in sorted(REGISTERED_FACTORIES))}); "
                             "set logging.tensorboard=false or use another output_dir")

        self._writer = SummaryWriter(logdir=logdir)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, float(value), global_step=int(step))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class ConsoleWriter:
    """A rich progress bar with ETA; the key figures of the last step beside it.

    Without a terminal (CI logs, pipes) it prints one plain line every ``print_every``
    writes instead of redrawing.
    """

    def __init__(self, total_steps: int, *, keys: Sequence[str] = ("loss",), description: str = "train",
                 print_every: int = 1, stream=None):
        self.total_steps = total_steps
        self.keys = tuple(keys)
        self.print_every = max(1, print_every)
        self._stream = stream or sys.stdout
        self._count = 0
        self._start = time.perf_counter()
        self._progress = None
        if getattr(self._stream, "isatty", lambda: False)():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[figures]}"),
                console=Console(file=self._stream), transient=False,
            )
            self._task = self._progress.add_task(description, total=total_steps, figures="")
            self._progress.start()

    def _figures(self, metrics: Mapping[str, float]) -> str:
        parts = [f"{k}={float(metrics[k]):.4g}" for k in self.keys if k in metrics]
        return "  ".join(parts)

    def _print(self, text: str) -> None:
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(text, file=self._stream, flush=True)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        # Evaluations and data counts get a line of their own; train steps move the bar.
        sections = {key.split("/", 1)[0] for key in metrics}
        if sections <= {"eval", "data"}:
            figures = "  ".join(f"{k}={float(v):.4g}" for k, v in sorted(metrics.items()))
            self._print(f"[{'/'.join(sorted(sections))} @ step {step}] {figures}")
            return
        self._count += 1
        if self._progress is not None:
            self._progress.update(self._task, completed=step, figures=self._figures(metrics))
            return
        if self._count % self.print_every and step < self.total_steps:
            return
        elapsed = time.perf_counter() - self._start
        rate = step / elapsed if elapsed > 0 and step > 0 else 0.0
        eta = (self.total_steps - step) / rate if rate > 0 else float("nan")
        eta_text = f"{eta:.0f}s" if math.isfinite(eta) else "?"
        self._print(f"step {step}/{self.total_steps}  {self._figures(metrics)}  elapsed {elapsed:.0f}s  eta {eta_text}")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


class MultiWriter:
    """Fans one ``write`` out to several writers."""

    def __init__(self, writers: Sequence[MetricWriter]):
        self.writers = list(writers)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for writer in self.writers:
            writer.write(step, metrics)

    def record_outcome(self, outcome: str) -> None:
        """How the run ended (``finished``, ``killed``, ``failed``), for the writers that keep
        it (the experiment trackers' run status, :mod:`alignax.trackers`); before :meth:`close`."""
        for writer in self.writers:
            if hasattr(writer, "record_outcome"):
                writer.record_outcome(outcome)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
