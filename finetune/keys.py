"""Dotted config keys on the config dataclasses: `set_key` (checked), `get_key`, `parse_value`, closest-key hints."""
from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
from dataclasses import fields
from functools import reduce
from typing import Any, get_args, get_type_hints, Literal

from .errors import FinetuneError


class ConfigError(FinetuneError, ValueError):
    """A bad key or value; the message is one line that names it."""


def _closest(name: str, options) -> str:
    match = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean '{match[0]}'?)" if match else ""


# The names other tools (HF Trainer, torchrun, torchtune, axolotl, nanoGPT) give our settings, by meaning, before
# spelling: by spelling alone `epochs` is train.eps (the optimizer's epsilon) and `out` is lora.dropout.
MEANINGS = {
    "train.max_steps": "epochs num_epochs num_train_epochs steps train_steps total_steps iters max_iters",
    "train.lr": "learning_rate peak_lr", "train.micro_batch_size": "batch_size per_device_train_batch_size bs",
    "train.grad_accum_steps": "gradient_accumulation_steps grad_accum accum_steps",
    "train.warmup_steps": "warmup num_warmup_steps", "train.max_grad_norm": "grad_clip clip_grad gradient_clipping",
    "train.weight_decay": "wd", "train.mixed_precision": "precision dtype bf16 fp16",
    "data.max_seq_len": "seq_len max_length max_seq_length seq_length context_length cutoff_len block_size",
    "lora.rank": "lora_r r", "ac.ratio": "gradient_checkpointing activation_checkpointing",
    "checkpoint.interval": "save_steps save_interval", "checkpoint.keep": "save_total_limit",
    "train.log_interval": "logging_steps log_every", "eval.path": "eval_file eval_data eval_dataset",
    "log.wandb": "report_to use_wandb",
    "output_dir": "out output output_path save_dir", "model.path": "model_name_or_path model_name base_model",
    "data.path": "dataset_path train_file data_path", "checkpoint.resume_from": "resume_from_checkpoint",
    "--nproc-per-node": "nproc nprocs nproc_per_node gpus num_gpus ngpus devices",
}
MEANT = {name: target for target, names in MEANINGS.items() for name in names.split()}


def meant_key(name: str) -> str | None:
    """The key (or a flag: '--nproc-per-node') that other tools' name `name` means: 'epochs' -> 'train.max_steps'."""
    return MEANT.get(name.lower().replace("-", "_"))


def closest_key(dotted: str, root: type) -> str:
    """The hint " (did you mean 'train.lr'?)" for `lr`, `data.lr`, `trian.lr`, `lrr` or `learning_rate`; "" when none
    is close."""
    if meant := meant_key(dotted.split(".")[-1]):
        return f" (did you mean '{meant}'?)"
    hints = get_type_hints(root)
    keys = [f.name for f in fields(root)] + [f"{f.name}.{g.name.rstrip('_')}" for f in fields(root)
                                             if dataclasses.is_dataclass(hints[f.name]) for g in fields(hints[f.name])]
    leaf, leaves = dotted.split(".")[-1], [k.split(".")[-1] for k in keys]
    near = difflib.get_close_matches(leaf, leaves, n=1)  # last: `sead` -> train.seed
    match = [k for k in keys if k.endswith(f".{leaf}")] or difflib.get_close_matches(dotted, keys, n=1) or \
        [k for k in keys if near and k.endswith(f".{near[0]}")]
    return f" (did you mean {' or '.join(repr(k) for k in match[:3])}?)" if match else ""


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """`value` checked against the field type (ints are accepted for floats)."""
    if getattr(typ, "__origin__", None) is Literal:
        choices = get_args(typ)
        if value not in choices:
            hint = _closest(str(value), choices) if isinstance(value, str) else ""
            raise ConfigError(f"{key} must be one of {', '.join(map(repr, choices))}, got {value!r}{hint}")
        return value
    if getattr(typ, "__origin__", None) is list:  # an array of tables (data.sources)
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise ConfigError(f"{key} must be an array of tables, e.g. [{{path = \"a.jsonl\", weight = 2}}], got "
                              f"{value!r}")
        items = [get_args(typ)[0]() for _ in value]
        for j, (item, table) in enumerate(zip(items, value)):
            for k, v in flatten(table).items():
                set_key(item, k, v, f"{key}[{j}].")
                # 0 is what an unset weight/samples/epochs reads as (one epoch of the source): a written 0, meant
                # as "none of it", would train all of it. Refused; to_toml never writes these zeros.
                if k in ("weight", "samples", "epochs") and v == 0:
                    raise ConfigError(f"{key}[{j}].{k} = 0 would take none of {table.get('path', 'the source')}, "
                                      f"but an unset {k} reads as 0 (one epoch of it): remove the source to leave "
                                      f"it out")
        return items
    if isinstance(typ, types.UnionType):  # str | list: any of the members
        if not any(isinstance(value, t) for t in get_args(typ)):
            raise ConfigError(f"{key} must be {' or '.join(t.__name__ for t in get_args(typ))}, got {value!r}")
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    ok = isinstance(value, bool) if typ is bool else isinstance(value, typ) and not isinstance(value, bool)
    if not ok:
        raise ConfigError(f"{key} must be {typ.__name__}, got {value!r}")
    # torch and numpy hold an int in 64 bits: a bigger one fails deep inside them, after the model has loaded
    if typ is int and not -2**63 <= value < 2**63:
        raise ConfigError(f"{key} must be below 2**63 in size, got {value!r}")
    if typ is float and not math.isfinite(value):  # TOML has inf and nan; no setting means them
        raise ConfigError(f"{key} must be a finite number, got {value!r}")
    return value


def set_key(cfg, dotted: str, value: Any, prefix: str = "") -> None:
    """Set `section.key` (top-level, or `section.table.key` of a dict key) on cfg, checking the key and the type."""
    parts = dotted.split(".")
    target, full = cfg, prefix + dotted
    for i, part in enumerate(parts):
        names = {f.name.rstrip("_"): f.name for f in fields(target)}  # async_ is TOML's `async` (a Python keyword)
        if part not in names:
            where = (prefix + ".".join(parts[:i])).rstrip(".") or "the top level"
            hint = _closest(part, names) if i and not meant_key(part) else ""  # in its section (train.lrr -> lr)
            hint = hint or (closest_key(dotted, type(cfg)) if not prefix else "") or _closest(part, names)
            raise ConfigError(f"unknown config key '{full}'{hint}; keys in {where}: {', '.join(sorted(names))}")
        name = names[part]
        typ = get_type_hints(type(target))[name]
        if typ is dict and i < len(parts) - 1:  # one entry of a table (nested tables: one level per part)
            table = getattr(target, name)
            for key in parts[i + 1:-1]:
                table = table.setdefault(key, {})
            table[parts[-1]] = value
            return
        if i < len(parts) - 1:
            target = getattr(target, name)
            if not dataclasses.is_dataclass(target):
                raise ConfigError(f"unknown config key '{full}': '{'.'.join(parts[:i + 1])}' is not a section")
        elif dataclasses.is_dataclass(typ):
            raise ConfigError(f"'{full}' is a section; set one of its keys, e.g. {full}.{fields(typ)[0].name}=...")
        else:
            setattr(target, name, _coerce(full, value, typ))


def parse_value(text: str) -> Any:
    """A CLI override value in TOML syntax (numbers, true/false, "strings"); bare words are strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def flatten(table: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in table.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def get_key(cfg, dotted: str) -> Any:
    """cfg's value at `section.key` (TOML's `async` is the field async_)."""
    return reduce(lambda obj, part: getattr(obj, part if hasattr(obj, part) else part + "_"), dotted.split("."), cfg)
