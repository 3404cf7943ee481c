"""Exports of the large-model families beyond what test_families.py checks for each (byte- and dtype-equal at lr=0):
a DeepSeek-V3-style export still generates with its MTP layer, the check names what differs, an explicit dtype, 2
processes."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch
import transformers as T

from families import FAMILIES, family_kwargs, make_family_dir, stored
from helpers import export_hf, run_ranks, sft

@pytest.fixture(scope="module")
def export_of(chat_file, tmp_path_factory):
    """export_of(name) -> (source dir, export dir, what the export printed): one run (lr=0) and one export of a
    family of families.py."""
    done = {}

    def run(name):
        if name not in done:
            config_cls, _, extras = FAMILIES[name]
            root = tmp_path_factory.mktemp(name)
            source = make_family_dir(root / "source", config_cls, family_kwargs(name), **extras)
            sft(source, chat_file, root / "run", "train.lr=0", "train.max_steps=1", "train.micro_batch_size=2",
                "data.max_seq_len=64")
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                export_hf(str(root / "run"), str(root / "hf"))
            done[name] = source, root / "hf", printed.getvalue()
        return done[name]
    return run


def test_a_deepseek_v3_export_generates_with_its_mtp_layer(export_of, monkeypatch):
    """MtpModel finds the MTP layer by the class's pattern for the released model (layer 61): here, layer 2."""
    source, out, _ = export_of("deepseek_v3")
    from transformers import AutoModelForCausalLM
    monkeypatch.setattr(T.DeepseekV3ForCausalLM, "_keys_to_ignore_on_load_unexpected", [r"model\.layers\.2\..*"])
    ids = torch.tensor([[3, 14, 15, 9, 2, 6]])
    tokens = []
    for model_dir in (source, out):
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        assert model.config.num_mtp_layers == 1
        tokens.append(model.generate(ids, max_new_tokens=6, do_sample=False, use_mtp=True))
    assert torch.equal(tokens[0], tokens[1]) and tokens[1].shape[1] == ids.shape[1] + 6


def test_only_the_config_s_mtp_layers_past_the_last_are_left_unread():
    """DeepSeek-V3 names its MTP layer model.layers.61: in a 2-layer config that is layer 2 (num_mtp_layers=1); a
    layer 3 means a config.json that undercounts the layers, which a load must refuse, not skip."""
    from finetune.model import build_skeleton
    from finetune.weights import ignored_on_load
    skeleton = build_skeleton(FAMILIES["deepseek_v3"][0](**family_kwargs("deepseek_v3")), None)
    assert ignored_on_load(skeleton, "model.layers.2.eh_proj.weight")
    assert ignored_on_load(skeleton, "model.layers.61.mlp.gate.weight")
    assert not ignored_on_load(skeleton, "model.layers.3.eh_proj.weight")
    assert not ignored_on_load(skeleton, "model.layers.1.eh_proj.weight")


@pytest.mark.parametrize("name", ["llama4_text"])
def test_the_check_s_streamed_logits_are_those_of_the_model_holding_every_weight(name):
    """The check runs the model with each module's weights loaded only while it runs; Llama 4 reads
    embed_tokens.weight.device before its embedding runs (once: uninitialised memory embedded, NaN in some runs)."""
    from transformers import AutoModelForCausalLM
    from finetune.hf.verify import streamed_logits
    from finetune.model import build_skeleton
    config = FAMILIES[name][0](**family_kwargs(name), vocab_size=64, pad_token_id=0, max_position_embeddings=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    weights, ids = model.state_dict(), torch.randint(64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits
    skeleton = build_skeleton(config, None)
    for _ in range(2):  # and again: the skeleton is left as it was
        torch.testing.assert_close(streamed_logits(skeleton, weights.__getitem__, ids), want, rtol=1e-5, atol=1e-6)
    assert all(p.is_meta for p in skeleton.parameters())


def test_the_check_names_a_copied_through_tensor_that_changed_and_a_dtype_off_the_plan(export_of, tmp_path):
    from safetensors.torch import load_file, save_file
    from finetune.hf.files import find_source
    from finetune.export import export_layout
    from finetune.hf.passthrough import plan_export
    from finetune.hf.verify import VerifyError, verify_export
    from finetune.model import build_skeleton, load_hf_config
    from finetune.hf.files import open_dcp
    source, out, _ = export_of("glm4_moe")
    checkpoint = find_source(str(out.parent / "run"))
    hf_config = load_hf_config(checkpoint.model_path)
    skeleton, (stored_tensors, load) = build_skeleton(hf_config, None), open_dcp(checkpoint.weights)
    kept, disk = export_layout(checkpoint, skeleton, stored_tensors)
    plan = plan_export(skeleton, kept, disk, checkpoint.model_path, hf_config, None)
    args = (skeleton, load, hf_config, plan, {"model.safetensors": [*disk, *plan.untouched]})
    assert verify_export(out, *args) == 0
    for name, edit, expect in [
        ("model.layers.2.hnorm.weight", lambda t: t + 1, "model.layers.2.hnorm.weight in model.safetensors is not "
                                                         "the source's"),
        ("model.layers.1.mlp.gate.e_score_correction_bias", lambda t: t.bfloat16(),
         "holds model.layers.1.mlp.gate.e_score_correction_bias as BF16, the plan was F32")]:
        bad = tmp_path / name
        bad.mkdir()
        for f in out.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        tensors = load_file(bad / "model.safetensors")
        tensors[name] = edit(tensors[name])
        save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(VerifyError, match=expect):
            verify_export(bad, *args)


def test_an_explicit_dtype_is_every_tensor_s_but_what_transformers_keeps_in_fp32(export_of, tmp_path):
    source, out, _ = export_of("glm4_moe")
    want = stored(source)
    for dtype in ("float32", "bfloat16"):
        with contextlib.redirect_stdout(io.StringIO()):
            export_hf(str(out.parent / "run"), str(tmp_path / dtype), dtype)
        got = stored(tmp_path / dtype)
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert got[bias][0] == torch.float32 and got[bias][2] == want[bias][2]
        written = {got[k][0] for k in got if k != bias and not k.startswith("model.layers.2.")}
        assert written == {getattr(torch, dtype)}, written


def export_on_rank(checkpoint, out):
    export_hf(str(checkpoint), str(out), "auto", "4KB")


def test_an_export_on_2_processes_writes_the_bytes_of_1_with_the_mtp_layer(export_of, tmp_path):
    """Each process writes whole files: the copied-through tensors land in both ranks' files."""
    source, out, _ = export_of("deepseek_v3")
    one, two = tmp_path / "one", tmp_path / "two"
    with contextlib.redirect_stdout(io.StringIO()):
        export_on_rank(out.parent / "run", one)
    run_ranks(export_on_rank, 2, out.parent / "run", two)
    files = sorted(p.name for p in one.iterdir() if p.name != "finetune_export.json")  # it records the time
    assert len([f for f in files if f.endswith(".safetensors")]) > 2 and "model.safetensors.index.json" in files
    assert files == sorted(p.name for p in two.iterdir() if p.name != "finetune_export.json")
    for f in files:
        assert (one / f).read_bytes() == (two / f).read_bytes(), f
    assert stored(two) == stored(source)
