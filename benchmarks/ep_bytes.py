"""Bytes each rank moves in one training step, by collective (all-gather, reduce-scatter, all-to-all, all-reduce),
counted on gloo ranks (CPU) by wrapping torch.distributed's collectives, for FSDP alone and parallel.ep 2/4/8 over
the same ranks, beside the formula that predicts them. The model is Qwen3-MoE-shaped with Qwen3-30B-A3B's expert
count (128) and top-k (8), narrow (hidden 64, expert width 32) and 2 layers, so 8 CPU ranks run it; bf16 mixed
precision as sft's default (bf16 all-gathers and rows, fp32 reduce-scatters); one micro-batch of --tokens a rank.

    uv run python benchmarks/ep_bytes.py [--world-size 8] [--eps 1,2,4,8] [--tokens 256]

Buffer bytes: an all-gather's output, a reduce-scatter's input, an all-to-all's input, an all-reduce's tensor (what
the formulas predict). Wire: what leaves a rank in a ring (an all-gather or reduce-scatter over n ranks: (n-1)/n of
the buffer; an all-to-all: the rows sent to other ranks; an all-reduce: 2 (n-1)/n of it).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import socket
import tempfile
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

SIZES = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=128,
             num_experts_per_tok=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=1024, tie_word_embeddings=False)
REAL = dict(SIZES, vocab_size=151936, hidden_size=2048, moe_intermediate_size=768, num_attention_heads=32,
            num_key_value_heads=4, head_dim=128)  # Qwen3-30B-A3B (config.json)
REAL_TOKENS = 4096
# torch 2.15's FSDP2 calls the *_single forms (the *_tensor forms call them); older torch the *_tensor forms
KINDS = {"all_gather_single": "all-gather", "all_gather_into_tensor": "all-gather",
         "reduce_scatter_single": "reduce-scatter", "reduce_scatter_tensor": "reduce-scatter",
         "all_to_all_single": "all-to-all", "all_reduce": "all-reduce"}


def make_model(path: Path, num_layers: int) -> None:
    """A random bf16 Qwen3-MoE with fused expert tensors on disk (each rank reads its slices)."""
    import transformers as T
    from safetensors.torch import save_file
    config = T.Qwen3MoeConfig(num_hidden_layers=num_layers, **SIZES)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors",
              metadata={"format": "pt"})


def count_collectives(counts: dict) -> None:
    """Wrap torch.distributed's collectives: counts[kind] += [calls, buffer bytes, wire bytes] (see the docstring)."""
    def nbytes(t):
        return t.numel() * t.element_size()

    def counted(fn, kind, *args, **kwargs):
        a = inspect.signature(fn).bind(*args, **kwargs).arguments
        group = a.get("group")
        n = dist.get_world_size(group)
        if kind == "all-gather":
            buffer = nbytes(a["output_tensor"])
            wire = buffer * (n - 1) // n
        elif kind == "reduce-scatter":
            buffer = nbytes(a["input"])
            wire = buffer * (n - 1) // n
        elif kind == "all-reduce":
            buffer = nbytes(a["tensor"])
            wire = 2 * buffer * (n - 1) // n
        else:
            inp, splits = a["input"], a.get("input_split_sizes")
            buffer = nbytes(inp)
            own = splits[dist.get_rank(group)] if splits else inp.shape[0] // n
            wire = buffer - own * (buffer // max(inp.shape[0], 1))
        c = counts[kind]
        c[0], c[1], c[2] = c[0] + 1, c[1] + buffer, c[2] + wire
        return fn(*args, **kwargs)
    wrapped = {}
    for name, kind in KINDS.items():
        if not hasattr(dist, name):
            continue
        if name.endswith("_tensor") and hasattr(dist, name.replace("into_tensor", "single").replace("_tensor",
                                                                                                   "_single")):
            continue  # it calls the *_single form, counted there
        wrapped[name] = getattr(dist, name)
        setattr(dist, name, partial(counted, wrapped[name], kind))
    counts["_restore"] = wrapped


def count_step(model_dir: str, ep: int, tokens: int) -> dict:
    """On each rank of an initialised gloo world: {kind: [calls, buffer bytes, wire bytes]} of one forward and
    backward of `tokens` tokens through build_model's model at parallel.ep=`ep` (bf16 mixed precision)."""
    from finetune.distributed import init_distributed
    from finetune.kernels.moe import apply_experts_implementation
    from finetune.model import Transform, build_model
    from finetune.parallel.expert import apply_ep
    device, dims = init_distributed(ep=ep)
    t = [Transform("kernels", lambda model, layers: apply_experts_implementation(model, "grouped_mm"))]
    if ep > 1:
        t.append(Transform("expert_parallel", partial(apply_ep, mesh=dims.expert_mesh)))
    model = build_model(model_dir, device, dims.mesh, t, mixed_precision="bf16")[0]
    ids = torch.randint(0, SIZES["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(dist.get_rank()))
    dist.barrier()
    counts = defaultdict(lambda: [0, 0, 0])
    count_collectives(counts)
    try:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    finally:
        for name, fn in counts.pop("_restore").items():
            setattr(dist, name, fn)
    return dict(counts)


def rank_main(rank: int, world_size: int, port: int, model_dir: str, ep: int, tokens: int, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    counts = count_step(model_dir, ep, tokens)
    queue.put((rank, counts))
    dist.barrier()
    dist.destroy_process_group()


def measure(model_dir: Path, world_size: int, ep: int, tokens: int) -> dict:
    """{kind: [calls, buffer bytes, wire bytes]} averaged over the ranks (every rank's are equal but all-to-all's,
    which follow the routing)."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=rank_main, args=(r, world_size, port, str(model_dir), ep, tokens, queue))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=900) for _ in procs]
    for p in procs:
        p.join()
    kinds = sorted({k for _, c in results for k in c})
    return {k: [sum(c.get(k, [0, 0, 0])[i] for _, c in results) / world_size for i in range(3)] for k in kinds}


def formula(sizes: dict, num_layers: int, ep: int, world_size: int, tokens: int) -> dict:
    """Predicted buffer bytes a rank moves in one step (one micro-batch) by collective.

    X = 3 E H I: a layer's expert elements (gate_up [E, 2I, H], down [E, H, I]); per layer the dense elements
    D = attention (H (2 q + 2 kv) d + 2 d for the q/k norms) + router E H + 2 H norms; FSDP2 gathers a unit in forward
    and again in backward where it resharded (every block but the last: 2 L - 1 gathers), the embedding twice, the
    lm_head and the root (final norm) once. Under ep a rank holds E / ep experts, FSDP-sharded over g = world / ep
    ranks; a group of one (ep = world) moves nothing ([g > 1]).
      all-gather     = 2 bytes x [(2L - 1) (D + [g > 1] X / ep) + 3 V H + H]           (bf16 params)
      reduce-scatter = 4 bytes x [L (D + [g > 1] X / ep) + 2 V H + H]                   (fp32 gradients)
      all-to-all     = L x [8 E (the counts) + 4 x T k H x 2 bytes] for ep > 1: a rank sends its T k rows of H
                       bf16 values there and the R rows its experts received back, and in backward their gradients
                       the other way (2 T k + 2 R rows); R follows the routing, T k on average over the ranks
    """
    s = sizes
    h, e, i, v, k, d = (s["hidden_size"], s["num_experts"], s["moe_intermediate_size"], s["vocab_size"],
                        s["num_experts_per_tok"], s["head_dim"])
    experts = 3 * e * h * i / ep if world_size // ep > 1 else 0
    dense = h * (2 * s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * d + 2 * d + e * h + 2 * h
    out = {"all-gather": 2 * ((2 * num_layers - 1) * (dense + experts) + 3 * v * h + h),
           "reduce-scatter": 4 * (num_layers * (dense + experts) + 2 * v * h + h), "all-to-all": 0}
    if ep > 1:
        out["all-to-all"] = num_layers * (8 * e + 4 * tokens * k * h * 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--eps", default="1,2,4,8")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="one JSON line per ep instead of the table")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp), args.layers)
        rows = []
        for ep in map(int, args.eps.split(",")):
            got = measure(Path(tmp), args.world_size, ep, args.tokens)
            want = formula(SIZES, args.layers, ep, args.world_size, args.tokens)
            rows.append((ep, got, want))
            if args.json:
                print(json.dumps({"ep": ep, "counted": got, "formula": want}), flush=True)
    if args.json:
        return
    s = SIZES
    print(f"Counted: world {args.world_size}, {args.layers} layers, {s['num_experts']} experts top-"
          f"{s['num_experts_per_tok']}, hidden {s['hidden_size']}, expert width {s['moe_intermediate_size']}, "
          f"{args.tokens} tokens a rank. MB a rank per step: buffer (formula), wire\n")
    print("| ep | all-gather | reduce-scatter | all-to-all | total buffer | total wire | buffer vs ep 1 |")
    print("|---:|---|---|---|---:|---:|---:|")
    first = sum(c[1] for c in rows[0][1].values())
    for ep, got, want in rows:
        counted = {kind: got.get(kind, [0, 0, 0]) for kind in ("all-gather", "reduce-scatter", "all-to-all")}
        cells = [f"{c[1] / 1e6:.3f} ({want[kind] / 1e6:.3f}), {c[2] / 1e6:.3f}" for kind, c in counted.items()]
        total = sum(c[1] for c in got.values())
        print(f"| {ep} | {' | '.join(cells)} | {total / 1e6:.3f} | {sum(c[2] for c in got.values()) / 1e6:.3f} | "
              f"{total / first:.2f} |")
    print(f"\nFormula only at Qwen3-30B-A3B's sizes (48 layers, hidden 2048, expert width 768, 32 heads, 4 KV heads, "
          f"head dim 128, vocab 151,936), world {args.world_size}, {REAL_TOKENS} tokens a rank. GB a rank per step\n")
    print("| ep | all-gather | reduce-scatter | all-to-all | total | vs ep 1 |")
    print("|---:|---:|---:|---:|---:|---:|")
    base = sum(formula(REAL, 48, 1, args.world_size, REAL_TOKENS).values())
    for ep in map(int, args.eps.split(",")):
        f = formula(REAL, 48, ep, args.world_size, REAL_TOKENS)
        print(f"| {ep} | " + " | ".join(f"{f[k] / 1e9:.1f}" for k in ("all-gather", "reduce-scatter", "all-to-all"))
              + f" | {sum(f.values()) / 1e9:.1f} | {sum(f.values()) / base:.2f} |")


if __name__ == "__main__":
    main()
