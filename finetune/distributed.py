"""Process group, device and mesh set-up; rank-0 helpers (`is_main`, `print0`); teardown.

Every run, even a single process, has a process group and a 1-D data-parallel mesh, so the 1-process path is
the same code as the N-rank path (FSDP2 on a mesh of one).
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: int = 1800) -> tuple[torch.device, DeviceMesh]:
    """Init the default process group (nccl on CUDA, gloo on CPU) and return (device, dp mesh)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python`/`finetune` without torchrun: a group of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            backend = "cuda:nccl,cpu:gloo"  # gloo for CPU-side collectives (object lists, signals)
        else:
            backend = "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("dp",))
    return device, mesh


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args, **kwargs) -> None:
    if is_main():
        print(*args, **kwargs, flush=True)


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over ranks in place (a no-op on one rank); returns it."""
    if world_size() > 1:
        dist.all_reduce(t)
    return t


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
