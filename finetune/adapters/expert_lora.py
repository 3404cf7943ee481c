"""LoRA on the fused 3-D expert parameters of MoE layers: per expert A [E, r, in] and B [E, out, r]; the experts'
forward computes with W + alpha/r * B @ A (one baddbmm over this rank's experts, no separate delta), so any experts
implementation (grouped GEMM, batched, eager) and expert parallel (each rank's experts: A and B split over the ep
ranks as W is) run it unchanged. Also the merge math and peft 0.21's adapter layout of these tensors.

Not peft's own `target_parameters` in training: its lora_B keeps the experts interleaved along its last dim (column
j * E + e), so no block of it is one rank's experts (EP's Shard(0)), and it swaps the parameter for a parametrization
during each forward, out of the module's own parameters that FSDP and EP hand out. The adapter export writes peft's
layout, which PeftModel loads onto the base.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..kernels.moe import ExpertsView, expert_tensors, find_experts


def expert_params(model: nn.Module) -> dict[str, list[str]]:
    """{name of each fused experts module: its parameters laid out by expert (3-D, [num_experts, ., .])}, in the
    module's own order (peft nests one wrapper per parameter in that order)."""
    ids = {id(m) for m in find_experts(model)}
    return {name: [n for n, p in m.named_parameters(recurse=False) if p.dim() == 3 and p.shape[0] == m.num_experts]
            for name, m in model.named_modules() if id(m) in ids}


def ends(fqn: str, name: str) -> bool:
    return fqn == name or fqn.endswith("." + name)


def peft_remapped(model: nn.Module, names: list[str]) -> tuple[list[str], str]:
    """(those of the Linear targets `names` that peft turns into the fused experts' parameters, why): its conversion
    of transformers-v4 MoE adapters remaps names like gate_proj in some model types (DeepSeek-V3, GLM-4.5, Qwen3-Next:
    their shared experts or dense MLPs), and its layer then fails on our expert LoRA."""
    import peft
    from peft import LoraConfig
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    def remapped(name: str) -> bool:
        config = LoraConfig(target_modules=[name])
        try:
            convert_peft_config_for_transformers(config, model, None)
        except ValueError:  # one of a fused pair alone (gate_proj without up_proj): it would remap the pair
            return True
        return bool(config.target_parameters)
    return [n for n in names if remapped(n)], (f"peft {peft.__version__} turns LoRA targets with these names of a "
                                               f"{model.config.model_type} model into its fused experts' parameters "
                                               f"(its conversion of transformers-v4 adapters, huggingface/peft#3711)")


def match_expert_params(params: dict[str, list[str]], names: list[str]) -> list[str]:
    """The "module.param" names of the expert parameters `names` (lora.target_modules) name: one ending an experts
    module's name names all its parameters ("experts"), one ending a parameter's name that one ("down_proj")."""
    return [f"{m}.{p}" for m, ps in params.items() for p in ps
            if any(ends(m, t) or ends(f"{m}.{p}", t) for t in names)]


def is_transposed(module: nn.Module) -> bool:
    """Its parameters are [E, in, out] (gpt-oss), not [E, out, in] (transformers' flag on the experts class)."""
    return bool(getattr(module, "is_transposed", False))


def transposed_params(model: nn.Module) -> set[str]:
    """The "module.param" names of the expert parameters stored [E, in, out]."""
    return {f"{m}.{p}" for m, ps in expert_params(model).items() if is_transposed(model.get_submodule(m)) for p in ps}


def expert_factor(p: torch.Tensor, shape: tuple[int, int]) -> nn.Parameter:
    """A new fp32 parameter [E, *shape] on p's device, split over the experts as p is (a DTensor: the same mesh and
    placements, e.g. Shard(0) over the ep ranks)."""
    full = (p.shape[0], *shape)
    if not hasattr(p, "to_local"):
        return nn.Parameter(torch.empty(full, device=p.device))
    from torch.distributed.tensor import DTensor
    local = torch.empty((p.to_local().shape[0], *shape), device=p.device)
    return nn.Parameter(DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=full,
                                           stride=torch.empty(full, device="meta").stride()))


def apply_expert_lora(model: nn.Module, targets: list[str], rank: int, scale: float) -> None:
    """LoRA factors for the expert parameters `targets` ("module.param"), as `<module>.lora_A.default.<param>`
    [E, r, in] and `lora_B` [E, out, r]; the module's forward then computes with W + scale * B @ A."""
    by_module: dict[str, list[str]] = {}
    for target in targets:
        module_name, param = target.rsplit(".", 1)
        by_module.setdefault(module_name, []).append(param)
    for module_name, params in by_module.items():
        module = model.get_submodule(module_name)
        factors_a, factors_b = {}, {}
        for name in params:
            p = getattr(module, name)
            fan_in, fan_out = (p.shape[1], p.shape[2]) if is_transposed(module) else (p.shape[2], p.shape[1])
            factors_a[name], factors_b[name] = expert_factor(p, (rank, fan_in)), expert_factor(p, (fan_out, rank))
        module.lora_A = nn.ModuleDict({"default": nn.ParameterDict(factors_a)})
        module.lora_B = nn.ModuleDict({"default": nn.ParameterDict(factors_b)})
        module.adapt_experts = partial(add_deltas, module, scale=scale)
        module.experts_adapters_on = True
        # expert parallel's forward computes with expert_tensors itself; the model's own needs it handed in
        if "forward" not in vars(module):
            module.forward = partial(adapted_forward, module, forward=type(module).forward)


def adapted_summary(model: nn.Module, experts: dict[str, list[str]]) -> str:
    """What LoRA adapted, in words: the linear layers of attention and of the MLPs, the expert tensors."""
    linear = [n[:-len(".lora_A")] for n, _ in model.named_modules()
              if n.endswith(".lora_A") and n[:-len(".lora_A")] not in experts]
    attention = sum(1 for n in linear if "attn" in n or "attention" in n)
    text = f"{len(linear)} linear layers (attention {attention}, MLP {len(linear) - attention})"
    adapted = [model.get_submodule(m) for m in experts if "lora_A" in model.get_submodule(m)._modules]
    if adapted:
        names = sorted({p for m in adapted for p in m.lora_A["default"]})
        text += (f" and {sum(len(m.lora_A['default']) for m in adapted)} expert tensors ({', '.join(names)}; "
                 f"{len(adapted)} MoE layers of {adapted[0].num_experts} experts)")
    return text


def adapted_forward(module: nn.Module, *args, forward, **kwargs):
    """The experts' own forward over their adapted tensors."""
    return forward(ExpertsView(module, expert_tensors(module), module.num_experts), *args, **kwargs)


def add_deltas(module: nn.Module, tensors: dict, *, scale: float) -> dict:
    """`tensors` (the module's local ones) with W + scale * B @ A for each adapted one (none while switched off)."""
    if not module.experts_adapters_on:
        return tensors
    factors_a, factors_b = module.lora_A["default"], module.lora_B["default"]
    for name in factors_a:
        a, b = (t.to_local() if hasattr(t, "to_local") else t for t in (factors_a[name], factors_b[name]))
        w = tensors[name]
        # W is [E, in, out] where transposed: W + scale * (B @ A)^T = W + scale * A^T @ B^T
        tensors[name] = torch.baddbmm(w, a.mT, b.mT, alpha=scale) if is_transposed(module) else \
            torch.baddbmm(w, b, a, alpha=scale)
    return tensors


def switch_expert_adapters(model: nn.Module, on: bool) -> None:
    """The experts' adapters on or off (dpo's reference: the base model)."""
    for m in model.modules():
        if "experts_adapters_on" in vars(m):
            m.experts_adapters_on = on


def expert_delta(lora_a: torch.Tensor, lora_b: torch.Tensor, transposed: bool) -> torch.Tensor:
    """B @ A of each expert in fp32, in the parameter's layout ([E, in, out] where `transposed`)."""
    delta = lora_b.float() @ lora_a.float()
    return delta.mT if transposed else delta


def peft_tensor(key: str, tensor: torch.Tensor, target_parameters: list[str]) -> tuple[str, torch.Tensor]:
    """A checkpoint's adapter (key, tensor) -> peft's: an expert factor `<m>.lora_A.default.<p>` [E, r, in] is
    `<m>[.base_layer]*k.lora_A.default.weight` [E * r, in] (lora_B [E, out, r]: [out, r * E], the expert fastest),
    k the targeted parameters of m after p (peft wraps m once per parameter, the first innermost); others as
    they are."""
    for side in ("lora_A", "lora_B"):
        module_name, sep, param = key.partition(f".{side}.default.")
        if sep and f"{module_name}.{param}" in target_parameters:
            own = [t for t in target_parameters if t.rsplit(".", 1)[0] == module_name]
            nested = ".base_layer" * (len(own) - 1 - own.index(f"{module_name}.{param}"))
            if side == "lora_A":
                tensor = tensor.reshape(-1, tensor.shape[-1])
            else:
                tensor = tensor.permute(1, 2, 0).reshape(tensor.shape[1], -1)
            return f"{module_name}{nested}.{side}.default.weight", tensor
    return key, tensor
