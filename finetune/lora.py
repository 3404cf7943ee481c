"""LoRA via peft: inject adapters into the HF model (names stay HF names), initialise them, and the key maps that
checkpoints, export (merged W + alpha/r * B @ A) and PEFT adapter dirs share."""
from __future__ import annotations

import math
import re
from pathlib import Path

import torch
from torch import nn

from .distributed import print0

# peft wraps a target Linear as <name>.base_layer + <name>.lora_A/B.default, and a module to save as
# <name>.original_module (frozen) + <name>.modules_to_save.default (the trained copy)
_WRAPPERS = re.compile(r"\.(base_layer|original_module|modules_to_save\.default)(?=\.)")


def base_name(fqn: str) -> str:
    """The HF name a (wrapped) parameter is loaded from: q_proj.base_layer.weight -> q_proj.weight."""
    return _WRAPPERS.sub("", fqn)


def is_adapter(fqn: str) -> bool:
    return ".lora_A." in fqn or ".lora_B." in fqn


def resolve_targets(model: nn.Module, layers: nn.ModuleList, target_modules) -> str | list[str]:
    """"all-linear": a regex naming every Linear inside the decoder blocks (peft's own "all-linear" is every Linear
    but the output layer); a list of names: checked to match at least one module each."""
    names = [n for n, _ in model.named_modules()]
    if target_modules == "all-linear":
        prefix = next(n for n, m in model.named_modules() if m is layers)
        leaves = sorted({n.rsplit(".", 1)[-1] for layer in layers for n, m in layer.named_modules()
                         if isinstance(m, nn.Linear)})
        return rf"{re.escape(prefix)}\.\d+\.(.*\.)?({'|'.join(leaves)})"
    from .model import ModelError
    if isinstance(target_modules, str) or not target_modules or not all(isinstance(t, str) for t in target_modules):
        raise ModelError(f"lora.target_modules must be \"all-linear\" or a non-empty list of module names, "
                         f"got {target_modules!r}")
    for name in target_modules:
        if not any(n == name or n.endswith("." + name) for n in names):
            raise ModelError(f"lora.target_modules: '{name}' matches no module of {type(model).__name__}")
    return list(target_modules)


def apply_lora(model: nn.Module, rank: int, alpha: float, dropout: float, target_modules, modules_to_save: list,
               base_dtype: torch.dtype) -> dict | None:
    """Inject peft LoRA layers (and trainable copies of modules_to_save) into the meta skeleton; freeze the rest
    and keep it in base_dtype. Returns the settings a checkpoint records (None when rank is 0)."""
    if rank == 0:
        return None
    from peft import LoraConfig, inject_adapter_in_model
    from .model import ModelError, find_layers
    targets = resolve_targets(model, find_layers(model), target_modules)
    names = [n for n, _ in model.named_modules()]
    for name in modules_to_save:
        if not any(n == name or n.endswith("." + name) for n in names):
            raise ModelError(f"lora.modules_to_save: '{name}' matches no module of {type(model).__name__}")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        modules_to_save=list(modules_to_save) or None)
    inject_adapter_in_model(config, model)
    for p in model.parameters():  # frozen weights are never trained: no fp32 master copy of them
        if not p.requires_grad:
            p.data = p.data.to(base_dtype)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    num_adapted = sum(1 for n, _ in model.named_modules() if n.endswith(".lora_A"))
    print0(f"lora: rank {rank}, alpha {alpha:g} on {num_adapted} linear layers; trainable {trainable / 1e6:.3f}M of "
           f"{total / 1e6:.1f}M params ({trainable / total:.2%})")
    return {"rank": rank, "alpha": alpha, "dropout": dropout, "target_modules": targets,
            "modules_to_save": list(modules_to_save)}


@torch.no_grad()
def init_lora_weights(model: nn.Module, seed: int) -> None:
    """As peft initialises them (A kaiming-uniform, B zeros, so training starts at the base model), from `seed`:
    every rank draws the same full tensors in the same order, so any world size starts identically."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if not is_adapter(name):
            continue
        full = torch.zeros(p.shape, dtype=p.dtype)
        if ".lora_A." in name:
            nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=gen)
        if isinstance(p, DTensor):
            p.to_local().copy_(distribute_tensor(full.to(p.device), p.device_mesh, p.placements).to_local())
        else:
            p.copy_(full)


def peft_key(fqn: str) -> str:
    """Our checkpoint key -> the key PeftModel.save_pretrained writes (adapter name dropped)."""
    return "base_model.model." + fqn.replace(".lora_A.default.", ".lora_A.").replace(
        ".lora_B.default.", ".lora_B.").replace(".modules_to_save.default.", ".")


def write_adapter(out: Path, lora: dict, base_model: str, tensors: dict[str, torch.Tensor], dtype) -> None:
    """adapter_config.json + adapter_model.safetensors, as PeftModel.save_pretrained lays them out."""
    from peft import LoraConfig
    from safetensors.torch import save_file
    config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                        target_modules=lora["target_modules"], modules_to_save=lora["modules_to_save"] or None,
                        task_type="CAUSAL_LM", base_model_name_or_path=base_model)
    config.save_pretrained(str(out))
    save_file({peft_key(k): t.to(dtype).contiguous() for k, t in tensors.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})


def merged(name: str, base: torch.Tensor, adapters: dict, scale: float) -> torch.Tensor:
    """The export tensor `name`: W + scale * B @ A in fp32 for a LoRA target, the trained copy of a module to save,
    else the base tensor. `adapters` holds the checkpoint's tensors by their names."""
    stem = name.rsplit(".", 1)
    copy = f"{stem[0]}.modules_to_save.default.{stem[1]}"
    if copy in adapters:
        return adapters[copy].float()
    a, b = f"{stem[0]}.lora_A.default.weight", f"{stem[0]}.lora_B.default.weight"
    if stem[1] == "weight" and a in adapters:
        return base.float() + scale * (adapters[b].float() @ adapters[a].float())
    return base
