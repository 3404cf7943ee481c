"""Private third-party APIs of the core in one place (the extensions': ext/compat.py), checked against the versions
named (torch 2.15, transformers 5.23): an upgrade that moves one breaks here first."""
from __future__ import annotations

# torch 2.15: the module wrappers for non-reentrant activation checkpointing live in a private package
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper  # noqa: F401


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
