"""`finetune plan`: its figures against the real thing at 2 gloo ranks (bytes saved for backward at AC ratios 0 /
0.5 / 1, sharded parameters, gradients and AdamW state, tied and untied; HSDP 2x2 shards as FSDP 2), the 70B preset
fitting 8 x 8 H100s offline, a model that fits nowhere (exit 1, the smallest world that fits, which then does), bad
flags (one line, exit 2); parallel.ep against the real expert-parallel model at 2 ranks."""
from __future__ import annotations

import gc
import json

import pytest
import torch

from finetune.config import load_config
from finetune.tools.plan import GIB, load_arch, run_plan
from helpers import REPO, invoke, run_ranks


def measure_real(path: str, mixed_precision: str, ratios: list[float], micro_batch_size: int, seq_len: int,
                 lora_rank: int = 0) -> dict:
    """On each rank: bench's bytes saved for backward of the real sharded model at each AC ratio, then the bytes of
    the sharded parameters, gradients and AdamW state after one optimizer step (keys as the planner's)."""
    from finetune.tools.bench import saved_for_backward_mb
    from finetune.distributed import init_distributed
    from finetune.loss import label_targets
    from finetune.model import build_model
    from finetune.optim import build_optimizer
    device, dims = init_distributed()
    torch.manual_seed(0)
    saved, model = {}, None
    for ratio in ratios:
        del model  # the previous model's memory first (0.5B: 1 GB of fp32 shards and as much of gradients a rank)
        gc.collect()
        lora = dict(rank=lora_rank, alpha=16.0, dropout=0.0, target_modules="all-linear", modules_to_save=[])
        from finetune.adapters.lora import lora_transforms
        t = lora_transforms(lora, seed=0, path=path, mixed_precision=mixed_precision) if lora_rank else None
        model, _ = build_model(path, device, dims.mesh, t, mixed_precision=mixed_precision, ac_ratio=ratio)
        ids = torch.randint(model.config.vocab_size, (micro_batch_size, seq_len))
        batch = {"input_ids": ids, **label_targets(ids, None)}  # a target at every position but a row's last
        saved[ratio] = saved_for_backward_mb(model, batch) * 2**20  # and backward
    optimizer = build_optimizer(model, 1e-3, 0.1, (0.9, 0.95), 1e-8)
    optimizer.step()
    state = {}
    for p in model.parameters():
        adamw = [("optimizer", v) for v in optimizer.state[p].values() if v.dim()]  # not `step`
        tensors = [("params", p)] + ([("grads", p.grad)] + adamw if p.requires_grad else [])
        for kind, t in tensors:
            key = f"{kind} {str(t.dtype).removeprefix('torch.')}"
            state[key] = state.get(key, 0) + t.to_local().numel() * t.element_size()
    return {"saved": saved, "state": state}


def planned(path, mixed_precision, ratios, micro_batch_size, seq_len, nnodes=1, nproc=2, gpu_bytes=80 * GIB,
            **overrides):
    cfg = load_config(None, {"model.path": str(path), "data.path": "-", "train.mixed_precision": mixed_precision,
                             "data.max_seq_len": seq_len, **overrides})
    return run_plan(cfg, load_arch(cfg, None), nnodes, nproc, gpu_bytes, ratios, [micro_batch_size])


@pytest.mark.parametrize("model, mixed_precision, ratios, lora_rank", [("llama_dir", "bf16", [0.0, 0.5, 1.0], 0),
                                                                       ("qwen_tied_dir", "fp32", [0.5], 0),
                                                                       ("qwen_tied_dir", "bf16", [1.0], 8)])
def test_plan_matches_the_real_sharded_model_at_2_ranks(model, mixed_precision, ratios, lora_rank, request):
    path = request.getfixturevalue(model)
    real = run_ranks(measure_real, 2, str(path), mixed_precision, ratios, 2, 64, lora_rank)[0]
    plan = planned(path, mixed_precision, ratios, 2, 64, **{"lora.rank": lora_rank})
    assert ("params bfloat16" in plan["state"]) == bool(lora_rank)  # LoRA: a frozen bf16 base, fp32 adapters
    assert plan["state"] == real["state"]  # the very shards, gradients and optimizer state of rank 0
    for point in plan["points"]:
        measured = real["saved"][point["ac_ratio"]]
        assert point["saved"] == pytest.approx(measured, rel=0.10), (point, measured)
        assert 0 < point["activations"] < point["saved"]
    saved = [p["activations"] for p in plan["points"]]
    assert saved == sorted(saved, reverse=True)  # checkpointing more blocks keeps less
    hsdp = planned(path, mixed_precision, ratios[:1], 2, 64, nnodes=2, **{"parallel.dp_replicate": 2,
                                                                           "lora.rank": lora_rank})
    assert hsdp["parallel"] == "HSDP 2x2" and hsdp["state"] == real["state"]  # sharded within a group of 2


def test_70b_preset_fits_8x8_h100_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the preset's model.path is a hub id: model.arch is what plan reads
    result = invoke("plan", "--config", REPO / "configs/llama3-70b.toml", "--nnodes", 8, "--nproc-per-node", 8,
                    "--gpu-memory", "80GB", "--sac-ratios", 1, "--micro-batch-sizes", 1, "--json")
    assert result.exit_code == 0, (result.output, result.exception)
    plan = json.loads(result.stdout)
    assert plan["world_size"] == 64 and 70e9 < plan["num_params"] < 71e9
    assert plan["state"]["params float32"] == pytest.approx(plan["num_params"] * 4 / 64, rel=0.01)
    best = plan["best"]
    assert (best["ac_ratio"], best["micro_batch_size"]) == (1.0, 1)
    assert best["free"] >= 0.1 * 80 * GIB and best["total"] > 40 * GIB
    block_inputs = 80 * 8192 * 8192 * 2  # every block checkpointed: each keeps its bf16 input for the recompute
    assert block_inputs < best["activations"] < 1.05 * block_inputs and best["recompute"] > block_inputs / 80


def test_a_model_that_fits_nowhere_names_the_smallest_world_that_does(llama_dir):
    def plan(nnodes, gpu_bytes):
        return planned(llama_dir, "fp32", [1.0], 1, 64, nnodes=nnodes, nproc=8, gpu_bytes=gpu_bytes)
    one_node, eight_nodes = plan(1, GIB)["best"]["total"], plan(8, GIB)["best"]["total"]
    gpu = int((one_node + eight_nodes) / 2 / 0.9)  # fits on 8 nodes, not on 1 (10% must stay free)
    small = plan(1, gpu)
    world = small["smallest_world_size"]
    assert small["best"] is None and world % 8 == 0 and 8 < world <= 64
    assert plan(world // 8, gpu)["best"] and not plan(world // 8 - 1, gpu)["best"]
    result = invoke("plan", "--model", llama_dir, "--nproc-per-node", 8, "--gpu-memory", f"{gpu / 2**20}MB",
                    "--sac-ratios", 1, "--micro-batch-sizes", 1, "data.max_seq_len=64", "train.mixed_precision=fp32")
    assert result.exit_code == 1, (result.output, result.exception)
    assert "| 1 | 1 |" in result.stdout and "| no |" in result.stdout
    assert f"does not fit: no point leaves 10% of {gpu / 2**20:.3g} MiB free; the smallest world size that would " \
           f"fit is {world} GPUs ({world // 8} nodes x 8)" in result.stdout


@pytest.mark.parametrize("flags, message", [
    (["--gpu-memory", "0GB"], "--gpu-memory must be a size like 80GB or 24576MB, got '0GB'"),
    (["--gpu-memory", "lots"], "--gpu-memory must be a size like 80GB"),
    (["--micro-batch-sizes", "0,1"], "--micro-batch-sizes must be comma-separated integers > 0, got '0,1'"),
    (["--sac-ratios", "2"], "--sac-ratios must be comma-separated numbers in [0, 1], got '2'"),
    (["--nnodes", "0"], "--nnodes must be >= 1, got 0"),
    (["ac.mode=fast"], "ac.mode must be one of 'block', 'op', got 'fast'"),
    (["parallel.dp_replicate=3"], "parallel.dp_replicate=3 does not divide the 8 launched ranks"),
])
def test_bad_flags_are_one_line_and_exit_2(llama_dir, flags, message):
    result = invoke("plan", "--model", llama_dir, *flags)
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_a_bad_arch_file_is_one_line(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text('[model]\npath = "org/unreachable"\narch = "nope.json"\n')
    result = invoke("plan", "--config", preset)
    assert result.exit_code == 2 and "model.arch 'nope.json' is not a readable HF config.json" in result.stderr


def test_json_is_the_whole_stdout_with_lora_and_tied_embeddings(qwen_tied_dir):
    result = invoke("plan", "--model", qwen_tied_dir, "--nproc-per-node", 2, "--sac-ratios", "0.5",
                    "--micro-batch-sizes", 1, "--json", "lora.rank=4", "train.mixed_precision=bf16")
    assert result.exit_code == 0, (result.output, result.exception)
    plan = json.loads(result.stdout)  # the build's notes ("lora: rank 4 ...") went to stderr
    assert "lora: rank 4" in result.stderr and plan["parallel"] == "FSDP 2"
    assert set(plan["state"]) == {"params bfloat16", "params float32", "grads float32", "optimizer float32"}
    state = plan["state"]
    assert state["optimizer float32"] == 2 * state["grads float32"] == 2 * state["params float32"]  # adapters only
    assert [(p["ac_ratio"], p["micro_batch_size"]) for p in plan["points"]] == [(0.5, 1)] and plan["best"]


def saved_at_cp(path: str, cp: int, seq_len: int) -> float:
    """Bench's bytes saved for backward on this rank of a one-row (one-sample) micro-batch split over cp ranks."""
    from finetune.tools.bench import saved_for_backward_mb
    from finetune.parallel.context import split_batch
    from finetune.data.collate import sample_boundaries
    from finetune.distributed import init_distributed
    from finetune.loss import label_targets
    from finetune.model import build_model
    device, dims = init_distributed(cp=cp)
    from finetune.parallel.context import cp_rank
    from finetune.build import transforms
    from finetune.config import load_config
    t = transforms(load_config(None, {"parallel.cp": cp}), dims, device)
    model, _ = build_model(path, device, dims.mesh, t, attn_implementation="auto")
    ids = torch.randint(model.config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "position_ids": torch.arange(seq_len)[None], **sample_boundaries([seq_len]),
             **label_targets(ids, None)}
    return saved_for_backward_mb(model, split_batch(batch, cp_rank(dims), cp) if cp > 1 else batch) * 2**20


def test_plan_with_cp_and_offload_matches_the_real_split_and_the_longest_row_fits(llama_dir):
    """cp 2 on 2 ranks: the planned bytes saved for backward are the real ones (FSDP over both ranks, as cp 1);
    with every block checkpointed, ac.offload leaves (almost) nothing on the GPU up to the last block. Then
    --max-seq-len: cp 2 fits twice cp 1's row, and its answer fits when planned."""
    real = run_ranks(saved_at_cp, 2, str(llama_dir), 2, 256)[0]
    at_cp = planned(llama_dir, "bf16", [0.0], 1, 256, **{"parallel.cp": 2})
    assert at_cp["points"][0]["saved"] == pytest.approx(real, rel=0.10) and at_cp["parallel"] == "FSDP 1 x cp 2"
    ac = {off: planned(llama_dir, "bf16", [1.0], 1, 256, **{"ac.ratio": 1.0, "ac.offload": off})["points"][0]
          for off in (False, True)}
    assert ac[True]["activations"] < 0.02 * ac[False]["activations"]
    result = invoke("plan", "--model", llama_dir, "--nproc-per-node", 2, "--gpu-memory", "160MB", "--sac-ratios", "1",
                    "--max-seq-len", "--json")
    assert result.exit_code == 0, (result.output, result.exception)
    search = json.loads(result.stdout)
    best, line = search["best"], search["max_seq_len"]["1.0"]
    assert (best["cp"], best["ac_ratio"]) == (2, 1.0) and best["max_seq_len"] >= 4096
    assert abs(line["2"] - 2 * line["1"]) <= 1024  # the same tokens per rank
    plan = planned(llama_dir, "bf16", [1.0], 1, best["max_seq_len"], gpu_bytes=160 * 2**20, **{"parallel.cp": 2})
    assert plan["points"][0]["fits"]


def test_a_plan_that_more_gpus_cannot_fit_does_not_search_every_world_size(llama_dir, monkeypatch):
    """The activations alone exceed the GPU: no world size fits, said at once (the search tried every world size up
    to 2**16: 20 s of CPU for this 4-layer model on 1 rank, minutes for a 70B one). Where the sharded state is what
    does not fit, the search still names the first world that fits."""
    from finetune.tools import plan as planner
    tried, sharded_bytes = [], planner.sharded_bytes

    def counted(params, world):
        tried.append(world)
        return sharded_bytes(params, world)
    monkeypatch.setattr(planner, "sharded_bytes", counted)
    alone = planned(llama_dir, "fp32", [0.0], 1, 256, nproc=1, gpu_bytes=2**20)
    assert alone["points"][0]["activations"] > 2**20  # more than the whole GPU
    assert alone["best"] is None and alone["smallest_world_size"] is None and tried == []
    state = planned(llama_dir, "fp32", [0.0], 1, 256, nproc=1, gpu_bytes=12 * 2**20)  # 4 MB of state on 1 rank
    assert state["best"] is None and tried == list(range(2, state["smallest_world_size"] + 1))


def ep_storage(model_dir, ep: int) -> tuple[dict, int]:
    """On each rank: the bytes of its parameters by dtype (sft's model with parallel.ep=`ep`) and those of the first
    block gathered (its FSDP units: the block's, and the experts' over the ranks holding the same experts)."""
    from torch.distributed.fsdp import FSDPModule

    from finetune.build import transforms
    from finetune.distributed import init_distributed
    from finetune.model import build_model, find_layers
    device, dims = init_distributed(ep=ep)
    cfg = load_config(None, {"model.path": str(model_dir), "data.path": "-", "parallel.ep": ep,
                             "train.mixed_precision": "bf16"})
    model, _ = build_model(str(model_dir), device, dims.mesh, transforms(cfg, dims, device),
                           mixed_precision=cfg.train.mixed_precision)
    params = {}
    for p in model.parameters():
        key = f"params {str(p.dtype).removeprefix('torch.')}"
        params[key] = params.get(key, 0) + p.to_local().numel() * p.element_size()
    model(input_ids=torch.zeros(1, 8, dtype=torch.long))  # FSDP's lazy init: its bf16 all-gathers
    for unit in (m for m in find_layers(model)[0].modules() if isinstance(m, FSDPModule)):
        unit.unshard()
    block = find_layers(model)[0].parameters()
    return params, sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in block)


def test_plan_with_ep_holds_each_ranks_experts_as_the_real_model_and_says_ep_decides_the_fit(tmp_path):
    """ep 2 on 2 ranks: the parameters a rank holds and a block in flight (attention and its 4 of the 8 experts, not
    all 8) as the real model's; --json carries ep and each point's total with FSDP alone."""
    from test_moe import make_moe_dir
    path = make_moe_dir(tmp_path / "moe", "qwen3_moe", fused=True, num_layers=3)
    params, block = run_ranks(ep_storage, 2, path, 2)[0]
    result = invoke("plan", "--model", path, "--nproc-per-node", 2, "--sac-ratios", "0", "--micro-batch-sizes", 1,
                    "--json", "parallel.ep=2", "data.max_seq_len=32", "train.mixed_precision=bf16")
    assert result.exit_code == 0, (result.output, result.exception)
    plan = json.loads(result.stdout)
    assert plan["ep"] == 2 and plan["parallel"] == "FSDP 2, experts ep 2"
    assert plan["state"]["params float32"] == pytest.approx(params["params float32"], rel=0.05)
    # three blocks: the last is held from forward to backward, the other two are in flight in turn
    assert plan["in_flight"]["current+next"] == pytest.approx(2 * block, rel=0.05)
    point = plan["points"][0]
    assert point["total_without_ep"] > point["total"] > 0
    # a token's 2 chosen experts' rows of 64 bf16 values, sent and received, for 32 tokens
    assert point["ep_dispatch"] == 2 * 2 * 64 * 2 * 32
