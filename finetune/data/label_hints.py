"""The hint of a not_prefix turn (tokenize_messages' hint=): the template switch that, set to false, makes it
trainable (a generation prompt opening a think block)."""
from __future__ import annotations

import weakref
from functools import partial

import jinja2.meta

from . import build_samples as build_one, tokenize_messages as label
from .labels import _render_or_none
from .template import Template

_SWITCHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def switches(t: Template) -> list[str]:
    """The template's variables that may switch thinking off (enable_thinking, ...), not set to false already."""
    if t not in _SWITCHES:
        texts = t.text.values() if isinstance(t.text, dict) else [t.text]
        names = set().union(*(jinja2.meta.find_undeclared_variables(t.compiled[False].environment.parse(x))
                              for x in texts))
        _SWITCHES[t] = sorted(n for n in names if ("think" in n or "reason" in n) and t.kwargs.get(n) is not False)
    return _SWITCHES[t]


def way_out(t: Template, msgs, i: int, tools) -> str:
    """The hint for message i, which does not extend its generation prompt, or ""."""
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


tokenize_messages = partial(label, hint=way_out)  # data.tokenize_messages, with the hint
build_samples = partial(build_one, hint=way_out)  # data.build_samples, with the hint
