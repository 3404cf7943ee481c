"""prepare-checkpoint and export-hf: an lr=0 run exports exactly the original tensors (untied Llama, tied Qwen2), a
sharded export loads like a single-file one, a prepared checkpoint (saved on 2 ranks) trains like the HF dir on 1
and 2 ranks, and bad input is one line with exit 2 and nothing written. Training runs in-process (run_ranks) and
most exports call export_hf directly; the CLI runs once for prepare-checkpoint (2 ranks) and once for export-hf."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import BASE, count_builds_and_opens, invoke, losses, run_cli, sft

LR0 = ("train.lr=0", "train.max_steps=2", "train.micro_batch_size=4")


def export(checkpoint, out, dtype: str = "bfloat16", max_shard_size: str = "5GB") -> str:
    """finetune.export.export_hf in this process; returns what it printed."""
    import contextlib
    import io
    from helpers import export_hf
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        export_hf(str(checkpoint), str(out), dtype, max_shard_size)
    return printed.getvalue()


def read_weights(model_dir) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def logits_of(model_dir) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.arange(3, 40).reshape(1, -1)).logits


@pytest.fixture(scope="module")
def llama_run(llama_dir, chat_file, reference):
    """2 steps at lr=0 from the HF dir: a checkpoint holding the original weights, and the reference losses."""
    return reference(llama_dir, chat_file, *LR0)


@pytest.fixture(scope="module")
def llama_export(llama_run, tmp_path_factory):
    """Through the real CLI (the one export-hf subprocess of the suite)."""
    out = tmp_path_factory.mktemp("llama_export") / "hf"
    proc = run_cli("export-hf", "--checkpoint", llama_run, "--output-dir", out, "--dtype", "bfloat16")
    assert "verified" in proc.stdout and "max abs diff 0" in proc.stdout, proc.stdout
    return out


@pytest.fixture(scope="module")
def prepared(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "llama-prepared"
    run_cli("prepare-checkpoint", "--model", llama_dir, "--output-dir", out, "--nproc-per-node", 2)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen_tied"])
def test_lr0_training_exports_the_original_tensors(family, request, chat_file, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model_dir = request.getfixturevalue(f"{family}_dir")
    if family == "llama":
        out = request.getfixturevalue("llama_export")
    else:
        sft(model_dir, chat_file, tmp_path / "run", *LR0)
        out = tmp_path / "hf"
        printed = export(tmp_path / "run", out, "bfloat16")
        assert "verified" in printed and "max abs diff 0" in printed, printed

    original, exported = read_weights(model_dir), read_weights(out)
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert set(exported) == set(original)  # save_pretrained's key set: no lm_head.weight when tied
    for name, tensor in original.items():
        assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], tensor), name

    config = json.loads((out / "config.json").read_text())
    tied = family == "qwen_tied"
    assert config["dtype"] == "bfloat16" and config["tie_word_embeddings"] is tied
    assert config["architectures"] == json.loads((Path(model_dir) / "config.json").read_text())["architectures"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    lm_head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert (lm_head is embed) is tied
    want_head = original["model.embed_tokens.weight" if tied else "lm_head.weight"].float()
    assert torch.equal(lm_head, want_head)
    text = "<|im_start|>user\nRepeat alpha<|im_end|>" if tied else "Repeat alpha beta"
    ids = [AutoTokenizer.from_pretrained(d)(text)["input_ids"] for d in (out, model_dir)]
    assert ids[0] == ids[1]
    assert (out / "generation_config.json").is_file() and (out / "finetune_export.json").is_file()


@pytest.mark.parametrize("arch,tied", [("gemma2", True), ("gpt_neox", False), ("mixtral", False)])
def test_lr0_export_of_other_architectures_matches_save_pretrained(arch, tied, chat_file, tmp_path):
    """Gemma2 has no sdpa path (eager is used); GPT-NeoX renames lm_head to embed_out on disk; Mixtral fuses its
    experts in memory and stores them one by one: the export holds save_pretrained's names, shapes and values."""
    from conftest import make_model_dir
    model_dir = make_model_dir(tmp_path / "model", "chatml", arch, tied=tied, num_layers=2)
    sft(model_dir, chat_file, tmp_path / "run", *LR0)
    out = tmp_path / "hf"
    printed = export(tmp_path / "run", out, "bfloat16", "60KB")
    assert "verified" in printed and "max abs diff 0" in printed, printed
    assert len(list(out.glob("model-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    original, exported = read_weights(model_dir), read_weights(out)
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], tensor), name


def test_sharded_export_of_a_prepared_checkpoint_gives_the_same_logits(llama_export, prepared, tmp_path):
    single, sharded = llama_export, tmp_path / "sharded"
    sharded.mkdir()  # an earlier export there is replaced whole: stale shards must not survive
    (sharded / "finetune_export.json").write_text("{}")
    (sharded / "model-00001-of-00009.safetensors").write_text("stale")
    export(prepared, sharded, max_shard_size="100KB")

    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 2 and files == sorted(set(index["weight_map"].values()))
    assert all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    weights = read_weights(sharded)
    assert set(index["weight_map"]) == set(weights) == set(read_weights(single))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in weights.values())
    assert torch.equal(logits_of(sharded), logits_of(single))


def test_prepared_checkpoint_trains_like_the_hf_dir_on_1_and_2_ranks(llama_run, prepared, llama_dir, chat_file,
                                                                     tmp_path):
    manifest = json.loads((prepared / "finetune_manifest.json").read_text())
    original = read_weights(llama_dir)
    assert manifest["num_params"] == sum(t.numel() for t in original.values())
    assert manifest["num_tensors"] == len(original) and manifest["saved_world_size"] == 2
    assert manifest["config"]["num_hidden_layers"] == 4 and manifest["tie_word_embeddings"] is False
    assert manifest["source"]["fingerprint"].startswith("sha256:") and manifest["finetune_version"]

    reference = losses(llama_run)[0]  # first step: loss of the loaded weights, before any update
    one = sft(prepared, chat_file, tmp_path / "one", "train.lr=0", "train.max_steps=1", "train.micro_batch_size=4")
    two = sft(prepared, chat_file, tmp_path / "two", "train.lr=0", "train.max_steps=1", "train.micro_batch_size=2",
              nproc=2)
    assert one[0]["loss"] == reference
    assert two[0]["loss"] == pytest.approx(reference, rel=1e-5)

    broken = tmp_path / "broken"  # config.json edited after preparing: sft stops before any rank starts
    shutil.copytree(prepared, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 4}))
    result = invoke("sft", "--model", broken, "--dataset", chat_file, "--output-dir", tmp_path / "x", *BASE,
                    "--nproc-per-node", 2)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [f"error: prepared checkpoint '{broken}' does not match its "
                                                f"config.json: num_key_value_heads is 2 in the manifest but 4 in "
                                                f"the config"]
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("case, expect", [
    ("incomplete", "is an incomplete checkpoint"),
    ("occupied", "is not empty and not an earlier export"),
])
def test_bad_export_input_is_one_line_and_writes_nothing(case, expect, llama_run, tmp_path):
    checkpoint, out = llama_run, tmp_path / "out"
    if case == "incomplete":  # a save that died before its marker
        checkpoint = tmp_path / "step-2"
        shutil.copytree(llama_run / "checkpoints" / "step-2", checkpoint)
        (checkpoint / "finetune_complete.json").unlink()
    else:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    result = invoke("export-hf", "--checkpoint", checkpoint, "--output-dir", out)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], result.stderr
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp dir left
    assert (not out.exists()) if case != "occupied" else [p.name for p in out.iterdir()] == ["notes.txt"]


def test_a_re_export_keeps_what_the_user_added_and_replaces_our_own_files(llama_run, tmp_path):
    out = tmp_path / "hf"
    export(llama_run, out, max_shard_size="100KB")  # sharded: model-0000i-of-0000N.safetensors + index
    assert (out / "model.safetensors.index.json").is_file()
    (out / "README.md").write_text("# my model card")
    (out / "extra").mkdir()
    (out / "extra" / "notes.txt").write_text("mine")
    (out / "config.json").write_text("{}")  # ours: replaced
    printed = export(llama_run, out)  # one model.safetensors now: the earlier shards and index were ours too
    assert f"{out}: kept what was added there since it was written (README.md, extra)" in printed
    assert (out / "README.md").read_text() == "# my model card" and (out / "extra" / "notes.txt").read_text() == "mine"
    assert not list(out.glob("model-*")) and not (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no lock file, temp or old dir left beside it


def test_source_resolution_and_argument_errors(llama_run, prepared, tmp_path):
    from finetune.checkpoint import CheckpointError
    from finetune.config import ConfigError
    from finetune.export import parse_dtype, parse_shard_size
    from finetune.hf.files import find_source
    assert find_source(str(llama_run)).weights == llama_run / "checkpoints" / "step-2"
    assert find_source(str(llama_run / "checkpoints" / "step-2")).model_path == \
        find_source(str(llama_run)).model_path
    assert find_source(str(prepared)).weights == prepared / "weights"
    assert find_source(str(prepared)).model_path == str(prepared)
    (tmp_path / "run" / "checkpoints" / "step-3").mkdir(parents=True)
    for path, expect in [(tmp_path / "nowhere", "no checkpoint at"), (tmp_path / "run", "no complete checkpoint"),
                         (tmp_path, "no checkpoint at")]:
        with pytest.raises(CheckpointError, match=expect):
            find_source(str(path))
    with pytest.raises(ConfigError, match="--dtype must be one of auto, bfloat16, float32, got 'float16'"):
        parse_dtype("float16")
    assert parse_shard_size("5GB") == 5 * 10**9 and parse_shard_size("100KB") == 10**5
    for bad in ("5XB", "0MB", "-1", "big"):
        with pytest.raises(ConfigError, match="--max-shard-size must be"):
            parse_shard_size(bad)


def test_the_reload_check_catches_a_wrong_tensor_and_a_wrong_config(llama_run, llama_export, tmp_path):
    from safetensors.torch import save_file
    from finetune.export import export_layout
    from finetune.hf.files import find_source
    from finetune.hf.verify import VerifyError, verify_export
    from finetune.model import build_skeleton, load_hf_config
    from finetune.hf.passthrough import plan_export
    from finetune.hf.files import open_dcp
    source = find_source(str(llama_run))
    hf_config = load_hf_config(source.model_path)
    skeleton, (stored, load) = build_skeleton(hf_config, None), open_dcp(source.weights)
    kept, disk = export_layout(source, skeleton, stored)
    shards = {"model.safetensors": list(kept)}
    args = (skeleton, load, hf_config, plan_export(skeleton, kept, disk, source.model_path, hf_config, None), shards)
    assert verify_export(llama_export, *args) == 0

    bad_tensor = tmp_path / "bad_tensor"
    shutil.copytree(llama_export, bad_tensor)
    weights = read_weights(bad_tensor)
    weights["model.layers.1.mlp.up_proj.weight"][0, 0] += 1
    save_file(weights, bad_tensor / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(VerifyError, match="model.layers.1.mlp.up_proj.weight in model.safetensors differs"):
        verify_export(bad_tensor, *args)

    bad_config = tmp_path / "bad_config"
    shutil.copytree(llama_export, bad_config)
    config = json.loads((bad_config / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] = 500.0
    (bad_config / "config.json").write_text(json.dumps(config))
    with pytest.raises(VerifyError, match="logits differ"):
        verify_export(bad_config, *args)
    config["rope_parameters"]["rope_theta"] = hf_config.rope_parameters["rope_theta"]
    config["bos_token_id"] = 7  # no effect on the logits: config.json must still read back as written
    (bad_config / "config.json").write_text(json.dumps(config))
    with pytest.raises(VerifyError, match="config.json reads back with bos_token_id=7"):
        verify_export(bad_config, *args)


def test_an_export_builds_its_skeleton_once_and_opens_the_checkpoint_once(llama_run, monkeypatch, tmp_path):
    """Build once, pass down: the writing and the check of a (sharded) export use one meta skeleton and one open of
    the checkpoint (one read of its DCP metadata); the check builds one more model, the one config.json describes."""
    from helpers import export_hf
    step = str(llama_run / "checkpoints" / "step-2")
    for verify in (False, True):
        seen = count_builds_and_opens(monkeypatch)
        export_hf(str(llama_run), str(tmp_path / f"hf-{verify}"), max_shard_size="100KB", verify=verify)
        assert seen["opens"] == [("open_dcp", step)] and seen["metadata_reads"] == [step], seen
        assert len(seen["builds"]) == 1 + verify, seen["builds"]
