"""Tiny offline chat tokenizers (Llama-3, ChatML, Qwen3-like with reasoning and tools) for tests; no hub access."""

from __future__ import annotations

from functools import lru_cache

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
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

# Our own template with the behaviour of Qwen3's: tools in the system turn, tool calls as XML-tagged JSON, tool
# results in user turns; reasoning only in the turns after the last user query, and an empty think block in the
# last turn when it has none (so earlier turns render differently once the conversation goes on).
QWEN3_LIKE_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- if tools %}{{ '<|im_start|>system\n' }}{%- if messages and messages[0].role == 'system' %}"
    "{{ messages[0].content + '\n\n' }}{%- endif %}{{ '# Tools\n<tools>' }}{%- for t in tools %}"
    "{{ '\n' + (t | tojson) }}{%- endfor %}{{ '\n</tools>\nCall one as <tool_call>{\"name\": ..., "
    "\"arguments\": ...}</tool_call>.<|im_end|>\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content if m.content is string else '' %}"
    "{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}"
    "{%- if '</think>' in content %}{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') %}{%- endif %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{%- if loop.index0 > ns.last_user and (loop.last or reasoning) %}"
    "{{ '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' }}{%- endif %}{{ content }}"
    "{%- for c in m.tool_calls or [] %}{%- if content or not loop.first %}{{ '\n' }}{%- endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' }}"
    "{%- if c.function.arguments is string %}{{ c.function.arguments }}{%- else %}"
    "{{ c.function.arguments | tojson }}{%- endif %}{{ '}\n</tool_call>' }}{%- endfor %}{{ '<|im_end|>\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
# Special tokens of the other tool-calling template styles the tests write (GPT-OSS channels, special-token
# delimited calls, Python-call lists, Mistral-like [INST]).
TOOL_SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|User|>",
                 "<|Assistant|>", "<|tool_calls_begin|>", "<|tool_call_begin|>", "<|tool_sep|>", "<|tool_call_end|>",
                 "<|tool_calls_end|>", "<|tool_output_begin|>", "<|tool_output_end|>", "<|eos|>",
                 "<|tool_call_start|>", "[INST]", "[/INST]", "</s>"]

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
# As in Qwen3's tokenizer, the think and tool tags are added tokens but not special ones.
FAMILIES["qwen3"] = dict(FAMILIES["chatml"], special=["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + TOOL_SPECIALS,
                         template=QWEN3_LIKE_TEMPLATE,
                         added=["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
                                "</tool_response>"],
                         corpus=['{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}} tools',
                                 "Let me think step by step. The weather in Paris is sunny, 21 degrees."])

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
    tok.train_from_iterator((_CORPUS + spec.get("corpus", [])) * 4, trainer=trainer)
    return tok


def build_tokenizer(family: str) -> PreTrainedTokenizerFast:
    """A fresh tokenizer of a FAMILIES entry (training is cached per family)."""
    spec = FAMILIES[family]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=_backend(family), bos_token=spec["bos"], eos_token=spec["eos"],
        pad_token=spec["pad"], chat_template=spec["template"], model_max_length=1 << 20,
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.get("added", ())])
    return tok
