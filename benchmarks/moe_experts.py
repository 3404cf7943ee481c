"""CPU: a small Qwen3-MoE-shaped model (4 blocks, hidden 256, 32 experts of 128, 4 per token), forward + backward
through the loss on one packed micro-batch, per model.experts_implementation, interleaved: median tokens/s and the
bytes the forward keeps for backward (finetune.tools.bench.count_saved, parameters excluded).

    uv run python benchmarks/moe_experts.py [--reps 5] [--tokens 1024]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    import transformers as T
    from transformers import AutoModelForCausalLM

    from finetune.kernels.moe import apply_experts_implementation
    from finetune.tools.bench import count_saved
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1024)
    args = parser.parse_args()
    config = T.Qwen3MoeConfig(vocab_size=8192, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                              num_experts=32, num_experts_per_tok=4, num_hidden_layers=4, num_attention_heads=8,
                              num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ids = torch.randint(0, config.vocab_size, (2, args.tokens // 2))
    impls = ("grouped_mm", "eager", "batched_mm")
    times, saved = {i: [] for i in impls}, {}
    for rep in range(args.reps + 1):  # the first round warms up
        for impl in impls:
            apply_experts_implementation(model, impl)
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            with count_saved(model) as storages:
                logits = model(input_ids=ids, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
            if rep:
                times[impl].append(time.perf_counter() - t0)
            saved[impl] = sum(s.nbytes() for s in storages.values()) / 2**20
    print(f"torch {torch.__version__}, transformers {T.__version__}, {torch.get_num_threads()} threads, "
          f"{args.tokens} tokens per step, {args.reps} timed steps each (interleaved)")
    print("| experts_implementation | median step s | tokens/s | saved for backward MiB |")
    print("|---|---:|---:|---:|")
    for impl in impls:
        step = statistics.median(times[impl])
        print(f"| {impl} | {step:.3f} | {args.tokens / step:.0f} | {saved[impl]:.1f} |")


if __name__ == "__main__":
    main()
