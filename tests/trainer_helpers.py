"""Shared pieces of the trainer tests: a tiny random model on SmolLM2's tokenizer, and
small synthetic datasets whose answers are known."""

from __future__ import annotations

import os
import random

from alignax import config as config_io
from alignax.trainers.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")

# The tiny model of configs/tiny-*.yaml (scripts that write their own recipe use it).
TINY_MODEL = config_io.load_yaml(os.path.join(CONFIGS, "tiny-dpo.yaml"))["model"]

WORDS = ("apple river stone cloud maple ember north quiet silver harbor lantern meadow cedar "
         "falcon copper willow summit breeze canyon violet").split()


def separable_pairs(n: int, seed: int = 0) -> list[dict]:
    """Preference pairs a model can separate from the response alone: the chosen answer
    always starts with "yes", the rejected one with "no"."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        topic = " ".join(rng.sample(WORDS, 3))
        word = rng.choice(WORDS)
        records.append({"prompt": f"Say something about {topic}.", "chosen": f"yes {word}", "rejected": f"no {word}"})
    return records


def sft_conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        word = rng.choice(WORDS)
        out.append({"messages": [{"role": "user", "content": f"Repeat: {word}"},
                                 {"role": "assistant", "content": f"{word} {word}"}]})
    return out


def unpaired_feedback(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        word = rng.choice(WORDS)
        good = i % 2 == 0
        out.append({"prompt": f"Answer about {word}.", "completion": ("yes " if good else "no ") + word, "label": good})
    return out


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def tiny_config(tmp_path, recipe: str, *, steps: int = 4, overrides: tuple[str, ...] = (), **sections):
    """``configs/tiny-<recipe>.yaml`` writing under ``tmp_path``, quiet, with ``sections``
    merged over it (e.g. ``dpo={"beta": 0.5}``) and dotted ``overrides`` applied last."""
    raw = config_io.load_yaml(os.path.join(CONFIGS, f"tiny-{recipe}.yaml"))
    raw = _merge(raw, {
        "output_dir": str(tmp_path),
        "train": {"total_steps": steps, "log_every": 1},
        "data": {"read_threads": 0},
        "logging": {"console": False, "tensorboard": False},
    })
    raw = _merge(raw, sections)
    return load_config(data=raw, overrides=overrides)


# Synthetic records are short: a shorter sequence budget keeps their runs fast.
SHORT = {"data": {"max_length": 64, "max_prompt_length": 48}}
