"""Regression tests for what probing the multi-node features found (plan, [parallel], apply_fsdp)."""
from __future__ import annotations

import json

import pytest

from finetune.config import ConfigError
from finetune.tools.plan import GIB, parse_gpu_memory
from helpers import invoke


def test_gpu_memory_takes_the_usual_spellings_and_refuses_a_size_of_no_bytes():
    assert [parse_gpu_memory(t) for t in ("80GB", "80G", "80gib", "80", "81920MB", "81920M")] == [80 * GIB] * 6
    assert parse_gpu_memory("1TB") == parse_gpu_memory("1T") == 1024 * GIB
    for text in ("0GB", "0.0000000001GB", "1e3", "80PB", "-1"):  # the second rounded to 0 bytes: division by zero
        with pytest.raises(ConfigError, match="--gpu-memory must be a size like 80GB"):
            parse_gpu_memory(text)
    result = invoke("plan", "--gpu-memory", "0.0000000001GB")
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [
        "error: --gpu-memory must be a size like 80GB or 24576MB, got '0.0000000001GB'"]


def test_a_gpu_attention_implementation_is_planned_on_the_cpu(llama_dir):
    """A GPU preset's flash_attention_2 was refused ("needs a CUDA device") and flex_attention crashed the process
    (fake tensors): both save O(seq) state for backward, which CPU sdpa stands in for."""
    def plan(attn):
        result = invoke("plan", "--model", llama_dir, "--nproc-per-node", 2, "--sac-ratios", 0, "--micro-batch-sizes",
                        1, "--json", "data.max_seq_len=32", f"model.attn_implementation={attn}")
        assert result.exit_code == 0, (attn, result.output, result.exception)
        return json.loads(result.stdout)["points"]
    sdpa = plan("sdpa")
    assert plan("flash_attention_2") == sdpa and plan("flex_attention") == sdpa
    assert plan("eager")[0]["activations"] > sdpa[0]["activations"]  # seq x seq probabilities are saved


def test_a_set_dp_shard_that_does_not_fit_names_the_world_and_dp_shard_that_do(llama_dir):
    """With parallel.dp_shard set, a plan that did not fit said "no world size fits", though larger shard groups
    shrink the sharded state as they do when dp_shard is derived."""
    from finetune.config import load_config
    from finetune.tools.plan import format_plan, load_arch, run_plan

    def plan(nnodes, gpu_bytes, dp_shard):
        cfg = load_config(None, {"model.path": str(llama_dir), "data.path": "-", "train.mixed_precision": "fp32",
                                 "data.max_seq_len": 64, "parallel.dp_replicate": 2, "parallel.dp_shard": dp_shard})
        return run_plan(cfg, load_arch(cfg, None), nnodes, 8, gpu_bytes, [1.0], [1])
    one_node, four_nodes = plan(1, GIB, 4)["best"]["total"], plan(4, GIB, 16)["best"]["total"]
    gpu = int((one_node + four_nodes) / 2 / 0.9)  # fits on 4 nodes (HSDP 2x16), not on 1 (2x4)
    small = plan(1, gpu, 4)
    world = small["smallest_world_size"]
    assert small["best"] is None and world and 8 < world <= 32 and world % 8 == 0
    assert plan(world // 8, gpu, world // 2)["best"] and not plan(world // 8 - 1, gpu, world // 2 - 4)["best"]
    assert format_plan(small).endswith(f"is {world} GPUs ({world // 8} nodes x 8; parallel.dp_shard={world // 2})")


def expert_placements(model_dir: str) -> dict:
    from finetune.distributed import init_distributed
    from finetune.model import build_model
    device, dims = init_distributed()
    model, _ = build_model(model_dir, device, dims.mesh, [], mixed_precision="fp32")
    return {n: (str(p.placements), tuple(p.to_local().shape)) for n, p in model.named_parameters()
            if "experts" in n or "gate.weight" in n}


def test_moe_experts_fewer_than_ranks_are_sharded_on_their_longest_dim(tmp_path, chat_file):
    """2 fused experts on 4 ranks sharded on dim 0 left 2 ranks without expert weights and gave the other 2 twice
    their share (Mixtral-8x7B on 16+ GPUs: no world size fit). They shard on their longest dim, train as one
    process does, and plan counts them so."""
    from conftest import make_model_dir
    from finetune.model import shard_dim
    from finetune.tools.plan import sharded_bytes
    from helpers import run_ranks, sft
    moe = make_model_dir(tmp_path / "moe", "chatml", "mixtral", tied=False, num_layers=2, num_local_experts=2,
                         num_experts_per_tok=1)
    placements = run_ranks(expert_placements, 4, str(moe))[3]
    gate_up = next(v for n, v in placements.items() if n.endswith("experts.gate_up_proj"))
    assert gate_up == ("(Shard(dim=1),)", (2, 80, 64))  # (2 experts, 2 x 160, 64) over 4 ranks
    one = sft(moe, chat_file, tmp_path / "one", "train.max_steps=2", "train.micro_batch_size=4")
    four = sft(moe, chat_file, tmp_path / "four", "train.max_steps=2", "train.micro_batch_size=1", nproc=4)
    assert [r["loss"] for r in four] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["grad_norm"] for r in four] == pytest.approx([r["grad_norm"] for r in one], rel=1e-5)
    assert shard_dim((8, 28672, 4096), 8) == 0 and shard_dim((8, 28672, 4096), 16) == 1
    assert shard_dim((2, 64), 4) == 1 and shard_dim((2, 66), 4) == 0  # FSDP2 shards dims > 0 only evenly
    assert sharded_bytes([((8, 28672, 4096), 8 * 28672 * 4096, 4)], 64) == 8 * 28672 * 4096 * 4 // 64


def test_the_slice_reader_fills_parameters_sharded_on_dim_1(tmp_path):
    """k_proj with 2 rows on 4 ranks is sharded on dim 1 (and on dim 0 at 3 ranks, where dim 1 does not divide):
    each rank's block equals the rank-0 load's, bit for bit."""
    from conftest import make_model_dir
    from helpers import run_ranks
    from test_io import both_loads
    narrow = make_model_dir(tmp_path / "narrow", "chatml", "llama", tied=False, num_layers=1, num_attention_heads=32,
                            num_key_value_heads=1)  # head_dim 2: k_proj and v_proj are (2, 64)
    for nproc, rows in ((4, [2, 2, 2, 2]), (3, [1, 1, 0])):
        per_rank = run_ranks(both_loads, nproc, str(narrow))
        assert all(path == "slices" and differ == [] and filled for path, differ, _, filled in per_rank)
        assert [r["model.layers.0.self_attn.k_proj.weight"] for _, _, r, _ in per_rank] == rows
