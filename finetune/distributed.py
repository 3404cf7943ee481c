"""Process group, device, ParallelDims (the mesh and the data-parallel rank and size); rank-0 helpers (`is_main`,
`print0`); teardown.

Every run, even a single process, has a process group and a data-parallel mesh, so the 1-process path is the same
code as the N-rank path (FSDP2 on a mesh of one).
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import check_parallel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ParallelDims:
    """dp_replicate groups of dp_shard ranks: FSDP2 shards parameters within a group and replicates them across
    groups (HSDP; plain FSDP when dp_replicate == 1). The one owner of the mesh and of the data-parallel rank and
    size that data sharding, the global batch and the loss use. Data parallelism is the only parallelism, so the
    data-parallel ranks are all the ranks (`all_reduce` sums over them)."""

    dp_replicate: int
    dp_shard: int
    mesh: DeviceMesh  # ("dp_replicate", "dp_shard"), replicate outermost; 1-D ("dp_shard",) when dp_replicate == 1

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_rank()  # the mesh holds all ranks in order (replicate outermost): its coordinate's rank

    def __str__(self) -> str:
        return f"HSDP {self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"FSDP {self.dp_shard}"


def build_parallel_dims(device_type: str, dp_replicate: int = 1, dp_shard: int = 0) -> ParallelDims:
    """The mesh over the default process group's ranks (a real group, or a fake one as a planner uses)."""
    dp_shard = check_parallel(dp_replicate, dp_shard, dist.get_world_size())
    shape, names = ((dp_replicate, dp_shard), ("dp_replicate", "dp_shard")) if dp_replicate > 1 else \
        ((dp_shard,), ("dp_shard",))
    return ParallelDims(dp_replicate, dp_shard, init_device_mesh(device_type, shape, mesh_dim_names=names))


def init_distributed(dp_replicate: int = 1, dp_shard: int = 0,
                     timeout_s: int = 1800) -> tuple[torch.device, ParallelDims]:
    """Init the default process group (nccl on CUDA, gloo on CPU) and return (device, parallel dims)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python`/`finetune` without torchrun: a group of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            backend = "cuda:nccl,cpu:gloo"  # gloo for CPU-side collectives (object lists, signals)
        else:
            backend = "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return device, build_parallel_dims(device.type, dp_replicate, dp_shard)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args, **kwargs) -> None:
    if is_main():
        print(*args, **kwargs, flush=True)


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over all ranks (= the data-parallel ranks: ParallelDims) in place (a no-op on one rank); returns it."""
    if world_size() > 1:
        dist.all_reduce(t)
    return t


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def broadcast(obj):
    """rank 0's `obj` on every rank (itself on one process)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def is_my_file(filename: str, files: dict) -> bool:
    """Whether this process writes (and checks) `filename`: files are dealt out round-robin over the ranks."""
    return list(files).index(filename) % world_size() == (dist.get_rank() if dist.is_initialized() else 0)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
