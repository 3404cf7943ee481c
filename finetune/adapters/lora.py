"""LoRA via peft: inject adapters into the HF model (names stay HF names; handed its decoder blocks), initialise
them, the merge math (W + alpha/r * B @ A) and the key map of PEFT adapter dirs. No file I/O."""
from __future__ import annotations

import math
import re
from functools import partial
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import CheckpointError, read_marker
from ..config import ConfigError
from ..distributed import print0
from ..model import Transform
from ..weights import is_adapter


def resolve_targets(model: nn.Module, layers: nn.ModuleList, target_modules,
                   experts: dict[str, list[str]]) -> tuple[str | list[str], list[str]]:
    """(peft's target_modules, the "module.param" names of the expert parameters to adapt; `experts`: expert_params).
    "all-linear": a regex naming every Linear inside the decoder blocks (peft's "all-linear" would adapt any Linear but
    the output layer), and every expert parameter. A list of names: each matches Linear layers, experts modules
    ("experts") or expert parameters ("gate_up_proj"), at least one."""
    from .expert_lora import ends, match_expert_params, peft_remapped
    # peft's layer adds its delta to a Linear's output: Llama 4's router (a Linear subclass) returns scores and logits
    from .qlora import is_plain_linear
    if target_modules == "all-linear":
        prefix = next(n for n, m in model.named_modules() if m is layers)
        leaves = sorted({n.rsplit(".", 1)[-1] for layer in layers for n, m in layer.named_modules()
                         if is_plain_linear(m)})
        if (moved := peft_remapped(model, leaves))[0]:
            leaves = [n for n in leaves if n not in moved[0]]
            print0(f"note: all-linear leaves out the Linear layers named {moved[0]}: {moved[1]}")
        return rf"{re.escape(prefix)}\.\d+\.(.*\.)?({'|'.join(leaves)})", [f"{m}.{p}" for m, ps in experts.items()
                                                                         for p in ps]
    if isinstance(target_modules, str) or not target_modules or not all(isinstance(t, str) for t in target_modules):
        raise ConfigError(f"lora.target_modules must be \"all-linear\" or a non-empty list of module names, "
                         f"got {target_modules!r}")
    expert_targets = match_expert_params(experts, target_modules)
    check_names_match(model, "target_modules", [t for t in target_modules
                                                if not match_expert_params(experts, [t])])
    modules = [(n, m) for n, m in model.named_modules() if n not in experts]
    linear_names = [t for t in target_modules if any(ends(n, t) for n, _ in modules)]
    other = next(((t, n, m) for t in linear_names for n, m in modules
                  if ends(n, t) and not is_plain_linear(m)), None)
    if other:  # peft's embedding adapters (lora_embedding_A/B) have no load, merge or adapter-export path here
        kind = "a Linear whose forward is not a Linear's" if isinstance(other[2], nn.Linear) else "not a Linear layer"
        raise ConfigError(f"lora.target_modules: '{other[0]}' names {other[1]} ({type(other[2]).__name__}), {kind}: "
                          f"LoRA here adapts plain Linear layers only; to train it in full, name it in "
                          f"lora.modules_to_save instead (lora.modules_to_save=['{other[0]}'])")
    if (moved := peft_remapped(model, linear_names))[0]:
        keep = [n for n in target_modules if n not in moved[0]]
        raise ConfigError(f"lora.target_modules: {moved[0]}: {moved[1]}, and then fails; leave them out "
                          f"(lora.target_modules={keep})")
    return linear_names, expert_targets


def check_names_match(model: nn.Module, key: str, names: list[str]) -> None:
    """Each of `names` (the setting lora.`key`) is a module of `model` or ends one's name."""
    fqns = [n for n, _ in model.named_modules()]
    for name in names:
        if not any(n == name or n.endswith("." + name) for n in fqns):
            raise ConfigError(f"lora.{key}: '{name}' matches no module of {type(model).__name__}")


def apply_lora(model: nn.Module, layers: nn.ModuleList, rank: int, alpha: float, dropout: float, target_modules,
               modules_to_save: list, base_dtype: torch.dtype, quantize=None) -> dict | None:
    """Inject peft LoRA layers (and trainable copies of modules_to_save) into the meta skeleton (decoder blocks
    `layers`); freeze the rest, in base_dtype, then `quantize(model, layers)` it (QLoRA). Returns the settings a
    checkpoint records (None when rank is 0)."""
    if rank == 0:
        return None
    from peft import inject_adapter_in_model
    from .expert_lora import adapted_summary, apply_expert_lora, expert_params
    experts = expert_params(model)
    targets, expert_targets = resolve_targets(model, layers, target_modules, experts)
    check_names_match(model, "modules_to_save", modules_to_save)
    # peft's target_parameters refuses it too
    if expert_targets and dropout:
        raise ConfigError(f"lora.dropout={dropout:g} cannot apply to LoRA on the experts ({expert_targets[0]}, ...): "
                          f"their adapters act on the merged weight, not on each input; set lora.dropout=0 or leave "
                          f"the experts out of lora.target_modules")
    # peft injects modules_to_save only beside a Linear target
    if modules_to_save and not targets:
        raise ConfigError(f"lora.modules_to_save={list(modules_to_save)} with LoRA on the experts only: name a Linear "
                          f"layer in lora.target_modules too (e.g. \"q_proj\") or use \"all-linear\"")
    settings = LoraSettings(rank=rank, alpha=alpha, dropout=dropout, target_modules=targets,
                            modules_to_save=list(modules_to_save), target_parameters=expert_targets)
    if targets:
        inject_adapter_in_model(peft_config({**settings, "target_parameters": []}), model)
    apply_expert_lora(model, expert_targets, rank, alpha / rank)
    for name, p in model.named_parameters():  # frozen weights are never trained: no fp32 master copy of them
        p.requires_grad_(is_adapter(name) or ".modules_to_save.default." in name)
        if not p.requires_grad:
            p.data = p.data.to(base_dtype)
    if quantize is not None:
        quantize(model, layers)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print0(f"lora: rank {rank}, alpha {alpha:g} on {adapted_summary(model, experts)}; trainable "
           f"{trainable / 1e6:.3f}M of {total / 1e6:.1f}M params ({trainable / total:.2%})")
    return settings


class LoraSettings(dict):
    """apply_lora's settings, as checkpoints record them; `check` compares a LoRA checkpoint's with them."""

    def check(self, path, saved: dict, hf_config) -> None:
        """The LoRA checkpoint `path` (its settings `saved`) has these settings and trained on this run's base."""
        # how the base was held: its config's, for a checkpoint whose settings do not record it (none before QLoRA)
        held = read_marker(path).get("config", {}).get("lora", {}).get("quantize_base", "none")
        saved = {"quantize_base": held, **saved}
        diffs = [f"lora.{k}: checkpoint {saved[k]!r}, run {self.get(k)!r}" for k in saved
                 if k != "base_fingerprint" and saved[k] != self.get(k)]
        if diffs:
            raise CheckpointError(f"checkpoint {path} has other LoRA settings than this run: {'; '.join(diffs)}")
        check_base(path, saved, self["base_fingerprint"], hf_config.name_or_path)


def check_base(path: Path, lora: dict, fingerprint: str, model_path: str) -> None:
    """The base at `model_path` (its weights' `fingerprint`) is the one the LoRA checkpoint `path` trained on."""
    trained = read_marker(path).get("config", {}).get("model", {}).get("path")
    if "base_fingerprint" not in lora:
        print0(f"note: checkpoint {path} records no fingerprint of its LoRA base (saved by an older finetune): not "
               f"checked that '{model_path}' holds the base weights it trained on")
    elif lora["base_fingerprint"] != fingerprint:
        raise CheckpointError(f"checkpoint {path} trained its LoRA adapters on the base '{trained}', and "
                              f"'{model_path}' holds other weights now (fingerprint {lora['base_fingerprint'][:19]} "
                              f"then, {fingerprint[:19]} now): the adapters fit only the base they trained on")


def peft_config(lora: dict, **kwargs):
    """peft's LoraConfig for our settings (training and the adapter dir use the same one)."""
    from peft import LoraConfig
    return LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                      target_modules=lora["target_modules"] or None, modules_to_save=lora["modules_to_save"] or None,
                      target_parameters=lora.get("target_parameters") or None, **kwargs)


@torch.no_grad()
def init_lora_weights(model: nn.Module, seed: int) -> None:
    """As peft does (A kaiming-uniform, B zeros), from `seed`: every rank draws the same full tensors (any world)."""
    from torch.distributed.tensor import distribute_tensor
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        full = torch.zeros(p.shape, dtype=p.dtype)
        # an expert's A [E, r, in]: each expert's r rows drawn as one [r, in] Linear's
        if ".lora_A." in name:
            nn.init.kaiming_uniform_(full.view(-1, full.shape[-1]), a=math.sqrt(5), generator=gen)
        p.to_local().copy_(distribute_tensor(full.to(p.device), p.device_mesh, p.placements).to_local())


def peft_key(fqn: str) -> str:
    """Our checkpoint key -> the key PeftModel.save_pretrained writes (adapter name dropped)."""
    return "base_model.model." + fqn.replace(".lora_A.default.", ".lora_A.").replace(
        ".lora_B.default.", ".lora_B.").replace(".modules_to_save.default.", ".")


def merge_lora_tensor(name: str, base: torch.Tensor, load_adapter, scale: float,
                      transposed: bool = False) -> torch.Tensor:
    """The export tensor `name`: W + scale * B @ A in fp32 for a LoRA target (an expert parameter: per expert, its
    [E, in, out] layout where `transposed`), the trained copy of a module to save, else the base tensor;
    load_adapter(checkpoint key) returns that tensor, or None."""
    from .expert_lora import expert_delta
    module, leaf = name.rsplit(".", 1)
    copy = load_adapter(f"{module}.modules_to_save.default.{leaf}")
    if copy is not None:
        return copy.float()
    lora_a = load_adapter(f"{module}.lora_A.default.{leaf}")
    if lora_a is None:
        return base
    return base.float() + scale * expert_delta(lora_a, load_adapter(f"{module}.lora_B.default.{leaf}"), transposed)


def lora_settings(cfg) -> dict | None:
    """The lora section as apply_lora's keyword arguments (None: LoRA off)."""
    lc = cfg.lora
    return dict(rank=lc.rank, alpha=lc.alpha, dropout=lc.dropout, target_modules=lc.target_modules,
                modules_to_save=lc.modules_to_save) if lc.rank else None


def lora_transforms(settings: dict, *, seed: int, path: str, mixed_precision: str = "bf16",
                    quantize_base: str = "none", shards: int = 1) -> list[Transform]:
    """LoRA's transform: apply_lora's `settings` on a frozen base in bf16 (fp32 when mixed_precision is fp32;
    quantize_base "nf4": its linear weights NF4, sharded over `shards` ranks), adapters initialised from `seed`, tied
    to the base weights at `path`."""
    base_dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    quantize = fill = unsharded = None
    if quantize_base == "nf4":
        from .qlora import apply_nf4, fill_nf4, nf4_params
        quantize, fill, unsharded = partial(apply_nf4, shards=shards, dtype=base_dtype), fill_nf4, nf4_params
    return [Transform("adapters", partial(apply_lora, **settings, base_dtype=base_dtype, quantize=quantize),
                      after_load=partial(init_adapters, seed=seed, path=path, quantize_base=quantize_base), fill=fill,
                      unsharded=unsharded)]


def init_adapters(model, settings: dict, *, seed: int, path: str, quantize_base: str = "none") -> None:
    """After the load: the adapters initialised from `seed`; the base they train on recorded in `settings`: its
    weights' fingerprint and how it is held (a resume onto another, e.g. NF4 then bf16, is refused as a change of
    settings)."""
    from ..hf.fingerprint import base_fingerprint
    init_lora_weights(model, seed)
    settings["base_fingerprint"], settings["quantize_base"] = base_fingerprint(path), quantize_base
