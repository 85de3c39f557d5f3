"""Tiny Hugging Face configs of every supported family (no PyTorch needed to read them):
the models tests build them in transformers and in alignax; the estimator tests count
their parameters."""

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
CONFIGS = {
    "llama": dict(
        COMMON,
        model_type="llama",
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=False,
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "qwen2": dict(
        COMMON,
        model_type="qwen2",
        num_key_value_heads=1,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    ),
    "qwen3": dict(
        COMMON,
        model_type="qwen3",
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    ),
    "gpt2": dict(model_type="gpt2", vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32),
    # Windows of 4 positions: the tests' sequences (8 tokens and more) run past them.
    "mistral": dict(
        COMMON,
        model_type="mistral",
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    ),
    "phi3": dict(
        COMMON,
        model_type="phi3",
        num_key_value_heads=2,
        sliding_window=4,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    ),
    "gemma2": dict(  # layers: sliding, full; query_pre_attn_scalar != head_dim; caps that bite at these sizes
        COMMON,
        model_type="gemma2",
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    ),
    "gemma3_text": dict(  # layers: sliding (local base 100), full (linear-scaled base 5000)
        COMMON,
        model_type="gemma3_text",
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}},
    ),
}
# Mixtures of experts (alignax.models.moe; tests/test_moe.py): apart from CONFIGS, as
# tests/test_models.py's gradient check names the expert weights one tensor an expert where
# transformers' state_dict() holds them fused (experts.gate_up_proj [E, 2F, D]).
MOE_CONFIGS = {
    # a mixture (alignax.models.moe): 4 experts, top 2; the coefficient larger than
    # transformers' 0.001 so the load-balancing term shows in a float32 loss
    "qwen3_moe": dict(
        COMMON,
        model_type="qwen3_moe",
        moe_intermediate_size=16,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        attention_bias=True,
        router_aux_loss_coef=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    ),
}
# transformers' classes of each family (built by the tests that import torch).
HF_CLASS_NAMES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
