"""Expert parallelism (finetune/parallel/expert.py): ranks with different batches, the experts split over them, against
one process on the concatenation; tiny MoE models built offline (test_moe.make_moe_dir), ranks in-process."""
from __future__ import annotations

import pytest
import torch

from helpers import run_ranks
from test_moe import aux_batches, cat, make_moe_dir


def ep_step(model_dir, ep: int, batches: list[dict], experts: str = "grouped_mm", fold: int = 0):
    """On each rank: its own batch (batches[rank]) through build_model's model with parallel.ep=`ep`: (the global
    loss, every parameter's full gradient, the experts' local rows and mesh dims, all-to-all calls made, the rows
    of the experts' (3-D) tensors this rank read from the safetensors). `fold`: the routers pick expert i % fold."""
    from functools import partial

    import torch.distributed as dist

    import finetune.load
    from finetune.distributed import all_reduce, init_distributed
    from finetune.parallel.expert import apply_ep
    from finetune.kernels.moe import apply_experts_implementation, find_experts, router_recorder
    from finetune.model import Transform, build_model
    from finetune.weights import clean_fqn
    device, dims = init_distributed(ep=ep)
    t = [Transform("kernels", lambda model, layers: apply_experts_implementation(model, experts))]
    if ep > 1:
        t.append(Transform("expert_parallel", partial(apply_ep, mesh=dims.expert_mesh)))
    reads, read_rows = [], finetune.load.read_rows
    finetune.load.read_rows = lambda entry, start, stop: (len(entry.shape) == 3 and reads.append((start, stop))) or \
        read_rows(entry, start, stop)
    model = build_model(str(model_dir), device, dims.mesh, t, mixed_precision="fp32")[0]
    finetune.load.read_rows = read_rows
    for gate in (m for m in model.modules() if fold and isinstance(m, router_recorder(model)[0])):
        gate.register_forward_hook(lambda module, args, out: (*out[:2], out[2] % fold))
    calls, exchange = [], dist.all_to_all_single
    dist.all_to_all_single = lambda *a, **k: calls.append(1) or exchange(*a, **k)
    loss = rank_loss_backward(model, batches)
    dist.all_to_all_single = exchange
    grads = {clean_fqn(n): p.grad.full_tensor().numpy() for n, p in model.named_parameters()}
    weight = find_experts(model)[0].gate_up_proj
    return (all_reduce(loss.detach()).item(), grads, weight.to_local().shape[0], weight.device_mesh.mesh_dim_names,
            len(calls), sorted(set(reads)))


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    """Fused experts on disk: each rank reads its slices (save_pretrained's per-expert layout: rank 0 reads it)."""
    return make_moe_dir(tmp_path_factory.mktemp("qwen3_moe_ep"), "qwen3_moe", fused=True, num_layers=1)


def rank_loss_backward(model, parts: list[dict]):
    """This rank's batch (parts[rank]): its summed token loss over every rank's label count, backward run."""
    import torch.distributed as dist
    batch = parts[dist.get_rank()]
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)[:, 1:]
    num_labels = sum(int((b["attention_mask"][:, 1:] != 0).sum()) for b in parts)
    logits = model(**batch, use_cache=False).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / num_labels
    loss.backward()
    return loss


def batches(world_size: int) -> list[dict]:
    return [aux_batches(seed, 2) for seed in range(1, world_size + 1)]


def assert_same(got, want, ep: int):
    """`got` (one rank's ep_step) equals one process's `want` in loss and every gradient."""
    (loss, grads, *_), (want_loss, want_grads, *_) = got, want
    assert abs(loss - want_loss) < 1e-6, (ep, loss, want_loss)
    assert set(grads) == set(want_grads) and any("experts" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(torch.from_numpy(grad), torch.from_numpy(want_grads[name]), rtol=1e-5, atol=1e-7,
                                   msg=lambda m: f"{name} (ep {ep}): {m}")


def prepare(source, out) -> None:
    from finetune.distributed import init_distributed
    from finetune.tools.prepare import prepare_checkpoint
    init_distributed()
    prepare_checkpoint(str(source), str(out))


def test_ep2_on_two_ranks_with_their_own_batches_equals_one_process(qwen3_moe_dir, tmp_path):
    """Each rank holds 4 of the 8 experts (FSDP over 1 rank: 4 rows) and exchanges rows with the other; the batches
    differ, so a rank computing its tokens with its own experts only (or a replicated expert set) cannot agree.
    Grouped GEMM and eager experts; the fused safetensors (each rank reads its experts' rows) and a prepared
    checkpoint (DCP reads them)."""
    parts = batches(2)
    want = run_ranks(ep_step, 1, qwen3_moe_dir, 1, [cat(*parts)])[0]
    run_ranks(prepare, 1, qwen3_moe_dir, tmp_path / "prepared")
    for model_dir, experts in ((qwen3_moe_dir, "grouped_mm"), (qwen3_moe_dir, "eager"),
                               (tmp_path / "prepared", "grouped_mm")):
        for rank, got in enumerate(run_ranks(ep_step, 2, model_dir, 2, parts, experts)):
            assert got[2:4] == (4, ("efsdp", "ep")), got[2:4]
            assert got[4] >= 2 * 2, got[4]  # counts and rows there, rows back (one MoE layer)
            # its own experts' rows only (DCP reads a prepared dir)
            assert got[5] == ([(4 * rank, 4 * rank + 4)] if model_dir == qwen3_moe_dir else []), got[5]
            assert_same(got, want, 2)


def test_a_rank_whose_experts_no_token_chose_still_gets_their_zero_gradients(qwen3_moe_dir):
    """Every token routed to experts 0-3 (rank 0's): rank 1 receives no row, its eager experts compute nothing, and
    their gradients are zeros (FSDP reduce-scatters them on every rank: absent ones hang it), as one process's are."""
    parts = batches(2)
    want = run_ranks(ep_step, 1, qwen3_moe_dir, 1, [cat(*parts)], "eager", 4)[0]
    assert not want[1]["model.layers.0.mlp.experts.gate_up_proj"][4:].any()
    for got in run_ranks(ep_step, 2, qwen3_moe_dir, 2, parts, "eager", 4):
        assert_same(got, want, 2)


def test_ep2_by_fsdp2_and_ep4_on_four_ranks_equal_one_process(qwen3_moe_dir):
    """ep 2 x FSDP 2 (each rank 2 of its group's 4 experts' rows) and ep 4 (each rank 2 experts, whole)."""
    parts = batches(4)
    want = run_ranks(ep_step, 1, qwen3_moe_dir, 1, [cat(*parts)])[0]
    for ep in (2, 4):
        for rank, got in enumerate(run_ranks(ep_step, 4, qwen3_moe_dir, ep, parts)):
            assert got[2:4] == (2, ("efsdp", "ep")), (ep, got[2:4])
            # rank = efsdp index x ep + ep index: its ep group's block of experts, its FSDP shard of that block
            first = (rank % ep) * 8 // ep + (rank // ep) * 2
            assert got[5] == [(first, first + 2)], (ep, rank, got[5])
            assert_same(got, want, ep)


def test_sft_at_ep2_equals_one_process_resumes_without_ep_and_exports_the_source(chat_file, tmp_path, capfd):
    """The whole run at ep 2 on 2 ranks (per-expert layout on disk: rank 0 reads and scatters; every block
    checkpointed: its all-to-alls re-run in backward): the losses, router
    aux losses and grad norms (clipped over both meshes, AdamW grouped by mesh) of one process; its step-2 checkpoint
    resumed without EP (2 ranks, 1 process) and one process's resumed at ep 2 give one process's step 3; at lr 0 the
    export is the source, byte for byte."""
    from helpers import sft
    from test_export import export, read_weights
    model_dir = make_moe_dir(tmp_path / "model", "qwen3_moe", num_layers=1)
    common = ("train.max_steps=3", "train.lr=1e-2", "train.max_grad_norm=0.5")
    saves = ("checkpoint.interval=2", "checkpoint.keep=0")
    one = sft(model_dir, chat_file, tmp_path / "one", *common, "train.micro_batch_size=4", *saves)
    ep = sft(model_dir, chat_file, tmp_path / "ep", *common, "train.micro_batch_size=2", "parallel.ep=2", "ac.ratio=1",
             *saves, nproc=2)
    assert "moe: expert parallel over 2 ranks (4 of 8 experts a rank, FSDP-sharded over 1)" in capfd.readouterr().out
    for key in ("loss", "aux_loss", "grad_norm"):
        assert [r[key] for r in ep] == pytest.approx([r[key] for r in one], rel=1e-5), key
    assert one[-1]["loss"] < one[0]["loss"] and all(r["grad_norm"] > 0.5 for r in one)  # clipped at every step
    # from ep 2 to FSDP on 2 ranks and to one process; from one process to ep 2 (DCP reshards weights and AdamW state)
    for name, start, layout, nproc in (("moved", "ep", ("train.micro_batch_size=2",), 2),
                                       ("alone", "ep", ("train.micro_batch_size=4",), 1),
                                       ("into", "one", ("train.micro_batch_size=2", "parallel.ep=2"), 2)):
        moved = sft(model_dir, chat_file, tmp_path / name, *common, *layout,
                    f"checkpoint.resume_from={tmp_path / start / 'checkpoints' / 'step-2'}", nproc=nproc)
        assert [r["step"] for r in moved] == [3]
        assert [moved[0][k] for k in ("loss", "grad_norm")] == pytest.approx([one[2][k] for k in ("loss", "grad_norm")],
                                                                              rel=1e-5), name
    sft(model_dir, chat_file, tmp_path / "lr0", "train.lr=0", "train.max_steps=1", "train.micro_batch_size=2",
        "parallel.ep=2", nproc=2)
    assert "verified" in export(tmp_path / "lr0", tmp_path / "hf")
    original, exported = read_weights(model_dir), read_weights(tmp_path / "hf")
    assert set(exported) == set(original) and any(".experts.7." in k for k in original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name



@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_ep2_equals_one_process_for_mixtral_deepseek_v3_and_gpt_oss(arch, tmp_path):
    """Mixtral (4 experts), DeepSeek-V3 (shared experts beside the routed ones, grouped routing with its bias kept,
    a dense first layer), gpt-oss (biases on the experts, their own gate)."""
    # DeepSeek-V3's attention (MLA) has as many key-value heads as heads: sdpa with a mask needs it
    sizes = dict(num_layers=2, num_key_value_heads=4) if arch == "deepseek_v3" else dict(num_layers=1)
    model_dir = make_moe_dir(tmp_path / arch, arch, fused=True, **sizes)
    parts = batches(2)
    want = run_ranks(ep_step, 1, model_dir, 1, [cat(*parts)])[0]
    for got in run_ranks(ep_step, 2, model_dir, 2, parts):
        assert got[2] == (4 if arch == "deepseek_v3" else 2), got[2]
        assert_same(got, want, 2)


# ------------------------------------------------------------------------------------------------- refused

@pytest.mark.parametrize("overrides, message", [
    (("parallel.ep=0",), "parallel.ep must be >= 1, got 0"),
    (("parallel.ep=2", "parallel.cp=2"), "parallel.ep=2 with context parallel (parallel.cp > 1) is not supported "
                                         "yet; set parallel.ep=1"),
    (("parallel.ep=2", "model.fp8=tensorwise"), "parallel.ep=2 with model.fp8=tensorwise is not supported yet; set "
                                                "parallel.ep=1"),
    (("parallel.ep=2",), "parallel.ep=2 does not divide the 1 data-parallel ranks (parallel.dp_shard)"),
])
def test_ep_settings_it_does_not_compose_with_are_one_line_and_exit_2(qwen3_moe_dir, chat_file, tmp_path, overrides,
                                                                      message):
    from helpers import BASE, invoke
    result = invoke("sft", "--model", qwen3_moe_dir, "--dataset", chat_file, "--output-dir", tmp_path / "run", *BASE,
                    "train.max_steps=1", *overrides)
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [f"error: {message}"], result.output


@pytest.mark.parametrize("model, overrides, message", [
    ("qwen3_moe_dir", ("parallel.ep=3",), "parallel.ep=3 does not divide the 8 data-parallel ranks "
                                          "(parallel.dp_shard)"),
    ("qwen3_moe_dir", ("parallel.ep=2", "parallel.cp=2"), "parallel.ep=2 with context parallel (parallel.cp > 1) is "
                                                          "not supported yet; set parallel.ep=1")])
def test_plan_refuses_what_ep_does_not_compose_with_in_one_line(model, overrides, message, request):
    """sft's refusals (check_ep; the ranks'), in one line; a dense model: apply_ep's, tested with sft below."""
    from helpers import invoke
    result = invoke("plan", "--model", request.getfixturevalue(model), *overrides)
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [f"error: {message}"], result.output


def test_ep_on_a_dense_model_or_an_expert_count_it_does_not_divide_is_refused(llama_dir, chat_file, tmp_path):
    from finetune.config import ConfigError
    from helpers import run_ranks, sft_config, train_rank
    three = make_moe_dir(tmp_path / "three", "mixtral", num_layers=1, num_local_experts=3)
    for model_dir, message in ((llama_dir, "parallel.ep=2: LlamaForCausalLM is a dense model; set parallel.ep=1"),
                               (three, "parallel.ep=2 does not divide the 3 experts of MixtralForCausalLM's MoE "
                                       "layers")):
        cfg = sft_config(model_dir, chat_file, tmp_path / model_dir.name, "parallel.ep=2", "train.max_steps=1")
        with pytest.raises(ConfigError, match=f"^{message}$".replace("(", r"\(").replace(")", r"\)")):
            run_ranks(train_rank, 2, cfg)
    # dpo: refused by the task's checks (run/checks.validate, which train.train runs again for API callers)
    from finetune.run.checks import validate
    with pytest.raises(ConfigError, match=r"^parallel.ep=2 with finetune dpo is not supported yet"):
        validate(sft_config(three, chat_file, tmp_path / "dpo", "parallel.ep=2"), "dpo")
