"""Process group, device, ParallelDims, rank-0 helpers. One process is a group of one (FSDP2 on a mesh of one)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .config import ConfigError, check_parallel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ParallelDims:
    """dp_replicate groups of dp_shard x cp ranks: FSDP2 shards in a group, replicates across (HSDP); cp splits rows."""

    dp_replicate: int
    dp_shard: int
    mesh: DeviceMesh  # FSDP's: ("dp_replicate", "dp_shard_cp"), replicate outermost; 1-D when dp_replicate == 1
    cp: int = 1
    ep: int = 1
    # ep > 1: the data-parallel ranks as ("efsdp", "ep"), ep innermost: an "ep" row holds all the experts of a layer
    # (each rank its share), an "efsdp" column the ranks holding the same experts (FSDP shards them over it)
    expert_mesh: DeviceMesh | None = None

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_rank() // self.cp  # all ranks in order (replicate outermost, cp innermost)

    def __str__(self) -> str:
        dp = f"HSDP {self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else f"FSDP {self.dp_shard}"
        return dp + (f" x cp {self.cp}" if self.cp > 1 else "") + (f", experts ep {self.ep}" if self.ep > 1 else "")


def build_parallel_dims(device_type: str, dp_replicate: int = 1, dp_shard: int = 0, cp: int = 1,
                        ep: int = 1) -> ParallelDims:
    """The FSDP mesh over the default process group's ranks (and with ep > 1 the experts' mesh)."""
    dp_shard = check_parallel(dp_replicate, dp_shard, dist.get_world_size(), cp)
    name = "dp_shard_cp" if cp > 1 else "dp_shard"
    shape, names = ((dp_replicate, dp_shard * cp), ("dp_replicate", name)) if dp_replicate > 1 else \
        ((dp_shard * cp,), (name,))
    experts = None
    if ep > 1:
        # run/checks refuses these first (API callers: here)
        if dp_replicate > 1 or cp > 1:
            raise ConfigError(f"parallel.ep={ep} with parallel.dp_replicate or parallel.cp is not supported yet")
        if dp_shard % ep:
            raise ConfigError(f"parallel.ep={ep} does not divide the {dp_shard} data-parallel ranks "
                              f"(parallel.dp_shard)")
        experts = init_device_mesh(device_type, (dp_shard // ep, ep), mesh_dim_names=("efsdp", "ep"))
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return ParallelDims(dp_replicate, dp_shard, mesh, cp, ep, experts)


def init_distributed(dp_replicate: int = 1, dp_shard: int = 0, timeout_s: int = 1800,
                     cp: int = 1, ep: int = 1) -> tuple[torch.device, ParallelDims]:
    """Init the default process group (nccl on CUDA, gloo on CPU) and return (device, parallel dims)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # plain `python`/`finetune` without torchrun: a group of one
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        # on CUDA, gloo too for CPU-side collectives (object lists, signals)
        dist.init_process_group("cuda:nccl,cpu:gloo" if torch.cuda.is_available() else "gloo",
                                timeout=timedelta(seconds=timeout_s))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return device, build_parallel_dims(device.type, dp_replicate, dp_shard, cp, ep)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def print0(*args, **kwargs) -> None:
    if is_main():
        print(*args, **kwargs, flush=True)


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum `t` over all ranks in place; returns it."""
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
    """Whether this process writes `filename`: files are dealt out round-robin over the ranks."""
    return list(files).index(filename) % world_size() == (dist.get_rank() if dist.is_initialized() else 0)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
