"""FP8 training (model.fp8) through torchao's float8 Linear: the float8 slot of model.parallelize, after the kernels
and before adapters, activation checkpointing, compile and FSDP.

The decoder's Linear layers become Float8Linear in place, on the meta skeleton: parameters keep their names, shapes
and dtypes, only the matmuls run in fp8 (scales computed dynamically per tensor, or per row for "rowwise"), so
checkpoints and exports hold the model's own dtypes and a run resumes with fp8 on or off. Tensorwise with fp8
all-gather (model.fp8_all_gather, the default) casts each weight shard to fp8 before FSDP's all-gather; rowwise
gathers bf16. On CPU the fp8 matmuls are emulated (for tests); on CUDA they need sm >= 8.9.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import re

import torch
from torch import nn

from ..distributed import print0
from ..errors import ModelError

MIN_HIDDEN_SIZE = 4096  # below this the casts cost about what the fp8 GEMMs save (torchao's and torchtitan's tables)
ROUTER_NAMES = ("gate", "router")  # the last name of an MoE's router Linear (Mixtral, Qwen-MoE: mlp.gate)


def check_float8(recipe: str, device: torch.device, *, compile: bool, hidden_size: int) -> None:
    """Refuse what cannot run fp8 (no torchao, a CUDA GPU below sm 8.9) in one line; note what will not gain."""
    if recipe == "off":
        return
    if importlib.util.find_spec("torchao") is None:
        raise ModelError(f"model.fp8={recipe} needs torchao: install the fp8 extra (pip install 'finetune[fp8]', or "
                         f"uv sync --extra fp8)")
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ModelError(f"model.fp8={recipe} needs a GPU with fp8 matmuls (compute capability >= 8.9: Ada, Hopper or "
                         f"newer); {torch.cuda.get_device_name(device)} is sm {major}.{minor}: set model.fp8=off")
    if hidden_size < MIN_HIDDEN_SIZE:
        print0(f"note: model.fp8={recipe} on a hidden size of {hidden_size} (< {MIN_HIDDEN_SIZE}): the fp8 casts "
               f"cost about what the smaller GEMMs save here; expect no speed-up")
    if not compile:
        print0(f"note: model.fp8={recipe} without model.compile is slower than bf16: only torch.compile fuses the "
               f"fp8 casts into their neighbours")


def num_experts(hf_config) -> int:
    """The routed experts of an MoE config (0 for a dense model)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return next((getattr(text, k) for k in ("num_local_experts", "num_experts", "n_routed_experts")
                 if getattr(text, k, None)), 0)


def float8_filter(model: nn.Module) -> tuple[list[str], dict[str, str]]:
    """(the names of the Linear layers to run in fp8, {name: why} of those kept in bf16): lm_head (the output),
    an MoE's router (named gate/router, or as many outputs as experts: its scores decide the routing), and any
    Linear with a dim that is not a multiple of 16."""
    head, experts = model.get_output_embeddings(), num_experts(model.config)
    convert, kept = [], {}
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        if mod is head:
            kept[name] = "output"
        elif name.rsplit(".", 1)[-1] in ROUTER_NAMES or "router" in name or mod.out_features == experts:
            kept[name] = "router"
        elif mod.in_features % 16 or mod.out_features % 16:
            kept[name] = "dims not multiples of 16"
        else:
            convert.append(name)
    return convert, kept


def describe_kept(kept: dict[str, str]) -> str:
    """'lm_head (output), model.layers.*.mlp.gate x4 (router)': the kept layers, blocks folded into one pattern."""
    groups: dict[tuple[str, str], int] = {}
    for name, why in kept.items():
        key = (re.sub(r"\.\d+\.", ".*.", name), why)
        groups[key] = groups.get(key, 0) + 1
    return ", ".join(f"{name}{f' x{n}' if n > 1 else ''} ({why})" for (name, why), n in groups.items())


def float8_config(recipe: str, *, all_gather: bool, emulate: bool):
    """torchao's Float8LinearConfig for `recipe`, fp8 all-gather for tensorwise only, emulated matmuls on CPU."""
    try:
        from torchao.float8 import Float8LinearConfig
    except ImportError as e:
        raise ModelError(f"model.fp8={recipe} needs torchao: install the fp8 extra (pip install 'finetune[fp8]', "
                         f"or uv sync --extra fp8)") from e
    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate,
                               enable_fsdp_float8_all_gather=all_gather and recipe == "tensorwise")


def apply_float8(model: nn.Module, recipe: str, *, shards: int, all_gather: bool = True,
                 emulate: bool = False) -> list[str]:
    """Swap the filtered Linear layers (float8_filter) for torchao's Float8Linear in place; returns their names.
    `shards`: the ranks FSDP shards each weight over; with fp8 all-gather every converted weight's sharded dim must
    divide evenly (torchao pads uneven shards wrongly: pytorch/ao#3982). A no-op for "off"."""
    if recipe == "off":
        return []
    config = float8_config(recipe, all_gather=all_gather, emulate=emulate)
    convert, kept = float8_filter(model)
    modules = dict(model.named_modules())
    if config.enable_fsdp_float8_all_gather:
        for name in convert:
            rows, cols = modules[name].weight.shape  # sharded on rows, or on columns the group divides (shard_dim)
            if rows % shards and not (rows < shards and cols % shards == 0):
                raise ModelError(f"model.fp8=tensorwise with model.fp8_all_gather=true: {name} has {rows} rows, "
                                 f"which the {shards} ranks sharding it do not divide (fp8 all-gather needs even "
                                 f"shards, pytorch/ao#3982); set model.fp8_all_gather=false or a world size that "
                                 f"divides it")
    from torchao.float8 import convert_to_float8_training
    wanted = set(convert)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda mod, name: name in wanted)
    how = ", fp8 all-gather" if config.enable_fsdp_float8_all_gather else ""
    from .moe import find_experts
    experts = len(find_experts(model))
    fused = f"; the fused experts of {experts} MoE layers stay in bf16 (3-D weights, not Linear)" if experts else ""
    print0(f"fp8: {recipe}{how}{', emulated on CPU' if emulate else ''}: {len(convert)} of "
           f"{len(convert) + len(kept)} Linear layers in fp8; {len(kept)} kept in bf16"
           f"{': ' + describe_kept(kept) if kept else ''}; embeddings in bf16{fused}")
    return convert


def precompute_scales_after_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """After each optimizer step, the fp8 scales of every all-gathered weight in one all-reduce (torchao's)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def precompute(*_):
        precompute_float8_dynamic_scale_for_fsdp(model)
    optimizer.register_step_post_hook(precompute)

    # and once more before the first forward, before FSDP's own hook all-gathers: weights change after this call
    # without an optimizer step (a resumed checkpoint), and DCP's set-up of the optimizer state runs a step of its
    # own before the load (state_dict._init_optim_state), whose scales would be those of the weights before it
    def first_forward(*_):
        precompute()
        handle.remove()
    handle = model.register_forward_pre_hook(first_forward, prepend=True)


def plan_float8_bytes(model: nn.Module, recipe: str, *, all_gather: bool, param_bytes: int) -> int:
    """What fp8 changes in the bytes per GPU of `finetune plan`'s units in flight (FSDP's current and next block) of
    the planned, unconverted `model`: tensorwise fp8 all-gather saves param_bytes - 1 per converted weight element of
    those two blocks (negative); otherwise the fp8 copies add one byte per element of one block (an upper bound).
    Plus the fp32 scales: 3 per Linear tensorwise, one per weight row and column rowwise (activations' not counted)."""
    if recipe == "off":
        return 0
    convert, _ = float8_filter(model)
    modules, per_block = dict(model.named_modules()), {}
    for name in convert:
        block = re.match(r"(.*?\.\d+)\.", name)  # the decoder block (FSDP unit) the Linear belongs to
        key = block[1] if block else name
        per_block[key] = per_block.get(key, 0) + modules[name].in_features * modules[name].out_features
    largest = sorted(per_block.values())[-2:] or [0]
    gathered_fp8 = recipe == "tensorwise" and all_gather
    weights = -sum(largest) * (param_bytes - 1) if gathered_fp8 else max(largest)
    scales = 4 * (3 * len(convert) if recipe == "tensorwise" else
                  sum(modules[n].in_features + modules[n].out_features for n in convert))
    return weights + scales


def float8_scales(cfg, run) -> None:
    """Tensorwise fp8 with fp8 all-gather: every weight's scale in one all-reduce after each optimizer step."""
    if cfg.model.fp8 == "tensorwise" and cfg.model.fp8_all_gather:
        precompute_scales_after_step(run.model, run.optimizer)


def float8_transform(model: nn.Module, layers, *, cfg, device: torch.device, shards: int) -> None:
    """The float8 slot: refusals and notes for this device, then Linear layers swapped for torchao's Float8Linear."""
    from ..model import resolve_compile
    m = cfg.model
    check_float8(m.fp8, device, compile=resolve_compile(m.compile, device.type == "cuda"),
                 hidden_size=model.config.get_text_config().hidden_size)
    apply_float8(model, m.fp8, shards=shards, all_gather=m.fp8_all_gather, emulate=device.type != "cuda")
