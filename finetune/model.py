"""Build the sharded training model: skeleton, kernels -> LoRA -> activation checkpointing -> compile -> FSDP, weights.

`parallelize` is the one place where the order lives (build_model and plan's fake model both call it):
  1. apply_kernels  patches modules (Liger) while they are plain HF modules;
     apply_lora     injects peft adapters into the Linear layers (before AC/compile/FSDP wrap the blocks, so each
                    block's FSDP unit holds its adapters too: every parameter is a DTensor);
  2. apply_ac       wraps whole decoder blocks with torch's non-reentrant checkpoint (not HF's
                    gradient_checkpointing, which under FSDP all-gathers each block again on recompute);
  3. apply_compile  compiles each block (regional compile must see the block before FSDP hooks it);
  4. apply_fsdp     shards each block, then the root (fp32 params, bf16 compute when mixed precision);
then `build_model` materialises the shards and load.py fills them: each rank reads its own slices of the HF
safetensors (rank 0 reads and scatters a layout that needs converting on load), or a prepared DCP checkpoint.
"""
from __future__ import annotations

import copy
import json
import os
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from .attention import check_packing, resolve_attn_implementation
from .compat import CheckpointImpl, apply_liger_kernels, checkpoint_wrapper
from .ext.context import apply_cp
from .distributed import print0
from .errors import ModelError, one_line
from .load import base_fingerprint, check_manifest, is_prepared, load_hf_weights, load_prepared_weights
from .ext.lora import apply_lora, init_lora_weights
from .ext.offload import HostOffload, Offloaded


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
    """The model's tokenizer, with a pad token (eos when the tokenizer has none) unless pad=False (as saved), and
    `chat_template` (data.chat_template's text) in place of its own."""
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


def load_generation_config(model_path: str, hf_config):
    """The source's generation_config.json, or (it has none) one derived from the model config, as save_pretrained
    does; a file that is there but unreadable or invalid is an error, never replaced."""
    from transformers import GenerationConfig
    try:
        return GenerationConfig.from_pretrained(model_path)
    except Exception as e:  # noqa: BLE001 - OSError (missing file, bad JSON), ValueError (bad values), ...
        there = (Path(model_path) / "generation_config.json").exists() if Path(model_path).is_dir() else \
            not isinstance(e, OSError)  # a hub id: a missing file is an OSError (so is one that cannot be fetched)
        if there:
            raise ModelError(f"cannot load the generation config of '{model_path}': {one_line(e)}") from e
    return GenerationConfig.from_model_config(hf_config)


def save_hf_files(out: Path, model_path: str, hf_config, trust_remote_code: bool, chat_template: str | dict = ""):
    """config.json, generation_config.json and the tokenizer files of `model_path` (with `chat_template` in place of
    its own, if given), saved as save_pretrained would."""
    hf_config.save_pretrained(out)
    load_generation_config(model_path, hf_config).save_pretrained(out)
    load_tokenizer(model_path, trust_remote_code, pad=False, chat_template=chat_template).save_pretrained(out)
    # transformers 5 also writes where *this* process loaded the tokenizer from (is_local, local_files_only) into
    # tokenizer_config.json; that describes our load, not the tokenizer, so it is dropped
    tok_config = out / "tokenizer_config.json"
    if tok_config.is_file():
        entries = json.loads(tok_config.read_text())
        if [entries.pop(k) for k in ("is_local", "local_files_only") if k in entries]:
            tok_config.write_text(json.dumps(entries, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def build_skeleton(hf_config, attn_implementation: str | None = "sdpa", trust_remote_code: bool = False) -> nn.Module:
    """The model with parameters on the meta device (fp32) and real buffers (rotary tables etc.) on CPU, on a copy
    of hf_config (from_config would set the caller's dtype and attention)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM
    attn_implementation = resolve_attn_implementation(hf_config, attn_implementation)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(hf_config), dtype=torch.float32,
                                                 attn_implementation=attn_implementation,
                                                 trust_remote_code=trust_remote_code)
    model.tie_weights()  # init_empty_weights re-registers parameters, which unties them
    return model


def find_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks: the longest ModuleList of one block class (what HF lists in _no_split_modules)."""
    best = None
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    for _, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            # the block class itself, not FSDP's subclass of it (wrapped and unwrapped blocks must agree)
            kinds = {next(k for k in type(clean_child(c)).__mro__ if not issubclass(k, FSDPModule)) for c in mod}
            names = {cls.__name__ for kind in kinds for cls in kind.__mro__}
            if len(kinds) == 1 and (not no_split or names & no_split) and (best is None or len(mod) > len(best)):
                best = mod
    if best is None:
        raise ModelError(f"cannot find the decoder layers of {type(model).__name__}")
    return best


def clean_child(mod: nn.Module) -> nn.Module:
    while hasattr(mod, "_checkpoint_wrapped_module") or hasattr(mod, "_orig_mod"):
        mod = getattr(mod, "_checkpoint_wrapped_module", None) or mod._orig_mod
    return mod


def resolve_auto(liger: bool | str, compile: bool | str, cuda: bool) -> tuple[bool, bool]:
    """model.liger / model.compile "auto": both on CUDA (Liger where liger-kernel is installed), both off on CPU."""
    import importlib.util
    if liger == "auto":
        liger = cuda and importlib.util.find_spec("liger_kernel") is not None
    return liger, cuda if compile == "auto" else compile


def apply_kernels(model: nn.Module, liger: bool, compile: bool = False) -> None:
    """Swap in Liger's fused kernels (RMSNorm, SwiGLU, RoPE, fused linear cross-entropy). CUDA, or on CPU under
    Triton's interpreter (TRITON_INTERPRET=1, for tests) only RoPE and the fused linear cross-entropy: the
    interpreter cannot run the others. With regional compile only the fused linear cross-entropy (outside the
    blocks): Liger dispatches RoPE through a torch.compiler.disable'd function, which splits every compiled block's
    graph (3 breaks a Llama block), and inductor fuses norms, SwiGLU and RoPE itself."""
    if not liger:
        return
    interpret = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not interpret:
        raise ModelError("model.liger=true needs a CUDA device (Liger kernels are Triton GPU kernels; on CPU only "
                         "under TRITON_INTERPRET=1, for tests)")
    # RoPE and fused linear cross-entropy are on by default; the interpreter gets no others (each arch's apply
    # function takes the switches it has)
    off = dict.fromkeys(("cross_entropy", "rms_norm", "swiglu", "geglu", "layer_norm"), False) if interpret else {}
    if compile:  # outside the compiled blocks only (apply_kernels' docstring)
        off = dict.fromkeys(("cross_entropy", "rms_norm", "swiglu", "geglu", "layer_norm", "rope"), False)
    try:
        apply_liger_kernels(model, **off)
    except ImportError as e:
        raise ModelError("model.liger=true needs liger-kernel: install the gpu extra (uv sync --extra gpu)") from e


def ac_layer_ids(num_layers: int, ratio: float) -> list[int]:
    """Which blocks to checkpoint: round(ratio * n) of them, spread evenly (0.5 -> every other block)."""
    k = round(ratio * num_layers)
    return [i for i in range(num_layers) if (i + 1) * k // num_layers > i * k // num_layers]


def _op_sac_policy():
    """Op-level selective AC: keep matmul and attention outputs, recompute the cheap pointwise ops."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    aten = torch.ops.aten
    save = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default,
            aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            aten._scaled_dot_product_cudnn_attention.default,
            aten._scaled_mm.default}  # model.fp8's matmuls (torchao's Float8Linear on CUDA), as torchtitan saves them

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE
    return partial(create_selective_checkpoint_contexts, policy)


def apply_ac(model: nn.Module, ratio: float, mode: str = "block", offload: bool = False) -> list[int]:
    """Wrap the chosen decoder blocks in torch's non-reentrant checkpoint; returns their indices. `offload`: the
    inputs each keeps for its recompute go to host memory and back, overlapped with compute (finetune.offload)."""
    layers = find_layers(model)
    ids = ac_layer_ids(len(layers), ratio)
    # respect_saved_tensors_hooks: the outputs op-level AC keeps go through the caller's saved_tensors_hooks
    # (save_on_cpu, the bench's saved-bytes count) like any saved tensor; torch's legacy default bypasses them
    kwargs = {"context_fn": _op_sac_policy(), "respect_saved_tensors_hooks": True} if mode == "op" else {}
    host = HostOffload() if offload else None  # one copy stream and block order for the whole model
    for i in ids:
        layers[i] = checkpoint_wrapper(layers[i], checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)
        if offload:
            layers[i] = Offloaded(layers[i], host)
    return ids


def apply_compile(model: nn.Module, enabled: bool) -> None:
    """Compile each decoder block in place (keeps parameter names; one graph reused by every block). An offloaded
    block's hooks stay outside the compiled region (eager, as they are Python)."""
    if enabled:
        for layer in find_layers(model):
            (layer._checkpoint_wrapped_module if isinstance(layer, Offloaded) else layer).compile()


def shard_dim(shape, shards: int) -> int:
    """The dim FSDP shards a parameter on: 0, unless it has fewer rows than ranks in a shard group (fused MoE experts,
    8 of them on 16 ranks: half the ranks would hold none, the others twice their share), then its longest dim that
    the group divides (FSDP2 shards other dims only evenly)."""
    if not shape or shape[0] >= shards:
        return 0
    return max((d for d in range(1, len(shape)) if shape[d] % shards == 0), key=lambda d: shape[d], default=0)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, mixed_precision: str, lm_head_unit: bool = True) -> None:
    """fully_shard each block, the input embedding and the output projection, then the root (final norm, the rest).
    On a 2-D mesh ("dp_replicate", "dp_shard") this is HSDP: sharded within a group, replicated across groups.
    Tied embeddings are one parameter, which must live in one FSDP unit (a parameter shared by two is rejected):
    they stay in the root. `lm_head_unit=False` keeps an untied lm_head in the root too, for Liger's fused
    cross-entropy: it reads lm_head.weight in the model's forward, not in lm_head's, so a unit of its own would
    never be all-gathered there (Liger issues #332, #631)."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed_precision == "bf16" else MixedPrecisionPolicy()
    shards = mesh.shape[-1]
    kw = dict(mesh=mesh, mp_policy=mp, shard_placement_fn=lambda p: Shard(shard_dim(p.shape, shards)))
    layers = find_layers(model)
    for i, layer in enumerate(layers):
        # the last block is resharded right after backward begins anyway; keeping it avoids one all-gather
        fully_shard(layer, reshard_after_forward=i < len(layers) - 1, **kw)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and {id(p) for p in embed.parameters()} & {id(p) for p in head.parameters()}
    if not tied:
        fully_shard(embed, **kw)
        if head is not None and lm_head_unit:  # used last in forward, first in backward: kept unsharded between
            fully_shard(head, reshard_after_forward=False, **kw)
    fully_shard(model, **kw)
    # gradients are summed over ranks, not averaged: train_step divides by the global label-token count itself
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM


def _materialize(model: nn.Module, device: torch.device) -> None:
    """Allocate the sharded parameters on `device`, keeping the buffers computed at construction."""
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    model.to_empty(device=device)
    with torch.no_grad():
        for n, b in model.named_buffers():
            b.copy_(buffers[n])


def parallelize(model: nn.Module, mesh: DeviceMesh, *, mixed_precision: str, lora: dict | None = None,
                ac_ratio: float = 0.0, ac_mode: str = "block", ac_offload: bool = False, compile: bool = False,
                liger: bool = False, kernels: bool = True, fp8: str = "off", fp8_all_gather: bool = True,
                fp8_emulate: bool = False) -> dict | None:
    """apply_* in their order (module docstring) on the meta skeleton; returns the LoRA settings a checkpoint records
    (None without LoRA). With `lora` (rank, alpha, dropout, target_modules, modules_to_save) the frozen base is
    kept in bf16 (fp32 when mixed_precision is fp32). kernels=False leaves Liger's kernels out but keeps the FSDP
    layout they need (plan's fake model: the kernels cannot run on fake tensors)."""
    apply_kernels(model, liger and kernels, compile)
    if fp8 != "off":  # the float8 slot: Linear -> torchao's Float8Linear (ext/float8.py)  # wired by the lead
        from .ext.float8 import apply_float8
        apply_float8(model, fp8, shards=mesh.shape[-1], all_gather=fp8_all_gather, emulate=fp8_emulate)
    base_dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    settings = apply_lora(model, find_layers(model), **lora, base_dtype=base_dtype) if lora and lora["rank"] else None
    apply_ac(model, ac_ratio, ac_mode, ac_offload)
    apply_compile(model, compile)
    apply_fsdp(model, mesh, mixed_precision, lm_head_unit=not liger)
    return settings


def build_model(path: str, device: torch.device, mesh: DeviceMesh, *, mixed_precision: str = "bf16",
                ac_ratio: float = 0.0, ac_mode: str = "block", compile: bool | str = False, liger: bool | str = False,
                attn_implementation: str = "sdpa", trust_remote_code: bool = False, lora: dict | None = None,
                seed: int = 0, packing: bool = False, cp_group=None,
                ac_offload: bool = False, fp8: str = "off",
                fp8_all_gather: bool = True) -> tuple[nn.Module, dict | None]:
    """A sharded model ready to train, with the weights of `path` (HF dir/id or prepared dir): fp32 masters, or
    with `lora` (rank, alpha, dropout, target_modules, modules_to_save) fp32 adapters on a frozen base kept in
    bf16 (fp32 when mixed_precision is fp32); and the LoRA settings its checkpoints record (None without LoRA),
    with the base weights' fingerprint, which checkpoints record to tie adapters to their base. "auto" for the
    attention, Liger and compile picks by device (one line says what); `packing`: refuse attention that cannot keep
    packed samples apart (attention.check_packing); `cp_group`: split each row over its ranks (context.apply_cp);
    `ac_offload`: checkpointed blocks keep their inputs in host memory (apply_ac; a no-op on CPU)."""
    hf_config = load_hf_config(path, trust_remote_code)  # checks a prepared checkpoint's manifest
    asked = "auto" in (attn_implementation, liger, compile)
    liger, compile = resolve_auto(liger, compile, device.type == "cuda")
    model = build_skeleton(hf_config, attn_implementation, trust_remote_code)
    attn = model.config._attn_implementation
    kernels = "fused loss only (compiled blocks)" if liger and compile else "on" if liger else "off"
    print0(f"kernels: attention {attn}, Liger {kernels}, regional compile {'on' if compile else 'off'} "
           f"({'auto on ' if asked else ''}{device.type})")
    if packing:
        check_packing(model, find_layers(model), attn)
    if cp_group is not None:
        apply_cp(model, find_layers(model), cp_group)
    if fp8 != "off":  # refuse a GPU or an install without fp8; note where it will not gain  # wired by the lead
        from .ext.float8 import check_float8
        check_float8(fp8, device, compile=compile, hidden_size=hf_config.get_text_config().hidden_size)
    if ac_offload and device.type != "cuda":
        print0("note: ac.offload is a no-op on CPU: activations already live in host memory")
    settings = parallelize(model, mesh, mixed_precision=mixed_precision, lora=lora, ac_ratio=ac_ratio,
                           ac_mode=ac_mode, ac_offload=ac_offload and device.type == "cuda", compile=compile,
                           liger=liger, fp8=fp8, fp8_all_gather=fp8_all_gather, fp8_emulate=device.type != "cuda")
    _materialize(model, device)
    if is_prepared(path):
        load_prepared_weights(model, path)
    else:  # the name map comes from a clean skeleton: the model's own is wrapped by now
        load_hf_weights(model, build_skeleton(hf_config, None, trust_remote_code), path, trust_remote_code)
    if settings:
        init_lora_weights(model, seed)
        settings["base_fingerprint"] = base_fingerprint(path)  # which base weights the adapters belong to
    base_dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    for p in model.parameters():  # invariant: sharded trainable weights are fp32 masters
        assert p.dtype == (torch.float32 if p.requires_grad else base_dtype), p.dtype
    model.train()
    return model, settings
