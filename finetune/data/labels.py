"""Exact labels: the tokens a model emits at inference for each assistant turn, in the context it sees there.

For assistant message i, prompt_i is the rendering of messages[:i] with a generation prompt; completion_i is the
rendering of messages[:i+1] after prompt_i, cut right after its end-of-turn token. Turns whose prompt_i + completion_i
begin the whole row's rendering share its sample; a turn it shows differently gets a sample of its own. A turn that
cannot be trained so (Unsupported) stays untrained, as context of the later turns."""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Mapping
from typing import NamedTuple

from .formats import DataError, text_of
from .template import (Template, Unsupported, find_all, prepared, render_or_why, require_chat_template, template_of,
                       turn_length)

IGNORE_INDEX = -100
DROP_REASONS = ("no_assistant", "no_labels_after_truncation")


class Labelled(NamedTuple):
    samples: list[dict]  # {'input_ids', 'labels', 'turns', 'split'}, in the order of their first trained turn
    dropped: str | None  # why the row gives no sample (DROP_REASONS or an Unsupported reason), else None
    left_out: list[Unsupported]  # why each assistant turn left untrained is ("message i: ...", and its reason)


def _answer_start(t: Template, msgs, i, tools, prompt: str, upto: str) -> int | None:
    """Where message i's answer starts in `upto` (its rendering) that does not extend `prompt` (GPT-OSS, Mistral), or
    None: of the places after which `upto` holds nothing of message i-1, the one ending the most as `prompt` does."""
    history = t.render(msgs[:i], tools, False)
    if not prompt.startswith(history):
        return None
    before = _render_or_none(t, msgs[:i - 1], tools, False) or ""
    rendered = (history[len(before):] if history.startswith(before) else history).strip()  # the previous message
    gen, backwards = prompt[len(history):], prompt[::-1]
    text = msgs[i - 1].get("content")
    text = text.strip() if isinstance(text, str) else ""
    best, best_len = None, (len(prompt) - prompt.rfind(text) if text and text in prompt else len(gen) + 1) - 1
    key = gen or prompt[-1:]  # no generation prompt: every place where prompt's last character is
    for p in find_all(upto, key):
        end = p + len(key)
        n = len(os.path.commonprefix([upto[end - 1::-1], backwards]))  # how far upto[:end] ends as prompt does
        if n > best_len and not (rendered and rendered in upto[end:]):
            best, best_len = end, n
    return best


def _rewritten_start(t: Template, msgs, i, tools, prompt: str, upto: str) -> int | None:
    """Where message i's answer starts in `upto` when its rendering rewrites what precedes it so that no place there
    ends as `prompt` does back to message i-1 (Hermes closes a tool result otherwise when a turn follows it; Command
    R+'s generation prompt adds an instruction after the history), or None: of the places past the text `upto` shares
    with the history, the one ending the most as `prompt` does, through `prompt`'s last control token at least, if the
    turn's content follows it."""
    last = max((prompt.rfind(c) for c in t.control), default=-1)
    if last < 0:
        return None
    shared = len(os.path.commonprefix([upto, t.render(msgs[:i], tools, False)]))
    key, backwards = prompt[last:], prompt[::-1]
    best, best_len = None, 0
    for p in find_all(upto, key):
        end = p + len(key)
        n = len(os.path.commonprefix([upto[end - 1::-1], backwards]))
        if end > shared and n > best_len:
            best, best_len = end, n
    return best if best is not None and _keeps_content(msgs[i], upto[best:]) else None


def _render_or_none(t: Template, msgs, tools, generation_prompt: bool, **extra) -> str | None:
    try:
        return t.render(msgs, tools, generation_prompt, **extra)
    except Unsupported:
        return None


def _keeps_content(m: dict, text: str) -> bool:
    """Whether `text` holds the message's content (inline <think> reasoning included)."""
    head, _, answer = text_of(m.get("content")).rpartition("</think>")  # without </think>: head "", answer all of it
    return all(p.strip() in text for p in (answer, head.split("<think>")[-1]))


def _check_kept(m: dict, i: int, completion: str) -> None:
    """The message's content, reasoning and tool calls must be in what is trained (Unsupported otherwise)."""
    if not _keeps_content(m, completion):
        raise Unsupported("drops_content", f"message {i}: the chat template drops (or rewrites) its content")
    reasoning = (m.get("reasoning_content") or "").strip()
    if reasoning and reasoning not in completion:
        raise Unsupported("drops_reasoning", f"message {i}: the chat template drops its reasoning")
    own = json.dumps([text_of(m.get("content")), reasoning], ensure_ascii=False)  # a name there does not count
    for call in m.get("tool_calls") or ():
        name = call["function"]["name"]
        expected = own.count(name) + sum(c["function"]["name"] == name for c in m["tool_calls"])
        if completion.count(name) < expected:
            raise Unsupported("drops_tool_calls", f"message {i}: the chat template drops its tool call '{name}'")


def _tokens(tokenizer, t: Template, text: str, where: str, base=None, shared: int = 0) -> tuple[list, tuple, tuple]:
    """(ids, start offsets, end offsets) of `text`. base: the same of a text sharing `text`'s first `shared`
    characters, whose tokens before the last added token within them are reused (checked once per template)."""
    if base is not None and t.reuse is not False:
        ids, starts, ends = base
        k = bisect.bisect_right(ends, shared)
        while k and ids[k - 1] not in t.added:
            k -= 1
        if k > 1:
            cut = starts[k - 1]
            rest_ids, rest_starts, rest_ends = _tokens(tokenizer, t, text[cut:], where)
            got = (ids[:k - 1] + rest_ids, starts[:k - 1] + tuple(a + cut for a in rest_starts),
                   ends[:k - 1] + tuple(b + cut for b in rest_ends))
            if t.reuse is None:
                t.reuse = list(got[0]) == list(_tokens(tokenizer, t, text, where)[0])
            if t.reuse:
                return got
    if t.backend is not None:
        enc = t.backend.encode(text, add_special_tokens=False)
        ids, offsets = enc.ids, enc.offsets
    else:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if "offset_mapping" not in enc:
            raise DataError(f"{where}: the tokenizer ({type(tokenizer).__name__}) gives no character offsets, so "
                            f"labels cannot be placed; use a fast (tokenizers-backed) tokenizer")
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
    starts, ends = zip(*offsets) if offsets else ((), ())
    return ids, starts, ends


def _encode(t: Template, ids: list, starts, ends, spans, max_seq_len: int) -> dict:
    """The sample whose labels are the tokens of each span (message index, start, end) of trained text: every token
    holding answer text (also one straddling the boundary), never an added token that only swallowed the answer's
    leading whitespace; a token touching two spans is the first's."""
    labels, turns, done = [IGNORE_INDEX] * len(ids), [], 0
    for i, a, b in spans:
        lo, hi = max(bisect.bisect_right(ends, a), done), bisect.bisect_left(starts, b)
        while lo < hi and starts[lo] < a and ids[lo] in t.added:
            lo += 1
        labels[lo:hi] = ids[lo:hi]
        if lo < min(hi, max_seq_len):  # a label left after truncation
            turns.append(i)
        done = max(done, hi)
    return {"input_ids": list(ids[:max_seq_len]), "labels": labels[:max_seq_len], "turns": turns}


def _turn(tokenizer, t: Template, msgs, row_message: dict, i: int, tools, full: str, prompt: str | None, hint):
    """(prompt_i, completion_i, the stop token the template does not write) of assistant message i, or Unsupported."""
    prompt = prompt if prompt is not None else t.render(msgs[:i], tools, True)
    upto = full if i == len(msgs) - 1 else t.render(msgs[: i + 1], tools, False)
    start = len(prompt) if upto.startswith(prompt) else _answer_start(t, msgs, i, tools, prompt, upto)
    start = start if start is not None else _rewritten_start(t, msgs, i, tools, prompt, upto)
    if start is None:
        raise Unsupported("not_prefix", f"message {i}: the chat template renders it differently from its "
                                        f"generation prompt, so there is no answer to train"
                                        + (hint(t, msgs, i, tools) if hint else ""))
    length, stop = turn_length(tokenizer, t, msgs, i, tools, upto[start:])
    completion = upto[start:start + length]
    if not completion:
        raise Unsupported("drops_message", f"message {i}: the chat template renders nothing for it")
    _check_kept(row_message, i, completion + stop)
    return prompt, completion + stop, stop


def refuse(e: Unsupported, where: str, on_unsupported: str, then: str) -> None:
    """Raise e as a DataError naming `where` unless on_unsupported="drop" (`then`: what "drop" would do)."""
    if on_unsupported != "drop":
        raise DataError(f'{where}: {e} ({e.reason}); data.on_unsupported="drop" {then}') from e


def tokenize_messages(tokenizer, messages: list[dict], max_seq_len: int, where: str = "", tools=None,
                      on_unsupported: str = "error", template_kwargs: dict | None = None, hint=None) -> Labelled:
    """One conversation's Labelled by the module docstring's rule. A turn (or row) the template cannot hold raises a
    DataError (on_unsupported="error") or is left untrained and reported ("drop"). hint(template, messages, i, tools):
    text added to a not_prefix turn's reason (data/label_hints.py)."""
    where = where or "conversation"
    require_chat_template(tokenizer, where)
    # An assistant message that opens the conversation (a greeting) is context only: no prompt precedes it at inference
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("train", True) and i > 0]
    if not trained:
        return Labelled([], "no_assistant", [])
    t = template_of(tokenizer, template_kwargs)
    msgs = prepared(messages, t.args_as_string[bool(tools)], t.reads_parts)
    try:
        full = main_text = t.render(msgs, tools, False)
        first = t.render(msgs[:trained[0]], tools, True)
        if tools and _render_or_none(t, msgs[:trained[0]], None, True) == first:  # (one that needs tools shows them)
            raise Unsupported("drops_tools", f"message {trained[0]}: the chat template does not show the row's tools")
    except Unsupported as e:
        if e.reason == "template_error":  # name the first message it fails on
            k = next((k for k in range(len(msgs))
                      if render_or_why(tokenizer, msgs[: k + 1], tools, t.extra)[0] is None), 0)
            e = Unsupported(e.reason, f"message {k}: {e}")
        refuse(e, where, on_unsupported, "leaves such rows untrained and trains the rest")
        return Labelled([], e.reason, [])
    main, alone, left_out = [], [], []
    for i in trained:
        try:
            prompt, completion, stop = _turn(tokenizer, t, msgs, messages[i], i, tools, full,
                                             first if i == trained[0] else None, hint)
        except Unsupported as e:
            e = e if str(e).startswith("message") else Unsupported(e.reason, f"message {i}: {e}")
            refuse(e, where, on_unsupported, "leaves such turns untrained and trains the rest")
            left_out.append(e)  # the turn stays in the rendering, as context of the later turns
            continue
        span = (i, len(prompt), len(prompt) + len(completion))
        if main_text.startswith(prompt + completion):
            main.append(span)
        elif stop and i == len(msgs) - 1 and main_text.startswith(prompt + completion[:-len(stop)]):
            main_text = prompt + completion  # the stop token the last turn's template does not write
            main.append(span)
        else:  # "history": the full rendering shows this turn differently; "context": what precedes it differs
            alone.append((prompt + completion, [span], "history" if full.startswith(prompt) else "context"))
    if main and not t.checked:  # once: our rendering and tokenization are what the library itself gives
        _check_tokenization(tokenizer, t, msgs, tools, full, where)
    texts = ([(main_text, main, "")] if main else []) + alone
    samples, base = [], None
    for text, spans, why in texts:
        shared = len(os.path.commonprefix([texts[0][0], text])) if base else 0  # with the text `base` tokenized
        tokens = _tokens(tokenizer, t, text, where, base, shared)
        base = base or tokens  # the whole row's: the samples of turns split out share much of its text
        samples.append({**_encode(t, *tokens, spans, max_seq_len), "split": why})
    samples = sorted((s for s in samples if s["turns"]), key=lambda s: s["turns"][0])
    reason = None if samples else left_out[0].reason if not main and not alone else "no_labels_after_truncation"
    return Labelled(samples, reason, left_out)


def _check_tokenization(tokenizer, t: Template, msgs, tools, full: str, where: str) -> None:
    ref = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=True, **t.extra)
    ref = list(ref["input_ids"] if isinstance(ref, Mapping) else ref)
    if t.backend is not None and t.backend.encode(full, add_special_tokens=False).ids != ref:
        t.backend = None
    ids, starts, ends = _tokens(tokenizer, t, full, where)
    if list(ids) != ref:
        raise DataError(f"{where}: tokenizing the rendered text differs from apply_chat_template(tokenize=True)")
    if list(starts) != sorted(starts) or list(ends) != sorted(ends):
        raise DataError(f"{where}: the tokenizer's character offsets do not grow along the text; labels cannot be "
                        f"placed")
    t.checked = True
