"""The extensions' checks of a config, before torch is imported (cli.py and tools/commands.py hand this module to
args.build_config): `validate` refuses bad settings of their keys, `probe` hub ids the hub cannot serve."""
from __future__ import annotations

import math
import os
import socket
from urllib.parse import urlsplit

from ..args import remote_paths
from ..config import Config, ConfigError, get_key

RANGES = (("dpo.beta", "> 0", lambda v: v > 0), ("dpo.label_smoothing", "in [0, 0.5)", lambda v: 0 <= v < 0.5),
          ("dpo.simpo_gamma", ">= 0 (SimPO's target margin: a negative one rewards a chosen answer less likely than "
                              "the rejected)", lambda v: v >= 0),
          ("moe.aux_loss_coef", ">= 0 (or -1: the architecture's)", lambda v: v >= 0 or v == -1))
MAX_EPOCHS = 1_000_000  # passes over one source in an epoch of a mixture (beyond it: an OverflowError, or no memory)


def validate(cfg: Config, task: str = "sft") -> None:
    """After config.validate: dpo.*, moe.* and parallel.ep, model.fp8's combinations, data.sources (one line each);
    `task`: the command's (train.train checks again: API callers)."""
    for key, rule, holds in RANGES:
        if not holds(get_key(cfg, key)):
            raise ConfigError(f"{key} must be {rule}, got {get_key(cfg, key)!r}")
    check_ep(cfg, task)
    check_quantize_base(cfg)
    check_fp8(cfg)
    check_simpo(cfg)
    for j, src in enumerate(cfg.data.sources):
        how = [k for k in ("weight", "samples", "epochs") if getattr(src, k)]
        for ok, why in ((src.path, ": path is not set"), (len(how) <= 1, f": sets {' and '.join(how)}; set one"),
                        (min(src.weight, src.samples, src.epochs) >= 0, ": weight, samples and epochs must be >= 0"),
                        (src.epochs <= MAX_EPOCHS, f".epochs must be <= {MAX_EPOCHS:,}, got {src.epochs!r}")):
            if not ok:  # MAX_EPOCHS: an epoch's sample indices are held in memory
                raise ConfigError(f"data.sources[{j}]{why}")
    if not math.isfinite(total := sum(src.weight for src in cfg.data.sources)):  # only their ratios count
        raise ConfigError(f"data.sources: the weights sum past the largest number ({total}); only their ratios "
                          f"count: scale them down, e.g. to 1 and 3")
    if cfg.data.path and cfg.data.sources:
        raise ConfigError("data.path (--dataset) and data.sources are both set; use one (data.path= clears a "
                          "preset's path)")


def check_simpo(cfg: Config) -> None:
    """dpo.loss=simpo with a setting of the sigmoid loss only (SimPO has no reference model and no label smoothing),
    refused: the run would ignore it."""
    for key, unset in (("dpo.label_smoothing", 0.0), ("dpo.reference", "auto")):
        if cfg.dpo.loss == "simpo" and get_key(cfg, key) != unset:
            raise ConfigError(f"{key}={get_key(cfg, key)!r} has no effect on dpo.loss=simpo (reference-free, no label "
                              f"smoothing): leave it at {unset!r}, or set dpo.loss=sigmoid")


def check_ep(cfg: Config, task: str) -> None:
    """parallel.ep with what it does not compose with yet, refused (the model's: parallel/expert.py; the ranks':
    distributed.py)."""
    p, ep = cfg.parallel, cfg.parallel.ep
    if ep < 1:
        raise ConfigError(f"parallel.ep must be >= 1, got {ep!r}")
    other = next((name for name, on in (
        ("context parallel (parallel.cp > 1)", p.cp > 1),
        ("HSDP (parallel.dp_replicate > 1)", p.dp_replicate > 1),
        (f"model.fp8={cfg.model.fp8}", cfg.model.fp8 != "off"), (f"finetune {task}", task != "sft")) if on), None)
    if ep > 1 and other:
        raise ConfigError(f"parallel.ep={ep} with {other} is not supported yet; set parallel.ep=1")


def check_fp8(cfg: Config) -> None:
    """model.fp8 with LoRA, host offload or tensor parallel, refused (needs no torchao; kernels/float8.py checks the
    device)."""
    if cfg.model.fp8 != "off" and cfg.lora.rank:
        raise ConfigError(f"model.fp8={cfg.model.fp8} with LoRA (lora.rank={cfg.lora.rank}) is not supported yet "
                          "(peft's adapters over torchao's Float8Linear, their merge and adapter export are untested); "
                          "set model.fp8=off or lora.rank=0")
    if cfg.model.fp8 != "off" and cfg.parallel.cpu_offload:  # its scales are computed on the sharded weights
        raise ConfigError(f"model.fp8={cfg.model.fp8} with parallel.cpu_offload=true is not supported (torchao's "
                          f"fp8 weights are untested in host memory); set model.fp8=off or parallel.cpu_offload=false")
    if cfg.model.fp8 != "off" and getattr(cfg.parallel, "tp", 1) > 1:  # once TP exists: NaNs (torchtitan#3109)
        raise ConfigError(f"model.fp8={cfg.model.fp8} with tensor parallel (parallel.tp={cfg.parallel.tp}) is not "
                          f"supported yet; set model.fp8=off")


def check_quantize_base(cfg: Config) -> None:
    """lora.quantize_base="nf4" (QLoRA) needs adapters and a base in bf16 or fp32, not fp8."""
    if cfg.lora.quantize_base == "none":
        return
    if not cfg.lora.rank:
        raise ConfigError(f"lora.quantize_base={cfg.lora.quantize_base} quantizes the frozen base under LoRA "
                          f"adapters, and lora.rank=0 trains every weight in full; set lora.rank (e.g. 16) or "
                          f"lora.quantize_base=none")
    if cfg.model.fp8 != "off":
        raise ConfigError(f"lora.quantize_base={cfg.lora.quantize_base} with model.fp8={cfg.model.fp8}: the frozen "
                          f"base is held 4-bit, which torchao's Float8Linear cannot take; set model.fp8=off")


def probe(cfg: Config) -> None:
    """A ConfigError naming the first hub id when the Hugging Face hub cannot be reached (no proxy set,
    HF_HUB_OFFLINE unset): huggingface_hub would retry for ~30 s."""
    remote = remote_paths(cfg)
    proxy = any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"))
    if not remote or proxy or os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return
    url = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=5).close()
    except OSError:
        key, value = next(iter(remote.items()))
        raise ConfigError(f"{key} '{value}' is not a local path and the Hugging Face hub ({url.netloc}) cannot be "
                          f"reached: pass a local path, or set HF_HUB_OFFLINE=1 to use the local cache") from None
