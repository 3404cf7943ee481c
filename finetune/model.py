"""Build the sharded training model: skeleton -> `parallelize` -> weights. The transforms' one order: kernels ->
(tensor parallel) -> context parallel -> expert parallel -> float8 -> adapters (on the plain HF modules, so later
wrappers and FSDP units hold them) -> activation checkpointing (with offload) -> compile (each block) -> FSDP."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from .attention import attention_notes, check_packing, check_trainable, resolve_attn_implementation
from .compat import CheckpointImpl, checkpoint_wrapper
from .distributed import print0
from .errors import ModelError, one_line
from .load import check_manifest, load_hf_weights
from .weights import is_prepared


# the stages of the model transforms, in the order they run; activation checkpointing's wraps are "ac"'s, then compile
# and FSDP follow (tensor parallel, not built, would come after the kernels)
STAGES = ("attention", "kernels", "context_parallel", "expert_parallel", "float8", "adapters", "ac")


@dataclass
class Transform:
    """One model transform, the interface of kernels/, parallel/, adapters/ and memory/ (build.transforms makes them
    from the config): `apply` at its `stage` (STAGES), and what else it adds to the build.
    - "attention": apply() registers an attention function before the skeleton is built (varlen);
    - "kernels" to "float8": apply(model, layers) on the meta skeleton's plain HF modules, in STAGES order;
    - "adapters": apply(model, layers) -> the settings its checkpoints record (the base frozen);
    - "ac": apply(block) -> what wraps each checkpointed block (op-level AC's checkpoint, activation offload)."""
    stage: str
    apply: Callable
    note: str = ""  # what it does, for the start-up line
    after_load: Callable | None = None  # (model, settings): once the weights are in (the adapters' init)
    fill: Callable | None = None  # (param, rows) -> bool: the load writes rows into a base held quantized (QLoRA)
    unsharded: Callable | None = None  # (model) -> params that FSDP over one rank leaves alone (QLoRA's NF4)
    lm_head_in_root: bool = False  # lm_head.weight read outside lm_head's forward (Liger's fused loss)


def load_hf_config(path: str, trust_remote_code: bool = False):
    """The HF config of `path`; for a prepared checkpoint also checked against its manifest."""
    from transformers import AutoConfig
    if path.startswith(("/", "./", "../", "~")) and not Path(path).expanduser().exists():
        raise ModelError(f"model path '{path}' does not exist")
    try:
        hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers' validation errors have several types; all are about the file
        raise ModelError(f"cannot load model '{path}': {one_line(e)}") from e
    if is_prepared(path):
        check_manifest(path, hf_config)
    return hf_config


def load_tokenizer(path: str, trust_remote_code: bool = False, pad: bool = True, chat_template: str | dict = ""):
    """The tokenizer, eos as pad token where it has none (not with pad=False: as saved), `chat_template` for its own."""
    from transformers import AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - a malformed tokenizer file raises KeyError, Exception, ...
        raise ModelError(f"cannot load the tokenizer of '{path}': {one_line(e)}") from e
    if pad and tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if chat_template:
        tok.chat_template = chat_template
    return tok


def build_skeleton(hf_config, attn_implementation: str | None = "sdpa", trust_remote_code: bool = False,
                   varlen: Callable | None = None) -> nn.Module:
    """The model with fp32 parameters on the meta device and real buffers (rotary tables etc.) on CPU."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    attn_implementation = resolve_attn_implementation(hf_config, attn_implementation, varlen)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), dtype=torch.float32,
                                                 attn_implementation=attn_implementation,
                                                 trust_remote_code=trust_remote_code)
    model.tie_weights()  # init_empty_weights re-registers parameters, which unties them
    return model


def find_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks: the longest ModuleList of classes HF lists in _no_split_modules (without them: of one)."""
    best = None
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    for _, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            # the block class itself, not FSDP's subclass of it (wrapped and unwrapped blocks must agree)
            kinds = {next(k for k in type(clean_child(c)).__mro__ if not issubclass(k, FSDPModule)) for c in mod}
            # a hybrid (olmo_hybrid) lists an attention block class and a linear-attention one
            blocks = all({cls.__name__ for cls in kind.__mro__} & no_split for kind in kinds) if no_split else \
                len(kinds) == 1
            if blocks and (best is None or len(mod) > len(best)):
                best = mod
    if best is None:
        raise ModelError(f"cannot find the decoder layers of {type(model).__name__}")
    return best


def find_decoder(model: nn.Module) -> nn.Module:
    """The module whose output is the hidden states lm_head reads: get_decoder(), or where that is the whole model
    (Llama 4's: its base_model_prefix names no attribute) its one child that is itself a transformers model."""
    from transformers import PreTrainedModel
    decoder = model.get_decoder()
    if decoder is not model:
        return decoder
    inner = [m for m in model.children() if isinstance(m, PreTrainedModel)]
    if len(inner) != 1:
        raise ModelError(f"cannot find the decoder of {type(model).__name__}: its get_decoder() is the whole model")
    return inner[0]


def router_recorder(model: nn.Module) -> tuple[type, int] | None:
    """(router module class, index of its logits in its output) as transformers records them; None without routers."""
    rec = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
    if rec is None:
        return None
    if isinstance(rec, type):
        return rec, 0
    return rec.target_class, rec.index or 0


def find_experts(model: nn.Module) -> list[nn.Module]:
    """The fused expert modules (transformers' @use_experts_implementation classes: 3-D weights)."""
    return [m for m in model.modules() if hasattr(m, "_is_expert_parallel")]


def clean_child(mod: nn.Module) -> nn.Module:
    while hasattr(mod, "_checkpoint_wrapped_module") or hasattr(mod, "_orig_mod"):
        mod = getattr(mod, "_checkpoint_wrapped_module", None) or mod._orig_mod
    return mod


def resolve_compile(compile: bool | str, cuda: bool) -> bool:
    return cuda if compile == "auto" else compile


def ac_layer_ids(num_layers: int, ratio: float) -> list[int]:
    """Which blocks to checkpoint: round(ratio * n) of them, spread evenly (0.5 -> every other block)."""
    k = round(ratio * num_layers)
    return [i for i in range(num_layers) if (i + 1) * k // num_layers > i * k // num_layers]


def apply_ac(model: nn.Module, ratio: float, wraps=()) -> list[int]:
    """Wrap the chosen blocks in non-reentrant checkpoint, then in each of `wraps` (the "ac" transforms); their ids."""
    layers = find_layers(model)
    ids = ac_layer_ids(len(layers), ratio)
    for i in ids:
        layers[i] = checkpoint_wrapper(layers[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        for wrap in wraps:
            layers[i] = wrap(layers[i])
    return ids


def apply_compile(model: nn.Module, enabled: bool) -> None:
    """Compile each decoder block in place (a wrapper with `compile_inside`: offload's hooks, stays outside)."""
    if enabled:
        for layer in find_layers(model):
            (layer._checkpoint_wrapped_module if getattr(layer, "compile_inside", False) else layer).compile()


def shard_dim(shape, shards: int) -> int:
    """FSDP's dim for `shape`: 0, or with fewer rows than ranks its longest dim the ranks divide (FSDP2: evenly)."""
    if not shape or shape[0] >= shards:
        return 0
    return max((d for d in range(1, len(shape)) if shape[d] % shards == 0), key=lambda d: shape[d], default=0)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, mixed_precision: str, lm_head_unit: bool = True,
               ignored: set | None = None, cpu_offload: bool = False) -> None:
    """fully_shard each block, the embedding and lm_head (not tied, `lm_head_unit`), the root (2-D mesh: HSDP);
    the parameters `ignored` stay plain tensors; `cpu_offload`: the shards, their gradients (and so the optimizer's
    state) in host memory, pinned where there is a GPU, copied to it for each all-gather."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed_precision == "bf16" else MixedPrecisionPolicy()
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    def over(mesh: DeviceMesh) -> dict:
        return dict(mesh=mesh, mp_policy=mp, offload_policy=offload,
                    shard_placement_fn=lambda p: Shard(shard_dim(p.shape, mesh.shape[-1])))
    kw = dict(over(mesh), ignored_params=ignored)
    layers = find_layers(model)
    for i, layer in enumerate(layers):
        # expert parallel: a rank's experts are an FSDP unit of their own, over the ranks holding the same experts
        for sub in (m for m in layer.modules() if getattr(m, "fsdp_mesh", None) is not None):
            fully_shard(sub, reshard_after_forward=i < len(layers) - 1, **over(sub.fsdp_mesh))
        # the last block is resharded right after backward begins anyway; keeping it avoids one all-gather
        fully_shard(layer, reshard_after_forward=i < len(layers) - 1, **kw)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and {id(p) for p in embed.parameters()} & {id(p) for p in head.parameters()}
    if not tied:
        fully_shard(embed, **kw)
        if head is not None and lm_head_unit:  # used last in forward, first in backward: kept unsharded between
            fully_shard(head, reshard_after_forward=False, **kw)
    fully_shard(model, **kw)
    if cpu_offload:  # Llama 4 moves its ids to the embedding's (host) shard first: back to the gathered weight's device
        embed.register_forward_pre_hook(lambda mod, args: tuple(a.to(mod.weight.device) for a in args))
    # gradients are summed over ranks, not averaged: train_step divides by the global label-token count itself
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def _materialize(model: nn.Module, device: torch.device) -> None:
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    # with CPU offload FSDP moves each shard to pinned host memory as it materializes (FSDPParam.reset_sharded_param)
    model.to_empty(device=device)
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])


def compute_device(model: nn.Module) -> torch.device:
    """The device `model` computes on: its FSDP mesh's (with parallel.cpu_offload its shards are in host memory)."""
    p = next(model.parameters())
    kind = p.device_mesh.device_type if isinstance(p, DTensor) else p.device.type
    return p.device if kind == p.device.type else torch.device(kind, torch.accelerator.current_device_index())


def parallelize(model: nn.Module, mesh: DeviceMesh, transforms: list[Transform], *, mixed_precision: str,
                ac_ratio: float = 0.0, compile: bool = False, done: tuple = (),
                cpu_offload: bool = False) -> dict | None:
    """`transforms` in STAGES order (module docstring; the stages `done` already applied), then activation
    checkpointing with the "ac" wraps, compile and FSDP (`cpu_offload`: its shards in host memory); returns the
    adapters' settings (None without)."""
    layers, settings = find_layers(model), None
    skip = ("attention", "ac", *done)
    for t in sorted((t for t in transforms if t.stage not in skip), key=lambda t: STAGES.index(t.stage)):
        out = t.apply(model, layers)
        settings = out if t.stage == "adapters" else settings
    apply_ac(model, ac_ratio, [t.apply for t in transforms if t.stage == "ac"])
    apply_compile(model, compile)
    ignored = {p for t in transforms if t.unsharded for p in t.unsharded(model)} if mesh.shape[-1] == 1 else set()
    if cpu_offload:
        kept = f" (on one rank the {len(ignored)} NF4 weights stay on the device)" if ignored else ""
        print0(f"offload: FSDP keeps the parameter shards, their gradients and AdamW's state in host memory; the "
               f"optimizer steps on the CPU{kept}")
    apply_fsdp(model, mesh, mixed_precision, lm_head_unit=not any(t.lm_head_in_root for t in transforms),
               ignored=ignored or None, cpu_offload=cpu_offload)
    return settings


def build_model(path: str, device: torch.device, mesh: DeviceMesh, transforms: list[Transform] | None = None, *,
                mixed_precision: str = "bf16", ac_ratio: float = 0.0, compile: bool | str = False,
                attn_implementation: str = "sdpa", trust_remote_code: bool = False, packing: bool = False,
                cpu_offload: bool = False) -> tuple[nn.Module, dict | None]:
    """(model, adapter settings or None) over `mesh`, `path`'s weights: fp32 masters, or adapters on a frozen base
    (`cpu_offload`: FSDP's shards in host memory)."""
    transforms = transforms or []
    varlen = next((t.apply for t in transforms if t.stage == "attention"), None)
    hf_config = load_hf_config(path, trust_remote_code)  # checks a prepared checkpoint's manifest
    asked = "auto" in (attn_implementation, compile)
    compile = resolve_compile(compile, device.type == "cuda")
    model = build_skeleton(hf_config, attn_implementation, trust_remote_code, varlen)
    attn = model.config._attn_implementation
    check_trainable(attn, device.type)
    note = next((t.note for t in transforms if t.note), "Liger off")
    print0(f"kernels: attention {attn}{attention_notes(model, attn)}, {note}, regional compile "
           f"{'on' if compile else 'off'} ({'auto on ' if asked else ''}{device.type})")
    find_decoder(model)  # the loss reads its output: a model without one is refused before loading
    layers = find_layers(model)
    # the kernels first: check_packing lets a model pack whose token-mixing layers they made run per sample
    for t in transforms:
        if t.stage == "kernels":
            t.apply(model, layers)
    if packing:
        check_packing(model, layers, attn)
    settings = parallelize(model, mesh, transforms, mixed_precision=mixed_precision, ac_ratio=ac_ratio,
                           compile=compile, done=("kernels",), cpu_offload=cpu_offload)
    _materialize(model, device)
    # the name map comes from a clean skeleton (the model's own is wrapped by now); a prepared dir's load needs none
    skeleton = None if is_prepared(path) else build_skeleton(hf_config, None, trust_remote_code)
    load_hf_weights(model, skeleton, path, trust_remote_code, next((t.fill for t in transforms if t.fill), None))
    for t in transforms:
        if t.after_load is not None:
            t.after_load(model, settings)
    base_dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    # invariant: sharded trainable weights are fp32 masters; a frozen base is in base_dtype, and what the model class
    # itself freezes (ERNIE-4.5-MoE's moe_statics) stays fp32
    for p in model.parameters():
        assert p.dtype in ({torch.float32} if p.requires_grad else {base_dtype, torch.float32}), p.dtype
    model.train()
    return model, settings
