"""Templates and inputs of shapes not covered elsewhere (issue 31): a template that needs tools, one whose tool
messages need a tool_call_id, thinking templates without reasoning in the data, content parts, and bad template
files, data files and template kwargs refused in one line."""

import json

import pytest
from tokenizers import AddedToken

from finetune.config import ConfigError, load_config
from finetune.data import DataError, open_sources, to_conversation
from finetune.data.chat_template import read_chat_template
from finetune.data.label_hints import build_samples, tokenize_messages  # data's, with the not_prefix hint
from finetune.data.streaming import open_streamed
from test_templates import CHATML, TOOLS, assistant, call, check, decode, tok_with, tool, user

# A tool-use template that requires the tool list (raises on a conversation without tools).
NEEDS_TOOLS = ("{%- if not tools %}{{ raise_exception('This template needs tools') }}{%- endif %}"
               "{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}"
               "{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') }}"
               "{%- for c in m.tool_calls or [] %}{{ '<tool_call>' + c.function.name + ' ' +"
               " (c.function.arguments | tojson) + '</tool_call>' }}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endfor %}"
               "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
# Each call closed by <|tool_call_end|>, the calls by a <|calls|> stop token (no <|im_end|>); tool results need the
# id of the call they answer.
CALLS_STOP = (
    "{%- if tools %}{{ '<|im_start|>system\\nTools: ' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}{%- if not m.tool_call_id %}"
    "{{ raise_exception('a tool message needs its tool_call_id') }}{%- endif %}"
    "{{ '<|im_start|>tool ' + m.tool_call_id + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{{ '<|im_start|>assistant\\n' }}{%- for c in m.tool_calls %}"
    "{{ '<|tool_call_begin|>' + c.function.name + ':' + (c.function.arguments | tojson) + '<|tool_call_end|>' }}"
    "{%- endfor %}{{ '<|calls|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
# The generation prompt opens a think block unless the template's switch (`name`) is false; an answer without
# reasoning is written without one.
THINKING = (
    "{%- for m in messages %}{%- if m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if m.reasoning_content %}{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{ m.content + '<|im_end|>\\n' }}{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if NAME is not defined or NAME %}{{ '<think>\\n' }}{%- endif %}{%- endif %}")
# Reads content as a list of parts (indexes them).
PARTS = ("{%- for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}{%- for p in m.content %}"
         "{%- if p.type == 'text' %}{{ p.text }}{%- endif %}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endfor %}"
         "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def label(tok, messages, tools=None, on_unsupported="error", kwargs=None):
    conv = to_conversation({"messages": messages, "tools": tools}, "messages", "t.jsonl:1")
    return tokenize_messages(tok, conv.messages, 4096, "t.jsonl:1", conv.tools, on_unsupported, kwargs)


def trained(tok, sample):
    return decode(tok, [t for t, lab in zip(sample["input_ids"], sample["labels"]) if lab != -100])


# ----------------------------------------------------------------------------- item 1: a template that needs tools


def test_a_template_that_needs_tools_trains_rows_with_tools_and_refuses_rows_without():
    tok = tok_with(NEEDS_TOOLS)
    messages = [user("Weather?"), assistant("", calls=[call(city="Paris")]), tool("21"), assistant("Sunny.")]
    samples = check(tok, messages, TOOLS)  # every turn trained, exactly as rendered with the row's tools
    assert [s["turns"] for s in samples] == [[1, 3]]
    with pytest.raises(DataError) as e:
        label(tok, [user("Hi"), assistant("Hello")])
    assert str(e.value) == ("t.jsonl:1: message 0: chat template failed (TemplateError: This template needs tools) "
                            '(template_error); data.on_unsupported="drop" leaves such rows untrained and trains the '
                            "rest")
    assert label(tok, [user("Hi"), assistant("Hello")], on_unsupported="drop").dropped == "template_error"


# ----------------------------------------------------------------------------- item 2: probes carry ids and names


def calls_tok():
    tok = tok_with(CALLS_STOP)
    tok.add_tokens([AddedToken("<|calls|>", special=True, normalized=False)])
    return tok


def test_a_tool_call_turn_keeps_its_stop_token_when_tool_results_need_ids():
    tok = calls_tok()
    messages = [user("Weather?"), assistant("", calls=[{**call(city="Paris"), "id": "c1"}]), tool("21"),
                assistant("Sunny.")]
    samples = check(tok, messages, TOOLS, eot=("<|calls|>", "<|im_end|>"))
    assert trained(tok, samples[0]) == ('<|tool_call_begin|>get_weather:{"city": "Paris"}<|tool_call_end|><|calls|>'
                                        'Sunny.<|im_end|>')
    # the call's turn last in the row: the probe takes the id from the call itself
    tok = calls_tok()  # (a fresh template: nothing learned from the row above)
    samples = check(tok, messages[:2], TOOLS, eot=("<|calls|>",))
    assert trained(tok, samples[0]).endswith("<|tool_call_end|><|calls|>")


def test_a_turn_whose_probe_cannot_render_is_refused_not_cut_by_a_guess():
    tok = calls_tok()
    messages = [user("Weather?"), assistant("", calls=[call(city="Paris")])]  # no id anywhere in the row
    with pytest.raises(DataError) as e:
        label(tok, messages, TOOLS)
    assert str(e.value) == (
        "t.jsonl:1: message 1: the chat template cannot render the probe of what follows this turn, which finds where "
        "it ends (TemplateError: a tool message needs its tool_call_id) (probe_error); data.on_unsupported=\"drop\" "
        "leaves such turns untrained and trains the rest")
    got = label(tok, messages, TOOLS, on_unsupported="drop")
    assert got.samples == [] and got.dropped == "probe_error"


# ----------------------------------------------------------------------------- item 3: not_prefix with a way out


@pytest.mark.parametrize("switch", ["enable_thinking", "thinking"])
def test_not_prefix_on_a_thinking_prompt_names_the_templates_switch(tmp_path, switch):
    tok = tok_with(THINKING.replace("NAME", switch))
    messages = [user("Hi"), assistant("Hello")]
    hint = (f"; data.chat_template_kwargs.{switch}=false renders the generation prompt without it, which makes such "
            f"turns trainable")
    with pytest.raises(DataError) as e:
        label(tok, messages)
    assert str(e.value).startswith("t.jsonl:1: message 1: the chat template renders it differently from its "
                                   f"generation prompt, so there is no answer to train{hint} (not_prefix)")
    # what preview-data shows for a turn left untrained
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"messages": [user("Hi"), assistant("Yes", "Think."), user("Ok"), assistant("Bye")]})
                    + "\n")
    sample, = build_samples(str(path), tok, on_unsupported="drop", shuffle=False, epoch_limit=1)
    assert sample["sources"][0]["left_out"][0].endswith(hint)
    check(tok, messages, kwargs={switch: False})  # and the hint holds: with the switch off the turn trains


# ----------------------------------------------------------------------------- item 4: content parts


def test_text_parts_reach_a_template_that_reads_parts():
    tok = tok_with(PARTS)
    parts = [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Paris?"}]
    messages = [{"role": "user", "content": parts},
                {"role": "assistant", "content": [{"type": "text", "text": "Sunny."}]}]
    samples = check(tok, messages)
    assert trained(tok, samples[0]) == "Sunny.<|im_end|>"
    assert "Weather in Paris?" in decode(tok, samples[0]["input_ids"])


def test_parts_are_text_for_a_template_that_prints_content_as_a_string():
    tok = tok_with(CHATML)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}, assistant("Hello")]
    sample, = label(tok, messages).samples
    assert decode(tok, sample["input_ids"]) == ("<|im_start|>user\nHi<|im_end|>\n"
                                                "<|im_start|>assistant\nHello<|im_end|>\n")


def test_a_part_other_than_text_is_refused_naming_its_type():
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                      {"type": "image_url", "image_url": {"url": "x.png"}}]},
                        assistant("A cat.")]}
    with pytest.raises(DataError) as e:
        to_conversation(row, "messages", "t.jsonl:3")
    assert str(e.value) == ("t.jsonl:3: message 0 content part 1 is of type 'image_url'; only text parts "
                            '({"type": "text", "text": ...}) can be trained')


# ----------------------------------------------------------------------------- items 11, 15: data.chat_template files


def test_an_empty_chat_template_file_is_refused(tmp_path):
    path = tmp_path / "empty.jinja"
    path.write_text("\n")
    with pytest.raises(DataError) as e:
        read_chat_template(str(path))
    assert str(e.value) == (f"data.chat_template: {path} is empty; give a Jinja chat template (or unset the key to "
                            f"use the model's own)")


def test_a_jinja_syntax_error_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jinja"
    path.write_text("{%- for m in messages %}\n{{ m.content + }}\n{%- endfor %}\n")
    with pytest.raises(DataError) as e:
        read_chat_template(str(path))
    assert str(e.value).startswith(f"data.chat_template: {path} line 2: Jinja syntax error (")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text, expect", [("", "is empty"), ("{{ 'a' }}\n{% if x %}", "line 2: Jinja syntax error")])
def test_preview_data_refuses_a_bad_template_file_in_one_line(tmp_path, llama_dir, text, expect):
    from typer.testing import CliRunner

    from finetune.cli import app
    template, data = tmp_path / "t.jinja", tmp_path / "d.jsonl"
    template.write_text(text)
    data.write_text(json.dumps({"messages": [user("Hi"), assistant("Hello")]}) + "\n")
    result = CliRunner().invoke(app, ["preview-data", "--model", str(llama_dir), "--dataset", str(data),
                                      f"data.chat_template={template}"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: data.chat_template: {template} {expect}"), result.output


# ----------------------------------------------------------------------------- item 17: empty data files


@pytest.mark.parametrize("streaming", [False, True])
def test_an_empty_data_file_is_named_also_in_a_mixture(tmp_path, streaming):
    empty, good = tmp_path / "empty.jsonl", tmp_path / "good.jsonl"
    empty.write_text("\n")
    good.write_text(json.dumps({"messages": [user("Hi"), assistant("Hello")]}) + "\n")
    with pytest.raises(DataError, match=rf"^{empty}: has no rows \(the file is empty\)$"):
        (open_streamed if streaming else open_sources)(str(empty))
    if not streaming:  # (a mixture does not stream)
        with pytest.raises(DataError, match=rf"^{empty}: has no rows \(the file is empty\)$"):
            open_sources([{"path": str(good), "weight": 1}, {"path": str(empty), "weight": 1}])
    folder = tmp_path / "dir"
    folder.mkdir()
    (folder / "train.jsonl").write_text("")
    with pytest.raises(DataError, match=rf"^{folder}: split 'train' has no rows \(its files are empty: "):
        (open_streamed if streaming else open_sources)(str(folder))


def test_an_empty_parquet_file_is_named(tmp_path):
    import datasets
    path = tmp_path / "empty.parquet"
    datasets.Dataset.from_dict({"messages": []}).to_parquet(str(path))
    with pytest.raises(DataError, match=rf"^{path}: has no rows"):
        open_sources(str(path))


# ----------------------------------------------------------------------------- item 19: reserved template kwargs


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "tools", "documents", "tokenize"])
def test_a_name_apply_chat_template_sets_itself_is_refused_as_a_template_kwarg(key):
    with pytest.raises(ConfigError) as e:
        load_config(None, {"data.chat_template_kwargs": {key: False}})
    assert str(e.value) == (f"data.chat_template_kwargs.{key}: apply_chat_template sets {key!r} itself (from each "
                            f"row and the labelling); remove the key")
    assert load_config(None, {"data.chat_template_kwargs": {"enable_thinking": False}})
