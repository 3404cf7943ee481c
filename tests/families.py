"""The model families test_families.py covers, one row each, and their tiny offline models: built from a transformers
config class, every tensor and buffer moved off its init, stored in the dtypes a released checkpoint has (bf16, fp32
where the class keeps a tensor in fp32 on load), with the tensors the class does not own (MTP layers) beside them."""
from __future__ import annotations

import re
from pathlib import Path

import torch
import transformers as T

from _tokenizers import build_tokenizer

# The sizes every family starts from (a row overrides them; None drops one): 2 layers, hidden 32
TINY = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, tie_word_embeddings=False)
SMALL = dict(hidden_size=16, intermediate_size=32, moe_intermediate_size=8)
LINEAR = ["linear_attention", "full_attention"]  # one layer of each kind
GDN = dict(head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
           linear_value_head_dim=8, layer_types=LINEAR)
MOE = dict(num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=16)
EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2)
ROUTED = dict(n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1)
# MLA: value head dim 6, query/key 12; one kv head per query head, as the released models (and use_mtp) have it
MLA = dict(q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, num_key_value_heads=2)
KMLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=16, num_experts=4,
            num_key_value_heads=2)
# 16 indexer heads: its scores are sums of ReLUs, and with few heads many tie at 0, where topk's pick among equal
# keys (which then differ in their attention) depends on the row's length
DSA = dict(KMLA, q_lora_rank=16, head_dim=8, **ROUTED, index_topk=8, index_head_dim=16, index_n_heads=16)

# model_type: (config class, its sizes beyond TINY, the source's extra tensors: make_family_dir's mtp/extra/fp8)
FAMILIES = {
    "llama": (T.LlamaConfig, {}, {}),
    "mistral": (T.MistralConfig, dict(head_dim=16, sliding_window=16), {}),
    "qwen3": (T.Qwen3Config, dict(head_dim=16), {}),
    "qwen3_moe": (T.Qwen3MoeConfig, dict(head_dim=16, num_experts=4, num_experts_per_tok=2), {}),
    "qwen2_moe": (T.Qwen2MoeConfig, MOE, {}),
    "gemma2": (T.Gemma2Config, dict(head_dim=16, sliding_window=16), {}),  # soft-capping: auto picks sdpa
    "gemma3_text": (T.Gemma3TextConfig, dict(head_dim=16, sliding_window=16,
                                             layer_types=["sliding_attention", "full_attention"]), {}),
    # per-layer inputs (their own embedding of 600 rows: the tokenizer's)
    "gemma4_text": (T.Gemma4TextConfig, dict(head_dim=16, sliding_window=16, hidden_size_per_layer_input=8,
                                             vocab_size_per_layer_input=600,
                                             layer_types=["sliding_attention", "full_attention"]), {}),
    "phi3": (T.Phi3Config, {}, {}),
    "olmo2": (T.Olmo2Config, {}, {}),
    "olmo3": (T.Olmo3Config, dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"]), {}),
    "smollm3": (T.SmolLM3Config, {}, {}),
    "mixtral": (T.MixtralConfig, EXPERTS, {}),
    "minimax_m2": (T.MiniMaxM2Config, dict(EXPERTS, head_dim=16), {}),
    "hunyuan_v1_dense": (T.HunYuanDenseV1Config, dict(head_dim=16), {}),
    "hunyuan_v1_moe": (T.HunYuanMoEV1Config, dict(head_dim=16, num_experts=4, moe_topk=2), {}),
    "granitemoe": (T.GraniteMoeConfig, EXPERTS, {}),
    "dots1": (T.Dots1Config, dict(ROUTED, n_shared_experts=1), {}),
    "hy_v3": (T.HYV3Config, dict(head_dim=16, num_experts=4, num_experts_per_tok=2, num_shared_experts=1), {}),
    # two attention and two MLP sublayers per layer, zero (identity) experts
    "longcat_flash": (T.LongcatFlashConfig, dict(MLA, num_hidden_layers=None, num_layers=2, head_dim=4,
                                                 ffn_hidden_size=64, expert_ffn_hidden_size=16, n_routed_experts=4,
                                                 moe_topk=2, zero_expert_num=1, moe_intermediate_size=None,
                                                 intermediate_size=None),
                      {"extra": {"model.mtp.layers.0.eh_proj.weight": (16, 32)}}),
    "ernie4_5_moe": (T.Ernie4_5_MoeConfig, dict(moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
                                                moe_layer_start_index=1),
                     {"extra": {"mtp_linear_proj.0.weight": (8, 8)}}),
    "glm4_moe": (T.Glm4MoeConfig, dict(SMALL, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                                       head_dim=8), {"mtp": True, "fp8": ["model.layers.2.eh_proj.weight"]}),
    "deepseek_v3": (T.DeepseekV3Config, dict(MLA, **ROUTED), {"mtp": True}),
    "glm4_moe_lite": (T.Glm4MoeLiteConfig, dict(MLA, **ROUTED), {}),
    "mimo_v2_flash": (T.MiMoV2FlashConfig, dict(head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                                                sliding_window=8),  # attention sinks
                      {"extra": {"model.mtp.layers.0.eh_proj.weight": (16, 32)}}),
    "gpt_oss": (T.GptOssConfig, dict(EXPERTS, head_dim=16, sliding_window=8), {}),  # attention sinks, sliding layers
    # chunked and global layers, whole-model get_decoder()
    "llama4_text": (T.Llama4TextConfig, dict(head_dim=16, intermediate_size_mlp=64, num_local_experts=2,
                                             attention_chunk_size=8, no_rope_layers=[1, 0]), {}),
    "falcon": (T.FalconConfig, dict(num_key_value_heads=None), {}),  # masks built without position_ids
    "opt": (T.OPTConfig, dict(num_key_value_heads=None, ffn_dim=64, dropout=0.0), {}),
    "qwen3_5_text": (T.Qwen3_5TextConfig, GDN, {}),
    "qwen3_5_moe_text": (T.Qwen3_5MoeTextConfig, {**GDN, **MOE}, {}),
    "qwen3_next": (T.Qwen3NextConfig, {**GDN, **MOE}, {}),
    "olmo_hybrid": (T.OlmoHybridConfig, GDN, {}),  # two decoder block classes (model.find_layers)
    # with hyper-connections, a per-layer n-gram embedding (PLE) with its dilated conv, and QSA's indexer over blocks
    "qwen4_exp_text": (T.Qwen4ExpTextConfig, {**GDN, **MOE, "layer_types": ["linear_attention", "indexed_attention"],
                                              "hc_count": 2, "hc_lowrank": 8, "ple_layer_ids": [1], "ple_embed_dim": 32,
                                              "heads_per_ngram": 2, "ngram_vocab_size_base": 1000,
                                              "split_ngram_parts": 1, "indexer_n_heads": 2, "indexer_kv_heads": 1,
                                              "indexer_head_dim": 16, "indexer_budget": 4,
                                              "indexer_compress_ratio": 2}, {}),
    "falcon_h1": (T.FalconH1Config, dict(head_dim=16, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8,
                                         mamba_d_state=8, mamba_chunk_size=16), {}),
    "nemotron_h": (T.NemotronHConfig, dict(SMALL, layers_block_type=["mamba", "attention", "moe"],
                                           num_hidden_layers=3, head_dim=8, n_routed_experts=4,
                                           num_experts_per_tok=2, moe_shared_expert_intermediate_size=8,
                                           mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=1,
                                           chunk_size=16), {"extra": {"mtp.layers.0.eh_proj.weight": (16, 32)}}),
    "mamba2": (T.Mamba2Config, dict(num_heads=4, head_dim=16, state_size=8, n_groups=1, chunk_size=16), {}),
    "granitemoehybrid": (T.GraniteMoeHybridConfig, dict(EXPERTS, layer_types=["mamba", "attention"], mamba_n_heads=4,
                                                        mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                                                        mamba_chunk_size=16), {}),
    "lfm2": (T.Lfm2Config, dict(layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False), {}),
    "lfm2_moe": (T.Lfm2MoeConfig, dict(layer_types=["conv", "full_attention"], num_dense_layers=1, num_experts=4,
                                       num_experts_per_tok=2), {}),  # an fp32 expert bias
    "minimax": (T.MiniMaxConfig, dict(EXPERTS, layer_types=LINEAR, head_dim=16, block_size=16), {}),
    "kimi_linear": (T.KimiLinearConfig, dict(KMLA, layer_types=LINEAR, mlp_layer_types=["dense", "sparse"],
                                             linear_head_dim=8, linear_num_heads=2, num_experts_per_token=2), {}),
    # A_log, dt_bias and the conv1d weights kept in fp32
    "bailing_hybrid": (T.BailingHybridConfig, dict(KMLA, linear_head_dim=8, linear_num_heads=2, num_experts_per_token=2,
                                                   first_k_dense_replace=1, num_expert_group=1, topk_group=1,
                                                   layer_group_size=2), {"mtp": True}),  # a linear, then a full layer
    "deepseek_v32": (T.DeepseekV32Config, DSA, {}),
    "glm_moe_dsa": (T.GlmMoeDsaConfig, DSA, {}),
    "deepseek_v4": (T.DeepseekV4Config, dict(
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"], head_dim=16, qk_rope_head_dim=8,
        q_lora_rank=16, o_groups=1, o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=4, hc_mult=2,
        sliding_window=8, mlp_layer_types=["hash_moe", "moe"], n_routed_experts=4, num_experts_per_tok=2),
        {"extra": {"mtp.0.e_proj.weight": (16, 16)}}),
}

# Families whose export the check cannot pass yet (the export is still compared with the source, byte and dtype)
UNVERIFIED: dict[str, str] = {}


def family_kwargs(name: str) -> dict:
    """The config kwargs of `name`'s tiny model: TINY, then its row (None drops a field)."""
    return {k: v for k, v in {**TINY, **FAMILIES[name][1]}.items() if v is not None}


def fp32_on_load(model) -> re.Pattern | None:
    """What transformers keeps in fp32 when it loads `model` in bf16 (its _keep_in_fp32_modules_strict)."""
    plan = model._get_dtype_plan(torch.bfloat16)
    return re.compile("|".join(p.replace("*", ".*") for p in plan)) if plan else None


def mtp_tensors(config_cls, kwargs: dict, extra_layer: str) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3-style MTP layer stored as `extra_layer` (model.layers.<num_hidden_layers>): one more decoder
    block plus the MTP projections and norms, as MtpModel reads them."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion
    n = kwargs["num_hidden_layers"]
    bigger = AutoModelForCausalLM.from_config(config_cls(**{**kwargs, "num_hidden_layers": n + 1}))
    on_disk = revert_weight_conversion(bigger, {k: v.detach() for k, v in bigger.state_dict().items()
                                                if k.startswith(f"model.layers.{n}.")})
    block = {k.replace(f"model.layers.{n}.", extra_layer): v.to(torch.bfloat16) for k, v in on_disk.items()}
    h = kwargs["hidden_size"]
    block.update({f"{extra_layer}{k}": torch.ones(shape, dtype=torch.bfloat16) for k, shape in
                  {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
                   "shared_head.norm.weight": (h,)}.items()})
    return block


def make_family_dir(path: Path, config_cls, kwargs: dict, extra: dict[str, tuple] | None = None,
                    mtp: bool = False, fp8: tuple = (), seed: int = 0) -> Path:
    """Save the tiny model of `config_cls(**kwargs)` (ChatML tokenizer) to `path`: each tensor and persistent buffer
    perturbed, bf16 but fp32 where transformers keeps it so, plus `extra` ({name: shape}, random bf16) and with
    `mtp` an MTP layer after the last: tensors the model class does not own; those named in `fp8` stored as a
    released FP8 checkpoint stores them (F8_E4M3 and a weight_scale_inv beside)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    tok = build_tokenizer("chatml")
    kwargs = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, max_position_embeddings=256, **kwargs)
    torch.manual_seed(seed)
    # as from_pretrained(dtype=bfloat16) holds it: bf16, but what the class creates in fp32 (lfm2_moe's expert_bias)
    # or keeps in fp32 (its dtype plan)
    model = AutoModelForCausalLM.from_config(config_cls(**kwargs), dtype=torch.bfloat16)
    keep = fp32_on_load(model)
    owned = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in model.state_dict())]
    extras = mtp_tensors(config_cls, kwargs, f"model.layers.{kwargs['num_hidden_layers']}.") if mtp else {}
    extras.update({k: torch.zeros(shape, dtype=torch.bfloat16) for k, shape in (extra or {}).items()})
    with torch.no_grad():
        for name, t in [*owned, *extras.items()]:
            if keep is not None and keep.search(name):
                t.data = t.data.float()
            # off its init (ones, zeros, a constant): a tensor dropped or re-initialised shows
            if t.is_floating_point():
                t.copy_(t.float() + torch.randn(t.shape) * 0.05 + 0.01 * (1 + t.float().abs().mean()))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    for name in fp8:
        extras[name] = extras[name].to(torch.float8_e4m3fn)
        extras[f"{name}_scale_inv"] = torch.ones(1, 1)
    if extras:
        stored = load_file(Path(path) / "model.safetensors")
        stored.update({k: t.contiguous() for k, t in extras.items()})
        save_file(stored, Path(path) / "model.safetensors", metadata={"format": "pt"})
    return Path(path)


def stored(model_dir) -> dict[str, tuple[torch.dtype, tuple, bytes]]:
    """{name: (dtype, shape, bytes)} of a model dir's safetensors."""
    from safetensors.torch import load_file
    tensors = {k: t for f in sorted(model_dir.glob("*.safetensors")) for k, t in load_file(f).items()}
    return {k: (t.dtype, tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            for k, t in tensors.items()}
