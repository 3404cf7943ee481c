"""LoRA rank 16 vs full fine-tuning on the 0.5B benchmark Llama: peak host RAM, weights+grads+optimizer bytes,
checkpoint size and step time, at 1 and 2 ranks, the same global batch.

    uv run python benchmarks/lora.py                 # prints the table
    uv run python benchmarks/lora.py --write         # ... and puts it into benchmarks/RESULTS.md

The model is the one benchmarks/load_and_export.py builds (random bf16 Llama, 28 layers, hidden 1024, 0.5B params).
Each point is a fresh `torchrun` (gloo on CPU): build_model (bf16 mixed precision: fp32 masters, bf16 compute; under
LoRA the frozen base stays bf16), AdamW, `--warmup` + `--steps` optimizer steps on a fixed global batch
(4 sequences x --seq-len tokens, padded), then one DCP checkpoint as sft writes it. The four points run once each,
in the order full, LoRA at 1 rank, then at 2. Peak RSS is each rank's VmHWM, summed over the node; weights + grads
+ AdamW state are the bytes of those tensors (each rank's shards, summed), measured after the last step.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_and_export import REPO, machine, make_model_dir, run_child  # noqa: E402

HEADING = "## LoRA vs full fine-tuning"
GLOBAL_BATCH = 4


def child(model_dir: str, data: str, out: str, lora_rank: int, steps: int, warmup: int, seq_len: int) -> None:
    """Under torchrun: one point; prints `RESULT {json}` on rank 0."""
    import torch
    import torch.distributed as dist
    from finetune import checkpoint as ckpt
    from finetune.config import load_config
    from finetune.data import build_samples
    from finetune.distributed import init_distributed, is_main
    from finetune.model import build_model, load_tokenizer
    from finetune.optim import build_optimizer, build_scheduler, clip_grad_norm
    from finetune.loss import token_loss_sum
    from finetune.train import next_micro_batches
    cfg = load_config(None, {"model.path": model_dir, "data.path": data, "output_dir": out, "lora.rank": lora_rank,
                             "train.mixed_precision": "bf16", "data.max_seq_len": seq_len})
    device, dims = init_distributed()
    torch.manual_seed(0)
    tok = load_tokenizer(model_dir)
    from finetune.adapters.lora import lora_transforms
    from finetune.adapters.lora import lora_settings
    model, _ = build_model(model_dir, device, dims.mesh, lora_transforms(lora_settings(cfg), seed=0, path=model_dir),
                           mixed_precision="bf16")
    optimizer = build_optimizer(model, 1e-4, 0.0, (0.9, 0.95), 1e-8)
    scheduler = build_scheduler(optimizer, warmup_steps=0, max_steps=100, min_lr_ratio=0.1)
    micro = GLOBAL_BATCH // dims.dp_size
    samples = iter(build_samples(data, tok, max_seq_len=seq_len, seed=0, rank=dims.dp_rank,
                                 world_size=dims.dp_size))
    times, state_bytes = [], 0
    for step in range(warmup + steps):
        batch = next_micro_batches(samples, micro, 1, tok.pad_token_id, seq_len)[0][0]
        dist.barrier()
        t0 = time.perf_counter()
        num_tokens = torch.tensor(float((batch["label_targets"] != -100).sum()))
        dist.all_reduce(num_tokens)
        (token_loss_sum(model, batch) / num_tokens).backward()
        grad_bytes = sum(p.grad.to_local().nbytes for p in model.parameters() if p.grad is not None)
        clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    param_bytes = sum(p.to_local().nbytes for p in model.parameters())
    optim_bytes = sum(t.to_local().nbytes for s in optimizer.state.values() for t in s.values()
                      if isinstance(t, torch.Tensor) and t.dim() > 0)
    state_bytes = torch.tensor([param_bytes + grad_bytes + optim_bytes], dtype=torch.float64)
    dist.all_reduce(state_bytes)
    state = ckpt.TrainState()
    state.step = warmup + steps
    path = ckpt.Checkpointer(Path(out) / "checkpoints", keep=1).save(
        state.step, model, optimizer, scheduler, state, model.config)
    hwm = next(int(x.split()[1]) for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    hwms: list = [None] * dist.get_world_size()
    dist.all_gather_object(hwms, hwm / 1024)
    if is_main():
        num_params = sum(p.numel() for p in model.parameters())
        num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        ckpt_bytes = sum(f.stat().st_size for f in path.iterdir())
        print("RESULT " + json.dumps({"times": times[warmup:], "rss_mib": hwms, "state_bytes": state_bytes.item(),
                                      "num_params": num_params, "num_trainable": num_trainable,
                                      "ckpt_bytes": ckpt_bytes}), flush=True)
    dist.destroy_process_group()


def run_point(nproc: int, model_dir: Path, data: Path, out: Path, lora_rank: int, args) -> dict:
    _, _, log = run_child(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
                           "--child", str(model_dir), str(data), str(out), str(lora_rank), "--steps", str(args.steps),
                           "--warmup", str(args.warmup), "--seq-len", str(args.seq_len)])
    return json.loads(next(x for x in log.splitlines() if x.startswith("RESULT "))[len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", nargs=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--layers", type=int, default=28, help="fewer for a quick check of the script")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    if args.child:
        model_dir, data, out, lora_rank = args.child
        return child(model_dir, data, out, int(lora_rank), args.steps, args.warmup, args.seq_len)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, data = Path(tmp) / "model", REPO / "examples" / "data" / "tiny_chat.jsonl"
        make_model_dir(model_dir, args.layers, 1024, 4096, 32000)
        rows = []
        for nproc in (1, 2):
            for lora_rank in (0, args.rank):
                r = run_point(nproc, model_dir, data, Path(tmp) / f"run-{nproc}-{lora_rank}", lora_rank, args)
                rows.append((nproc, lora_rank, r))
                print(nproc, lora_rank, {k: v for k, v in r.items()}, flush=True)
    table = render(rows, args, time.perf_counter() - t_start)
    print(table)
    if args.write:
        results = REPO / "benchmarks" / "RESULTS.md"
        text = results.read_text()
        pattern = re.compile(rf"{re.escape(HEADING)}\n.*?(?=\n## |\Z)", re.S)
        text = pattern.sub(lambda _: table.rstrip("\n"), text) if pattern.search(text) else \
            text.rstrip("\n") + "\n\n" + table
        results.write_text(text if text.endswith("\n") else text + "\n")


def render(rows: list, args, wall_s: float) -> str:
    lines = [HEADING, "",
             f"`uv run python benchmarks/lora.py --steps {args.steps} --warmup {args.warmup} --write` "
             f"({wall_s / 60:.1f} min). Machine: {machine()}.", "",
             f"Model: the 0.5B random Llama of the load benchmark ({rows[0][2]['num_params'] / 1e9:.3f}B params). "
             f"bf16 mixed precision, AdamW, global batch {GLOBAL_BATCH} x {args.seq_len} tokens (micro-batch "
             f"{GLOBAL_BATCH} at 1 rank, 2 per rank at 2), gloo on CPU; {args.steps} timed steps after "
             f"{args.warmup} warm-up, each point a fresh torchrun. LoRA: rank {args.rank}, alpha 16, all linear layers "
             f"of the decoder blocks.", "",
             "| ranks | run | trainable params | weights+grads+AdamW, node (GiB) | bytes / param | "
             "node peak RSS (GiB) | checkpoint (MB) | median step (s) | steps (s) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for nproc, lora_rank, r in rows:
        name = f"LoRA r={lora_rank}" if lora_rank else "full"
        lines.append(f"| {nproc} | {name} | {r['num_trainable'] / 1e6:.2f}M | {r['state_bytes'] / 2**30:.2f} | "
                     f"{r['state_bytes'] / r['num_params']:.2f} | {sum(r['rss_mib']) / 1024:.2f} | "
                     f"{r['ckpt_bytes'] / 1e6:.1f} | {statistics.median(r['times']):.2f} | "
                     f"{', '.join(f'{t:.2f}' for t in r['times'])} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
