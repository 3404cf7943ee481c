"""What every command shares: the common options, the config from preset + flags + overrides, flag checks."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .config import Config, ConfigError, get_key, load_config
from .keys import parse_value

OVERRIDES = typer.Argument(None, help="Config overrides as section.key=value, e.g. train.lr=1e-4 data.max_seq_len=4096",
                           show_default=False)
CONFIG = typer.Option(None, "--config", "-c", help="TOML preset (default: configs/tiny.toml, the embedded demo)")
MODEL = typer.Option(None, "--model", help="HF hub id, HF model dir or prepared checkpoint (model.path)")
DATASET = typer.Option(None, "--dataset", help="hub id or .json/.jsonl/.parquet file or dir (data.path)")
OUTPUT = typer.Option(None, "--output-dir", "-o", help="where metrics, config and checkpoints go (output_dir)")
NPROC = typer.Option(1, "--nproc-per-node", help="local ranks, launched with torch's elastic launcher")
DEBUG = typer.Option(False, "--debug", help="show tracebacks")


FLAGS = {"model.path": "--model", "data.path": "--dataset", "output_dir": "--output-dir"}  # what a command must have


def build_config(config: Optional[Path], overrides: Optional[List[str]], check=True, checks=None, **flags) -> Config:
    """Preset + flags (by their config keys) + key=value overrides, validated (also by `checks.validate`: the
    extensions' keys), FLAGS set; with check, the paths (and `checks.probe`: the hub)."""
    values = {key: value for key, value in flags.items() if value is not None}
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' must look like section.key=value")
        values[key.strip()] = parse_value(value.strip())
    cfg = load_config(config, values)
    if checks:
        checks.validate(cfg)
    for key, flag in FLAGS.items():
        if not get_key(cfg, key) and not (key == "data.path" and cfg.data.sources):
            raise ConfigError(f"{key} is not set: pass {flag} or set {key} in the config")
    if check:
        check_paths(cfg)
        if checks:
            checks.probe(cfg)
    return cfg


def remote_paths(cfg: Config) -> dict[str, str]:
    """{key: value} of the config's paths not on this machine (hub ids, or files that do not exist)."""
    paths = {"model.path": cfg.model.path, "data.path": cfg.data.path, "eval.path": cfg.eval.path,
             **{f"data.sources[{j}].path": src.path for j, src in enumerate(cfg.data.sources)}}
    return {k: v for k, v in paths.items() if v and not Path(v).expanduser().exists()}


def check_paths(cfg: Config) -> None:
    """Before torch is imported: a missing local-looking path, an output dir that is a file."""
    for key, value in remote_paths(cfg).items():
        if value.startswith((".", "/", "~")) or value.endswith((".json", ".jsonl", ".parquet")):
            raise ConfigError(f"{key.replace('.', ' ')} '{value}' does not exist")
    if Path(cfg.output_dir).exists() and not Path(cfg.output_dir).is_dir():
        raise ConfigError(f"output_dir {cfg.output_dir} is a file, not a directory")


def check_flag(flag: str, ok: bool, rule: str, value) -> None:
    if not ok:
        raise ConfigError(f"{flag} must be {rule}, got {value}")
