"""`finetune sft` against its peers on variable-length chat data, and its fixed-shape overhead against a bare loop.

Peers (each run a fresh process; runs alternate system by system, round after round; CPU, fp32, sdpa):
  finetune defaults   `finetune sft --model M --dataset D` with no data flags (packing is on by default)
  finetune unpacked   the same with data.packing=false (each micro-batch pads to its longest sample)
  HF Trainer          transformers' Trainer, its usual padding (DataCollatorForSeq2Seq: to the longest of the batch)
  TRL SFTTrainer      packing=True (its default "bfd" strategy, padding-free), run with `uv run --with trl`
All get the same samples (finetune's tokenization and labels, 1,024-token cap), model (a random ~21M-parameter
Llama with a 32k vocabulary, written offline), AdamW settings, grad clipping, and about 4k real tokens per optimizer
step (4 packed rows of 1,024, or 14 unpadded samples). The figure is real (non-pad) tokens per second over the timed
steps: sum of real tokens / sum of step times, medians over rounds. A few timed steps of padded batches are luck
(one 1,024-token sample pads its whole batch of 14), so the table also gives computed (padded) tokens/s and the real
tokens/s to expect over an epoch: computed tokens/s x real / computed tokens of the whole epoch's batches.

Overhead: `finetune sft` with fixed shapes (packed rows padded to data.max_seq_len: data.pad_to_max) against a bare
PyTorch loop (forward, backward, clip, AdamW) on the same model and the same batches; median step times.

    uv run python benchmarks/compare_peers.py                      # both tables, ~30 min on 2 CPU cores
    uv run python benchmarks/compare_peers.py --only overhead --rounds 3
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TINY = REPO / "examples" / "tiny-llama"  # its chat tokenizer; the model's vocabulary is 32k all the same


def machine() -> str:
    import psutil
    import torch
    import transformers
    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), platform.processor())
    gpu = f"GPU {torch.cuda.get_device_name(0)} (not used)" if torch.cuda.is_available() else "no GPU"
    return (f"CPU {cpu}, {psutil.cpu_count(logical=False)} physical / {psutil.cpu_count()} logical cores visible; "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM; {gpu}; Linux {platform.release()}; torch "
            f"{torch.__version__}, transformers {transformers.__version__}; load average at start "
            f"{os.getloadavg()[0]:.1f}")


def make_inputs(root: Path, num_rows: int, seed: int = 0) -> tuple[Path, Path]:
    """A random ~21M Llama (hidden 256, 6 layers, vocab 32,000, untied) with the tiny model's chat tokenizer, and
    `num_rows` chat rows whose lengths are lognormal (median ~225 tokens, mean ~280, capped by max_seq_len)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    model_dir, data = root / "llama-21m", root / "chat.jsonl"
    if model_dir.exists() and data.exists():
        return model_dir, data
    tok = AutoTokenizer.from_pretrained(TINY)
    config = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=768, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    words = sorted({w for line in (TINY.parent / "data" / "tiny_chat.jsonl").read_text().splitlines()
                    for m in json.loads(line)["messages"] for w in m["content"].split()})
    rng = random.Random(seed)
    sample = " ".join(rng.choice(words) for _ in range(2000))
    per_word = len(tok(sample, add_special_tokens=False)["input_ids"]) / 2000
    rows = []
    for _ in range(num_rows):
        target = rng.lognormvariate(math.log(228), 0.7)  # tokens of the whole sample, template included
        question = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        n = max(1, int((target - 12) / per_word) - len(question.split()))
        answer = " ".join(rng.choice(words) for _ in range(n))
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model_dir, data


# ----------------------------------------------------------------------------------------------- the systems


def run_finetune(job: dict, env: dict, extra: list[str]) -> tuple[list[float], list[float], list[float]]:
    """One `finetune sft` process: (real tokens, computed tokens, seconds) of each step, from its metrics.jsonl."""
    out = Path(job["out"])
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time (an earlier one's checkpoint would be resumed)
    cmd = [sys.executable, "-m", "finetune", "sft", "--model", job["model"], "--dataset", job["data"],
           "--output-dir", str(out), "--no-resume", f"data.max_seq_len={job['seq_len']}",
           f"train.max_steps={job['steps']}", "eval.path=", "log.progress=false", f"train.log_interval={job['steps']}",
           "train.warmup_steps=0", *extra]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    real = [r["tokens_per_s"] * r["step_time_s"] for r in recs]
    return real, [x / (1 - r["padding_fraction"]) for x, r in zip(real, recs)], [r["step_time_s"] for r in recs]


def hf_samples(job: dict) -> list[dict]:
    """finetune's samples (labels included), unpacked, in file order: what every peer trains on."""
    from finetune.data import build_samples
    from finetune.model import load_tokenizer
    stream = build_samples(job["data"], load_tokenizer(job["model"]), max_seq_len=job["seq_len"], shuffle=False,
                           epoch_limit=1)
    return [{"input_ids": list(s["input_ids"]), "labels": list(s["labels"])} for s in stream]


def peer_worker(job: dict) -> None:
    """HF Trainer or TRL SFTTrainer in this (fresh) process; writes (real tokens, computed tokens, seconds) per step
    to job["result"]."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    tok = AutoTokenizer.from_pretrained(job["model"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32, attn_implementation="sdpa")
    rows = datasets.Dataset.from_list(hf_samples(job))
    times, tokens, computed, last = [], [], [], [None]

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if last[0] is None:
                last[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            times.append(now - last[0])
            last[0] = now

    def counted(collate):  # real and computed tokens of each batch (grad accumulation 1: one batch per step)
        def run(features):
            batch = collate(features)
            mask = batch.get("attention_mask")
            tokens.append(int(mask.sum()) if mask is not None else batch["input_ids"].numel())
            computed.append(batch["input_ids"].numel())  # TRL's padding-free packing: one row, no padding
            return batch
        return run

    common = dict(output_dir=job["out"], max_steps=job["steps"], gradient_accumulation_steps=1, learning_rate=3e-3,
                  weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0,
                  lr_scheduler_type="constant", optim="adamw_torch", use_cpu=True, report_to="none",
                  save_strategy="no", logging_steps=10**6, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    if job["system"] == "trl":
        from trl import SFTConfig, SFTTrainer
        args = SFTConfig(**common, per_device_train_batch_size=job["rows"], packing=True, max_length=job["seq_len"])
        trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tok, callbacks=[StepTimer()])
    else:
        from transformers import DataCollatorForSeq2Seq, Trainer, TrainingArguments
        args = TrainingArguments(**common, per_device_train_batch_size=job["samples"], remove_unused_columns=False)
        trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[StepTimer()],
                          data_collator=DataCollatorForSeq2Seq(tok, padding=True))
    trainer.data_collator = counted(trainer.data_collator)
    trainer.train()
    Path(job["result"]).write_text(json.dumps([tokens[:len(times)], computed[:len(times)], times]))


def run_peer(job: dict, env: dict, launcher: list[str]) -> tuple[list[float], list[float], list[float]]:
    Path(job["out"]).mkdir(parents=True, exist_ok=True)
    job = {**job, "result": str(Path(job["out"]) / "steps.json")}
    subprocess.run([*launcher, __file__, "--worker", json.dumps(job)], cwd=REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return tuple(json.loads(Path(job["result"]).read_text()))


def bare_worker(job: dict) -> None:
    """The floor: forward, backward, clip, AdamW on the batches finetune computes with data.pad_to_max (packed rows
    padded to seq_len, the same sample order), same model and optimizer settings; step times to job["result"]."""
    import torch
    from transformers import AutoModelForCausalLM
    from finetune.data import build_samples, pad_collate
    from finetune.model import load_tokenizer
    torch.manual_seed(0)
    tok = load_tokenizer(job["model"])
    samples = iter(build_samples(job["data"], tok, max_seq_len=job["seq_len"], packing=True, seed=0))
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01,
                            foreach=True)  # as finetune's on CPU (torch's CPU default is a loop over the params)
    times = []
    for _ in range(job["steps"]):
        t0 = time.perf_counter()
        batch = pad_collate([next(samples) for _ in range(job["rows"])], tok.pad_token_id, pad_to=job["seq_len"])
        model(**batch, use_cache=False).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    Path(job["result"]).write_text(json.dumps(times))


# ----------------------------------------------------------------------------------------------- main


def epoch_efficiency(base: dict) -> dict:
    """Real / computed tokens of each system's batching over a whole epoch (a few timed steps of padded batches
    are luck: one 1,024-token sample pads its whole batch). The Trainer's random batches of 14 have the expectation
    of finetune's unpacked ones; TRL's padding-free rows compute no padding."""
    from finetune.data import batch_efficiency, build_samples
    from finetune.model import load_tokenizer
    tok = load_tokenizer(base["model"])
    units = {p: build_samples(base["data"], tok, max_seq_len=base["seq_len"], packing=p).unit_lengths()
             for p in (True, False)}
    padded = batch_efficiency(units[False], base["samples"], 1)
    return {"finetune defaults (packed)": batch_efficiency(units[True], base["rows"], 1),
            "finetune unpacked": padded, "HF Trainer (padding)": padded, "TRL SFTTrainer (packing)": 1.0}


def summary(runs: list[dict], warmup: int, efficiency: dict) -> dict:
    """Per system: real and computed tokens/s of each run over its timed steps, their medians and range, and the
    real tokens/s expected over a whole epoch (computed tokens/s x the epoch's real / computed tokens)."""
    by = {}
    for r in runs:
        toks, computed, secs = r["tokens"][warmup:], r["computed"][warmup:], r["seconds"][warmup:]
        r["tokens_per_s"], r["computed_per_s"] = sum(toks) / sum(secs), sum(computed) / sum(secs)
        r["real_tokens_per_step"] = sum(toks) / len(toks)
        by.setdefault(r["system"], []).append(r)
    out = {}
    for s, rs in by.items():
        computed = statistics.median(x["computed_per_s"] for x in rs)
        out[s] = {"median": statistics.median(x["tokens_per_s"] for x in rs),
                  "min": min(x["tokens_per_s"] for x in rs), "max": max(x["tokens_per_s"] for x in rs),
                  "real_tokens_per_step": statistics.median(x["real_tokens_per_step"] for x in rs),
                  "runs": [round(x["tokens_per_s"]) for x in rs], "computed_per_s": computed,
                  "epoch_efficiency": efficiency[s], "expected": computed * efficiency[s]}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["peers", "overhead"], help="one table only")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (each system once per round)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per run (peers)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--overhead-steps", type=int, default=8, help="timed steps per overhead run")
    p.add_argument("--rows", type=int, default=4000, help="chat rows to generate (3,000 are read)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for every process")
    p.add_argument("--output-dir", default="outputs/compare_peers")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        return bare_worker(job) if job["system"] == "bare" else peer_worker(job)

    root = Path(args.output_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    model, data = make_inputs(root, 3000)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "PYTHONWARNINGS": "ignore"}
    base = {"model": str(model), "data": str(data), "seq_len": 1024, "rows": 4, "samples": 14}
    trl = ["uv", "run", "--with", "trl", "python"]
    peers = {
        "finetune defaults (packed)": lambda j: run_finetune(j, env, ["train.micro_batch_size=4"]),
        "finetune unpacked": lambda j: run_finetune(j, env, ["train.micro_batch_size=14", "data.packing=false"]),
        "HF Trainer (padding)": lambda j: run_peer({**j, "system": "hf"}, env, [sys.executable]),
        "TRL SFTTrainer (packing)": lambda j: run_peer({**j, "system": "trl"}, env, trl),
    }
    seq, rows = 512, 4  # overhead: 4 rows of 512, fixed shapes
    overhead = {
        "finetune sft (pad_to_max)": lambda j: run_finetune({**j, "seq_len": seq}, env, [
            f"train.micro_batch_size={rows}", "data.pad_to_max=true"])[2],
        "bare PyTorch loop": lambda j: bare_times(j, env, seq, rows),
    }
    where = machine()
    print(f"machine: {where}", flush=True)
    result = {"machine": where, "args": vars(args)}
    if args.only != "overhead":
        runs = []
        for r in range(args.rounds):
            for name, fn in peers.items():
                t0 = time.perf_counter()
                toks, computed, secs = fn({**base, "out": str(root / f"{name.split()[0]}-{len(runs)}"),
                                           "steps": args.warmup + args.steps})
                runs.append({"system": name, "round": r, "tokens": toks, "computed": computed, "seconds": secs,
                             "wall_s": time.perf_counter() - t0})
                t = sum(toks[args.warmup:]) / sum(secs[args.warmup:])
                print(f"round {r} {name}: {t:,.0f} real tokens/s, {statistics.median(secs):.2f} s/step, "
                      f"wall {runs[-1]['wall_s']:.0f} s", flush=True)
        result["peers"] = {"runs": runs, "summary": summary(runs, args.warmup, epoch_efficiency(base))}
    if args.only != "peers":
        runs = []
        for r in range(args.rounds):
            for name, fn in overhead.items():
                secs = fn({**base, "out": str(root / f"overhead-{len(runs)}"),
                           "steps": args.warmup + args.overhead_steps})
                runs.append({"system": name, "round": r, "seconds": secs,
                             "median_s": statistics.median(secs[args.warmup:])})
                print(f"round {r} {name}: median step {runs[-1]['median_s']:.3f} s", flush=True)
        result["overhead"] = {"runs": runs, "rows": rows, "seq_len": seq}
    (root / "compare_peers.json").write_text(json.dumps(result, indent=1))
    print("\n" + "\n".join(tables(result)))


def bare_times(job: dict, env: dict, seq: int, rows: int) -> list[float]:
    job = {**job, "system": "bare", "seq_len": seq, "rows": rows, "result": str(Path(job["out"]) / "steps.json")}
    Path(job["out"]).mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], cwd=REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return json.loads(Path(job["result"]).read_text())


def tables(result: dict) -> list[str]:
    lines = [f"Machine: {result['machine']}."]
    if "peers" in result:
        s = result["peers"]["summary"]
        hf, trl = s["HF Trainer (padding)"], s["TRL SFTTrainer (packing)"]
        lines += ["", "| system | real tokens/s: median (runs) | real tokens/step | vs HF, TRL | computed tokens/s "
                      "| real/computed, epoch | expected real tokens/s | vs HF, TRL |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for name, x in s.items():
            lines.append(f"| {name} | {x['median']:,.0f} ({', '.join(f'{v:,}' for v in x['runs'])}) | "
                         f"{x['real_tokens_per_step']:,.0f} | {x['median'] / hf['median']:.2f}x, "
                         f"{x['median'] / trl['median']:.2f}x | {x['computed_per_s']:,.0f} | "
                         f"{x['epoch_efficiency']:.1%} | {x['expected']:,.0f} | {x['expected'] / hf['expected']:.2f}x, "
                         f"{x['expected'] / trl['expected']:.2f}x |")
    if "overhead" in result:
        o = result["overhead"]
        med = {}
        for r in o["runs"]:
            med.setdefault(r["system"], []).append(r["median_s"])
        bare = statistics.median(med["bare PyTorch loop"])
        lines += ["", f"Fixed shapes: {o['rows']} rows x {o['seq_len']} tokens per step.", "",
                  "| system | median step (s) | runs (s) | vs bare loop |", "|---|---:|---|---:|"]
        for name, xs in med.items():
            m = statistics.median(xs)
            lines.append(f"| {name} | {m:.3f} | {', '.join(f'{x:.3f}' for x in xs)} | {m / bare - 1:+.1%} |")
    return lines


if __name__ == "__main__":
    main()
