"""70B-ready I/O (finetune/weights.py, finetune/load.py): every rank reads its own slices of the HF safetensors,
bit-equal to the rank-0 load for every test architecture at 1, 2 and 4 ranks with sizes that do not divide by the
world size; strict about what the files hold. Ranks run in-process (run_ranks)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import BASE, invoke, run_ranks

ODD = dict(vocab_size=603, intermediate_size=163)  # 603 rows on 2 or 4 ranks: chunks of 302/301, 151/151/151/150
ARCHES = [("llama", False), ("llama", True), ("qwen2", True), ("gemma2", True), ("gpt_neox", False),
          ("mixtral", False)]


@pytest.fixture(scope="module")
def odd_models(tmp_path_factory):
    from conftest import make_model_dir
    root = tmp_path_factory.mktemp("odd")
    return {(arch, tied): make_model_dir(root / f"{arch}-{tied}", "chatml", arch, tied=tied, num_layers=2, **ODD)
            for arch, tied in ARCHES}


def both_loads(model_dir, lora: bool = False, dp_replicate: int = 1):
    """On each rank: (the path locate_slices takes, shard names whose fp32 values differ between the slice reader and
    the rank-0 load, the local row counts, whether every shard was filled)."""
    from finetune.distributed import init_distributed
    from finetune import hub
    from finetune.load import locate_slices
    from finetune.model import build_model, build_skeleton
    device, dims = init_distributed(dp_replicate=dp_replicate)
    mesh = dims.mesh
    lora_cfg = dict(rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"], modules_to_save=[]) \
        if lora else None
    from finetune.adapters.lora import lora_transforms
    t = lora_transforms(lora_cfg, seed=0, path=str(model_dir)) if lora else []
    model, _ = build_model(str(model_dir), device, mesh, t, mixed_precision="bf16" if lora else "fp32")
    located = locate_slices(model, build_skeleton(model.config, None), str(model_dir))
    new = {n: p.to_local().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(float("nan"))
    hub.load_hf_weights_rank0(model, str(model_dir))
    old = {n: p.to_local() for n, p in model.named_parameters() if "lora_" not in n}
    differ = [n for n in old if not torch.equal(new[n].view(torch.uint8), old[n].view(torch.uint8))]  # bits
    filled = all(not t.isnan().any() for t in old.values())
    return ("slices" if isinstance(located, dict) else located), differ, {n: t.shape[0] for n, t in old.items()
                                                                  if t.dim()}, filled


def all_loads(model_dirs):
    return [both_loads(d) for d in model_dirs]


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_slice_reader_equals_the_rank0_load_bit_for_bit(nproc, odd_models):
    per_rank = run_ranks(all_loads, nproc, [odd_models[a] for a in ARCHES])
    for i, (arch, tied) in enumerate(ARCHES):
        results = [r[i] for r in per_rank]
        for path, differ, rows, filled in results:
            assert filled and differ == [], (arch, tied, differ)
            if arch == "mixtral":  # per-expert weights on disk, fused in memory: a real conversion on load
                assert "converts on load" in path, path
            else:
                assert path == "slices", (arch, path)
        vocab = [r["model.embed_tokens.weight" if arch != "gpt_neox" else "gpt_neox.embed_in.weight"]
                 for _, _, r, _ in results]
        assert sum(vocab) == 603 and len(set(vocab)) == (1 if nproc == 1 else 2)  # uneven shards were read


def test_slice_reader_under_hsdp_reads_the_slice_of_each_replica_group(odd_models):
    for arch in (("llama", False), ("qwen2", True)):  # 2 replica groups x 2 shards: (Replicate, Shard(0)) params
        per_rank = run_ranks(both_loads, 4, odd_models[arch], False, 2)
        assert all(path == "slices" and differ == [] and filled for path, differ, _, filled in per_rank), arch
        assert [r["model.embed_tokens.weight"] for _, _, r, _ in per_rank] == [302, 301, 302, 301]


def test_slice_reader_under_lora_loads_the_frozen_bf16_base(odd_models):
    for path, differ, _, filled in run_ranks(both_loads, 2, odd_models["llama", False], True):
        assert path == "slices" and differ == [] and filled


def load_on_rank(model_dir):
    from finetune.distributed import init_distributed
    from finetune.model import build_model
    device, dims = init_distributed()
    mesh = dims.mesh
    build_model(str(model_dir), device, mesh, mixed_precision="fp32")


def write_sharded(src, dst):
    """`src` (one safetensors file) as 3 files with an index, like save_pretrained with a small shard size."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for i in range(3):
        part = names[i::3]
        file = f"model-{i + 1:05d}-of-00003.safetensors"
        save_file({n: tensors[n] for n in part}, dst / file, metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def edit_tensors(model_dir, edit):
    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("case,expect", [
    ("missing", "lacks the parameter model.layers.1.mlp.up_proj.weight"),
    ("unexpected", "has no place for, e.g. model.layers.0.mlp.extra.weight"),
    ("shape", "model.norm.weight has shape [63], the model of its config.json needs [64]"),
    ("dtype", "model.norm.weight is stored as I32, which does not load into a float32 parameter"),
    ("file", "names 1 file(s) that do not exist, e.g. model-00002-of-00003.safetensors"),
    ("index", "says model.norm.weight is in model-00002-of-00003.safetensors, but that file does not hold it"),
    ("truncated", "model.safetensors has {size} bytes, its header describes {full} (a truncated copy?)"),
])
def test_strict_load_is_one_error_line_before_training(case, expect, odd_models, chat_file, tmp_path):
    src, bad = odd_models["llama", False], tmp_path / "bad"
    if case in ("file", "index"):
        weight_map = write_sharded(src, bad)
        if case == "file":
            (bad / "model-00002-of-00003.safetensors").unlink()
        else:
            index = json.loads((bad / "model.safetensors.index.json").read_text())
            assert weight_map["model.norm.weight"] != "model-00002-of-00003.safetensors"
            index["weight_map"]["model.norm.weight"] = "model-00002-of-00003.safetensors"
            (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    elif case == "truncated":  # refused when the header is read, before any tensor is
        shutil.copytree(src, bad)
        full = (bad / "model.safetensors").stat().st_size
        with open(bad / "model.safetensors", "r+b") as f:
            f.truncate(full - 100)
        expect = expect.format(size=full - 100, full=full)
    else:
        shutil.copytree(src, bad)
        edit_tensors(bad, {
            "missing": lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
            "unexpected": lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2, 2)}),
            "shape": lambda t: t.update({"model.norm.weight": t["model.norm.weight"][:63].clone()}),
            "dtype": lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)}),
        }[case])
    from finetune.errors import ModelError
    with pytest.raises(ModelError) as e:
        run_ranks(load_on_rank, 2, bad)
    assert expect in str(e.value) and "\n" not in str(e.value)
    if case == "missing":  # through the CLI: `error: <line>`, exit 2, nothing trained
        out = tmp_path / "out"
        result = invoke("sft", "--model", bad, "--dataset", chat_file, "--output-dir", out, *BASE)
        assert result.exit_code == 2, result.output
        assert result.stderr.strip().splitlines()[-1] == f"error: '{bad}' lacks the parameter " \
                                                        f"model.layers.1.mlp.up_proj.weight"
        assert not (out / "checkpoints").exists()


def test_a_sharded_dir_loads_like_the_single_file(odd_models, tmp_path):
    src = odd_models["qwen2", True]
    sharded = tmp_path / "sharded"
    write_sharded(src, sharded)
    for path, differ, _, filled in run_ranks(both_loads, 2, sharded):
        assert path == "slices" and differ == [] and filled


def export_on_rank(checkpoint, out, max_shard_size="60KB"):
    from helpers import export_hf
    export_hf(str(checkpoint), str(out), "bfloat16", max_shard_size)


def test_export_on_2_processes_writes_the_bytes_of_1(llama_dir, chat_file, reference, tmp_path, capfd):
    run = reference(llama_dir, chat_file, "train.lr=0", "train.max_steps=2", "train.micro_batch_size=4")
    one, two = tmp_path / "one", tmp_path / "two"
    export_on_rank(run, one)
    run_ranks(export_on_rank, 2, run, two)
    assert "verified" in capfd.readouterr().out
    files = sorted(p.name for p in one.iterdir() if p.name != "finetune_export.json")  # it records the time
    assert len([f for f in files if f.endswith(".safetensors")]) > 2 and "model.safetensors.index.json" in files
    assert files == sorted(p.name for p in two.iterdir() if p.name != "finetune_export.json")
    for f in files:
        assert (one / f).read_bytes() == (two / f).read_bytes(), f
    assert not list(tmp_path.glob(".*.partial-*"))  # no temp dir left


def test_sft_with_checkpoint_export_hf_writes_what_export_hf_writes(qwen_tied_dir, chat_file, tmp_path):
    from helpers import sft
    run = tmp_path / "run"
    sft(qwen_tied_dir, chat_file, run, "train.max_steps=2", "train.micro_batch_size=2", "checkpoint.export_hf=true",
        nproc=2)
    export_on_rank(run, tmp_path / "later", "5GB")  # export-hf of the final checkpoint, one process
    later = tmp_path / "later"
    files = sorted(p.name for p in later.iterdir() if p.name != "finetune_export.json")
    assert files == sorted(p.name for p in (run / "hf").iterdir() if p.name != "finetune_export.json")
    for f in files:
        assert (later / f).read_bytes() == (run / "hf" / f).read_bytes(), f
    assert json.loads((run / "hf" / "finetune_export.json").read_text())["weights"] == "the live model"


def local_dir_of_hub_id(model_dir, fail):
    """hub.local_dir("org/model") with snapshot_download replaced by a fake hub cache that records its calls."""
    import huggingface_hub
    from finetune.hub import local_dir
    calls = []

    def snapshot_download(repo_id, allow_patterns=None, local_files_only=False):
        calls.append("cache" if local_files_only else "download")
        if fail and not local_files_only:
            raise OSError("hub unreachable")
        return str(model_dir)
    huggingface_hub.snapshot_download = snapshot_download
    try:
        return str(local_dir("org/model")), calls
    except Exception as e:  # noqa: BLE001 - the error each rank saw
        return str(e), calls


def test_a_hub_id_is_downloaded_once_per_node(odd_models):
    model_dir = odd_models["llama", False]
    results = run_ranks(local_dir_of_hub_id, 2, model_dir, False)
    assert results == [(str(model_dir), ["download", "cache"]), (str(model_dir), ["cache"])]
    results = run_ranks(local_dir_of_hub_id, 2, model_dir, True)  # every rank reports the download's failure
    assert [r[0] for r in results] == ["cannot download 'org/model': OSError: hub unreachable"] * 2
