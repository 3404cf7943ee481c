"""ac.offload: the inputs a checkpointed block keeps for its recompute go to pinned host memory and come back for
the backward, both on a side CUDA stream so the copies overlap compute: each block's inputs leave while the next
blocks run forward, and come back one block ahead of the backward that needs them. (torch's save_on_cpu copies on
the compute stream, where copies and kernels take turns.) Off CUDA (plan's fake tensors, tests) it just copies."""
from __future__ import annotations

import weakref

import torch
from torch import nn

from ..compat import ActivationWrapper, storage_key


class _Saved:
    """One saved tensor: its device, its host copy, its device copy once fetched back, whether the backward used it."""
    __slots__ = ("device", "host", "block", "fetched", "used", "__weakref__")

    def __init__(self, device, host, block):
        self.device, self.host, self.block, self.fetched, self.used = device, host, block, None, False


class _Block:
    """What one call of an offloaded block saved and the block called before it, both weakly: autograd holds the
    saved tensors, they hold their block, and all of it is freed (no cycle, no wait for the garbage collector) once
    the backward has used them. `params`: the storages of the block's parameters as this call sees them (FSDP's
    unsharded ones), which are never offloaded: a compiled block's autograd function saves them beside its input."""
    __slots__ = ("saved", "prev", "params", "__weakref__")

    def __init__(self, prev: _Block | None, params: set = frozenset()):
        self.saved, self.prev = [], weakref.ref(prev) if prev is not None else (lambda: None)
        self.params = params


class HostOffload:
    """Saved-tensor hooks shared by one model's offloaded blocks, and their copy stream (made at the first CUDA one)."""

    def __init__(self):
        self.stream, self.block = None, None

    def copy(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        if self.stream is None:
            return t.to(device, copy=True)
        with torch.cuda.stream(self.stream):  # queued after the stream's earlier copies (a tensor's D2H first)
            out = torch.empty(t.size(), dtype=t.dtype, device=device, pin_memory=device.type == "cpu")
            out.copy_(t, non_blocking=True)
        return out

    def pack(self, t: torch.Tensor) -> _Saved | torch.Tensor:
        if isinstance(t, nn.Parameter) or storage_key(t.untyped_storage()) in self.block.params:
            return t  # a weight the compiled block saves for its recompute: resident anyway, never copied
        if t.is_cuda:
            if self.stream is None:
                self.stream = torch.cuda.Stream(t.device)
            self.stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written
            t.record_stream(self.stream)  # its memory is not reused before the copy is done
        saved = _Saved(t.device, self.copy(t, torch.device("cpu")), self.block)
        self.block.saved.append(weakref.ref(saved))
        return saved

    def unpack(self, saved: _Saved | torch.Tensor) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        out = saved.fetched if saved.fetched is not None else self.copy(saved.host, saved.device)
        saved.fetched, saved.used = None, True
        if out.is_cuda:
            compute = torch.cuda.current_stream(out.device)
            compute.wait_stream(self.stream)
            out.record_stream(compute)
        prev = saved.block.prev()  # the block the backward reaches next: its inputs start coming back now
        for s in (ref() for ref in prev.saved) if prev is not None else ():
            if s is not None and s.fetched is None and not s.used:
                s.fetched = self.copy(s.host, s.device)
        return out


class Offloaded(ActivationWrapper):
    """A checkpointed block whose saved inputs go through `offload`'s hooks: only what the checkpoint keeps for its
    recompute (activations, never the block's parameters, which a compiled block's autograd function saves too)."""
    compile_inside = True  # model.apply_compile compiles the checkpointed block inside; these hooks stay eager

    def __init__(self, module: nn.Module, offload: HostOffload):
        super().__init__(module)
        self.offload = offload

    def forward(self, *args, **kwargs):
        params = {storage_key(p.untyped_storage()) for p in self.parameters()}
        self.offload.block = _Block(self.offload.block, params)
        with torch.autograd.graph.saved_tensors_hooks(self.offload.pack, self.offload.unpack):
            return self._checkpoint_wrapped_module(*args, **kwargs)
