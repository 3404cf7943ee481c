"""What finetune learns once per tokenizer, chat template and kwargs: how to render, tool-call arguments, turn ends."""

from __future__ import annotations

import json
import os
import weakref

from ..compat import compile_jinja_template
from ..errors import one_line
from .formats import DataError

_PROBE, _NEXT = "finetuneprobe", "nextturnmarker"  # stand-ins for row text, to find the template's own text
_TEMPLATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# The names rows and servers give a turn's reasoning (vLLM and OpenAI's APIs now say `reasoning`, GPT-OSS templates
# read `thinking`): a template may read any of them, so the template gets it under each, whichever the row used
REASONING_NAMES = ("reasoning_content", "reasoning", "thinking")


class Unsupported(DataError):
    """The template cannot hold this turn (or row); `reason` names why (counted under data.on_unsupported="drop")."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def require_chat_template(tokenizer, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: the tokenizer has no chat template; set data.chat_template to a Jinja file (or a "
                        f"tokenizer dir with one), or use a chat/instruct model's tokenizer")


class Template:
    """One tokenizer + template + template kwargs, learned once (see the module docstring; template_of caches it)."""

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
            as_dict = render_or_why(tokenizer, conv, tools, extra)[0]
            as_str = render_or_why(tokenizer, _args_as_strings(conv), tools, extra)[0]
            self.args_as_string[has_tools] = (bool(as_str) and (as_dict is None or "{'a': " in as_dict)
                                              and '{\\"a\\"' not in as_str)
        # Content parts reach a template that reads them as the row has them; one that prints content as a string
        # would print a list's Python repr: it gets their text, as inference servers give such templates.
        asked = [{"role": "user", "content": [{"type": "text", "text": _PROBE}]}]
        parts = render_or_why(tokenizer, asked, None, extra)[0] or render_or_why(tokenizer, asked, schema, extra)[0]
        self.reads_parts = bool(parts) and _PROBE in parts and "'text'" not in parts and '"text"' not in parts
        self.kwargs = {**tokenizer.special_tokens_map, **extra}  # as apply_chat_template passes them
        # The compiled template called directly on prepared messages renders as apply_chat_template does (the first
        # row is checked against it) without its per-call deep copy of the conversation: labelling renders each
        # row about twice per turn.
        self.compiled = {has: compile_jinja_template(tokenizer.get_chat_template(None, [{}] if has else None))
                         for has in (False, True)}  # a template dict may have its own "tool_use" template

    def render(self, messages: list[dict], tools, generation_prompt: bool, **extra) -> str:
        """The template's text for prepared messages (extra: kwargs over the run's); Unsupported if it raises."""
        try:
            return self.compiled[bool(tools)].render(messages=messages, tools=tools, documents=None,
                                                     add_generation_prompt=generation_prompt,
                                                     **{**self.kwargs, **extra})
        except Exception as e:  # noqa: BLE001 - template errors are about this row
            raise Unsupported("template_error", f"chat template failed ({one_line(e)})") from e


def render_or_why(tokenizer, messages, tools, extra: dict) -> tuple[str | None, str]:
    """(apply_chat_template's text, "") or (None, why it failed): a probe's rendering."""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **extra), ""
    except Exception as e:  # noqa: BLE001 - only a probe
        return None, one_line(e)


def _args_as_strings(messages: list[dict]) -> list[dict]:
    return [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(
        c["function"]["arguments"], ensure_ascii=False)}} for c in m["tool_calls"]]} if m.get("tool_calls") else m
        for m in messages]


def template_of(tokenizer, extra: dict | None = None) -> Template:
    t = _TEMPLATES.get(tokenizer)
    if t is None or t.text != tokenizer.chat_template or t.extra != (extra or {}):
        t = _TEMPLATES[tokenizer] = Template(tokenizer, dict(extra or {}))
    return t


def prepared(messages: list[dict], args_as_string: bool, reads_parts: bool = True) -> list[dict]:
    """Messages as apply_chat_template hands them to the template (null keys dropped, reasoning under each name
    REASONING_NAMES, content parts as text where the template does not read parts)."""
    out = []
    for m in _args_as_strings(messages) if args_as_string else messages:
        m = {k: v for k, v in m.items() if v is not None and k != "train"}
        if not reads_parts and isinstance(m.get("content"), list):
            m["content"] = "".join(part["text"] for part in m["content"])
        out.append({**dict.fromkeys(REASONING_NAMES, m["reasoning_content"]), **m} if "reasoning_content" in m else m)
    return out


def _shape(m: dict) -> tuple:
    return bool(m.get("content")), bool(m.get("reasoning_content")), len(m.get("tool_calls") or ())


def _probe_tail(tokenizer, t: Template, messages, i, tools) -> tuple[str, int | None, str] | None:
    """(tail, cut, stop): the text the template writes after message i's last row text, how much of it the model
    emits (through the end-of-turn token; None: no token), and where the template writes none (GLM-style) the next
    role's control token, which the model must emit to stop ("" otherwise)."""
    m = dict(messages[i])
    if m.get("content") or not m.get("tool_calls"):
        m["content"] = _like(m.get("content"), _PROBE)
    if m.get("tool_calls"):
        *calls, last = m["tool_calls"]
        fn = last["function"]
        args = {**fn["arguments"], _PROBE: _PROBE} if isinstance(fn["arguments"], dict) else json.dumps(
            {**json.loads(fn["arguments"]), _PROBE: _PROBE}, ensure_ascii=False)
        m["tool_calls"] = [*calls, {**last, "function": {**fn, "arguments": args}}]
    # A probe that cannot render (a template that checks what the row's messages carry) would leave the cut to a
    # guess (a tool call's closing token lost): the turn is refused instead.
    probe, why = render_or_why(tokenizer, messages[:i] + [m], tools, t.extra)
    if probe is None:
        raise Unsupported("probe_error", f"the chat template cannot render the probe that finds where this turn "
                                         f"ends ({why})")
    if _PROBE not in probe:
        return None
    tail = probe[probe.rfind(_PROBE) + len(_PROBE):]
    hits = sorted((p, -len(c), c) for c in t.control for p in find_all(tail, c))
    # What the template writes between this turn and the next one (a tool result after tool calls, else a user)
    more, why = render_or_why(tokenizer, messages[:i] + [m, _next_probe(messages, i, m)], tools, t.extra)
    if more is None:
        raise Unsupported("probe_error", f"the chat template cannot render the probe of what follows this turn, "
                                         f"which finds where it ends ({why})")
    more = more[more.rfind(_PROBE) + len(_PROBE):more.rfind(_NEXT)] if _NEXT in more else None
    if not hits:
        return tail, None, _next_control(t, more, len(tail))
    # Several control tokens (Phi-3's '<|end|>\n<|endoftext|>', Qwen's '</tool_call><|im_end|>'): the turn ends at
    # the last one the template also writes when the conversation goes on; text only at the very end of a
    # conversation (an eos) is not emitted by the model. None in common (GPT-OSS <|return|> vs <|end|>): the first.
    cut = hits[0][0] + len(hits[0][2])
    if more is not None:
        common = len(os.path.commonprefix([tail, more]))
        inside = [h for h in hits if h[0] + len(h[2]) <= common]
        # A template that writes a turn after every conversation (Command R+'s tool-use instruction) opens it with
        # the token that opens the next message: the turn ends before the token its generation prompt opens with.
        opener = _opener(tokenizer, t, messages[:i] + [m], tools, probe) if len(inside) > 1 else ""
        inside = [h for h in inside if not (opener and h[0] >= tail.find(opener, 1) > 0)]
        cut = max((p + len(c) for p, _, c in inside), default=cut)
    stop = ""
    if m.get("tool_calls"):  # tags close a tool call; where plain answers end with the next role's token, so do calls
        plain = _probe_tail(tokenizer, t, [*messages[:i], {"role": "assistant", "content": "x"}], i, tools)
        if plain is not None and plain[1] is None and plain[2]:
            stop = _next_control(t, more, cut)
    return tail, cut, stop


def _opener(tokenizer, t: Template, messages, tools, text: str) -> str:
    """The first control token the generation prompt adds after `messages` (rendered as `text`), or ""."""
    gen = render_or_why(tokenizer, messages, tools, {**t.extra, "add_generation_prompt": True})[0] or ""
    gen = gen[len(text):] if gen.startswith(text) else ""
    return min(((gen.find(c), -len(c), c) for c in t.control if c in gen), default=(0, 0, ""))[2]


def _like(content, text: str):
    return [{"type": "text", "text": text}] if isinstance(content, list) else text


def _next_probe(messages: list[dict], i: int, m: dict) -> dict:
    """The message after turn i in probes: a tool result after tool calls, else a user turn (the row's own if any)."""
    role = "tool" if m.get("tool_calls") else "user"
    after = messages[i + 1] if i + 1 < len(messages) else {}
    shape = next((x.get("content") for x in messages[:i + 1] if isinstance(x.get("content"), list)), None)
    if after.get("role") == role:
        return {**after, "content": _like(after.get("content") or shape, _NEXT)}
    if role == "tool":
        last = m["tool_calls"][-1]
        ids = {"tool_call_id": last["id"]} if last.get("id") else {}
        return {"role": "tool", "content": _like(shape, _NEXT), **ids, "name": last["function"]["name"]}
    return {"role": "user", "content": _like(shape, _NEXT)}


def _next_control(t: Template, more: str | None, cut: int) -> str:
    """The control token that opens the next turn right after `cut` (whitespace before it included), or ""."""
    rest = more[cut:] if more is not None else ""
    stop = next((c for c in sorted(t.control, key=len, reverse=True) if rest.lstrip().startswith(c)), "")
    return rest[:rest.find(stop) + len(stop)] if stop else ""


def find_all(text: str, sub: str):
    p = text.find(sub)
    while p >= 0:
        yield p
        p = text.find(sub, p + 1)


def turn_length(tokenizer, t: Template, messages, i, tools, completion: str) -> tuple[int, str]:
    """(how much of completion_i is trained, the stop token to add after it): see _probe_tail."""
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
