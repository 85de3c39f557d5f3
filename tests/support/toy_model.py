"""A tiny word-level model for fast trainer tests.

A one-layer Llama over the 22-word vocabulary of tests/data/tiny_tokenizer.py (pad == eos
== ``<|im_end|>``, ChatML template), saved as a Hugging Face folder so trainers load it
like any model. Logits over 32 ids instead of SmolLM2's 49,152 make every step cheap, and
a task over its words is learnable in a few dozen updates.

One layer because the trainer tests that use it test the trainers, and XLA's compile of a
train step is most of such a test's time: with a second layer a two-step PPO run took
12.8 s against 9.2 s, its XLA compile 8.2 s against 5.5 s. How layers stack (the residual stream between them, a
KV cache per layer, scan over layers, per-layer remat) is tested on models of two or more
layers in tests/test_models*.py, test_sampling.py, test_packing.py and
test_remat_attention.py; ``layers=2`` gives this model with two.
"""

from __future__ import annotations

import os

from alignax.models import ModelConfig, create_model, save_pretrained
from tests.data.tiny_tokenizer import WORDS, word_tokenizer

# Words a toy record may use (no special or structural tokens).
TOY_WORDS = ["hi", "there", "bye", "now", "yes", "no", "what", "is", "two", "plus", "four", "ok", "sure"]


def make_toy_model(directory, seed: int = 0, layers: int = 1, experts: int = 0) -> str:
    """Write the tiny word-level model and its tokenizer to ``directory``; ``experts > 0``:
    a Qwen3-MoE of that many experts (top 2, width 16) in place of the Llama MLP."""
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    end = WORDS.index("<|im_end|>")
    hf = dict(model_type="llama", vocab_size=32, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=256,
              rms_norm_eps=1e-5, tie_word_embeddings=True, eos_token_id=end, pad_token_id=end,
              bos_token_id=WORDS.index("<|im_start|>"))
    if experts:
        hf.update(model_type="qwen3_moe", num_experts=experts, num_experts_per_tok=2, moe_intermediate_size=16,
                  norm_topk_prob=True, router_aux_loss_coef=0.01)
    model = create_model(ModelConfig.from_hf_config(hf), seed=seed)
    save_pretrained(model, directory)
    word_tokenizer().save_pretrained(directory)
    return directory
