"""The `finetune` command and its subcommands; bad input ends with one line on stderr and exit code 2 (`guarded`)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import List, Optional

import typer

from .args import CONFIG, DATASET, DEBUG, MODEL, NPROC, OUTPUT, OVERRIDES, build_config, check_flag
from .config import (DEFAULT_PRESET, ConfigError, check_parallel, export_dtype_name, parse_shard_size)
from .run import checks
from .tools.commands import COMMANDS, options
from .run.console import setup as setup_console
from .run.flag_hints import Commands
from .run.locks import hold_run_lock, release_lock
from .launch import guarded, launch as launch_ranks
from .outdir import check_writable


app = typer.Typer(cls=Commands, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Fine-tune Hugging Face causal LMs with FSDP2: sft, dpo, preview-data, prepare-checkpoint, "
                  "export-hf, bench, plan.")
app.callback()(options)


def launch(entry, args: tuple, nproc: int, debug: bool, nnodes: int = 1, **kwargs):
    """launch.launch; ranks it starts end with their errors as one line (run/rank_errors.py)."""
    errors = None
    if nproc > 1 or nnodes > 1:
        from .run.rank_errors import rank_errors as errors
    return launch_ranks(entry, args, nproc, debug, nnodes=nnodes, errors=errors, **kwargs)


DPO_PRESET = DEFAULT_PRESET.parent / "tiny_dpo.toml"  # `finetune dpo`'s embedded default
NNODES = typer.Option(1, "--nnodes", help="nodes, each running this command (one launcher per node)")
RDZV_ENDPOINT = typer.Option("", "--rdzv-endpoint", help="host:port where the nodes' launchers meet (c10d rendezvous; "
                             "on the first node); needed with --nnodes > 1")
NO_RESUME = typer.Option(False, "--no-resume", help="start fresh even if checkpoints exist (they are kept beside, as "
                         "checkpoints.N)")
RESUME_FROM = typer.Option(None, "--resume-from", help="resume from this checkpoint dir")


def train_command(task: str):
    """The `sft` or `dpo` command: train.train(cfg, task) on the launched ranks."""
    def command(overrides: Optional[List[str]] = OVERRIDES, config: Optional[Path] = CONFIG,
                model: Optional[str] = MODEL, dataset: Optional[str] = DATASET, output_dir: Optional[str] = OUTPUT,
                nproc_per_node: int = NPROC, nnodes: int = NNODES, rdzv_endpoint: str = RDZV_ENDPOINT,
                no_resume: bool = NO_RESUME, resume_from: Optional[str] = RESUME_FROM, debug: bool = DEBUG):
        def prepare():
            check_flag("--nproc-per-node", nproc_per_node >= 1, ">= 1", nproc_per_node)  # before the lock (dir)
            check_flag("--nnodes", nnodes >= 1, ">= 1", nnodes)
            check_flag("--rdzv-endpoint", nnodes == 1 or ":" in rdzv_endpoint, "host:port with --nnodes > 1",
                       repr(rdzv_endpoint))
            cfg = build_config(config or (DPO_PRESET if task == "dpo" else None), overrides, checks=checks,
                               **{"model.path": model, "data.path": dataset, "output_dir": output_dir,
                                  "checkpoint.resume_from": resume_from})  # the hub's probe: before torch is imported
            if no_resume:
                cfg.checkpoint.resume = False
            lock = Path(cfg.output_dir) / ".finetune.lock"  # the run's (run/locks.py)
            launched = "RANK" in os.environ and os.environ.get("FINETUNE_LOCK") == str(lock.resolve())
            if not launched:
                check_writable(Path(cfg.output_dir), f"output_dir {cfg.output_dir}")
            # a dir another run owns stops here, before torch and the recipe's modules load (~20 s on a busy CPU)
            if not launched and (nnodes == 1 or "RANK" in os.environ) and lock.parent.is_dir():
                hold_run_lock(lock, f"output dir {cfg.output_dir}")
            try:
                checks.validate(cfg, task)
                num_ranks = int(os.environ.get("WORLD_SIZE", nnodes * nproc_per_node))
                check_parallel(cfg.parallel.dp_replicate, cfg.parallel.dp_shard, num_ranks, cfg.parallel.cp)
            except BaseException:
                release_lock(lock)
                raise
            if launched:
                return cfg, None, None  # a rank our launcher started: it checked this and holds the lock
            if os.environ.get("RANK", "0") == "0":  # at once: loading a big model or dataset takes a while
                print(f"{task}: loading {cfg.model.path} and {cfg.data.path} -> {cfg.output_dir}", flush=True)
            from .preflight import preflight_locked
            return cfg, preflight_locked(cfg, task, lock, nnodes), lock
        cfg, nothing_to_do, lock = guarded(prepare, debug)
        try:  # the lock goes with the process anyway; released here for callers that run commands in-process
            if nothing_to_do:
                if os.environ.get("RANK", "0") == "0":
                    print(nothing_to_do, flush=True)
                return
            from .checkpoint import latest_complete
            from .train import train
            root = Path(cfg.output_dir) / "checkpoints"
            before = latest_complete(root, report=False) if cfg.checkpoint.resume else None  # else moved aside
            launch(train, (cfg, task), nproc_per_node, debug,
                   on_signal=lambda: latest_complete(root, report=False) != before, nnodes=nnodes,
                   rdzv_endpoint=rdzv_endpoint)
        finally:
            if lock:
                release_lock(lock)
    return command


app.command("sft", help="Supervised fine-tuning (with no arguments: the embedded tiny model on the bundled chat data, "
            "on CPU).")(train_command("sft"))
app.command("dpo", help="Preference tuning, DPO or SimPO (dpo.*), on sft's loop (with no arguments: the embedded tiny "
            "model on the bundled preference pairs, on CPU).")(train_command("dpo"))


for name, command in COMMANDS.items():
    app.command(name)(command)


@app.command("export-hf")
def export_hf(checkpoint: Optional[str] = typer.Option(None, "--checkpoint",
                                                       help="output dir, step dir or prepared dir"),
              output_dir: Optional[str] = typer.Option(None, "--output-dir", "-o", help="the Hugging Face model "
                                                       "dir to write (replaces an earlier export)"),
              dtype: str = typer.Option("auto", "--dtype", help="dtype of the exported weights: auto (each "
                                        "tensor's in the source) | bfloat16 | float32"),
              max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="largest safetensors file: 5GB, "
                                                 "500MiB, 1.5GB (as transformers' max_shard_size)"),
              verify: bool = typer.Option(True, "--verify/--no-verify", help="read every tensor back and compare "
                                          "logits streamed block by block from the files (never holds the model)"),
              adapter: bool = typer.Option(False, "--adapter", help="LoRA checkpoints: write the PEFT adapter dir "
                                           "(adapter_config.json + adapter_model.safetensors), not the merged model"),
              nproc_per_node: int = typer.Option(1, "--nproc-per-node", help="processes, each writing and "
                                                 "checking whole safetensors files (same bytes as one process)"),
              debug: bool = DEBUG):
    """Turn a checkpoint into a Hugging Face model directory, verified tensor by tensor. No GPU needed."""
    def check():
        if not checkpoint or not output_dir:
            raise ConfigError("export-hf needs --checkpoint DIR and --output-dir HF_DIR")
        check_flag("--nproc-per-node", nproc_per_node >= 1, ">= 1", nproc_per_node)
        export_dtype_name(dtype)  # before the import of torch and transformers (seconds)
        parse_shard_size(max_shard_size)
        out = Path(output_dir).resolve()
        check_writable(out.parent, f"--output-dir {out} (written beside it, then renamed)")
    guarded(check, debug)
    from .export import export_hf as export  # VerifyError: exit 1, nothing written
    launch(export, (checkpoint, output_dir, dtype, max_shard_size, verify, adapter),
           nproc_per_node, debug)


def main():
    # quiet libraries, Ctrl-C as one line
    setup_console()
    app()


if __name__ == "__main__":
    main()
