"""The extensions' commands (preview-data, bench, plan, prepare-checkpoint) and --version: their flags, checked
before any model loads; each imports its module when it runs. cli.py's table adds them to the `finetune` command."""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import List, Optional

import typer

from .. import args
from ..args import CONFIG, DATASET, DEBUG, MODEL, NPROC, OVERRIDES, check_flag
from ..config import ConfigError
from ..launch import guarded, set_threads
from ..run import checks


build_config = partial(args.build_config, checks=checks)  # with the extensions' checks and the hub probe


def parse_list(text: str, flag: str, kind: type, ok, rule: str) -> list:
    """'0,0.5,1' -> [0.0, 0.5, 1.0]; anything else is a ConfigError that names the flag."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(ok(v) for v in values):
        raise ConfigError(f"{flag} must be comma-separated {rule}, got {text!r}")
    return values


def preview_data(overrides: Optional[List[str]] = OVERRIDES, config: Optional[Path] = CONFIG,
                 model: Optional[str] = MODEL, dataset: Optional[str] = DATASET,
                 num: int = typer.Option(3, "--num", "-n", help="samples to show"),
                 json_out: bool = typer.Option(False, "--json", help='one {"input_ids", "labels"} object per line'),
                 debug: bool = DEBUG):
    """Show the first samples in dataset order as the trainer sees them: text with trained tokens highlighted."""
    def run():
        from .preview import preview
        cfg = build_config(config, overrides, **{"model.path": model, "data.path": dataset})
        check_flag("--num", num >= 1, ">= 1", num)
        preview(cfg, num, json_out)
    guarded(run, debug)


def bench(overrides: Optional[List[str]] = OVERRIDES, config: Optional[Path] = CONFIG, model: Optional[str] = MODEL,
          dataset: Optional[str] = DATASET,
          sac_ratios: str = typer.Option("0,0.25,0.5,0.75,1", "--sac-ratios", help="ac.ratio values to sweep"),
          steps: int = typer.Option(10, "--steps", help="timed optimizer steps per point (median reported)"),
          warmup: int = typer.Option(2, "--warmup", help="untimed steps first"),
          output_dir: str = typer.Option("outputs/bench", "--output-dir", "-o", help="bench.json/md/png go here"),
          grad_accum: Optional[str] = typer.Option(None, "--grad-accum", help="also sweep splits of the same global "
                                                   "batch into this many micro-batches, e.g. 1,2,4"),
          fp8: Optional[str] = typer.Option(None, "--fp8", help="also sweep model.fp8 over these, e.g. off,tensorwise"),
          memory_budget: Optional[float] = typer.Option(None, "--memory-budget", help="MB the recommended point "
                                                        "must fit (default: GPU memory, or host RAM on CPU)"),
          nproc_per_node: int = NPROC, debug: bool = DEBUG):
    """Measure step time, tokens/s, MFU and memory across activation-checkpointing ratios (fresh processes each)."""
    def run():
        from ..model import load_hf_config
        from .bench import run_bench
        ratios = parse_list(sac_ratios, "--sac-ratios", float, lambda r: 0 <= r <= 1, "numbers in [0, 1]")
        accums = parse_list(grad_accum, "--grad-accum", int, lambda a: a > 0, "integers > 0") if grad_accum else None
        fp8s = parse_list(fp8, "--fp8", str.strip, lambda f: f in ("off", "tensorwise", "rowwise"),
                          "off, tensorwise or rowwise") if fp8 else None
        check_flag("--steps", steps > 0, "> 0", steps)
        check_flag("--warmup", warmup >= 0, ">= 0", warmup)
        check_flag("--memory-budget", memory_budget is None or memory_budget > 0, "> 0 (MB)", memory_budget)
        check_flag("--nproc-per-node", nproc_per_node >= 1, ">= 1", nproc_per_node)
        cfg = build_config(config, overrides, **{"model.path": model, "data.path": dataset, "ac.ratio": max(ratios)})
        load_hf_config(cfg.model.path, cfg.model.trust_remote_code)  # a bad model path fails here, not per point
        set_threads(nproc_per_node)
        run_bench(cfg, ratios, accums, steps, warmup, Path(output_dir), memory_budget, nproc_per_node, fp8s)
    guarded(run, debug)


def plan(overrides: Optional[List[str]] = OVERRIDES, config: Optional[Path] = CONFIG,
         model: Optional[str] = typer.Option(None, "--model", help="an HF model or config dir (default: model.path, "
                                             "or the preset's model.arch offline)"),
         nnodes: int = typer.Option(1, "--nnodes", help="nodes of the planned run"),
         nproc_per_node: int = typer.Option(8, "--nproc-per-node", help="GPUs per node"),
         gpu_memory: str = typer.Option("80GB", "--gpu-memory", help="memory of one GPU (GB = GiB, as GPUs are sized)"),
         sac_ratios: str = typer.Option("0,0.25,0.5,0.75,1", "--sac-ratios", help="ac.ratio values to plan"),
         micro_batch_sizes: str = typer.Option("1,2,4", "--micro-batch-sizes", help="train.micro_batch_size values"),
         max_seq_len: bool = typer.Option(False, "--max-seq-len", help="search the longest data.max_seq_len that "
                                          "fits (micro-batch 1) at each --sac-ratios value and cp degree"),
         json_out: bool = typer.Option(False, "--json", help="print the plan as JSON"), debug: bool = DEBUG):
    """Memory per GPU of a run on GPUs you have not rented (fake tensors and ranks, on this CPU): which activation
    checkpointing ratio and micro-batch fit, or (--max-seq-len) how long a row fits. Exit code 1 when none does."""
    def run():
        import contextlib
        import json
        from . import plan as p
        ratios = parse_list(sac_ratios, "--sac-ratios", float, lambda r: 0 <= r <= 1, "numbers in [0, 1]")
        mbs = parse_list(micro_batch_sizes, "--micro-batch-sizes", int, lambda m: m > 0, "integers > 0")
        check_flag("--nnodes", nnodes >= 1, ">= 1", nnodes)
        check_flag("--nproc-per-node", nproc_per_node >= 1, ">= 1", nproc_per_node)
        gpu_bytes = p.parse_gpu_memory(gpu_memory)
        cfg = build_config(config, overrides, check=False, **{"model.path": model, "data.path": "-"})
        from ..run.checks import check_ep
        check_ep(cfg, "sft")
        with contextlib.redirect_stdout(sys.stderr):  # notes of the model build (once per ratio) stay off the table
            result = p.run_seq_search(cfg, p.load_arch(cfg, model), nnodes, nproc_per_node, gpu_bytes, ratios) \
                if max_seq_len else p.run_plan(cfg, p.load_arch(cfg, model), nnodes, nproc_per_node, gpu_bytes, ratios,
                                               mbs)
        print(json.dumps(result, indent=2) if json_out else (p.format_seq_search if max_seq_len else p.format_plan)(
            result))
        return result["best"] is not None
    if not guarded(run, debug):
        raise SystemExit(1)


def prepare_checkpoint(overrides: Optional[List[str]] = OVERRIDES, model: Optional[str] = MODEL,
                       output_dir: Optional[str] = typer.Option(None, "--output-dir", "-o", help="the prepared "
                                                                "checkpoint dir to write (replaces an earlier one)"),
                       nproc_per_node: int = NPROC, debug: bool = DEBUG):
    """Load, cast to fp32 and shard a HF model once; save it as a DCP checkpoint that later runs load in seconds."""
    from .prepare import command
    command(overrides, model, output_dir, nproc_per_node, debug)


def print_version(value: bool) -> None:
    if value:
        from .. import __version__
        print(f"finetune {__version__}")
        raise typer.Exit()


def options(version: bool = typer.Option(False, "--version", callback=print_version, is_eager=True,
                                         help="print the version and exit")):
    """The `finetune` command's own options."""


COMMANDS = {"preview-data": preview_data, "bench": bench, "plan": plan, "prepare-checkpoint": prepare_checkpoint}
