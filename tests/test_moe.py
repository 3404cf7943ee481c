"""Mixture-of-experts models (kernels/moe.py and the load/export paths): routing buffers loaded, saved, exported
and checked against the source; tiny models built offline from configs, ranks in-process (run_ranks)."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import run_ranks, sft

LR0 = ("train.lr=0", "train.max_steps=2", "train.micro_batch_size=4")

MOE = dict(moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
           n_shared_experts=1, first_k_dense_replace=1)
ARCH_SIZES = {
    "deepseek_v3": dict(**MOE, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
    "glm4_moe": dict(**MOE, head_dim=16),
    "qwen3_moe": dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16,
                      output_router_logits=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8, layer_types=None,
                    output_router_logits=True),
}


def make_moe_dir(path, arch: str, fused: bool = False, num_layers: int = 2, seed: int = 0,
                 bias_dtype: torch.dtype = torch.float32, **sizes):
    """A random bf16 `arch` model with the chatml tokenizer saved to `path`; a routing bias (where the router has one)
    of large random values, stored in fp32 as DeepSeek-V3 ships it. `fused`: the tensors under their in-memory names
    (fused experts), which each rank reads in slices, instead of save_pretrained's per-expert layout."""
    import transformers as T
    from transformers import AutoModelForCausalLM

    from _tokenizers import build_tokenizer
    tok = build_tokenizer("chatml")
    kw = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
              bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    kw = {k: v for k, v in {**kw, **ARCH_SIZES[arch], **sizes}.items() if v is not None}
    config = T.AutoConfig.for_model(arch, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.data = torch.randn(buf.shape, generator=torch.Generator().manual_seed(seed + 1)).to(bias_dtype)
    model.save_pretrained(path)
    if fused:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors",
                  metadata={"format": "pt"})
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def biased(tmp_path_factory):
    """A DeepSeek-V3 model with a non-zero routing bias, per-expert on disk (the rank-0 load), and a GLM-4.5-style one
    fused on disk (per-rank slices)."""
    root = tmp_path_factory.mktemp("biased")
    return {(arch, fused): make_moe_dir(root / f"{arch}-{fused}", arch, fused=fused)
            for arch, fused in (("deepseek_v3", False), ("glm4_moe", True))}


INPUT_IDS = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))


def reference_logits(model_dir) -> torch.Tensor:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(INPUT_IDS).logits


def our_logits(model_dirs, prepare=None) -> list[tuple[str, torch.Tensor, dict]]:
    """On each rank, for each dir: the path the load took, the logits of build_model's model, its routing biases.
    `prepare`: (source, dir) prepare-checkpoint writes first (on these ranks), loaded last."""
    from finetune.distributed import init_distributed
    from finetune.load import locate_slices
    from finetune.weights import is_prepared
    from finetune.model import build_model, build_skeleton
    from finetune.tools.prepare import prepare_checkpoint
    device, dims = init_distributed()
    if prepare:
        prepare_checkpoint(str(prepare[0]), str(prepare[1]))
        model_dirs = [*model_dirs, prepare[1]]
    out = []
    for model_dir in model_dirs:
        model, _ = build_model(str(model_dir), device, dims.mesh, [],
                               mixed_precision="fp32")
        path = "prepared" if is_prepared(model_dir) else locate_slices(model, build_skeleton(model.config, None),
                                                                      str(model_dir))
        model.eval()
        with torch.no_grad():
            logits = model(INPUT_IDS).logits
        biases = {n: b.numpy().copy() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
        out.append(("slices" if isinstance(path, dict) else path, logits.numpy(), biases))  # no tensors: see helpers
    return out


def test_routing_bias_is_loaded_on_every_path_and_gives_from_pretrained_logits(biased, tmp_path):
    prepared = tmp_path / "prepared"
    dirs = [*biased.values(), prepared]
    per_rank = run_ranks(our_logits, 2, list(biased.values()), (biased["deepseek_v3", False], prepared))
    for i, model_dir in enumerate(dirs):
        source = biased["deepseek_v3", False] if model_dir == prepared else model_dir
        want = reference_logits(source)
        stored = {k: v for k, v in load_file(source / "model.safetensors").items()
                  if k.endswith("e_score_correction_bias")}
        assert len(stored) == 1 and next(iter(stored.values())).abs().min() > 0  # non-zero, fp32 on disk
        for path, logits, biases in (r[i] for r in per_rank):
            assert path == ("prepared" if model_dir == prepared else "slices" if "True" in model_dir.name
                            else f"{'DeepseekV3' if 'deepseek' in model_dir.name else 'Glm4Moe'}ForCausalLM stores "
                                 f"model.layers.1.mlp.experts.0.down_proj.weight in a layout that transformers "
                                 f"converts on load"), path
            assert set(biases) == set(stored) and all(torch.equal(torch.from_numpy(biases[k]), stored[k])
                                                       for k in stored), model_dir
            torch.testing.assert_close(torch.from_numpy(logits), want, rtol=1e-5, atol=1e-5)


def test_lr0_export_equals_the_source_and_the_check_compares_untrained_tensors_with_it(chat_file, tmp_path):
    from finetune.hf.verify import VerifyError
    from test_export import export, read_weights
    source = make_moe_dir(tmp_path / "source", "deepseek_v3", bias_dtype=torch.bfloat16)
    sft(source, chat_file, tmp_path / "run", *LR0, nproc=2)
    # --dtype auto: each tensor as the source stores it (a bf16 bias too, which transformers keeps in fp32 on load)
    printed = export(tmp_path / "run", tmp_path / "hf", "auto")
    assert "verified" in printed, printed
    original, exported = read_weights(source), read_weights(tmp_path / "hf")
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    # a load that dropped the bias (the checkpoint holds zeros) is caught: the check compares it with the source
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    original[bias] = original[bias] + 1
    save_file(original, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(VerifyError, match=f"export check: {bias} differs from the source model's"):
        export(tmp_path / "run", tmp_path / "hf2", "auto")
    assert not (tmp_path / "hf2").exists()


# ------------------------------------------------------------------------------------- router load-balancing loss

COEF = 0.05


def aux_batches(seed: int, rows: int, packed: bool = False) -> dict:
    """A padded micro-batch (attention_mask; rows of different lengths) or a packed one (position_ids restarting per
    sample, padding at the end with position 0)."""
    g = torch.Generator().manual_seed(seed)
    width = 12
    ids = torch.randint(3, 200, (rows, width), generator=g)
    lengths = [width - (i * 3 + seed) % 7 for i in range(rows)]
    if packed:
        pos = torch.zeros(rows, width, dtype=torch.long)
        for i, n in enumerate(lengths):
            pos[i, :n] = torch.cat([torch.arange(n // 2), torch.arange(n - n // 2)])
        return {"input_ids": ids, "position_ids": pos, "lengths": lengths}
    mask = torch.zeros(rows, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask}


def aux_on_ranks(model_dir, cases):
    """For each (ac_ratio, micro-batches per rank) case, this rank's micro-batches through RouterLoss alone (no
    cross-entropy): (the step's value, the full gradient of every router weight divided by the label count, as
    train_step divides it). One model per AC setting."""
    import torch.distributed as dist

    from finetune.distributed import init_distributed
    from finetune.kernels.moe import RouterLoss
    from finetune.model import build_model
    from finetune.weights import clean_fqn
    device, dims = init_distributed()
    models, results = {}, []
    for ac_ratio, micro_batches_per_rank in cases:
        if ac_ratio not in models:
            t = []
            models[ac_ratio] = build_model(str(model_dir), device, dims.mesh, t, mixed_precision="fp32",
                                           ac_ratio=ac_ratio)[0]
            models[ac_ratio].router = RouterLoss(models[ac_ratio], COEF)
        model, router = models[ac_ratio], models[ac_ratio].router
        model.zero_grad(set_to_none=True)
        mine = micro_batches_per_rank[dist.get_rank()]
        num_labels = 100  # any count: the term is scaled by it and the gradients divided by it
        router.begin_step(mine, num_labels // dist.get_world_size(), device)
        for i, batch in enumerate(mine):
            model.set_requires_gradient_sync(i == len(mine) - 1)
            inputs = {k: v for k, v in batch.items() if k != "lengths"}
            with router.collect(batch):
                out = model(**inputs, use_cache=False)
            (router.micro_batch_loss() + 0 * out.logits.mean()).backward()
        value = router.end_step().item()
        grads = {clean_fqn(n): (p.grad.full_tensor() / num_labels).numpy() for n, p in model.named_parameters()
                 if n.endswith("gate.weight")}
        results.append((value, grads))
    return results


def hf_aux(model_dir, batch):
    """transformers' own: load_balancing_loss_func over the router logits (output_router_logits) and the mask, and
    the gradient of COEF times it on the router weights."""
    import importlib

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    func = importlib.import_module(type(model).__module__).load_balancing_loss_func
    out = model(**{k: v for k, v in batch.items() if k != "lengths"}, output_router_logits=True, use_cache=False)
    mask = batch.get("attention_mask")
    if mask is None:  # packed: the real tokens are each row's first `lengths`
        mask = torch.stack([torch.arange(batch["input_ids"].shape[1]) < n for n in batch["lengths"]]).long()
    aux = func(out.router_logits, model.config.num_experts if hasattr(model.config, "num_experts")
               else model.config.num_local_experts, model.config.num_experts_per_tok, mask)
    (COEF * aux).backward()
    return aux.item(), {n: p.grad.numpy() for n, p in model.named_parameters() if n.endswith("gate.weight")}


def cat(*batches):
    out = {k: torch.cat([b[k] for b in batches]) for k in batches[0] if k != "lengths"}
    if "lengths" in batches[0]:
        out["lengths"] = [n for b in batches for n in b["lengths"]]
    return out


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    return make_moe_dir(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe")


def test_aux_loss_over_the_global_batch_equals_transformers_at_any_split_and_with_ac(qwen3_moe_dir):
    """Padded and packed micro-batches: 1 process on the concatenation, 2 ranks with a batch each (with and
    without activation checkpointing re-running the routers) give transformers' value and gradient; 1 process with
    the two as micro-batches gives its value."""
    batches = {packed: (aux_batches(1, 2, packed), aux_batches(2, 3, packed)) for packed in (False, True)}
    want = {packed: hf_aux(qwen3_moe_dir, cat(a, b)) for packed, (a, b) in batches.items()}
    one = run_ranks(aux_on_ranks, 1, qwen3_moe_dir, [c for a, b in batches.values() for c in
                                                     ((0.0, [[cat(a, b)]]), (0.0, [[a, b]]))])[0]
    two = run_ranks(aux_on_ranks, 2, qwen3_moe_dir, [c for a, b in batches.values() for c in
                                                     ((0.0, [[a], [b]]), (1.0, [[a], [b]]))])
    for i, packed in enumerate((False, True)):
        value, grads = want[packed]
        split_value = one[2 * i + 1][0]
        assert abs(split_value - value) < 1e-6, (packed, split_value, value)
        for got_value, got_grads in (one[2 * i], *(r[2 * i + j] for r in two for j in (0, 1))):
            assert abs(got_value - value) < 1e-6, (packed, got_value, value)
            assert set(got_grads) == set(grads) and len(grads) == 2
            for name, grad in got_grads.items():
                torch.testing.assert_close(torch.from_numpy(grad), torch.from_numpy(grads[name]), rtol=1e-4,
                                           atol=1e-7)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_the_aux_loss_counts_the_experts_the_tokens_were_routed_to(biased, arch):
    """Issue 53 item 2: DeepSeek-V3's and GLM-4.5's routers pick among groups of experts after adding a bias; the
    loss recounted a softmax top-k of the logits (e.g. [119, 148, 116, 129] for a routed load of [256, 256, 0, 0])."""
    from transformers import AutoModelForCausalLM

    from finetune.kernels.moe import RouterLoss, find_experts
    fused = arch == "glm4_moe"
    model = AutoModelForCausalLM.from_pretrained(biased[arch, fused], dtype=torch.float32)
    ids = aux_batches(1, 3)["input_ids"]
    # no padding: transformers' DeepSeek-V3 attention fails on a padded batch of this tiny config
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    routed = []  # what each MoE layer's experts were handed: the real routing
    for experts in find_experts(model):
        experts.register_forward_pre_hook(lambda m, args: routed.append(args[1].reshape(len(batch["input_ids"]), -1,
                                                                                          args[1].shape[-1])))
    router = RouterLoss(model, COEF)
    router.begin_step([batch], 10, "cpu")
    with router.collect(batch):
        model(**batch, use_cache=False)
    router.micro_batch_loss()
    num_experts = model.config.n_routed_experts
    real = batch["attention_mask"].bool()
    load = torch.bincount(torch.cat([r[real].reshape(-1) for r in routed]), minlength=num_experts).float()
    assert load.sum() == real.sum() * 2 * len(routed) and (load == 0).sum() >= num_experts // 2  # one group of two
    torch.testing.assert_close(router.step_sums[:num_experts].float(), load)


def test_compiled_blocks_compile_once_with_the_router_loss(qwen3_moe_dir):
    """Regional compile of a 2-layer MoE whose config asks transformers for its router logits: one graph serves every
    block while RouterLoss records them (a list of them, growing by layer, was a guard: a recompile per layer, and
    eager blocks past dynamo's limit of 8), with the uncompiled value."""
    from transformers import AutoModelForCausalLM

    from finetune.kernels.moe import RouterLoss, apply_experts_implementation
    model = AutoModelForCausalLM.from_pretrained(qwen3_moe_dir, dtype=torch.float32)
    assert len(model.model.layers) == 2
    assert model.config.output_router_logits
    apply_experts_implementation(model, "grouped_mm")
    router, batch = RouterLoss(model, COEF), aux_batches(1, 2)

    def value():
        router.begin_step([batch], 10, "cpu")
        with router.collect(batch):
            model(**batch, use_cache=False)
        return router.micro_batch_loss()
    eager, graphs = value(), []

    def backend(gm, inputs):  # one callable for every block (each its own would be a recompile)
        return graphs.append(gm) or gm.forward
    for layer in model.model.layers:
        layer.compile(backend=backend)
    torch.testing.assert_close(value(), eager)
    assert len(graphs) == 1


# ----------------------------------------------------------------------------------- experts, settings refused

@pytest.mark.parametrize("override, message", [
    ("model.experts_implementation=loop", "error: model.experts_implementation must be one of 'grouped_mm', 'eager', "
                                          "'batched_mm', got 'loop'"),
    ("moe.aux_loss_coef=-0.5", "error: moe.aux_loss_coef must be >= 0 (or -1: the architecture's), got -0.5"),
])
def test_bad_moe_settings_are_one_line_and_exit_2(qwen3_moe_dir, chat_file, tmp_path, override, message):
    from helpers import BASE, invoke
    result = invoke("sft", "--model", qwen3_moe_dir, "--dataset", chat_file, "--output-dir", tmp_path / "run", *BASE,
                    "train.max_steps=1", override)
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [message], result.output
    assert not (tmp_path / "run").exists()


def test_grouped_mm_equals_eager_in_loss_and_gradients(qwen3_moe_dir, capsys):
    """Through the loss (a cross-entropy: never .sum().backward() on grouped GEMM output, whose backward rejects a
    stride-0 gradient)."""
    from transformers import AutoModelForCausalLM

    from finetune.kernels.moe import apply_experts_implementation
    batch = aux_batches(3, 3)
    results = {}
    for name in ("grouped_mm", "eager", "batched_mm"):
        model = AutoModelForCausalLM.from_pretrained(qwen3_moe_dir, dtype=torch.float32)
        apply_experts_implementation(model, name)
        assert model.config._experts_implementation == name
        logits = model(**batch, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["input_ids"][:, 1:].flatten())
        loss.backward()
        results[name] = loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert "moe: experts grouped_mm (2 MoE layers of 8 experts)" in capsys.readouterr().out
    (loss, grads), eager_grads = results["grouped_mm"], results["eager"][1]
    assert any("experts.gate_up_proj" in n for n in grads) and set(grads) == set(eager_grads)
    for other_loss, other_grads in (results["eager"], results["batched_mm"]):
        torch.testing.assert_close(other_loss, loss, rtol=1e-5, atol=1e-6)
        for n, g in grads.items():
            torch.testing.assert_close(other_grads[n], g, rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------------------ training on 2 ranks

@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_moe_models_train_on_two_ranks_as_one_process(arch, chat_file, tmp_path, capfd):
    """fp32, packed, with the architecture's load-balancing loss (router_aux_loss_coef 0.001): the same global
    batch in one micro-batch per rank gives the same losses and aux losses on 1 and 2 ranks."""
    from helpers import read_metrics
    model_dir = make_moe_dir(tmp_path / "model", arch)
    # the default attention: varlen, with gpt-oss's sinks
    common = ("train.max_steps=4", "data.packing=true", "data.max_seq_len=128", "train.lr=1e-2")
    one = sft(model_dir, chat_file, tmp_path / "one", *common, "train.micro_batch_size=4")
    printed = capfd.readouterr().out
    assert "moe: router load-balancing loss coefficient 0.001 (the architecture default)" in printed, printed
    assert "moe: experts grouped_mm (2 MoE layers of " in printed
    assert arch != "gpt_oss" or "kernels: attention varlen (attention sinks: one sdpa call per sample)" in printed
    two = sft(model_dir, chat_file, tmp_path / "two", *common, "train.micro_batch_size=2", nproc=2)
    # fp32 summation order differs between the splits; at lr 1e-2 gpt-oss drifts by 1.02e-5 relative by step 4
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=5e-5)
    assert [r["aux_loss"] for r in two] == pytest.approx([r["aux_loss"] for r in one], rel=5e-5)
    assert all(r["aux_loss"] > 0 for r in one)
    assert one[-1]["loss"] < one[0]["loss"]
    assert "aux_loss" in read_metrics(tmp_path / "one")[0]


# ------------------------------------------------------------------------------------------ one mesh or many

def two_mesh_step(max_norm: float):
    """On each rank: a module whose parameters live on two device meshes (as experts on a mesh of their own would):
    the grad norm, the clipped gradients and an AdamW step of train's functions, against the plain-tensor math."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from finetune.optim import build_optimizer
    from finetune.optim import clip_grad_norm
    dense = init_device_mesh("cpu", (2,))
    experts = init_device_mesh("cpu", (1, 2), mesh_dim_names=("ep", "shard"))
    g = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(4, 6, generator=g), "b": torch.randn(6, generator=g),
            "e": torch.randn(2, 4, 6, generator=g)}
    grads = {k: torch.randn(v.shape, generator=g) for k, v in full.items()}
    module = torch.nn.Module()
    placements = {"w": (dense, [Shard(0)]), "b": (dense, [Shard(0)]), "e": (experts, [Replicate(), Shard(1)])}
    for k, (mesh, where) in placements.items():
        setattr(module, k, torch.nn.Parameter(distribute_tensor(full[k].clone(), mesh, where)))
        getattr(module, k).grad = distribute_tensor(grads[k].clone(), mesh, where)
    norm = clip_grad_norm(module, max_norm)
    want = torch.cat([t.flatten() for t in grads.values()]).norm()
    clipped = {k: getattr(module, k).grad.full_tensor() for k in full}
    optimizer = build_optimizer(module, 0.1, 0.1, (0.9, 0.95), 1e-8)
    optimizer.step()
    reference = {k: torch.nn.Parameter(v.clone()) for k, v in full.items()}
    for k, p in reference.items():
        p.grad = clipped[k].clone()
    plain = torch.optim.AdamW([{"params": [reference["w"], reference["e"]], "weight_decay": 0.1},
                               {"params": [reference["b"]], "weight_decay": 0.0}], lr=0.1, betas=(0.9, 0.95), eps=1e-8)
    plain.step()
    coef = min(1.0, max_norm / (want.item() + 1e-6)) if max_norm > 0 else 1.0
    return (abs(norm.item() - want.item()) < 1e-5,
            all(torch.allclose(clipped[k], grads[k] * coef, atol=1e-6) for k in full),
            all(torch.allclose(getattr(module, k).full_tensor(), reference[k], atol=1e-6) for k in full),
            len(optimizer.param_groups))


def test_clipping_scaling_and_the_optimizer_group_parameters_by_mesh():
    for max_norm in (1.0, 0.0):
        for norm_ok, clipped_ok, step_ok, num_groups in run_ranks(two_mesh_step, 2, max_norm):
            assert norm_ok and clipped_ok and step_ok and num_groups == 3, (max_norm, norm_ok, clipped_ok, step_ok)


def test_lora_on_per_expert_weights_says_at_start_up_and_at_export_that_adapter_export_works(qwen3_moe_dir, chat_file,
                                                                                             tmp_path, capfd):
    """Issue 53 item 10: the merged export of LoRA over a base that stores its experts per expert (as save_pretrained
    writes them) failed with "does not hold the model ... 24 unexpected" and no hint; --adapter exports it."""
    from finetune.errors import ModelError
    from finetune.preflight import preflight
    from helpers import export_hf, sft_config
    out, lora = tmp_path / "run", ("train.max_steps=1", "lora.rank=4", 'lora.target_modules=["q_proj"]')
    layout = "stores tensors in a layout that transformers converts on load (e.g. model.layers.0.mlp.experts.0."
    preflight(sft_config(qwen3_moe_dir, chat_file, out, *lora))  # what `finetune sft` checks before the ranks start
    assert capfd.readouterr().out.splitlines() == [
        f"note: {qwen3_moe_dir} {layout}down_proj.weight), which a merged export of LoRA cannot read yet: export this "
        f"run with `finetune export-hf --adapter`"]
    sft(qwen3_moe_dir, chat_file, out, *lora)
    with pytest.raises(ModelError) as e:
        export_hf(str(out), str(tmp_path / "merged"), "float32")
    assert str(e.value) == (f"the LoRA base model '{qwen3_moe_dir}' {layout}down_proj.weight), which a merged export "
                            f"cannot read yet: export the adapter with --adapter (a PEFT dir that peft loads over the "
                            f"base)")
    assert not (tmp_path / "merged").exists()
    export_hf(str(out), str(tmp_path / "adapter"), "float32", adapter=True)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
