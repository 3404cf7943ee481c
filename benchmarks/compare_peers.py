"""`finetune sft` against its peers on variable-length chat data, and its fixed-shape overhead against a bare loop.

Peers (each run a fresh process; runs alternate system by system, round after round):
  finetune defaults   `finetune sft --model M --dataset D` with no data flags (packing is on by default; on CUDA
                      model.attn_implementation/liger/compile "auto": torch's varlen attention, Liger's fused
                      loss, regional compile), bf16 compute on CUDA, fp32 on CPU
  finetune unpacked   (CPU) the same with data.packing=false (each micro-batch pads to its longest sample)
  finetune at DIR     (--baseline DIR) the defaults of another checkout (its own .venv), e.g. the commit before a
                      change: the same command, the same data and seed
  HF Trainer          transformers' Trainer at its fastest that fits: padding-free batches
                      (DataCollatorWithFlattening: the step's samples as one row, position_ids restart per sample),
                      no gradient checkpointing, Liger kernels and bf16 on CUDA (as finetune's defaults there)
  HF Trainer padded   (--systems hf_padded) its usual padding (DataCollatorForSeq2Seq: to the longest of the batch)
  TRL SFTTrainer      at its fastest that fits: packing=True (the "bfd" strategy, padding-free), gradient
                      checkpointing OFF (SFTConfig turns it on by default: every layer would be recomputed while
                      finetune's defaults recompute none), Liger kernels (use_liger_kernel=True) and bf16 on CUDA,
                      fp32 without Liger on CPU (as finetune there); on CUDA its attention (and the Trainer's) is
                      torch's varlen kernel (Flash or cuDNN), registered by kernels/varlen.py (flash-attn, which
                      TRL's docs name, has no wheel to install offline), sdpa on CPU. TRL is not a dependency of the
                      package: the dev group has it (python >= 3.11), else `uv run --with trl`; a wheel on the GPU
                      machine (benchmarks/gpu_check.sh wheels).
All get the same samples (finetune's tokenization and labels), model (random, written offline: CPU a ~21M Llama with
a 32k vocabulary, 1,024-token cap, lognormal one-turn rows; CUDA the 886M Llama of RESULTS.md, 8,192-token cap and
chat_data.py's realistic rows: 2 packed rows or 17 samples, ~16k real tokens a step), AdamW settings (fused on
CUDA), grad clipping, and about the same real tokens per optimizer step (packed rows, or padded samples). The figure
is real (non-pad) tokens per second over the timed steps: sum of real tokens / sum of step times, medians over
rounds; MFU from it on CUDA, by both counts of run/mfu (MFU_CONVENTION, T = sum(s^2)/sum(s) of the samples, and
MFU_RAN, lm_head at the label tokens only); peak memory (CUDA: max allocated; CPU: peak RSS). A few timed steps of
padded batches are luck (one long sample pads its whole batch), so the table also gives computed (padded) tokens/s
and the real tokens/s to expect over an epoch: computed tokens/s x real / computed tokens of the whole epoch's
batches.

Overhead (CPU): `finetune sft` with fixed shapes (packed rows padded to data.max_seq_len: data.pad_to_max) against a
bare PyTorch loop (forward, backward, clip, AdamW) on the same model and the same batches; median step times.

    uv run python benchmarks/compare_peers.py                      # both tables, ~30 min on 2 CPU cores
    uv run python benchmarks/compare_peers.py --only overhead --rounds 3
    uv run python benchmarks/compare_peers.py --only peers --systems defaults,baseline --baseline /tmp/base
    python3 benchmarks/compare_peers.py --only peers --rounds 1 --append    # CUDA: one round per call
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
sys.path.insert(0, str(REPO / "benchmarks"))
TINY = REPO / "examples" / "tiny-llama"  # its chat tokenizer; the model's vocabulary is 32k all the same

# per device: the model written offline, the data's lengths, rows of packed systems / samples of padded ones a step
PROFILES = {
    "cpu": dict(name="llama-21m", hidden=256, intermediate=768, layers=6, heads=4, kv_heads=4, seq_len=1024,
                median=228, sigma=0.7, rows=4, samples=14, num_rows=3000, dtype="fp32"),
    "cuda": dict(name="llama-886m", hidden=2048, intermediate=5632, layers=16, heads=32, kv_heads=16, seq_len=8192,
                 median=900, sigma=1.0, rows=2, samples=17, num_rows=2000, dtype="bf16", realistic=True),
}


def machine() -> str:
    import psutil
    import torch
    import transformers
    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), platform.processor())
    gpu = f"GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "no GPU"
    return (f"CPU {cpu}, {psutil.cpu_count(logical=False)} physical / {psutil.cpu_count()} logical cores visible; "
            f"{psutil.virtual_memory().total / 2**30:.0f} GiB RAM; {gpu}; Linux {platform.release()}; torch "
            f"{torch.__version__}, transformers {transformers.__version__}; load average at start "
            f"{os.getloadavg()[0]:.1f}")


def make_inputs(root: Path, profile: dict, seed: int = 0) -> tuple[Path, Path]:
    """A random Llama of the profile (vocab 32,000, untied) with the tiny model's chat tokenizer, and chat rows whose
    lengths are lognormal (the profile's median and sigma, capped by its seq_len when tokenized)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    model_dir = root / profile["name"]
    data = root / (f"chat-realistic-{profile['seq_len']}.jsonl" if profile.get("realistic") else
                   f"chat-{profile['median']}.jsonl")
    if model_dir.exists() and data.exists():
        return model_dir, data
    tok = AutoTokenizer.from_pretrained(TINY)
    config = LlamaConfig(vocab_size=32000, hidden_size=profile["hidden"], intermediate_size=profile["intermediate"],
                         num_hidden_layers=profile["layers"], num_attention_heads=profile["heads"],
                         num_key_value_heads=profile["kv_heads"], max_position_embeddings=profile["seq_len"],
                         tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.bfloat16 if profile["dtype"] == "bf16" else torch.float32).save_pretrained(
        model_dir)
    tok.save_pretrained(model_dir)
    if profile.get("realistic"):  # chat_data.py's rows: several turns, median ~640 tokens, a tail into thousands
        from chat_data import write_rows
        write_rows(data, tok, profile["num_rows"], seed, profile["seq_len"])
    else:
        make_chat_data(data, tok, profile["num_rows"], profile["median"], profile["sigma"], seed)
    return model_dir, data


def make_chat_data(path: Path, tok, num_rows: int, median: float, sigma: float, seed: int = 0) -> Path:
    """`num_rows` chat rows (a user question, an assistant answer) of the tiny data's words, whose tokenized lengths
    (template included) are lognormal with this median and sigma."""
    words = sorted({w for line in (TINY.parent / "data" / "tiny_chat.jsonl").read_text().splitlines()
                    for m in json.loads(line)["messages"] for w in m["content"].split()})
    rng = random.Random(seed)
    sample = " ".join(rng.choice(words) for _ in range(2000))
    per_word = len(tok(sample, add_special_tokens=False)["input_ids"]) / 2000
    rows = []
    for _ in range(num_rows):
        target = rng.lognormvariate(math.log(median), sigma)
        question = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
        n = max(1, int((target - 12) / per_word) - len(question.split()))
        answer = " ".join(rng.choice(words) for _ in range(n))
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------------------------- the systems


def run_finetune(job: dict, env: dict, extra: list[str], checkout: Path = REPO) -> dict:
    """One `finetune sft` process (of `checkout`, with its own .venv when it has one): per step real tokens,
    computed tokens, seconds and loss, and the peak memory, from its metrics.jsonl."""
    out = Path(job["out"])
    shutil.rmtree(out, ignore_errors=True)  # a fresh run each time (an earlier one's checkpoint would be resumed)
    python = checkout / ".venv" / "bin" / "python" if checkout != REPO else Path(sys.executable)
    cmd = [str(python), "-m", "finetune", "sft", "--model", job["model"], "--dataset", job["data"],
           "--output-dir", str(out), "--no-resume", f"data.max_seq_len={job['seq_len']}",
           f"train.max_steps={job['steps']}", "eval.path=", "log.progress=false", f"train.log_interval={job['steps']}",
           "train.warmup_steps=0", f"train.mixed_precision={job['dtype']}",
           # the peers' optimizer: lr 3e-3 constant, weight decay 0.01 (finetune's defaults are 2e-5, cosine, 0)
           "train.lr=3e-3", "train.min_lr_ratio=1", "train.weight_decay=0.01", *extra]
    subprocess.run(cmd, cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL)
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    real = [r["tokens_per_s"] * r["step_time_s"] for r in recs]
    return {"tokens": real, "computed": [x / (1 - r["padding_fraction"]) for x, r in zip(real, recs)],
            "seconds": [r["step_time_s"] for r in recs], "losses": [r["loss"] for r in recs],
            "peak_mem_mb": max(r["peak_mem_mb"] for r in recs)}


def hf_samples(job: dict) -> list[dict]:
    """finetune's samples (labels included), unpacked, in file order: what every peer trains on."""
    from finetune.data import build_samples
    from finetune.model import load_tokenizer
    stream = build_samples(job["data"], load_tokenizer(job["model"]), max_seq_len=job["seq_len"], shuffle=False,
                           epoch_limit=1)
    return [{"input_ids": list(s["input_ids"]), "labels": list(s["labels"])} for s in stream]


def peer_worker(job: dict) -> None:
    """HF Trainer or TRL SFTTrainer in this (fresh) process; writes per step real tokens, computed tokens, seconds
    and loss, and the peak memory, to job["result"]."""
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    cuda = torch.cuda.is_available()
    attn = "sdpa"
    if cuda and job["system"] in ("trl", "hf"):  # padding-free rows need a varlen kernel
        from finetune.attention import VARLEN
        from finetune.kernels.varlen import register
        register()
        attn = VARLEN
    tok = AutoTokenizer.from_pretrained(job["model"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32, attn_implementation=attn)
    # no KV cache in training: with one, transformers skips the padding-free rows' per-sample mask (masking_utils
    # looks for packed position_ids only without past_key_values) and the Trainer's samples attend across each other;
    # TRL sets it off itself
    model.config.use_cache = False
    rows = datasets.Dataset.from_list(hf_samples(job))
    times, tokens, computed, losses, last = [], [], [], [], [None]

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            if last[0] is None:
                last[0] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            times.append(now - last[0])
            last[0] = now

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    def counted(collate):  # real and computed tokens of each batch (grad accumulation 1: one batch per step)
        def run(features):
            batch = collate(features)
            mask = batch.get("attention_mask")
            tokens.append(int(mask.sum()) if mask is not None else batch["input_ids"].numel())
            computed.append(batch["input_ids"].numel())  # padding-free (TRL's packing, flattening): no padding
            return batch
        return run

    common = dict(output_dir=job["out"], max_steps=job["steps"], gradient_accumulation_steps=1, learning_rate=3e-3,
                  weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, max_grad_norm=1.0,
                  lr_scheduler_type="constant", optim="adamw_torch_fused" if cuda else "adamw_torch",
                  use_cpu=not cuda, bf16=cuda, report_to="none", save_strategy="no", logging_steps=1,
                  disable_tqdm=True, dataloader_num_workers=0, seed=0)
    if job["system"] == "trl":
        from trl import SFTConfig, SFTTrainer
        args = SFTConfig(**common, per_device_train_batch_size=job["rows"], packing=True, max_length=job["seq_len"],
                         gradient_checkpointing=False, use_liger_kernel=cuda)
        trainer = SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=tok, callbacks=[StepTimer()])
    else:
        from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, Trainer, TrainingArguments
        args = TrainingArguments(**common, per_device_train_batch_size=job["samples"], remove_unused_columns=False,
                                 gradient_checkpointing=False, use_liger_kernel=cuda)
        collate = DataCollatorForSeq2Seq(tok, padding=True) if job["system"] == "hf_padded" else \
            DataCollatorWithFlattening(return_flash_attn_kwargs=cuda)
        trainer = Trainer(model=model, args=args, train_dataset=rows, callbacks=[StepTimer()], data_collator=collate)
    trainer.data_collator = counted(trainer.data_collator)
    trainer.train()
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        from finetune.metrics import peak_rss_mb
        peak = peak_rss_mb()
    n = len(times)
    Path(job["result"]).write_text(json.dumps({"tokens": tokens[:n], "computed": computed[:n], "seconds": times,
                                               "losses": losses[:n], "peak_mem_mb": peak}))


def run_peer(job: dict, env: dict, launcher: list[str]) -> dict:
    Path(job["out"]).mkdir(parents=True, exist_ok=True)
    job = {**job, "result": str(Path(job["out"]) / "steps.json")}
    subprocess.run([*launcher, __file__, "--worker", json.dumps(job)], cwd=REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return json.loads(Path(job["result"]).read_text())


def bare_worker(job: dict) -> None:
    """The floor: forward, backward, clip, AdamW on the batches finetune computes with data.pad_to_max (packed rows
    padded to seq_len, the same sample order), same model, loss (at label positions) and optimizer settings; step
    times to job["result"]."""
    import torch
    from transformers import AutoModelForCausalLM
    from finetune.data import build_samples, pad_collate
    from finetune.loss import label_targets, token_loss_sum
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
        batch.update(label_targets(batch.pop("labels"), batch["position_ids"]))
        (token_loss_sum(model, batch) / len(batch["label_targets"])).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    Path(job["result"]).write_text(json.dumps(times))


# ----------------------------------------------------------------------------------------------- main


def epoch_efficiency(base: dict, systems: dict) -> dict:
    """Real / computed tokens of each system's batching over a whole epoch (a few timed steps of padded batches
    are luck: one long sample pads its whole batch). The Trainer's random batches have the expectation of finetune's
    unpacked ones; TRL's padding-free rows compute no padding."""
    from finetune.data import build_samples
    from finetune.run.report import batch_efficiency
    from finetune.model import load_tokenizer
    tok = load_tokenizer(base["model"])
    units = {p: build_samples(base["data"], tok, max_seq_len=base["seq_len"], packing=p).unit_lengths()
             for p in (True, False)}
    packed, padded = batch_efficiency(units[True], base["rows"], 1), batch_efficiency(units[False], base["samples"], 1)
    free = ("TRL", "padding-free")
    return {name: 1.0 if any(f in name for f in free) else packed if "finetune" in name and "unpacked" not in name
            else padded for name in systems}


def flops_and_peak(base: dict) -> tuple[dict, float | None]:
    """FLOPs per token (run/mfu.flops_per_token) of the model at the data's attention length (T = sum(s^2) / sum(s)
    over its samples s: MFU_CONVENTION), {"mfu": the convention's, "mfu_ran": lm_head at the data's fraction of
    label tokens (MFU_RAN)}, and the device's peak FLOP/s."""
    import torch

    from finetune.run.mfu import flops_per_token, peak_flops
    from finetune.model import build_skeleton, load_hf_config
    samples = hf_samples(base)
    lengths = [len(x["input_ids"]) for x in samples]
    labels = sum(sum(t != -100 for t in x["labels"]) for x in samples)
    t = sum(s * s for s in lengths) / max(sum(lengths), 1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_skeleton(load_hf_config(base["model"]))
    return {"mfu": flops_per_token(model, t), "mfu_ran": flops_per_token(model, t, labels / max(sum(lengths), 1))}, \
        peak_flops(device)


def summary(runs: list[dict], warmup: int, efficiency: dict, flops_tok: dict, peak: float | None) -> dict:
    """Per system: real and computed tokens/s of each run over its timed steps, their medians and range, the real
    tokens/s expected over a whole epoch (computed tokens/s x the epoch's real / computed tokens), MFU and peak
    memory (medians)."""
    by = {}
    for r in runs:
        toks, computed, secs = r["tokens"][warmup:], r["computed"][warmup:], r["seconds"][warmup:]
        r["tokens_per_s"], r["computed_per_s"] = sum(toks) / sum(secs), sum(computed) / sum(secs)
        r["real_tokens_per_step"] = sum(toks) / len(toks)
        by.setdefault(r["system"], []).append(r)
    out = {}
    for s, rs in by.items():
        computed, median = statistics.median(x["computed_per_s"] for x in rs), statistics.median(
            x["tokens_per_s"] for x in rs)
        out[s] = {"median": median, "min": min(x["tokens_per_s"] for x in rs),
                  "max": max(x["tokens_per_s"] for x in rs),
                  "real_tokens_per_step": statistics.median(x["real_tokens_per_step"] for x in rs),
                  "runs": [round(x["tokens_per_s"]) for x in rs], "computed_per_s": computed,
                  "epoch_efficiency": efficiency[s], "expected": computed * efficiency[s],
                  **{k: median * f / peak if peak else None for k, f in flops_tok.items()},
                  "peak_mem_mb": statistics.median(x["peak_mem_mb"] for x in rs),
                  "last_loss": rs[0]["losses"][-1] if rs[0].get("losses") else None}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["peers", "overhead"], help="one table only")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (each system once per round)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per run (peers)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (CUDA: compile, allocator)")
    p.add_argument("--overhead-steps", type=int, default=8, help="timed steps per overhead run")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for every process (CPU)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="the profile (default: cuda when there is one)")
    p.add_argument("--systems", default="defaults,trl,hf",
                   help="peers to run, of: defaults, unpacked, baseline, hf, hf_padded, trl")
    p.add_argument("--baseline", help="another finetune checkout (with its .venv) whose defaults run as 'baseline'")
    p.add_argument("--tiny", action="store_true", help="toy sizes (a dry run of the CUDA profile on any device)")
    p.add_argument("--append", action="store_true", help="add this call's rounds to the runs in the output's json")
    p.add_argument("--output-dir", default="outputs/compare_peers")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        return bare_worker(job) if job["system"] == "bare" else peer_worker(job)

    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    profile = dict(PROFILES[device])
    if args.tiny:  # the CUDA profile's shape, toy sizes: checks the whole benchmark end to end in minutes
        profile.update(name=f"{profile['name']}-tiny", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
                       seq_len=512, median=80, num_rows=200)
    root = Path(args.output_dir).resolve()
    root.mkdir(parents=True, exist_ok=True)
    model, data = make_inputs(root, profile)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error",
           "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "PYTHONWARNINGS": "ignore", "WANDB_MODE": "disabled"}
    base = {"model": str(model), "data": str(data), "seq_len": profile["seq_len"], "rows": profile["rows"],
            "samples": profile["samples"], "dtype": profile["dtype"]}
    # TRL: a wheel on PYTHONPATH where it is installed (the GPU machine), else uv's one-off environment
    import importlib.util
    trl = [sys.executable] if importlib.util.find_spec("trl") else ["uv", "run", "--with", "trl", "python"]
    packed, padded = f"train.micro_batch_size={profile['rows']}", f"train.micro_batch_size={profile['samples']}"
    peers = {
        "defaults": ("finetune defaults (packed)", lambda j: run_finetune(j, env, [packed])),
        "unpacked": ("finetune unpacked", lambda j: run_finetune(j, env, [padded, "data.packing=false"])),
        "baseline": (f"finetune at {args.baseline}",
                     lambda j: run_finetune(j, env, [packed], Path(args.baseline or "."))),
        "hf": ("HF Trainer (padding-free)", lambda j: run_peer({**j, "system": "hf"}, env, [sys.executable])),
        "hf_padded": ("HF Trainer (padding)", lambda j: run_peer({**j, "system": "hf_padded"}, env,
                                                                  [sys.executable])),
        "trl": ("TRL SFTTrainer (packing, no grad ckpt)", lambda j: run_peer({**j, "system": "trl"}, env, trl)),
    }
    peers = dict(peers[k] for k in args.systems.split(","))
    seq, rows = 512, 4  # overhead: 4 rows of 512, fixed shapes
    overhead = {
        "finetune sft (pad_to_max)": lambda j: run_finetune({**j, "seq_len": seq}, env, [
            f"train.micro_batch_size={rows}", "data.pad_to_max=true"])["seconds"],
        "bare PyTorch loop": lambda j: bare_times(j, env, seq, rows),
    }
    where = machine()
    print(f"machine: {where}", flush=True)
    out_json = root / "compare_peers.json"
    result = json.loads(out_json.read_text()) if args.append and out_json.exists() else {}
    result.update(machine=where, args=vars(args), profile=profile)
    if args.only != "overhead":
        runs = result.get("peers", {}).get("runs", [])
        first = 1 + max((r["round"] for r in runs), default=-1)
        for r in range(first, first + args.rounds):
            for name, fn in peers.items():
                t0 = time.perf_counter()
                run = fn({**base, "out": str(root / f"{name.split()[0]}-{len(runs)}"),
                          "steps": args.warmup + args.steps})
                runs.append({"system": name, "round": r, **run, "wall_s": time.perf_counter() - t0})
                t = sum(run["tokens"][args.warmup:]) / sum(run["seconds"][args.warmup:])
                print(f"round {r} {name}: {t:,.0f} real tokens/s, {statistics.median(run['seconds']):.2f} s/step, "
                      f"peak {run['peak_mem_mb']:,.0f} MB, wall {runs[-1]['wall_s']:.0f} s", flush=True)
                # each run kept as it comes: a call cut off keeps its rounds (--append --rounds 0 summarises them)
                out_json.write_text(json.dumps({**result, "peers": {"runs": runs}}, indent=1))
        flops_tok, peak = flops_and_peak(base)
        names = {r["system"] for r in runs}
        result["peers"] = {"runs": runs, "summary": summary(runs, args.warmup, epoch_efficiency(base, names),
                                                            flops_tok, peak)}
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
    out_json.write_text(json.dumps(result, indent=1))
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
        refs = [n for n in ("HF Trainer (padding-free)", "HF Trainer (padding)",
                            "TRL SFTTrainer (packing, no grad ckpt)", "finetune defaults (packed)") if n in s]
        lines += ["", f"| system | real tokens/s: median (runs) | real tokens/step | vs {', '.join(refs)} | MFU / ran "
                      f"| peak memory (MB) | loss, last step | computed tokens/s | real/computed, epoch "
                      f"| expected real tokens/s |", "|---|" + "---:|" * 9]
        for name, x in s.items():
            ratios = ", ".join(f"{x['median'] / s[ref]['median']:.2f}x" for ref in refs)
            mfu = f"{x['mfu']:.1%} / {x['mfu_ran']:.1%}" if x.get("mfu") else "n/a"
            loss = f"{x['last_loss']:.4f}" if x.get("last_loss") is not None else ""
            lines.append(f"| {name} | {x['median']:,.0f} ({', '.join(f'{v:,}' for v in x['runs'])}) | "
                         f"{x['real_tokens_per_step']:,.0f} | {ratios} | {mfu} | {x['peak_mem_mb']:,.0f} | {loss} | "
                         f"{x['computed_per_s']:,.0f} | {x['epoch_efficiency']:.1%} | {x['expected']:,.0f} |")
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
