"""Labels exact on templates that read reasoning under another name, that render the message before a turn by what
follows it, or whose generation prompt adds an instruction after the history; template kwargs it never reads
(issues 52 and 53)."""

import json

import pytest
from tokenizers import AddedToken

from finetune.data import DataError, to_conversation
from finetune.data.label_hints import tokenize_messages  # data's, with the not_prefix hint
from test_templates import assistant, call, check, decode, splits, tok_with, tool, user

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


# Hermes-3 tool-use style: a tool result closes with a newline before <|im_end|> when a message follows it, without
# one when it is the last message (so in the generation prompt after it), and no newline after <|im_end|>.
TOOL_RESULT_CLOSED_BY_WHAT_FOLLOWS = (
    "{%- for m in messages %}{%- if m.role == 'tool' %}"
    "{%- if loop.previtem and loop.previtem.role != 'tool' %}{{ '<|im_start|>tool\\n' }}{%- endif %}"
    "{{ '<tool_response>\\n' + m.content + ('\\n</tool_response>\\n' if not loop.last else '\\n</tool_response>') }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{ '<|im_end|>' }}{%- endif %}"
    "{%- elif m.tool_calls %}{{ '<|im_start|>assistant' }}{%- for c in m.tool_calls %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' + (c.function.arguments | tojson) +"
    " '}\\n</tool_call>' }}{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def contexts_and_answers(tok, samples) -> dict:
    """{turn: (the text before it, its trained text)} of each sample's trained runs."""
    out = {}
    for s in samples:
        ids, labels = s["input_ids"], s["labels"]
        starts = [k for k, lab in enumerate(labels) if lab != -100 and (k == 0 or labels[k - 1] == -100)]
        ends = [k for k in range(1, len(labels) + 1) if labels[k - 1] != -100 and (k == len(labels) or
                                                                                   labels[k] == -100)]
        for i, a, b in zip(s["turns"], starts, ends):
            out[i] = decode(tok, ids[:a]), decode(tok, ids[a:b])
    return out


def label(tok, messages, on_unsupported="error"):
    conv = to_conversation({"messages": messages}, "messages", "t.jsonl row 0")
    return tokenize_messages(tok, conv.messages, 4096, "t.jsonl row 0", None, on_unsupported)


def generation_prompt(tok, messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_a_turn_after_a_message_rendered_by_what_follows_is_trained_after_its_generation_prompt():
    tok = tok_with(TOOL_RESULT_CLOSED_BY_WHAT_FOLLOWS)
    messages = [user("Weather?"), assistant("", calls=[call(city="Paris")]), tool('{"temp": 21}'),
                assistant("Sunny, 21."), user("Thanks"), assistant("Bye")]
    full = tok.apply_chat_template(messages, tokenize=False)
    assert '</tool_response>\n<|im_end|><|im_start|>assistant\nSunny' in full  # not the generation prompt's
    assert generation_prompt(tok, messages[:3]).endswith("</tool_response><|im_end|><|im_start|>assistant\n")
    samples, dropped, left_out = label(tok, messages)
    assert (dropped, left_out) == (None, [])
    # the answer after the tool result in a sample of its own, whose context is the generation prompt exactly
    assert splits(samples) == [([1, 5], ""), ([3], "context")]
    assert samples[0]["input_ids"] == tok.apply_chat_template(messages, tokenize=True)["input_ids"]
    got = contexts_and_answers(tok, samples)
    assert {i: context for i, (context, _) in got.items()} == {i: generation_prompt(tok, messages[:i])
                                                               for i in (1, 3, 5)}
    assert {i: answer for i, (_, answer) in got.items()} == {
        1: '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        3: "Sunny, 21.<|im_end|>", 5: "Bye<|im_end|>"}


# Command R+ tool-use style: turns between <|START_OF_TURN_TOKEN|> and <|END_OF_TURN_TOKEN|>, tool calls written as
# "Action:" and a JSON list (a turn's content beside calls is not written), and a system turn after the history that
# asks for one: after every conversation, or only before the generation prompt.
ACTION_TURNS = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}"
    "{%- if m.tool_calls %}{{ 'Action: ```json\\n[' }}{%- for c in m.tool_calls %}{{ '{\"tool_name\": \"' +"
    " c.function.name + '\", \"parameters\": ' + (c.function.arguments | tojson) + '}' }}{%- endfor %}"
    "{{ ']\\n```' }}{%- else %}{{ m.content }}{%- endif %}{{ '<|END_OF_TURN_TOKEN|>' }}"
    "{%- elif m.role == 'tool' %}{{ '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|><results>' + m.content +"
    " '</results><|END_OF_TURN_TOKEN|>' }}"
    "{%- else %}{{ '<|START_OF_TURN_TOKEN|><|USER_TOKEN|>' + m.content + '<|END_OF_TURN_TOKEN|>' }}{%- endif %}"
    "{%- endfor %}"
)
ASK_FOR_ACTION = ("{{ '<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>Write \\'Action:\\' followed by the list of tool calls, "
                  "as JSON, that answers the last input.<|END_OF_TURN_TOKEN|>' }}")
CHATBOT_PROMPT = "{%- if add_generation_prompt %}{{ '<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>' }}{%- endif %}"
ACTION_AFTER_EVERY_CONVERSATION = ACTION_TURNS + ASK_FOR_ACTION + CHATBOT_PROMPT
ACTION_BEFORE_THE_PROMPT = ACTION_TURNS + CHATBOT_PROMPT.replace("{{", ASK_FOR_ACTION + "{{", 1)


def action_tok(template):
    tok = tok_with(template)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in (
        "<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>")])
    return tok


@pytest.mark.parametrize("template", [ACTION_AFTER_EVERY_CONVERSATION, ACTION_BEFORE_THE_PROMPT])
def test_a_generation_prompt_that_adds_an_instruction_trains_each_turn_after_it(template):
    tok = action_tok(template)
    messages = [user("Weather?"), assistant(None, calls=[call(city="Paris")]), tool('{"temp": 21}'),
                assistant("Sunny, 21."), user("Thanks"), assistant("Bye")]
    assert "Write 'Action:'" in generation_prompt(tok, messages[:1])
    samples, dropped, left_out = label(tok, messages)
    assert (dropped, left_out) == (None, [])
    # every turn after the instruction, which its rendering in the conversation does not show before it
    assert splits(samples) == [([1], "context"), ([3], "context"), ([5], "context")]
    got = contexts_and_answers(tok, samples)
    assert {i: context for i, (context, _) in got.items()} == {i: generation_prompt(tok, messages[:i])
                                                               for i in (1, 3, 5)}
    assert {i: answer for i, (_, answer) in got.items()} == {
        1: 'Action: ```json\n[{"tool_name": "get_weather", "parameters": {"city": "Paris"}}]\n```<|END_OF_TURN_TOKEN|>',
        3: "Sunny, 21.<|END_OF_TURN_TOKEN|>", 5: "Bye<|END_OF_TURN_TOKEN|>"}
    # a turn whose own text its rendering does not show (content beside calls) keeps the one-line refusal
    dropped_content = [user("Weather?"), assistant("Let me look.", calls=[call(city="Paris")])]
    with pytest.raises(DataError) as e:
        label(tok, dropped_content)
    assert str(e.value) == ('t.jsonl row 0: message 1: the chat template renders it differently from its generation '
                            'prompt, so there is no answer to train (not_prefix); data.on_unsupported="drop" leaves '
                            'such turns untrained and trains the rest')


def test_a_template_kwarg_the_template_never_reads_is_refused_in_one_line(tmp_path, llama_dir):
    from helpers import invoke
    from test_templates import ENABLE_THINKING, QWEN3_LIKE_TEMPLATE
    says = ("data.chat_template_kwargs.enable_thinkng: the chat template never reads 'enable_thinkng', so it would "
            "change nothing (did you mean enable_thinking?); fix or remove the key")
    data, template = tmp_path / "d.jsonl", tmp_path / "t.jinja"
    data.write_text(json.dumps({"messages": [user("Hi"), assistant("Hello")]}) + "\n")
    template.write_text(ENABLE_THINKING)
    refused, shown = (invoke("preview-data", "--model", llama_dir, "--dataset", data, f"data.chat_template={template}",
                             f"data.chat_template_kwargs.{key}=false") for key in ("enable_thinkng", "enable_thinking"))
    assert refused.exit_code == 2 and refused.stderr.strip().splitlines() == [f"error: {says}"]
    assert shown.exit_code == 0 and shown.stdout.startswith("--- sample 0"), shown.output
    from finetune.config import ConfigError
    from finetune.data.chat_template import check_template_kwargs
    check_template_kwargs(tok_with(ENABLE_THINKING), {"enable_thinking": False})
    with pytest.raises(ConfigError, match="never reads 'enable_thinking', so it would change nothing; fix"):
        check_template_kwargs(tok_with(QWEN3_LIKE_TEMPLATE), {"enable_thinking": False})  # reads no such switch
