"""Mixture-of-experts models (finetune/ext/moe.py and the load/export paths): routing buffers loaded, saved, exported
and checked against the source; tiny models built offline from configs, ranks in-process (run_ranks)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import run_ranks, sft

LR0 = ("train.lr=0", "train.max_steps=2", "train.micro_batch_size=4")

MOE = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
           n_shared_experts=1, first_k_dense_replace=1)
ARCH_SIZES = {
    "deepseek_v3": dict(**MOE, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "glm4_moe": dict(**MOE, head_dim=16),
    "qwen3_moe": dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16,
                      output_router_logits=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8, layer_types=None,
                    output_router_logits=True),
}


def make_moe_dir(path, arch: str, fused: bool = False, num_layers: int = 2, seed: int = 0,
                 bias_dtype: torch.dtype = torch.float32, **sizes):
    """A random bf16 `arch` model with the chatml tokenizer saved to `path`; a routing bias (where the router has one)
    of large random values, stored in fp32 as DeepSeek-V3 ships it. `fused`: the tensors under their in-memory names
    (fused experts), which each rank reads in slices, instead of save_pretrained's per-expert layout."""
    import transformers as T
    from transformers import AutoModelForCausalLM

    from _tokenizers import build_tokenizer
    tok = build_tokenizer("chatml")
    kw = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    kw = {k: v for k, v in {**kw, **ARCH_SIZES[arch], **sizes}.items() if v is not None}
    config = T.AutoConfig.for_model(arch, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.data = torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed + 1)).to(bias_dtype)
    model.save_pretrained(path)
    if fused:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors",
                  metadata={"format": "pt"})
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def biased(tmp_path_factory):
    """DeepSeek-V3 and GLM-4.5-style models with a non-zero routing bias, per-expert on disk (rank-0 load) and fused
    (per-rank slices)."""
    root = tmp_path_factory.mktemp("biased")
    return {(arch, fused): make_moe_dir(root / f"{arch}-{fused}", arch, fused=fused)
            for arch in ("deepseek_v3", "glm4_moe") for fused in (False, True)}


INPUT_IDS = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))


def reference_logits(model_dir) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(INPUT_IDS).logits


def our_logits(model_dirs) -> list[tuple[str, torch.Tensor, dict]]:
    """On each rank, for each dir: the path the load took, the logits of build_model's model, its routing biases."""
    from finetune.distributed import init_distributed
    from finetune.load import is_prepared, locate_slices
    from finetune.model import build_model, build_skeleton
    device, dims = init_distributed()
    out = []
    for model_dir in model_dirs:
        model, _ = build_model(str(model_dir), device, dims.mesh, mixed_precision="fp32")
        path = "prepared" if is_prepared(model_dir) else locate_slices(model, build_skeleton(model.config, None),
                                                                      str(model_dir))
        model.eval()
        with torch.no_grad():
            logits = model(INPUT_IDS).logits
        biases = {n: b.numpy().copy() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
        out.append(("slices" if isinstance(path, dict) else path, logits.numpy(), biases))  # no tensors: see helpers
    return out


def test_routing_bias_is_loaded_on_every_path_and_gives_from_pretrained_logits(biased, tmp_path):
    from helpers import run_cli
    prepared = tmp_path / "prepared"
    run_cli("prepare-checkpoint", "--model", biased["deepseek_v3", False], "--output-dir", prepared,
            "--nproc-per-node", 2)
    dirs = [*biased.values(), prepared]
    per_rank = run_ranks(our_logits, 2, dirs)
    for i, model_dir in enumerate(dirs):
        source = biased["deepseek_v3", False] if model_dir == prepared else model_dir
        want = reference_logits(source)
        stored = {k: v for k, v in load_file(source / "model.safetensors").items()
                  if k.endswith("e_score_correction_bias")}
        assert len(stored) == 1 and next(iter(stored.values())).abs().min() > 0  # non-zero, fp32 on disk
        for path, logits, biases in (r[i] for r in per_rank):
            assert path == ("prepared" if model_dir == prepared else "slices" if "True" in model_dir.name
                            else f"{'DeepseekV3' if 'deepseek' in model_dir.name else 'Glm4Moe'}ForCausalLM stores "
                                 f"model.layers.1.mlp.experts.0.down_proj.weight in a layout that transformers "
                                 f"converts on load"), path
            assert set(biases) == set(stored) and all(torch.equal(torch.from_numpy(biases[k]), stored[k])
                                                       for k in stored), model_dir
            torch.testing.assert_close(torch.from_numpy(logits), want, rtol=1e-5, atol=1e-5)


def test_lr0_export_equals_the_source_and_the_check_compares_untrained_tensors_with_it(chat_file, tmp_path):
    from finetune.ext.verify import VerifyError
    from test_export import export, read_weights
    source = make_moe_dir(tmp_path / "source", "deepseek_v3", bias_dtype=torch.bfloat16)
    sft(source, chat_file, tmp_path / "run", *LR0, nproc=2)
    printed = export(tmp_path / "run", tmp_path / "hf")
    assert "verified" in printed, printed
    original, exported = read_weights(source), read_weights(tmp_path / "hf")
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    # a load that dropped the bias (the checkpoint holds zeros) is caught: the check compares it with the source
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    original[bias] = original[bias] + 1
    save_file(original, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(VerifyError, match=f"export check: {bias} differs from the source model's"):
        export(tmp_path / "run", tmp_path / "hf2")
    assert not (tmp_path / "hf2").exists()
