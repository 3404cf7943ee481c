"""CPU step time of `finetune dpo` vs TRL's DPOTrainer: the same tiny model (examples/tiny-llama, fp32), the same pairs
(examples/data/tiny_prefs.jsonl), the same pairs per step (unpacked: one pair per sample, padded like TRL), reference
log-probs precomputed in both (so a step is one policy forward and backward), one thread each. Fresh processes,
alternating ours / TRL, `--rounds` times; each reports the median of its timed steps; we print the median over the
rounds with the min-max spread.

    uv run python benchmarks/dpo_vs_trl.py --rounds 5 --steps 20 --pairs 16
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL, DATA = REPO / "examples" / "tiny-llama", REPO / "examples" / "data" / "tiny_prefs.jsonl"


def ours(pairs: int, steps: int, warmup: int, attn: str = "auto") -> list[float]:
    """train.py's step as `finetune dpo` runs it (batches padded to their longest, not bench's max_seq_len);
    the reference log-probs are read from a table (zeros here: a precomputed reference costs no compute per step)."""
    from collections import defaultdict
    from functools import partial

    from finetune.config import load_config
    from finetune.distributed import init_distributed
    from finetune.tasks.dpo import LABELLERS, MEANS, collate_pairs, make_loss
    from finetune.task import Task, build_run_samples
    from finetune.data.chat_template import run_tokenizer
    from finetune.train import build_model_and_optimizer, next_micro_batches, train_step
    cfg = load_config(None, {"model.path": str(MODEL), "data.path": str(DATA), "output_dir": "/tmp/dpo-bench",
                             "data.packing": False, "data.max_seq_len": 256, "train.micro_batch_size": pairs,
                             "train.mixed_precision": "fp32", "eval.path": "", "model.attn_implementation": attn})
    device, dims = init_distributed(1, 0)
    tok, _ = run_tokenizer(cfg)
    model, optimizer, _ = build_model_and_optimizer(cfg, device, dims, [])
    samples = iter(build_run_samples(cfg, tok, labellers=LABELLERS))
    loss_fn = make_loss(cfg.dpo, "precomputed")
    collate = partial(collate_pairs, table=defaultdict(lambda: [0.0, 0.0]))
    times = []
    for _ in range(warmup + steps):  # the batch is made before the clock starts, as Trainer's is
        micro_batches, num_input_tokens = next_micro_batches(samples, pairs, 1, tok.pad_token_id, None, collate)
        t0 = time.perf_counter()
        train_step(model, optimizer, micro_batches, num_input_tokens=num_input_tokens, max_grad_norm=1.0,
                   task=Task(loss_fn, means=MEANS))
        times.append(time.perf_counter() - t0)
    return times[warmup:]


def trl(pairs: int, steps: int, warmup: int) -> list[float]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[:pairs * (steps + warmup)]]
    rows = [{**r, **{k: [{"role": "assistant", "content": r[k]}] for k in ("chosen", "rejected")}} for r in rows]
    times = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.t0)

    args = DPOConfig(output_dir="/tmp/dpo-bench-trl", beta=0.1, per_device_train_batch_size=pairs,
                     max_steps=steps + warmup, learning_rate=1e-3, lr_scheduler_type="constant", report_to=[],
                     use_cpu=True, bf16=False, max_length=256, precompute_ref_log_probs=True, logging_steps=10**6,
                     save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(MODEL), callbacks=[Timer()])
    trainer.train()
    return times[warmup:]


# ours: attention "auto" (on CPU one sdpa call per sample: packed boundaries kept); ours-sdpa: one batched sdpa call
# with the block-diagonal mask transformers builds from the position_ids restarts
SYSTEMS = {"ours": ours, "ours-sdpa": lambda *a: ours(*a, attn="sdpa"), "trl": trl}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--pairs", type=int, default=16, help="pairs per optimizer step")
    ap.add_argument("--child", choices=list(SYSTEMS), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(SYSTEMS[a.child](a.pairs, a.steps, a.warmup)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
    medians = {who: [] for who in SYSTEMS}
    for r in range(a.rounds):
        for who in SYSTEMS:
            out = subprocess.run([sys.executable, __file__, "--child", who, "--pairs", str(a.pairs), "--steps",
                                  str(a.steps), "--warmup", str(a.warmup)], env=env, capture_output=True, text=True,
                                 check=True, cwd=REPO).stdout
            medians[who].append(statistics.median(json.loads(out.strip().splitlines()[-1])))
            print(f"round {r}: {who} {medians[who][-1] * 1e3:.1f} ms/step", flush=True)
    for who, m in medians.items():
        print(f"{who}: median {statistics.median(m) * 1e3:.1f} ms/step (min {min(m) * 1e3:.1f}, max "
              f"{max(m) * 1e3:.1f}) over {a.rounds} processes; {a.pairs} pairs/step")
    for who in ("ours", "ours-sdpa"):
        print(f"{who} / trl: {statistics.median(medians[who]) / statistics.median(medians['trl']):.2f}")


if __name__ == "__main__":
    main()
