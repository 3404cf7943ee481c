"""data.chat_template: a Jinja file's (or another tokenizer's) chat template replaces the model's; it is saved with
the run's checkpoints and a resumed run keeps it (run_tokenizer). data.chat_template_kwargs must name variables the
template reads."""
from __future__ import annotations

import difflib
from pathlib import Path

from .. import checkpoint as ckpt
from ..compat import compile_jinja_template
from ..config import Config, ConfigError
from . import DataError
from ..distributed import print0
from ..errors import one_line
from ..model import load_tokenizer


def read_chat_template(path: str) -> str | dict:
    """data.chat_template's template (a Jinja file's text, or a tokenizer dir's), checked to be one that compiles."""
    try:
        if not Path(path).is_dir():
            template = Path(path).expanduser().read_text(encoding="utf-8")
            if not template.strip():
                raise DataError(f"data.chat_template: {path} is empty; give a Jinja chat template (or unset the key "
                                f"to use the model's own)")
        else:
            from transformers import AutoTokenizer
            template = AutoTokenizer.from_pretrained(path).chat_template
    except (OSError, ValueError) as e:
        raise DataError(f"data.chat_template: cannot read {path} ({one_line(e)})") from e
    if not template:
        raise DataError(f"data.chat_template: the tokenizer in {path} has no chat template")
    from jinja2 import TemplateSyntaxError
    for name, text in (template.items() if isinstance(template, dict) else [("", template)]):
        try:
            compile_jinja_template(text)
        except TemplateSyntaxError as e:
            raise DataError(f"data.chat_template: {path}{f' ({name!r} template)' if name else ''} line {e.lineno}: "
                            f"Jinja syntax error ({one_line(e.message or e)})") from None
    return template


def check_template_kwargs(tokenizer, kwargs: dict | None) -> None:
    """Refuse a data.chat_template_kwargs key the chat template never reads as a variable: a misspelt switch would
    change nothing, silently, and be written into the exported template. A key it reads is never refused."""
    template = getattr(tokenizer, "chat_template", None)
    if not kwargs or not template:
        return
    import jinja2.meta
    read = set().union(*(jinja2.meta.find_undeclared_variables(compile_jinja_template(text).environment.parse(text))
                         for text in (template.values() if isinstance(template, dict) else [template])))
    for key in kwargs:
        if key not in read:
            near = difflib.get_close_matches(key, sorted(read), n=1)
            raise ConfigError(f"data.chat_template_kwargs.{key}: the chat template never reads {key!r}, so it would "
                              f"change nothing{f' (did you mean {near[0]}?)' if near else ''}; fix or remove the key")


def run_tokenizer(cfg: Config, resume_dir: Path | None = None):
    """(the tokenizer with data.chat_template's template, that template or None); resuming: the checkpoint's."""
    path, template = cfg.data.chat_template, None
    if path:
        template = ckpt.read_marker(resume_dir).get("chat_template") if resume_dir is not None else None
        if template and Path(path).exists() and read_chat_template(path) != template:
            print0(f"note: data.chat_template {cfg.data.chat_template} changed since {resume_dir}; resuming with the "
                   f"template saved with it")
        template = template or read_chat_template(path)
    tokenizer = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code, chat_template=template)
    # a template kwarg it never reads is refused at start-up (preflight), not after loading the model
    check_template_kwargs(tokenizer, cfg.data.chat_template_kwargs)
    return tokenizer, template
