"""Prepared-checkpoint load vs HF load into the sharded model, and export-hf's peak host RAM, on a random Llama.

    uv run python benchmarks/load_and_export.py            # ~0.5B Llama, 5 repetitions, prints the tables
    uv run python benchmarks/load_and_export.py --write    # ... and puts them into benchmarks/RESULTS.md

In one run: a random bf16 Llama is saved to a temp dir (save_pretrained), `finetune prepare-checkpoint
--nproc-per-node 2` turns it into a prepared dir, then `build_model` (fp32 master weights, the sft load path) is
timed from the HF dir and from the prepared dir in fresh torchrun processes at 1 and 2 ranks, alternating, median of
--reps (between barriers, so imports and process start, the same for both, are left out). Each rank's peak RSS of
one load is read in separate fresh processes and summed over the node. Finally `finetune export-hf` runs in child
processes whose peak RSS (VmHWM) is polled: without the reload check (the streaming export alone), with it (the
default command), and the import floor of the same modules for comparison. Both sources are read from the page
cache (just written); a cold-cache load also pays the disk.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parent.parent
HEADING = "## prepare-checkpoint and export-hf"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONUNBUFFERED": "1"}


def make_model_dir(path: Path, layers: int, hidden: int, intermediate: int, vocab: int) -> int:
    """A random bf16 Llama with the tests' offline Llama-3 style tokenizer; returns its parameter count."""
    sys.path.insert(0, str(REPO / "tests"))
    from _tokenizers import build_tokenizer
    from transformers import AutoModelForCausalLM, LlamaConfig
    tok = build_tokenizer("llama3")
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                         max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def run_child(args: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS in MiB, output) of one child process; exits on failure. The peak is the child's
    VmHWM (its own address space), polled until it exits: wait4's ru_maxrss would also count this parent's RSS,
    which the kernel carries over into the child at fork/exec."""
    t0 = time.perf_counter()
    peak_kib = 0
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT)
        status = Path(f"/proc/{proc.pid}/status")
        while proc.poll() is None:
            try:
                hwm = next((x for x in status.read_text().splitlines() if x.startswith("VmHWM:")), None)
                peak_kib = max(peak_kib, int(hwm.split()[1])) if hwm else peak_kib
            except (OSError, ValueError):
                pass  # exiting
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        log.seek(0)
        out = log.read()
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args)} failed ({proc.returncode}):\n{out[-3000:]}")
    return wall, peak_kib / 1024, out


def load_child(sources: list[str], reps: int, warmup: bool) -> None:
    """Run under torchrun: time build_model from each source (alternating order, between barriers), then print one
    line `RESULT {json}` on rank 0 with the times and every rank's peak RSS (VmHWM) in MiB."""
    import torch.distributed as dist
    from finetune.distributed import init_distributed, is_main
    from finetune.model import build_model
    device, dims = init_distributed()
    mesh = dims.mesh
    times: dict[str, list[float]] = {src: [] for src in sources}
    for src in sources if warmup else ():  # untimed: first-use imports and allocator warm-up land here
        build_model(src, device, mesh, mixed_precision="fp32")
        gc.collect()
    for rep in range(reps):
        for src in (sources if rep % 2 == 0 else sources[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            model = build_model(src, device, mesh, mixed_precision="fp32")
            dist.barrier()
            times[src].append(time.perf_counter() - t0)
            del model
            gc.collect()
    hwm = next(int(x.split()[1]) for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
    hwms: list = [None] * dist.get_world_size()
    dist.all_gather_object(hwms, hwm / 1024)
    if is_main():
        print("RESULT " + json.dumps({"times": times, "rss_mib": hwms}), flush=True)
    dist.destroy_process_group()


def run_loads(nproc: int, sources: list[Path], reps: int, warmup: bool) -> dict:
    """load_child in a fresh `torchrun --nproc-per-node nproc`."""
    _, _, out = run_child(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
                           "--child", *map(str, sources), "--reps", str(reps), *(["--warmup"] if warmup else [])])
    result = json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    result["times"] = {Path(k).name: v for k, v in result["times"].items()}
    return result


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    import transformers
    return (f"{cpu}; {psutil.cpu_count(logical=False)} physical / {os.cpu_count()} logical cores visible; "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM; no GPU; Linux {platform.release()}; "
            f"torch {torch.__version__}, transformers {transformers.__version__}; "
            f"load average at start {os.getloadavg()[0]:.1f} (shared machine)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--export-reps", type=int, default=3)
    ap.add_argument("--nprocs", default="1,2", help="world sizes to time the loads at")
    ap.add_argument("--write", action="store_true", help="write the section into benchmarks/RESULTS.md")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--warmup", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return load_child(args.child, args.reps, args.warmup)
    nprocs = [int(n) for n in args.nprocs.split(",")]
    host = machine()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="finetune-bench-") as tmp:
        hf_dir, prepared = Path(tmp) / "hf", Path(tmp) / "prepared"
        t0 = time.perf_counter()
        num_params = make_model_dir(hf_dir, args.layers, args.hidden, args.intermediate, args.vocab)
        bf16_gb = num_params * 2 / 1e9
        print(f"random Llama: {num_params / 1e9:.3f}B params, {bf16_gb:.2f} GB bf16 "
              f"({time.perf_counter() - t0:.0f}s to make)", flush=True)
        prep_s, _, _ = run_child(["-m", "finetune", "prepare-checkpoint", "--model", str(hf_dir),
                                  "--output-dir", str(prepared), "--nproc-per-node", "2"])
        print(f"prepare-checkpoint --nproc-per-node 2: {prep_s:.1f}s", flush=True)
        loads = {}  # nproc -> {"times": {source: [s]}, "rss": {source: [MiB per rank]}}
        for n in nprocs:
            loads[n] = run_loads(n, [hf_dir, prepared], args.reps, warmup=True)
            loads[n]["rss"] = {src.name: run_loads(n, [src], 1, warmup=False)["rss_mib"] for src in (hf_dir, prepared)}
            print(f"{n} rank(s): {loads[n]}", flush=True)
        variants = {  # label -> child args; each runs --export-reps times, interleaved, in fresh processes
            "import floor (torch, transformers, finetune; no work)":
                ["-c", "import transformers, finetune.cli, finetune.export; from transformers import LlamaForCausalLM"],
            "default (export, then reload check): whole command": [],
            "--no-verify --max-shard-size 200MB: whole command": ["--no-verify", "--max-shard-size", "200MB"]}
        runs: dict[str, list[tuple[float, float]]] = {label: [] for label in variants}
        writing: list[float] = []  # the default command's own peak once the shards are written, before its check
        for _ in range(args.export_reps):
            for label, extra in variants.items():
                cmd = extra if label.startswith("import") else [
                    "-m", "finetune", "export-hf", "--checkpoint", str(prepared), "--output-dir",
                    str(Path(tmp) / "export"), *extra]
                wall, rss, out = run_child(cmd)
                runs[label].append((wall, rss))
                print(f"{label}: {wall:.1f}s, peak RSS {rss:.0f} MB\n  {out.strip()[-400:]}", flush=True)
                if label.startswith("default"):
                    writing.append(float(re.search(r"peak RSS so far (\d+) MB", out).group(1)))
        largest_mb = args.vocab * args.hidden * 4 / 2**20
    total_s = time.perf_counter() - t_start
    med = statistics.median
    fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    lines = [
        HEADING, "",
        f"`uv run python benchmarks/load_and_export.py --write` (one run, {total_s / 60:.1f} min). Machine: {host}.",
        "",
        f"Model: random Llama, {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, vocab "
        f"{args.vocab}, untied: **{num_params / 1e9:.3f}B params, {bf16_gb:.2f} GB in bf16, "
        f"{2 * bf16_gb:.2f} GB in fp32**. Largest tensor (embedding / lm_head) {largest_mb:.0f} MiB in fp32.",
        "",
        f"Load into the sharded fp32 model (`build_model`, the sft load path: skeleton, FSDP, weights), timed between "
        f"barriers in fresh `torchrun` processes (imports and process start, the same for both sources, left out), "
        f"after one untimed load of each, {args.reps} loads alternating, warm page cache. Peak RSS: one load in a "
        f"fresh process, summed over the node's ranks.",
        "",
        "| ranks | source | median s | min s | loads (s) | node peak RSS of one load (GiB) |",
        "|---|---|---|---|---|---|",
    ]
    for n, res in loads.items():
        for src, label in (("hf", "HF dir: from_pretrained on rank 0, cast, scatter"),
                           ("prepared", "prepared dir: fp32 DCP into the shards")):
            ts = res["times"][src]
            lines.append(f"| {n} | {label} | {med(ts):.2f} | {min(ts):.2f} | {fmt(ts)} | "
                         f"{sum(res['rss'][src]) / 1024:.2f} |")
    lines += ["", "HF-dir load time / prepared load time, by median: " + "; ".join(
        f"**{med(res['times']['hf']) / med(res['times']['prepared']):.1f}x at {n} rank(s)**" for n, res in
        loads.items()) + ". " + "Node RAM of one load, HF / prepared: " + "; ".join(
        f"{sum(res['rss']['hf']) / 1024:.2f} / {sum(res['rss']['prepared']) / 1024:.2f} GiB at {n} rank(s)"
        for n, res in loads.items()) + ".",
        "",
        f"The HF path reads the whole bf16 model on rank 0 (from_pretrained), casts each tensor to fp32 and scatters "
        f"it, so its time grows with the world size while the other ranks wait; the prepared path has every rank "
        f"read just its own fp32 shards from DCP in parallel, with no bf16 copy of the model beside them. On one "
        f"process both are a few memory copies of the model from the page cache. Making the prepared dir "
        f"(`prepare-checkpoint --nproc-per-node 2`, the sft load path then a DCP save) took {prep_s:.0f}s wall; it "
        f"holds {2 * bf16_gb:.2f} GB of fp32 weights, twice the bf16 checkpoint. Loading it at 1 rank reshards it "
        f"from the 2 shards it was saved in.",
        "",
        f"export-hf from the prepared dir (bf16 output, one process; peak RSS = the child's VmHWM), each command "
        f"{args.export_reps} times in fresh processes, interleaved; medians, with the range of the peaks:",
        "",
        "| command | wall s | peak RSS MiB (range) | vs. bf16 model size |",
        "|---|---|---|---|",
    ]
    mib = {label: med(r for _, r in rs) for label, rs in runs.items()}
    rng = lambda xs: f"{min(xs):.0f}-{max(xs):.0f}"  # noqa: E731
    floor_label, default_label, no_verify_label = variants
    for label, rs in runs.items():
        lines.append(f"| {label} | {med(w for w, _ in rs):.1f} | {mib[label]:.0f} ({rng([r for _, r in rs])}) | "
                     f"{mib[label] * 2**20 / (bf16_gb * 1e9):.2f}x |")
        if label == default_label:
            lines.append(f"| default: writing the shards (peak reported by the command before its check) | | "
                         f"{med(writing):.0f} ({rng(writing)}) | {med(writing) * 2**20 / (bf16_gb * 1e9):.2f}x |")
    floor = mib[floor_label]
    lines += [
        "",
        f"Writing the shards streams one tensor at a time: the command's own peak while writing is "
        f"{med(writing) - floor:+.0f} MiB over the import floor with one {bf16_gb:.1f} GB shard and "
        f"{mib[no_verify_label] - floor:+.0f} MiB for the whole `--no-verify` command with 200 MB shards (medians; "
        f"the ranges are in the table); the extra is about one fp32 copy of the largest "
        f"tensor ({largest_mb:.0f} MiB) plus its bf16 cast and DCP's read buffers, not the model or shard size. The "
        f"reload check (`from_pretrained(dtype=float32)`, every tensor compared with the checkpoint's one by one, "
        f"logits against the source config's model on the same storage) holds one fp32 copy of the model plus "
        f"what from_pretrained needs while loading: {(mib[default_label] - floor) / 1024:.2f} GiB over the floor for "
        f"a {2 * bf16_gb:.2f} GB fp32 model. `--no-verify` skips it on hosts without that RAM.",
        "",
    ]
    section = "\n".join(lines)
    print("\n" + section)
    if args.write:
        write_section(REPO / "benchmarks" / "RESULTS.md", section)


def write_section(path: Path, section: str) -> None:
    """Replace (or append) our section, leaving the other sections of RESULTS.md as they are."""
    text = path.read_text() if path.exists() else "# Benchmark results\n\nEach section names its machine.\n"
    start = text.find(HEADING)
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(HEADING))
        text = text[:start] + section.rstrip("\n") + "\n\n" + (text[end + 1:] if end >= 0 else "")
    path.write_text(text.rstrip("\n") + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
