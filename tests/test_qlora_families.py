"""QLoRA beyond Llama: an MoE stored expert by expert (transformers fuses the experts on load, so rank 0 reads the
model and each rank quantizes its rows with the whole tensor's scales, as where each rank reads its slices); a router
that subclasses Linear with another forward (Llama 4's) is neither adapted by "all-linear" nor held as NF4."""
from __future__ import annotations

import pytest
import torch

import helpers
from test_qlora import SIZES, built_shards

# head_dim 64: the attention weights split into 2 row shards of whole NF4 factor blocks (k_proj 128 x 256 as well)
MOE = dict(SIZES, num_key_value_heads=2, head_dim=64, moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    from transformers import Qwen3MoeConfig
    from families import family_kwargs, make_family_dir
    return make_family_dir(tmp_path_factory.mktemp("qlora_moe"), Qwen3MoeConfig, {**family_kwargs("qwen3_moe"), **MOE})


def test_an_moe_stored_expert_by_expert_is_read_on_rank_0_and_each_rank_holds_the_whole_tensor_s_nf4_rows(
        moe_dir, chat_file, capfd):
    """On 1 process, 2 ranks and HSDP 2 x 1 (the NF4 weights outside FSDP, whole): each rank's bytes those of the whole
    tensor quantized at once, as the slice reader's (the attention's; the experts stay unquantized, with a note)."""
    from torchao.quantization import to_nf4
    from test_lora import read_weights
    stored = read_weights(moe_dir)
    # HSDP 2 x 1: the NF4 weights outside FSDP on 2 ranks, rank 0's tensors broadcast
    for world, replicas in ((1, 1), (2, 1), (2, 2)):
        num_shards = world // replicas
        for rank, (shards, _, _) in enumerate(helpers.run_ranks(built_shards, world, moe_dir, chat_file, replicas)):
            assert len(shards) == 2 * 4, sorted(shards)  # q, k, v, o of 2 blocks; the experts stay unquantized
            for name, inner in shards.items():
                whole = to_nf4(stored[name.replace(".base_layer", "")].float())
                for attr, mine in inner.items():
                    theirs = getattr(whole, attr).numpy()
                    n = theirs.size // num_shards if attr != "scaler_mean" else 0
                    theirs = theirs[rank % num_shards * n:(rank % num_shards + 1) * n] if n else theirs
                    assert mine.dtype == theirs.dtype and (mine == theirs).all(), (world, replicas, rank, name, attr)
    out = capfd.readouterr().out
    assert "loading on rank 0 and scattering: Qwen3MoeForCausalLM stores model.layers.0.mlp.experts.0." in out, out
    assert "note: the MoE experts (2 layers of fused 3-D weights) are not NF4" in out, out


def test_a_router_subclassing_linear_is_neither_adapted_nor_quantized(capsys):
    """Llama 4's router is a Linear returning scores and logits: peft's wrapper cannot add a delta to its output and
    NF4's matmul would replace its top-k; it stays as it is, and naming it is refused in one line. Falcon's Linear
    (x @ W.T + b in a forward of its own) is a plain one; DeepSeek-V4's grouped projection is not."""
    from functools import partial
    from transformers import Llama4TextConfig
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear
    from transformers.models.falcon.modeling_falcon import FalconLinear
    from finetune.adapters.lora import apply_lora
    from finetune.adapters.qlora import apply_nf4, is_nf4, is_plain_linear
    # on meta (a skeleton) and with real weights (plan's are fake): the forward is tried on meta stand-ins
    assert is_plain_linear(FalconLinear(64, 32)) and not is_plain_linear(DeepseekV4GroupedLinear(32, 64, 2))
    with torch.device("meta"):
        assert is_plain_linear(FalconLinear(64, 32)) and not is_plain_linear(DeepseekV4GroupedLinear(32, 64, 2))
    from finetune.config import ConfigError
    from finetune.model import build_skeleton, find_layers
    config = Llama4TextConfig(vocab_size=512, num_hidden_layers=1, num_local_experts=2, intermediate_size_mlp=512,
                              head_dim=64, **SIZES)
    lora = dict(rank=4, alpha=8.0, dropout=0.0, modules_to_save=[], base_dtype=torch.bfloat16,
                quantize=partial(apply_nf4, shards=1))
    skeleton = build_skeleton(config)
    apply_lora(skeleton, find_layers(skeleton), target_modules="all-linear", **lora)
    router = skeleton.model.layers[0].feed_forward.router
    assert type(router).__name__ == "Llama4Router" and not is_nf4(router.weight)
    assert is_nf4(skeleton.model.layers[0].self_attn.q_proj.base_layer.weight)
    assert "layers.0.feed_forward.router.weight belongs to a Llama4Router, a Linear whose forward is not a Linear's" \
        in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"'router' names model.layers.0.feed_forward.router \(Llama4Router\), a "
                                          r"Linear whose forward is not a Linear's: LoRA here adapts plain Linear"):
        skeleton = build_skeleton(config)
        apply_lora(skeleton, find_layers(skeleton), target_modules=["router"], **lora)
