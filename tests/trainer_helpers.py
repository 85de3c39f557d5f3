"""Shared pieces of the trainer tests: a tiny random model on SmolLM2's tokenizer, and
small synthetic datasets whose answers are known."""

from __future__ import annotations

import random

from alignax.trainers.config import load_config

# A tiny Llama with SmolLM2's vocabulary (and tokenizer): compiles and steps in seconds.
TINY_MODEL = {
    "name": "smollm2-135m-instruct",
    "random_init": {
        "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "intermediate_size": 64,
    },
    "logprob_chunk_size": 32,
}

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


def tiny_config(tmp_path, algorithm: str, *, data_format: str, steps: int = 4, batch_size: int = 8,
                overrides: tuple[str, ...] = (), **sections):
    """A TrainConfig for a tiny run writing under ``tmp_path``; sections override defaults."""
    data = {"format": data_format, "max_length": 64, "max_prompt_length": 48, "batch_size": batch_size,
            "eval_fraction": 0.25, "shuffle": True, "read_threads": 0}
    data.update(sections.pop("data", {}))
    raw = {
        "algorithm": algorithm,
        "output_dir": str(tmp_path),
        "model": dict(TINY_MODEL, **sections.pop("model", {})),
        "data": data,
        "optim": {"learning_rate": 3e-3, "warmup_steps": 0, "schedule": "constant", **sections.pop("optim", {})},
        "train": {"total_steps": steps, "log_every": 1, **sections.pop("train", {})},
        "logging": {"console": False, "tensorboard": False},
        "mesh": {"shape": [1, 1, 1]},
        **sections,
    }
    return load_config(data=raw, overrides=overrides)
