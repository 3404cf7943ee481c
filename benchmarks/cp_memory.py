"""Activation memory per rank under context parallelism: bench's saved-for-backward counter on each rank for one row
of a fixed length split over cp = the launched ranks (FSDP over the same ranks). Run once per cp degree:

    uv run torchrun --nproc-per-node N benchmarks/cp_memory.py [--model examples/tiny-llama] [--seq-len 4096]
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from finetune.bench import saved_for_backward_mb
from finetune.context import split_batch
from finetune.data.collate import sample_boundaries
from finetune.distributed import init_distributed, print0, teardown
from finetune.loss import label_targets
from finetune.model import build_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="examples/tiny-llama")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--ac-ratio", type=float, default=0.0)
    args = parser.parse_args()
    device, dims = init_distributed(cp=int(os.environ.get("WORLD_SIZE", 1)))  # cp over every launched rank
    model = build_model(args.model, device, dims.mesh, attn_implementation="auto", ac_ratio=args.ac_ratio,
                        cp_group=dims.cp_group)
    ids = torch.randint(model.config.vocab_size, (1, args.seq_len), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "position_ids": torch.arange(args.seq_len)[None], **sample_boundaries([args.seq_len]),
             **label_targets(ids, None)}  # one sample filling the row, a target at every position but the last
    if dims.cp > 1:
        batch = split_batch(batch, dims.cp_rank, dims.cp)
    saved = torch.tensor([saved_for_backward_mb(model, batch)])
    every = [torch.zeros(1) for _ in range(dims.cp)] if dims.cp > 1 else [saved]
    if dims.cp > 1:
        dist.all_gather(every, saved)
    print0(f"cp={dims.cp} seq_len={args.seq_len} ac.ratio={args.ac_ratio:g} {args.model}: saved for backward per "
           f"rank {', '.join(f'{t.item():.2f}' for t in every)} MB")
    teardown()


if __name__ == "__main__":
    main()
