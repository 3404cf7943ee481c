"""The `finetune` command: sft, dpo, preview-data, prepare-checkpoint, export-hf, bench, plan; launches ranks
(torchrun's engine).

Bad input (config, paths, data, checkpoints) ends with one line on stderr and exit code 2 (`guarded`)."""
from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path
from typing import List, NoReturn, Optional

import typer

from .config import (DEFAULT_PRESET, Config, ConfigError, check_parallel, export_dtype_name, get_key, load_config,
                     parse_shard_size, parse_value)
from .launch import guarded, launch, set_threads
from .lock import RUN_LOCK, hold_run_lock, release_lock
from .outdir import check_writable

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Fine-tune Hugging Face causal LMs with FSDP2: sft, dpo, preview-data, prepare-checkpoint, "
                       "export-hf, bench, plan.")


def print_version(value: bool) -> None:
    if value:
        from . import __version__
        print(f"finetune {__version__}")
        raise typer.Exit()


@app.callback()
def options(version: bool = typer.Option(False, "--version", callback=print_version, is_eager=True,
                                         help="print the version and exit")):
    pass


OVERRIDES = typer.Argument(None, help="Config overrides as section.key=value, e.g. train.lr=1e-4 data.max_seq_len=4096",
                           show_default=False)
CONFIG = typer.Option(None, "--config", "-c", help="TOML preset (default: configs/tiny.toml, the embedded demo)")
MODEL = typer.Option(None, "--model", help="HF hub id, HF model dir or prepared checkpoint (model.path)")
DATASET = typer.Option(None, "--dataset", help="hub id or .json/.jsonl/.parquet file or dir (data.path)")
OUTPUT = typer.Option(None, "--output-dir", "-o", help="where metrics, config and checkpoints go (output_dir)")
NPROC = typer.Option(1, "--nproc-per-node", help="local ranks, launched with torch's elastic launcher")
DEBUG = typer.Option(False, "--debug", help="show tracebacks")


FLAGS = {"model.path": "--model", "data.path": "--dataset", "output_dir": "--output-dir"}  # what a command must have


def build_config(config: Optional[Path], overrides: Optional[List[str]], check: bool = True, **flags) -> Config:
    """Preset + flags (--model etc., by their config keys) + key=value overrides, validated, with a model, data and
    output dir (FLAGS); with check, their paths too."""
    values = {key: value for key, value in flags.items() if value is not None}
    for item in overrides or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' must look like section.key=value")
        values[key.strip()] = parse_value(value.strip())
    cfg = load_config(config, values)
    if cfg.data.path and cfg.data.sources:
        raise ConfigError("data.path (--dataset) and data.sources are both set; use one (data.path= clears a "
                          "preset's path)")
    for key, flag in FLAGS.items():
        if not get_key(cfg, key) and not (key == "data.path" and cfg.data.sources):
            raise ConfigError(f"{key} is not set: pass {flag} or set {key} in the config")
    if check:
        check_paths(cfg)
    return cfg


def check_paths(cfg: Config) -> None:
    """Path errors within a second, before torch is imported: a local-looking path that is not there, an output
    dir that is a file, and hub ids while the hub cannot be reached (huggingface_hub would retry for ~30 s)."""
    paths = {"model.path": cfg.model.path, "data.path": cfg.data.path, "eval.path": cfg.eval.path,
             **{f"data.sources[{j}].path": src.path for j, src in enumerate(cfg.data.sources)}}
    remote = {k: v for k, v in paths.items() if v and not Path(v).expanduser().exists()}
    for key, value in remote.items():
        if value.startswith((".", "/", "~")) or value.endswith((".json", ".jsonl", ".parquet")):
            raise ConfigError(f"{key.replace('.', ' ')} '{value}' does not exist")
    if Path(cfg.output_dir).exists() and not Path(cfg.output_dir).is_dir():
        raise ConfigError(f"output_dir {cfg.output_dir} is a file, not a directory")
    proxy = any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"))
    if not remote or proxy or os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return
    from urllib.parse import urlsplit
    url = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=5).close()
    except OSError:
        key, value = next(iter(remote.items()))
        raise ConfigError(f"{key} '{value}' is not a local path and the Hugging Face hub ({url.netloc}) cannot be "
                          f"reached: pass a local path, or set HF_HUB_OFFLINE=1 to use the local cache") from None


def parse_list(text: str, flag: str, kind: type, ok, rule: str) -> list:
    """'0,0.5,1' -> [0.0, 0.5, 1.0]; anything else is a ConfigError that names the flag."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(ok(v) for v in values):
        raise ConfigError(f"{flag} must be comma-separated {rule}, got {text!r}")
    return values


def check_flag(flag: str, ok: bool, rule: str, value) -> None:
    if not ok:
        raise ConfigError(f"{flag} must be {rule}, got {value}")


def preflight(cfg: Config, task: str = "sft") -> str | None:
    """Fail fast, before any rank starts: model config, tokenizer with a chat template, the checkpoint to resume
    (intact, same architecture, a LoRA one on its base), readable data and eval set. Returns why there is nothing
    to do, if so."""
    from dataclasses import asdict

    from .checkpoint import check_arch, check_base, find_resume, read_marker
    from .data import open_sources, require_chat_template
    from .load import base_fingerprint
    from .model import load_hf_config
    from .train import run_tokenizer
    hf_config = load_hf_config(cfg.model.path, cfg.model.trust_remote_code)
    resume = find_resume(Path(cfg.output_dir), cfg.checkpoint.resume, cfg.checkpoint.resume_from, report=False)
    require_chat_template(run_tokenizer(cfg, resume)[0], f"model {cfg.model.path}")
    if resume is not None:
        check_arch(resume, hf_config)
        lora = read_marker(resume).get("lora")
        # the LoRA base now, not after loading it (a hub id: by the ranks, once downloaded)
        if lora and cfg.lora.rank and "base_fingerprint" in lora and Path(cfg.model.path).is_dir():
            check_base(resume, lora, base_fingerprint(cfg.model.path), cfg.model.path)
    dc = cfg.data
    sources = open_sources([asdict(s) for s in dc.sources] or dc.path, fmt=dc.format, split=dc.split,
                           name=dc.name or None, streaming=dc.streaming)
    sources += open_sources(cfg.eval.path) if cfg.eval.path else []  # checked now, not when training ends
    for src in sources:  # sft trains (and evaluates) conversations, dpo preference pairs
        if (src.fmt == "pairs") != (task == "dpo"):
            raise ConfigError(f"{src.spec['path']}: " + ("preference pairs (columns 'chosen' and 'rejected'): train "
                              "them with `finetune dpo`" if task == "sft" else "`finetune dpo` needs preference "
                              "pairs: columns 'chosen' and 'rejected' (and optionally 'prompt')"))
    if task == "dpo":
        from .ext.dpo import reference_kind
        reference_kind(cfg)
    step = read_marker(resume)["step"] if resume is not None else 0
    if step >= cfg.train.max_steps:
        return (f"nothing to do: checkpoint {resume} is at step {step} and train.max_steps is "
                f"{cfg.train.max_steps}; raise train.max_steps to train on")
    return None


DPO_PRESET = DEFAULT_PRESET.parent / "tiny_dpo.toml"  # `finetune dpo`'s embedded default


def train_command(task: str):
    """The `sft` or `dpo` command: the same flags, presets, output dir, lock and launch; train.train(cfg, task)."""
    def command(overrides: Optional[List[str]] = OVERRIDES, config: Optional[Path] = CONFIG,
                model: Optional[str] = MODEL, dataset: Optional[str] = DATASET, output_dir: Optional[str] = OUTPUT,
                nproc_per_node: int = NPROC,
                nnodes: int = typer.Option(1, "--nnodes", help="nodes, each running this command (one launcher per "
                                           "node)"),
                rdzv_endpoint: str = typer.Option("", "--rdzv-endpoint", help="host:port where the nodes' launchers "
                                                  "meet (c10d rendezvous; on the first node); needed with --nnodes "
                                                  "> 1"),
                no_resume: bool = typer.Option(False, "--no-resume", help="start fresh even if checkpoints exist "
                                               "(they are kept beside, as checkpoints.N)"),
                resume_from: Optional[str] = typer.Option(None, "--resume-from", help="resume from this checkpoint "
                                                          "dir"),
                debug: bool = DEBUG):
        def prepare():
            check_flag("--nproc-per-node", nproc_per_node >= 1, ">= 1", nproc_per_node)  # before the lock (dir)
            check_flag("--nnodes", nnodes >= 1, ">= 1", nnodes)
            check_flag("--rdzv-endpoint", nnodes == 1 or ":" in rdzv_endpoint, "host:port with --nnodes > 1",
                       repr(rdzv_endpoint))
            cfg = build_config(config or (DPO_PRESET if task == "dpo" else None), overrides,
                               **{"model.path": model, "data.path": dataset, "output_dir": output_dir,
                                  "checkpoint.resume_from": resume_from})
            if no_resume:
                cfg.checkpoint.resume = False
            num_ranks = int(os.environ.get("WORLD_SIZE", nnodes * nproc_per_node))
            check_parallel(cfg.parallel.dp_replicate, cfg.parallel.dp_shard, num_ranks, cfg.parallel.cp)  # each rank
            lock = Path(cfg.output_dir) / RUN_LOCK
            if "RANK" in os.environ and os.environ.get("FINETUNE_LOCK") == str(lock.resolve()):
                return cfg, None, lock  # a rank our launcher started: it checked all this and holds the lock
            check_writable(Path(cfg.output_dir), f"output_dir {cfg.output_dir}")
            if os.environ.get("RANK", "0") == "0":  # at once: loading a big model or dataset takes a while
                print(f"{task}: loading {cfg.model.path} and {cfg.data.path} -> {cfg.output_dir}", flush=True)
            # the node launchers of a multi-node run share the output dir: there global rank 0 takes the lock
            locks = nnodes == 1 or "RANK" in os.environ
            # at once if another run may own it (exit 2); no new dir before preflight
            if locks and lock.parent.is_dir():
                hold_run_lock(lock, f"output dir {cfg.output_dir}")
            try:
                nothing_to_do = preflight(cfg, task)
            except BaseException:
                release_lock(lock)
                raise
            if locks:
                hold_run_lock(lock, f"output dir {cfg.output_dir}")
            return cfg, nothing_to_do, lock
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
            release_lock(lock)
    command.__doc__ = {"sft": "Supervised fine-tuning (with no arguments: the embedded tiny model on the bundled chat "
                              "data, on CPU).",
                       "dpo": "Preference tuning, DPO or SimPO (dpo.*), on sft's loop (with no arguments: the "
                              "embedded tiny model on the bundled preference pairs, on CPU)."}[task]
    return command


app.command("sft")(train_command("sft"))
app.command("dpo")(train_command("dpo"))
SPLIT_WHY = {"history": "the full conversation renders this turn differently",
             "context": "the full conversation renders what precedes it differently"}


@app.command("preview-data")
def preview_data(overrides: Optional[List[str]] = OVERRIDES, config: Optional[Path] = CONFIG,
                 model: Optional[str] = MODEL, dataset: Optional[str] = DATASET,
                 num: int = typer.Option(3, "--num", "-n", help="samples to show"),
                 json_out: bool = typer.Option(False, "--json", help='one {"input_ids", "labels"} object per line'),
                 debug: bool = DEBUG):
    """Show the first samples in dataset order as the trainer sees them: text with trained tokens highlighted."""
    def run():
        import json
        from .data import format_preview
        from .train import build_run_samples, run_tokenizer
        cfg = build_config(config, overrides, **{"model.path": model, "data.path": dataset})
        check_flag("--num", num >= 1, ">= 1", num)
        tok, _ = run_tokenizer(cfg)
        samples = build_run_samples(cfg, tok, shuffle=False, epoch_limit=1)
        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        for i, sample in zip(range(num), samples):
            if json_out:
                print(json.dumps({"input_ids": list(sample["input_ids"]), "labels": list(sample["labels"])}))
                continue
            where = "; ".join((f"source {s['source']} " if len(cfg.data.sources) > 1 else "")
                              + f"row {s['row']} turns {','.join(map(str, s['turns']))}"
                              + (f" (own sample: {SPLIT_WHY[s['split']]})" if s["split"] else "")
                              for s in sample["sources"])
            untrained = "".join(f"\n    left untrained: {x.split(' ', 1)[1]} ({x.split(' ', 1)[0]})"
                                for s in sample["sources"] for x in s["left_out"])
            print(f"--- sample {i}: {where}{untrained}\n{format_preview(tok, sample, color=color)}")
        if not json_out:  # streamed data is counted as it is read: the summary covers the rows read so far
            print("\n".join(f"--- {line}" for line in samples.summary()))
    guarded(run, debug)


@app.command("prepare-checkpoint")
def prepare_checkpoint(overrides: Optional[List[str]] = OVERRIDES, model: Optional[str] = MODEL,
                       output_dir: Optional[str] = typer.Option(None, "--output-dir", "-o", help="the prepared "
                                                                "checkpoint dir to write (replaces an earlier one)"),
                       nproc_per_node: int = NPROC, debug: bool = DEBUG):
    """Load, cast to fp32 and shard a HF model once; save it as a DCP checkpoint that later runs load in seconds."""
    def prepare():
        check_flag("--nproc-per-node", nproc_per_node >= 1, ">= 1", nproc_per_node)
        if not model or not output_dir:
            raise ConfigError("prepare-checkpoint needs --model ID|DIR and --output-dir DIR")
        cfg = build_config(None, overrides, **{"model.path": model, "output_dir": output_dir})
        out = Path(cfg.output_dir).resolve()
        check_writable(out.parent, f"--output-dir {out} (written beside it, then renamed)")
        from .model import load_generation_config, load_hf_config, load_tokenizer
        from .prepare import check_prepare_target
        check_prepare_target(Path(cfg.output_dir), cfg.model.path)
        hf_config = load_hf_config(cfg.model.path, cfg.model.trust_remote_code)  # bad input fails here, before
        load_tokenizer(cfg.model.path, cfg.model.trust_remote_code)  # any rank starts
        load_generation_config(cfg.model.path, hf_config)
        lock = out.parent / f".{out.name}.lock"  # beside it: `out` is replaced
        hold_run_lock(lock, f"--output-dir {out}")
        return cfg, lock
    cfg, lock = guarded(prepare, debug)
    from .prepare import prepare_checkpoint as run_prepare
    try:
        launch(run_prepare, (cfg.model.path, cfg.output_dir, cfg.model.trust_remote_code,
                             cfg.model.attn_implementation), nproc_per_node, debug)
    finally:
        release_lock(lock)


@app.command("export-hf")
def export_hf(checkpoint: Optional[str] = typer.Option(None, "--checkpoint",
                                                       help="output dir, step dir or prepared dir"),
              output_dir: Optional[str] = typer.Option(None, "--output-dir", "-o", help="the Hugging Face model "
                                                       "dir to write (replaces an earlier export)"),
              dtype: str = typer.Option("bfloat16", "--dtype",
                                        help="dtype of the exported weights: bfloat16 | float32"),
              max_shard_size: str = typer.Option("5GB", "--max-shard-size",
                                                 help="largest safetensors file (5GB, 500MB)"),
              verify: bool = typer.Option(True, "--verify/--no-verify",
                                          help="read every tensor back and compare logits streamed block by block "
                                               "from the files (never holds the model)"),
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
    launch(export, (checkpoint, output_dir, dtype, max_shard_size, verify, adapter), nproc_per_node, debug)


@app.command()
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
        from .ext.bench import run_bench
        from .model import load_hf_config
        ratios = parse_list(sac_ratios, "--sac-ratios", float, lambda r: 0 <= r <= 1, "numbers in [0, 1]")
        accums = parse_list(grad_accum, "--grad-accum", int, lambda a: a > 0, "integers > 0") if grad_accum else None
        fp8s = parse_list(fp8, "--fp8", str.strip, lambda f: f in ("off", "tensorwise", "rowwise"),
                          "off, tensorwise or rowwise") if fp8 else None
        check_flag("--steps", steps > 0, "> 0", steps)
        check_flag("--warmup", warmup >= 0, ">= 0", warmup)
        check_flag("--memory-budget", memory_budget is None or memory_budget > 0, "> 0 (MB)", memory_budget)
        check_flag("--nproc-per-node", nproc_per_node >= 1, ">= 1", nproc_per_node)
        cfg = build_config(config, overrides, **{"model.path": model, "data.path": dataset})
        load_hf_config(cfg.model.path, cfg.model.trust_remote_code)  # a bad model path fails here, not per point
        set_threads(nproc_per_node)
        run_bench(cfg, ratios, accums, steps, warmup, Path(output_dir), memory_budget, nproc_per_node, fp8s)
    guarded(run, debug)


@app.command()
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
        from .ext.plan import format_plan, format_seq_search, load_arch, parse_gpu_memory, run_plan, run_seq_search
        ratios = parse_list(sac_ratios, "--sac-ratios", float, lambda r: 0 <= r <= 1, "numbers in [0, 1]")
        mbs = parse_list(micro_batch_sizes, "--micro-batch-sizes", int, lambda m: m > 0, "integers > 0")
        check_flag("--nnodes", nnodes >= 1, ">= 1", nnodes)
        check_flag("--nproc-per-node", nproc_per_node >= 1, ">= 1", nproc_per_node)
        gpu_bytes = parse_gpu_memory(gpu_memory)
        cfg = build_config(config, overrides, check=False, **{"model.path": model, "data.path": "-"})
        with contextlib.redirect_stdout(sys.stderr):  # notes of the model build (once per ratio) stay off the table
            result = run_seq_search(cfg, load_arch(cfg, model), nnodes, nproc_per_node, gpu_bytes, ratios) \
                if max_seq_len else run_plan(cfg, load_arch(cfg, model), nnodes, nproc_per_node, gpu_bytes, ratios, mbs)
        print(json.dumps(result, indent=2) if json_out else (format_seq_search if max_seq_len else format_plan)(result))
        return result["best"] is not None
    if not guarded(run, debug):
        raise SystemExit(1)


def interrupted(signum, frame) -> NoReturn:
    """Ctrl-C before training started (then checkpoint.SignalFlag takes over: save and stop) or during an export."""
    print("finetune: interrupted; nothing was saved", file=sys.stderr, flush=True)
    raise SystemExit(130)


def main():
    # our progress bar and log lines only: no per-load bars from transformers/datasets
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGINT, interrupted)
    app()


if __name__ == "__main__":
    main()
