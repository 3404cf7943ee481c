"""Labels exact on templates that read reasoning under another name, that render the message before a turn by what
follows it, or whose generation prompt adds an instruction after the history; template kwargs it never reads
(issues 52 and 53)."""

import pytest

from test_templates import check, decode, tok_with, user

# Solar Open style: the reasoning is read from `reasoning` (the name vLLM and OpenAI's APIs use).
READS_REASONING = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' and m.reasoning %}{{ '<think>' + m.reasoning + '</think>\\n' }}{%- endif %}"
    "{{ (m.content or '') + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.mark.parametrize("name", ["reasoning_content", "reasoning", "thinking"])
def test_reasoning_reaches_a_template_that_reads_it_as_reasoning(name):
    tok = tok_with(READS_REASONING)
    row = {"messages": [user("Hi"), {"role": "assistant", "content": "Hello!", name: "Greet back."}]}
    rendered = [user("Hi"), {"role": "assistant", "content": "Hello!", "reasoning": "Greet back."}]
    samples = check(tok, rendered, row=row)
    trained = decode(tok, [t for t, lab in zip(samples[0]["input_ids"], samples[0]["labels"]) if lab != -100])
    assert trained == "<think>Greet back.</think>\nHello!<|im_end|>"
