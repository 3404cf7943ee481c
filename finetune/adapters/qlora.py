"""QLoRA: the frozen linear weights of the decoder blocks held as torchao's NF4 (lora.quantize_base="nf4"),
quantized shard by shard while the weights load, each rank's bytes those of the whole tensor quantized at once."""
from __future__ import annotations

import copy
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..distributed import print0

BLOCK = 64  # elements per NF4 scale (torchao's default block_size)
SCALER_BLOCK = 256  # scales per double-quantization factor (torchao's default scaler_block_size)
GRANULE = BLOCK * SCALER_BLOCK  # a shard holding whole factors: its bytes need no other rank's
NF4_BYTES = 0.5 + 1 / BLOCK + 2 / GRANULE  # per element: a 4-bit code, an int8 scale a block, a bf16 factor a granule
# values dequantized at once: torchao's whole-tensor dequantization keeps ~14 bytes a value alive (int64 codes, two
# halves, their scaled copies, the stack): 3.3 GB for one 28672 x 8192 weight of a 70B model; a chunk of 2^24 values
# keeps that to ~110 MB (measured: ~6.5 bytes a chunk value) beside the weight's bf16 copy, in few kernel launches
CHUNK = 2**24


def nf4_misfit(module: nn.Linear, shards: int) -> str | None:
    """Why `module`'s weight cannot be held as NF4 over `shards` ranks (dim-0 shards of whole factors), or None."""
    if not is_plain_linear(module):
        return f"belongs to a {type(module).__name__}, a Linear whose forward is not a Linear's (a router's)"
    shape = module.weight.shape
    if len(shape) != 2:
        return f"is {len(shape)}-D"
    if shape[0] % shards or (shape[0] // shards * shape[1]) % GRANULE:
        whole = f"does not split into {shards} row shards of whole" if shards > 1 else "is not a whole number of"
        return f"{list(shape)} {whole} NF4 factor blocks ({GRANULE} elements each)"
    return None


def is_plain_linear(module: nn.Module) -> bool:
    """A Linear whose forward computes a Linear's output (Linear's own, or Falcon's x @ W.T + b): what NF4's matmul
    and peft's LoRA layer stand in for. Not Llama 4's router (a Linear returning scores and logits) nor DeepSeek-V4's
    grouped projection: their forward is run once to see, on meta tensors (a copy of the module holding meta
    parameters of its parameters' shapes: plan's are fake, sharded ones) and an input of leading shape (2, 3)."""
    if not isinstance(module, nn.Linear) or type(module).forward is nn.Linear.forward:
        return isinstance(module, nn.Linear)
    stand_in = copy.copy(module)
    stand_in._parameters = {n: p if p is None else torch.empty(p.shape, dtype=p.dtype, device="meta")
                            for n, p in module._parameters.items()}
    x = torch.empty(2, 3, module.in_features, dtype=module.weight.dtype, device="meta")
    try:
        out = type(module).forward(stand_in, x)
    except Exception:  # noqa: BLE001 - an input a Linear takes that this forward does not: not a plain one
        return False
    return isinstance(out, torch.Tensor) and tuple(out.shape) == (2, 3, module.out_features)


def apply_nf4(model: nn.Module, layers: nn.ModuleList, shards: int, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """On the meta skeleton, after apply_lora froze the base: each frozen Linear weight of the blocks `layers` becomes
    an NF4 parameter of `dtype` (its scales' and dequantized values'; filled by fill_nf4 on load) when its shape
    splits into `shards` row shards of whole blocks; returns the others, kept in `dtype`, with why."""
    from torchao.quantization import to_nf4
    from ..kernels.moe import find_experts
    kept, num_quantized = [], 0
    for name, mod in frozen_linears(layers):
        if why := nf4_misfit(mod, shards):
            kept.append(f"{name}.weight {why}")
            continue
        meta = torch.empty(mod.weight.shape, dtype=dtype, device="meta")
        mod.weight = nn.Parameter(to_nf4(meta, BLOCK, SCALER_BLOCK), requires_grad=False)
        mod.forward = partial(nf4_linear, mod)
        num_quantized += 1
    print0(f"qlora: {num_quantized} frozen linear weights of the blocks held as NF4 (blocks of {BLOCK}, scales "
           f"double-quantized in blocks of {SCALER_BLOCK}); embeddings, norms, lm_head and biases stay "
           f"{str(dtype).removeprefix('torch.')}, the adapters fp32 masters")
    if kept:
        print0(f"note: {len(kept)} frozen linear weights of the blocks are not NF4, e.g. layers.{kept[0]}")
    if experts := find_experts(model):
        print0(f"note: the MoE experts ({len(experts)} layers of fused 3-D weights) are not NF4 (it holds 2-D "
               f"linear weights here): they stay {str(dtype).removeprefix('torch.')}")
    return kept


def nf4_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """An NF4 Linear's forward: torchao's (a frozen weight dequantized for the matmul, again in backward) with
    dequantize_nf4's bounded memory."""
    out = _LinearNF4.apply(x, module.weight)
    return out if module.bias is None else out + module.bias


class _LinearNF4(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(weight)
        return F.linear(x, dequantize_nf4(weight, x.dtype))

    @staticmethod
    def backward(ctx, grad):
        return grad @ dequantize_nf4(ctx.saved_tensors[0], grad.dtype), None


@torch.no_grad()
def dequantize_nf4(weight, dtype: torch.dtype, chunk: int = CHUNK) -> torch.Tensor:
    """`weight` (an NF4Tensor) in `dtype`, equal to torchao's get_original_weight().to(dtype), computed `chunk` values
    at a time into the result (torchao's way at once keeps ~14 bytes a value alive, this 2 or 4 and one chunk's)."""
    from ..compat import local_tensor
    w = local_tensor(weight)
    out = torch.empty(w.shape, dtype=dtype, device=w.quantized_data.device)
    pairs = out.view(-1, 2)
    # each byte holds two consecutive values (high, low nibble); a scale covers BLOCK values, BLOCK // 2 bytes
    scalers = w.dequantize_scalers(w.quantized_scalers, w.quantization_factor, w.scaler_block_size)
    step = chunk // 2 // (BLOCK // 2) * (BLOCK // 2) or BLOCK // 2
    for start in range(0, w.quantized_data.numel(), step):
        codes = w.quantized_data[start:start + step]
        scales = scalers[start // (BLOCK // 2):(start + codes.numel()) // (BLOCK // 2)].repeat_interleave(BLOCK // 2)
        pairs[start:start + codes.numel(), 0].copy_(w.nf4[(codes >> 4).long()] * scales)
        pairs[start:start + codes.numel(), 1].copy_(w.nf4[(codes & 0b1111).long()] * scales)
    return out


def frozen_linears(layers: nn.ModuleList) -> list[tuple[str, nn.Linear]]:
    """(name, module) of each Linear in the blocks `layers` whose weight is frozen (what apply_nf4 quantizes)."""
    return [(n, m) for n, m in layers.named_modules() if isinstance(m, nn.Linear) and not m.weight.requires_grad]


def plan_nf4(model: nn.Module, quantize_base: str, shards: int, meter) -> dict | None:
    """For plan (its fake model built unquantized; None without QLoRA): {id(weight): bytes per element} of the weights
    apply_nf4 would hold as NF4 over `shards` ranks, and "dequantized": the bytes dequantize_nf4 allocates for the
    largest one (`meter`: a dispatch mode with the peak bytes of what ops create), measured on two small weights:
    the bytes a value (its copy, its scale) and those of a chunk's work, which CHUNK bounds."""
    if quantize_base != "nf4":
        return None
    from torchao.quantization import to_nf4
    from ..model import find_layers
    weights = [m.weight for _, m in frozen_linears(find_layers(model)) if nf4_misfit(m, shards) is None]
    dtype = weights[0].dtype if weights else torch.bfloat16
    peaks = []
    for rows in (1, 2):
        probe = to_nf4(torch.ones(rows, GRANULE, dtype=dtype), BLOCK, SCALER_BLOCK)
        with meter() as peak:
            dequantize_nf4(probe, dtype, chunk=GRANULE)
        peaks.append(peak.peak)
    per_value = (peaks[1] - peaks[0]) / GRANULE
    per_chunk_value = (peaks[0] - per_value * GRANULE) / GRANULE
    largest = max((w.numel() for w in weights), default=0)
    return {**{id(w): NF4_BYTES for w in weights},
            "dequantized": per_value * largest + per_chunk_value * min(largest, CHUNK)}


def is_nf4(param) -> bool:
    from torchao.quantization import NF4Tensor
    from ..compat import local_tensor
    return isinstance(local_tensor(param), NF4Tensor)


@torch.no_grad()
def fill_nf4(param, rows: torch.Tensor) -> bool:
    """The load's fill for a parameter apply_nf4 made: `rows` (this rank's rows of the stored tensor) quantized with
    the whole tensor's double-quantized scales (all-gathered over the ranks sharing it). False: not an NF4 one."""
    from torchao.quantization import to_nf4
    from ..compat import local_tensor
    if not is_nf4(param):
        return False
    local, mesh = local_tensor(param), getattr(param, "device_mesh", None)
    # quantized on the mesh's device (the GPU), also when the shard lives in host memory (parallel.cpu_offload)
    home = local.quantized_data.device
    rows = rows.to(device=mesh.device_type if mesh is not None else home, dtype=local.dtype).contiguous()
    scalers = rows.view(-1, BLOCK).abs().max(dim=1).values
    group = shard_group(param)
    if group is not None and dist.get_world_size(group) > 1:
        parts = [torch.empty_like(scalers) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, scalers, group=group)
        whole, rank = torch.cat(parts), dist.get_rank(group)
    else:
        whole, rank = scalers, 0
    quantized_scalers, factors, mean = double_quantize(whole)
    n, k = scalers.numel(), scalers.numel() // SCALER_BLOCK
    # the 4-bit codes depend on each block's own absmax only: this rank's rows alone give them
    codes = to_nf4(rows, BLOCK, SCALER_BLOCK)
    local.quantized_data.copy_(codes.quantized_data)
    local.quantized_scalers.copy_(quantized_scalers[rank * n:(rank + 1) * n])
    local.quantization_factor.copy_(factors[rank * k:(rank + 1) * k])
    # materialising the skeleton leaves these two on meta (torchao's empty_like makes the sharded tensors only)
    local.scaler_mean, local.nf4 = mean.to(home), codes.nf4.to(home)
    return True


def double_quantize(scalers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 scales, their factors, their mean) of a whole tensor's block absmaxes, as torchao's NF4 computes them."""
    mean = scalers.mean()
    blocks = (scalers - mean).view(-1, SCALER_BLOCK)
    factors = 256 / (2 * blocks.abs().max(dim=1).values)
    quantized = (blocks * factors.unsqueeze(-1)).round().clamp(-128, 127).to(torch.int8).flatten()
    return quantized, factors.contiguous(), mean


def shard_group(param):
    """The process group over which FSDP shards the DTensor `param` (None: a plain tensor, unsharded)."""
    placements = getattr(param, "placements", None)
    if placements is None:
        return None
    dims = [i for i, p in enumerate(placements) if p.is_shard()]
    return param.device_mesh.get_group(dims[0]) if dims else None


def nf4_params(model: nn.Module) -> set:
    """The NF4 parameters of `model`: FSDP over one rank leaves them unmanaged (with one rank torch 2.15's FSDP2
    hands a tensor subclass only the first of its all-gather inputs, and NF4 has three)."""
    return {p for p in model.parameters() if is_nf4(p)}
