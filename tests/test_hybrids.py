"""Hybrid and linear-attention families (gated delta rule, state space, short convolutions, lightning attention) and
sparse attention train packed exactly: sft's model at lr 0 gives the loss and gradient norm of the same samples
unpacked, and 2 gloo ranks those of 1 process. A family is added by one line of FAMILIES (its config
class and tiny sizes)."""
from __future__ import annotations

import pytest
import torch
import transformers as T

from helpers import BASE, invoke, run_ranks, sft, write_jsonl

LINEAR = ["linear_attention", "full_attention"]  # one layer of each kind
GDN = dict(head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
           linear_value_head_dim=8, layer_types=LINEAR)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=16, num_experts=4,
           moe_intermediate_size=16, num_key_value_heads=2)
# 16 indexer heads: its scores are sums of ReLUs, and with few heads many tie at 0, where topk's pick among equal
# keys (which then differ in their attention) depends on the row's length
DSA = dict(MLA, q_lora_rank=16, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
           first_k_dense_replace=1, index_topk=8, index_head_dim=16, index_n_heads=16)
FAMILIES = {  # model_type: (config class, its sizes beyond the common ones in make_hybrid_dir)
    "qwen3_5_text": (T.Qwen3_5TextConfig, GDN),
    "qwen3_5_moe_text": (T.Qwen3_5MoeTextConfig, {**GDN, **MOE}),
    "qwen3_next": (T.Qwen3NextConfig, {**GDN, **MOE}),
    "olmo_hybrid": (T.OlmoHybridConfig, GDN),  # two decoder block classes (model.find_layers)
    # with hyper-connections, a per-layer n-gram embedding (PLE) with its dilated conv, and QSA's indexer over blocks
    "qwen4_exp_text": (T.Qwen4ExpTextConfig, {**GDN, **MOE, "layer_types": ["linear_attention", "indexed_attention"],
                                              "hc_count": 2, "hc_lowrank": 8, "ple_layer_ids": [1], "ple_embed_dim": 32,
                                              "heads_per_ngram": 2, "ngram_vocab_size_base": 1000,
                                              "split_ngram_parts": 1, "indexer_n_heads": 2, "indexer_kv_heads": 1,
                                              "indexer_head_dim": 16, "indexer_budget": 4,
                                              "indexer_compress_ratio": 2}),
    "falcon_h1": (T.FalconH1Config, dict(head_dim=16, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
                                         mamba_d_state=8, mamba_chunk_size=16)),
    "nemotron_h": (T.NemotronHConfig, dict(layers_block_type=LINEAR, head_dim=16, mamba_num_heads=4,
                                           mamba_head_dim=8, ssm_state_size=8, n_groups=1, chunk_size=16)),
    "mamba2": (T.Mamba2Config, dict(num_heads=4, head_dim=16, state_size=8, n_groups=1, chunk_size=16)),
    "granitemoehybrid": (T.GraniteMoeHybridConfig, dict(layer_types=["mamba", "attention"], mamba_n_heads=4,
                                                        mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                                                        mamba_chunk_size=16, num_local_experts=4,
                                                        num_experts_per_tok=2)),
    "lfm2": (T.Lfm2Config, dict(layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False)),
    "lfm2_moe": (T.Lfm2MoeConfig, dict(layer_types=["conv", "full_attention"], num_dense_layers=1, num_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=16)),
    "minimax": (T.MiniMaxConfig, dict(layer_types=LINEAR, head_dim=16, block_size=16, num_local_experts=4,
                                      num_experts_per_tok=2)),
    "kimi_linear": (T.KimiLinearConfig, dict(layer_types=LINEAR, mlp_layer_types=["dense", "sparse"], **MLA,
                                             linear_head_dim=8, linear_num_heads=2, num_experts_per_token=2)),
    "bailing_hybrid": (T.BailingHybridConfig, dict(layer_types=LINEAR, mlp_layer_types=["dense", "sparse"], **MLA,
                                                   linear_head_dim=8, linear_num_heads=2, num_experts_per_token=2,
                                                   first_k_dense_replace=1, num_expert_group=1, topk_group=1,
                                                   layer_group_size=2, num_nextn_predict_layers=0)),
    "deepseek_v32": (T.DeepseekV32Config, DSA),
    "glm_moe_dsa": (T.GlmMoeDsaConfig, DSA),
    "deepseek_v4": (T.DeepseekV4Config, dict(
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"], head_dim=16, qk_rope_head_dim=8,
        q_lora_rank=16, o_groups=1, o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=4, hc_mult=2,
        sliding_window=8, mlp_layer_types=["hash_moe", "moe"], n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, num_nextn_predict_layers=0)),
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


def packed_and_unpacked(model_dir: str, data: str) -> list[tuple[float, float]]:
    """On one rank, sft's model (its transforms, default attention, packing on, fp32) at lr 0: train_step's (loss,
    grad norm) on the samples of one epoch packed in one row, then on the same samples unpacked (one per row,
    right-padded), as data.packing=false batches them."""
    from finetune.data import build_samples
    from finetune.distributed import init_distributed
    from finetune.build import transforms
    from finetune.model import build_model, load_tokenizer
    from finetune.train import next_micro_batches, train_step
    from helpers import sft_config
    device, dims = init_distributed()
    cfg = sft_config(model_dir, data, "unused")
    tok = load_tokenizer(model_dir)
    rows = list(build_samples(data, tok, max_seq_len=512, packing=True, shuffle=False, epoch_limit=1))
    assert len(rows) == 1 and rows[0]["position_ids"].count(0) == 6
    starts = [i for i, p in enumerate(rows[0]["position_ids"]) if p == 0] + [len(rows[0]["input_ids"])]
    singles = [{k: rows[0][k][a:b] for k in ("input_ids", "labels")} for a, b in zip(starts, starts[1:])]
    model, _ = build_model(model_dir, device, dims.mesh, transforms(cfg, dims, device), mixed_precision="fp32",
                           attn_implementation=cfg.model.attn_implementation, packing=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    results = []
    for units in (rows, singles):
        batches, num_input_tokens = next_micro_batches(iter(units), len(units), 1, tok.pad_token_id, None)
        result, _ = train_step(model, optimizer, batches, num_input_tokens=num_input_tokens, max_grad_norm=0.0)
        results.append((result["loss"].item(), result["grad_norm"].item()))
    return results


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_packed_samples_train_as_the_samples_unpacked(model_type, tmp_path):
    """6 samples packed in one row give the loss and gradient norm of the same 6 unpacked in one micro-batch (fp32,
    lr 0). Before, packing was refused, and unpacked the gated-delta families failed too (transformers took the
    collate's boundaries for packing) while the sparse-attention ones crashed or (deepseek_v4) leaked the padding."""
    model_dir = make_hybrid_dir(tmp_path / "model", model_type)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6))
    packed, unpacked = run_ranks(packed_and_unpacked, 1, str(model_dir), str(data))[0]
    assert packed == pytest.approx(unpacked, rel=1e-5)


def test_a_hybrid_trains_packed_on_two_ranks_as_one_process(tmp_path):
    """Qwen3-Next (gated delta rule, full attention, MoE), packed rows of 128 tokens, lr 1e-2: 2 gloo ranks of one row
    each (every block recomputed in backward: the per-sample path again) give the losses of one process with both
    rows in its micro-batch."""
    model_dir = make_hybrid_dir(tmp_path / "model", "qwen3_next")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(24))
    common = ("train.lr=1e-2", "train.max_steps=3", "data.max_seq_len=128")
    one = sft(model_dir, data, tmp_path / "one", *common, "train.micro_batch_size=2")
    two = sft(model_dir, data, tmp_path / "two", *common, "train.micro_batch_size=1", "ac.ratio=1", nproc=2)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["num_tokens"] for r in two] == [r["num_tokens"] for r in one]


def test_sparse_attention_other_than_eager_is_one_line_and_exit_2(tmp_path):
    """DeepSeek sparse attention (V3.2's indexer, V4's compressed KV) reads a materialized causal mask: varlen and flash
    give none, sdpa none for a row without padding or packing (V3.2 crashed: 'NoneType' object is not subscriptable;
    V4 let every query see every compressed block); auto picks eager."""
    from _tokenizers import build_tokenizer
    model_dir = tmp_path / "dsa"  # config and tokenizer only: the run stops before any weight is read
    T.DeepseekV32Config(**DSA, hidden_size=32, num_hidden_layers=2, num_attention_heads=2).save_pretrained(model_dir)
    build_tokenizer("chatml").save_pretrained(model_dir)
    # its module imported here, not in the run: torchao, which it imports, warns on stderr once per process
    from transformers import DeepseekV32ForCausalLM  # noqa: F401
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(2))
    result = invoke("sft", "--model", model_dir, "--dataset", data, "--output-dir", tmp_path / "run", *BASE,
                    "model.attn_implementation=sdpa")
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [
        "error: model.attn_implementation=sdpa: DeepseekV32ForCausalLM's sparse attention needs the causal mask only "
        "eager always builds; use eager (or auto)"], result.output
