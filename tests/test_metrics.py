"""MFU's FLOP count: the attention term follows the samples' own lengths in a packed row, not the row length."""
from __future__ import annotations

import pytest


def test_attention_length_of_packed_rows_is_sum_of_squares_over_tokens():
    from finetune.data import pad_collate
    from finetune.ext.mfu import attention_length

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
    from finetune.ext.mfu import attention_length, flops_per_token
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

    from finetune.ext.mfu import flops_per_token
    model = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_experts=8,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    params = dict(model.named_parameters())
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    dense = sum(p.numel() for n, p in params.items() if "embed_tokens" not in n) - experts
    assert experts > dense
    assert flops_per_token(model, 10) == pytest.approx(6 * (dense + experts * 2 / 8) + 12 * 2 * 32 * 10)
