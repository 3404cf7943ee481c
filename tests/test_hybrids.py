"""Hybrid and linear-attention families (gated delta rule, state space, short convolutions, lightning attention)
train packed exactly: the default sft path at lr 0 gives the loss and gradient norm of the same samples unpacked, and
2 gloo ranks those of 1 process. A family is added by one line of FAMILIES (its config class and tiny sizes)."""
from __future__ import annotations

import pytest
import torch
import transformers as T

from helpers import sft, write_jsonl

LINEAR = ["linear_attention", "full_attention"]  # one layer of each kind
GDN = dict(head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
           linear_value_head_dim=8, layer_types=LINEAR)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
FAMILIES = {  # model_type: (config class, its sizes beyond the common ones in make_hybrid_dir)
    "qwen3_5_text": (T.Qwen3_5TextConfig, GDN),
    "qwen3_5_moe_text": (T.Qwen3_5MoeTextConfig, {**GDN, **MOE}),
    "qwen3_next": (T.Qwen3NextConfig, {**GDN, **MOE}),
    "falcon_h1": (T.FalconH1Config, dict(head_dim=16, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
                                         mamba_d_state=8, mamba_chunk_size=16)),
    "nemotron_h": (T.NemotronHConfig, dict(layers_block_type=LINEAR, head_dim=16, mamba_num_heads=4,
                                           mamba_head_dim=8, ssm_state_size=8, n_groups=1, chunk_size=16)),
    "lfm2": (T.Lfm2Config, dict(layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False)),
    "lfm2_moe": (T.Lfm2MoeConfig, dict(layer_types=["conv", "full_attention"], num_dense_layers=1, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=16)),
    "minimax": (T.MiniMaxConfig, dict(layer_types=LINEAR, head_dim=16, block_size=16, num_local_experts=4,
                                      num_experts_per_tok=2)),
}


def make_hybrid_dir(path, model_type: str, seed: int = 0):
    """A 2-layer fp32 `model_type` model (hidden 32, the chatml tokenizer) saved to `path`, every tensor moved off its
    init (norms of 1, zero biases and fixed decays would hide a mix-up)."""
    from transformers import AutoModelForCausalLM

    from _tokenizers import build_tokenizer
    tok = build_tokenizer("chatml")
    config_class, sizes = FAMILIES[model_type]
    config = config_class(**{**dict(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id), **sizes})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(torch.randn_like(tensor) * 0.1)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def chat_rows(n: int) -> list[dict]:
    """`n` short conversations of different lengths (each a few dozen tokens)."""
    words = "alpha beta gamma delta echo fox golf hotel".split()
    return [{"messages": [{"role": "user", "content": " ".join(words[: 1 + i % 7])},
                          {"role": "assistant", "content": " ".join(words[i % 3: 2 + i % 8])}]} for i in range(n)]


LR0 = ("train.lr=0", "train.max_steps=1", "data.max_seq_len=512")


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_packed_samples_train_as_the_samples_unpacked(model_type, tmp_path):
    """The default path (packing on, attention auto) on 6 samples in one packed row, then the same 6 unpacked (one
    per row, right-padded) in one step: loss and gradient norm agree (fp32, lr 0). Before, packing was refused and
    the gated-delta families failed unpacked too (transformers took the collate's boundaries for packing)."""
    model_dir = make_hybrid_dir(tmp_path / "model", model_type)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6))
    packed = sft(model_dir, data, tmp_path / "packed", *LR0)
    unpacked = sft(model_dir, data, tmp_path / "unpacked", *LR0, "data.packing=false", "train.micro_batch_size=6")
    # the packed stream repeats the 6 samples to fill its row: the same samples, each as often
    assert packed[0]["num_tokens"] % unpacked[0]["num_tokens"] == 0 < unpacked[0]["num_tokens"]
    assert (packed[0]["loss"], packed[0]["grad_norm"]) == pytest.approx(
        (unpacked[0]["loss"], unpacked[0]["grad_norm"]), rel=1e-5)
