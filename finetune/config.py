"""Typed run configuration: preset -> CLI flags -> `section.key=value` overrides -> `validate()` (ConfigError)."""
from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from .keys import ConfigError, flatten, get_key, set_key

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PRESET = REPO_ROOT / "configs" / "tiny.toml"


@dataclass
class ModelConfig:
    path: str = ""  # HF hub id, HF model dir, or a prepared checkpoint dir
    arch: str = ""  # an HF config.json of the model, for `finetune plan` when model.path is not at hand (offline)
    # auto: varlen where the model allows (else sdpa), on CPU too; varlen: torch's varlen kernel on CUDA (Flash, or
    # cuDNN where torch prefers it; fp32 inputs cast to bf16), one sdpa call per sample on CPU
    attn_implementation: Literal["auto", "sdpa", "eager", "varlen", "flash_attention_2", "flash_attention_3",
                                 "flex_attention"] = "auto"
    liger: bool | str = "auto"  # Liger kernels (CUDA, or CPU under TRITON_INTERPRET=1; `gpu` extra); auto: on CUDA
    compile: bool | str = "auto"  # torch.compile each decoder block (regional compile); auto: on CUDA
    # MoE experts: one grouped GEMM (torch's grouped_mm), batched matmuls, or transformers' per-expert loop (eager)
    experts_implementation: Literal["grouped_mm", "eager", "batched_mm"] = "grouped_mm"
    trust_remote_code: bool = False  # passed to from_pretrained
    # FP8 matmuls in the decoder blocks' Linear layers through torchao (`fp8` extra; CUDA sm >= 8.9, emulated on
    # CPU): dynamic scales per tensor or per row; lm_head, routers, embeddings stay bf16; weights stay in their dtype
    fp8: Literal["off", "tensorwise", "rowwise"] = "off"
    fp8_all_gather: bool = True  # tensorwise under FSDP: all-gather weights in fp8 (scales computed after each step)


Format = Literal["auto", "messages", "sharegpt", "alpaca", "pairs"]  # of data rows


@dataclass
class SourceConfig:  # one entry of data.sources: [[data.sources]] tables in TOML
    path: str = ""  # as data.path
    split: str = "train"  # as data.split
    name: str = ""  # as data.name
    format: Format = "auto"  # as data.format
    weight: float = 0.0  # share of an epoch's samples: the weighted sources share the samples they hold together
    samples: int = 0  # or: this many samples an epoch (the source repeated, or a fixed part of it)
    epochs: float = 0.0  # or: this many passes over the source an epoch (0.5: a fixed half); none of the 3 set: 1


@dataclass
class DataConfig:
    path: str = ""  # hub id (optionally "id:split"), .json/.jsonl/.parquet file or dataset dir (splits as datasets)
    sources: list[SourceConfig] = field(default_factory=list)  # a mixture instead of path; one epoch interleaves them
    split: str = "train"  # dataset split when loading from the hub or a dataset dir
    name: str = ""  # dataset config name on the hub ("" = default)
    format: Format = "auto"  # row format; auto detects from columns
    streaming: bool = False  # stream rows instead of loading them (file order, no shuffle)
    max_seq_len: int = 2048  # truncate samples (keeping the head) / pack to this many tokens
    packing: bool = True  # best-fit samples into rows of <= max_seq_len tokens (position_ids restart per sample)
    pad_to_max: bool = False  # pad every batch to max_seq_len (constant shapes for benchmarks)
    on_unsupported: Literal["error", "drop"] = "error"  # a turn the template cannot train: stop, or leave it and count
    num_proc: int = 1  # processes that tokenize (datasets map workers; not used when streaming)
    chat_template: str = ""  # Jinja file or tokenizer dir whose chat template replaces the model's (saved with the run)
    chat_template_kwargs: dict = field(default_factory=dict)  # template variables, e.g. {enable_thinking=false};
    # override one as data.chat_template_kwargs.enable_thinking=false, or all as data.chat_template_kwargs={...}


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
    # "nf4" (QLoRA): the frozen linear weights of the decoder blocks held as torchao's 4-bit NF4 (adapters/qlora.py)
    quantize_base: Literal["none", "nf4"] = "none"


@dataclass
class MoEConfig:  # mixture-of-experts models (finetune/kernels/moe.py)
    # router load-balancing loss weight over the global batch; -1: the architecture's router_aux_loss_coef (0 when
    # it has none: DeepSeek-V3-style routers balance with a bias)
    aux_loss_coef: float = -1.0


@dataclass
class ACConfig:
    ratio: float = 0.0  # fraction of decoder blocks under activation checkpointing, spread evenly (0..1)
    mode: Literal["block", "op"] = "block"  # block: recompute whole block; op: keep matmul/attention outputs
    offload: bool = False  # checkpointed blocks keep their inputs in pinned host memory (CUDA; a no-op on CPU)


@dataclass
class ParallelConfig:
    dp_replicate: int = 1  # HSDP: replicate the model over this many groups of ranks (1 = plain FSDP over all)
    dp_shard: int = 0  # ranks that shard the model in each group (0 = launched ranks / dp_replicate / cp)
    cp: int = 1  # context parallelism: each row's tokens split over this many ranks (FSDP shards over dp_shard x cp)
    ep: int = 1  # expert parallelism: each MoE layer's experts split over this many of the dp_shard ranks
    # FSDP keeps each rank's parameter shards, their gradients and the AdamW state in pinned host memory (all-gathered
    # to the GPU unit by unit; the optimizer steps on the CPU): QLoRA's 70B base on 24 GB GPUs (model.py, apply_fsdp)
    cpu_offload: bool = False


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
    num_samples: int = 100  # held-out conversations to score (0 = no evaluation)
    max_new_tokens: int = 32  # greedy generation budget for exact match


@dataclass
class LogConfig:
    wandb: bool = False  # log to Weights & Biases (offline mode without WANDB_API_KEY)
    wandb_project: str = "finetune"  # wandb project name
    progress: bool = True  # show a progress bar on rank 0


@dataclass
class DPOConfig:  # `finetune dpo` (finetune/tasks/dpo.py)
    loss: Literal["sigmoid", "simpo"] = "sigmoid"  # DPO's sigmoid loss, or SimPO (reference-free, length-normalised)
    beta: float = 0.1  # scale of the log-prob ratios (SimPO: of the mean log-probs; its paper uses ~2)
    label_smoothing: float = 0.0  # sigmoid: the chance a label is flipped (conservative DPO)
    simpo_gamma: float = 0.5  # SimPO's target margin
    # sigmoid's reference: auto = "adapters" with LoRA (the base: adapters off), else "precomputed" (the initial
    # model's log-probs, one pass before training, kept in <output_dir>/checkpoints/ref_logps.pt, reused on resume)
    reference: Literal["auto", "adapters", "precomputed"] = "auto"


@dataclass
class Config:
    output_dir: str = "outputs/run"  # metrics.jsonl, config.toml, checkpoints/
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    ac: ACConfig = field(default_factory=ACConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    log: LogConfig = field(default_factory=LogConfig)


PATH_KEYS = ("model.path", "model.arch", "data.path", "data.chat_template", "eval.path")


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
        for key, value in flatten(table).items():
            set_key(cfg, key, value)
        for key in PATH_KEYS:  # the preset's relative paths (overrides are relative to the cwd)
            if value := get_key(cfg, key):
                set_key(cfg, key, resolve_path(value, preset.parent))
        for src in cfg.data.sources:
            if src.path:
                src.path = resolve_path(src.path, preset.parent)
    for key, value in (overrides or {}).items():
        set_key(cfg, key, value)
    validate(cfg)
    return cfg


def resolve_path(value: str, base: Path) -> str:
    """A preset's relative path: from the cwd if it exists there, else from the preset's dir (or the repo)."""
    p = Path(value).expanduser()
    if p.is_absolute() or p.exists():
        return str(p)
    for root in (base, base.parent, REPO_ROOT):
        if (root / p).exists():
            return str((root / p).resolve())
    return value  # maybe a hub id


# The names apply_chat_template (transformers 5.x) takes or hands the template itself: a template kwarg of that name
# would clash with them (a TypeError) or replace what the row gives (its messages, its tools).
TEMPLATE_OWN_ARGS = ("messages tools documents add_generation_prompt conversation conversations chat_template "
                     "continue_final_message tokenize sanitize_control_tokens padding truncation max_length "
                     "return_tensors return_dict return_assistant_tokens_mask tokenizer_kwargs").split()
RANGES = [  # (rule, test, the keys it holds for): validate's messages say "<key> must be <rule>"
    ("> 0", lambda v: v > 0, "train.max_steps train.micro_batch_size train.grad_accum_steps train.log_interval "
                             "data.max_seq_len data.num_proc lora.alpha eval.max_new_tokens train.eps"),
    (">= 0", lambda v: v >= 0, "train.lr train.warmup_steps train.weight_decay train.max_grad_norm"),
    (">= 0 (0 = no evaluation)", lambda v: v >= 0, "eval.num_samples"),
    (">= 0 (0 = off)", lambda v: v >= 0, "train.tokens_per_step lora.rank"),
    ("in [0, 2**63)", lambda v: 0 <= v < 2**63, "train.seed"),
    (">= 0 (0 = launched ranks / dp_replicate / cp)", lambda v: v >= 0, "parallel.dp_shard"),
    (">= 0 (0 = no periodic checkpoint)", lambda v: v >= 0, "checkpoint.interval"),
    (">= 0 (0 = keep all)", lambda v: v >= 0, "checkpoint.keep"),
    (">= 1", lambda v: v >= 1, "parallel.dp_replicate parallel.cp"),
    ("in [0, 1]", lambda v: 0 <= v <= 1, "train.min_lr_ratio ac.ratio"),
    ("in [0, 1)", lambda v: 0 <= v < 1, "train.beta1 train.beta2 lora.dropout"),
    ('true, false or "auto"', lambda v: v in (True, False, "auto"), "model.liger model.compile"),
]


def validate(cfg: Config) -> None:
    """Range checks that types cannot express; each error names the key (the extensions' keys: run/checks)."""
    for rule, holds, keys in RANGES:
        for key in keys.split():
            if not holds(get_key(cfg, key)):
                raise ConfigError(f"{key} must be {rule}, got {get_key(cfg, key)!r}")
    tc, dc = cfg.train, cfg.data
    if cfg.ac.offload and not cfg.ac.ratio:
        raise ConfigError("ac.offload=true moves what checkpointed blocks keep to host memory: set ac.ratio > 0")
    if tc.tokens_per_step:  # a step is a number of packed rows: see run/tokens_per_step.py
        for ok, why in ((dc.packing, "needs data.packing=true (a step of unpacked samples has no token size)"),
                        (tc.tokens_per_step % dc.max_seq_len == 0, f"must be a multiple of data.max_seq_len "
                                                                    f"({dc.max_seq_len}): rows of that many tokens"),
                        (tc.grad_accum_steps == 1, "sets the micro-batches per step; leave train.grad_accum_steps "
                                                   f"at 1 (got {tc.grad_accum_steps})")):
            if not ok:
                raise ConfigError(f"train.tokens_per_step={tc.tokens_per_step} {why}")
    for key in dc.chat_template_kwargs:
        if key in TEMPLATE_OWN_ARGS:
            raise ConfigError(f"data.chat_template_kwargs.{key}: apply_chat_template sets {key!r} itself (from each "
                              f"row and the labelling); remove the key")


def check_parallel(dp_replicate: int, dp_shard: int, num_ranks: int, cp: int = 1) -> int:
    """dp_shard for `num_ranks` ranks (0: num_ranks / dp_replicate / cp), or a ConfigError naming the mismatch."""
    if num_ranks % dp_replicate:
        raise ConfigError(f"parallel.dp_replicate={dp_replicate} does not divide the {num_ranks} launched ranks")
    if num_ranks % (dp_replicate * cp):
        raise ConfigError(f"parallel.cp={cp} does not divide the {num_ranks // dp_replicate} ranks of a replica "
                          f"({num_ranks} launched, parallel.dp_replicate={dp_replicate})")
    dp_shard = dp_shard or num_ranks // (dp_replicate * cp)
    if dp_replicate * dp_shard * cp != num_ranks:
        raise ConfigError(f"parallel.dp_replicate x parallel.dp_shard{' x parallel.cp' * (cp > 1)} = {dp_replicate} x "
                          f"{dp_shard}{f' x {cp}' * (cp > 1)} = {dp_replicate * dp_shard * cp}, but {num_ranks} ranks "
                          f"were launched")
    return dp_shard


def export_dtype_name(name: str) -> str:
    """export-hf --dtype: the torch dtype's name (here so that the CLI checks it before importing torch)."""
    if name not in ("auto", "bfloat16", "bf16", "float32", "fp32"):
        raise ConfigError(f"--dtype must be one of auto, bfloat16, float32, got {name!r}")
    return {"bf16": "bfloat16", "fp32": "float32"}.get(name, name)


def parse_shard_size(text: str) -> int:
    """Bytes, as transformers' max_shard_size reads '5GB', '2GiB', '1.5GB', '1TB' or a number; '5Gb' (bits): refused."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(([KMGT])(i?)([Bb]))?\s*", text, re.IGNORECASE)
    if m and m[5] == "b" and not m[4]:
        raise ConfigError(f"--max-shard-size {text!r}: a lowercase b means bits (transformers reads it as "
                          f"1/8 of the bytes); write {m[1]}{m[3].upper()}{m[4]}B for bytes")
    size = 0
    if m and (m[2] or "." not in m[1]):  # a fraction of a byte is no size
        power = "KMGT".index(m[3].upper()) + 1 if m[2] else 0
        size = int(Fraction(m[1]) * (1024 if m[4] else 1000) ** power)
    if size <= 0:
        raise ConfigError(f"--max-shard-size must be a positive size like 5GB, 500MB, 2GiB or 1.5GB, got {text!r}")
    return size


def to_toml(cfg: Config) -> str:
    """The resolved config as TOML (what config.toml in the output dir holds)."""
    def fmt(v):
        if isinstance(v, dict):  # an inline table
            return "{" + ", ".join(f"{fmt(str(k))} = {fmt(x)}" for k, x in v.items()) + "}"
        if isinstance(v, list):
            return "[" + ", ".join(map(fmt, v)) + "]"
        return json.dumps(v, ensure_ascii=False)  # TOML writes strings, numbers and booleans as JSON does

    as_dict = dataclasses.asdict(cfg)
    as_dict["data"]["sources"] = [{k: v for k, v in src.items() if v or k not in ("weight", "samples", "epochs")}
                                  for src in as_dict["data"]["sources"]]  # unset: a written 0 is refused
    top = [f"{name} = {fmt(v)}" for name, v in as_dict.items() if not isinstance(v, dict)]
    sections = [f"[{name}]\n" + "\n".join(f"{k.rstrip('_')} = {fmt(x)}" for k, x in v.items())
                for name, v in as_dict.items() if isinstance(v, dict)]
    return "\n".join(top) + "\n\n" + "\n\n".join(sections) + "\n"
