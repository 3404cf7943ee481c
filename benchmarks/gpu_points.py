"""Two single-GPU points, each measured against `finetune plan`'s memory figure for the same run:
  lora8b  an 8B-class model (random weights from configs/llama3-8b.config.json) with LoRA rank 16 on all linear
          layers of the blocks, packed 8k-token rows;
  full    the largest full fine-tune that `finetune plan` says fits this GPU, from a ladder of Llama-architecture
          sizes (1B, 3B, 4B, 8B; 4k-token rows).
For each: the plan (the least recompute that fits: ac.ratio, micro-batch, its total), then `finetune bench` at that
point (the training step of sft, timed; no checkpoint is written: a full fine-tune's final checkpoint would be
36-48 GB on a 64 GB disk) on the variable-length chat data of compare_peers (lognormal lengths up to 8k) for a few
steps: peak memory (max allocated, max reserved), tokens/s and MFU (metrics.MFU_CONVENTION; for LoRA 6N still counts
the frozen weights' gradient FLOPs that LoRA skips), beside the plan's figure. Random weights are written tensor by
tensor (never a whole model in memory), so the 8B point needs ~16 GB of disk and ~2 GB of host RAM to set up.
gpu_points.json is rewritten after each plan and each measurement: a call cut off keeps what it had.

    python3 benchmarks/gpu_points.py lora8b full          # on one GPU: ~4 + ~4 min on an H100, after writing weights
    python3 benchmarks/gpu_points.py lora8b full --tiny   # toy sizes, any machine: the whole path end to end
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LLAMA3_8B = json.loads((REPO / "configs" / "llama3-8b.config.json").read_text())
# Llama-architecture sizes for the full fine-tune: (name, config fields over Llama-3-8B's)
LADDER = [("1B", dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32,
                      tie_word_embeddings=True)),
          ("3B", dict(hidden_size=3072, num_hidden_layers=28, intermediate_size=8192, num_attention_heads=24,
                      tie_word_embeddings=True)),
          ("4B", dict(hidden_size=3072, num_hidden_layers=36, intermediate_size=8192, num_attention_heads=24,
                      tie_word_embeddings=True)),
          ("8B", {})]
TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1024)


def config_dir(path: Path, fields: dict) -> Path:
    """A model dir with the config (Llama-3-8B's, `fields` over it) and the tests' offline Llama-3 style tokenizer."""
    sys.path.insert(0, str(REPO / "tests"))
    from _tokenizers import build_tokenizer
    from transformers import LlamaConfig
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer("llama3")
    config = {k: v for k, v in {**LLAMA3_8B, **fields}.items() if k not in ("architectures", "model_type")}
    config.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaConfig(**config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_random_weights(path: Path, shard_bytes: int = 4 << 30) -> int:
    """Random bf16 weights for the config in `path`, written tensor by tensor into safetensors shards with an index
    (normal(0, 0.02) matrices, norm weights 1): returns the parameter count."""
    import torch
    from safetensors.torch import save_file

    from finetune.model import build_skeleton, load_hf_config
    if (path / "model.safetensors.index.json").exists():
        return json.loads((path / "model.safetensors.index.json").read_text())["metadata"]["num_params"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = list(build_skeleton(load_hf_config(str(path))).named_parameters())  # tied weights once
    shards, current, size = [], {}, 0
    for name, p in params:
        t = (torch.ones(p.shape) if p.dim() == 1 else torch.randn(p.shape, device=device) * 0.02).to(torch.bfloat16)
        current[name], size = t.cpu(), size + t.numel() * 2
        if size >= shard_bytes or name == params[-1][0]:
            shards.append(current)
            save_file(current, str(path / f"part-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
            current, size = {}, 0
    names = {n: f"part-{i + 1:05d}.safetensors" for i, shard in enumerate(shards) for n in shard}
    num_params = sum(p.numel() for _, p in params)
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"num_params": num_params}, "weight_map": names}, indent=1))
    return num_params


def plan(model_dir: Path, gpu_memory: str, seq_len: int, overrides: list[str]) -> dict:
    """`finetune plan --json` for one GPU: its best point (ac.ratio, micro-batch, total bytes) or None."""
    out = subprocess.run([sys.executable, "-m", "finetune", "plan", "--model", str(model_dir), "--nproc-per-node", "1",
                          "--gpu-memory", gpu_memory, "--sac-ratios", "0,0.5,1", "--micro-batch-sizes", "1,2",
                          "--json", f"data.max_seq_len={seq_len}", "train.mixed_precision=bf16", *overrides],
                         cwd=REPO, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def run_point(model_dir: Path, data: Path, out: Path, steps: int, seq_len: int, best: dict,
              overrides: list[str]) -> dict:
    """`finetune bench` at the plan's point (one ac.ratio, its micro-batch; no checkpoint): median step after
    2 warm-up steps, and the peaks."""
    cmd = [sys.executable, "-m", "finetune", "bench", "--model", str(model_dir), "--dataset", str(data),
           "--output-dir", str(out), "--steps", str(steps), "--warmup", "2", "--sac-ratios", f"{best['ac_ratio']:g}",
           f"data.max_seq_len={seq_len}", "data.packing=true", "train.mixed_precision=bf16",
           f"train.micro_batch_size={best['micro_batch_size']}", *overrides]
    subprocess.run(cmd, cwd=REPO, check=True, env={**os.environ, "WANDB_MODE": "disabled"})
    point = json.loads((out / "bench.json").read_text())["points"][0]
    return {"tokens_per_s": point["tokens_per_s"], "mfu": point["mfu"], "step_time_s": point["step_time_s"],
            "peak_mem_mb": point["peak_mem_mb"], "peak_reserved_mb": point["peak_reserved_mb"] or 0,
            "losses": point["losses"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("points", nargs="+", choices=["lora8b", "full"])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tiny", action="store_true", help="toy sizes (a dry run on any machine)")
    p.add_argument("--output-dir", default="outputs/gpu_points")
    args = p.parse_args()
    import torch
    sys.path.insert(0, str(REPO / "benchmarks"))
    from compare_peers import make_chat_data
    from transformers import AutoTokenizer
    root = Path(args.output_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    gpu_memory = f"{torch.cuda.get_device_properties(0).total_memory // 2**20}MB" if cuda else "8GB"
    seq_len = 512 if args.tiny else 8192
    data = root / "chat.jsonl"
    if not data.exists():
        make_chat_data(data, AutoTokenizer.from_pretrained(REPO / "examples" / "tiny-llama"), 400 if args.tiny else
                       1500, 80 if args.tiny else 900, 1.0)
    results = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "gpu_memory": gpu_memory}
    for point in args.points:
        if point == "lora8b":
            model_dir, overrides, seq = config_dir(root / "llama-8b", TINY if args.tiny else {}), ["lora.rank=16"], \
                seq_len
            best = plan(model_dir, gpu_memory, seq, overrides)["best"]
        else:  # the largest rung of the ladder that plan says fits
            overrides, seq, best = [], seq_len // 2, None
            for name, fields in LADDER:
                candidate = config_dir(root / f"llama-{name}", {**fields, **(TINY if args.tiny else {})})
                fit = plan(candidate, gpu_memory, seq, overrides)["best"]
                print(f"plan, full fine-tune of {name}: " + (f"fits at ac.ratio={fit['ac_ratio']:g}, micro-batch "
                                                             f"{fit['micro_batch_size']}, {fit['total'] / 2**30:.1f} "
                                                             f"GiB" if fit else "does not fit"), flush=True)
                if fit:
                    model_dir, best, results.setdefault("full", {})["model"] = candidate, fit, name
        if best is None:
            results[point] = {"error": "plan says nothing fits"}
            save(root, results)
            continue
        results[point] = {**results.get(point, {}), "seq_len": seq, "plan": best}
        save(root, results)
        num_params = write_random_weights(model_dir)
        run = run_point(model_dir, data, root / f"run-{point}", args.steps, seq, best, overrides)
        results[point] = {**results.get(point, {}), "num_params": num_params, "seq_len": seq, "plan": best, **run}
        r = results[point]
        print(f"{point}: {num_params / 1e9:.2f}B params, seq {seq}, ac.ratio={best['ac_ratio']:g}, micro-batch "
              f"{best['micro_batch_size']}: plan {best['total'] / 2**20:,.0f} MB vs peak allocated "
              f"{r['peak_mem_mb']:,.0f} MB / reserved {r['peak_reserved_mb']:,.0f} MB; {r['tokens_per_s']:,.0f} "
              f"tokens/s" + (f", MFU {r['mfu']:.1%}" if r["mfu"] else ""), flush=True)
        save(root, results)


def save(root: Path, results: dict) -> None:
    tmp = root / "gpu_points.json.tmp"
    tmp.write_text(json.dumps(results, indent=1))
    tmp.replace(root / "gpu_points.json")


if __name__ == "__main__":
    main()
