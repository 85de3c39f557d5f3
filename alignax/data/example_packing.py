"""Several short examples in one row (``data.packing: true``; formats ``sft`` and ``text``).

A training row of width ``T`` holds whole examples one after another,

    [ example a (L_a) | example b (L_b) | ... | pad ]      sum L <= T

with ``segment_ids`` 1, 2, ... per example (0 on padding) and positions restarting at 0 for
each, so the decoder's segment mask (:mod:`alignax.models.modeling`: a key of segment
``k > 0`` is seen only by queries of segment ``k``) makes every hidden state the one of the
example's own unpacked row. An example's first token, which its unpacked row never scores
(token ``t`` is scored by the hidden state at ``t - 1``), has its response mask 0 here too, so
the previous example's last state never scores it: the rows train on exactly the tokens of
the unpacked rows, with the same log-probs. Packing is not a different objective: the
summed loss over a batch's tokens is the unpacked one (``tests/test_sft_packing.py``).

Which examples share a row (:func:`plan_rows`): each epoch's shuffled order is packed
first-fit into at most :data:`OPEN_ROWS` open rows (a row that is the oldest open one when
nothing fits is closed), so rows keep roughly the epoch's order and the plan is a fixed
function of (seed, epoch, lengths): every process computes the same rows, and a resumed run
reads the same batches.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np

# rows kept open for the first-fit search: more fill the rows better and reorder the epoch more
OPEN_ROWS = 32
ROW_KEYS = ("tokens", "positions", "attention_mask", "response_mask")


def plan_rows(lengths: Sequence[int], width: int, *, open_rows: int = OPEN_ROWS) -> list[list[int]]:
    """Positions ``0..n-1`` (examples of lengths ``lengths``, in that order) grouped into rows
    of at most ``width`` tokens: each example goes into the first open row it fits, else into
    a new row; with ``open_rows`` rows open, the oldest is closed first. Rows come out in
    the order they were opened; every position appears once."""
    closed: list[list[int]] = []
    rows: list[list[int]] = []
    room: list[int] = []
    for position, length in enumerate(lengths):
        if not 0 < length <= width:
            raise ValueError(f"example {position} has {length} tokens; a packed row holds 1 to {width}")
        slot = next((i for i, r in enumerate(room) if r >= length), None)
        if slot is None:
            if len(rows) == open_rows:
                closed.append(rows.pop(0))
                room.pop(0)
            rows.append([])
            room.append(width)
            slot = len(rows) - 1
        rows[slot].append(position)
        room[slot] -= length
    return sorted(closed + rows, key=lambda row: row[0])  # in the order the rows were opened


def pack_row(examples: Sequence[Mapping[str, np.ndarray]], width: int, pad_id: int) -> dict[str, np.ndarray]:
    """One packed row ``[width]`` (``tokens, positions, attention_mask, response_mask,
    segment_ids``) from right-padded example rows (the pipeline's ``sft``/``text`` arrays),
    padded with ``pad_id``."""
    out = {key: np.zeros((width,), np.int32) for key in (*ROW_KEYS, "segment_ids")}
    out["tokens"][:] = pad_id
    start = 0
    for segment, example in enumerate(examples, 1):
        n = int(np.sum(example["attention_mask"]))
        if start + n > width:
            raise ValueError(f"packed examples need {start + n} tokens; the row holds {width}")
        span = slice(start, start + n)
        for key in ROW_KEYS:
            out[key][span] = example[key][:n]
        out["response_mask"][start] = 0  # never scored in its own row: not by the previous example here
        out["segment_ids"][span] = segment
        start += n
    return out


class RowPlan:
    """The packed rows of a training split, epoch after epoch: row ``k`` of the endless (or
    ``num_epochs``-long) stream is the record indices it holds (:meth:`row`).

    Epoch ``e`` shuffles the split with ``(seed, e)`` (``shuffle``; else file order) and packs
    it with :func:`plan_rows`. Rows are found by random access (a resumed run, and process
    ``p`` reading its block of each batch); the plans of the last epochs asked for are kept,
    and the grain reader's threads may ask at once."""

    _KEPT_EPOCHS = 2

    def __init__(self, indices: np.ndarray, lengths: np.ndarray, width: int, *, seed: int, shuffle: bool,
                 num_epochs: int | None):
        self._indices, self._lengths = np.asarray(indices, np.int64), np.asarray(lengths, np.int64)
        self._width, self._seed, self._shuffle, self.num_epochs = width, seed, shuffle, num_epochs
        self._starts = [0]  # the first row of each epoch planned so far, then the end of the last
        self._plans: OrderedDict[int, list[np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()

    def _plan(self, epoch: int) -> list[np.ndarray]:
        if epoch not in self._plans:
            order = (np.random.default_rng([self._seed, epoch]).permutation(len(self._indices)) if self._shuffle
                     else np.arange(len(self._indices)))
            self._plans[epoch] = [self._indices[order[r]] for r in plan_rows(self._lengths[order], self._width)]
            while len(self._plans) > self._KEPT_EPOCHS:
                self._plans.popitem(last=False)  # the least recently asked for
        self._plans.move_to_end(epoch)
        return self._plans[epoch]

    def _reach(self, position: int) -> None:
        while self._starts[-1] <= position:
            epoch = len(self._starts) - 1
            if self.num_epochs is not None and epoch >= self.num_epochs:
                raise IndexError(f"row {position} is past the {self.num_epochs} epochs' {self._starts[-1]} rows")
            self._starts.append(self._starts[-1] + len(self._plan(epoch)))

    def epoch_of(self, position: int) -> int:
        """The epoch that row ``position`` belongs to."""
        with self._lock:
            self._reach(position)
            return bisect.bisect_right(self._starts, position) - 1

    def row(self, position: int) -> np.ndarray:
        """The record indices packed into row ``position``, in the row's order."""
        with self._lock:
            self._reach(position)
            epoch = bisect.bisect_right(self._starts, position) - 1
            return self._plan(epoch)[position - self._starts[epoch]]

    def rows_in(self, epoch: int) -> int:
        """How many rows epoch ``epoch`` packs into."""
        with self._lock:
            return len(self._plan(epoch))

    def total_rows(self) -> int:
        """Rows of all ``num_epochs`` epochs (a finite stream only)."""
        if self.num_epochs is None:
            raise ValueError("an endless stream (num_epochs None) has no total")
        return sum(self.rows_in(e) for e in range(self.num_epochs))


__all__ = ["OPEN_ROWS", "RowPlan", "pack_row", "plan_rows"]
