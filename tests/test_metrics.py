"""MFU's FLOP count: the attention term follows the samples' own lengths in a packed row, not the row length."""
from __future__ import annotations

import pytest


def test_attention_length_of_packed_rows_is_sum_of_squares_over_tokens():
    from finetune.data import pad_collate
    from finetune.run.mfu import attention_length

    def sample(n):
        return {"input_ids": [1] * n, "labels": [1] * n}

    def packed(*lengths):  # one packed row of these samples
        return {"input_ids": [1] * sum(lengths), "labels": [1] * sum(lengths),
                "position_ids": [i for n in lengths for i in range(n)]}

    # rows of 8: [3, 5] and [6, then 2 of padding]; a micro-batch of [4] and [2, 1, 1]
    batches = [pad_collate([packed(3, 5), packed(6)], pad_id=0), pad_collate([packed(4), packed(2, 1, 1)], pad_id=0)]
    lengths = [3, 5, 6, 4, 2, 1, 1]
    assert attention_length(batches) == pytest.approx(sum(s * s for s in lengths) / sum(lengths))
    # unpacked samples (padded to the longest): each its own length
    assert attention_length([pad_collate([sample(5), sample(3)], pad_id=0)]) == pytest.approx(34 / 8)


def test_mfu_flops_count_the_per_sample_attention():
    """One step over a packed row of samples 100, 300 and 600 tokens: 6N per token plus 12*L*H*Q*s^2 per sample,
    far fewer than the row length's 12*L*H*Q*1000^2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.data import pad_collate
    from finetune.run.mfu import attention_length, flops_per_token
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    lengths = [100, 300, 600]
    row = {"input_ids": [1] * 1000, "labels": [1] * 1000, "position_ids": [i for n in lengths for i in range(n)]}
    dense = 6 * sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    step = 1000 * flops_per_token(model, attention_length([pad_collate([row], pad_id=0)]))
    assert step == pytest.approx(1000 * dense + 12 * 2 * 32 * sum(s * s for s in lengths))
    assert step < 1000 * flops_per_token(model, 1000)


def test_mfu_counts_the_experts_a_token_runs():
    """An MoE token runs k of a layer's E experts: 6N counts k/E of the fused experts' weights (torchtitan's active
    parameters). Counting all of them, the H200 bench of a 64-expert top-8 model read MFU 62.8%, ~5x high."""
    import transformers as T

    from finetune.run.mfu import flops_per_token
    model = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    params = dict(model.named_parameters())
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    dense = sum(p.numel() for n, p in params.items() if "embed_tokens" not in n) - experts
    assert experts > dense
    assert flops_per_token(model, 10) == pytest.approx(6 * (dense + experts * 2 / 8) + 12 * 2 * 32 * 10)


def test_flops_per_token_against_a_hand_count_with_lm_head_at_the_label_positions():
    """A tiny untied Llama counted by hand, weight by weight: the convention (6N + 12*L*H*Q*T) runs lm_head at every
    token; MFU ran counts its 6*V*D at the label positions only, which the loss gathers before projecting. One packed
    row of samples 3 and 5 (labels on 2 and 3 of their positions) and 2 tokens of padding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from finetune.run.mfu import flops_per_token, step_flops_per_token
    from finetune.loss import collate_labelled
    vocab, hidden, inter, layers, heads, kv, head_dim = 50, 16, 24, 3, 4, 2, 4
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                         num_hidden_layers=layers, num_attention_heads=heads,
                                         num_key_value_heads=kv, tie_word_embeddings=False))
    # per layer: q, o (D x D), k, v (D x kv*Q), gate, up, down (D x I), two RMSNorm weights; then the final norm
    block = 2 * hidden * hidden + 2 * hidden * kv * head_dim + 3 * hidden * inter + 2 * hidden
    body, head = layers * block + hidden, vocab * hidden
    attention = 12 * layers * heads * head_dim
    assert flops_per_token(model, 7.0) == 6 * (body + head) + attention * 7.0
    assert flops_per_token(model, 7.0, label_fraction=0.25) == pytest.approx(6 * (body + head / 4) + attention * 7.0)

    ignore = -100
    row = {"input_ids": list(range(1, 9)), "position_ids": [0, 1, 2, 0, 1, 2, 3, 4],
           "labels": [ignore, 5, 6, ignore, ignore, 9, 9, 9]}
    batch = collate_labelled([row], 0, 10)
    assert batch["input_ids"].shape == (1, 10) and batch["label_index"].numel() == 5
    counts = step_flops_per_token(model, [batch])
    t = (3 * 3 + 5 * 5) / 8
    assert counts["mfu"] == pytest.approx(6 * (body + head) + attention * t)
    assert counts["mfu_ran"] == pytest.approx(6 * (body + head * 5 / 8) + attention * t)
