"""LoRA on the experts (adapters/expert_lora.py): "all-linear" and named experts adapt the fused 3-D expert tensors;
ranks with their own batches (FSDP, expert parallel) equal one process in loss and adapter gradients; the sft run
resumes exactly, its merged export is base + delta, its PEFT adapter export gives the merged export's logits; dpo's
reference switches the experts' adapters off. Tiny MoE models built offline (test_moe.make_moe_dir)."""
from __future__ import annotations

import pytest
import torch

from helpers import run_ranks
from test_expert_parallel import batches, rank_loss_backward
from test_moe import cat, make_moe_dir

LORA = dict(rank=4, alpha=8.0, dropout=0.0, modules_to_save=[])


def lora_step(model_dir, ep: int, parts: list[dict], target_modules="all-linear"):
    """On each rank: its own batch through build_model's LoRA model at parallel.ep=`ep`, the B factors drawn at
    random (every gradient then non-zero): (global loss, each trainable parameter's full gradient, the local shape of
    gate_up_proj's A and its mesh's dims, the rank's start-up lines)."""
    import contextlib
    import io
    from functools import partial

    from torch.distributed.tensor import distribute_tensor

    from finetune.adapters.lora import lora_transforms
    from finetune.distributed import all_reduce, init_distributed
    from finetune.kernels.moe import apply_experts_implementation, find_experts
    from finetune.model import Transform, build_model
    from finetune.parallel.expert import apply_ep
    from finetune.weights import clean_fqn
    device, dims = init_distributed(ep=ep)
    t = lora_transforms(dict(LORA, target_modules=target_modules), seed=0, path=str(model_dir),
                        mixed_precision="fp32")
    t.append(Transform("kernels", lambda model, layers: apply_experts_implementation(model, "grouped_mm")))
    if ep > 1:
        t.append(Transform("expert_parallel", partial(apply_ep, mesh=dims.expert_mesh)))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        model = build_model(str(model_dir), device, dims.mesh, t, mixed_precision="fp32")[0]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                full = torch.randn(p.shape, generator=gen) * 0.1
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
    loss = rank_loss_backward(model, parts)
    grads = {clean_fqn(n): p.grad.full_tensor().numpy() for n, p in model.named_parameters() if p.requires_grad}
    lora_a = find_experts(model)[0].lora_A["default"]["gate_up_proj"]
    return (all_reduce(loss.detach()).item(), grads, (*lora_a.to_local().shape, *lora_a.device_mesh.mesh_dim_names),
            printed.getvalue())


def assert_same(got, want, what):
    (loss, grads, *_), (want_loss, want_grads, *_) = got, want
    assert abs(loss - want_loss) < 1e-6, (what, loss, want_loss)
    assert set(grads) == set(want_grads), (what, sorted(set(grads) ^ set(want_grads))[:4])
    for name, grad in grads.items():
        torch.testing.assert_close(torch.from_numpy(grad), torch.from_numpy(want_grads[name]), rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{name} ({what}): {m}")


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    return make_moe_dir(tmp_path_factory.mktemp("qwen3_moe_lora"), "qwen3_moe", fused=True, num_layers=1)


def test_all_linear_adapts_the_experts_and_two_ranks_at_ep_1_and_2_equal_one_process(qwen3_moe_dir):
    """Qwen3-MoE (8 experts, [E, out, in]): "all-linear" adapts attention and both expert tensors, said in one line;
    FSDP over 2 ranks and ep 2 (each rank 4 experts' A and B) with their own batches give one process's loss and
    adapter gradients."""
    parts = batches(2)
    want = run_ranks(lora_step, 1, qwen3_moe_dir, 1, [cat(*parts)])[0]
    expert_grads = [n for n in want[1] if ".experts.lora_" in n]
    assert sorted(expert_grads) == [f"model.layers.0.mlp.experts.lora_{s}.default.{p}" for s in "AB"
                                    for p in ("down_proj", "gate_up_proj")], sorted(want[1])
    assert all(abs(want[1][n]).max() > 0 for n in want[1])
    assert want[2][:3] == (8, 4, 64)  # gate_up_proj's A: [8 experts, rank 4, hidden 64]
    assert ("lora: rank 4, alpha 8 on 4 linear layers (attention 4, MLP 0) and 2 expert tensors (down_proj, "
            "gate_up_proj; 1 MoE layers of 8 experts); trainable") in want[3], want[3]
    for ep in (1, 2):
        for got in run_ranks(lora_step, 2, qwen3_moe_dir, ep, parts):
            # 4 experts a rank: FSDP's shard of all 8, or the 4 this ep rank holds (FSDP over 1 rank)
            assert got[2] == ((4, 4, 64, "dp_shard") if ep == 1 else (4, 4, 64, "efsdp", "ep")), (ep, got[2])
            assert_same(got, want, f"ep {ep}")


def test_four_ranks_at_ep_2_x_fsdp_2_equal_one_process(qwen3_moe_dir):
    """ep 2 over 4 ranks (each expert group's 4 experts and their A and B FSDP-sharded over 2 ranks), each rank its own
    batch: one process's loss and adapter gradients."""
    parts = batches(4)
    want = run_ranks(lora_step, 1, qwen3_moe_dir, 1, [cat(*parts)])[0]
    for got in run_ranks(lora_step, 4, qwen3_moe_dir, 2, parts):
        assert got[2] == (2, 4, 64, "efsdp", "ep"), got[2]  # gate_up_proj's A: 2 of its group's 4 experts
        assert_same(got, want, "ep 2 x efsdp 2")


def logits_of(model_dir, adapter=None) -> torch.Tensor:
    """fp32 logits of the HF model at `model_dir` (with peft's PeftModel of `adapter` on it) on fixed tokens."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model.eval()(input_ids=torch.arange(3, 40).reshape(1, -1)).logits


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_sft_at_ep2_equals_one_process_resumes_and_both_exports_agree_with_peft(arch, chat_file, tmp_path, capfd):
    """3 LoRA steps, all-linear: one process and ep 2 on 2 ranks agree (loss, grad norm); ep 2's step-2 checkpoint
    resumed in one process gives step 3; the merged export's expert tensors are W + alpha/r * B @ A per expert (gpt-oss
    stores them [E, in, out]), and peft (target_parameters) on the adapter export gives the merged export's logits."""
    from transformers import AutoModelForCausalLM

    from finetune.hf.files import open_dcp
    from helpers import export_hf, sft
    model_dir = make_moe_dir(tmp_path / "model", arch, fused=True, num_layers=1)
    common = ("lora.rank=4", "lora.alpha=8", "train.lr=2e-2", "train.max_steps=3", "checkpoint.interval=2",
              "checkpoint.keep=0")
    one = sft(model_dir, chat_file, tmp_path / "one", *common, "train.micro_batch_size=4")
    ep = sft(model_dir, chat_file, tmp_path / "ep", *common, "train.micro_batch_size=2", "parallel.ep=2", nproc=2)
    assert "2 expert tensors (down_proj, gate_up_proj; 1 MoE layers of " in capfd.readouterr().out
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in ep] == pytest.approx([r[key] for r in one], rel=1e-5), key
    resumed = sft(model_dir, chat_file, tmp_path / "resumed", *common, "train.micro_batch_size=4",
                  f"checkpoint.resume_from={tmp_path / 'ep' / 'checkpoints' / 'step-2'}")
    assert [resumed[0][k] for k in ("loss", "grad_norm")] == pytest.approx([one[2][k] for k in ("loss", "grad_norm")],
                                                                            rel=1e-5)
    export_hf(str(tmp_path / "ep"), str(tmp_path / "merged"), "float32")  # verified against the checkpoint
    export_hf(str(tmp_path / "ep"), str(tmp_path / "adapter"), "float32", adapter=True)  # verified with peft
    _, adapters = open_dcp(tmp_path / "ep" / "checkpoints" / "step-3")
    # the export writes transformers' layout on disk (per expert for Qwen3-MoE): compared as the model holds them
    source, merged = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).model.layers[0].mlp.experts
                      for d in (model_dir, tmp_path / "merged"))
    for name in ("gate_up_proj", "down_proj"):
        a, b = (adapters(f"model.layers.0.mlp.experts.lora_{s}.default.{name}") for s in "AB")
        delta = torch.stack([b[e] @ a[e] for e in range(a.shape[0])])
        want = getattr(source, name) + 2.0 * (delta.mT if arch == "gpt_oss" else delta)
        assert torch.equal(getattr(merged, name), want), name
        assert (want - getattr(source, name)).abs().max() > 1e-4, name  # the experts' adapters trained
    got = logits_of(tmp_path / "merged")
    assert (got - logits_of(model_dir, tmp_path / "adapter")).abs().max() < 1e-4
    assert (got - logits_of(model_dir)).abs().max() > 1e-3


def test_target_modules_name_the_experts_by_module_or_parameter_and_dropout_on_them_is_refused(qwen3_moe_dir):
    from finetune.adapters.lora import apply_lora
    from finetune.config import ConfigError
    from finetune.model import build_skeleton, find_layers, load_hf_config

    def adapted(target_modules, dropout=0.0):
        model = build_skeleton(load_hf_config(str(qwen3_moe_dir)))
        settings = apply_lora(model, find_layers(model), 4, 8.0, dropout, target_modules, [], torch.float32)
        trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        return settings["target_parameters"], trainable
    experts = "model.layers.0.mlp.experts"
    assert adapted(["experts"]) == ([f"{experts}.gate_up_proj", f"{experts}.down_proj"],
                                    [f"{experts}.lora_{s}.default.{p}" for s in "AB" for p in ("down_proj",
                                                                                              "gate_up_proj")])
    params, trainable = adapted(["q_proj", "down_proj"])
    assert params == [f"{experts}.down_proj"] and len(trainable) == 4 and "lora_A.default.weight" in trainable[2]
    assert adapted(["q_proj"])[0] == []  # attention only, as before
    with pytest.raises(ConfigError, match=r"^lora.dropout=0.1 cannot apply to LoRA on the experts \(model.layers.0.mlp"
                                          r".experts.gate_up_proj, ...\): .*set lora.dropout=0 or leave the experts "
                                          r"out of lora.target_modules$"):
        adapted("all-linear", dropout=0.1)
    with pytest.raises(ConfigError, match="lora.target_modules: 'up_proj' matches no module of Qwen3MoeForCausalLM"):
        adapted(["up_proj"])
    model = build_skeleton(load_hf_config(str(qwen3_moe_dir)))
    with pytest.raises(ConfigError, match=r"^lora.modules_to_save=\['lm_head'\] with LoRA on the experts only: name a "
                                          r"Linear layer in lora.target_modules too"):
        apply_lora(model, find_layers(model), 4, 8.0, 0.0, ["experts"], ["lm_head"], torch.float32)


def test_shared_expert_linears_that_peft_remaps_onto_the_experts_are_left_out_of_all_linear_or_refused(capsys):
    """DeepSeek-V3: peft 0.21 turns targets named gate_proj/up_proj/down_proj into the fused experts' parameters
    (huggingface/peft#3711) and then failed (AttributeError); all-linear leaves those Linears out with a note and
    adapts the rest, the experts by our own LoRA; naming them is refused in one line."""
    from families import FAMILIES, family_kwargs
    from finetune.adapters.lora import apply_lora
    from finetune.config import ConfigError
    from finetune.model import build_skeleton, find_layers
    config_cls, _, _ = FAMILIES["deepseek_v3"]

    def adapt(target_modules):
        model = build_skeleton(config_cls(**family_kwargs("deepseek_v3")))
        apply_lora(model, find_layers(model), 4, 8.0, 0.0, target_modules, [], torch.float32)
        return {n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad}
    adapted = adapt("all-linear")
    assert "note: all-linear leaves out the Linear layers named ['down_proj', 'gate_proj', 'up_proj']: peft" in \
        capsys.readouterr().out
    assert not any(n.endswith(("gate_proj", "up_proj", "down_proj")) and ".experts" not in n for n in adapted), adapted
    assert any(n.endswith("self_attn.o_proj") for n in adapted) and any(".mlp.experts" in n for n in adapted)
    with pytest.raises(ConfigError, match=r"^lora.target_modules: \['gate_proj'\]: peft .* turns LoRA targets with "
                                          r"these names of a deepseek_v3 model into its fused experts' parameters .*"
                                          r"leave them out \(lora.target_modules=\['o_proj'\]\)$"):
        adapt(["o_proj", "gate_proj"])


def test_deepseek_v3_lora_trains_and_its_adapter_export_holds_the_adapters_only(chat_file, tmp_path):
    """The run the remap broke (AttributeError at the build) trains; the checkpoint also holds the routing biases (the
    base's persistent buffers), which the adapter dir leaves out (peft loads exactly its tensors: export's check)."""
    from families import FAMILIES, family_kwargs, make_family_dir
    from helpers import export_hf, sft
    config_cls, _, _ = FAMILIES["deepseek_v3"]
    model_dir = make_family_dir(tmp_path / "m", config_cls, family_kwargs("deepseek_v3"))
    records = sft(model_dir, chat_file, tmp_path / "run", "lora.rank=4", "train.max_steps=2", "train.lr=1e-2")
    assert len(records) == 2 and records[1]["loss"] < records[0]["loss"]
    out = export_hf(str(tmp_path / "run"), str(tmp_path / "adapter"), adapter=True)  # raises if peft loads others
    from safetensors import safe_open
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and all(".lora_" in k for k in keys) and any(".mlp.experts." in k for k in keys), keys


def test_dpo_trains_the_experts_adapters(qwen3_moe_dir, tmp_path):
    """2 dpo steps with LoRA on the attention and the experts (reference: the adapters off): the second step's
    policy differs from the reference (rewards non-zero) and the experts' B factors left zero."""
    from finetune.hf.files import open_dcp
    from test_dpo import dpo, make_pairs
    from helpers import write_jsonl
    pairs = write_jsonl(tmp_path / "pairs.jsonl", make_pairs(8))
    records = dpo(qwen3_moe_dir, pairs, tmp_path / "run", "lora.rank=4", "train.lr=1e-2", "train.max_steps=2",
                  "train.micro_batch_size=4", "checkpoint.interval=2")
    assert records[0]["loss"] == pytest.approx(0.6931, abs=1e-3) and records[1]["loss"] != records[0]["loss"]
    _, load = open_dcp(tmp_path / "run" / "checkpoints" / "step-2")
    assert load("model.layers.0.mlp.experts.lora_B.default.gate_up_proj").abs().max() > 0
