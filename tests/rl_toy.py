"""A toy verifiable task for online-RL tests, on a tiny word-level model.

The model: a 2-layer Llama over the 22-word vocabulary of tests/data/tiny_tokenizer.py
(pad == eos == ``<|im_end|>``, ChatML template), saved as a Hugging Face folder so the
trainers load it like any model. The task: answer a prompt; the reward is the share of
the word "yes" among the completion's words — dense enough that a random policy sees
variance in every group, and learnable within a few dozen updates.
"""

from __future__ import annotations

import os
import random

from alignax.models import ModelConfig, create_model, save_pretrained
from tests.data.tiny_tokenizer import WORDS, word_tokenizer
from tests.trainer_helpers import tiny_config

TOY_WORDS = ["hi", "there", "bye", "now", "yes", "no", "what", "is", "two", "plus", "four", "ok", "sure"]


def letter_e_share(completions, references):
    del references
    return [text.count("e") / max(len(text), 1) for text in completions]


def yes_share(completions, references):
    """Share of "yes" among each completion's words (0 for an empty completion)."""
    del references
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(w == "yes" for w in words) / max(len(words), 1))
    return out


def constant_reward(completions, references):
    del references
    return [0.5] * len(completions)


def nan_reward(completions, references):
    del references
    return [float("nan")] + [0.0] * (len(completions) - 1)


def toy_process_reward(steps, references):
    """One reward per step: the step's "yes" share."""
    del references
    return [[yes_share([s], None)[0] for s in parts] for parts in steps]


def make_toy_model(directory: str, seed: int = 0) -> str:
    """Write the tiny word-level model and its tokenizer to ``directory``."""
    hf = dict(model_type="llama", vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=256,
              rms_norm_eps=1e-5, tie_word_embeddings=True, eos_token_id=WORDS.index("<|im_end|>"),
              pad_token_id=WORDS.index("<|im_end|>"), bos_token_id=WORDS.index("<|im_start|>"))
    model = create_model(ModelConfig.from_hf_config(hf), seed=seed)
    save_pretrained(model, directory)
    word_tokenizer().save_pretrained(directory)
    return directory


def toy_prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": " ".join(rng.choice(TOY_WORDS) for _ in range(3)), "answer": "yes", "task": "toy"}
            for _ in range(n)]


def toy_config(tmp_path, model_dir: str, algorithm: str, *, steps: int, overrides=(), **sections):
    """configs/tiny-<algorithm>.yaml pointed at the toy model and the "yes"-share reward."""
    base = {
        "model": {"name": model_dir, "random_init": None, "logprob_chunk_size": None},
        "data": {"paths": [], "max_prompt_length": 24, "batch_size": 4, "eval_fraction": 0.25},
        "rollout": {"max_new_tokens": 8, "greedy_eval_prompts": 4},
        "rewards": {"verifier_weight": 0.0, "format_weight": 0.0, "functions": {"tests.rl_toy:yes_share": 1.0}},
        "optim": {"learning_rate": 2e-2},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return tiny_config(tmp_path, algorithm, steps=steps, overrides=tuple(overrides), **base)


def ensure_dir(path) -> str:
    os.makedirs(path, exist_ok=True)
    return str(path)
