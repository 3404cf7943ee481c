"""Labelling's optional parts (tokenize_messages' and build_samples' labelling=): the hint of a not_prefix turn (the
template switch that makes it trainable) and the reuse of a shared prefix's tokens (a speed-up; the same labels)."""
from __future__ import annotations

import bisect
import os
import weakref
from functools import partial
from types import SimpleNamespace

import jinja2.meta

from ..data import build_samples as build_one, tokenize_messages as label
from ..data.labels import _render_or_none, _tokens
from ..data.template import Template

_SWITCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_REUSE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # whether reuse gives the same tokens (checked once)


def switches(t: Template) -> list[str]:
    """The template's variables that may switch thinking off (enable_thinking, ...), not set to false already."""
    if t not in _SWITCHES:
        texts = t.text.values() if isinstance(t.text, dict) else [t.text]
        names = set().union(*(jinja2.meta.find_undeclared_variables(t.compiled[False].environment.parse(x))
                              for x in texts))
        _SWITCHES[t] = sorted(n for n in names if ("think" in n or "reason" in n) and t.kwargs.get(n) is not False)
    return _SWITCHES[t]


def hint(t: Template, msgs, i: int, tools) -> str:
    """The hint for message i, which does not extend its generation prompt (a generation prompt opening a think
    block), or ""."""
    for name in switches(t):
        off = {name: False}
        prompt = _render_or_none(t, msgs[:i], tools, True, **off)
        upto = _render_or_none(t, msgs[:i + 1], tools, False, **off)
        if prompt is not None and upto is not None and upto.startswith(prompt):
            return (f"; data.chat_template_kwargs.{name}=false renders the generation prompt without it, which makes "
                    f"such turns trainable")
    history, prompt = _render_or_none(t, msgs[:i], tools, False), _render_or_none(t, msgs[:i], tools, True)
    if (history is not None and prompt is not None and prompt.startswith(history) and not msgs[i].get("thinking")
            and "think" in prompt[len(history):].lower()):
        return ("; its generation prompt opens a thinking block, this turn has no reasoning, and the template reads "
                "no switch (such as enable_thinking) that turns thinking off: give the turn reasoning_content")
    return ""


def tokens(tokenizer, t: Template, text: str, where: str, base, main_text: str) -> tuple[list, tuple, tuple]:
    """labels._tokens of `text`, reusing `base`'s tokens (the first sample's) before the last added token within the
    characters `text` shares with `main_text` (the row's rendering)."""
    if _REUSE.get(t) is not False:
        ids, starts, ends = base
        k = bisect.bisect_right(ends, len(os.path.commonprefix([main_text, text])))
        while k and ids[k - 1] not in t.added:
            k -= 1
        if k > 1:
            cut = starts[k - 1]
            rest_ids, rest_starts, rest_ends = _tokens(tokenizer, t, text[cut:], where)
            got = (ids[:k - 1] + rest_ids, starts[:k - 1] + tuple(a + cut for a in rest_starts),
                   ends[:k - 1] + tuple(b + cut for b in rest_ends))
            if t not in _REUSE:
                _REUSE[t] = list(got[0]) == list(_tokens(tokenizer, t, text, where)[0])
            if _REUSE[t]:
                return got
    return _tokens(tokenizer, t, text, where)


LABELLING = SimpleNamespace(hint=hint, tokens=tokens)
tokenize_messages = partial(label, labelling=LABELLING)  # data.tokenize_messages, with these parts
build_samples = partial(build_one, labelling=LABELLING)  # data.build_samples, with these parts
