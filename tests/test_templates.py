"""Labels exact as at inference for today's chat-template behaviours (our own templates that reproduce them): reasoning,
tool calls in several styles, templates that rewrite earlier turns, and the rows a template cannot hold."""

import json

import pytest

from _tokenizers import QWEN3_LIKE_TEMPLATE, build_tokenizer
from finetune.data import DataError, to_conversation
from finetune.data.label_hints import build_samples, tokenize_messages  # data's, with the not_prefix hint
from finetune.data.streaming import build_samples as build_streamed
from helpers import REPO, sft

# GPT-OSS style: channels; the final answer ends with <|return|> when it is the last message and <|end|> in history,
# where its analysis is dropped; a tool call ends with <|call|>, its analysis dropped once a final answer follows;
# reasoning is read from `thinking`.
HARMONY = (
    "{%- for m in messages %}{%- set ns = namespace(final=false) %}{%- for f in messages[loop.index:] %}"
    "{%- if f.role == 'assistant' and not f.tool_calls %}{%- set ns.final = true %}{%- endif %}{%- endfor %}"
    "{%- if m.role in ['system', 'user'] %}{{ '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' }}"
    "{%- elif m.role == 'tool' %}{{ '<|start|>functions.' + m.name + ' to=assistant<|channel|>commentary<|message|>'"
    " + m.content + '<|end|>' }}"
    "{%- elif m.tool_calls %}"
    "{%- if m.thinking and not ns.final %}{{ '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking +"
    " '<|end|>' }}{%- endif %}"
    "{%- set c = m.tool_calls[0].function %}{{ '<|start|>assistant to=functions.' + c.name +"
    " '<|channel|>commentary json<|message|>' + (c.arguments | tojson) + '<|call|>' }}"
    "{%- else %}"
    "{%- if loop.last and m.thinking %}{{ '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking +"
    " '<|end|>' }}{%- endif %}"
    "{{ '<|start|>assistant<|channel|>final<|message|>' + m.content + ('<|return|>' if loop.last else '<|end|>') }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{ '<|start|>assistant' }}{%- endif %}"
)
# DeepSeek style: calls delimited by special tokens, several control tokens before the end of turn.
SPECIAL_DELIMITED = (
    "{%- for m in messages %}{%- if m.role == 'user' %}{{ '<|User|>' + m.content }}"
    "{%- elif m.role == 'assistant' %}{{ '<|Assistant|>' + (m.content or '') }}"
    "{%- if m.tool_calls %}{{ '<|tool_calls_begin|>' }}{%- for c in m.tool_calls %}"
    "{{ '<|tool_call_begin|>' + c.function.name + '<|tool_sep|>' + (c.function.arguments | tojson) +"
    " '<|tool_call_end|>' }}{%- endfor %}{{ '<|tool_calls_end|>' }}{%- endif %}{{ '<|eos|>' }}"
    "{%- elif m.role == 'tool' %}{{ '<|tool_output_begin|>' + m.content + '<|tool_output_end|>' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{ '<|Assistant|>' }}{%- endif %}"
)
# LFM2 / Llama-3.2 pythonic style: a Python-call list before the content.
PYTHONIC = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.tool_calls %}{{ '<|tool_call_start|>[' }}{%- for c in m.tool_calls %}{{ c.function.name + '(' }}"
    "{%- for k, v in c.function.arguments.items() %}{{ k + '=' + (v | tojson) }}{{ ', ' if not loop.last }}"
    "{%- endfor %}{{ ')' }}{{ ', ' if not loop.last }}{%- endfor %}{{ ']<|tool_call_end|>' }}{%- endif %}"
    "{{ (m.content or '') + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Concatenates `arguments` as a string (an object would not concatenate).
CONCAT_ARGS = (
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{{ '<tool_call>{\"name\": \"' + c.function.name + '\", \"arguments\": ' +"
    " c.function.arguments + '}</tool_call>' }}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATML = ("{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
NO_TOOL_ROLE = "{%- for m in messages %}{%- if m.role == 'tool' %}{{ raise_exception('Only user and assistant " \
               "roles are supported') }}{%- endif %}{%- endfor %}" + CHATML
# Mistral v0.3 style: the system prompt goes into the last user turn; no generation prompt.
SYSTEM_IN_LAST_USER = (
    "{%- set sys = messages[0].content if messages and messages[0].role == 'system' else '' %}"
    "{%- set ns = namespace(last=-1) %}{%- for m in messages %}{%- if m.role == 'user' %}"
    "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}{{ '<s>' }}"
    "{%- for m in messages %}{%- if m.role == 'user' %}"
    "{{ '[INST] ' + (sys + '\\n\\n' if sys and loop.index0 == ns.last else '') + m.content + '[/INST]' }}"
    "{%- elif m.role == 'assistant' %}{{ m.content + '</s>' }}{%- endif %}{%- endfor %}"
)

# Llama 3.1 style: tools in the first user turn, a tool call written instead of the content.
LLAMA31_LIKE = (
    "{%- set ns = namespace(first=true) %}{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{ '[INST]' }}{%- if ns.first and tools %}{{ 'Tools: ' + (tools | tojson) + '\\n' }}"
    "{%- endif %}{%- set ns.first = false %}{{ m.content + '[/INST]' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{%- set c = m.tool_calls[0].function %}"
    "{{ '{\"name\": \"' + c.name + '\", \"parameters\": ' + (c.arguments | tojson) + '}</s>' }}"
    "{%- elif m.role == 'assistant' %}{{ m.content + '</s>' }}"
    "{%- elif m.role == 'tool' %}{{ '<|tool_output_begin|>' + m.content + '<|tool_output_end|>' }}{%- endif %}"
    "{%- endfor %}"
)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def tok_with(template=None):
    tok = build_tokenizer("qwen3")
    if template:
        tok.chat_template = template
    return tok


def call(name="get_weather", **args):
    return {"type": "function", "function": {"name": name, "arguments": args}}


def user(text):
    return {"role": "user", "content": text}


def assistant(content, reasoning=None, calls=None):
    m = {"role": "assistant", "content": content}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    if calls:
        m["tool_calls"] = calls
    return m


def tool(text, name="get_weather"):
    return {"role": "tool", "content": text, "name": name, "tool_call_id": "c1"}


def expected(tok, messages, tools, eot, answers=None, untrained=(), kwargs=None):
    """Independent renders: {i: (prompt_i, completion_i)}, completion_i cut after its last end-of-turn token;
    `answers` gives completion_i by hand where the rendering through turn i does not extend prompt_i; turns in
    `untrained` have none."""
    out, kwargs = {}, kwargs or {}
    for i, m in enumerate(messages):
        if m["role"] == "assistant" and m.get("train", True) and i not in untrained:
            prompt = tok.apply_chat_template(messages[:i], tools=tools, add_generation_prompt=True, tokenize=False,
                                             **kwargs)
            upto = tok.apply_chat_template(messages[: i + 1], tools=tools, tokenize=False, **kwargs)
            if i in (answers or {}):  # after prompt_i or at the end, when the rendering does not extend it
                assert upto.startswith(prompt + answers[i]) or upto.endswith(answers[i])
                out[i] = prompt, answers[i]
                continue
            assert upto.startswith(prompt)
            completion = upto[len(prompt):]
            out[i] = prompt, completion[: max(completion.rfind(e) + len(e) for e in eot if e in completion)]
    return out


def decode(tok, ids):
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def check(tok, messages, tools=None, eot=("<|im_end|>",), row=None, render_messages=None, answers=None,
          untrained=None, kwargs=None):
    """Label the row (`row` defaults to {messages, tools}); every trained run decodes to completion_i and all
    before it to prompt_i, as rendered here from `render_messages` (default: messages) with template `kwargs`;
    `untrained` {message index: reason}: the turns left untrained, and why. Returns the samples."""
    conv = to_conversation(row or {"messages": messages, "tools": tools}, "messages", "t.jsonl row 0")
    samples, reason, left_out = tokenize_messages(tok, conv.messages, 4096, "t.jsonl row 0", conv.tools,
                                                  "drop" if untrained else "error", kwargs)
    assert reason is None and {int(str(e).split(":")[0][8:]): e.reason for e in left_out} == (untrained or {})
    want = expected(tok, render_messages or messages, tools, eot, answers, untrained or {}, kwargs)
    got = {}
    for s in samples:
        ids, labels = s["input_ids"], s["labels"]
        runs, start = [], None
        for k, lab in enumerate(labels + [-100]):
            if lab != -100 and start is None:
                start = k
            elif lab == -100 and start is not None:
                runs.append((start, k))
                start = None
        assert len(runs) == len(s["turns"])
        for (a, b), i in zip(runs, s["turns"]):
            assert labels[a:b] == ids[a:b]
            got[i] = decode(tok, ids[:a]), decode(tok, ids[a:b])
        if s["split"]:  # a sample of its own ends where its turn ends
            assert runs[-1][1] == len(ids)
        else:  # the whole row's rendering, tokenized as the library does it
            ref = tok.apply_chat_template(render_messages or messages, tools=tools, tokenize=True,
                                          **(kwargs or {}))["input_ids"]
            assert ids == ref
    assert got == want
    return samples


def splits(samples):
    return [(s["turns"], s["split"]) for s in samples]


# ----------------------------------------------------------------------------- templates that rewrite turns


def test_empty_think_block_only_in_the_last_turn():
    tok = tok_with()
    messages = [user("Hi"), assistant("Hello!"), user("Weather in Paris?"), assistant("Sunny.")]
    samples = check(tok, messages)
    # The first answer is trained as the model writes it when it is the last turn (with the empty think block),
    # in a sample of its own; the full rendering keeps it without one, as context of the second.
    assert splits(samples) == [([1], "history"), ([3], "")]
    assert decode(tok, samples[0]["input_ids"]).endswith("assistant\n<think>\n\n</think>\n\nHello!<|im_end|>")
    assert "Hello!<|im_end|>\n<|im_start|>user" in decode(tok, samples[1]["input_ids"])


def test_reasoning_kept_only_after_the_last_user_query_with_tools():
    tok = tok_with()
    messages = [user("Hi"), assistant("Hello!", reasoning="Greet back."), user("Weather in Paris?"),
                assistant("", reasoning="Need the tool.", calls=[call(city="Paris")]), tool('{"temp": 21}'),
                assistant("Sunny, 21 degrees.", reasoning="Report it.")]
    samples = check(tok, messages, TOOLS)
    assert splits(samples) == [([1], "history"), ([3, 5], "")]
    text = decode(tok, samples[1]["input_ids"])
    assert "Greet back." not in text and "<think>\nNeed the tool.\n</think>" in text  # as inference renders history
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in text


def test_gpt_oss_channels_and_end_tokens():
    tok = tok_with(HARMONY)
    messages = [user("Hi"), assistant("Hello!", reasoning="Greet."), user("Weather?"),
                assistant(None, reasoning="Call it.", calls=[call(city="Paris")]), tool("21", "get_weather"),
                assistant("Sunny.", reasoning="Done.")]
    # The last answer: its context at inference still shows the tool call's analysis, which the rendering of the
    # whole row drops once the answer follows; so it is trained after prompt_i, in a sample of its own.
    answer = "<|channel|>analysis<|message|>Done.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>"
    samples = check(tok, messages, eot=("<|return|>", "<|call|>"), answers={5: answer})
    assert splits(samples) == [([1], "history"), ([3], "history"), ([5], "context")]
    assert "<|message|>Call it.<|end|>" in decode(tok, samples[2]["input_ids"])
    first = decode(tok, samples[0]["input_ids"])
    assert first.endswith("<|start|>assistant<|channel|>analysis<|message|>Greet.<|end|>"
                          "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>")
    trained = [decode(tok, [t for t, lab in zip(s["input_ids"], s["labels"]) if lab != -100]) for s in samples]
    assert trained[1].startswith("<|channel|>analysis<|message|>Call it.<|end|><|start|>assistant to=functions."
                                 'get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>')


def test_system_prompt_moved_into_the_last_user_turn():
    tok = tok_with(SYSTEM_IN_LAST_USER)
    messages = [{"role": "system", "content": "Be brief."}, user("Q1"), assistant("A1"), user("Q2"), assistant("A2")]
    samples = check(tok, messages, eot=("</s>",))
    assert splits(samples) == [([2], "context"), ([4], "")]
    assert decode(tok, samples[0]["input_ids"]) == "<s>[INST] Be brief.\n\nQ1[/INST]A1</s>"


# ----------------------------------------------------------------------------- tool-call styles


def test_tool_calls_delimited_by_special_tokens():
    tok = tok_with(SPECIAL_DELIMITED)
    messages = [user("Weather in Paris and Rome?"), assistant("", calls=[call(city="Paris"), call(city="Rome")]),
                tool("21"), tool("25"), assistant("Both sunny.")]
    samples = check(tok, messages, eot=("<|eos|>",))
    assert splits(samples) == [([1, 4], "")]
    trained = decode(tok, [t for t, lab in zip(samples[0]["input_ids"], samples[0]["labels"]) if lab != -100])
    # all control tokens through the end of turn, not just the first one after the arguments
    assert '{"city": "Rome"}<|tool_call_end|><|tool_calls_end|><|eos|>Both sunny.<|eos|>' in trained


def test_tool_calls_as_a_python_call_list():
    tok = tok_with(PYTHONIC)
    messages = [user("Weather?"), assistant(None, calls=[call(city="Paris", unit="celsius")]), tool("21"),
                assistant("Sunny.")]
    samples = check(tok, messages, eot=("<|im_end|>",))
    assert '[get_weather(city="Paris", unit="celsius")]<|tool_call_end|><|im_end|>' in decode(
        tok, samples[0]["input_ids"])


@pytest.mark.parametrize("as_string", [False, True])
def test_arguments_object_or_json_string_never_double_encoded(as_string):
    args = {"city": "Paris"}
    row_call = {"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps(args) if as_string else args}}
    row = {"messages": [user("Weather?"), {"role": "assistant", "content": None, "tool_calls": [row_call]},
                        tool("21"), assistant("Sunny.")]}
    # a template that `tojson`s the arguments gets an object, one that concatenates them gets a string
    for template, arguments in ((None, args), (CONCAT_ARGS, json.dumps(args))):
        tok = tok_with(template)
        rendered = [user("Weather?"), assistant(None, calls=[{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": arguments}}]), tool("21"), assistant("Sunny.")]
        samples = check(tok, row["messages"], row=row, render_messages=rendered)
        text = decode(tok, samples[0]["input_ids"])
        assert '"arguments": {"city": "Paris"}}' in text and '\\"' not in text


def test_tools_in_the_first_user_turn_and_a_call_instead_of_content():
    tok = tok_with(LLAMA31_LIKE)
    messages = [user("Weather?"), assistant("", calls=[call(city="Paris")]), tool("21"), assistant("Sunny.")]
    assert splits(check(tok, messages, TOOLS, eot=("</s>",))) == [([1, 3], "")]


def test_inline_think_in_content_is_left_as_the_row_has_it():
    tok = tok_with()  # the Qwen3-style template re-renders inline reasoning, and drops it from history
    messages = [user("Hi"), assistant("<think>Greet.</think>Hello!"), user("Bye"),
                assistant("<think>\nOk.\n</think>\n\nBye!")]
    samples = check(tok, messages)
    assert splits(samples) == [([1], "history"), ([3], "")]
    assert decode(tok, samples[0]["input_ids"]).endswith("<think>\nGreet.\n</think>\n\nHello!<|im_end|>")


def test_train_false_keeps_a_turn_as_context_only():
    tok = tok_with()
    messages = [user("Weather?"), dict(assistant("", calls=[call(city="Paris")]), train=False), tool("21"),
                assistant("Sunny.")]
    samples = check(tok, messages, TOOLS)
    assert splits(samples) == [([3], "")]


# ----------------------------------------------------------------------------- rows a template cannot hold


@pytest.mark.parametrize("template, messages, tools, reason, says", [
    (CHATML, [user("Weather?"), assistant("Let me call get_weather.", calls=[call(city="Paris")])], None,
     "drops_tool_calls", "message 1: the chat template drops its tool call 'get_weather'"),
    (CHATML, [user("Hi"), assistant("Hello", reasoning="Be kind.")], None,
     "drops_reasoning", "message 1: the chat template drops its reasoning"),
    (CHATML, [user("Hi"), assistant("Hello")], TOOLS,
     "drops_tools", "message 1: the chat template does not show the row's tools"),
    (LLAMA31_LIKE, [user("Weather?"), assistant("Let me look.", calls=[call(city="Paris")])], TOOLS,
     "drops_content", "message 1: the chat template drops (or rewrites) its content"),
    (NO_TOOL_ROLE, [user("Weather?"), assistant("", calls=[call(city="Paris")]), tool("21"), assistant("Sunny")],
     None, "template_error", "message 2: chat template failed (TemplateError: Only user and assistant roles are "
                             "supported)"),
])
def test_rows_the_template_cannot_hold(template, messages, tools, reason, says):
    tok = tok_with(template)
    conv = to_conversation({"messages": messages, "tools": tools}, "messages", "data/t.jsonl row 7")
    with pytest.raises(DataError) as err:
        tokenize_messages(tok, conv.messages, 4096, "data/t.jsonl row 7", conv.tools)
    what = "rows" if reason in ("drops_tools", "template_error") else "turns"
    assert str(err.value) == (f'data/t.jsonl row 7: {says} ({reason}); data.on_unsupported="drop" leaves such '
                              f'{what} untrained and trains the rest')
    samples, dropped, left_out = tokenize_messages(tok, conv.messages, 4096, "r", conv.tools, on_unsupported="drop")
    assert (samples, dropped) == ([], reason)
    assert [(str(e), e.reason) for e in left_out] == ([] if what == "rows" else [(says, reason)])


# ----------------------------------------------------------------------------- data shapes


def test_data_shapes_normalise_to_the_openai_shape():
    w = "f row 0"
    conv = to_conversation({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "reasoning": "Use the tool.",
         "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "a", "name": "f"},
        {"role": "assistant", "content": "Done.", "thinking": "Easy.", "train": False},
        {"role": "assistant", "function_call": {"name": "g", "arguments": {"y": 2}}, "content": ""}],
        "tools": json.dumps([{"name": "f", "parameters": {}}])}, "messages", w)
    assert conv.messages == [
        user("Weather?"),
        {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
         "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "a", "name": "f"},
        {"role": "assistant", "content": "Done.", "reasoning_content": "Easy.", "train": False},
        {"role": "assistant", "content": "", "tool_calls": [call("g", y=2)]}]
    assert conv.tools == [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    sharegpt = to_conversation({"conversations": [
        {"from": "human", "value": "Weather?"}, {"from": "function_call", "value": '{"name": "f", "arguments": {}}'},
        {"from": "observation", "value": "ok"}, {"from": "gpt", "value": "Done."}], "tools": None}, "sharegpt", w)
    assert sharegpt.messages == [user("Weather?"), {"role": "assistant", "content": None, "tool_calls": [call("f")]},
                                 {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "Done."}]
    for bad, says in (({"function": {"name": "f", "arguments": "{oops"}}, "message 1 tool call 0 arguments is not "
                                                                          "valid JSON"),
                      ({"function": {"arguments": {}}}, "message 1 tool call 0 has no function name")):
        with pytest.raises(DataError, match=f"^f row 0: {says}"):
            to_conversation({"messages": [user("q"), {"role": "assistant", "tool_calls": [bad]}]}, "messages", w)


# ----------------------------------------------------------------------------- whole files


EXAMPLE = REPO / "examples" / "data" / "tools_reasoning.jsonl"


def test_example_file_order_counts_workers_and_streaming():
    tok = tok_with()
    s = build_samples(str(EXAMPLE), tok, shuffle=False, epoch_limit=1, max_seq_len=1024)
    samples = list(s)
    assert s.counts["rows"] == len(EXAMPLE.read_text().splitlines()) == s.counts["kept"]
    assert s.counts["samples"] == len(samples) > s.counts["rows"]  # earlier turns rendered differently, split out
    assert s.counts["turns_split_history"] > 0
    rows = [src["row"] for x in samples for src in x["sources"]]
    assert rows == sorted(rows)  # a row's samples follow each other, in row order
    key = [(x["input_ids"], x["labels"]) for x in samples]
    two = build_samples(str(EXAMPLE), tok, shuffle=False, epoch_limit=1, max_seq_len=1024, num_proc=2)
    assert [(x["input_ids"], x["labels"]) for x in two] == key and two.counts == s.counts
    streamed = build_streamed(str(EXAMPLE), tok, epoch_limit=1, max_seq_len=1024)
    assert [(x["input_ids"], x["labels"]) for x in streamed] == key and streamed.counts == s.counts


def test_a_rows_samples_do_not_depend_on_the_rows_before_it():
    """The tokens reused from a row's first sample (labels._tokens' base) are those of the text it shares, also in a
    row whose every turn is split out (its first sample is not the row's whole rendering)."""
    from finetune.data.template import _TEMPLATES
    tok = tok_with()
    got = [(x["input_ids"], x["labels"]) for x in build_samples(str(EXAMPLE), tok, shuffle=False, epoch_limit=1,
                                                                   max_seq_len=1024)]
    alone = []
    for k, line in enumerate(EXAMPLE.read_text().splitlines()):
        _TEMPLATES.pop(tok, None)  # what the template learned from the rows before does not count
        conv = to_conversation(json.loads(line), "messages", f"row {k}")
        alone += [(x["input_ids"], x["labels"]) for x in tokenize_messages(tok, conv.messages, 1024, f"row {k}",
                                                                            conv.tools).samples]
    assert got == alone


def test_unsupported_rows_dropped_and_counted(tmp_path):
    rows = [json.loads(line) for line in EXAMPLE.read_text().splitlines()]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = tok_with(CHATML)  # no tools, no reasoning: every example row carries something it would drop
    with pytest.raises(DataError, match=rf"^{path}:1: message \d+: the chat template"):
        build_samples(str(path), tok)
    plain = {"messages": [user("Hi"), assistant("Hello")]}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [plain]))
    s = build_samples(str(path), tok, on_unsupported="drop")
    assert s.counts["rows"] == len(rows) + 1 and s.counts["kept"] == 1 and s.num_samples == 1
    assert sum(v for k, v in s.counts.items() if k.startswith("dropped_drops_")) == len(rows)


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    from conftest import make_model_dir
    return make_model_dir(tmp_path_factory.mktemp("qwen3"), "qwen3", "qwen2", tied=True, num_layers=2)


def test_sft_and_preview_with_a_qwen3_style_template(qwen3_model, tmp_path):
    records = sft(qwen3_model, EXAMPLE, tmp_path / "run", "train.max_steps=4", "train.micro_batch_size=2",
                  "data.max_seq_len=512", f"eval.path={EXAMPLE}", "eval.num_samples=4", "eval.max_new_tokens=4")
    assert len(records) == 4 and all(r["loss"] > 0 for r in records)
    held_out = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert held_out["after"]["num_samples"] == 4 and held_out["after"]["loss"] > 0
    from typer.testing import CliRunner

    from finetune.cli import app
    shown = CliRunner().invoke(app, ["preview-data", "--model", str(qwen3_model), "--dataset", str(EXAMPLE),
                                     "--num", "3", "data.max_seq_len=1024"])
    assert shown.exit_code == 0, shown.output
    own = "(own sample: the full conversation renders this turn differently)"
    assert f"--- sample 0: row 0 turns 2 {own}" in shown.stdout
    assert "turns split history" in shown.stdout.splitlines()[-1]


def test_cli_refusal_is_one_line_naming_row_and_reason(qwen_tied_dir):
    from typer.testing import CliRunner

    from finetune.cli import app
    result = CliRunner().invoke(app, ["preview-data", "--model", str(qwen_tied_dir), "--dataset", str(EXAMPLE)])
    assert result.exit_code == 2 and result.stdout == ""
    last = result.stderr.splitlines()[-1]  # (above it: the progress bar the CLI turns off outside tests)
    assert last == (f"error: {EXAMPLE}:1: message 8: chat template failed (UndefinedError: 'dict object' has no "
                    "attribute 'content') (template_error); data.on_unsupported=\"drop\" leaves such rows untrained "
                    "and trains the rest")


# ----------------------------------------------------------------------------- found by probing real families

# Mistral v0.3 as shipped: the system prompt shows only in a user turn that is the last message, and there is no
# generation prompt: every turn of a row with a system prompt is trained in its own sample, after its prompt_i.
SYSTEM_WHEN_USER_IS_LAST = (
    "{{ '<s>' }}{%- for m in messages %}{%- if m.role == 'user' %}{{ '[INST] ' + (messages[0].content + '\\n\\n'"
    " if messages[0].role == 'system' and loop.last else '') + m.content + '[/INST]' }}"
    "{%- elif m.role == 'assistant' %}{{ ' ' + m.content + '</s>' }}{%- endif %}{%- endfor %}"
)
# GLM-4.5 style: no end-of-turn token; the next role's token (an eos id of the model) ends a turn.
NEXT_ROLE_ENDS_TURN = (
    "{%- for m in messages %}{%- if m.role == 'user' %}{{ '<|User|>\\n' + m.content }}"
    "{%- elif m.role == 'assistant' %}{{ '<|Assistant|>\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{{ '<tool_call>' + c.function.name + ' ' + (c.function.arguments | tojson)"
    " + '</tool_call>' }}{%- endfor %}"
    "{%- elif m.role == 'tool' %}{{ '<|tool_output_begin|>\\n' + m.content }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|Assistant|>' }}{%- endif %}"
)
# A template dict whose "tool_use" template prints `arguments` as given (the OpenAI JSON string).
RAW_ARGS_TOOL_USE = (
    "{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}"
    "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
    "{%- for c in m.tool_calls or [] %}{{ '<tool_call>{\"name\": \"' + c.function.name + '\", \"arguments\": ' }}"
    "{{ c.function.arguments }}{{ '}</tool_call>' }}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_system_prompt_only_when_the_user_turn_is_last_and_no_generation_prompt():
    tok = tok_with(SYSTEM_WHEN_USER_IS_LAST)
    messages = [{"role": "system", "content": "Be brief."}, user("Q1"), assistant("A1"), user("Q2"), assistant("A2")]
    samples = check(tok, messages, eot=("</s>",), answers={2: " A1</s>", 4: " A2</s>"})
    assert splits(samples) == [([2], "context"), ([4], "context")]
    assert decode(tok, samples[1]["input_ids"]) == "<s>[INST] Q1[/INST] A1</s>[INST] Be brief.\n\nQ2[/INST] A2</s>"


def test_the_next_roles_token_is_trained_where_the_template_writes_no_end_of_turn():
    tok = tok_with(NEXT_ROLE_ENDS_TURN)
    messages = [user("Weather?"), assistant("", calls=[call(city="Paris")]), tool("21"), assistant("Sunny.")]
    conv = to_conversation({"messages": messages}, "messages", "t.jsonl row 0")
    samples, reason, _ = tokenize_messages(tok, conv.messages, 4096, "t.jsonl row 0", conv.tools)
    assert reason is None and splits(samples) == [([1, 3], "")]
    ids, labels = samples[0]["input_ids"], samples[0]["labels"]
    runs = [k for k, lab in enumerate(labels) if lab != -100]
    starts = [k for k in runs if k - 1 not in runs]
    trained = [decode(tok, [ids[k] for k in runs if k >= a and (b is None or k < b)])
               for a, b in zip(starts, starts[1:] + [None])]
    assert trained == ['\n<tool_call>get_weather {"city": "Paris"}</tool_call><|tool_output_begin|>',
                       "\nSunny.<|User|>"]
    for i, a in zip((1, 3), starts):  # the context of each turn is its prompt_i
        assert decode(tok, ids[:a]) == tok.apply_chat_template(messages[:i], add_generation_prompt=True,
                                                                tokenize=False)


def test_arguments_as_the_tool_use_template_wants_them():
    tok = tok_with()
    tok.chat_template = {"default": CHATML, "tool_use": RAW_ARGS_TOOL_USE}
    as_string = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [user("Weather?"), assistant("", calls=[as_string]), tool("21"), assistant("Sunny.")]
    samples = check(tok, messages, tools=TOOLS)
    trained = decode(tok, [t for t, lab in zip(samples[0]["input_ids"], samples[0]["labels"]) if lab != -100])
    assert '"arguments": {"city": "Paris"}}</tool_call>' in trained and "{'city'" not in trained


# ----------------------------------------------------------------------------- one turn left untrained, the rest kept

# DeepSeek-R1 / thinking-model style: the generation prompt opens <think>; an answer without reasoning is rendered
# without it, so it cannot be trained after that prompt (not_prefix). Tool results as user turns.
THINK_OPEN = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content %}{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{ m.content or '' }}{%- for c in m.tool_calls or [] %}{{ '<tool_call>' + c.function.name + ' ' +"
    " (c.function.arguments | tojson) + '</tool_call>' }}{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content +"
    " '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
# One assistant block kept across a tool result: the block closes only before a user turn or at the end, so a
# final answer after a tool result continues the block its tool call opened, where the generation prompt after a
# tool result (the last message) opens a new one.
ONE_BLOCK = (
    "{%- for m in messages %}{%- set prev = messages[loop.index0 - 1].role if not loop.first else '' %}"
    "{%- set next = messages[loop.index0 + 1].role if not loop.last else '' %}"
    "{%- if m.role == 'user' %}{{ '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}{%- if prev != 'tool' %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
    "{{ m.content or '' }}{%- for c in m.tool_calls or [] %}{{ '<tool_call>' + c.function.name + ' ' +"
    " (c.function.arguments | tojson) + '</tool_call>' }}{%- endfor %}"
    "{%- if next != 'tool' %}{{ '<|im_end|>\\n' }}{%- else %}{{ '\\n' }}{%- endif %}"
    "{%- elif m.role == 'tool' %}{{ '<tool_response>\\n' + m.content + '\\n</tool_response>\\n' }}"
    "{%- if loop.last %}{{ '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# The generation prompt opens <think>; each tool call is a block of its own after the message's think block, so a
# call without reasoning is not written after the opened <think> (not_prefix), one with reasoning is.
CALL_BLOCK_AFTER_THINK = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}"
    "{%- if m.reasoning_content or m.content %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content %}{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{ (m.content or '') + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for c in m.tool_calls or [] %}{{ '<|im_start|>assistant\\n<tool_call>' + c.function.name + ' ' +"
    " (c.function.arguments | tojson) + '</tool_call><|im_end|>\\n' }}{%- endfor %}"
    "{%- elif m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m.content +"
    " '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
THINK_OPEN_ROW = [user("Weather in Paris?"), assistant("", "Use the tool.", [call(city="Paris")]), tool("21"),
                  assistant("Sunny, 21 degrees."), user("Thanks!"), assistant("Bye!", "Say goodbye.")]


@pytest.mark.parametrize("template, messages, untrained, samples_of, answers", [
    (THINK_OPEN, THINK_OPEN_ROW, {3: "not_prefix"}, [([1, 5], "")], None),
    # the same question twice: the earlier turn that answers it is never taken for the later turn's place
    (THINK_OPEN, [user("Continue"), assistant("A1", "R1"), user("Continue"), assistant("A2")], {3: "not_prefix"},
     [([1], "")], None),
    # the call's turn ends where the block goes on with the tool result (after </tool_call>)
    (ONE_BLOCK, [user("Weather?"), assistant("", calls=[call(city="Paris")]), tool("21"), assistant("Sunny, 21."),
                 user("Thanks!"), assistant("Bye!")], {3: "not_prefix"}, [([1, 5], "")],
     {1: '<tool_call>get_weather {"city": "Paris"}</tool_call>'}),
    (CALL_BLOCK_AFTER_THINK, [user("Weather?"), assistant(None, calls=[call(city="Paris")]), tool("21"),
                              assistant("Sunny.", "It is warm."), user("Rome?"),
                              assistant(None, "Rome too.", [call(city="Rome")])], {1: "not_prefix"},
     [([3, 5], "")], None),
])
def test_a_turn_the_template_cannot_train_is_left_out_and_the_others_trained(template, messages, untrained,
                                                                             samples_of, answers):
    tok = tok_with(template)
    samples = check(tok, messages, untrained=untrained, answers=answers)
    assert splits(samples) == samples_of
    whole = decode(tok, samples[-1]["input_ids"])
    for i in untrained:  # left untrained, but still context as rendered, ahead of later trained turns
        text = messages[i]["content"] or messages[i]["tool_calls"][0]["function"]["name"]
        assert text in whole or text in decode(tok, samples[0]["input_ids"])
    with pytest.raises(DataError, match=rf"^t.jsonl row 0: message {min(untrained)}: the chat template renders it "
                                        rf"differently .* \(not_prefix\); data.on_unsupported=\"drop\" leaves such "
                                        rf"turns untrained and trains the rest$"):
        check(tok, messages)


def test_turns_left_out_are_counted_per_turn_and_per_row(tmp_path):
    rows = [{"messages": THINK_OPEN_ROW}] * 3 + [
        {"messages": [user("Hi"), assistant("Hello"), user("Ok"), assistant("Fine")]},  # nothing trainable: dropped
        {"messages": [user("Hi"), assistant("Hello", "Greet.")]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = tok_with(THINK_OPEN)
    with pytest.raises(DataError, match=rf"^{path}:1: message 3: .*\(not_prefix\); data.on_unsupported=\"drop\""):
        build_samples(str(path), tok)
    s = build_samples(str(path), tok, on_unsupported="drop", shuffle=False, epoch_limit=1)
    samples = list(s)
    assert s.counts == {"rows": 5, "kept": 4, "samples": 4, "turns_trained": 7, "dropped_no_assistant": 0,
                        "dropped_no_labels_after_truncation": 0, "turns_unsupported_not_prefix": 5,
                        "rows_unsupported_not_prefix": 4, "dropped_not_prefix": 1}
    assert samples[0]["sources"] == [{"row": 0, "turns": [1, 5], "split": "", "left_out": [
        "not_prefix message 3: the chat template renders it differently from its generation prompt, so there is no "
        "answer to train; its generation prompt opens a thinking block, this turn has no reasoning, and the template "
        "reads no switch (such as enable_thinking) that turns thinking off: give the turn reasoning_content"],
        "source": 0}]
    from finetune.data import describe_counts
    assert "turns left untrained not_prefix 5 (in 4 rows)" in describe_counts(s.counts)


# Qwen3-style enable_thinking: with enable_thinking=false the generation prompt holds an empty think block, which
# the template otherwise writes as part of the last turn's answer.
ENABLE_THINKING = QWEN3_LIKE_TEMPLATE.replace(
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}",
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- if enable_thinking is defined and not "
    "enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}")


def test_template_kwargs_change_what_is_rendered_and_trained():
    tok = tok_with(ENABLE_THINKING)
    assert ENABLE_THINKING != QWEN3_LIKE_TEMPLATE
    messages = [user("Weather?"), assistant("Sunny.")]
    trained = {}
    for kwargs in (None, {"enable_thinking": False}):
        samples = check(tok, messages, kwargs=kwargs)
        ids, labels = samples[0]["input_ids"], samples[0]["labels"]
        trained[bool(kwargs)] = decode(tok, [t for t, lab in zip(ids, labels) if lab != -100])
        context = decode(tok, ids[:next(k for k, lab in enumerate(labels) if lab != -100)])
        assert context.endswith("assistant\n<think>\n\n</think>\n\n" if kwargs else "assistant\n")
    assert trained == {False: "<think>\n\n</think>\n\nSunny.<|im_end|>", True: "Sunny.<|im_end|>"}
    from finetune.tasks.evaluate import prompt_text
    assert prompt_text(tok, messages[:1], None, {"enable_thinking": False}).endswith("<think>\n\n</think>\n\n")


def test_preview_shows_the_turn_left_untrained_and_why(qwen3_model, tmp_path):
    from helpers import invoke
    template = tmp_path / "think_open.jinja"
    template.write_text(THINK_OPEN)
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"messages": THINK_OPEN_ROW}) + "\n")
    shown = invoke("preview-data", "--model", qwen3_model, "--dataset", data, "--num", "1",
                   f"data.chat_template={template}", "data.on_unsupported=drop", "data.max_seq_len=1024")
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    assert lines[0] == "--- sample 0: row 0 turns 1,5"
    assert lines[1] == ("    left untrained: message 3: the chat template renders it differently from its generation "
                        "prompt, so there is no answer to train; its generation prompt opens a thinking block, this "
                        "turn has no reasoning, and the template reads no switch (such as enable_thinking) that turns "
                        "thinking off: give the turn reasoning_content (not_prefix)")
    assert "[[Use the tool.\n</think>\n\n<tool_call>get_weather" in shown.stdout  # trained, as rendered
    assert "Sunny, 21 degrees.<|im_end|>\n<|im_start|>user" in shown.stdout  # context, not trained
    assert "[[Sunny" not in shown.stdout
    assert "turns left untrained not_prefix 1 (in 1 rows)" in lines[-1]


def test_a_chat_template_of_our_own_is_saved_with_the_run_and_exported(qwen3_model, chat_file, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from finetune.checkpoint import read_marker
    from helpers import export_hf
    from helpers import invoke, sft
    base = tmp_path / "base"  # a base model: its tokenizer has no chat template
    shutil.copytree(qwen3_model, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    refused = invoke("preview-data", "--model", base, "--dataset", chat_file)
    assert refused.exit_code == 2 and refused.stderr.splitlines()[-1] == (
        f"error: {chat_file}: the tokenizer has no chat template; set data.chat_template to a Jinja file (or a "
        f"tokenizer dir with one), or use a chat/instruct model's tokenizer")
    template = tmp_path / "chat.jinja"
    template.write_text(CHATML)
    out = tmp_path / "run"
    sft(base, chat_file, out, "train.max_steps=2", f"data.chat_template={template}")
    template.write_text("{{ raise_exception('the file changed since') }}")
    sft(base, chat_file, out, "train.max_steps=3", f"data.chat_template={template}")  # resumes with the saved text
    assert read_marker(out / "checkpoints" / "step-3")["chat_template"] == CHATML
    template.unlink()
    export_hf(str(out), str(tmp_path / "hf"), verify=False)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template == CHATML  # inference renders as training did
    assert not AutoTokenizer.from_pretrained(base).chat_template
