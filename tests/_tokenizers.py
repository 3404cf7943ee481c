"""Tiny offline chat tokenizers (Llama-3 and ChatML style) for tests; no hub access."""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Like Qwen2.5: a default system prompt is inserted when the conversation has none.
CHATML_DEFAULT_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}" + CHATML_TEMPLATE
)

FAMILIES = {
    "llama3": dict(
        special=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eot_id|>", "<|finetune_right_pad_id|>"],
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad="<|finetune_right_pad_id|>", template=LLAMA3_TEMPLATE,
    ),
    "chatml": dict(
        special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", template=CHATML_TEMPLATE,
    ),
}
FAMILIES["chatml_default_system"] = dict(FAMILIES["chatml"], template=CHATML_DEFAULT_SYSTEM_TEMPLATE)

# Fixed corpus: English, unicode, emoji and code so that merges are realistic enough to mix spans.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital.",
    "You are a helpful assistant. Please answer the question concisely and correctly.",
    "What is 2 + 2? The answer is 4. Multiply 3 by 7 to get 21. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "Héllo wörld, ça va? Ünïcödé: 日本語のテキスト, 中文文本, Ελληνικά, русский текст, العربية.",
    "Emoji: 😀 🚀 🎉 👍🏽 ❤️ 🤖 — dashes – and “quotes” … ellipsis.",
    "```python\ndef add(a, b):\n    return a + b\n\nprint(add(1, 2))\n```",
    "for i in range(10):\n    if i % 2 == 0:\n        print(f'{i} is even')\n    else:\n        continue\n",
    "import torch\nx = torch.zeros(3, 4)\ny = x @ x.T  # matrix product\n{'key': [1, 2, 3]}\n",
    "user assistant system human gpt instruction input output response question answer",
    "Translate to German: good morning -> Guten Morgen. Summarize the following text in one sentence.",
]


@lru_cache(maxsize=None)
def _backend(family: str) -> Tokenizer:
    spec = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600, min_frequency=2, special_tokens=spec["special"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return tok


def build_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A fresh tokenizer for 'llama3', 'chatml' or 'chatml_default_system' (training is cached per family)."""
    spec = FAMILIES[family]
    return PreTrainedTokenizerFast(
        tokenizer_object=_backend(family), bos_token=spec["bos"], eos_token=spec["eos"],
        pad_token=spec["pad"], chat_template=spec["template"], model_max_length=1 << 20,
    )
