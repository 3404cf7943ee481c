"""`finetune sft` vs the Hugging Face Trainer: the same model, samples, batch, sequence length, precision, optimizer
and grad clipping; runs alternate (finetune, Trainer, finetune, Trainer, ...) in fresh processes and the
tokens/s ratio is reported with the machine named.

Both see fixed shapes (every batch padded to data.max_seq_len), so tokens/s = batch * seq_len / median step time
after warm-up. finetune's step time is its own `step_time_s` (collate -> forward/backward -> clip -> AdamW step);
the Trainer's is the time between consecutive `on_step_end` callbacks (its batch fetch and collate included).

    uv run python benchmarks/compare_hf_trainer.py                  # tiny default model, CPU, a few minutes
    uv run python benchmarks/compare_hf_trainer.py --model DIR --dataset FILE --steps 50 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def machine() -> str:
    import psutil
    import torch
    import transformers
    if torch.cuda.is_available():
        dev = f"{torch.cuda.get_device_name(0)} (CUDA)"
    else:
        cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                    if x.startswith("model name")), platform.processor())
        dev = f"CPU {cpu}, {psutil.cpu_count(logical=False)} physical / {psutil.cpu_count()} logical cores visible"
    gpu = "no GPU; " * (not torch.cuda.is_available())
    return (f"{dev}; {psutil.virtual_memory().total / 2**30:.0f} GiB RAM; {gpu}"
            f"Linux {platform.release()}; torch {torch.__version__}, transformers {transformers.__version__}; "
            f"load average at start {os.getloadavg()[0]:.1f}")


def run_finetune(cfg, args, out: Path, env: dict) -> list[float]:
    """One `finetune sft` run in its own process; its per-step times from metrics.jsonl."""
    cmd = [sys.executable, "-m", "finetune", "sft", "--config", args.config, "--model", cfg.model.path,
           "--dataset", cfg.data.path, "--output-dir", str(out), "--no-resume",
           f"train.max_steps={args.warmup + args.steps}", f"train.micro_batch_size={cfg.train.micro_batch_size}",
           "train.grad_accum_steps=1", f"data.max_seq_len={cfg.data.max_seq_len}", "data.pad_to_max=true",
           f"train.mixed_precision={cfg.train.mixed_precision}", "ac.ratio=0", "eval.path=", "log.progress=false",
           f"train.log_interval={args.warmup + args.steps}"]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(x)["step_time_s"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def trainer_worker(job: dict) -> None:
    """One Trainer run (in a fresh process): finetune's samples and collate, HF's loop; step times to a file."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments
    from transformers.utils import logging as hf_logging
    from finetune.data import build_samples, pad_collate
    from finetune.model import load_tokenizer
    hf_logging.disable_progress_bar()
    cfg = job["cfg"]
    tok = load_tokenizer(cfg["model"])
    n = cfg["micro_batch_size"] * job["num_steps"]
    stream = iter(build_samples(cfg["data"], tok, max_seq_len=cfg["seq_len"], seed=cfg["seed"]))
    samples = [{"input_ids": s["input_ids"], "labels": s["labels"]} for s in (next(stream) for _ in range(n))]
    bf16 = cfg["mixed_precision"] == "bf16"
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32, attn_implementation="sdpa")
    times, last = [], [None]

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if last[0] is None:  # the first step: start at its first micro-batch
                last[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            now = time.perf_counter()
            times.append(now - last[0])
            last[0] = now

    targs = TrainingArguments(output_dir=job["out"], max_steps=job["num_steps"],
                              per_device_train_batch_size=cfg["micro_batch_size"], gradient_accumulation_steps=1,
                              learning_rate=cfg["lr"], weight_decay=cfg["weight_decay"], adam_beta1=cfg["beta1"],
                              adam_beta2=cfg["beta2"], adam_epsilon=cfg["eps"], max_grad_norm=cfg["max_grad_norm"],
                              lr_scheduler_type="cosine", warmup_steps=0, optim="adamw_torch", bf16=bf16,
                              use_cpu=not torch.cuda.is_available(), report_to="none", save_strategy="no",
                              logging_steps=10**6, disable_tqdm=True, dataloader_num_workers=0,
                              remove_unused_columns=False, seed=cfg["seed"])
    trainer = Trainer(model=model, args=targs, train_dataset=samples, callbacks=[StepTimer()],
                      data_collator=lambda b: pad_collate(b, tok.pad_token_id, pad_to=cfg["seq_len"]))
    trainer.train()
    Path(job["result"]).write_text(json.dumps(times))


def run_trainer(cfg, args, out: Path, env: dict) -> list[float]:
    t = cfg.train
    job = {"out": str(out), "num_steps": args.warmup + args.steps, "result": str(out / "step_times.json"),
           "cfg": {"model": cfg.model.path, "data": cfg.data.path, "seq_len": cfg.data.max_seq_len, "seed": t.seed,
                   "micro_batch_size": t.micro_batch_size, "mixed_precision": t.mixed_precision, "lr": t.lr,
                   "weight_decay": t.weight_decay, "beta1": t.beta1, "beta2": t.beta2, "eps": t.eps,
                   "max_grad_norm": t.max_grad_norm}}
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, __file__, "--trainer-worker", json.dumps(job)], cwd=REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return json.loads((out / "step_times.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "tiny.toml"), help="finetune preset (model, data, batch)")
    p.add_argument("--model", help="override model.path")
    p.add_argument("--dataset", help="override data.path")
    p.add_argument("--micro-batch-size", type=int, help="override train.micro_batch_size")
    p.add_argument("--seq-len", type=int, help="override data.max_seq_len")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=2, help="finetune/Trainer pairs, alternating")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for both (CPU)")
    p.add_argument("--output-dir", default="outputs/compare_hf_trainer")
    p.add_argument("--trainer-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trainer_worker:
        return trainer_worker(json.loads(args.trainer_worker))

    from finetune.config import load_config
    overrides = {"model.path": args.model, "data.path": args.dataset, "data.max_seq_len": args.seq_len,
                 "train.micro_batch_size": args.micro_batch_size}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    cfg = load_config(args.config, overrides)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    out = Path(args.output_dir)
    where = machine()
    tokens_per_step = cfg.train.micro_batch_size * cfg.data.max_seq_len
    runs = []
    for r in range(args.rounds):
        for name, fn in (("finetune sft", run_finetune), ("HF Trainer", run_trainer)):
            start = time.perf_counter()
            times = fn(cfg, args, out / f"{name.split()[0].lower()}_{r}", env)
            wall = time.perf_counter() - start
            step = statistics.median(times[args.warmup:])
            runs.append({"system": name, "round": r, "median_step_s": step, "tokens_per_s": tokens_per_step / step,
                         "wall_s": wall, "step_times_s": times})
            print(f"round {r} {name}: {step:.4f} s/step, {tokens_per_step / step:,.0f} tokens/s, wall {wall:.0f} s",
                  flush=True)
    med = {s: statistics.median(x["tokens_per_s"] for x in runs if x["system"] == s)
           for s in ("finetune sft", "HF Trainer")}
    ratio = med["finetune sft"] / med["HF Trainer"]
    lines = [f"Machine: {where}.", "",
             f"Model `{cfg.model.path}`, data `{cfg.data.path}`; batch {cfg.train.micro_batch_size} x seq "
             f"{cfg.data.max_seq_len} (padded: {tokens_per_step} tokens/step), {cfg.train.mixed_precision}, AdamW, "
             f"clip {cfg.train.max_grad_norm}, no activation checkpointing, OMP_NUM_THREADS={args.threads}; "
             f"median of {args.steps} steps after {args.warmup} warm-up, {args.rounds} alternating rounds.", "",
             "| run | system | median step (s) | tokens/s | process wall (s) |", "|---|---|---:|---:|---:|"]
    lines += [f"| {i + 1} | {x['system']} | {x['median_step_s']:.4f} | {x['tokens_per_s']:,.0f} | {x['wall_s']:.0f} |"
              for i, x in enumerate(runs)]
    lines += ["", f"**finetune sft / HF Trainer tokens/s = {ratio:.2f}x** (medians over runs: "
                  f"{med['finetune sft']:,.0f} vs {med['HF Trainer']:,.0f} tokens/s)."]
    (out / "compare.json").write_text(json.dumps({"machine": where, "ratio": ratio, "runs": runs}, indent=2))
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
