"""The data pipeline: config, one validation pass, then grain shuffling, sharding, batching.

``build_dataset(config, tokenizer)`` returns a :class:`DataIterator` of fixed-shape numpy
batches whose state (``get_state`` / ``set_state``, JSON-able) resumes a run exactly.

How a batch is made:

1. **Prepare** (once, identically on every JAX process): every record is read and
   tokenised; bad records raise (``on_bad_record: error``) or are skipped and counted;
   truncations and duplicates (records whose tokenised content repeats an earlier one's;
   ``on_duplicate``) are counted. The survivors are split into train and eval by prompt
   (``eval_fraction``): whole groups of records sharing a prompt go to one side, so no
   prompt is in both. Memory holds their indices and digests, not their tokens.
2. **Order**: grain ``MapDataset.range(n).shuffle(seed).repeat()`` — a different,
   deterministic permutation in every epoch; epochs follow each other without a gap.
3. **Shard**: process ``p`` of ``P`` takes block ``p`` of every global batch: of batch
   ``k``'s elements ``kB ... kB + B - 1``, the ``B / P`` from ``kB + pB/P`` on. Placed in
   process order (``alignax.parallel.multihost``) the blocks are exactly global batch
   ``k`` of the unsharded stream, in its order, whatever ``P`` is.
4. **Tokenise and pad** lazily per element (the same deterministic encoding as step 1),
   batch, and prefetch in ``read_threads`` threads.

Batch keys (``B`` = batch_size / process_count rows, ``T`` = max_length,
``P`` = max_prompt_length; int32 arrays):

- ``preference``: ``chosen_{tokens,positions,attention_mask,response_mask}`` and the
  same for ``rejected_``, each ``[B, T]``, right-padded; ``prompt_length`` ``[B]``: the
  prompt both rows start with (``alignax.trainers.engine.packing`` runs it once per pair);
  ``margin`` ``[B]`` float32: the record's ``margin`` field, 0 where it has none.
- ``unpaired``: ``tokens, positions, attention_mask, response_mask`` ``[B, T]``,
  ``label`` ``[B]`` (1 desirable, 0 undesirable), and the same four with a ``kl_``
  prefix, for KTO's mismatched-pair KL estimate: the row's prompt followed by the
  completion of its record's *KL partner*, another record of the same split fixed once
  by a seeded permutation (:meth:`PreparedData.kl_partner`). The row depends on the
  record alone, not on the batch it lands in, so reference log-probs precomputed per
  record match the rows the policy sees in any shuffled batch.
- ``sft``, ``text``: ``tokens, positions, attention_mask, response_mask`` ``[B, T]``
  (``text``: ``response_mask`` 1 on every real token but the first). With
  ``data.packing`` a training row holds several examples: ``segment_ids`` ``[B, T]`` (1, 2,
  ... per example, 0 on padding), positions restarting per example, ``examples`` ``[B]``
  (how many), ``record_index`` the row's first record.
- ``steps``: ``tokens, positions, attention_mask`` ``[B, T]`` right-padded, ``step_mask``
  ``[B, T]`` 1 on each step's end token (its delimiter; the end-of-turn token for the
  last step) and ``step_labels`` ``[B, T]`` float32, the step's label there, 0 elsewhere.
- ``prompt``: ``prompt_tokens, prompt_positions, prompt_attention_mask`` ``[B, P]``,
  left-padded for generation, and ``references``: a tuple of B record dicts (the prompt,
  ``answer`` and any metadata), for the verifiers — pop it before sending the batch to
  devices.
- always ``example_mask`` ``[B]``: 1 for real rows; 0 only on the padding rows that fill
  the last eval batch; and ``record_index`` ``[B]``: each row's index in the source (to
  look up per-record values computed once, such as precomputed reference log-probs).

``response_mask[b, t]`` is 1 when ``tokens[b, t]`` is a response token to train on (the
end-of-turn token included), aligned with ``tokens``, not with the shifted targets: the
log-prob of token ``t`` comes from logits at ``t - 1``, so a trainer uses
``token_logprobs(logits[:, :-1], tokens[:, 1:])`` with ``response_mask[:, 1:]``. Padding
may use the eos id (SmolLM2: pad == eos); masks, never token ids, say what is padding.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from alignax import paths
from alignax.config import ConfigError
from alignax.data.example_packing import RowPlan, pack_row
from alignax.data.formats import FORMATS, TRUNCATIONS, Encoder
from alignax.data.sources import BadRecordError, ConcatSource, ListSource, open_source

BAD_RECORD_POLICIES = ("error", "skip")
DUPLICATE_POLICIES = ("keep", "skip", "error")
PACKED_FORMATS = ("sft", "text")  # one sequence per example: whole examples pack into a row


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What to read, how to tokenise it, and how to batch it.

    Attributes:
      paths: data files or folders (JSONL, JSON, Parquet, ``datasets`` save_to_disk or
        hub-style folders; see :mod:`alignax.data.sources`), read in order as one
        dataset. An entry may instead be a generator spec:
        ``reasoning_gym:<task>?size=500&seed=0&<task option>=...`` (preference pairs for
        format ``preference``, prompts with answers for format ``prompt``) or
        ``champ`` / ``champ:v0`` (champ-dataset's human-labelled solution pairs); see
        :mod:`alignax.data.builders`.
      format: ``preference`` | ``unpaired`` | ``sft`` | ``prompt`` | ``text`` | ``steps``
        (see :mod:`alignax.data.formats` for the fields each expects).
      step_delimiter: format ``steps``: the text between two steps of a solution (a step
        may not contain it).
      split: the split to read from a dataset folder.
      field_map: canonical field -> the record's key, e.g. ``{"prompt": "question"}``.
      apply_chat_template: render plain-text prompts/responses as chat turns through the
        tokenizer's template (message lists always are).
      system_prompt: a system message put before every conversation without one.
      max_length: tokens per sequence, ``T`` (prompt + response), for offline formats.
      max_prompt_length: prompt tokens, ``P``; the width of left-padded prompt batches.
      max_response_length: cap on response tokens; ``None``: ``max_length - 1``.
      truncation: ``keep_end`` (the prompt loses its start), ``truncate_response`` (the
        responses lose their end) or ``reject`` (the record is a bad record).
      on_bad_record: ``error`` stops with the file, line/row and field; ``skip`` counts it
        in ``stats`` and goes on.
      on_duplicate: what to do with a record whose tokenised content (prompt and response
        ids and masks, label, margin; a prompt set's prompt and ``answer``) equals an
        earlier kept record's: ``keep`` it (the default: repeated training data can be
        meant), ``skip`` it, or ``error`` naming both records' file and line/row. Always
        counted in ``stats["duplicates"]``.
      seed: seeds the per-epoch shuffle and the train/eval split.
      shuffle: shuffle the training stream (eval is never shuffled).
      batch_size: the global batch size, over all JAX processes.
      eval_fraction: fraction of the (kept) records held out for evaluation, in [0, 1),
        split by prompt: the records sharing a prompt (text: the whole text) form a group,
        and whole groups, in an order drawn with ``seed``, go to eval until it holds
        ``round(eval_fraction * kept)`` records (at least one group, never all of them), so
        no prompt is in both splits. ``stats["eval"]`` can therefore exceed that count by
        up to a group's size less one. With ``eval_fraction > 0`` the data needs two
        distinct prompts at least.
      num_epochs: passes over the training set; ``None`` repeats forever.
      packing: formats ``sft`` and ``text``: a training row holds several whole examples
        (``segment_ids`` keep them apart, positions restart;
        :mod:`alignax.data.example_packing`), so ``batch_size`` counts rows, each holding as
        many shuffled examples as fit in ``max_length`` tokens. Eval batches stay one example
        per row.
      read_threads: threads tokenising ahead of the consumer (0: in the caller's thread).
      prefetch_batches: batches buffered ahead when ``read_threads > 0``.
    """

    paths: tuple[str, ...] = ()
    format: str = "preference"
    step_delimiter: str = "\n"
    split: str = "train"
    field_map: Mapping[str, str] = dataclasses.field(default_factory=dict)
    apply_chat_template: bool = True
    system_prompt: str | None = None
    max_length: int = 1024
    max_prompt_length: int = 512
    max_response_length: int | None = None
    truncation: str = "keep_end"
    on_bad_record: str = "error"
    on_duplicate: str = "keep"
    seed: int = 0
    shuffle: bool = True
    batch_size: int = 8
    eval_fraction: float = 0.0
    num_epochs: int | None = None
    packing: bool = False
    read_threads: int = 1
    prefetch_batches: int = 2

    def __post_init__(self):
        if isinstance(self.paths, (str, os.PathLike)):
            object.__setattr__(self, "paths", (os.fspath(self.paths),))
        else:
            object.__setattr__(self, "paths", tuple(os.fspath(p) for p in self.paths))
        object.__setattr__(self, "field_map", dict(self.field_map))
        for name, value, choices in (
            ("format", self.format, FORMATS),
            ("truncation", self.truncation, TRUNCATIONS),
            ("on_bad_record", self.on_bad_record, BAD_RECORD_POLICIES),
            ("on_duplicate", self.on_duplicate, DUPLICATE_POLICIES),
        ):
            if value not in choices:
                raise ValueError(f"unknown data.{name} {value!r}; valid: {', '.join(choices)}")
        for name in ("max_length", "max_prompt_length", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1; got {getattr(self, name)}")
        if self.format != "prompt" and self.max_prompt_length >= self.max_length:
            raise ValueError(
                f"data.max_prompt_length ({self.max_prompt_length}) must be < data.max_length "
                f"({self.max_length}) to leave room for a response"
            )
        if self.max_response_length is not None and self.max_response_length < 1:
            raise ValueError(f"data.max_response_length must be >= 1 or null; got {self.max_response_length}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction must be in [0, 1); got {self.eval_fraction}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"data.num_epochs must be >= 1 or null; got {self.num_epochs}")
        if self.read_threads < 0 or self.prefetch_batches < 0:
            raise ValueError("data.read_threads and data.prefetch_batches must be >= 0")


def _open_sources(config: DataConfig):
    from alignax.data import builders  # generators pull in reasoning_gym only when used

    if not config.paths:
        raise ValueError("data.paths is empty; give at least one file, folder or generator spec")
    sources = []
    for path in config.paths:
        if builders.is_generator_spec(path):
            sources.append(ListSource(builders.generate(path, config.format), path, unit="record"))
        else:
            # a URI (gs://...) is read from a local copy (alignax.paths.staged); errors name the URI
            sources.append(open_source(paths.staged(path, key="data.paths"), split=config.split, name=path))
    return sources[0] if len(sources) == 1 else ConcatSource(sources)


def _encoder(config: DataConfig, tokenizer, required_fields: Sequence[str] = ()) -> Encoder:
    return Encoder(
        tokenizer,
        format=config.format,
        field_map=config.field_map,
        apply_chat_template=config.apply_chat_template,
        system_prompt=config.system_prompt,
        max_length=config.max_length,
        max_prompt_length=config.max_prompt_length,
        max_response_length=config.max_response_length,
        truncation=config.truncation,
        required_fields=required_fields,
        step_delimiter=config.step_delimiter,
    )



class PreparedData:
    """A validated dataset: record source, encoder, the train/eval indices, and ``stats``.

    ``stats`` (ints, loggable as they are): ``records`` read, ``kept``, ``skipped``,
    ``skipped/<reason>`` per reason (``malformed``, ``not_utf8``, ``missing_field``,
    ``empty``, ``identical``, ``too_long``, ``invalid``, and ``duplicate`` under
    ``on_duplicate: skip``), ``duplicates`` (records repeating an earlier kept record's
    tokenised content, kept or skipped as ``on_duplicate`` says), ``truncated/prompt``,
    ``truncated/response``, ``train``, ``eval``, for ``preference`` ``margin/present``
    (records carrying a margin), and for ``unpaired`` ``label/desirable`` /
    ``label/undesirable``.

    The train/eval split is by prompt (see ``DataConfig.eval_fraction``): records whose
    prompt ids are equal, before or after truncation (``text``: whose ids are equal), are
    one group, and a group is wholly in train or wholly in eval.

    ``required_fields``: optional fields of the format every record must carry (see
    :class:`~alignax.data.formats.Encoder`).
    """

    def __init__(self, config: DataConfig, tokenizer, source=None, *, required_fields: Sequence[str] = ()):
        self.config = config
        self.source = source if source is not None else _open_sources(config)
        self.encoder = _encoder(config, tokenizer, required_fields)
        on_duplicate = config.on_duplicate
        stats: Counter = Counter(
            {"records": 0, "skipped": 0, "duplicates": 0, "truncated/prompt": 0, "truncated/response": 0}
        )
        valid = []
        prompt_keys: dict[int, bytes] = {}  # unpaired: record -> its prompt's digest (KL partners)
        first_of: dict[bytes, int] = {}  # content digest -> the first kept record with it
        groups = _PromptGroups()
        # (a config's data.packing is checked with its format when the config loads: the key table)
        if config.packing and config.format not in PACKED_FORMATS:
            raise ValueError(f"data.packing packs whole examples of format {' or '.join(PACKED_FORMATS)} into rows; "
                             f"data.format is {config.format}")
        # tokens of each kept record (data.packing plans its rows from them); -1: not kept
        self.lengths = np.full(len(self.source) if config.packing else 0, -1, np.int64)
        if config.format == "preference":
            stats["margin/present"] = 0
        for i in range(len(self.source)):
            stats["records"] += 1
            try:
                encoded = self.encoder.encode(self.source[i])
            except BadRecordError as e:
                located = e.located(self.source.where(i))
                if config.on_bad_record == "error":
                    raise located from None
                stats["skipped"] += 1
                stats[f"skipped/{e.reason}"] += 1
                continue
            content = _content_digest(encoded, config.format)
            first = first_of.setdefault(content, i)
            if first != i:
                stats["duplicates"] += 1
                if on_duplicate == "error":
                    raise BadRecordError(
                        "duplicate", None,
                        f"duplicate of {self.source.where(first)}: the same tokenised content "
                        "(data.on_duplicate='error'; 'skip' drops such records, 'keep' trains on them)",
                        self.source.where(i),
                    )
                if on_duplicate == "skip":
                    stats["skipped"] += 1
                    stats["skipped/duplicate"] += 1
                    continue
            valid.append(i)
            if config.packing:
                self.lengths[i] = len(encoded.prompt) + len(encoded.responses["response"][0])
            prompt = _digest(encoded.prompt if config.format != "text" else
                             encoded.prompt + encoded.responses["response"][0])
            groups.add(i, prompt, None if encoded.full_prompt is None else _digest(encoded.full_prompt))
            stats["truncated/prompt"] += encoded.truncated_prompt
            stats["truncated/response"] += encoded.truncated_response
            if encoded.label is not None:
                stats["label/desirable" if encoded.label else "label/undesirable"] += 1
                prompt_keys[i] = prompt
            if encoded.margin is not None:
                stats["margin/present"] += 1
        valid = np.asarray(valid, np.int64)
        in_eval = _eval_groups(groups.members(), config.eval_fraction, config.seed)
        eval_mask = np.isin(valid, in_eval)
        self.eval_indices = valid[eval_mask]
        self.train_indices = valid[~eval_mask]
        stats["kept"] = len(valid)
        stats["train"] = len(self.train_indices)
        stats["eval"] = len(self.eval_indices)
        self.stats: dict[str, int] = dict(sorted(stats.items()))
        self._kl_partners = np.full(len(self.source) if config.format == "unpaired" else 0, -1, np.int64)
        if config.format == "unpaired":
            for stream, indices in ((1, self.train_indices), (2, self.eval_indices)):
                records, partners = _kl_partners(indices, prompt_keys, (config.seed, stream))
                self._kl_partners[records] = partners

    def kl_partner(self, record_index: int) -> int:
        """The record whose completion makes ``record_index``'s mismatched KL row (``unpaired``).

        Within each split, the records are grouped by prompt (identical prompt ids), the
        groups and their members laid out in an order drawn with ``data.seed``, and each
        record's partner is the record ``m`` places further along, cyclically, ``m`` the
        largest group's size. That is a bijection (every completion serves one KL row) in
        which no record meets its own prompt, as long as no prompt has more than half of
        the split's records. A fixed function of the record, so its row is the same
        whatever batch it lands in. A split of one record is its own partner.
        """
        partner = int(self._kl_partners[int(record_index)]) if self.config.format == "unpaired" else -1
        if partner < 0:
            raise ValueError(f"record {record_index} has no KL partner (format {self.config.format!r}, or not a "
                             "kept record)")
        return partner

    def prompt_digests(self, split: str = "train") -> dict[bytes, int]:
        """Digest of each prompt -> the first record of ``split`` (``train`` or ``eval``)
        with that prompt: what a held-out set is checked against for overlap. Two keys a
        record: its prompt's ids, and (prompt records) its prompt's text with whitespace
        runs made one space (:func:`_prompt_text_digest`), so the same question under
        another chat template, system prompt or truncation still meets its twin."""
        out: dict[bytes, int] = {}
        for i in self.train_indices if split == "train" else self.eval_indices:
            encoded = self.encoder.encode(self.source[int(i)])
            out.setdefault(_digest(encoded.prompt), int(i))
            if isinstance(encoded.reference, Mapping) and "prompt" in encoded.reference:
                out.setdefault(_prompt_text_digest(encoded.reference["prompt"]), int(i))
        return out

    def example(self, record_index: int) -> dict[str, Any]:
        """The padded arrays of one record (by its index in the source)."""
        encoded = self.encoder.encode(self.source[int(record_index)])
        out = self.encoder.arrays(encoded)
        if self.config.format == "unpaired":
            partner = self.kl_partner(record_index)
            other = encoded if partner == int(record_index) else self.encoder.encode(self.source[partner])
            out.update(self.encoder.mismatched(encoded, other))
        return out

    def iterator(
        self, split: str = "train", *, process_index: int | None = None, process_count: int | None = None,
        ordered: bool = False,
    ) -> DataIterator:
        """A :class:`DataIterator` over ``split`` (``train`` or ``eval``) for one process.

        ``process_index`` / ``process_count`` default to ``jax.process_index()`` /
        ``jax.process_count()``. ``ordered=True`` reads the split once in file order with
        a padded last batch, as eval always does (e.g. to precompute reference log-probs
        of every training record).
        """
        if split not in ("train", "eval"):
            raise ValueError(f"unknown split {split!r}; valid: train, eval")
        if process_index is None or process_count is None:
            import jax

            process_index = jax.process_index() if process_index is None else process_index
            process_count = jax.process_count() if process_count is None else process_count
        return DataIterator(self, split, process_index, process_count, ordered=ordered or split == "eval")


def _digest(ids: Sequence[int]) -> bytes:
    """A stable digest of token ids (the same in every process and run, unlike ``hash``)."""
    return hashlib.blake2b(np.asarray(ids, np.int64).tobytes(), digest_size=16).digest()


def _prompt_text_digest(prompt: str | Sequence[Mapping]) -> bytes:
    """A stable digest of a prompt's text (messages: each role and text, system messages
    left out since a config may add its own; a string: one user turn), whitespace runs made
    one space; tagged so it never equals an ids digest."""
    if isinstance(prompt, str):
        turns = [f"user: {prompt}"]
    else:
        turns = [f"{m.get('role')}: {m.get('content')}" for m in prompt if m.get("role") != "system"]
    text = "\n".join(" ".join(str(turn).split()) for turn in turns)
    return b"text:" + hashlib.blake2b(text.encode("utf-8"), digest_size=16).digest()


def _content_digest(encoded, format: str) -> bytes:
    """A stable digest of everything a record contributes to training: equal for duplicates."""
    h = hashlib.blake2b(digest_size=16)

    def part(ids: Sequence[int]) -> None:
        ids = np.asarray(ids, np.int64)
        h.update(np.int64(len(ids)).tobytes())  # lengths keep the parts' boundaries apart
        h.update(ids.tobytes())

    part(encoded.prompt)
    for name in sorted(encoded.responses):
        ids, mask = encoded.responses[name]
        h.update(name.encode())
        part(ids)
        part(mask)
    h.update(repr((encoded.label, encoded.margin, encoded.step_labels)).encode())
    if format == "prompt" and encoded.reference is not None:  # a prompt set's answer is its target
        h.update(json.dumps(encoded.reference.get("answer"), sort_keys=True, default=str).encode())
    return h.digest()


class _PromptGroups:
    """Records grouped by prompt: records sharing a key (their prompt's digest, or that of
    the prompt before truncation) are one group (union-find over the keys)."""

    def __init__(self):
        self._parent: dict[bytes, bytes] = {}
        self._key_of: dict[int, bytes] = {}  # record -> one of its keys, in insertion order

    def _root(self, key: bytes) -> bytes:
        parent = self._parent
        root = parent.setdefault(key, key)
        while parent[root] != root:
            root = parent[root]
        while parent[key] != root:  # path compression
            parent[key], key = root, parent[key]
        return root

    def add(self, record: int, key: bytes, other: bytes | None = None) -> None:
        self._key_of[record] = key
        root = self._root(key)
        if other is not None:
            other_root = self._root(other)
            if other_root != root:
                self._parent[other_root] = root

    def members(self) -> list[list[int]]:
        """The groups' records, groups in order of their first record (deterministic)."""
        out: dict[bytes, list[int]] = {}
        for record, key in self._key_of.items():
            out.setdefault(self._root(key), []).append(record)
        return list(out.values())


def _eval_groups(groups: Sequence[Sequence[int]], eval_fraction: float, seed: int) -> np.ndarray:
    """The records of the eval split: whole prompt groups, in an order drawn with ``seed``,
    until ``round(eval_fraction * records)`` are taken (at least one group, never all)."""
    if eval_fraction <= 0 or not groups:
        return np.zeros(0, np.int64)
    if len(groups) == 1:
        raise ValueError(
            f"data.eval_fraction is {eval_fraction} but every kept record ({len(groups[0])}) has the same prompt: "
            "the eval split cannot be separated by prompt from the training split; set data.eval_fraction: 0 "
            "or add records with other prompts"
        )
    target = max(1, int(round(eval_fraction * sum(len(g) for g in groups))))
    taken: list[int] = []
    for g in np.random.default_rng(seed).permutation(len(groups))[:-1]:  # the last drawn stays in train
        taken.extend(groups[g])
        if len(taken) >= target:
            break
    return np.asarray(sorted(taken), np.int64)


def _kl_partners(indices: np.ndarray, prompt_keys: Mapping[int, bytes], seed) -> tuple[np.ndarray, np.ndarray]:
    """``(records, their KL partners)`` within ``indices`` (see :meth:`PreparedData.kl_partner`)."""
    n = len(indices)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    groups: dict[bytes, list[int]] = {}
    for record in indices[np.random.default_rng(seed).permutation(n)]:
        groups.setdefault(prompt_keys[int(record)], []).append(int(record))
    order = [record for members in groups.values() for record in members]
    shift = max(len(members) for members in groups.values())
    if shift == n:  # one prompt only: no mismatched pair exists; the next completion then
        shift = 1 if n > 1 else 0
    records = np.asarray(order, np.int64)
    return records, np.roll(records, -shift)


@functools.cache
def _process_blocks():
    """The ``_ProcessBlocks`` dataset class, defined on first use: grain is imported where a
    data iterator is built, not with the package (configs, the estimator and the device check
    run where grain is not installed)."""
    import grain

    class _ProcessBlocks(grain.MapDataset):
        """Process ``index`` of ``count``'s elements of ``parent``: block ``index`` of each run
        of ``batch_size`` consecutive elements (one global batch)."""

        def __init__(self, parent: grain.MapDataset, batch_size: int, index: int, count: int):
            super().__init__(parent)
            self._batch, self._local, self._offset = batch_size, batch_size // count, index * (batch_size // count)

        def __len__(self) -> int:
            return len(self._parents[0]) // self._batch * self._local

        def __getitem__(self, position):
            if isinstance(position, slice):
                return self.slice(position)
            batch, within = divmod(position, self._local)
            return self._parents[0][batch * self._batch + self._offset + within]

        def __str__(self) -> str:
            return f"_ProcessBlocks(batch_size={self._batch}, local={self._local}, offset={self._offset})"

    return _ProcessBlocks


def _batch_fn(examples: Sequence[dict[str, Any]]) -> dict[str, Any]:
    batch: dict[str, Any] = {}
    for key in examples[0]:
        if key == "reference":
            batch["references"] = tuple(e["reference"] for e in examples)
        elif key == "example_mask":
            batch[key] = np.asarray([e[key] for e in examples], np.int32)
        else:
            batch[key] = np.stack([e[key] for e in examples])
    return batch


class DataIterator:
    """Batches of one split for one JAX process; ``get_state``/``set_state`` resume exactly.

    Attributes: ``stats`` (the :class:`PreparedData` counts), ``num_examples`` (of the
    split, all processes), ``global_batch_size``, ``local_batch_size``, ``steps_per_epoch``
    (full global batches per pass), and ``epoch`` / ``step`` of the next batch.

    Train: an endless (or ``num_epochs``-long) stream reshuffled every epoch, batches
    spanning epoch boundaries. Eval (and any ``ordered`` iterator): one pass in file
    order; the last batch is filled up with copies of the first example marked
    ``example_mask == 0``. Every example carries ``record_index``, its index in the source.
    """

    def __init__(self, prepared: PreparedData, split: str, process_index: int, process_count: int,
                 *, ordered: bool = False):
        config = prepared.config
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} is not in [0, process_count={process_count})")
        if config.batch_size % process_count:
            raise ValueError(
                f"data.batch_size {config.batch_size} is not divisible by the {process_count} JAX processes"
            )
        self.prepared = prepared
        self.split = split
        self.stats = prepared.stats
        indices = prepared.train_indices if split == "train" else prepared.eval_indices
        self.num_examples = len(indices)
        self.global_batch_size = config.batch_size
        self.local_batch_size = config.batch_size // process_count
        self.process_index, self.process_count = process_index, process_count
        n = self.num_examples
        self.ordered = ordered
        if not ordered and n < config.batch_size:
            raise ValueError(
                f"the training split has {n} examples ({prepared.stats.get('skipped', 0)} records skipped, "
                f"{prepared.stats.get('eval', 0)} held out); data.batch_size is {config.batch_size}"
            )
        if ordered and n == 0:
            raise ValueError(f"the {split} split is empty" + ("; set data.eval_fraction > 0" if split == "eval" else ""))
        self.steps_per_epoch = n // config.batch_size

        def load(position: int) -> dict[str, Any]:
            example = prepared.example(indices[position])
            example["example_mask"] = 1
            example["record_index"] = np.int32(indices[position])
            return example

        import grain

        _ProcessBlocks = _process_blocks()
        batch_fn = _batch_fn
        self._plan = None
        if not ordered and config.packing:
            self._plan = RowPlan(indices, prepared.lengths[indices], config.max_length, seed=config.seed,
                                 shuffle=config.shuffle, num_epochs=config.num_epochs)
            self._lengths_digest = hashlib.sha256(np.ascontiguousarray(prepared.lengths[indices]).tobytes()).hexdigest()[:16]
            rows = self._plan.rows_in(0)
            if rows < config.batch_size:
                raise ValueError(f"the training split packs into {rows} rows of data.max_length={config.max_length} "
                                 f"tokens ({n} examples, data.packing); data.batch_size is {config.batch_size} rows")
            self.steps_per_epoch = rows // config.batch_size
            stream = self._plan.total_rows() if config.num_epochs is not None else sys.maxsize

            def load_row(position: int) -> dict[str, Any]:
                records = self._plan.row(position)
                row = pack_row([prepared.example(r) for r in records], config.max_length, prepared.encoder.pad_id)
                row.update(example_mask=1, record_index=np.int32(records[0]), examples=np.int32(len(records)))
                return row

            ds = _ProcessBlocks(grain.MapDataset.range(stream), config.batch_size, process_index, process_count)
            ds = ds.map(lambda pos: load_row(int(pos)))
            ds = ds.batch(self.local_batch_size, drop_remainder=True, batch_fn=batch_fn)
        elif not ordered:
            ds = grain.MapDataset.range(n)
            if config.shuffle:
                ds = ds.shuffle(seed=config.seed)
            ds = ds.repeat(config.num_epochs)
            ds = _ProcessBlocks(ds, config.batch_size, process_index, process_count).map(lambda pos: load(int(pos)))
            ds = ds.batch(self.local_batch_size, drop_remainder=True, batch_fn=batch_fn)
        else:
            padded = -(-n // config.batch_size) * config.batch_size

            def load_eval(pos: int) -> dict[str, Any]:
                if pos < n:
                    return load(pos)
                example = load(0)
                example["example_mask"] = 0
                return example

            ds = _ProcessBlocks(grain.MapDataset.range(padded), config.batch_size, process_index,
                                process_count).map(lambda pos: load_eval(int(pos)))
            ds = ds.batch(self.local_batch_size, drop_remainder=True, batch_fn=batch_fn)
        self._dataset = ds
        options = grain.ReadOptions(num_threads=config.read_threads, prefetch_buffer_size=config.prefetch_batches)
        self._iterator = ds.to_iter_dataset(options).__iter__()
        self._lock = threading.Lock()

    @property
    def step(self) -> int:
        """Index of the next batch."""
        return int(self._iterator.get_state()["next_index"])

    @property
    def epoch(self) -> int:
        """Epoch of the first example (packed: row) of the next batch (0-based)."""
        if self._plan is not None:
            return self._plan.epoch_of(self.step * self.global_batch_size)
        return self.step * self.global_batch_size // max(self.num_examples, 1)

    def __iter__(self) -> DataIterator:
        return self

    def __next__(self) -> dict[str, Any]:
        return next(self._iterator)

    def batch(self, step: int) -> dict[str, Any]:
        """Batch ``step`` by random access, without moving the iterator."""
        return self._dataset[step]

    def _fingerprint(self) -> dict[str, Any]:
        config = self.prepared.config
        return {
            "split": self.split,
            "ordered": self.ordered,
            "records": self.stats["records"],
            "num_examples": self.num_examples,
            "seed": config.seed,
            "shuffle": config.shuffle,
            "batch_size": self.global_batch_size,
            # packed rows depend on the row width and each example's length: a resumed run reads
            # the same rows only if both are the same (absent unpacked: older states still match)
            **({"packing": True, "max_length": config.max_length, "lengths": self._lengths_digest}
               if self._plan is not None else {}),
        }

    def get_state(self) -> dict[str, Any]:
        """JSON-able state: the next batch index and what it is an index into.

        The index counts global batches, and process ``p`` of ``P`` reads block ``p`` of
        global batch ``k`` as its local batch ``k``, so the same state serves every process,
        and a run saved with one process count resumes with another."""
        return {"next_index": self.step, "fingerprint": self._fingerprint()}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Continue from a state of :meth:`get_state`; a state of another dataset is an error."""
        if isinstance(state, (str, bytes)):
            state = json.loads(state)
        saved = dict(state.get("fingerprint", {}))
        for older in ("process_index", "process_count"):  # written by earlier versions; not binding
            saved.pop(older, None)
        mine = self._fingerprint()
        if saved != mine:
            diff = ", ".join(
                f"{k}: saved {saved.get(k)!r}, now {mine.get(k)!r}" for k in mine if saved.get(k) != mine.get(k)
            )
            raise ConfigError(f"the checkpoint's data position is into another dataset than this config reads "
                              f"({diff}): a resumed run must read the same data (data.paths, the data.* keys "
                              "that filter records, data.batch_size); undo the change, or start over with "
                              "--overwrite")
        self._iterator.set_state({"next_index": int(state["next_index"])})


def prepare_dataset(config: DataConfig, tokenizer, *, records: Sequence[Mapping] | None = None,
                    required_fields: Sequence[str] = ()) -> PreparedData:
    """Read, validate and count ``config.paths`` (or in-memory ``records``) once.

    Call ``.iterator("train")`` and ``.iterator("eval")`` on the result to get both
    splits from one pass over the data. ``required_fields``: optional fields of the
    format that every record must carry here (e.g. ``("margin",)``).
    """
    source = ListSource(records, "records", unit="record") if records is not None else None
    return PreparedData(config, tokenizer, source, required_fields=required_fields)


def build_dataset(
    config: DataConfig,
    tokenizer,
    *,
    split: str = "train",
    records: Sequence[Mapping] | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
    required_fields: Sequence[str] = (),
) -> DataIterator:
    """The batch iterator of ``split`` for this JAX process: ``prepare_dataset(...).iterator(split)``."""
    prepared = prepare_dataset(config, tokenizer, records=records, required_fields=required_fields)
    return prepared.iterator(split, process_index=process_index, process_count=process_count)
