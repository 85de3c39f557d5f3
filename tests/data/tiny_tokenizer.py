"""Tiny in-memory tokenizers with ChatML special tokens, for the data tests.

``word_tokenizer``: one token per space-separated word, ``\\n`` kept as its own token,
so masks can be checked by hand. ``bpe_tokenizer``: a byte-level BPE trained on a few
strings, for realistic sub-word splits. Both have pad == eos == ``<|im_end|>`` (as
SmolLM2) and a ChatML chat template.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# SmolLM2-135M-Instruct's template (from its GGUF): adds a default system turn.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>"]
WORDS = SPECIALS + ["[UNK]", "\n", "system", "user", "assistant", "be", "brief", "hi", "there",
                    "bye", "now", "yes", "no", "what", "is", "two", "plus", "four", "ok", "sure"]
IDS = {w: i for i, w in enumerate(WORDS)}


def _wrap(backend: Tokenizer, template: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|im_end|>", unk_token="[UNK]",
        chat_template=template,
    )


def word_tokenizer(template: str = CHATML) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.WordLevel(vocab=dict(IDS), unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(" ", behavior="removed"), pre_tokenizers.Split(Regex("\n"), behavior="isolated")]
    )
    backend.add_special_tokens(SPECIALS)
    return _wrap(backend, template)


def bpe_tokenizer(template: str = SMOLLM2) -> PreTrainedTokenizerFast:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["hello there, how are you?", "The answer is <answer>42</answer>.", "assistant user system\n"] * 5
    backend.train_from_iterator(corpus, trainer)
    return _wrap(backend, template)


def ids(*words: str) -> list[int]:
    """Word-tokenizer ids of ``words`` (``"\\n"`` included as given)."""
    return [IDS[w] for w in words]
