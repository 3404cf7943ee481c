"""Typed run configuration: dataclasses with defaults and docs, TOML presets, dotted overrides, validation.

A run's config is built once: preset (configs/tiny.toml unless --config) -> CLI flags -> `section.key=value`
overrides -> `validate()`. Errors are `ConfigError`s whose message is one line naming the key.
"""
from __future__ import annotations

import dataclasses
import difflib
import tomllib
import types
from dataclasses import dataclass, field, fields
from functools import reduce
from pathlib import Path
from typing import Any, get_args, get_type_hints, Literal

from .errors import FinetuneError

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PRESET = REPO_ROOT / "configs" / "tiny.toml"


class ConfigError(FinetuneError, ValueError):
    """A bad key or value; the message is one line that names it."""


@dataclass
class ModelConfig:
    path: str = ""  # HF hub id, HF model dir, or a prepared checkpoint dir
    arch: str = ""  # an HF config.json of the model, for `finetune plan` when model.path is not at hand (offline)
    # auto: varlen on CUDA where the model allows (else sdpa), sdpa on CPU; or sdpa | eager | varlen (torch's
    # FlashAttention varlen kernel, CUDA) | flash_attention_2 | flash_attention_3 | flex_attention
    attn_implementation: str = "auto"
    liger: bool | str = "auto"  # Liger kernels (CUDA, or CPU under TRITON_INTERPRET=1; `gpu` extra); auto: on CUDA
    compile: bool | str = "auto"  # torch.compile each decoder block (regional compile); auto: on CUDA
    trust_remote_code: bool = False  # passed to from_pretrained


@dataclass
class DataConfig:
    path: str = ""  # hub id (optionally "id:split"), .json/.jsonl/.parquet file or dir
    split: str = "train"  # dataset split when loading from the hub or a dir
    name: str = ""  # dataset config name on the hub ("" = default)
    format: Literal["auto", "messages", "sharegpt", "alpaca"] = "auto"  # row format; auto detects from columns
    streaming: bool = False  # stream rows instead of loading them (file order, no shuffle)
    max_seq_len: int = 2048  # truncate samples (keeping the head) / pack to this many tokens
    packing: bool = True  # best-fit samples into rows of <= max_seq_len tokens (position_ids restart per sample)
    pad_to_max: bool = False  # pad every batch to max_seq_len (constant shapes for benchmarks)
    on_unsupported: Literal["error", "drop"] = "error"  # a row the chat template cannot hold: stop, or skip and count
    num_proc: int = 1  # processes that tokenize (datasets map workers; not used when streaming)


@dataclass
class TrainConfig:
    max_steps: int = 1000  # optimizer steps
    seed: int = 0  # data order, init of anything random
    micro_batch_size: int = 1  # samples per rank per forward
    grad_accum_steps: int = 1  # micro-batches per optimizer step (global batch = micro * accum * world)
    tokens_per_step: int = 0  # packed data: global batch of tokens_per_step / max_seq_len rows (0 = off); sets accum
    lr: float = 2e-5  # peak learning rate
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 0  # linear warm-up steps
    weight_decay: float = 0.0  # AdamW decay (never on embeddings, norms, biases)
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    eps: float = 1e-8  # AdamW eps
    max_grad_norm: float = 1.0  # clip the global grad norm to this (0 = no clipping)
    mixed_precision: Literal["bf16", "fp32"] = "bf16"  # bf16: bf16 compute, fp32 master weights and reduce
    nan_policy: Literal["stop", "skip"] = "stop"  # on non-finite loss/grad norm: stop, or skip the update
    log_interval: int = 1  # print a line every N steps (metrics.jsonl gets every step)


@dataclass
class LoraConfig:
    rank: int = 0  # LoRA rank (0 = off: full fine-tuning); adapters via peft, frozen base kept in bf16
    alpha: float = 16.0  # scale of the update: alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input
    target_modules: str | list = "all-linear"  # "all-linear" (every Linear in the decoder blocks) or module names
    modules_to_save: list = field(default_factory=list)  # modules trained in full beside the adapters, e.g. ["lm_head"]


@dataclass
class ACConfig:
    ratio: float = 0.0  # fraction of decoder blocks under activation checkpointing, spread evenly (0..1)
    mode: Literal["block", "op"] = "block"  # block: recompute whole block; op: keep matmul/attention outputs


@dataclass
class ParallelConfig:
    dp_replicate: int = 1  # HSDP: replicate the model over this many groups of ranks (1 = plain FSDP over all)
    dp_shard: int = 0  # ranks that shard the model in each group (0 = launched ranks / dp_replicate)


@dataclass
class CheckpointConfig:
    interval: int = 0  # save every N steps (0 = only at the end and on SIGTERM/SIGUSR1)
    keep: int = 2  # keep the newest K complete checkpoints (0 = keep all)
    async_: bool = False  # TOML key `async`: save in the background (at most one save in flight)
    resume: bool = True  # resume from the newest complete checkpoint in output_dir
    resume_from: str = ""  # resume from this checkpoint directory instead
    export_hf: bool = False  # at the end, write <output_dir>/hf from the trained model, every rank its own files


@dataclass
class EvalConfig:
    path: str = ""  # held-out file in any data format ("" = no evaluation)
    num_samples: int = 100  # held-out conversations to score
    max_new_tokens: int = 32  # greedy generation budget for exact match


@dataclass
class LogConfig:
    wandb: bool = False  # log to Weights & Biases (offline mode without WANDB_API_KEY)
    wandb_project: str = "finetune"  # wandb project name
    progress: bool = True  # show a progress bar on rank 0


@dataclass
class Config:
    output_dir: str = "outputs/run"  # metrics.jsonl, config.toml, checkpoints/
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    ac: ACConfig = field(default_factory=ACConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)


_ALIASES = {"async": "async_"}  # TOML keys that are Python keywords
PATH_KEYS = ("model.path", "model.arch", "data.path", "eval.path")


def _closest(name: str, options) -> str:
    match = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _coerce(key: str, value: Any, typ: Any) -> Any:
    """Check `value` against the field type; ints are accepted for floats. Raises ConfigError."""
    if getattr(typ, "__origin__", None) is Literal:
        choices = get_args(typ)
        if value not in choices:
            hint = _closest(str(value), choices) if isinstance(value, str) else ""
            raise ConfigError(f"{key} must be one of {', '.join(map(repr, choices))}, got {value!r}{hint}")
        return value
    if isinstance(typ, types.UnionType):  # str | list: any of the members
        if not any(isinstance(value, t) for t in get_args(typ)):
            raise ConfigError(f"{key} must be {' or '.join(t.__name__ for t in get_args(typ))}, got {value!r}")
        return value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    ok = isinstance(value, bool) if typ is bool else isinstance(value, typ) and not isinstance(value, bool)
    if not ok:
        raise ConfigError(f"{key} must be {typ.__name__}, got {value!r}")
    return value


def set_key(cfg: Config, dotted: str, value: Any) -> None:
    """Set `section.key` (or a top-level key) on cfg, checking that the key exists and the type fits."""
    parts = dotted.split(".")
    target = cfg
    for i, part in enumerate(parts):
        name = _ALIASES.get(part, part)
        names = {f.name for f in fields(target)}
        if name not in names:
            where = ".".join(parts[:i]) or "the top level"
            shown = sorted(n.rstrip("_") for n in names)
            raise ConfigError(f"unknown config key '{dotted}'{_closest(part, shown)}; "
                              f"keys in {where}: {', '.join(shown)}")
        if i < len(parts) - 1:
            target = getattr(target, name)
            if not dataclasses.is_dataclass(target):
                raise ConfigError(f"unknown config key '{dotted}': '{'.'.join(parts[:i + 1])}' is not a section")
        else:
            typ = get_type_hints(type(target))[name]
            if dataclasses.is_dataclass(typ):
                raise ConfigError(f"'{dotted}' is a section; set one of its keys, "
                                  f"e.g. {dotted}.{fields(typ)[0].name}=...")
            setattr(target, name, _coerce(dotted, value, typ))


def parse_value(text: str) -> Any:
    """A CLI override value in TOML syntax (numbers, true/false, "strings"); bare words are strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _flatten(table: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in table.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Preset (default: configs/tiny.toml) + overrides {dotted key: value} -> validated Config."""
    cfg = Config()
    preset = Path(path) if path else DEFAULT_PRESET
    if path or preset.exists():
        if not preset.is_file():
            raise ConfigError(f"config file not found: {preset}")
        try:
            table = tomllib.loads(preset.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{preset}: invalid TOML ({e})") from e
        for key, value in _flatten(table).items():
            if key in PATH_KEYS and value:
                value = resolve_path(value, preset.parent)
            set_key(cfg, key, value)
    for key, value in (overrides or {}).items():
        set_key(cfg, key, value)
    validate(cfg)
    return cfg


def resolve_path(value: str, base: Path) -> str:
    """A relative path in a preset means the cwd if it exists there, else relative to the preset (or repo)."""
    p = Path(value).expanduser()
    if p.is_absolute() or p.exists():
        return str(p)
    for root in (base, base.parent, REPO_ROOT):
        if (root / p).exists():
            return str((root / p).resolve())
    return value  # maybe a hub id


def validate(cfg: Config) -> None:
    """Range checks that types cannot express; each error names the key and the allowed range."""
    t, d = cfg.train, cfg.data
    attn = ("auto", "sdpa", "eager", "varlen", "flash_attention_2", "flash_attention_3", "flex_attention")
    checks = [
        ("train.max_steps", t.max_steps > 0, "> 0"),
        ("train.micro_batch_size", t.micro_batch_size > 0, "> 0"),
        ("train.grad_accum_steps", t.grad_accum_steps > 0, "> 0"),
        ("train.lr", t.lr >= 0, ">= 0"),
        ("train.warmup_steps", t.warmup_steps >= 0, ">= 0"),
        ("train.min_lr_ratio", 0 <= t.min_lr_ratio <= 1, "in [0, 1]"),
        ("train.weight_decay", t.weight_decay >= 0, ">= 0"),
        ("train.beta1", 0 <= t.beta1 < 1, "in [0, 1)"),
        ("train.beta2", 0 <= t.beta2 < 1, "in [0, 1)"),
        ("train.max_grad_norm", t.max_grad_norm >= 0, ">= 0"),
        ("train.log_interval", t.log_interval > 0, "> 0"),
        ("train.tokens_per_step", t.tokens_per_step >= 0, ">= 0 (0 = off)"),
        ("data.max_seq_len", d.max_seq_len > 0, "> 0"),
        ("lora.rank", cfg.lora.rank >= 0, ">= 0 (0 = off)"),
        ("lora.alpha", cfg.lora.alpha > 0, "> 0"),
        ("lora.dropout", 0 <= cfg.lora.dropout < 1, "in [0, 1)"),
        ("data.num_proc", d.num_proc > 0, "> 0"),
        ("ac.ratio", 0 <= cfg.ac.ratio <= 1, "in [0, 1]"),
        ("parallel.dp_replicate", cfg.parallel.dp_replicate >= 1, ">= 1"),
        ("parallel.dp_shard", cfg.parallel.dp_shard >= 0, ">= 0 (0 = launched ranks / dp_replicate)"),
        ("checkpoint.interval", cfg.checkpoint.interval >= 0, ">= 0 (0 = no periodic checkpoint)"),
        ("checkpoint.keep", cfg.checkpoint.keep >= 0, ">= 0 (0 = keep all)"),
        ("eval.num_samples", cfg.eval.num_samples >= 0, ">= 0"),
        ("eval.max_new_tokens", cfg.eval.max_new_tokens > 0, "> 0"),
        ("model.attn_implementation", cfg.model.attn_implementation in attn, f"one of {', '.join(attn)}"),
        ("model.liger", cfg.model.liger in (True, False, "auto"), "true, false or \"auto\""),
        ("model.compile", cfg.model.compile in (True, False, "auto"), "true, false or \"auto\""),
    ]
    for key, ok, rule in checks:
        if not ok:
            raise ConfigError(f"{key} must be {rule}, got {reduce(getattr, key.split('.'), cfg)!r}")
    if t.tokens_per_step:  # a step is a number of packed rows: see steps_per_rank in train.py
        for ok, why in ((d.packing, "needs data.packing=true (a step of unpacked samples has no token size)"),
                        (t.tokens_per_step % d.max_seq_len == 0, f"must be a multiple of data.max_seq_len "
                                                                  f"({d.max_seq_len}): rows of that many tokens"),
                        (t.grad_accum_steps == 1, "sets the micro-batches per step; leave train.grad_accum_steps "
                                                  f"at 1 (got {t.grad_accum_steps})")):
            if not ok:
                raise ConfigError(f"train.tokens_per_step={t.tokens_per_step} {why}")
    for key, flag in (("model.path", "--model"), ("data.path", "--dataset"), ("output_dir", "--output-dir")):
        if not reduce(getattr, key.split("."), cfg):
            raise ConfigError(f"{key} is not set: pass {flag} or set {key} in the config")


def check_parallel(dp_replicate: int, dp_shard: int, num_ranks: int) -> int:
    """dp_shard for `num_ranks` ranks (0: num_ranks / dp_replicate), or a ConfigError naming the mismatch."""
    if num_ranks % dp_replicate:
        raise ConfigError(f"parallel.dp_replicate={dp_replicate} does not divide the {num_ranks} launched ranks")
    dp_shard = dp_shard or num_ranks // dp_replicate
    if dp_replicate * dp_shard != num_ranks:
        raise ConfigError(f"parallel.dp_replicate x parallel.dp_shard = {dp_replicate} x {dp_shard} = "
                          f"{dp_replicate * dp_shard}, but {num_ranks} ranks were launched")
    return dp_shard


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (what config.toml in the output dir holds)."""
    def fmt(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(map(fmt, v)) + "]"
        return repr(v)

    top, sections = [], []
    for f in fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            body = [f"{sf.name.rstrip('_')} = {fmt(getattr(v, sf.name))}" for sf in fields(v)]
            sections.append(f"[{f.name}]\n" + "\n".join(body))
        else:
            top.append(f"{f.name} = {fmt(v)}")
    return "\n".join(top) + "\n\n" + "\n\n".join(sections) + "\n"
