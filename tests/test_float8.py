"""FP8 training (model.fp8, finetune/kernels/float8.py) on CPU in torchao's emulated mode: 2 FSDP ranks train like 1
process and within 2% of bf16; the module filter; checkpoints and exports keep the model's dtypes and a run resumes
with fp8 on or off; the refusals and notes. Tests that run torchao are skipped where it is not installed."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from helpers import BASE, invoke, losses, read_metrics, sft

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None,
                                   reason="torchao is not installed (the fp8 extra)")
# micro-batches of one row: a rank's micro-batch is then one of the 1-process run's, with the same dynamic scales
STEPS = ("train.max_steps=5", "train.micro_batch_size=1", "train.grad_accum_steps=2")
RECIPES = {"tensorwise": ("model.fp8=tensorwise", "model.fp8_all_gather=false"),
           "tensorwise_all_gather": ("model.fp8=tensorwise", "model.fp8_all_gather=true"),
           "rowwise": ("model.fp8=rowwise",)}


def skeleton(arch: str = "llama", **sizes):
    """A meta skeleton of a tiny model built from its config alone (no files)."""
    import transformers as T

    from finetune.model import build_skeleton
    kw = {**dict(vocab_size=100, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=False), **sizes}
    if arch == "mixtral":
        return build_skeleton(T.MixtralConfig(**kw, num_local_experts=4, num_experts_per_tok=2))
    return build_skeleton(T.LlamaConfig(**kw))


@needs_torchao
def test_the_filter_keeps_lm_head_embeddings_routers_and_odd_dims_in_bf16(capsys):
    from torch import nn
    from torchao.float8.float8_linear import Float8Linear

    from finetune.kernels.float8 import apply_float8
    model = skeleton()
    names = apply_float8(model, "tensorwise", shards=2, emulate=True)
    assert len(names) == 2 * 7  # q, k, v, o, gate_proj, up_proj, down_proj in each block
    assert all(isinstance(model.get_submodule(n), Float8Linear) for n in names)
    assert type(model.get_output_embeddings()) is nn.Linear and type(model.get_input_embeddings()) is nn.Embedding
    assert "14 of 15 Linear layers in fp8; 1 kept in bf16: lm_head (output)" in capsys.readouterr().out
    # intermediate 72: the MLP's Linear layers have a dim that is not a multiple of 16
    apply_float8(odd := skeleton(intermediate_size=72), "rowwise", shards=2, emulate=True)
    assert type(odd.model.layers[0].mlp.up_proj) is nn.Linear and isinstance(odd.model.layers[0].self_attn.q_proj,
                                                                             Float8Linear)
    assert "model.layers.*.mlp.down_proj x2 (dims not multiples of 16)" in capsys.readouterr().out
    # a tiny MoE: its router (and a Linear named like one, or with one output per expert) stays out
    moe = skeleton("mixtral")
    moe.model.layers[0].mlp.router_proj = nn.Linear(64, 16, device="meta")  # 16: not caught by its dims
    moe.model.layers[1].mlp.scores = nn.Linear(64, 4, device="meta")  # as many outputs as experts
    apply_float8(moe, "tensorwise", shards=2, emulate=True)
    assert not any(isinstance(m, Float8Linear) for n, m in moe.named_modules() if ".mlp." in n)
    assert isinstance(moe.model.layers[1].self_attn.o_proj, Float8Linear)
    # and the fused experts, most of an MoE's weights, which the line did not mention (issue 53)
    assert "3 kept in bf16: model.layers.*.mlp.router_proj (router), model.layers.*.mlp.scores (router), lm_head " \
        "(output); embeddings in bf16; the fused experts of 2 MoE layers stay in bf16 (3-D weights, not Linear)" \
        in capsys.readouterr().out


@pytest.fixture(scope="module")
def bf16_run(llama_dir, chat_file, reference):
    """The 2-rank bf16 run of STEPS, with a checkpoint at step 3 (constant lr: a 3-step run's own step 3)."""
    return reference(llama_dir, chat_file, *STEPS, "checkpoint.interval=3", nproc=2)


@pytest.fixture(scope="module")
def bf16_two_ranks(bf16_run):
    return losses(bf16_run)


@pytest.fixture(scope="module")
def fp8_two_ranks(llama_dir, chat_file, tmp_path_factory):
    """fp8_two_ranks(recipe) -> (output dir, what it printed) of the 2-rank fp8 run of STEPS, run once per module;
    the tensorwise_all_gather run also exports from the live model at its end (the checkpoints test reads it)."""
    import contextlib
    import io
    runs = {}

    def run(recipe):
        if recipe not in runs:
            out, printed = tmp_path_factory.mktemp(recipe) / "two", io.StringIO()
            export = ("checkpoint.export_hf=true",) if recipe == "tensorwise_all_gather" else ()
            with contextlib.redirect_stdout(printed):
                sft(llama_dir, chat_file, out, *STEPS, *RECIPES[recipe], *export, nproc=2)
            runs[recipe] = out, printed.getvalue()
        return runs[recipe]
    return run


@needs_torchao
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_two_ranks_train_like_one_process_and_within_2_percent_of_bf16(recipe, llama_dir, chat_file, tmp_path,
                                                                       bf16_two_ranks, fp8_two_ranks):
    out, printed = fp8_two_ranks(recipe)
    two = read_metrics(out)
    assert "Linear layers in fp8" in printed
    one = sft(llama_dir, chat_file, tmp_path / "one", *STEPS, "train.grad_accum_steps=4", *RECIPES[recipe])
    # step 0 (the same weights, scales and micro-batches) agrees to float noise; after updates the fp8 casts amplify
    # the ulp-level order-of-summation gap of the reduced gradients (tensorwise on an AMD EPYC: 5e-8 at step 2, 3e-5
    # at step 4), still well under fp8's own gap to bf16 (7e-4 at step 3, asserted below)
    assert two[0]["loss"] == pytest.approx(one[0]["loss"], rel=1e-6)
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-4)
    assert [r["loss"] for r in two] == pytest.approx(bf16_two_ranks, rel=0.02)
    # the matmuls really ran in (emulated) fp8: a gap to bf16 above the 1e-4 allowed between 2 ranks and 1 process
    assert max(abs(r["loss"] / b - 1) for r, b in zip(two, bf16_two_ranks)) > 3e-4
    assert two[-1]["loss"] < two[0]["loss"]


@needs_torchao
def test_checkpoints_and_exports_keep_the_model_dtypes_and_resume_with_fp8_on_or_off(llama_dir, chat_file, tmp_path,
                                                                                      capsys, fp8_two_ranks, bf16_run):
    import torch.distributed.checkpoint as dcp

    from test_export import export, read_weights
    fp8, three = RECIPES["tensorwise_all_gather"], ("train.max_steps=3", *STEPS[1:], "checkpoint.interval=3")
    straight_dir = fp8_two_ranks("tensorwise_all_gather")[0]  # STEPS with fp8, and an export from the live model
    straight, out = losses(straight_dir), tmp_path / "run"
    sft(llama_dir, chat_file, out, *three, *fp8, nproc=2)
    step3, plain3 = out / "checkpoints" / "step-3", bf16_run / "checkpoints" / "step-3"  # plain3: without fp8
    def dtypes(step_dir):  # every stored tensor's dtype by name (non-tensor entries: None)
        meta = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
        return {k: getattr(getattr(m, "properties", None), "dtype", None) for k, m in meta.items()}
    stored = dtypes(step3)
    assert stored == dtypes(plain3)  # the same tensors in the same dtypes as without fp8: no fp8, no torchao subclass
    assert {d for k, d in stored.items() if k.startswith("model.")} == {torch.float32}  # fp32 masters
    # resumed with fp8 on: the uninterrupted run; with fp8 off, and fp8 on from a run without: trains on, announced
    sft(llama_dir, chat_file, out, *STEPS, "checkpoint.interval=3", *fp8, nproc=2)
    assert losses(out) == pytest.approx(straight, rel=1e-5)
    capsys.readouterr()
    off = sft(llama_dir, chat_file, tmp_path / "off", *STEPS, f"checkpoint.resume_from={step3}", nproc=2)
    assert "model.fp8 'tensorwise' -> 'off'" in capsys.readouterr().out  # the resume note names it
    on = sft(llama_dir, chat_file, tmp_path / "on", *STEPS, f"checkpoint.resume_from={plain3}", *fp8, nproc=2)
    for tail in (off, on):
        assert [r["step"] for r in tail] == [4, 5]
        assert [r["loss"] for r in tail] == pytest.approx(straight[3:], rel=0.02)
    # the export: the model's own dtype and tensor names, as a run without fp8 exports, and its check passes
    assert "verified" in export(step3, tmp_path / "hf")
    export(plain3, tmp_path / "hf_plain")
    weights, plain_weights = read_weights(tmp_path / "hf"), read_weights(tmp_path / "hf_plain")
    assert {n: t.dtype for n, t in weights.items()} == {n: t.dtype for n, t in plain_weights.items()}
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    live = read_weights(straight_dir / "hf")
    assert {n: t.dtype for n, t in live.items()} == {n: t.dtype for n, t in plain_weights.items()}


def test_config_refusals_are_one_line_and_exit_2(llama_dir, chat_file, tmp_path):
    from finetune.config import ConfigError
    from finetune.run.checks import validate

    from helpers import sft_config
    r = invoke("sft", "--model", llama_dir, "--dataset", chat_file, "--output-dir", tmp_path / "o", *BASE,
               "model.fp8=tensorwise", "lora.rank=8")
    assert r.exit_code == 2 and "model.fp8=tensorwise with LoRA (lora.rank=8) is not supported" in r.output
    r = invoke("sft", "--model", llama_dir, "--dataset", chat_file, "--output-dir", tmp_path / "o", *BASE,
               "model.fp8=fp4")
    assert r.exit_code == 2 and "model.fp8" in r.output
    r = invoke("sft", "--model", llama_dir, "--dataset", chat_file, "--output-dir", tmp_path / "o", *BASE,
               "model.fp8=tensorwise", "parallel.cpu_offload=true")
    assert r.exit_code == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "model.fp8=tensorwise with parallel.cpu_offload=true is not supported" in r.stderr
    cfg = sft_config(llama_dir, chat_file, tmp_path / "o", "model.fp8=rowwise")
    cfg.parallel.tp = 2  # tensor parallel, not built yet: any such setting is refused
    with pytest.raises(ConfigError, match=r"model.fp8=rowwise with tensor parallel \(parallel.tp=2\)"):
        validate(cfg)


def test_device_and_install_refusals_and_notes(monkeypatch, capsys):
    from finetune.errors import ModelError
    from finetune.kernels import float8
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    with pytest.raises(ModelError, match=r"compute capability >= 8.9.*A100 is sm 8.0: set model.fp8=off"):
        float8.check_float8("tensorwise", torch.device("cuda", 0), compile=True, hidden_size=8192)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    float8.check_float8("tensorwise", torch.device("cuda", 0), compile=True, hidden_size=8192)  # H100: no note
    assert capsys.readouterr().out == ""
    float8.check_float8("rowwise", torch.device("cpu"), compile=False, hidden_size=64)
    out = capsys.readouterr().out
    assert "hidden size of 64 (< 4096)" in out and "without model.compile is slower" in out
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelError, match=r"needs torchao: install the fp8 extra \(pip install 'finetune\[fp8\]'"):
        float8.check_float8("rowwise", torch.device("cpu"), compile=True, hidden_size=8192)


@needs_torchao
def test_uneven_shards_under_fp8_all_gather_are_refused(capsys):
    from finetune.errors import ModelError
    from finetune.kernels.float8 import apply_float8
    with pytest.raises(ModelError, match=r"q_proj has 64 rows, which the 3 ranks sharding it do not divide"):
        apply_float8(skeleton(), "tensorwise", shards=3, emulate=True)
    apply_float8(skeleton(), "tensorwise", shards=3, all_gather=False, emulate=True)  # bf16 all-gather pads
    apply_float8(skeleton(), "rowwise", shards=3, emulate=True)  # rowwise never gathers fp8


@pytest.mark.parametrize("recipe, expected", [
    # the tiny Llama: 4 blocks of q, o (64 x 64), k, v (32 x 64), gate, up, down (160 x 64): 43,008 weights a block
    ("tensorwise", -2 * 43_008 * (2 - 1) + 4 * 3 * 28),  # fp8 all-gather: 1 byte, not 2, for the 2 blocks in flight
    ("rowwise", 43_008 + 4 * 4 * (2 * 128 + 2 * 96 + 3 * 224)),  # one block's fp8 copies; scales per row and column
])
def test_plan_counts_the_fp8_weights_in_flight_and_the_scales(recipe, expected, llama_dir):
    import json
    result = invoke("plan", "--model", llama_dir, "--nproc-per-node", 2, "--sac-ratios", "0", "--micro-batch-sizes",
                    1, "--json", f"model.fp8={recipe}", "train.mixed_precision=bf16")
    assert result.exit_code == 0, (result.output, result.exception)
    plan = json.loads(result.stdout)
    assert plan["in_flight"]["fp8"] == expected
    off = json.loads(invoke("plan", "--model", llama_dir, "--nproc-per-node", 2, "--sac-ratios", "0",
                            "--micro-batch-sizes", 1, "--json", "train.mixed_precision=bf16").stdout)
    assert "fp8" not in off["in_flight"] and plan["points"][0]["total"] == off["points"][0]["total"] + expected


@needs_torchao
def test_bench_sweeps_fp8_beside_off(llama_dir, chat_file, tmp_path, monkeypatch):
    import json
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "bench"
    result = invoke("bench", "--model", llama_dir, "--dataset", chat_file, "--sac-ratios", "0", "--steps", 1,
                    "--warmup", 0, "--fp8", "off,tensorwise", "--output-dir", out, "data.max_seq_len=64",
                    "train.micro_batch_size=2", "train.mixed_precision=fp32")
    assert result.exit_code == 0, (result.output, result.exception)
    off, fp8 = json.loads((out / "bench.json").read_text())["points"]
    assert (off["fp8"], fp8["fp8"]) == ("off", "tensorwise") and "error" not in off and "error" not in fp8
    assert fp8["losses"] != off["losses"] and fp8["losses"] == pytest.approx(off["losses"], rel=0.02)
    assert fp8["overhead"] == 0.0  # against the same model.fp8 at the smallest ratio, not against bf16
    assert "| 0 | tensorwise | 0/4 |" in (out / "bench.md").read_text()
    assert invoke("bench", "--model", llama_dir, "--fp8", "fp4").exit_code == 2
