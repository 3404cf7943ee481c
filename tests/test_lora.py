"""LoRA (peft under FSDP2): 2 ranks train like 1 process, the base stays frozen and bf16, checkpoints hold only the
adapters and resume exactly (2 ranks -> 1), the merged export equals the source at lr=0 and PeftModel on the adapter
export when trained, and bad input is one line with exit 2."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import helpers
from helpers import count_builds_and_opens, losses

# on top of helpers.BASE (fp32, constant lr, no eval)
LORA = ["lora.rank=4", "lora.alpha=8", "train.lr=1e-2", "train.max_steps=5", "checkpoint.interval=3",
        "checkpoint.keep=0"]


def sft(model_dir, data, out, *extra, nproc=1):
    """An in-process LoRA sft run on nproc gloo ranks (helpers.run_ranks)."""
    return helpers.sft(model_dir, data, out, *LORA, *extra, nproc=nproc)


def read_weights(model_dir) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


@pytest.fixture(scope="module", params=["llama", "qwen_tied", "qwen_tied_head"])
def runs(request, llama_dir, qwen_tied_dir, chat_file, tmp_path_factory):
    """The same 5 LoRA steps on 1 process (micro-batch 4) and on 2 ranks (2 each), checkpoints at steps 3 and 5.
    qwen_tied_head also trains lm_head in full (modules_to_save), apart from the embedding it is tied to."""
    model_dir = llama_dir if request.param == "llama" else qwen_tied_dir
    extra = ["lora.modules_to_save=['lm_head']"] if request.param == "qwen_tied_head" else []
    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    sft(model_dir, chat_file, root / "one", "train.micro_batch_size=4", *extra)
    sft(model_dir, chat_file, root / "two", "train.micro_batch_size=2", *extra, nproc=2)
    return model_dir, root, request.param


def test_two_ranks_train_like_one_process_and_checkpoints_hold_only_adapters(runs):
    model_dir, root, kind = runs
    one, two = losses(root / "one"), losses(root / "two")
    assert len(one) == 5 and one[-1] < one[0] - 0.05  # it learns
    assert two == pytest.approx(one, rel=1e-5, abs=1e-5)
    step = root / "one" / "checkpoints" / "step-5"
    import torch.distributed.checkpoint as dcp
    keys = [k for k in dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert keys and all(".lora_A.default." in k or ".lora_B.default." in k for k in keys
                        if k != "model.lm_head.modules_to_save.default.weight"), keys[:3]
    assert ("model.lm_head.modules_to_save.default.weight" in keys) == (kind == "qwen_tied_head")
    marker = json.loads((step / "finetune_complete.json").read_text())
    assert marker["lora"]["rank"] == 4 and marker["config"]["model"]["path"] == str(Path(model_dir).resolve())
    # fp32 weights + 2 AdamW moments (12 bytes each) of the trainable params only; a full checkpoint holds them for
    # every param. (DCP adds ~1.5 KB per tensor, which dominates at this toy size.)
    metadata = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    num_trainable = sum(metadata[k].size.numel() for k in keys)
    num_params = sum(t.numel() for t in read_weights(model_dir).values())
    data_bytes = sum(f.stat().st_size for f in step.glob("*.distcp"))
    assert 12 * num_trainable <= data_bytes < 12 * num_params, (data_bytes, num_trainable, num_params)
    assert num_trainable < 0.1 * num_params or kind == "qwen_tied_head"  # the head copy is large in a toy model


def test_merged_export_gives_the_logits_of_peft_on_the_adapter_export(runs, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM
    from helpers import export_hf
    model_dir, root, kind = runs
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    export_hf(str(root / "two"), str(merged), "float32")  # verified against the checkpoint by export_hf itself
    export_hf(str(root / "two"), str(adapter), "float32", adapter=True)
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                         "finetune_export.json"]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = load_file(adapter / "adapter_model.safetensors")  # the keys peft must take with none left over
    result = set_peft_model_state_dict(get_peft_model(base, LoraConfig.from_pretrained(adapter)), state)
    assert result.unexpected_keys == [] and [k for k in result.missing_keys if "lora_" in k] == []

    input_ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                               adapter).eval()
        want = peft_model(input_ids=input_ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(input_ids=input_ids).logits
        base_logits = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(
            input_ids=input_ids).logits
    assert (got - want).abs().max().item() <= 1e-4
    assert (got - base_logits).abs().max().item() > 1e-3  # the adapters changed the model
    config = json.loads((merged / "config.json").read_text())
    # tied stays tied, unless lm_head was trained apart (modules_to_save): then the export holds both
    assert config["tie_word_embeddings"] == (kind == "qwen_tied")
    weights = read_weights(merged)
    assert ("lm_head.weight" in weights) == (kind != "qwen_tied")


def test_a_merged_export_builds_its_skeleton_once_and_opens_each_source_once(runs, monkeypatch, tmp_path):
    """Build once, pass down: one meta skeleton (two when a tied embedding trained apart is exported untied: that
    is another model), the adapters and the base each opened once; an adapter export builds no model unverified."""
    from helpers import export_hf
    model_dir, root, kind = runs
    step = str(root / "one" / "checkpoints" / "step-5")
    seen = count_builds_and_opens(monkeypatch)
    export_hf(str(root / "one"), str(tmp_path / "merged"), verify=False)
    assert seen["opens"] == [("open_dcp", step), ("open_safetensors", str(model_dir))], seen["opens"]
    assert seen["metadata_reads"] == [step]
    tied = {"llama": [False], "qwen_tied": [True], "qwen_tied_head": [True, False]}[kind]
    assert [config.tie_word_embeddings for config in seen["builds"]] == tied
    seen = count_builds_and_opens(monkeypatch)
    export_hf(str(root / "one"), str(tmp_path / "adapter"), adapter=True, verify=False)
    assert seen == {"builds": [], "opens": [("open_dcp", step)], "metadata_reads": [step]}


def test_resume_on_one_rank_from_two_continues_exactly(runs, chat_file, tmp_path):
    model_dir, root, kind = runs
    if kind != "llama":
        pytest.skip("one architecture is enough for the resume path (the tied one runs the rest)")
    resumed = tmp_path / "resumed"
    shutil.copytree(root / "two", resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-5")
    (resumed / "metrics.jsonl").write_text("".join(line + "\n" for line in (resumed / "metrics.jsonl").read_text()
                                                   .splitlines()[:3]))
    sft(model_dir, chat_file, resumed, "train.micro_batch_size=4")
    assert losses(resumed)[3:] == pytest.approx(losses(root / "one")[3:], rel=1e-5, abs=1e-5)

    # a LoRA checkpoint does not resume into a full fine-tune: one line, exit 2, nothing written
    before = [(resumed / name).read_text() for name in ("metrics.jsonl", "config.toml")]
    result = helpers.invoke("sft", "--model", model_dir, "--dataset", chat_file, "--output-dir", resumed, *helpers.BASE,
                            *LORA, "lora.rank=0", "train.max_steps=7")  # refused before any rank starts
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is from LoRA (lora.rank=4), this run is full fine-tuning" in lines[0], result.stderr
    assert [(resumed / name).read_text() for name in ("metrics.jsonl", "config.toml")] == before
    from finetune.checkpoint import CheckpointError  # other LoRA settings: the same refusal, naming the keys
    with pytest.raises(CheckpointError, match=r"has other LoRA settings than this run: lora.rank: checkpoint 4, "
                                              r"run 8; lora.alpha: checkpoint 8.0, run 16.0"):
        sft(model_dir, chat_file, resumed, "lora.rank=8", "lora.alpha=16", "train.max_steps=7")
    assert [(resumed / name).read_text() for name in ("metrics.jsonl", "config.toml")] == before


def test_lr0_merged_export_equals_the_source_tensor_for_tensor(llama_dir, qwen_tied_dir, chat_file, tmp_path):
    from helpers import export_hf
    from finetune.errors import ModelError
    sft(llama_dir, chat_file, tmp_path / "run", "train.lr=0", "train.max_steps=1", "train.micro_batch_size=4")
    export_hf(str(tmp_path / "run"), str(tmp_path / "hf"), "bfloat16")
    source, exported = read_weights(llama_dir), read_weights(tmp_path / "hf")
    assert set(exported) == set(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name

    step = tmp_path / "run" / "checkpoints" / "step-1"  # the recorded base replaced by another architecture
    marker = json.loads((step / "finetune_complete.json").read_text())
    marker["config"]["model"]["path"] = str(qwen_tied_dir)
    (step / "finetune_complete.json").write_text(json.dumps(marker))
    with pytest.raises(ModelError, match=f"the LoRA base model '{qwen_tied_dir}' is not the one .* trained: "
                                         f"model_type"):
        export_hf(str(step), str(tmp_path / "other"), "bfloat16")
    assert not (tmp_path / "other").exists()


def test_a_base_with_other_weights_at_the_recorded_path_is_refused_by_export_and_resume(llama_dir, chat_file,
                                                                                          tmp_path, capsys):
    from conftest import make_model_dir
    from finetune.checkpoint import CheckpointError
    from helpers import export_hf
    base, run = tmp_path / "base", tmp_path / "run"
    shutil.copytree(llama_dir, base)
    sft(base, chat_file, run, "train.max_steps=3")
    make_model_dir(base, "llama3", "llama", tied=False, seed=1)  # re-downloaded: same architecture, other weights
    refused = rf"checkpoint {run}/checkpoints/step-3 trained its LoRA adapters on the base '{base}', and '{base}' " \
              rf"holds other weights now \(fingerprint sha256:\w+ then, sha256:\w+ now\)"
    for adapter in (False, True):
        with pytest.raises(CheckpointError, match=refused):
            export_hf(str(run), str(tmp_path / "hf"), adapter=adapter)
    assert not (tmp_path / "hf").exists()
    with pytest.raises(CheckpointError, match=refused):
        sft(base, chat_file, run, "train.max_steps=6")
    marker_path = run / "checkpoints" / "step-3" / "finetune_complete.json"
    marker = json.loads(marker_path.read_text())
    del marker["lora"]["base_fingerprint"]  # a checkpoint saved before finetune recorded it: a note, not checked
    marker_path.write_text(json.dumps(marker))
    capsys.readouterr()
    export_hf(str(run), str(tmp_path / "hf"), adapter=True)
    assert "records no fingerprint of its LoRA base (saved by an older finetune)" in capsys.readouterr().out


def train_on_prepared_base(llama_dir, tmp_path):
    """On one rank (run_ranks), bf16 mixed precision, base weights from a prepared checkpoint: a few large optimizer
    steps, the checks below, then a checkpoint; returns (prepared dir, step dir)."""
    from torch.distributed.tensor import DTensor
    from finetune.checkpoint import TrainState
    from finetune.run.saving import Checkpointer
    from finetune.distributed import init_distributed
    from finetune.model import build_model
    from finetune.weights import base_name, clean_fqn, is_adapter
    from finetune.optim import build_optimizer, build_scheduler
    from finetune.tools.prepare import prepare_checkpoint
    device, dims = init_distributed()
    mesh = dims.mesh
    prepared = prepare_checkpoint(str(llama_dir), str(tmp_path / "prepared"))
    lora = dict(rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear", modules_to_save=[])
    from finetune.adapters.lora import lora_transforms
    model, settings = build_model(str(prepared), device, mesh, lora_transforms(lora, seed=0, path=str(prepared)),
                                  mixed_precision="bf16")
    optimizer = build_optimizer(model, 1e-2, 0.0, (0.9, 0.95), 1e-8)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 2 * 7 * 4  # A and B on 7 linears x 4 blocks
    before = {n: p.full_tensor().clone() for n, p in model.named_parameters() if is_adapter(n)}
    for _ in range(3):
        ids = torch.randint(3, 100, (2, 16), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    source = read_weights(llama_dir)
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        if is_adapter(name):
            assert p.dtype == torch.float32 and p.requires_grad
            if ".lora_B." in name:  # B starts at zero and moves; so the product moves
                assert not torch.equal(p.full_tensor(), before[name]), name
        else:
            assert p.dtype == torch.bfloat16 and not p.requires_grad and p.grad is None, name
            assert torch.equal(p.full_tensor(), source[base_name(clean_fqn(name))]), name
    scheduler = build_scheduler(optimizer, warmup_steps=0, max_steps=3, min_lr_ratio=1.0)
    saver = Checkpointer(tmp_path / "run" / "checkpoints", keep=1, use_async=False, lora=settings,
                         run={"config": {"model": {"path": str(prepared)}}})  # as train() names the model
    step = saver.save(3, model, optimizer, scheduler, TrainState(), model.config)
    return prepared, step


def test_on_a_prepared_base_only_fp32_adapters_train_and_the_bf16_base_stays_bit_identical(llama_dir, tmp_path):
    """The frozen base is bf16 (no fp32 copy), gets no grad, and after training still equals the source bit for
    bit; only the fp32 adapters moved (checked in train_on_prepared_base). The merged export over the prepared base
    equals the one over the HF dir."""
    from helpers import export_hf
    prepared, step = helpers.run_ranks(train_on_prepared_base, 1, llama_dir, tmp_path)[0]
    export_hf(str(step.parent.parent), str(tmp_path / "from_prepared"), "float32")
    marker = json.loads((step / "finetune_complete.json").read_text())
    assert marker["config"]["model"]["path"] == str(prepared)
    marker["config"]["model"]["path"] = str(llama_dir)
    (step / "finetune_complete.json").write_text(json.dumps(marker))
    export_hf(str(step.parent.parent), str(tmp_path / "from_hf"), "float32")
    source = read_weights(llama_dir)
    merged, again = read_weights(tmp_path / "from_prepared"), read_weights(tmp_path / "from_hf")
    assert set(merged) == set(again) == set(source)
    assert all(torch.equal(merged[k], again[k]) for k in merged)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           source["model.layers.0.self_attn.q_proj.weight"].float())


def test_bad_lora_input_is_one_clear_error(llama_dir, tmp_path):
    from finetune.config import ConfigError, load_config, to_toml
    from finetune.adapters.lora import apply_lora
    from finetune.model import build_skeleton, find_layers, load_hf_config
    base = {"model.path": str(llama_dir), "data.path": "x.jsonl", "output_dir": str(tmp_path)}
    with pytest.raises(ConfigError, match=r"lora.rank must be >= 0 \(0 = off\), got -1"):
        load_config(None, {**base, "lora.rank": -1})
    cfg = load_config(None, {**base, "lora.rank": 8, "lora.target_modules": ["q_proj", "v_proj"],
                             "lora.modules_to_save": ["lm_head"]})
    (tmp_path / "config.toml").write_text(to_toml(cfg))  # what bench's workers (and export) read back
    assert load_config(tmp_path / "config.toml").lora == cfg.lora
    assert cfg.lora.target_modules == ["q_proj", "v_proj"] and cfg.lora.rank == 8
    with pytest.raises(ConfigError, match="lora.target_modules must be str or list, got 3"):
        load_config(None, {**base, "lora.target_modules": 3})
    cases = [(dict(target_modules=["q_proj", "qkv"]), "lora.target_modules: 'qkv' matches no module of"),
             (dict(target_modules=[]), "lora.target_modules must be"),
             (dict(modules_to_save=["lm_heads"]), "lora.modules_to_save: 'lm_heads' matches no module of"),
             (dict(target_modules=["q_proj", "embed_tokens"]), r"lora.target_modules: 'embed_tokens' names "
              r"model.embed_tokens \(Embedding\), not a Linear layer: .*\(lora.modules_to_save=\['embed_tokens'\]")]
    for kwargs, expect in cases:
        skeleton = build_skeleton(load_hf_config(str(llama_dir)))
        settings = {**dict(rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear", modules_to_save=[]), **kwargs}
        with pytest.raises(ConfigError, match=expect):
            apply_lora(skeleton, find_layers(skeleton), **settings, base_dtype=torch.bfloat16)
