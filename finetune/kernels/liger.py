"""model.liger: Liger's fused Triton kernels (RMSNorm, SwiGLU, RoPE, fused linear cross-entropy), the kernels slot."""
from __future__ import annotations

import importlib.util
import os

import torch
from torch import nn

from ..errors import ModelError
from ..compat import apply_liger_kernels

FUSED_ACCUM_DTYPE = torch.float32  # the fused loss: the dtype its lm_head (and hidden) gradients accumulate in


def resolve_liger(liger: bool | str, cuda: bool) -> bool:
    """model.liger "auto": on CUDA where liger-kernel is installed, off on CPU."""
    return cuda and importlib.util.find_spec("liger_kernel") is not None if liger == "auto" else liger


def apply_kernels(model: nn.Module, compile: bool = False) -> None:
    """Swap in Liger's fused kernels. On CPU under Triton's interpreter (TRITON_INTERPRET=1, for tests) only RoPE and
    the fused linear cross-entropy. With regional compile only the fused linear cross-entropy (outside the blocks):
    Liger's RoPE goes through a torch.compiler.disable'd function, which splits every compiled block's graph (3 breaks
    a Llama block), and inductor fuses norms, SwiGLU and RoPE itself."""
    interpret = not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not interpret:
        raise ModelError("model.liger=true needs a CUDA device (Liger kernels are Triton GPU kernels; on CPU only "
                         "under TRITON_INTERPRET=1, for tests)")
    # RoPE and fused linear cross-entropy are on by default; the interpreter gets no others (each arch's apply
    # function takes the switches it has)
    off = dict.fromkeys(("cross_entropy", "rms_norm", "swiglu", "geglu", "layer_norm"), False) if interpret else {}
    if compile:  # outside the compiled blocks only (see above)
        off = dict.fromkeys(("cross_entropy", "rms_norm", "swiglu", "geglu", "layer_norm", "rope"), False)
    try:
        apply_liger_kernels(model, **off)
    except ImportError as e:
        raise ModelError("model.liger=true needs liger-kernel: install the gpu extra (uv sync --extra gpu)") from e
    if getattr(model.forward, "__module__", "").startswith("liger_kernel"):  # Liger's forward replaced the model's
        model.fused_loss = fused_loss_inputs


def fused_loss_inputs(targets: torch.Tensor) -> dict:
    """loss.token_loss_sum's kwargs for Liger's forward (fused linear cross-entropy), which takes the targets itself:
    it reads shift_labels as given (num_items_in_batch: a sum, not a mean); the lm_head gradient summed over its
    ceil(V/H) chunks in fp32, not in the weights' bf16 (liger-kernel >= 0.6.2)."""
    return dict(labels=targets[None], shift_labels=targets[None], accum_dtype=FUSED_ACCUM_DTYPE,
                num_items_in_batch=torch.ones((), device=targets.device))
