"""Exports of the large-model families, one row each (a tiny model built offline from its config class: families.py):
an lr=0 run (a prepared checkpoint where the family does not train here) exports every tensor byte- and dtype-equal
to the source, fp32 routers' biases and the tensors the model class does not own (MTP layers) included, with the
check on; a DeepSeek-V3-style export still generates with its MTP layer. Add a family by adding a row."""
from __future__ import annotations

import contextlib
import io

import pytest
import torch
import transformers as T

from families import make_family_dir
from helpers import export_hf, run_ranks, sft

TINY = dict(hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_attention_heads=2, num_key_value_heads=1,
            num_hidden_layers=2)
MLA = dict(q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8)
# name: (config class, its kwargs, the source's extra tensors: {"mtp": True} (an MTP layer after the last) or
# {"extra": {name: shape}}, the run's overrides; "prepare" for a prepared checkpoint instead of a run)
FAMILIES = {
    # MLA: one kv head per query head, as the released models (and assisted decoding, use_mtp) have it
    "deepseek_v3": (T.DeepseekV3Config, dict(TINY, **MLA, num_key_value_heads=2, n_routed_experts=4,
                                            num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1),
                    {"mtp": True}, ()),
    "glm4_moe": (T.Glm4MoeConfig, dict(TINY, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                                       head_dim=8), {"mtp": True, "fp8": ["model.layers.2.eh_proj.weight"]}, ()),
    "lfm2_moe": (T.Lfm2MoeConfig, dict(TINY, num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
                                       layer_types=["conv", "full_attention"]), {}, ()),
    "ernie4_5_moe": (T.Ernie4_5_MoeConfig, dict(TINY, moe_num_experts=4, moe_k=2, moe_num_shared_experts=1,
                                                moe_layer_start_index=1),
                     {"extra": {"mtp_linear_proj.0.weight": (8, 8)}}, ("train.mixed_precision=bf16",)),
    "nemotron_h": (T.NemotronHConfig, dict(TINY, layers_block_type=["mamba", "moe"], head_dim=8, n_routed_experts=4,
                                           num_experts_per_tok=2, moe_shared_expert_intermediate_size=8,
                                           mamba_num_heads=4, mamba_head_dim=8, ssm_state_size=8, n_groups=1,
                                           chunk_size=8), {"extra": {"mtp.layers.0.eh_proj.weight": (16, 32)}},
                   ()),
    # attention sinks (varlen runs them under the default attention)
    "mimo_v2_flash": (T.MiMoV2FlashConfig, dict(TINY, head_dim=8, v_head_dim=8, n_routed_experts=4,
                                                num_experts_per_tok=2, sliding_window=8),
                      {"extra": {"model.mtp.layers.0.eh_proj.weight": (16, 32)}}, ()),
    # A_log, dt_bias and the conv1d weights kept in fp32
    "bailing_hybrid": (T.BailingHybridConfig, dict(TINY, **MLA, num_key_value_heads=2, head_dim=8, n_group=1,
                                                   topk_group=1, num_experts_per_tok=2, num_local_experts=4,
                                                   first_k_dense_replace=1, layer_group_size=2), {"mtp": True}, ()),
    "deepseek_v4": (T.DeepseekV4Config, dict(TINY, head_dim=8, q_lora_rank=8, o_groups=1, o_lora_rank=8,
                                             n_routed_experts=4, num_experts_per_tok=2, index_n_heads=2,
                                             index_head_dim=8, index_topk=4, sliding_window=8, hc_mult=2),
                    {"extra": {"mtp.0.e_proj.weight": (16, 16)}}, "prepare"),
}


@pytest.fixture(scope="module")
def export_of(chat_file, tmp_path_factory):
    """export_of(name) -> (source dir, export dir, what the export printed): one run and one export per family."""
    from finetune.tools.prepare import prepare_checkpoint
    done = {}

    def run(name):
        if name not in done:
            config_cls, kwargs, extras, overrides = FAMILIES[name]
            root = tmp_path_factory.mktemp(name)
            source = make_family_dir(root / "source", config_cls, kwargs, **extras)
            if overrides == "prepare":
                run_ranks(prepare_checkpoint, 1, str(source), str(root / "run"))
            else:
                sft(source, chat_file, root / "run", "train.lr=0", "train.max_steps=1", "train.micro_batch_size=2",
                    "data.max_seq_len=64", *overrides)
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                export_hf(str(root / "run"), str(root / "hf"))
            done[name] = source, root / "hf", printed.getvalue()
        return done[name]
    return run


def stored(model_dir) -> dict[str, tuple[torch.dtype, tuple, bytes]]:
    """{name: (dtype, shape, bytes)} of a model dir's safetensors."""
    from safetensors.torch import load_file
    tensors = {k: t for f in sorted(model_dir.glob("*.safetensors")) for k, t in load_file(f).items()}
    return {k: (t.dtype, tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            for k, t in tensors.items()}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_lr0_export_holds_the_source_tensors_byte_and_dtype_equal(name, export_of):
    source, out, printed = export_of(name)
    want, got = stored(source), stored(out)
    assert sorted(got) == sorted(want), (name, sorted(set(want) - set(got))[:4], sorted(set(got) - set(want))[:4])
    wrong = [(k, want[k][0], got[k][0]) for k in want if got[k] != want[k]]
    assert not wrong, (name, wrong[:4])
    assert "verified" in printed and "max abs diff 0;" in printed, printed
    extras = FAMILIES[name][2]
    assert ("copied through untouched" in printed) is bool(extras), printed


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
    config_cls, kwargs, _, _ = FAMILIES["deepseek_v3"]
    skeleton = build_skeleton(config_cls(**kwargs), None)
    assert ignored_on_load(skeleton, "model.layers.2.eh_proj.weight")
    assert ignored_on_load(skeleton, "model.layers.61.mlp.gate.weight")
    assert not ignored_on_load(skeleton, "model.layers.3.eh_proj.weight")
    assert not ignored_on_load(skeleton, "model.layers.1.eh_proj.weight")


def test_the_check_names_a_copied_through_tensor_that_changed_and_a_dtype_off_the_plan(export_of, tmp_path):
    from safetensors.torch import load_file, save_file
    from finetune.export import export_layout, find_source
    from finetune.hf.passthrough import plan_export
    from finetune.hf.verify import VerifyError, verify_export
    from finetune.model import build_skeleton, load_hf_config
    from finetune.weights import open_dcp
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
