"""Exact labels: the tokens a model emits at inference for each assistant turn, in the context it sees there.

For assistant message i, prompt_i is the template's rendering of messages[:i] (with the row's tools) and a generation
prompt; completion_i is the rendering of messages[:i+1] minus prompt_i (where that rendering also changes the
history, as GPT-OSS does, what follows its generation prompt for message i), cut right after the end-of-turn token
that closes it. Turns whose prompt_i + completion_i begin the full rendering share one sample (the rendering of the
whole row); a turn the full rendering shows differently (reasoning dropped from history, a think block only in the
last turn, a system prompt moved) gets a sample of its own, prompt_i + completion_i.
"""

from __future__ import annotations

import json
import os
import weakref
from collections.abc import Mapping

import numpy as np

from ..errors import one_line
from .formats import DataError

IGNORE_INDEX = -100
DROP_REASONS = ("no_assistant", "no_labels_after_truncation")
_PROBE, _NEXT = "finetuneprobe", "nextturnmarker"  # stand-ins for row text, to find the template's own text
_TEMPLATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Unsupported(DataError):
    """The template cannot hold this row; `reason` names why (counted under data.on_unsupported = "drop")."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class _Template:
    """What we learn once per tokenizer + template: its control tokens, how it wants tool-call arguments, and the
    text it writes after a turn (cached by the shape of the message)."""

    def __init__(self, tokenizer):
        self.text = tokenizer.chat_template
        # Added tokens mark where a turn ends; whitespace ones (e.g. Gemma's "\n") are ordinary template text.
        added = tokenizer.added_tokens_decoder  # {id: AddedToken}
        self.is_added = np.zeros(max(added, default=0) + 1, dtype=bool)  # by token id (ids above: not added)
        self.is_added[list(added)] = True
        self.control = [t.content for t in added.values() if t.content.strip()]
        self.tails: dict[tuple, tuple[str, int | None] | None] = {}
        self.checked = False  # our rendering + tokenization checked against apply_chat_template(tokenize=True) once
        # The backend tokenizer directly gives the same ids and offsets without the wrapper's cost; where it does
        # not (the first row tells), the tokenizer's own __call__.
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        # Arguments go in as an object (most templates `tojson` it), unless the template concatenates a string: then
        # an object would fail or print as a Python dict, and a string given to `tojson` would be encoded twice.
        # Learned with and without tools: a template dict's "tool_use" template, or a template's tools branch, may
        # want them otherwise than its default. Keyed by whether the row has tools.
        call = {"type": "function", "function": {"name": _PROBE, "arguments": {"a": _PROBE}}}
        conv = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        schema = [{"type": "function", "function": {"name": _PROBE, "description": _PROBE,
                                                    "parameters": {"type": "object", "properties": {}}}}]
        self.args_as_string = {}
        for has_tools, tools in ((False, None), (True, schema)):
            as_dict = _try_render(tokenizer, conv, tools)
            as_str = _try_render(tokenizer, _args_as_strings(conv), tools)
            self.args_as_string[has_tools] = (bool(as_str) and (as_dict is None or "{'a': " in as_dict)
                                              and '{\\"a\\"' not in as_str)
        self.kwargs = dict(tokenizer.special_tokens_map)
        # The compiled template called directly on _prepared messages renders as apply_chat_template does (the first
        # row is checked against it) without its per-call deep copy of the conversation: labelling renders each
        # row about twice per turn.
        from ..compat import compile_jinja_template
        self.compiled = {has: compile_jinja_template(tokenizer.get_chat_template(None, [{}] if has else None))
                         for has in (False, True)}  # a template dict may have its own "tool_use" template

    def render(self, messages: list[dict], tools, generation_prompt: bool) -> str:
        """The template's text for _prepared messages; a template that raises is Unsupported("template_error")."""
        try:
            return self.compiled[bool(tools)].render(messages=messages, tools=tools, documents=None,
                                                     add_generation_prompt=generation_prompt, **self.kwargs)
        except Exception as e:  # noqa: BLE001 - template errors are about this row
            raise Unsupported("template_error", f"chat template failed ({one_line(e)})") from e


def _try_render(tokenizer, messages, tools=None):
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    except Exception:  # noqa: BLE001 - only a probe
        return None


def _args_as_strings(messages: list[dict]) -> list[dict]:
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
        c["function"]["arguments"], ensure_ascii=False)}} for c in m["tool_calls"]]} if m.get("tool_calls") else m
        for m in messages]


def template_of(tokenizer) -> _Template:
    t = _TEMPLATES.get(tokenizer)
    if t is None or t.text != tokenizer.chat_template:
        t = _TEMPLATES[tokenizer] = _Template(tokenizer)
    return t


def _prepared(messages: list[dict], args_as_string: bool) -> list[dict]:
    """Messages as apply_chat_template hands them to the template (null keys dropped, reasoning also as `thinking`,
    which GPT-OSS templates read), made once per row so that each prefix renders without copying."""
    out = []
    for m in _args_as_strings(messages) if args_as_string else messages:
        m = {k: v for k, v in m.items() if v is not None and k != "train"}
        out.append({"thinking": m["reasoning_content"], **m} if "reasoning_content" in m else m)
    return out


def prompt_text(tokenizer, messages: list[dict], tools=None) -> str:
    """The context the model answers after messages (prompt_i for what follows): rendered as the labels are."""
    t = template_of(tokenizer)
    return t.render(_prepared(messages, t.args_as_string[bool(tools)]), tools, True)


def _answer_start(t: _Template, msgs, i, tools, prompt: str, upto: str) -> int | None:
    """Where message i's answer starts in `upto` when `upto` does not extend `prompt` because the template renders
    the history differently once message i follows (GPT-OSS drops the analysis of tool calls before a final
    answer, Mistral shows the system prompt only in the last user turn): right after the generation prompt that
    `upto` writes for message i, i.e. the occurrence of it whose preceding text matches the end of `prompt` the
    longest (at least the previous message). A template without a generation prompt: the place whose preceding text
    matches the end of `prompt` the longest, covering at least the previous message's text."""
    history = t.render(msgs[:i], tools, False)
    if not prompt.startswith(history):
        return None
    gen, backwards = prompt[len(history):], prompt[::-1]
    previous = msgs[i - 1].get("content")
    best, best_len = None, len(gen) if gen else max(len(previous.strip()) if isinstance(previous, str) else 0, 1) - 1
    key = gen or prompt[-1:]  # no generation prompt: every place where prompt's last character is
    for p in _find_all(upto, key):
        end = p + len(key)
        n = len(os.path.commonprefix([upto[end - 1::-1], backwards]))  # how far upto[:end] ends as prompt does
        if n > best_len:
            best, best_len = end, n
    return best


def _shape(m: dict) -> tuple:
    return bool(m.get("content")), bool(m.get("reasoning_content")), len(m.get("tool_calls") or ())


def _probe_tail(tokenizer, t: _Template, messages, i, tools) -> tuple[str, int | None, str] | None:
    """(tail, cut, stop): the text the template writes after the last row text of message i (its content, or the last
    tool call's arguments), how much of it the model emits (through the end-of-turn token; None: no token), and, for
    a template that writes no end-of-turn token (GLM-style: the next role's token ends the turn, and is an eos id of
    the model), that next control token, which the model must emit to stop ("" otherwise)."""
    m = dict(messages[i])
    if m.get("content") or not m.get("tool_calls"):
        m["content"] = _PROBE
    if m.get("tool_calls"):
        *calls, last = m["tool_calls"]
        fn = last["function"]
        args = {**fn["arguments"], _PROBE: _PROBE} if isinstance(fn["arguments"], dict) else json.dumps(
            {**json.loads(fn["arguments"]), _PROBE: _PROBE}, ensure_ascii=False)
        m["tool_calls"] = [*calls, {**last, "function": {**fn, "arguments": args}}]
    probe = _try_render(tokenizer, messages[:i] + [m], tools)
    if probe is None or _PROBE not in probe:
        return None
    tail = probe[probe.rfind(_PROBE) + len(_PROBE):]
    hits = sorted((p, -len(c), c) for c in t.control for p in _find_all(tail, c))
    # What the template writes between this turn and the next one (a tool result after tool calls, else a user)
    nxt = {"role": "tool" if m.get("tool_calls") else "user", "content": _NEXT}
    more = _try_render(tokenizer, messages[:i] + [m, nxt], tools)
    more = more[more.rfind(_PROBE) + len(_PROBE):more.rfind(_NEXT)] if more and _NEXT in more else None
    if not hits:
        return tail, None, _next_control(t, more, len(tail))
    # Several control tokens (Phi-3's '<|end|>\n<|endoftext|>', Qwen's '</tool_call><|im_end|>'): the turn ends at
    # the last one the template also writes when the conversation goes on; text only at the very end of a
    # conversation (an eos) is not emitted by the model. None in common (GPT-OSS <|return|> vs <|end|>): the first.
    cut = hits[0][0] + len(hits[0][2])
    if more is not None:
        common = len(os.path.commonprefix([tail, more]))
        inside = [h for h in hits if h[0] + len(h[2]) <= common]
        cut = max((p + len(c) for p, _, c in inside), default=cut)
    stop = ""
    if m.get("tool_calls"):  # tags close a tool call; where plain answers end with the next role's token, so do calls
        plain = _probe_tail(tokenizer, t, [*messages[:i], {"role": "assistant", "content": "x"}], i, tools)
        if plain is not None and plain[1] is None and plain[2]:
            stop = _next_control(t, more, cut)
    return tail, cut, stop


def _next_control(t: _Template, more: str | None, cut: int) -> str:
    """The control token that opens the next turn right after `cut` (whitespace before it included), or ""."""
    rest = more[cut:] if more is not None else ""
    stop = next((c for c in sorted(t.control, key=len, reverse=True) if rest.lstrip().startswith(c)), "")
    return rest[:rest.find(stop) + len(stop)] if stop else ""


def _find_all(text: str, sub: str):
    p = text.find(sub)
    while p >= 0:
        yield p
        p = text.find(sub, p + 1)


def _turn_length(tokenizer, t: _Template, messages, i, tools, completion: str) -> tuple[int, str]:
    """How much of completion_i is trained: through its end-of-turn token, never the template text after it (the
    '\n' after <|im_end|>, an eos the template adds at the end of a conversation); and the stop token to add after
    it where the template writes none in the turn (see _probe_tail)."""
    key = _shape(messages[i])
    found = t.tails.get(key, False)
    if found is False or (found is not None and not completion.endswith(found[0])):
        found = t.tails[key] = _probe_tail(tokenizer, t, messages, i, tools)
    if found is not None and completion.endswith(found[0]):
        tail, cut, stop = found
        return (len(completion) - len(tail) + cut if cut is not None else len(completion.rstrip())), stop
    # the template changes what follows the content: its last control token
    return max((completion.rfind(c) + len(c) for c in t.control if c in completion),
               default=len(completion.rstrip())), ""


def _check_kept(m: dict, i: int, completion: str) -> None:
    """What the row carries must be in what is trained: the message's content, reasoning and tool calls (templates
    strip text; Qwen-style ones re-render inline <think> reasoning, so its parts are looked for one by one)."""
    head, _, answer = (m.get("content") or "").rpartition("</think>")  # without </think>: head "", answer all of it
    if any(p.strip() not in completion for p in (answer, head.split("<think>")[-1])):
        raise Unsupported("drops_content", f"message {i}: the chat template drops (or rewrites) its content")
    reasoning = (m.get("reasoning_content") or "").strip()
    if reasoning and reasoning not in completion:
        raise Unsupported("drops_reasoning", f"message {i}: the chat template drops its reasoning")
    own = json.dumps([m.get("content"), reasoning], ensure_ascii=False)  # a name there does not count
    for call in m.get("tool_calls") or ():
        name = call["function"]["name"]
        expected = own.count(name) + sum(c["function"]["name"] == name for c in m["tool_calls"])
        if completion.count(name) < expected:
            raise Unsupported("drops_tool_calls", f"message {i}: the chat template drops its tool call '{name}'")


def _encode(tokenizer, t: _Template, text: str, spans, max_seq_len: int, where: str) -> dict:
    # Spans: (message index, start, end) of the trained text. The template already holds bos etc.: this is exactly
    # what apply_chat_template(tokenize=True) feeds the model (checked on the first row).
    if t.backend is not None:
        enc = t.backend.encode(text, add_special_tokens=False)
        ids, offsets = enc.ids, enc.offsets
    else:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if "offset_mapping" not in enc:
            raise DataError(f"{where}: the tokenizer ({type(tokenizer).__name__}) gives no character offsets, so "
                            f"labels cannot be placed; use a fast (tokenizers-backed) tokenizer")
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
    ids = np.asarray(ids, dtype=np.int64)
    starts, ends = np.asarray(offsets, dtype=np.int64).reshape(-1, 2).T
    is_added = t.is_added[np.minimum(ids, len(t.is_added) - 1)] & (ids < len(t.is_added))
    owner = np.full(len(ids), -1)  # the index of the span each token is trained for (-1: none)
    for k, (_, a, b) in reversed(list(enumerate(spans))):  # reversed: a token touching two spans belongs to the first
        # Every token that holds answer text, also one straddling the prompt/answer boundary ('ĠParis' after a
        # prompt ending in ' ', an end-of-turn token with rstrip that swallowed the '\n' after it), but never a
        # template token that only swallowed the answer's leading whitespace (a header with rstrip).
        owner[(starts < b) & (ends > a) & ((starts >= a) | ~is_added)] = k
    labels = np.where(owner >= 0, ids, IGNORE_INDEX)
    kept = np.unique(owner[:max_seq_len])  # turns with a label left after truncation
    return {"input_ids": ids[:max_seq_len].tolist(), "labels": labels[:max_seq_len].tolist(),
            "turns": [spans[k][0] for k in kept if k >= 0]}


def tokenize_messages(tokenizer, messages: list[dict], max_seq_len: int, where: str = "", tools=None,
                      on_unsupported: str = "error") -> tuple[list[dict], str | None]:
    """Samples ({'input_ids', 'labels', 'turns', 'split'}) of one conversation by the rule in the module docstring,
    in the order of their first trained turn; or ([], reason) for a row that is dropped. A row the template cannot
    hold raises DataError (on_unsupported="error") or is dropped with the Unsupported reason ("drop")."""
    where = where or "conversation"
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: the tokenizer has no chat template; use a chat/instruct model's tokenizer")
    # An assistant message that opens the conversation (a greeting) is context only: no prompt precedes it at inference
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("train", True) and i > 0]
    if not trained:
        return [], "no_assistant"
    t = template_of(tokenizer)
    msgs = _prepared(messages, t.args_as_string[bool(tools)])
    try:
        full = t.render(msgs, tools, False)
        main_text, main, alone = full, [], []
        for i in trained:
            prompt = t.render(msgs[:i], tools, True)
            upto = full if i == len(msgs) - 1 else t.render(msgs[: i + 1], tools, False)
            start = len(prompt) if upto.startswith(prompt) else _answer_start(t, msgs, i, tools, prompt, upto)
            if start is None:
                raise Unsupported("not_prefix", f"message {i}: the chat template renders it differently from its "
                                                f"generation prompt, so there is no answer to train")
            length, stop = _turn_length(tokenizer, t, msgs, i, tools, upto[start:])
            completion = upto[start:start + length]
            if not completion:
                raise Unsupported("drops_message", f"message {i}: the chat template renders nothing for it")
            completion += stop
            _check_kept(messages[i], i, completion)
            if tools and i == trained[0] and t.render(msgs[:i], None, True) == prompt:
                raise Unsupported("drops_tools", f"message {i}: the chat template does not show the row's tools")
            span = (i, len(prompt), len(prompt) + len(completion))
            if main_text.startswith(prompt + completion):
                main.append(span)
            elif stop and i == len(msgs) - 1 and main_text.startswith(prompt + completion[:-len(stop)]):
                main_text = prompt + completion  # the stop token the last turn's template does not write
                main.append(span)
            else:  # "history": the full rendering shows this turn differently; "context": what precedes it differs
                alone.append((prompt + completion, [span], "history" if full.startswith(prompt) else "context"))
    except Unsupported as e:
        if e.reason == "template_error" and not str(e).startswith("message"):  # name the first message it fails on
            k = next((k for k in range(len(msgs)) if _try_render(tokenizer, msgs[: k + 1], tools) is None), None)
            e = Unsupported(e.reason, f"message {k}: {e}" if k is not None else str(e))
        if on_unsupported != "drop":
            raise DataError(f"{where}: {e} (data.on_unsupported=\"drop\" skips such rows)") from e
        return [], e.reason
    if main and not t.checked:  # once: our rendering and tokenization are what the library itself gives
        ref = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=True)
        ref = list(ref["input_ids"] if isinstance(ref, Mapping) else ref)
        if t.backend is not None and t.backend.encode(full, add_special_tokens=False).ids != ref:
            t.backend = None
        if t.backend is None and list(tokenizer(full, add_special_tokens=False)["input_ids"]) != ref:
            raise DataError(f"{where}: tokenizing the rendered text differs from apply_chat_template(tokenize=True)")
        t.checked = True
    samples = [{**_encode(tokenizer, t, text, spans, max_seq_len, where), "split": why}
               for text, spans, why in ([(main_text, main, "")] if main else []) + alone]
    samples = sorted((s for s in samples if s["turns"]), key=lambda s: s["turns"][0])
    return (samples, None) if samples else ([], "no_labels_after_truncation")
