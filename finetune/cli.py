"""The `finetune` command: sft, preview-data, prepare-checkpoint, export-hf, bench; launches ranks via torchrun's engine.

Bad input (config, paths, data, checkpoints) ends with one line on stderr and exit code 2; `--debug` shows the
traceback instead.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable, List, NoReturn, Optional

import typer

from .config import Config, ConfigError, load_config, parse_value

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Fine-tune Hugging Face causal LMs with FSDP2: sft, preview-data, prepare-checkpoint, "
                       "export-hf, bench.")

OVERRIDES = typer.Argument(None, help="Config overrides as section.key=value, e.g. train.lr=1e-4 data.packing=true",
                           show_default=False)
CONFIG = typer.Option(None, "--config", "-c", help="TOML preset (default: configs/tiny.toml, the embedded demo)")
MODEL = typer.Option(None, "--model", help="HF hub id, HF model dir or prepared checkpoint (model.path)")
DATASET = typer.Option(None, "--dataset", help="hub id or .json/.jsonl/.parquet file or dir (data.path)")
OUTPUT = typer.Option(None, "--output-dir", "-o", help="where metrics, config and checkpoints go (output_dir)")
NPROC = typer.Option(1, "--nproc-per-node", help="local ranks, launched with torch's elastic launcher")
DEBUG = typer.Option(False, "--debug", help="show tracebacks")


def user_errors() -> tuple[type[Exception], ...]:
    """Exception types that mean bad input: one line, exit 2."""
    from .checkpoint import CheckpointError
    from .data import DataError
    from .model import ModelError
    return ConfigError, DataError, ModelError, CheckpointError


def fail(message, code: int = 2) -> NoReturn:
    """`error: <one line>` on stderr, then exit `code` (2: bad input)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def guarded(fn: Callable, debug: bool, *args, **kwargs):
    """Run fn; bad input becomes `error: <one line>` and exit 2 (traceback only with --debug)."""
    try:
        return fn(*args, **kwargs)
    except user_errors() as e:
        if debug:
            raise
        fail(e)


def build_config(config: Optional[Path], overrides: Optional[List[str]], **flags) -> Config:
    """Preset + flags (--model etc.) + key=value overrides, validated."""
    values = {key: value for key, value in flags.items() if value is not None}
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' must look like section.key=value")
        values[key.strip()] = parse_value(value.strip())
    return load_config(config, values)


def set_threads(nproc: int) -> None:
    """OMP_NUM_THREADS defaults to physical cores / local ranks (oversubscription slows CPU runs a lot)."""
    if "OMP_NUM_THREADS" not in os.environ:
        import psutil
        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
        os.environ["OMP_NUM_THREADS"] = str(max(1, cores // nproc))


def launch(entry: Callable, args: tuple, nproc: int, debug: bool, on_signal: Callable[[], bool] | None = None):
    """Run entry(*args) here when one rank (or when torchrun already launched us); else start `nproc` local ranks
    that re-run this same command line through torch's elastic launcher (torchrun's engine) and wait for them."""
    if nproc < 1:
        fail(f"--nproc-per-node must be >= 1, got {nproc}")
    set_threads(nproc)
    if nproc <= 1 or "RANK" in os.environ:
        return rank_main(entry, args, debug)
    import uuid
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    from .distributed import _free_port
    # the launcher forwards SIGTERM/SIGUSR1 to the ranks and gives them time to save before it kills them
    os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    lc = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                      rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{_free_port()}", max_restarts=0,
                      monitor_interval=0.5, shutdown_timeout=int(os.environ.get("FINETUNE_SHUTDOWN_TIMEOUT_S", 3600)))
    try:
        elastic_launch(lc, sys.executable)("-m", "finetune", *sys.argv[1:])
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        raise SystemExit(2 if 2 in codes else (codes[0] or 1)) from None
    except SignalException as e:
        ok = on_signal() if on_signal else False
        print(f"finetune: {e.sigval.name} forwarded to the ranks; "
              f"{'they saved and stopped' if ok else 'no new checkpoint was completed'}", file=sys.stderr)
        raise SystemExit(0 if ok else 1) from None


def rank_main(entry: Callable, args: tuple, debug: bool):
    """One rank: threads, the entry, errors as one line + exit 2, process group torn down."""
    import torch
    from .distributed import teardown
    if "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        return guarded(entry, debug, *args)
    finally:
        teardown()


def run_sft(cfg: Config):
    from .train import NonFiniteError, train
    try:
        return train(cfg)
    except NonFiniteError as e:
        fail(e, code=1)


def preflight(cfg: Config) -> None:
    """Fail fast, before any rank starts: model config, tokenizer with a chat template, readable data."""
    from .data import detect_format, load_rows, columns_of
    from .model import load_hf_config, load_tokenizer
    load_hf_config(cfg.model.path, cfg.model.trust_remote_code)
    tok = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
    if not getattr(tok, "chat_template", None):
        from .data import DataError
        raise DataError(f"the tokenizer of '{cfg.model.path}' has no chat template (tokenizer_config.json "
                        f"'chat_template'); instruct data cannot be rendered")
    from .checkpoint import find_resume
    find_resume(Path(cfg.output_dir), cfg.checkpoint.resume, cfg.checkpoint.resume_from, report=False)
    rows = load_rows(cfg.data.path, split=cfg.data.split, name=cfg.data.name or None, streaming=cfg.data.streaming)
    detect_format(columns_of(rows), cfg.data.format)


@app.command()
def sft(overrides: Optional[List[str]] = OVERRIDES, config: Optional[Path] = CONFIG, model: Optional[str] = MODEL,
        dataset: Optional[str] = DATASET, output_dir: Optional[str] = OUTPUT, nproc_per_node: int = NPROC,
        no_resume: bool = typer.Option(False, "--no-resume", help="start fresh even if checkpoints exist"),
        resume_from: Optional[str] = typer.Option(None, "--resume-from", help="resume from this checkpoint dir"),
        debug: bool = DEBUG):
    """Supervised fine-tuning (with no arguments: the embedded tiny model on the bundled chat data, on CPU)."""
    def prepare():
        cfg = build_config(config, overrides, **{"model.path": model, "data.path": dataset, "output_dir": output_dir,
                                                 "checkpoint.resume_from": resume_from})
        if no_resume:
            cfg.checkpoint.resume = False
        preflight(cfg)
        return cfg
    cfg = guarded(prepare, debug)
    from .checkpoint import latest_complete
    root = Path(cfg.output_dir) / "checkpoints"
    before = latest_complete(root, report=False)
    launch(run_sft, (cfg,), nproc_per_node, debug, on_signal=lambda: latest_complete(root, report=False) != before)


@app.command("preview-data")
def preview_data(overrides: Optional[List[str]] = OVERRIDES, config: Optional[Path] = CONFIG,
                 model: Optional[str] = MODEL, dataset: Optional[str] = DATASET,
                 num: int = typer.Option(3, "--num", "-n", help="samples to show"),
                 json_out: bool = typer.Option(False, "--json", help='one {"input_ids", "labels"} object per line'),
                 debug: bool = DEBUG):
    """Show the first samples in dataset order as the trainer sees them: text with trained tokens highlighted."""
    def run():
        import json
        from .data import build_samples, format_preview
        from .model import load_tokenizer
        cfg = build_config(config, overrides, **{"model.path": model, "data.path": dataset})
        if num < 1:
            raise ConfigError(f"--num must be >= 1, got {num}")
        d = cfg.data
        tok = load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
        samples = build_samples(d.path, tok, fmt=d.format, split=d.split, name=d.name or None, streaming=d.streaming,
                                max_seq_len=d.max_seq_len, packing=d.packing, seed=cfg.train.seed, shuffle=False,
                                epoch_limit=1)
        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        for i, sample in zip(range(num), samples):
            if json_out:
                print(json.dumps({"input_ids": list(sample["input_ids"]), "labels": list(sample["labels"])}))
            else:
                print(f"--- sample {i}\n{format_preview(tok, sample, color=color)}")
    guarded(run, debug)


@app.command("prepare-checkpoint")
def prepare_checkpoint(overrides: Optional[List[str]] = OVERRIDES, model: Optional[str] = MODEL,
                       output_dir: Optional[str] = OUTPUT, nproc_per_node: int = NPROC, debug: bool = DEBUG):
    """Load, cast to fp32 and shard a HF model once; save it as a DCP checkpoint that later runs load in seconds."""
    def prepare():
        from .model import load_hf_config, load_tokenizer
        from .prepare import check_output_dir
        if not model or not output_dir:
            raise ConfigError("prepare-checkpoint needs --model ID|DIR and --output-dir DIR")
        cfg = build_config(None, overrides, **{"model.path": model, "output_dir": output_dir})
        check_output_dir(Path(cfg.output_dir), cfg.model.path)
        load_hf_config(cfg.model.path, cfg.model.trust_remote_code)  # bad input fails here, before any rank starts
        load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)
        return cfg
    cfg = guarded(prepare, debug)
    from .prepare import prepare_checkpoint as run_prepare
    launch(run_prepare, (cfg.model.path, cfg.output_dir, cfg.model.trust_remote_code, cfg.model.attn_implementation),
           nproc_per_node, debug)


@app.command("export-hf")
def export_hf(checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="output dir, step dir or prepared dir"),
              output_dir: Optional[str] = OUTPUT,
              dtype: str = typer.Option("bfloat16", "--dtype", help="dtype of the exported weights: bfloat16 | float32"),
              max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="largest safetensors file (5GB, 500MB)"),
              verify: bool = typer.Option(True, "--verify/--no-verify",
                                          help="reload with from_pretrained and compare logits (needs RAM for one "
                                               "fp32 copy of the model)"),
              adapter: bool = typer.Option(False, "--adapter", help="LoRA checkpoints: write the PEFT adapter dir "
                                           "(adapter_config.json + adapter_model.safetensors), not the merged model"),
              debug: bool = DEBUG):
    """Turn a checkpoint into a Hugging Face model directory, verified by reloading it. One process, no GPU needed."""
    def run():
        from .export import VerifyError, export_hf as export
        if not checkpoint or not output_dir:
            raise ConfigError("export-hf needs --checkpoint DIR and --output-dir HF_DIR")
        try:
            export(checkpoint, output_dir, dtype, max_shard_size, verify, adapter)
        except VerifyError as e:  # not bad input but a broken export: exit 1, nothing left in --output-dir
            if debug:
                raise
            fail(e, code=1)
    guarded(run, debug)


@app.command()
def bench(overrides: Optional[List[str]] = OVERRIDES, config: Optional[Path] = CONFIG, model: Optional[str] = MODEL,
          dataset: Optional[str] = DATASET,
          sac_ratios: str = typer.Option("0,0.25,0.5,0.75,1", "--sac-ratios", help="ac.ratio values to sweep"),
          steps: int = typer.Option(10, "--steps", help="timed optimizer steps per point (median reported)"),
          warmup: int = typer.Option(2, "--warmup", help="untimed steps first"),
          output_dir: str = typer.Option("outputs/bench", "--output-dir", "-o", help="bench.json/md/png go here"),
          grad_accum: Optional[str] = typer.Option(None, "--grad-accum", help="also sweep splits of the same global "
                                                   "batch into this many micro-batches, e.g. 1,2,4"),
          memory_budget: Optional[float] = typer.Option(None, "--memory-budget", help="MB the recommended point "
                                                        "must fit (default: GPU memory, or host RAM on CPU)"),
          debug: bool = DEBUG):
    """Measure step time, tokens/s, MFU and memory across activation-checkpointing ratios (fresh process each)."""
    def run():
        from .bench import parse_list, run_bench
        from .model import load_hf_config
        ratios = parse_list(sac_ratios, "--sac-ratios", float, lambda r: 0 <= r <= 1, "numbers in [0, 1]")
        accums = parse_list(grad_accum, "--grad-accum", int, lambda a: a > 0, "integers > 0") if grad_accum else None
        for flag, ok, rule, value in (("--steps", steps > 0, "> 0", steps), ("--warmup", warmup >= 0, ">= 0", warmup),
                                      ("--memory-budget", memory_budget is None or memory_budget > 0, "> 0 (MB)",
                                       memory_budget)):
            if not ok:
                raise ConfigError(f"{flag} must be {rule}, got {value}")
        cfg = build_config(config, overrides, **{"model.path": model, "data.path": dataset})
        load_hf_config(cfg.model.path, cfg.model.trust_remote_code)  # a bad model path fails here, not per point
        set_threads(1)
        run_bench(cfg, ratios, accums, steps, warmup, Path(output_dir), memory_budget)
    guarded(run, debug)


def quiet_libraries() -> None:
    """Our progress bar and log lines only: no per-load bars from transformers/datasets."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main():
    quiet_libraries()
    app()


if __name__ == "__main__":
    main()
