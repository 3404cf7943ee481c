"""The final export of a run gathered from the live sharded model instead of read back from its last checkpoint."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..weights import clean_fqn


def open_live(model: nn.Module) -> tuple[dict, Callable[[str], torch.Tensor]]:
    """open_dcp for the sharded model in memory: load(name) gathers the full tensor (a collective)."""
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata
    from torch.distributed.tensor import DTensor
    tensors = {clean_fqn(n): t for n, t in model.state_dict().items()}  # tied aliases included, as DCP saves them
    stored = {n: TensorStorageMetadata(TensorProperties(dtype=t.dtype), t.shape, []) for n, t in tensors.items()}

    def load(name: str) -> torch.Tensor:
        t = tensors[name]
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
    return stored, load
