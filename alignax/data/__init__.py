"""Data for alignax: sources, formats, the grain pipeline, and packaged real data.

The trainer's entry points::

    from alignax.data import DataConfig, build_dataset, prepare_dataset

    config = DataConfig(paths=("pairs.jsonl",), format="preference", batch_size=8)
    batches = build_dataset(config, tokenizer)           # train split, this process's share
    batch = next(batches)                                 # dict of fixed-shape numpy arrays
    state = batches.get_state()                           # JSON-able; set_state(state) resumes
    batches.stats                                         # records, skipped/<reason>, truncated/...

    prepared = prepare_dataset(config, tokenizer)         # one pass for both splits
    train, evaluation = prepared.iterator("train"), prepared.iterator("eval")

Modules: :mod:`~alignax.data.sources` (files and folders as grain sources),
:mod:`~alignax.data.formats` (tokenisation, masks, truncation),
:mod:`~alignax.data.pipeline` (config, shuffling, sharding, batching, state),
:mod:`~alignax.data.builders` (reasoning-gym and champ-dataset records).
"""

from alignax.data.builders import (
    champ_pairs,
    generate,
    reasoning_gym_pairs,
    reasoning_gym_prompts,
    reasoning_gym_sft,
    unpaired_from_pairs,
    write_jsonl,
)
from alignax.data.formats import FORMATS, TRUNCATIONS, Encoded, Encoder
from alignax.data.pipeline import DataConfig, DataIterator, PreparedData, build_dataset, prepare_dataset
from alignax.data.sources import BadRecordError, open_source

__all__ = [
    "BadRecordError",
    "DataConfig",
    "DataIterator",
    "Encoded",
    "Encoder",
    "FORMATS",
    "PreparedData",
    "TRUNCATIONS",
    "build_dataset",
    "champ_pairs",
    "generate",
    "open_source",
    "prepare_dataset",
    "reasoning_gym_pairs",
    "reasoning_gym_prompts",
    "reasoning_gym_sft",
    "unpaired_from_pairs",
    "write_jsonl",
]
