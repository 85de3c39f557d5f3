"""The sampler on the real SmolLM2-135M-Instruct: greedy tokens equal transformers'.

Both sides hold the weights ``alignax.models.load`` converted into its cache (the HF
directory transformers reads with ``from_pretrained``). Three chat prompts of different
lengths are left-padded into one batch; ``<|im_end|>`` (id 2) is both the stop token
and the pad token, so the test also checks that the real end-of-turn token stays in the
response mask.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from flax import nnx
from transformers import AutoModelForCausalLM

import jax

from alignax.models.registry import DEFAULT_MODEL, load, local_model_path
from alignax.sampling import SamplingConfig, generate, left_pad

torch = pytest.importorskip("torch", reason="the PyTorch reference (pinned test extras; not in `make test-latest`)")

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHATS = [
    [{"role": "user", "content": "What is the capital of France? Answer with one word."}],
    [{"role": "user", "content": "Name three colours."}],
    [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Explain in one sentence why the sky is blue."},
    ],
]
MAX_NEW_TOKENS = 12
EOS = 2


@pytest.mark.slow
def test_smollm2_greedy_equals_transformers():
    model, tokenizer = load(DEFAULT_MODEL, scan_layers=True)  # scanned layers: one layer compiled
    assert tokenizer.eos_token_id == EOS == tokenizer.pad_token_id
    prompts = [
        tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"] for chat in CHATS
    ]
    assert len({len(p) for p in prompts}) == len(prompts)  # padded batch: every row differs
    tokens, mask = left_pad(prompts, pad_id=EOS)

    config = SamplingConfig(max_new_tokens=MAX_NEW_TOKENS, greedy=True, stop_token_ids=(EOS,), pad_id=EOS)
    graphdef, state = nnx.split(model)
    out = jax.device_get(generate(graphdef, state, tokens, mask, jax.random.key(0), config=config))

    hf = AutoModelForCausalLM.from_pretrained(local_model_path(DEFAULT_MODEL), dtype=torch.float32).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # PyTorch's spinning workers crawl on a shared, busy machine
    try:
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor(tokens, dtype=torch.long),
                attention_mask=torch.tensor(mask, dtype=torch.long),
                do_sample=False,
                max_new_tokens=MAX_NEW_TOKENS,
                eos_token_id=EOS,
                pad_token_id=EOS,
            )[:, tokens.shape[1] :].numpy()
    finally:
        torch.set_num_threads(threads)

    np.testing.assert_array_equal(out.tokens[:, : ref.shape[1]], ref)
    assert (out.tokens[:, ref.shape[1] :] == EOS).all()
    for b in range(len(CHATS)):
        row = list(ref[b])
        length = row.index(EOS) + 1 if EOS in row else MAX_NEW_TOKENS
        assert out.lengths[b] == length and bool(out.stopped[b]) == (EOS in row)
        np.testing.assert_array_equal(out.response_mask[b], np.arange(MAX_NEW_TOKENS) < length)
    assert out.stopped.any()  # the one-word answer ends with <|im_end|> ...
    stopped = int(np.argmax(out.stopped))
    assert out.tokens[stopped, out.lengths[stopped] - 1] == EOS  # ... which is inside the mask
    answer = tokenizer.decode(out.tokens[0, : out.lengths[0]], skip_special_tokens=True)
    assert "Paris" in answer, answer
