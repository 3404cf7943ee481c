"""Exact labels: the tokens a model emits at inference for each assistant turn, in the context it sees there.

For assistant message i, prompt_i is the template's rendering of messages[:i] (with the row's tools) and a generation
prompt; completion_i is the rendering of messages[:i+1] minus prompt_i (where that rendering also changes the
history, as GPT-OSS does, what follows its generation prompt for message i), cut right after the end-of-turn token
that closes it. Turns whose prompt_i + completion_i begin the full rendering share one sample (the rendering of the
whole row); a turn the full rendering shows differently (reasoning dropped from history, a think block only in the
last turn, a system prompt moved) gets a sample of its own, prompt_i + completion_i. A turn that cannot be trained so
(Unsupported) is left untrained: it stays in the rendering as context of the later turns, which train as before.
"""

from __future__ import annotations

import bisect
import json
import os
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

from ..errors import one_line
from .formats import DataError

IGNORE_INDEX = -100
DROP_REASONS = ("no_assistant", "no_labels_after_truncation")
_PROBE, _NEXT = "finetuneprobe", "nextturnmarker"  # stand-ins for row text, to find the template's own text
_TEMPLATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Unsupported(DataError):
    """The template cannot hold this turn (or row); `reason` names why (counted under data.on_unsupported="drop")."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class Labelled(NamedTuple):
    samples: list[dict]  # {'input_ids', 'labels', 'turns', 'split'}, in the order of their first trained turn
    dropped: str | None  # why the row gives no sample (DROP_REASONS or an Unsupported reason), else None
    left_out: list[Unsupported]  # why each assistant turn left untrained is ("message i: ...", and its reason)


def require_chat_template(tokenizer, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: the tokenizer has no chat template; set data.chat_template to a Jinja file (or a "
                        f"tokenizer dir with one), or use a chat/instruct model's tokenizer")


def read_chat_template(path: str) -> str | dict:
    """The chat template of data.chat_template: a Jinja file, or a tokenizer dir's (chat_template.jinja, else
    tokenizer_config.json's "chat_template": a string, or named templates as a dict)."""
    p = Path(path).expanduser()
    if p.is_dir():
        config = p / "tokenizer_config.json"
        if (p / "chat_template.jinja").is_file():
            p = p / "chat_template.jinja"
        elif config.is_file() and json.loads(config.read_text(encoding="utf-8")).get("chat_template"):
            template = json.loads(config.read_text(encoding="utf-8"))["chat_template"]
            return template if isinstance(template, str) else {t["name"]: t["template"] for t in template}
        else:
            raise DataError(f"data.chat_template: {path} holds no chat template (chat_template.jinja or "
                            f"tokenizer_config.json's chat_template)")
    try:
        return p.read_text(encoding="utf-8")
    except OSError as e:
        raise DataError(f"data.chat_template: cannot read {path} ({e.strerror or one_line(e)})") from e


class _Template:
    """What we learn once per tokenizer + template: its control tokens, how it wants tool-call arguments, and the
    text it writes after a turn (cached by the shape of the message)."""

    def __init__(self, tokenizer, extra: dict):
        self.text, self.extra = tokenizer.chat_template, extra  # extra: data.chat_template_kwargs
        # Added tokens mark where a turn ends; whitespace ones (e.g. Gemma's "\n") are ordinary template text.
        added = tokenizer.added_tokens_decoder  # {id: AddedToken}
        self.added = set(added)
        self.control = [t.content for t in added.values() if t.content.strip()]
        self.tails: dict[tuple, tuple[str, int | None] | None] = {}
        self.checked = False  # our rendering + tokenization checked against apply_chat_template(tokenize=True) once
        self.reuse: bool | None = None  # whether _tokens' reuse of a shared prefix's tokens holds (checked once)
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
            as_dict = _try_render(tokenizer, conv, tools, extra)
            as_str = _try_render(tokenizer, _args_as_strings(conv), tools, extra)
            self.args_as_string[has_tools] = (bool(as_str) and (as_dict is None or "{'a': " in as_dict)
                                              and '{\\"a\\"' not in as_str)
        self.kwargs = {**tokenizer.special_tokens_map, **extra}  # as apply_chat_template passes them
        # The compiled template called directly on _prepared messages renders as apply_chat_template does (the first
        # row is checked against it) without its per-call deep copy of the conversation: labelling renders each
        # row about twice per turn.
        from transformers.utils.chat_template_utils import _compile_jinja_template
        self.compiled = {has: _compile_jinja_template(tokenizer.get_chat_template(None, [{}] if has else None))
                         for has in (False, True)}  # a template dict may have its own "tool_use" template

    def render(self, messages: list[dict], tools, generation_prompt: bool) -> str:
        """The template's text for _prepared messages; a template that raises is Unsupported("template_error")."""
        try:
            return self.compiled[bool(tools)].render(messages=messages, tools=tools, documents=None,
                                                     add_generation_prompt=generation_prompt, **self.kwargs)
        except Exception as e:  # noqa: BLE001 - template errors are about this row
            raise Unsupported("template_error", f"chat template failed ({one_line(e)})") from e


def _try_render(tokenizer, messages, tools, extra: dict):
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **extra)
    except Exception:  # noqa: BLE001 - only a probe
        return None


def _args_as_strings(messages: list[dict]) -> list[dict]:
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
        c["function"]["arguments"], ensure_ascii=False)}} for c in m["tool_calls"]]} if m.get("tool_calls") else m
        for m in messages]


def template_of(tokenizer, extra: dict | None = None) -> _Template:
    t = _TEMPLATES.get(tokenizer)
    if t is None or t.text != tokenizer.chat_template or t.extra != (extra or {}):
        t = _TEMPLATES[tokenizer] = _Template(tokenizer, dict(extra or {}))
    return t


def _prepared(messages: list[dict], args_as_string: bool) -> list[dict]:
    """Messages as apply_chat_template hands them to the template (null keys dropped, reasoning also as `thinking`,
    which GPT-OSS templates read), made once per row so that each prefix renders without copying."""
    out = []
    for m in _args_as_strings(messages) if args_as_string else messages:
        m = {k: v for k, v in m.items() if v is not None and k != "train"}
        out.append({"thinking": m["reasoning_content"], **m} if "reasoning_content" in m else m)
    return out


def prompt_text(tokenizer, messages: list[dict], tools=None, template_kwargs: dict | None = None) -> str:
    """The context the model answers after messages (prompt_i for what follows): rendered as the labels are."""
    t = template_of(tokenizer, template_kwargs)
    return t.render(_prepared(messages, t.args_as_string[bool(tools)]), tools, True)


def _answer_start(t: _Template, msgs, i, tools, prompt: str, upto: str) -> int | None:
    """Where message i's answer starts in `upto` when `upto` does not extend `prompt` because the template renders
    the history differently once message i follows (GPT-OSS drops the analysis of tool calls before a final
    answer, Mistral shows the system prompt only in the last user turn): right after the generation prompt that
    `upto` writes for message i (without one: after prompt's last character). That is the place whose preceding text
    ends as `prompt` does the longest, through the previous message's text at least, and after which `upto` holds
    nothing of the previous message as rendered (so never an earlier turn that answers the same question); None
    when no place is."""
    history = t.render(msgs[:i], tools, False)
    if not prompt.startswith(history):
        return None
    try:
        before = t.render(msgs[:i - 1], tools, False)
    except Unsupported:
        before = ""
    rendered = (history[len(before):] if history.startswith(before) else history).strip()  # the previous message
    gen, backwards = prompt[len(history):], prompt[::-1]
    text = msgs[i - 1].get("content")
    text = text.strip() if isinstance(text, str) else ""
    best, best_len = None, (len(prompt) - prompt.rfind(text) if text and text in prompt else len(gen) + 1) - 1
    key = gen or prompt[-1:]  # no generation prompt: every place where prompt's last character is
    for p in _find_all(upto, key):
        end = p + len(key)
        n = len(os.path.commonprefix([upto[end - 1::-1], backwards]))  # how far upto[:end] ends as prompt does
        if n > best_len and not (rendered and rendered in upto[end:]):
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
    probe = _try_render(tokenizer, messages[:i] + [m], tools, t.extra)
    if probe is None or _PROBE not in probe:
        return None
    tail = probe[probe.rfind(_PROBE) + len(_PROBE):]
    hits = sorted((p, -len(c), c) for c in t.control for p in _find_all(tail, c))
    # What the template writes between this turn and the next one (a tool result after tool calls, else a user)
    nxt = {"role": "tool" if m.get("tool_calls") else "user", "content": _NEXT}
    more = _try_render(tokenizer, messages[:i] + [m, nxt], tools, t.extra)
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


def _tokens(tokenizer, t: _Template, text: str, where: str, base=None, shared: int = 0) -> tuple[list, list]:
    """(ids, offsets) of `text`, exactly what apply_chat_template(tokenize=True) feeds the model (checked on the first
    row). base = (ids, offsets, ends) of a text whose first `shared` characters `text` shares: its tokens before the
    last added token ending within them are kept and only the rest is encoded (text left of an added token tokenizes
    on its own; checked once per template against a whole encode)."""
    if base is not None and t.reuse is not False:
        ids, offsets, ends = base
        k = bisect.bisect_right(ends, shared)
        while k and ids[k - 1] not in t.added:
            k -= 1
        if k > 1:
            cut = offsets[k - 1][0]
            rest_ids, rest = _tokens(tokenizer, t, text[cut:], where)
            got = ids[:k - 1] + rest_ids, offsets[:k - 1] + [(a + cut, b + cut) for a, b in rest]
            if t.reuse is None:
                t.reuse = list(got[0]) == list(_tokens(tokenizer, t, text, where)[0])
            if t.reuse:
                return got
    if t.backend is not None:
        enc = t.backend.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if "offset_mapping" not in enc:
        raise DataError(f"{where}: the tokenizer ({type(tokenizer).__name__}) gives no character offsets, so "
                        f"labels cannot be placed; use a fast (tokenizers-backed) tokenizer")
    return list(enc["input_ids"]), list(enc["offset_mapping"])


def _encode(t: _Template, ids: list, offsets: list, spans, max_seq_len: int) -> tuple[dict, list]:
    """The sample whose labels are the tokens of each span (message index, start, end) of trained text: every token
    that holds answer text, also one straddling the prompt/answer boundary ('ĠParis' after a prompt ending in ' ', an
    end-of-turn token with rstrip that swallowed the '\n' after it), never a template token that only swallowed the
    answer's leading whitespace (a header with rstrip); a token touching two spans is the first's. Offsets grow
    along the text, so each span is a range of tokens. Also returns the tokens' end offsets."""
    starts, ends = [a for a, _ in offsets], [b for _, b in offsets]
    labels, turns, done = [IGNORE_INDEX] * len(ids), [], 0
    for i, a, b in spans:
        lo, hi = max(bisect.bisect_right(ends, a), done), bisect.bisect_left(starts, b)
        while lo < hi and starts[lo] < a and ids[lo] in t.added:
            lo += 1
        labels[lo:hi] = ids[lo:hi]
        if lo < min(hi, max_seq_len):  # a label left after truncation
            turns.append(i)
        done = max(done, hi)
    return {"input_ids": list(ids[:max_seq_len]), "labels": labels[:max_seq_len], "turns": turns}, ends


def _turn(tokenizer, t: _Template, msgs, row_message: dict, i: int, tools, full: str, prompt: str | None):
    """(prompt_i, completion_i, the stop token ending it where the template writes none) of assistant message i, or
    Unsupported when the template cannot show it as at inference."""
    prompt = prompt if prompt is not None else t.render(msgs[:i], tools, True)
    upto = full if i == len(msgs) - 1 else t.render(msgs[: i + 1], tools, False)
    start = len(prompt) if upto.startswith(prompt) else _answer_start(t, msgs, i, tools, prompt, upto)
    if start is None:
        raise Unsupported("not_prefix", f"message {i}: the chat template renders it differently from its "
                                        f"generation prompt, so there is no answer to train")
    length, stop = _turn_length(tokenizer, t, msgs, i, tools, upto[start:])
    completion = upto[start:start + length]
    if not completion:
        raise Unsupported("drops_message", f"message {i}: the chat template renders nothing for it")
    _check_kept(row_message, i, completion + stop)
    return prompt, completion + stop, stop


def _refusal(where: str, e: Unsupported, what: str) -> str:
    return f'{where}: {e} ({e.reason}); data.on_unsupported="drop" leaves such {what} untrained and trains the rest'


def tokenize_messages(tokenizer, messages: list[dict], max_seq_len: int, where: str = "", tools=None,
                      on_unsupported: str = "error", template_kwargs: dict | None = None) -> Labelled:
    """The samples of one conversation by the rule in the module docstring, the turns left untrained and why, or why
    the row gives no sample. A turn (or a row: template_error, drops_tools) the template cannot hold raises DataError
    (on_unsupported="error") or is left untrained and reported ("drop")."""
    where = where or "conversation"
    require_chat_template(tokenizer, where)
    # An assistant message that opens the conversation (a greeting) is context only: no prompt precedes it at inference
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("train", True) and i > 0]
    if not trained:
        return Labelled([], "no_assistant", [])
    t = template_of(tokenizer, template_kwargs)
    msgs = _prepared(messages, t.args_as_string[bool(tools)])
    try:
        full = main_text = t.render(msgs, tools, False)
        first = t.render(msgs[:trained[0]], tools, True)
        if tools and t.render(msgs[:trained[0]], None, True) == first:
            raise Unsupported("drops_tools", f"message {trained[0]}: the chat template does not show the row's tools")
    except Unsupported as e:
        if e.reason == "template_error":  # name the first message it fails on
            k = next((k for k in range(len(msgs)) if _try_render(tokenizer, msgs[: k + 1], tools, t.extra) is None), 0)
            e = Unsupported(e.reason, f"message {k}: {e}")
        if on_unsupported != "drop":
            raise DataError(_refusal(where, e, "rows")) from e
        return Labelled([], e.reason, [])
    main, alone, left_out = [], [], []
    for i in trained:
        try:
            prompt, completion, stop = _turn(tokenizer, t, msgs, messages[i], i, tools, full,
                                             first if i == trained[0] else None)
        except Unsupported as e:
            e = e if str(e).startswith("message") else Unsupported(e.reason, f"message {i}: {e}")
            if on_unsupported != "drop":
                raise DataError(_refusal(where, e, "turns")) from e
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
    samples, base = [], None
    for text, spans, why in ([(main_text, main, "")] if main else []) + alone:
        shared = spans[0][1] if base is not None and main_text.startswith(text[:spans[0][1]]) else 0
        ids, offsets = _tokens(tokenizer, t, text, where, base if shared else None, shared)
        sample, ends = _encode(t, ids, offsets, spans, max_seq_len)
        base = base or (ids, offsets, ends)
        samples.append({**sample, "split": why})
    samples = sorted((s for s in samples if s["turns"]), key=lambda s: s["turns"][0])
    reason = None if samples else left_out[0].reason if not main and not alone else "no_labels_after_truncation"
    return Labelled(samples, reason, left_out)


def _check_tokenization(tokenizer, t: _Template, msgs, tools, full: str, where: str) -> None:
    ref = tokenizer.apply_chat_template(msgs, tools=tools, tokenize=True, **t.extra)
    ref = list(ref["input_ids"] if isinstance(ref, Mapping) else ref)
    if t.backend is not None and t.backend.encode(full, add_special_tokens=False).ids != ref:
        t.backend = None
    ids, offsets = _tokens(tokenizer, t, full, where)
    if list(ids) != ref:
        raise DataError(f"{where}: tokenizing the rendered text differs from apply_chat_template(tokenize=True)")
    if any(a[0] > b[0] or a[1] > b[1] for a, b in zip(offsets, offsets[1:])):
        raise DataError(f"{where}: the tokenizer's character offsets do not grow along the text; labels cannot be "
                        f"placed")
    t.checked = True
