"""Prepared-checkpoint load vs HF load into the sharded model, and export-hf's peak host RAM, on a random Llama.

    uv run python benchmarks/load_and_export.py            # ~0.5B Llama, 3 repetitions, prints the table
    uv run python benchmarks/load_and_export.py --write    # ... and puts it into benchmarks/RESULTS.md

In one run: a random bf16 Llama is saved to a temp dir (save_pretrained), `finetune prepare-checkpoint` turns it
into a prepared dir, then `build_model` (world size 1, fp32 master weights, the sft load path) is timed from the HF
dir and from the prepared dir, alternating, median of --reps. Finally `finetune export-hf` runs in child processes
and each child's peak RSS (VmHWM) is polled: without the reload check (the streaming export alone), with
it (the default command), and the import floor of the same modules for comparison. Both sources are read from the
page cache (just written); a cold-cache load also pays the disk.
"""
from __future__ import annotations

import argparse
import gc
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
# one load in a fresh process, for its peak RSS
LOAD_CHILD = ("import sys; from finetune.distributed import init_distributed; from finetune.model import build_model; "
              "device, mesh = init_distributed(); build_model(sys.argv[1], device, mesh, mixed_precision='fp32')")
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


def time_loads(hf_dir: Path, prepared: Path, reps: int) -> dict[str, list[float]]:
    """Seconds for build_model (skeleton, FSDP on a mesh of 1, weights) from each source, alternating order."""
    from finetune.distributed import init_distributed
    from finetune.model import build_model
    device, mesh = init_distributed()
    times: dict[str, list[float]] = {"hf": [], "prepared": []}
    for path in (hf_dir, prepared):  # untimed: first-use imports and page-cache fill land here
        build_model(str(path), device, mesh, mixed_precision="fp32")
        gc.collect()
    for rep in range(reps):
        for name in (("hf", "prepared") if rep % 2 == 0 else ("prepared", "hf")):
            t0 = time.perf_counter()
            model = build_model(str(hf_dir if name == "hf" else prepared), device, mesh, mixed_precision="fp32")
            times[name].append(time.perf_counter() - t0)
            del model
            gc.collect()
            print(f"  rep {rep}: {name} load {times[name][-1]:.2f}s", flush=True)
    return times


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
    ap.add_argument("--write", action="store_true", help="write the section into benchmarks/RESULTS.md")
    args = ap.parse_args()
    host = machine()
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="finetune-bench-") as tmp:
        hf_dir, prepared = Path(tmp) / "hf", Path(tmp) / "prepared"
        t0 = time.perf_counter()
        num_params = make_model_dir(hf_dir, args.layers, args.hidden, args.intermediate, args.vocab)
        bf16_gb = num_params * 2 / 1e9
        print(f"random Llama: {num_params / 1e9:.3f}B params, {bf16_gb:.2f} GB bf16 "
              f"({time.perf_counter() - t0:.0f}s to make)", flush=True)
        prep_s, prep_rss, _ = run_child(["-m", "finetune", "prepare-checkpoint", "--model", str(hf_dir),
                                         "--output-dir", str(prepared)])
        print(f"prepare-checkpoint: {prep_s:.1f}s, peak RSS {prep_rss:.0f} MB", flush=True)
        times = time_loads(hf_dir, prepared, args.reps)
        load_rss = {name: run_child(["-c", LOAD_CHILD, str(path)])[1] for name, path in
                    (("hf", hf_dir), ("prepared", prepared))}
        print(f"peak RSS of one load (fresh process): {load_rss}", flush=True)
        floor_s, floor_rss, _ = run_child(["-c", "import transformers, finetune.cli, finetune.export; "
                                                 "from transformers import LlamaForCausalLM"])
        exports = {}
        for label, extra in (("default (export, then reload check)", []),
                             ("--no-verify --max-shard-size 200MB", ["--no-verify", "--max-shard-size", "200MB"])):
            wall, rss, out = run_child(["-m", "finetune", "export-hf", "--checkpoint", str(prepared), "--output-dir",
                                        str(Path(tmp) / "export"), *extra])
            exports[label] = (wall, rss)
            print(f"export-hf {label}: {wall:.1f}s, peak RSS {rss:.0f} MB\n  {out.strip()}", flush=True)
            if not extra:  # the command reports its own peak (VmHWM) once the shards are written, before the check
                export_phase_rss = float(re.search(r"peak RSS so far (\d+) MB", out).group(1))
        largest_mb = args.vocab * args.hidden * 4 / 2**20
    total_s = time.perf_counter() - t_start
    hf_med, prep_med = statistics.median(times["hf"]), statistics.median(times["prepared"])
    fmt = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    lines = [
        HEADING, "",
        f"`uv run python benchmarks/load_and_export.py --write` (one run, {total_s / 60:.1f} min). Machine: {host}.",
        "",
        f"Model: random Llama, {args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, vocab "
        f"{args.vocab}, untied: **{num_params / 1e9:.3f}B params, {bf16_gb:.2f} GB in bf16, "
        f"{2 * bf16_gb:.2f} GB in fp32**. Largest tensor (embedding / lm_head) {largest_mb:.0f} MiB in fp32.",
        "",
        f"Load into the sharded fp32 model (`build_model`, world size 1, the sft path), median of {args.reps}, "
        f"alternating, warm page cache:",
        "",
        "| source | median s | min s | runs (s) | peak RSS of one load, fresh process (GiB) |",
        "|---|---|---|---|---|",
        f"| HF dir (bf16 safetensors: from_pretrained on rank 0, cast, scatter) | {hf_med:.2f} | "
        f"{min(times['hf']):.2f} | {fmt(times['hf'])} | {load_rss['hf'] / 1024:.2f} |",
        f"| prepared dir (fp32 DCP straight into the shards) | {prep_med:.2f} | {min(times['prepared']):.2f} | "
        f"{fmt(times['prepared'])} | {load_rss['prepared'] / 1024:.2f} |",
        "",
        f"HF-dir load / prepared load = **{hf_med / prep_med:.1f}x** by median, "
        f"{min(times['hf']) / min(times['prepared']):.1f}x by min; the prepared load needs "
        f"{(load_rss['hf'] - load_rss['prepared']) / 1024:.2f} GiB less RAM (no full bf16 copy beside the fp32 "
        f"shards). One process, so the time is the rank-0 path's own cost (from_pretrained, the bf16->fp32 cast, "
        f"the scatter) against DCP reading twice the bytes in fp32; with N ranks the prepared load also spreads "
        f"the reading over all ranks, where the HF path reads the whole model on rank 0 and sends it. Making the "
        f"prepared dir (`prepare-checkpoint`, 1 process) took {prep_s:.0f}s wall with peak RSS "
        f"{prep_rss / 1024:.2f} GiB (the sft load path, then the DCP save); it holds {2 * bf16_gb:.2f} GB of fp32 "
        f"weights, twice the bf16 checkpoint.",
        "",
        "export-hf from the prepared dir (bf16 output, one process; peak RSS = the child's VmHWM):",
        "",
        "| command | wall s | peak RSS MiB | vs. bf16 model size |",
        "|---|---|---|---|",
        f"| import floor (torch, transformers, finetune; no work) | {floor_s:.1f} | {floor_rss:.0f} | "
        f"{floor_rss * 2**20 / (bf16_gb * 1e9):.2f}x |",
    ]
    default_wall, default_rss = exports["default (export, then reload check)"]
    lines.append(f"| default: writing the shards (peak reported by the command before its check) | | "
                 f"{export_phase_rss:.0f} | {export_phase_rss * 2**20 / (bf16_gb * 1e9):.2f}x |")
    for label, (wall, rss) in exports.items():
        lines.append(f"| {label}: whole command | {wall:.1f} | {rss:.0f} | {rss * 2**20 / (bf16_gb * 1e9):.2f}x |")
    no_verify_rss = exports["--no-verify --max-shard-size 200MB"][1]
    lines += [
        "",
        f"Writing the shards streams one tensor at a time: the command's own peak while writing is "
        f"{export_phase_rss - floor_rss:+.0f} MiB over the import floor with one 1 GB shard and "
        f"{no_verify_rss - floor_rss:+.0f} MiB with 200 MB shards (the floor itself varies by ~100 MiB between "
        f"processes); the extra is about one fp32 copy of the largest tensor ({largest_mb:.0f} MiB) plus its "
        f"bf16 cast and DCP's read buffer, whatever the model or shard size. The reload check "
        f"(`from_pretrained(dtype=float32)`, every tensor compared with the checkpoint's one by one, logits "
        f"against the source config's model on the same storage) holds one fp32 copy of the model plus what "
        f"from_pretrained needs while loading: {(default_rss - floor_rss) / 1024:.2f} GiB over the floor for a "
        f"{2 * bf16_gb:.2f} GB fp32 model. `--no-verify` skips it on hosts without that RAM.",
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
