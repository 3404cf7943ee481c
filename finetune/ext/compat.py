"""Private third-party APIs of the extensions in one place (the core's: finetune/compat.py), checked against the
versions named (torch 2.15, liger-kernel 0.8.5): an upgrade that moves one breaks here first."""
from __future__ import annotations

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper  # noqa: F401 - torch 2.15
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401 - torch 2.15
from torch.utils._pytree import tree_leaves  # noqa: F401 - torch 2.15


def storage_key(storage) -> int:
    """A storage's identity, also for fake tensors, which have no data pointer (torch 2.15 `_cdata`)."""
    return storage._cdata


def local_tensor(param):
    """A DTensor's local tensor itself, not the view to_local() returns (torch 2.15 `_local_tensor`); else `param`."""
    return getattr(param, "_local_tensor", param)


def fsdp_param_group(module):
    """The FSDP2 parameter group of a fully_shard-ed module, or None (torch 2.15 `_get_fsdp_state()`)."""
    from torch.distributed.fsdp import FSDPModule
    return module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None


def fake_world_parts():
    """(a store for a "fake" process group, a mode for tensors without storage) (torch 2.15)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore
    return FakeStore(), FakeTensorMode(allow_non_fake_inputs=True)


def apply_liger_kernels(model, **switches) -> None:
    """Liger's kernels for the model's architecture, into this instance (liger-kernel 0.8.5; ImportError without)."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance
    _apply_liger_kernel_to_instance(model=model, **switches)
