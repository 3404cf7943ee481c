"""The run's data.chat_template_kwargs as defaults of the exported chat template (export.export_hf): what
renders the saved template (transformers, vLLM, SGLang, llama.cpp) renders it as training did when a request passes
none of them, and a request's own value still wins (servers take them per request or flag; no model file holds them)."""
from __future__ import annotations

import json


def jinja_literal(value) -> str:
    """`value` (what TOML holds: bool, number, string, array, table) as a Jinja literal; ValueError if none."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)) and json.dumps(value) not in ("Infinity", "-Infinity", "NaN"):
        return json.dumps(value)  # numbers and strings: JSON's spelling is Jinja's
    if isinstance(value, list):
        return "[" + ", ".join(map(jinja_literal, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {jinja_literal(v)}" for k, v in value.items()) + "}"
    raise ValueError(f"{value!r} has no Jinja literal")


def template_defaults(kwargs: dict) -> tuple[str, list[str]]:
    """(the Jinja that sets each of `kwargs` unless the caller passed it, the names it cannot set: not a Jinja
    name, or a value with no literal). It renders no text."""
    import jinja2
    head, skipped = "", []
    for k, v in kwargs.items():
        try:
            part = f"{{% if {k} is not defined %}}{{% set {k} = {jinja_literal(v)} %}}{{% endif %}}"
            jinja2.Environment().parse(part)
            head += part
        except (ValueError, jinja2.TemplateSyntaxError):
            skipped.append(k)
    return head, skipped


def with_template_defaults(template: str | dict, kwargs: dict) -> str | dict:
    """The chat template with `kwargs` (data.chat_template_kwargs) as defaults (template_defaults first).
    trim_blocks, which transformers sets, eats a newline the template starts with after the head: one is added."""
    if isinstance(template, dict):  # named templates (default, tool_use): each
        return {name: with_template_defaults(text, kwargs) for name, text in template.items()}
    head = template_defaults(kwargs)[0]
    return head + ("\n" if head and template.startswith("\n") else "") + template


def template_kwargs_note(kwargs: dict) -> str:
    """The summary line about the run's data.chat_template_kwargs in the exported chat template."""
    skipped = template_defaults(kwargs)[1]
    written = {k: v for k, v in kwargs.items() if k not in skipped}
    shown = ", ".join(f"{k}={json.dumps(v)}" for k, v in written.items())
    return ((f"chat template: the run's data.chat_template_kwargs ({shown}) are its defaults now (a request's "
             f"chat_template_kwargs still override them)" if written else "chat template: ")
            + (f"{'; ' if written else ''}{', '.join(skipped)} cannot be set in Jinja: pass "
               f"{'it' if len(skipped) == 1 else 'them'} with every request" if skipped else ""))
