"""A toy verifiable task for online-RL tests on the toy word-level model
(tests/support/toy_model.py): answer a prompt; the reward is the share of the word "yes" among
the completion's words — dense enough that a random policy sees variance in every group,
and learnable within a few dozen updates.
"""

from __future__ import annotations

import hashlib
import random

from tests.support.toy_model import TOY_WORDS
from tests.support.trainer_helpers import tiny_config


def yes_share(completions, references):
    """Share of "yes" among each completion's words (0 for an empty completion)."""
    del references
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(w == "yes" for w in words) / max(len(words), 1))
    return out


def hashed_reward(completions, references):
    """A reward in [0, 1) from the completion's text: distinct completions, distinct rewards,
    so every group has advantages to learn from."""
    del references
    return [int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) / 2**32 for text in completions]


def constant_reward(completions, references):
    del references
    return [0.5] * len(completions)


def nan_reward(completions, references):
    del references
    return [float("nan")] + [0.0] * (len(completions) - 1)


SCORED_BATCHES = []


def nan_on_second_batch(completions, references):
    """Finite rewards for the first batch it scores, a NaN in the second (reset
    ``SCORED_BATCHES`` first)."""
    del references
    SCORED_BATCHES.append(len(completions))
    return [float("nan") if len(SCORED_BATCHES) == 2 else 0.5] + [0.0] * (len(completions) - 1)


def toy_process_reward(steps, references):
    """One reward per step: the step's "yes" share."""
    del references
    return [[yes_share([s], None)[0] for s in parts] for parts in steps]


def toy_prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": " ".join(rng.choice(TOY_WORDS) for _ in range(3)), "answer": "yes", "task": "toy"}
            for _ in range(n)]


def toy_config(tmp_path, model_dir: str, algorithm: str, *, steps: int, overrides=(), **sections):
    """configs/tiny-<algorithm>.yaml on the toy model with the "yes"-share reward."""
    base = {
        "data": {"max_prompt_length": 24, "batch_size": 4, "eval_fraction": 0.25},
        "optim": {"learning_rate": 2e-2},
    }
    if algorithm in ("grpo", "ppo"):  # an offline run reads no rollout, rewards nor evaluation settings
        base.update(rollout={"max_new_tokens": 8}, evaluation={"max_prompts": 4}, rewards={
            "verifier_weight": 0.0, "format_weight": 0.0, "functions": {"tests.support.rl_toy:yes_share": 1.0}})
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return tiny_config(tmp_path, algorithm, steps=steps, model_dir=model_dir, overrides=tuple(overrides), **base)


SAMPLER_FAULT = {"fail_on_batch": None, "batches": 0}


def yes_share_with_a_fault(completions, references):
    """:func:`yes_share`, raising on the scored batch numbered ``SAMPLER_FAULT["fail_on_batch"]``
    (0-based, counted in ``SAMPLER_FAULT["batches"]``; calls on one completion, as the
    reward room's search for the failing completion makes, are not batches): a reward
    function that fails once, as a verifier whose server drops a request would
    (tests/test_async_rollouts.py)."""
    if len(completions) == 1:
        return yes_share(completions, references)
    batch = SAMPLER_FAULT["batches"]
    SAMPLER_FAULT["batches"] += 1
    if batch == SAMPLER_FAULT["fail_on_batch"]:
        raise ConnectionError(f"the verifier dropped scored batch {batch}")
    return yes_share(completions, references)
