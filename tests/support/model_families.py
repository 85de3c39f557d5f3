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
}
