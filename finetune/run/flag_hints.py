"""Config keys as hints for unknown flags: `finetune sft --lr 1e-4` says to write train.lr=1e-4."""
from __future__ import annotations

import typer
try:  # typer >= 0.22 carries its own click
    from typer._click.exceptions import NoSuchOption
except ImportError:
    from click.exceptions import NoSuchOption

from ..args import FLAGS
from ..config import Config
from ..keys import closest_key, meant_key

# the keys that a command may take as a flag
KEY_FLAGS = {**FLAGS, "checkpoint.resume_from": "--resume-from"}


class Commands(typer.core.TyperGroup):
    """The commands; an unknown --flag that names a config key says how to set it (`--lr` -> train.lr=VALUE), or
    names the command's flag that other tools spell so (`--out` -> --output-dir, `--nproc` -> --nproc-per-node)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except NoSuchOption as e:
            key = e.option_name.lstrip("-").replace("-", "_")
            command = self.commands[ctx.invoked_subcommand]
            meant = meant_key(key) or ""
            flag = meant if meant.startswith("--") else KEY_FLAGS.get(meant)
            if flag in {o for p in command.params for o in getattr(p, "opts", ())}:
                e.message, e.possibilities = f"No such option: {e.option_name} (did you mean {flag}?)", None
                raise
            hint = closest_key(key, Config)  # " (did you mean 'train.lr'?)"
            takes_keys = any(p.name == "overrides" for p in command.params)
            # click's own near flag wins (--outpt -> --output-dir), except its --help for anything short
            if hint and takes_keys and ("." in hint or not [p for p in e.possibilities or [] if p != "--help"]):
                e.message, e.possibilities = f"No such option: {e.option_name}{hint[:-2]} as a key=value " \
                                             "override?)", None
            raise
