"""Load an HF model into the sharded fp32 model three ways, and export-hf's wall time and peak host RAM, on random
Llamas of two sizes.

    uv run python benchmarks/load_and_export.py                     # 0.5B and ~1.5B, prints the tables
    uv run python benchmarks/load_and_export.py --sizes 0.5B --write  # ... and puts them into benchmarks/RESULTS.md

For each size: a random bf16 Llama is saved (save_pretrained), `finetune prepare-checkpoint --nproc-per-node 2`
turns it into a prepared dir, then `build_model` (fp32 masters, the sft load path) is timed in fresh torchrun
processes at each world size from three sources, alternating, median of --reps, between barriers (imports and
process start, the same for all, left out): the HF dir through the slice reader (every rank reads its own slices),
the HF dir through the rank-0 path (from_pretrained on rank 0, cast, scatter; forced here), and the prepared dir.
Each rank's peak RSS (VmHWM) of one load is read in separate fresh processes and summed over the node. Then
`finetune export-hf` (default check) runs at 1 and 2 processes; every process's VmHWM in the command's process tree
is polled. Sources are read from the page cache (just written); a cold-cache load also pays the disk.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
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
SIZES = {"0.5B": (28, 1024, 4096, 32000), "1.5B": (28, 1536, 8960, 32000)}  # layers, hidden, intermediate, vocab
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONUNBUFFERED": "1"}


def make_model_dir(path: Path, layers: int, hidden: int, intermediate: int, vocab: int, arch: str = "llama",
                   **fields) -> int:
    """A random bf16 model of `arch` (a Llama by default; `fields` over its config's sizes) with the tests' offline
    Llama-3 style tokenizer; returns its parameter count."""
    sys.path.insert(0, str(REPO / "tests"))
    from _tokenizers import build_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM
    tok = build_tokenizer("llama3")
    config = AutoConfig.for_model(arch, **{
        **dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
               num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, max_position_embeddings=2048,
               tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id), **fields})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def run_child(args: list[str]) -> tuple[float, dict[int, float], str]:
    """(wall seconds, {pid: peak RSS in MiB} of every process in the child's tree, output); exits on failure. A
    peak is the process's VmHWM (its own address space), polled until the child exits: wait4's ru_maxrss would also
    count this parent's RSS, which the kernel carries over into the child at fork/exec."""
    t0 = time.perf_counter()
    peaks: dict[int, float] = {}
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT)
        parent = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                tree = [parent, *parent.children(recursive=True)]
            except psutil.Error:
                tree = []
            for p in tree:
                try:
                    hwm = next(x for x in Path(f"/proc/{p.pid}/status").read_text().splitlines()
                               if x.startswith("VmHWM:"))
                    peaks[p.pid] = max(peaks.get(p.pid, 0), int(hwm.split()[1]) / 1024)
                except (OSError, ValueError, StopIteration):
                    pass  # exiting
            time.sleep(0.02)
        wall = time.perf_counter() - t0
        log.seek(0)
        out = log.read()
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args)} failed ({proc.returncode}):\n{out[-3000:]}")
    return wall, peaks, out


def load_child(sources: list[str], reps: int, warmup: bool) -> None:
    """Run under torchrun: time build_model from each source (alternating order, between barriers), then print one
    line `RESULT {json}` on rank 0 with the times and every rank's peak RSS (VmHWM) in MiB."""
    import torch.distributed as dist
    from finetune.distributed import init_distributed, is_main
    from finetune.model import build_model
    import finetune.load as io
    device, dims = init_distributed()
    mesh = dims.mesh
    locate_slices = io.locate_slices

    def build(src: str):  # "rank0=DIR": the HF dir through the rank-0 path
        io.locate_slices = (lambda *a: "forced by the benchmark") if src.startswith("rank0=") else locate_slices
        return build_model(src.split("=", 1)[-1], device, mesh, mixed_precision="fp32")[0]
    times: dict[str, list[float]] = {src: [] for src in sources}
    for src in sources if warmup else ():  # untimed: first-use imports and allocator warm-up land here
        build(src)
        gc.collect()
    for rep in range(reps):
        for src in (sources if rep % 2 == 0 else sources[::-1]):
            dist.barrier()
            t0 = time.perf_counter()
            model = build(src)
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


def label(src: str) -> str:
    return "rank0" if src.startswith("rank0=") else Path(src).name


def run_loads(nproc: int, sources: list, reps: int, warmup: bool) -> dict:
    """load_child in a fresh `torchrun --nproc-per-node nproc`."""
    _, _, out = run_child(["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
                           "--child", *map(str, sources), "--reps", str(reps), *(["--warmup"] if warmup else [])])
    result = json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    result["times"] = {label(k): v for k, v in result["times"].items()}
    return result


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    import transformers
    return (f"{cpu}; {psutil.cpu_count(logical=False)} physical / {os.cpu_count()} logical cores visible; "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM; no GPU; Linux {platform.release()}; "
            f"torch {torch.__version__}, transformers {transformers.__version__}; "
            f"load average at start {os.getloadavg()[0]:.1f} (shared machine)")


def bench_size(name: str, args, tmp: Path, nprocs: list[int]) -> list[str]:
    """The tables of one model size."""
    layers, hidden, intermediate, vocab = SIZES[name]
    hf_dir, prepared = tmp / "hf", tmp / "prepared"
    t0 = time.perf_counter()
    num_params = make_model_dir(hf_dir, layers, hidden, intermediate, vocab)
    bf16_gb = num_params * 2 / 1e9
    print(f"{name}: random Llama, {num_params / 1e9:.3f}B params ({time.perf_counter() - t0:.0f}s to make)", flush=True)
    prep_s, _, _ = run_child(["-m", "finetune", "prepare-checkpoint", "--model", str(hf_dir), "--output-dir",
                              str(prepared), "--nproc-per-node", "2"])
    sources = {"hf": ("HF dir: slice reader (every rank its own slices)", str(hf_dir)),
               "rank0": ("HF dir: rank-0 path (from_pretrained, cast, scatter)", f"rank0={hf_dir}"),
               "prepared": ("prepared dir: fp32 DCP into the shards", str(prepared))}
    loads = {}
    for n in nprocs:
        loads[n] = run_loads(n, [src for _, src in sources.values()], args.reps, warmup=True)
        loads[n]["rss"] = {key: run_loads(n, [src], 1, warmup=False)["rss_mib"] for key, (_, src) in sources.items()}
        print(f"{n} rank(s): {loads[n]}", flush=True)
    med = statistics.median
    fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    fp32_gib = num_params * 4 / 2**30
    lines = [f"### {name}: {layers} layers, hidden {hidden}, intermediate {intermediate}, vocab {vocab}, untied: "
             f"{num_params / 1e9:.3f}B params, {bf16_gb:.2f} GB bf16, {fp32_gib:.2f} GiB fp32", "",
             f"prepare-checkpoint --nproc-per-node 2: {prep_s:.0f}s wall. Loads ({args.reps} alternating after one "
             f"untimed load of each; node peak RSS = the ranks' VmHWM of one load in fresh processes, summed):", "",
             "| ranks | source | median s | loads (s) | node peak RSS GiB | minus fp32 shards GiB |",
             "|---|---|---|---|---|---|"]
    for n, res in loads.items():
        for key, (text, _) in sources.items():
            ts, rss = res["times"][label(sources[key][1])], sum(res["rss"][key]) / 1024
            lines.append(f"| {n} | {text} | {med(ts):.2f} | {fmt(ts)} | {rss:.2f} | {rss - fp32_gib:.2f} |")
    # export-hf at 1 and 2 processes, default check, from the prepared dir
    variants = {"import floor (torch, transformers, finetune; no work)":
                ["-c", "import transformers, finetune.cli, finetune.export; from transformers import LlamaForCausalLM"]}
    for n in (1, 2):
        variants[f"export-hf --nproc-per-node {n} (default check)"] = [
            "-m", "finetune", "export-hf", "--checkpoint", str(prepared), "--output-dir", str(tmp / "export"),
            "--max-shard-size", args.shard_size, "--nproc-per-node", str(n)]
    runs: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    for _ in range(args.export_reps):
        for text, cmd in variants.items():
            wall, peaks, out = run_child(cmd)
            worker = max(peaks.values())  # the largest process: a writer (the launcher itself is small)
            runs[text].append((wall, worker))
            print(f"{text}: {wall:.1f}s, largest process peak {worker:.0f} MiB; {sorted(map(round, peaks.values()))}"
                  f"\n  {out.strip()[-300:]}", flush=True)
    largest_mib = vocab * hidden * 4 / 2**20
    lines += ["", f"export-hf from the prepared dir, bf16, --max-shard-size {args.shard_size}, default check, "
              f"{args.export_reps} runs each interleaved (medians; peak = the largest process's VmHWM in the "
              f"command's tree; largest tensor {largest_mib:.0f} MiB fp32):", "",
              "| command | wall s | peak RSS MiB per process (range) | over the import floor MiB |",
              "|---|---|---|---|"]
    floor = med(r for _, r in runs[next(iter(variants))])
    for text, rs in runs.items():
        peaks = [r for _, r in rs]
        lines.append(f"| {text} | {med(w for w, _ in rs):.1f} | {med(peaks):.0f} ({min(peaks):.0f}-{max(peaks):.0f}) "
                     f"| {med(peaks) - floor:+.0f} |")
    return lines + [""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0.5B,1.5B", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--export-reps", type=int, default=2)
    ap.add_argument("--nprocs", default="1,2,4", help="world sizes to time the loads at")
    ap.add_argument("--shard-size", default="200MB", help="export-hf --max-shard-size (several files to share out)")
    ap.add_argument("--write", action="store_true", help="write the section into benchmarks/RESULTS.md")
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--warmup", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return load_child(args.child, args.reps, args.warmup)
    host = machine()
    t_start = time.perf_counter()
    body = []
    for name in args.sizes.split(","):
        with tempfile.TemporaryDirectory(prefix="finetune-bench-") as tmp:
            body += bench_size(name, args, Path(tmp), [int(n) for n in args.nprocs.split(",")])
    lines = [HEADING, "", f"`uv run python benchmarks/load_and_export.py --sizes {args.sizes} --write` (one run, "
             f"{(time.perf_counter() - t_start) / 60:.1f} min). Machine: {host}.", "", *body]
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
