"""Flax NNX decoders (Llama, Qwen2/2.5, Qwen3, Qwen3-MoE, GPT-2, Mistral, Phi-3, Gemma 2, Gemma 3
text) with LM, value and reward heads, a KV cache, and Hugging Face weights in and out.

Build from a config (``CausalLM(ModelConfig.from_hf_config(cfg), rngs=nnx.Rngs(0))``) or
from weights (``from_pretrained(dir)``, ``from_hf_state_dict(cfg, tensors)``); save with
``save_pretrained``. See modeling.py for the forward signature and cache.py for the cache.
"""

from alignax.models.cache import CACHE_AXES, KVCache, cache_shardings, init_cache
from alignax.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, rope_inv_freq
from alignax.models.gguf import gguf_to_hf
from alignax.models.hf import (
    from_hf_state_dict,
    from_pretrained,
    read_hf_tensors,
    save_pretrained,
    to_hf_state_dict,
)
from alignax.models.modeling import (
    MODEL_KINDS,
    create_model,
    CausalLM,
    Decoder,
    ModelOutput,
    PolicyValueModel,
    RewardModel,
    ValueModel,
    last_token_index,
    map_time_chunks,
    positions_from_mask,
    token_logprobs_from_hidden,
)
from alignax.models.registry import load
from alignax.models.safetensors_io import SafetensorsError, read_safetensors, write_safetensors
from alignax.models.tokenizer import tokenizer_from_gguf

__all__ = [
    "CACHE_AXES",
    "MODEL_KINDS",
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "Decoder",
    "KVCache",
    "ModelConfig",
    "ModelOutput",
    "PolicyValueModel",
    "RewardModel",
    "SafetensorsError",
    "ValueModel",
    "cache_shardings",
    "create_model",
    "from_hf_state_dict",
    "from_pretrained",
    "gguf_to_hf",
    "init_cache",
    "last_token_index",
    "load",
    "map_time_chunks",
    "positions_from_mask",
    "read_hf_tensors",
    "read_safetensors",
    "rope_inv_freq",
    "save_pretrained",
    "to_hf_state_dict",
    "token_logprobs_from_hidden",
    "tokenizer_from_gguf",
    "write_safetensors",
]
