"""Private third-party APIs in one place, checked against the versions named (torch 2.15, transformers 5.23,
liger-kernel 0.8.5): an upgrade that moves one breaks here first."""
from __future__ import annotations

# torch 2.15: the module wrappers for non-reentrant activation checkpointing live in a private package
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper  # noqa: F401
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper  # noqa: F401 - torch 2.15
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401 - torch 2.15
from torch.utils._pytree import tree_leaves  # noqa: F401 - torch 2.15


def local_shape_and_offset(param) -> tuple[tuple, tuple]:
    """A DTensor's local shape and its offset in the global tensor (torch 2.15 distributed.tensor._utils)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    return compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)


def compile_jinja_template(template: str):
    """A chat template compiled as transformers renders it (transformers 5.23 chat_template_utils)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template
    return _compile_jinja_template(template)


def launch_config(**kwargs):
    """torch's elastic LaunchConfig, without `shutdown_timeout` where torch lacks it (2.11: ranks get 30 s, fixed)."""
    from torch.distributed.launcher.api import LaunchConfig
    if "shutdown_timeout" not in LaunchConfig.__dataclass_fields__:
        kwargs.pop("shutdown_timeout")
    return LaunchConfig(**kwargs)


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
