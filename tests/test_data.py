"""Tests for finetune.data: exact assistant-only labels, loading, formats, stream order, packing, collate."""

import itertools
import json

import datasets

import pytest
import torch

from finetune.data import (
    DataError,
    detect_format,
    load_rows,
    pad_collate,
    row_of,
    to_conversation,
    tokenize_messages,
)
from finetune.data.mixture import build_samples  # data.build_samples, with data.sources mixtures
from finetune.tools.preview import format_preview
from finetune.data.streaming import build_samples as build_streamed, load_streamed

try:
    from tests._tokenizers import build_tokenizer
except ImportError:
    from _tokenizers import build_tokenizer

FAMILIES = ["llama3", "chatml", "chatml_default_system"]
EOT = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>", "chatml_default_system": "<|im_end|>"}
CODE = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```"


def trained_spans(tok, sample):
    """Decoded text of each run of labelled positions; also checks labels == input_ids where trained."""
    ids, labels = sample["input_ids"], sample["labels"]
    assert len(ids) == len(labels)
    spans, run = [], []
    for i, lab in zip(ids, labels):
        if lab != -100:
            assert lab == i
            run.append(i)
        elif run:
            spans.append(run)
            run = []
    if run:
        spans.append(run)
    return [tok.decode(s, skip_special_tokens=False, clean_up_tokenization_spaces=False) for s in spans]


def tokenize_ok(tok, messages, max_seq_len=4096):
    samples, reason, left_out = tokenize_messages(tok, messages, max_seq_len, "test row 0")
    assert reason is None and not left_out, reason
    assert len(samples) == 1 and not samples[0]["split"]  # these templates keep every turn in one sample
    sample = samples[0]
    # Training sees what inference sees.
    ref = tok.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert sample["input_ids"] == ref[:max_seq_len]
    return sample


def msg(role, content):
    return {"role": role, "content": content}


def to_messages(row, fmt, where):
    return to_conversation(row, fmt, where).messages


def rows_of(path, streaming=False, **kw):
    """The rows load_rows (streaming: data/streaming.py's load_streamed) reads, decoded as the trainer decodes them."""
    load = load_streamed if streaming else load_rows
    return [row_of(item, path, i)[0] for i, item in enumerate(load(str(path), **kw).data)]


# ----------------------------------------------------------------------------- labels


@pytest.mark.parametrize("family", FAMILIES)
def test_multi_turn_with_system(family):
    tok, eot = build_tokenizer(family), EOT[family]
    messages = [msg("system", "You are terse."), msg("user", "What is 2 + 2?"), msg("assistant", "4"),
                msg("user", "What is the capital of France?"), msg("assistant", "Paris")]
    sample = tokenize_ok(tok, messages)
    assert trained_spans(tok, sample) == ["4" + eot, "Paris" + eot]
    text = tok.decode(sample["input_ids"], clean_up_tokenization_spaces=False)
    assert "You are a helpful assistant." not in text  # an explicit system prompt replaces the default


@pytest.mark.parametrize("family", FAMILIES)
def test_unicode_emoji_and_code(family):
    tok, eot = build_tokenizer(family), EOT[family]
    messages = [msg("user", "Écris du code 🚀 日本語"), msg("assistant", "Voilà 😀👍🏽 ça marche — “ok” 中文"),
                msg("user", "Now python please."), msg("assistant", CODE)]
    sample = tokenize_ok(tok, messages)
    assert trained_spans(tok, sample) == ["Voilà 😀👍🏽 ça marche — “ok” 中文" + eot, CODE + eot]


def test_template_inserted_default_system_prompt_is_not_trained():
    tok = build_tokenizer("chatml_default_system")
    sample = tokenize_ok(tok, [msg("user", "Hi"), msg("assistant", "Hello there!")])
    text = tok.decode(sample["input_ids"], clean_up_tokenization_spaces=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert trained_spans(tok, sample) == ["Hello there!<|im_end|>"]  # not the '\n' after <|im_end|>


def test_whitespace_follows_the_template():
    # llama3 trims content in the template, chatml keeps it; labels follow the rendered text.
    messages = [msg("user", "Hi"), msg("assistant", "  spaced out \n")]
    assert trained_spans(build_tokenizer("llama3"), tokenize_ok(build_tokenizer("llama3"), messages)) == [
        "spaced out<|eot_id|>"]
    chatml = build_tokenizer("chatml")
    assert trained_spans(chatml, tokenize_ok(chatml, messages)) == ["  spaced out \n<|im_end|>"]


@pytest.mark.parametrize("family", FAMILIES)
def test_conversation_ending_with_user_keeps_earlier_labels(family):
    tok, eot = build_tokenizer(family), EOT[family]
    messages = [msg("user", "Q1"), msg("assistant", "A1"), msg("user", "Q2 without answer")]
    assert trained_spans(tok, tokenize_ok(tok, messages)) == ["A1" + eot]


@pytest.mark.parametrize("family", FAMILIES)
def test_no_assistant(family):
    tok = build_tokenizer(family)
    assert tokenize_messages(tok, [msg("system", "s"), msg("user", "only a question")], 100) == ([], "no_assistant", [])


@pytest.mark.parametrize("family", ["llama3", "chatml"])
def test_empty_assistant_trains_only_end_of_turn(family):
    tok = build_tokenizer(family)
    assert trained_spans(tok, tokenize_ok(tok, [msg("user", "x"), msg("assistant", "")])) == [EOT[family]]


@pytest.mark.parametrize("family", ["llama3", "chatml"])
def test_assistant_first_is_context_only(family):
    """An opening assistant message (a greeting) has no prompt_0: no conversation precedes it at inference
    (apply_chat_template refuses an empty one), so it is context for what follows, never trained."""
    tok = build_tokenizer(family)
    messages = [msg("assistant", "Hello, how can I help?"), msg("user", "x"), msg("assistant", "y")]
    sample = tokenize_ok(tok, messages)
    assert trained_spans(tok, sample) == ["y" + EOT[family]]
    assert "Hello, how can I help?" in tok.decode(sample["input_ids"])


def test_a_row_of_one_assistant_message_has_nothing_to_train():
    # a template that indexes messages[0] would fail on the empty prefix; no render of it is needed
    assert tokenize_messages(build_tokenizer("chatml_default_system"), [msg("assistant", "hi")], 100,
                             "test row 0") == ([], "no_assistant", [])


@pytest.mark.parametrize("family", FAMILIES)
def test_truncation_keeps_head(family):
    tok, eot = build_tokenizer(family), EOT[family]
    answer = "The capital of France is Paris, of course."
    messages = [msg("user", "What is 2 + 2?"), msg("assistant", "4"), msg("user", "And the capital of France?"),
                msg("assistant", answer)]
    full = tokenize_ok(tok, messages)
    trained = [i for i, lab in enumerate(full["labels"]) if lab != -100]
    second = [i for i in trained if i - 1 not in trained][1]  # first token of the second answer
    cut = second + 3
    sample = tokenize_ok(tok, messages, max_seq_len=cut)
    assert sample["input_ids"] == full["input_ids"][:cut] and sample["labels"] == full["labels"][:cut]
    head = tok.decode(full["input_ids"][second:cut], clean_up_tokenization_spaces=False)
    assert trained_spans(tok, sample) == ["4" + eot, head]
    assert answer.startswith(head) and len(head) < len(answer)
    # Cut before the first answer: nothing left to learn.
    assert tokenize_messages(tok, messages, trained[0]) == ([], "no_labels_after_truncation", [])


def test_eos_only_after_the_last_message_is_not_trained():
    tok = build_tokenizer("llama3")
    # The template writes an eos after the whole conversation only: no turn emits it, every turn stays in one sample.
    tok.chat_template = tok.chat_template + "{% if not add_generation_prompt %}<|end_of_text|>{% endif %}"
    messages = [msg("user", "a"), msg("assistant", "b"), msg("user", "c"), msg("assistant", "d")]
    assert trained_spans(tok, tokenize_ok(tok, messages)) == ["b<|eot_id|>", "d<|eot_id|>"]


def test_tokenizer_without_chat_template():
    tok = build_tokenizer("llama3")
    tok.chat_template = None
    with pytest.raises(DataError, match="row 5: the tokenizer has no chat template"):
        tokenize_messages(tok, [msg("user", "a"), msg("assistant", "b")], 100, "x.jsonl row 5")


# ----------------------------------------------------------------------------- formats


def test_detect_format():
    assert detect_format(["messages", "id"]) == "messages"
    assert detect_format(["conversations"]) == "sharegpt"
    assert detect_format(["instruction", "input", "output"]) == "alpaca"
    assert detect_format(["conversations"], "sharegpt") == "sharegpt"
    with pytest.raises(DataError, match=r"columns \['prompt', 'completion'\].*messages.*sharegpt.*alpaca"):
        detect_format(["prompt", "completion"])
    with pytest.raises(DataError, match="'alpaca'"):
        detect_format(["messages"], "alpaca")
    with pytest.raises(DataError, match="'chatml'"):
        detect_format(["messages"], "chatml")


def test_detect_format_from_streaming_rows(tmp_path):
    rows = load_streamed(write_jsonl(tmp_path / "a.jsonl", [{"instruction": "i", "output": "o"}]))
    assert rows.data.column_names is None  # datasets does not know them before reading: the first row tells
    assert rows.columns == ["instruction", "output"] and detect_format(rows.columns) == "alpaca"


def test_to_conversation_all_formats():
    w = "f.jsonl row 0"
    sharegpt = {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"},
                                  {"from": "gpt", "value": "A"}]}
    assert to_messages(sharegpt, "sharegpt", w) == [msg("system", "S"), msg("user", "Q"), msg("assistant", "A")]
    alpaca = {"instruction": "Translate", "input": "bonjour", "output": "hello", "system": "Be brief."}
    assert to_messages(alpaca, "alpaca", w) == [msg("system", "Be brief."), msg("user", "Translate\n\nbonjour"),
                                                msg("assistant", "hello")]
    assert to_messages({"instruction": "Hi", "input": "", "output": "Yo"}, "alpaca", w) == [
        msg("user", "Hi"), msg("assistant", "Yo")]
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]  # kept as the row has them (issue 31)
    odd = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": None}]}
    assert to_messages(odd, "messages", w) == [msg("user", parts), msg("assistant", "")]
    odd["messages"][0]["content"].insert(1, {"type": "image"})  # not trainable here: refused, never dropped silently
    with pytest.raises(DataError, match=r"message 0 content part 1 is of type 'image'; only text parts"):
        to_messages(odd, "messages", w)


def test_unknown_role_names_row():
    with pytest.raises(DataError, match=r"^data/train\.jsonl row 17: unknown role 'robot' in message 1"):
        to_messages({"messages": [msg("user", "a"), msg("robot", "b")]}, "messages", "data/train.jsonl row 17")
    with pytest.raises(DataError, match="row 2: expected a list of messages"):
        to_messages({"messages": 5}, "messages", "f row 2")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fmt", ["messages", "sharegpt", "alpaca"])
def test_formats_end_to_end_labels(family, fmt):
    tok, eot = build_tokenizer(family), EOT[family]
    row = {
        "messages": {"messages": [msg("system", "Sys"), msg("user", "Q?"), msg("assistant", "A 😀")]},
        "sharegpt": {"conversations": [{"from": "system", "value": "Sys"}, {"from": "human", "value": "Q?"},
                                       {"from": "gpt", "value": "A 😀"}]},
        "alpaca": {"system": "Sys", "instruction": "Q?", "input": "", "output": "A 😀"},
    }[fmt]
    messages = to_messages(row, detect_format(list(row)), "r")
    assert trained_spans(tok, tokenize_ok(tok, messages)) == ["A 😀" + eot]


# ----------------------------------------------------------------------------- loading


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_load_rows_local_files(tmp_path):
    rows = [{"messages": [msg("user", f"q{i}"), msg("assistant", f"a{i}")]} for i in range(3)]
    jsonl = write_jsonl(tmp_path / "a.jsonl", rows)
    (tmp_path / "b.json").write_text(json.dumps(rows), encoding="utf-8")
    assert rows_of(jsonl)[2] == rows[2]
    assert rows_of(tmp_path / "b.json") == rows
    assert len(rows_of(tmp_path)) == 6  # directory
    assert [r["messages"][1]["content"] for r in rows_of(jsonl, streaming=True)] == ["a0", "a1", "a2"]
    parquet = tmp_path / "p" / "c.parquet"
    parquet.parent.mkdir()
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    assert rows_of(parquet)[1] == rows[1] == rows_of(parquet, streaming=True)[1]
    assert load_rows(str(parquet)).data[1]["__where__"] == f"{parquet} row 1"


def test_load_rows_mixed_content_types(tmp_path):
    rows = [{"messages": [msg("user", "plain"), msg("assistant", "x")]},
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}, msg("assistant", "y")]}]
    got = rows_of(write_jsonl(tmp_path / "odd.jsonl", rows))
    assert [to_messages(r, "messages", "r")[0] for r in got] == [msg("user", "plain"),
                                                                 msg("user", [{"type": "text", "text": "parts"}])]


def test_load_rows_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n\n{"messages": [}\n', encoding="utf-8")
    with pytest.raises(DataError, match=rf"^{bad}:3: malformed JSON \(") as err:
        load_rows(str(bad))
    assert "\n" not in str(err.value)
    with pytest.raises(DataError, match=rf"^{bad}:3: malformed JSON"):
        list(load_streamed(str(bad)).data)
    arr = tmp_path / "arr.jsonl"
    arr.write_text('{"messages": []}\n[1, 2]\n', encoding="utf-8")
    with pytest.raises(DataError, match=rf"^{arr}:2: expected a JSON object, got list"):
        load_rows(str(arr))
    with pytest.raises(DataError, match="missing.jsonl: no such file or directory"):
        load_rows(str(tmp_path / "missing.jsonl"))
    obj = tmp_path / "obj.json"  # a pretty-printed object (e.g. a config.json passed by mistake)
    obj.write_text(json.dumps({"model_type": "llama", "rows": [1]}, indent=2), encoding="utf-8")
    with pytest.raises(DataError, match=rf"^{obj}: holds one multi-line JSON object; expected JSON Lines"):
        load_rows(str(obj))
    with pytest.raises(DataError, match="no such file"):
        load_rows("./nope")
    txt = tmp_path / "x.txt"
    txt.write_text("hi")
    with pytest.raises(DataError, match="unsupported file type"):
        load_rows(str(txt))


# ----------------------------------------------------------------------------- stream


def make_rows(n=31):
    rows = []
    for i in range(n):
        if i % 10 == 3:
            rows.append({"messages": [msg("user", f"question {i} without an answer")]})
        elif i % 10 == 7:  # the prompt alone exceeds max_seq_len below
            rows.append({"messages": [msg("user", "long " * 200), msg("assistant", f"answer {i}")]})
        else:
            turns = [msg("user", f"Question {i}?"), msg("assistant", f"Answer {i} " + "ok " * (i % 5))]
            if i % 4 == 0:
                turns += [msg("user", "More?"), msg("assistant", f"Second answer {i}")]
            rows.append({"messages": turns})
    return rows


@pytest.fixture
def data_file(tmp_path):
    return write_jsonl(tmp_path / "train.jsonl", make_rows())


TOK = build_tokenizer("llama3")


def stream(path, streaming=False, **kw):
    """build_samples of `path` (streaming: data/streaming.py's)."""
    kw.setdefault("max_seq_len", 64)
    return (build_streamed if streaming else build_samples)(path, TOK, **kw)


def take(s, n):
    return list(itertools.islice(iter(s), n))


def key(sample):
    return tuple(sample["input_ids"]), tuple(sample["labels"]), tuple(sample.get("position_ids", ()))


@pytest.mark.parametrize("streaming", [False, True])
def test_counts_and_drops(data_file, streaming):
    s = stream(data_file, streaming=streaming, epoch_limit=1)
    samples = list(s)
    assert s.counts == {"rows": 31, "kept": 25, "samples": 25, "turns_trained": 33, "dropped_no_assistant": 3,
                        "dropped_no_labels_after_truncation": 3}
    assert s.num_samples == 25 == len(samples)
    assert all(len(x["input_ids"]) <= 64 for x in samples)


def test_row_errors_name_the_row(tmp_path):
    rows = make_rows(5)
    rows[4] = {"messages": [msg("user", "a"), {"role": "robot", "content": "b"}]}
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(DataError, match=r"t\.jsonl:5: unknown role 'robot'"):  # file:line, not the row index
        stream(path)
    with pytest.raises(DataError, match=r"t\.jsonl:5: unknown role 'robot'"):
        list(stream(path, streaming=True, epoch_limit=1))
    folder = tmp_path / "folder"  # a directory: the file that holds the row, and its line (a blank line counted)
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", make_rows(3))
    (folder / "b.jsonl").write_text(json.dumps(make_rows(1)[0]) + "\n\n" + json.dumps(rows[4]) + "\n")
    with pytest.raises(DataError, match=rf"^{folder / 'b.jsonl'}:3: unknown role 'robot'"):
        stream(str(folder))
    with pytest.raises(DataError, match=r"columns \['prompt'\]"):
        stream(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x"}]))


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("streaming", [False, True])
def test_global_order_is_world_size_independent(data_file, packing, streaming):
    # Two epochs with an epoch length that world sizes 2 and 3 do not divide.
    s = stream(data_file, packing=packing, streaming=streaming, epoch_limit=2)
    ref = list(s)
    assert len(ref) == 2 * s.num_samples
    if not packing:
        assert s.num_samples % 2 and s.num_samples % 3  # rank assignment must carry across the epoch boundary
    for world in (2, 3):
        per_rank = [list(stream(data_file, packing=packing, streaming=streaming, epoch_limit=2, rank=r,
                                world_size=world)) for r in range(world)]
        merged = [per_rank[g % world][g // world] for g in range(len(ref))]
        assert [key(x) for x in merged] == [key(x) for x in ref]
        assert sum(map(len, per_rank)) == len(ref)


def test_epochs_reshuffle_and_shuffle_off_is_file_order(data_file):
    s = stream(data_file, epoch_limit=2)
    both = list(s)
    e0, e1 = both[: s.num_samples], both[s.num_samples:]
    assert [key(x) for x in e0] != [key(x) for x in e1]
    assert sorted(map(key, e0)) == sorted(map(key, e1))
    ordered = list(stream(data_file, shuffle=False, epoch_limit=1))
    assert TOK.decode(ordered[0]["input_ids"]).count("Question 0?") == 1
    assert sorted(map(key, ordered)) == sorted(map(key, e0))


@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("streaming", [False, True])
def test_start_sample_resumes_at_global_sample(data_file, packing, streaming):
    ref = list(stream(data_file, packing=packing, streaming=streaming, epoch_limit=3))
    for k in (0, 5, len(ref) // 3 + 1, len(ref) - 2):
        for world, rank in ((1, 0), (2, 0), (2, 1)):
            got = list(stream(data_file, packing=packing, streaming=streaming, epoch_limit=3, start_sample=k,
                              rank=rank, world_size=world))
            want = [x for g, x in enumerate(ref) if g >= k and g % world == rank]
            assert [key(x) for x in got] == [key(x) for x in want], (k, world, rank)


def test_stream_repeats_forever_without_epoch_limit(data_file):
    s = stream(data_file, shuffle=False)
    got = take(s, 2 * s.num_samples + 1)
    assert [key(x) for x in got[s.num_samples: 2 * s.num_samples]] == [key(x) for x in got[: s.num_samples]]


@pytest.mark.parametrize("packing", [False, True])
def test_streaming_matches_non_streaming_without_shuffle(data_file, packing):
    a = take(stream(data_file, packing=packing, shuffle=False), 12)
    b = take(stream(data_file, packing=packing, streaming=True), 12)
    assert [key(x) for x in a] == [key(x) for x in b]


def test_packing_invariants(data_file):
    plain = list(stream(data_file, shuffle=False, epoch_limit=1))
    packs = list(stream(data_file, shuffle=False, packing=True, epoch_limit=1))
    assert len(packs) < len(plain)
    groups = []
    for p in packs:
        n = len(p["input_ids"])
        assert n <= 64 and len(p["labels"]) == n == len(p["position_ids"])
        starts = [i for i, pos in enumerate(p["position_ids"]) if pos == 0] + [n]
        assert starts[0] == 0
        for a, b in zip(starts, starts[1:]):
            assert p["position_ids"][a:b] == list(range(b - a))
        groups.append([{"input_ids": p["input_ids"][a:b], "labels": p["labels"][a:b]}
                       for a, b in zip(starts, starts[1:])])
    # Whole samples with their labels, each once, in file order within a pack (best-fit: tests/test_packing.py).
    position = {key(x): i for i, x in enumerate(plain)}
    assert sorted(position[key(x)] for g in groups for x in g) == list(range(len(plain)))
    assert all([position[key(x)] for x in g] == sorted(position[key(x)] for x in g) for g in groups)
    assert max(map(len, groups)) > 1


def test_build_samples_needs_a_chat_template(data_file):
    tok = build_tokenizer("chatml")
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        build_samples(data_file, tok)


# ----------------------------------------------------------------------------- collate and preview


def test_pad_collate():
    a = {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}
    b = {"input_ids": [4], "labels": [4]}
    batch = pad_collate([a, b], pad_id=9)
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 9, 9]]
    assert batch["labels"].tolist() == [[-100, 2, 3], [4, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    assert pad_collate([a], pad_id=0, pad_to=5)["input_ids"].shape == (1, 5)
    with pytest.raises(ValueError):
        pad_collate([a], pad_id=0, pad_to=2)
    packed = pad_collate([{"input_ids": [1, 2, 3], "labels": [1, 2, 3], "position_ids": [0, 0, 1]}, b], pad_id=0)
    assert "attention_mask" not in packed
    assert packed["position_ids"].tolist() == [[0, 0, 1], [0, 0, 0]]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_batch_loss_equals_separate(data_file, attn):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation=attn)
    model = LlamaForCausalLM(config).eval()
    packs = take(stream(data_file, packing=True, shuffle=False), 3)
    assert any(p["position_ids"].count(0) > 1 for p in packs)

    def token_losses(batch):
        # use_cache=False: with a cache transformers does not detect packed sequences from position_ids.
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                           attention_mask=batch.get("attention_mask"), use_cache=False).logits
        labels = batch["labels"][:, 1:]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels, reduction="none")
        return loss[labels != -100]

    packed = token_losses(pad_collate(packs, TOK.pad_token_id))
    singles = []
    for p in packs:
        starts = [i for i, pos in enumerate(p["position_ids"]) if pos == 0] + [len(p["input_ids"])]
        singles += [{"input_ids": p["input_ids"][a:b], "labels": p["labels"][a:b]} for a, b in zip(starts, starts[1:])]
    separate = token_losses(pad_collate(singles, TOK.pad_token_id))
    assert packed.shape == separate.shape and packed.numel() > 0
    torch.testing.assert_close(packed, separate, atol=1e-5, rtol=1e-5)


def test_format_preview():
    sample = tokenize_ok(TOK, [msg("user", "Hi"), msg("assistant", "Hello")])
    plain = format_preview(TOK, sample, color=False)
    assert "<|end_header_id|>\n\n[[Hello<|eot_id|>]]" in plain
    trained = sum(x != -100 for x in sample["labels"])
    assert plain.endswith(f"\ntrained tokens: {trained} / total: {len(sample['input_ids'])}") and trained > 1
    colored = format_preview(TOK, sample)
    assert "\x1b[30;42mHello<|eot_id|>\x1b[0m" in colored and "[[" not in colored


# ----------------------------------------------------------------------------- boundaries of the label spans


def test_answer_merged_with_a_prompt_ending_in_a_space_is_trained():
    tok = build_tokenizer("llama3")  # Vicuna-like: the generation prompt ends with ' ', BPE merges it into 'ĠParis'
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ 'USER: ' + m['content'] + ' ' }}"
                         "{% else %}{{ 'ASSISTANT: ' + m['content'] + eos_token + ' ' }}{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}{{ 'ASSISTANT: ' }}{% endif %}")
    messages = [msg("user", "What is 2 + 2?"), msg("assistant", "4"),
                msg("user", "Capital?"), msg("assistant", "Paris")]
    assert trained_spans(tok, tokenize_ok(tok, messages)) == [" 4<|eot_id|>", " Paris<|eot_id|>"]


def test_end_of_turn_with_rstrip_and_template_text_after_it():
    from tokenizers import AddedToken
    tok = build_tokenizer("chatml")  # <|im_end|> swallows the '\n' after it (rstrip), as Phi-3's <|end|> does
    tok.add_special_tokens({"additional_special_tokens": [AddedToken("<|im_end|>", special=True, normalized=False,
                                                                     rstrip=True)]})
    messages = [msg("user", "Q"), msg("assistant", "Hello"), msg("user", "Q2"), msg("assistant", "Paris")]
    assert trained_spans(tok, tokenize_ok(tok, messages)) == ["Hello<|im_end|>", "Paris<|im_end|>"]
    # Like Phi-3: eos after the whole conversation; the end-of-turn is <|im_end|>, not the eos after it.
    tok = build_tokenizer("chatml")
    tok.chat_template += "{% if not add_generation_prompt %}<|endoftext|>{% endif %}"
    assert trained_spans(tok, tokenize_ok(tok, messages[:2])) == ["Hello<|im_end|>"]


def test_added_token_text_inside_an_answer_does_not_end_it():
    tok = build_tokenizer("chatml")  # the template's end of turn is plain text, the answer holds an added token
    tok.chat_template = ("{% for m in messages %}{{ '### ' + m['role'] + ':\n' + m['content'] + '\n\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}### assistant:\n{% endif %}")
    answer = "Documents end with <|endoftext|>, then the next one starts."
    assert trained_spans(tok, tokenize_ok(tok, [msg("user", "How?"), msg("assistant", answer)])) == [answer]


def test_tool_calls_bom_and_python_tokenizer(tmp_path):
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
    # a template without tool support renders no call: the row is refused, not trained as an empty answer
    with pytest.raises(DataError, match=r"^f row 0: message 1: the chat template drops its tool call 'f' "
                                         r"\(drops_tool_calls\); data.on_unsupported=\"drop\" leaves such turns"):
        tokenize_messages(build_tokenizer("chatml"), to_messages({"messages": [msg("user", "q"), call]}, "messages",
                                                                 "f row 0"), 100, "f row 0")
    path = tmp_path / "bom.jsonl"
    path.write_text("\ufeff" + json.dumps({"messages": [msg("user", "q"), msg("assistant", "a")]}) + "\n",
                    encoding="utf-8")
    assert rows_of(path)[0]["messages"][1]["content"] == "a"
    (tmp_path / "bom.json").write_text("\ufeff" + json.dumps([{"instruction": "i", "output": "o"}]), encoding="utf-8")
    assert rows_of(tmp_path / "bom.json")[0] == {"instruction": "i", "output": "o"}

    class Slow:  # a Python (slow / remote-code) tokenizer returns no offsets
        def __init__(self, fast):
            self.fast = fast

        def __getattr__(self, name):
            if name == "backend_tokenizer":  # what a Python tokenizer lacks
                raise AttributeError(name)
            return getattr(self.fast, name)

        def __call__(self, text, **kw):
            return {"input_ids": self.fast(text, add_special_tokens=False)["input_ids"]}
    with pytest.raises(DataError, match=r"^r 0: the tokenizer .* gives no character offsets"):
        tokenize_messages(Slow(build_tokenizer("chatml")), [msg("user", "q"), msg("assistant", "a")], 100, "r 0")


# ----------------------------------------------------------------------------- dataset dirs, exact rows, mixtures


def qa(i, answer=None):
    return {"messages": [msg("user", f"Question {i}?"), msg("assistant", answer or f"Answer {i}")]}


def test_a_dataset_dir_reads_the_split_asked_for(tmp_path):
    hub = tmp_path / "hub"  # what a hub download gives
    (hub / "data").mkdir(parents=True)
    train, test = [qa(i) for i in range(3)], [qa(10 + i) for i in range(2)]
    for name, rows in (("train", train), ("test", test)):
        datasets.Dataset.from_list(rows).to_parquet(str(hub / "data" / f"{name}-00000-of-00001.parquet"))
    (hub / "README.md").write_text("# a card without YAML metadata\n")
    assert rows_of(hub) == train and rows_of(hub, split="test") == test == rows_of(hub, split="test", streaming=True)
    with pytest.raises(DataError, match=rf"^{hub}: no split 'validation' \(data.split\); its splits: train, test$"):
        load_rows(str(hub), split="validation")
    s = stream(str(hub), split="test", epoch_limit=1)
    assert s.counts["rows"] == 2 and s.summary()[0] == (f"read {hub} split test: 1 file(s): "
                                                        f"{hub / 'data' / 'test-00000-of-00001.parquet'}")
    card = tmp_path / "card"  # splits named in the README's configs
    (card / "x").mkdir(parents=True)
    write_jsonl(card / "x" / "one.jsonl", train)
    write_jsonl(card / "x" / "two.jsonl", test)
    (card / "README.md").write_text("---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: "
                                    "x/one.jsonl\n  - split: validation\n    path: x/two.jsonl\n---\n# card\n")
    assert rows_of(card) == train and rows_of(card, split="validation") == test
    with pytest.raises(DataError, match=r"no split 'test' \(data.split\); its splits: train, validation$"):
        load_rows(str(card), split="test")
    flat = tmp_path / "flat"  # no split names: every file is the train split, as before
    flat.mkdir()
    write_jsonl(flat / "a.jsonl", train)
    write_jsonl(flat / "b.jsonl", test)
    assert rows_of(flat) == train + test
    with pytest.raises(DataError, match=r"its splits: train$"):
        load_rows(str(flat), split="test")


def test_rows_are_kept_as_written(tmp_path):
    # Parts in one row used to make the column JSON, and every string in it that looked like JSON came back decoded.
    texts = ["null", '"hi"', '["a", "b"]', "3", '{"x": 1}', "true", " 7 "]
    rows = [{"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]}, msg("assistant", "x")]}]
    rows += [{"messages": [msg("user", t), {"role": "assistant", "content": t, "reasoning_content": t}]}
             for t in texts]
    rows.append({"messages": [msg("user", "q"), {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "null", "arguments": '{"q": "null", "n": "3"}'}}]},
        {"role": "tool", "content": "[1]", "name": "3"}, msg("assistant", "null")], "tools": None})
    path = write_jsonl(tmp_path / "odd.jsonl", rows)
    for streaming in (False, True):
        assert rows_of(path, streaming=streaming) == rows
    got = [to_conversation(r, "messages", "r").messages for r in rows_of(path)]
    assert [(m[1]["content"], m[1]["reasoning_content"]) for m in got[1:-1]] == [(t, t) for t in texts]
    assert got[-1][1]["tool_calls"][0]["function"] == {"name": "null", "arguments": {"q": "null", "n": "3"}}
    assert got[-1][2] == {"role": "tool", "content": "[1]", "name": "3"} and got[-1][3]["content"] == "null"
    samples = stream(path, shuffle=False, epoch_limit=1, max_seq_len=512, on_unsupported="drop")
    trained = [trained_spans(TOK, x) for x in samples][1:]  # (this template drops tool calls, and trims)
    assert trained == [[t.strip() + "<|eot_id|>"] for t in texts] + [["null<|eot_id|>"]]


def mixture_files(tmp_path, sizes=(40, 35, 25)):
    paths = []
    for k, n in enumerate(sizes):
        paths.append(write_jsonl(tmp_path / f"source{k}.jsonl", [qa(i, f"from {k} " + "ok " * (i % 7))
                                                                  for i in range(n)]))
    return paths


def shares(samples, num_sources):
    per = [0] * num_sources
    for x in samples:
        for src in x["sources"]:
            per[src["source"]] += 1
    return [n / sum(per) for n in per]


@pytest.mark.parametrize("packing", [False, True])
def test_a_mixture_gives_the_asked_shares_and_resumes_exactly(tmp_path, packing):
    a, b, c = mixture_files(tmp_path)
    specs = [{"path": a, "weight": 5}, {"path": b, "weight": 3}, {"path": c, "weight": 2}]
    s = stream(specs, packing=packing, epoch_limit=2)
    both = list(s)
    epoch = both[: s.num_samples]
    assert shares(epoch, 3) == pytest.approx([0.5, 0.3, 0.2], abs=0.01)
    assert s.shares == [(50, s.shares[0][1]), (30, s.shares[1][1]), (20, s.shares[2][1])]
    assert s.counts["rows"] == 100 and [c["rows"] for c in s.source_counts] == [40, 35, 25]
    assert [key(x) for x in both[s.num_samples:]] != [key(x) for x in epoch]  # each epoch reshuffled
    assert "source 2 " + c + ": 20 samples an epoch (20.0%)" in "\n".join(s.summary())
    for k in (7, s.num_samples + 3):
        for world, rank in ((1, 0), (2, 0), (2, 1)):
            got = list(stream(specs, packing=packing, epoch_limit=2, start_sample=k, rank=rank, world_size=world))
            assert [key(x) for x in got] == [key(x) for i, x in enumerate(both) if i >= k and i % world == rank]
    # samples and epochs: exactly that many, the source repeated or a fixed part of it
    fixed = stream([{"path": a, "samples": 60}, {"path": b, "epochs": 0.4}, {"path": c}], packing=packing,
                   shuffle=False, epoch_limit=1)
    assert [n for n, _ in fixed.shares] == [60, 14, 25]
    assert shares(list(fixed), 3) == pytest.approx([60 / 99, 14 / 99, 25 / 99])


def mixture_rank(specs, packing, start):
    import torch.distributed as dist
    s = stream(specs, packing=packing, epoch_limit=2, start_sample=start, rank=dist.get_rank(),
               world_size=dist.get_world_size())
    return [key(x) for x in s]


def test_a_mixture_is_the_same_at_1_and_2_ranks(tmp_path):
    from helpers import run_ranks
    specs = [{"path": p, "weight": w} for p, w in zip(mixture_files(tmp_path), (5, 3, 2))]
    for packing, start in ((True, 0), (False, 9)):
        one, = run_ranks(mixture_rank, 1, specs, packing, start)
        two = run_ranks(mixture_rank, 2, specs, packing, start)
        first = [start + (r - start) % 2 for r in (0, 1)]  # each rank's first global unit from `start` on
        assert [two[g % 2][(g - first[g % 2]) // 2] for g in range(start, start + len(one))] == one
        assert len(two[0]) + len(two[1]) == len(one)


def test_a_mixture_cannot_stream(tmp_path):
    a, b, _ = mixture_files(tmp_path)
    with pytest.raises(DataError, match=r"^data.sources: a mixture needs each source's size .* set "
                                        r"data.streaming=false$"):
        stream([{"path": a}, {"path": b}], streaming=True)
