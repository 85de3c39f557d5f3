"""Shared pieces of the trainer tests: the tiny recipes of configs/, the toy word-level
model (tests/support/toy_model.py), and small synthetic datasets whose answers are known."""

from __future__ import annotations

import functools
import os
import random

import jax

from alignax import config as config_io
from alignax.trainers.api import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/support/ -> the repository
CONFIGS = os.path.join(ROOT, "configs")

# The tiny model of configs/tiny-*.yaml (scripts that write their own recipe use it).
TINY_MODEL = config_io.load_yaml(os.path.join(CONFIGS, "tiny-dpo.yaml"))["model"]

from tests.support.toy_model import TOY_WORDS

# Content words of the synthetic records ("yes" / "no" are kept for the answers).
WORDS = [w for w in TOY_WORDS if w not in ("yes", "no")]


def separable_pairs(n: int, seed: int = 0) -> list[dict]:
    """Preference pairs a model can separate from the response alone: the chosen answer
    always starts with "yes", the rejected one with "no"."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        topic = " ".join(rng.sample(WORDS, 3))
        word = rng.choice(WORDS)
        records.append({"prompt": f"what is {topic}", "chosen": f"yes {word}", "rejected": f"no {word}"})
    return records


def sft_conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        word = rng.choice(WORDS)
        out.append({"messages": [{"role": "user", "content": f"what is {word}"},
                                 {"role": "assistant", "content": f"{word} {word}"}]})
    return out


def unpaired_feedback(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        word = rng.choice(WORDS)
        good = i % 2 == 0
        out.append({"prompt": f"what is {word}", "completion": ("yes " if good else "no ") + word, "label": good})
    return out


def merge_sections(base: dict, extra: dict) -> dict:
    """``base`` (a raw recipe) with ``extra`` laid over it: nested sections merge key by key,
    anything else replaces. Neither argument is changed."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merge_sections(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
            else value
    return out


def tiny_config(tmp_path, recipe: str, *, steps: int = 4, model_dir: str | None = None,
                overrides: tuple[str, ...] = (), **sections):
    """``configs/tiny-<recipe>.yaml`` writing under ``tmp_path``, quiet, with ``sections``
    merged over it (e.g. ``preference={"beta": 0.5}``) and dotted ``overrides`` applied last.
    ``model_dir``: train that model folder (e.g. the toy model) instead of the recipe's."""
    raw = config_io.load_yaml(os.path.join(CONFIGS, f"tiny-{recipe}.yaml"))
    if model_dir is not None:
        raw["model"] = {"name": str(model_dir)}
        data = raw.setdefault("data", {})
        data["max_prompt_length"] = 24
        if data.get("format") != "prompt":  # prompt batches have no max_length (rollout.max_new_tokens)
            data["max_length"] = 32
        # the recipe's reward functions read its own prompts' answers; a run on other
        # records brings its own (tests/support/rl_toy.py)
        raw.get("rewards", {}).pop("functions", None)
    raw = merge_sections(raw, {
        "output_dir": str(tmp_path),
        "train": {"total_steps": steps, "log_every": 1},
        "data": {"read_threads": 0},
        "logging": {"console": False, "tensorboard": False},
    })
    raw = merge_sections(raw, sections)
    return load_config(data=raw, overrides=overrides)


def step_solutions(n: int, seed: int = 0) -> list[dict]:
    """Step-labelled solutions (format ``steps``) a PRM can learn from the steps alone: a
    step starting with "no" is a slip, and every step from the first slip on is labelled 0."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        count = rng.randint(2, 4)
        slip = rng.randrange(count) if rng.random() < 0.6 else None
        steps = [("no " if k == slip else "yes ") + rng.choice(WORDS) for k in range(count)]
        labels = [int(slip is None or k < slip) for k in range(count)]
        records.append({"prompt": f"what is {' '.join(rng.sample(WORDS, 2))}", "steps": steps, "labels": labels})
    return records


@functools.partial(jax.jit, static_argnames=("scale", "seed"))  # one program, not an op-by-op draw per leaf
def perturbed(tree, *, scale: float, seed: int):
    """``tree`` (params) with Gaussian noise of std ``scale`` added to every leaf, one key per
    leaf split from ``seed``: a policy or reference that differs from its twin by a known amount."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])
