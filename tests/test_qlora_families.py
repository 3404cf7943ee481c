"""QLoRA beyond Llama: an MoE stored expert by expert (transformers fuses the experts on load, so rank 0 reads the
model and each rank quantizes its rows with the whole tensor's scales, as where each rank reads its slices)."""
from __future__ import annotations

import pytest

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
    """On 1 process (the NF4 weights outside FSDP, whole) and on 2 ranks: each rank's bytes those of the whole tensor
    quantized at once, as the slice reader's (the attention's; the experts stay unquantized, with a note)."""
    from torchao.quantization import to_nf4
    from test_lora import read_weights
    stored = read_weights(moe_dir)
    for world in (1, 2):
        for rank, (shards, _, _) in enumerate(helpers.run_ranks(built_shards, world, moe_dir, chat_file)):
            assert len(shards) == 2 * 4, sorted(shards)  # q, k, v, o of 2 blocks; the experts stay unquantized
            for name, inner in shards.items():
                whole = to_nf4(stored[name.replace(".base_layer", "")].float())
                for attr, mine in inner.items():
                    theirs = getattr(whole, attr).numpy()
                    n = theirs.size // world if attr != "scaler_mean" else 0
                    theirs = theirs[rank * n:(rank + 1) * n] if n else theirs
                    assert mine.dtype == theirs.dtype and (mine == theirs).all(), (world, rank, name, attr)
    out = capfd.readouterr().out
    assert "loading on rank 0 and scattering: Qwen3MoeForCausalLM stores model.layers.0.mlp.experts.0." in out, out
    assert "note: the MoE experts (2 layers of fused 3-D weights) are not NF4" in out, out
