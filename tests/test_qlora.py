"""QLoRA (lora.quantize_base="nf4"): the frozen linear weights of the blocks held as NF4, quantized on load shard by
shard with the bytes of the whole tensor quantized at once (2, 4 and HSDP 2 x 2 ranks) at about half a byte a
parameter, as plan counts them; 2 ranks train like 1 process; checkpoints hold the adapters only and resume exactly;
exports merge into the original base; dpo's reference and bench's point; MoE experts and refusals."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import helpers
from conftest import make_model_dir
from helpers import export_hf, losses

RUN = ["data.pad_to_max=true"]  # as bench sets it: the runs below and bench's point take the same batches
QLORA = ["lora.rank=4", "lora.alpha=8", "lora.quantize_base=nf4", "train.lr=1e-2", "train.max_steps=4",
         "checkpoint.interval=2", "checkpoint.keep=0"]
# every linear weight of the blocks splits into 1, 2 or 4 row shards of whole NF4 factor blocks (16384 elements)
SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4)


@pytest.fixture(scope="module")
def qlora_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("qlora_llama"), "llama3", "llama", tied=False, num_layers=2,
                          **SIZES)


def sft(model_dir, data, out, *extra, nproc=1):
    return helpers.sft(model_dir, data, out, *QLORA, *extra, nproc=nproc)


@pytest.fixture(scope="module")
def runs(qlora_dir, chat_file, tmp_path_factory):
    """The same 4 QLoRA steps on 1 process (micro-batch 4) and on 2 ranks (2 each), checkpoints at steps 2 and 4; 2 of
    them on 4 ranks (1 each) with parallel.cpu_offload."""
    root = tmp_path_factory.mktemp("qlora_runs")
    sft(qlora_dir, chat_file, root / "one", *RUN, "train.micro_batch_size=4")
    sft(qlora_dir, chat_file, root / "two", *RUN, "train.micro_batch_size=2", nproc=2)
    sft(qlora_dir, chat_file, root / "host", *RUN, "train.micro_batch_size=1", "parallel.cpu_offload=true",
        "train.max_steps=2", nproc=4)  # 4 ranks with the shards, gradients and AdamW state in host memory
    sft(qlora_dir, chat_file, root / "bf16", *RUN, "train.micro_batch_size=4", "lora.quantize_base=none",
        "train.max_steps=1")  # LoRA's bf16 base: the first loss, before any update, is the base's
    return root


def test_two_ranks_train_like_one_process_and_checkpoints_hold_only_the_adapters(runs, qlora_dir):
    import torch.distributed.checkpoint as dcp
    from test_lora import read_weights
    one, two = losses(runs / "one"), losses(runs / "two")
    assert len(one) == 4 and one[-1] < one[0] - 0.05  # it learns
    assert two == pytest.approx(one, rel=1e-5, abs=1e-5)
    assert abs(one[0] - losses(runs / "bf16")[0]) > 1e-4  # the base it starts from is the 4-bit one
    step = runs / "two" / "checkpoints" / "step-4"
    metadata = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    keys = [k for k in metadata if k.startswith("model.")]
    assert keys and all(".lora_A.default." in k or ".lora_B.default." in k for k in keys), keys[:3]
    num_trainable = sum(metadata[k].size.numel() for k in keys)
    num_params = sum(t.numel() for t in read_weights(qlora_dir).values())
    data_bytes = sum(f.stat().st_size for f in step.glob("*.distcp"))
    assert 12 * num_trainable <= data_bytes < num_params, (data_bytes, num_trainable, num_params)  # no base
    marker = json.loads((step / "finetune_complete.json").read_text())
    assert marker["config"]["lora"]["quantize_base"] == "nf4" and marker["lora"]["base_fingerprint"]


def offloaded(model_dir, data):
    """On each rank: (FSDP's parameters, those it keeps in host memory, NF4 ones among them, the bytes of its largest
    unit's shards and of the largest unit's gradient shards, those of the first block's shards) of the QLoRA model
    built with parallel.cpu_offload."""
    from finetune.adapters.qlora import is_nf4
    from finetune.build import transforms
    from finetune.compat import fsdp_param_group
    from finetune.distributed import build_parallel_dims
    from finetune.model import build_model, find_layers
    cfg = helpers.sft_config(model_dir, data, "unused", *QLORA, "parallel.cpu_offload=true")
    dims = build_parallel_dims("cpu")
    model, _ = build_model(cfg.model.path, torch.device("cpu"), dims.mesh, transforms(cfg, dims, torch.device("cpu")),
                           mixed_precision=cfg.train.mixed_precision, cpu_offload=cfg.parallel.cpu_offload)
    units = [group.fsdp_params for m in model.modules() if (group := fsdp_param_group(m))]
    params = [fp for unit in units for fp in unit]

    def nbytes(local):
        return sum(getattr(local, a).nbytes for a in ("quantized_data", "quantized_scalers", "quantization_factor")) \
            if is_nf4(local) else local.nbytes
    shards = max(sum(nbytes(fp.sharded_param.to_local()) for fp in unit) for unit in units)
    grads = max(sum(fp.sharded_param.to_local().nbytes for fp in unit if fp.sharded_param.requires_grad)
                for unit in units)
    first = sum(nbytes(fp.sharded_param.to_local()) for fp in fsdp_param_group(find_layers(model)[0]).fsdp_params)
    return (len(params), sum(fp.offload_to_cpu for fp in params),
            sum(fp.offload_to_cpu and is_nf4(fp.sharded_param) for fp in params), shards, grads, first)


def test_host_offload_holds_every_shard_there_and_trains_as_on_the_device(runs, qlora_dir, chat_file):
    """parallel.cpu_offload: FSDP offloads each parameter (the NF4 base's too); 4 ranks so == 1 process."""
    assert losses(runs / "host") == pytest.approx(losses(runs / "one")[:2], rel=1e-5, abs=1e-5)
    num, on_host, nf4, shards, grads, _ = helpers.run_ranks(offloaded, 2, qlora_dir, chat_file)[0]
    assert num == on_host and nf4 == 2 * 7, (num, on_host, nf4)  # 2 blocks of 7 linear weights
    # plan: the state moves to host memory; on the GPU the shards of two units (gathered, prefetched) and one
    # unit's gradient shards, copied over; on one rank FSDP leaves the NF4 weights on the device
    from test_plan import planned
    qlora = {"lora.rank": 4, "lora.quantize_base": "nf4"}
    device = planned(qlora_dir, "fp32", [0.0], 1, 64, **qlora)
    host = planned(qlora_dir, "fp32", [0.0], 1, 64, **qlora, **{"parallel.cpu_offload": True})
    assert host["state"] == {} and host["host"] == device["state"]
    assert host["in_flight"]["offload copies"] == pytest.approx(2 * shards + grads, rel=1e-2)
    added = host["in_flight"]["offload copies"] - sum(device["state"].values())
    assert host["points"][0]["total"] == pytest.approx(device["points"][0]["total"] + added)
    one = planned(qlora_dir, "fp32", [0.0], 1, 64, nproc=1, **qlora, **{"parallel.cpu_offload": True})
    assert set(one["state"]) == {"params nf4"} and "params nf4" not in one["host"]
    num, on_host, nf4, shards, grads, first = helpers.run_ranks(offloaded, 1, qlora_dir, chat_file)[0]
    assert num == on_host and nf4 == 0  # nor are they all-gathered: plan's block in flight leaves them out
    assert one["in_flight"]["current+next"] == pytest.approx(first, rel=1e-2)  # the last block is held
    assert one["in_flight"]["offload copies"] == pytest.approx(2 * shards + grads, rel=1e-2)


def test_resume_on_one_rank_from_two_continues_exactly(runs, qlora_dir, chat_file, tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(runs / "two", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-4")
    (resumed / "metrics.jsonl").write_text("".join(line + "\n" for line in (resumed / "metrics.jsonl").read_text()
                                                   .splitlines()[:2]))
    sft(qlora_dir, chat_file, resumed, *RUN, "train.micro_batch_size=4")
    assert losses(resumed)[2:] == pytest.approx(losses(runs / "one")[2:], rel=1e-5, abs=1e-5)


def test_a_resume_onto_a_base_held_otherwise_is_refused(runs, qlora_dir, chat_file, tmp_path):
    """The adapters fit the 4-bit base they trained on: resuming them on LoRA's bf16 base is a change of settings."""
    from finetune.checkpoint import CheckpointError
    shutil.copytree(runs / "two", tmp_path / "resumed")
    with pytest.raises(CheckpointError, match=r"has other LoRA settings than this run: lora.quantize_base: "
                                              r"checkpoint 'nf4', run 'none'"):
        sft(qlora_dir, chat_file, tmp_path / "resumed", *RUN, "train.max_steps=6", "lora.quantize_base=none")


def test_exports_merge_into_the_original_base_and_peft_loads_the_adapter_onto_it(runs, qlora_dir, tmp_path, capsys):
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from safetensors.torch import load_file
    from torchao.quantization import to_nf4
    from transformers import AutoModelForCausalLM
    from test_lora import read_weights
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    capsys.readouterr()
    export_hf(str(runs / "two"), str(merged), "float32")  # verified against the checkpoint by export_hf itself
    assert f"merged into the original base weights of {qlora_dir}" in capsys.readouterr().out
    export_hf(str(runs / "two"), str(adapter), "float32", adapter=True)
    base = AutoModelForCausalLM.from_pretrained(qlora_dir, dtype=torch.float32)
    state = load_file(adapter / "adapter_model.safetensors")
    result = set_peft_model_state_dict(get_peft_model(base, LoraConfig.from_pretrained(adapter)), state)
    assert result.unexpected_keys == [] and [k for k in result.missing_keys if "lora_" in k] == []
    source, exported = read_weights(qlora_dir), read_weights(merged)
    scale = 8 / 4
    for name, tensor in source.items():
        module = "base_model.model." + name.removesuffix(".weight")
        if f"{module}.lora_A.weight" not in state:
            assert torch.equal(exported[name], tensor.float()), name
            continue
        delta = scale * state[f"{module}.lora_B.weight"].float() @ state[f"{module}.lora_A.weight"].float()
        assert delta.abs().max() > 0, name  # trained
        assert torch.allclose(exported[name], tensor.float() + delta, rtol=0, atol=1e-6), name
        dequantized = to_nf4(tensor.float()).get_original_weight()  # what the adapters trained on, not exported
        assert (exported[name] - (dequantized + delta)).abs().max() > 1e-3, name


def built_shards(model_dir, data, dp_replicate=1):
    """On each rank: the model built as sft builds it with QLoRA (HSDP: `dp_replicate` groups); its NF4 shards'
    inner tensors and byte counts."""
    from finetune.adapters.qlora import is_nf4
    from finetune.compat import local_tensor
    from finetune.build import transforms
    from finetune.distributed import build_parallel_dims
    from finetune.model import build_model
    cfg = helpers.sft_config(model_dir, data, "unused", *QLORA)
    dims = build_parallel_dims("cpu", dp_replicate)
    model, _ = build_model(cfg.model.path, torch.device("cpu"), dims.mesh, transforms(cfg, dims, torch.device("cpu")),
                           mixed_precision=cfg.train.mixed_precision)
    shards, frozen_bytes, frozen_numel = {}, 0, 0
    for name, p in model.named_parameters():
        local = local_tensor(p)
        if is_nf4(p):
            # numpy arrays: a torch tensor would travel back through shared memory that the rank's exit frees
            inner = {a: getattr(local, a).numpy().copy() for a in ("quantized_data", "quantized_scalers",
                                                             "quantization_factor", "scaler_mean")}
            shards[name] = inner
            frozen_bytes += sum(t.nbytes for k, t in inner.items() if k != "scaler_mean")
            frozen_numel += local.numel()
    return shards, frozen_bytes, frozen_numel


def test_each_rank_holds_the_rows_of_the_whole_tensor_quantized_at_once_at_half_a_byte_a_param(qlora_dir, chat_file):
    """And plan counts those bytes (its fake model is built unquantized)."""
    from torchao.quantization import to_nf4
    from test_lora import read_weights
    from test_plan import planned
    stored = read_weights(qlora_dir)
    num_linear = sum(1 for k, t in stored.items() if ".layers." in k and t.dim() == 2)
    # one process holds the whole tensor quantized at once: the 2-ranks-vs-1 run compares it; HSDP 2 x 2 shards as 2
    for world, replicas in ((2, 1), (4, 1), (4, 2)):
        ranks = helpers.run_ranks(built_shards, world, qlora_dir, chat_file, replicas)
        num_shards = world // replicas
        for rank, (shards, frozen_bytes, frozen_numel) in enumerate(ranks):
            index = rank % num_shards  # the mesh is (replicate, shard), ranks in row-major order
            # all linear weights of the blocks, none kept bf16 (a bf16 base would be 2 bytes a param)
            assert len(shards) == num_linear == 14, sorted(shards)
            assert 0.5 < frozen_bytes / frozen_numel < 0.53, (world, frozen_bytes / frozen_numel)
            for name, inner in shards.items():
                key = name.replace(".base_layer", "")
                whole = to_nf4(stored[key].float())  # fp32 masters run (helpers.BASE): the scales in fp32
                for attr, mine in inner.items():
                    theirs = getattr(whole, attr).numpy()
                    if attr != "scaler_mean":
                        n = theirs.size // num_shards
                        theirs = theirs[index * n:(index + 1) * n]
                    assert mine.dtype == theirs.dtype and (mine == theirs).all(), (world, replicas, rank, name, attr)
        if world == 2:  # plan's bf16 factors (a run in fp32 holds them in fp32): 2 bytes more per 16384 elements
            plan = planned(qlora_dir, "fp32", [0.0], 1, 64, **{"lora.rank": 4, "lora.quantize_base": "nf4"})
            assert plan["state"]["params nf4"] == pytest.approx(ranks[0][1], rel=1e-3)
            assert plan["in_flight"]["nf4 dequantized"] > 0


def layer_in_flight(model_dir, data):
    """On each rank: the bytes of the first block gathered (its NF4 weights, bf16 norms and adapters) and the peak
    bytes that its largest NF4 Linear's forward allocates (the weight dequantized)."""
    from finetune.adapters.qlora import is_nf4
    from finetune.build import transforms
    from finetune.distributed import build_parallel_dims
    from finetune.model import build_model, find_layers
    from finetune.tools.memory_model import LivePeak
    cfg = helpers.sft_config(model_dir, data, "unused", *QLORA, "train.mixed_precision=bf16")
    dims = build_parallel_dims("cpu")
    model, _ = build_model(cfg.model.path, torch.device("cpu"), dims.mesh, transforms(cfg, dims, torch.device("cpu")),
                           mixed_precision=cfg.train.mixed_precision)
    layer = find_layers(model)[0]
    layer.unshard()
    unit, linears = 0, []
    for m in layer.modules():
        for p in m.parameters(recurse=False):
            inner = [getattr(p, a) for a in ("quantized_data", "quantized_scalers", "quantization_factor")] \
                if is_nf4(p) else [p]
            unit += sum(t.numel() * t.element_size() for t in inner)
            linears += [m] if is_nf4(p) else []
    largest = max(linears, key=lambda m: m.weight.numel())
    with torch.no_grad(), LivePeak() as peak:
        largest(torch.zeros(1, largest.in_features, dtype=torch.bfloat16))
    return unit, peak.peak


def test_plan_counts_a_gathered_4bit_block_and_its_dequantized_weight_as_the_real_ones(qlora_dir, chat_file):
    """Per GPU in flight: a block's NF4 weights all-gathered and the bf16 copy its largest weight is dequantized
    into (2 bytes a value and one chunk's work, not torchao's 14 bytes a value), as the real 2-rank model's."""
    from test_plan import planned
    unit, dequantized = helpers.run_ranks(layer_in_flight, 2, qlora_dir, chat_file)[0]
    plan = planned(qlora_dir, "bf16", [1.0], 1, 64, **{"lora.rank": 4, "lora.quantize_base": "nf4"})
    # two blocks: the last stays gathered from forward to backward (held), so one is in flight beside it
    assert plan["in_flight"]["current+next"] == pytest.approx(unit, rel=0.05)
    assert plan["in_flight"]["nf4 dequantized"] == pytest.approx(dequantized, rel=0.05)
    weights = SIZES["hidden_size"] * SIZES["intermediate_size"]
    assert dequantized < 9 * weights  # torchao's own dequantization keeps 14 bytes a value alive


def test_bad_qlora_input_is_one_line_and_exit_2(qlora_dir, chat_file, tmp_path):
    cases = [(["lora.quantize_base=nf4"], "lora.quantize_base=nf4 quantizes the frozen base under LoRA adapters, "
                                          "and lora.rank=0 trains every weight in full"),
             ([*QLORA, "model.fp8=tensorwise"], "lora.quantize_base=nf4 with model.fp8=tensorwise"),
             ([*QLORA, "lora.quantize_base=int4"], "lora.quantize_base must be one of")]
    for extra, expect in cases:
        result = helpers.invoke("sft", "--model", qlora_dir, "--dataset", chat_file, "--output-dir", tmp_path / "out",
                                *helpers.BASE, *extra)
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and expect in lines[0], (extra, result.stderr)
        assert not (tmp_path / "out").exists()
    from finetune.errors import ModelError
    from finetune.adapters.qlora import fill_nf4
    from finetune.load import load_hf_weights
    from finetune.weights import MANIFEST
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / MANIFEST).write_text("{}")  # a prepared checkpoint: no safetensors slices to quantize
    with pytest.raises(ModelError, match="is a prepared checkpoint: lora.quantize_base quantizes the base as each "
                                         "rank reads its slices of the safetensors files"):
        load_hf_weights(None, None, str(tmp_path / "prepared"), fill=fill_nf4)


def test_dpo_on_a_4bit_base_takes_its_reference_with_the_adapters_off(qlora_dir, tmp_path):
    """The reference is the same NF4 base with the adapters off: at step 0 policy == reference (loss ln 2)."""
    from test_dpo import dpo, make_pairs
    pairs = helpers.write_jsonl(tmp_path / "pairs.jsonl", make_pairs(16))
    records = dpo(qlora_dir, pairs, tmp_path / "dpo", *QLORA, "train.lr=1e-2", "train.max_steps=3",
                  "train.micro_batch_size=2", "data.max_seq_len=512", nproc=2)
    assert records[0]["loss"] == pytest.approx(0.6931472, abs=1e-6)
    assert records[-1]["loss"] < records[0]["loss"]


def test_moe_experts_stay_unquantized_with_a_note_and_odd_shapes_are_named(capsys):
    """On the meta skeleton of a Mixtral: attention NF4, the fused 3-D experts not (a note says so); a weight whose rows
    do not split into whole factor blocks over the ranks is kept and named."""
    from functools import partial
    from transformers import MixtralConfig
    from finetune.adapters.lora import apply_lora
    from finetune.adapters.qlora import apply_nf4, is_nf4
    from finetune.model import build_skeleton, find_layers
    config = MixtralConfig(vocab_size=512, num_hidden_layers=1, num_local_experts=4, num_experts_per_tok=2,
                           **{**SIZES, "num_key_value_heads": 2})  # k_proj, v_proj: 128 x 256, one block a rank of 4
    for shards, kept in ((1, 0), (4, 2)):
        skeleton = build_skeleton(config)
        capsys.readouterr()
        apply_lora(skeleton, find_layers(skeleton), rank=4, alpha=8.0, dropout=0.0,
                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], modules_to_save=[],
                   base_dtype=torch.bfloat16, quantize=partial(apply_nf4, shards=shards))
        out = capsys.readouterr().out
        quantized = sorted(n for n, p in skeleton.named_parameters() if is_nf4(p))
        assert len(quantized) == 4 - kept and all(".self_attn." in n for n in quantized), quantized
        assert not any(is_nf4(p) for n, p in skeleton.named_parameters() if ".experts." in n)
        assert "note: the MoE experts (1 layers of fused 3-D weights) are not NF4" in out, out
        assert (f"note: {kept} frozen linear weights of the blocks are not NF4, e.g. layers.0.self_attn.k_proj."
                f"base_layer.weight [128, 256] does not split into 4 row shards" in out) == bool(kept), out


def test_bench_runs_qlora_with_sfts_step(runs, qlora_dir, chat_file, tmp_path):
    """bench's point on a 4-bit base, 2 ranks, with the settings of the fixture's 2-rank run: its first losses."""
    from finetune.tools.bench import run_point
    cfg = helpers.sft_config(qlora_dir, chat_file, tmp_path / "bench", *QLORA, *RUN, "train.micro_batch_size=2")
    points = helpers.run_ranks(run_point, 2, cfg, 2, 0)
    assert points[0]["losses"] == pytest.approx(losses(runs / "two")[:2], rel=1e-6)
