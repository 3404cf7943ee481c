"""Checks of the CUDA path that only a GPU can settle, one stage a call (benchmarks/gpu_check.sh runs them); each
prints and appends one JSON line per result to <out>/<stage>.jsonl as it comes (a call cut off keeps what it had).
On a machine without CUDA each stage builds what it needs on the CPU and stops, in one line, where CUDA is first
needed (a dry run).

  varlen      the varlen path (torch's kernel) against a per-sample fp32 reference, forward and the three input
              gradients: GQA 32/8 d128, MHA 16/16 d64 at 4,096 tokens, a 256-token sliding window, d16; fp32 inputs
              (cast to bf16 for the kernel, output back in fp32)
  evalcompile held-out evaluation (loss forward + generate) on regionally compiled blocks, then training steps:
              the dynamo graphs each compiles (evaluation 0: it runs eagerly; training >= 1)
  offload     ac.offload with and without compile on a 2-block Llama: the tensors packed to host memory, how many
              are parameters (0), their bytes, and the gradients against no offload
  flce        Liger's fused linear cross-entropy: the lm_head gradient error against an fp32 reference with
              accum_dtype None (bf16 accumulation) and torch.float32 (finetune's default)
  opac        op-level AC (ac.mode=op) against whole-block AC: how many times the varlen attention kernel runs in
              backward (op: 0, block: once a block)

    python3 benchmarks/gpu_stages.py STAGE [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
STAGES = ("varlen", "evalcompile", "offload", "flce", "opac")
OUT: Path | None = None


def emit(stage: str, **result) -> None:
    line = json.dumps({"stage": stage, **result})
    print(line, flush=True)
    if OUT is not None:
        with open(OUT / f"{stage}.jsonl", "a") as f:
            f.write(line + "\n")


def need_cuda(stage: str) -> torch.device:
    if not torch.cuda.is_available():
        print(f"{stage}: needs a CUDA device from here on (dry run: stops here)", flush=True)
        raise SystemExit(0)
    return torch.device("cuda")


def tiny_llama(layers: int = 2, hidden: int = 256, heads: int = 8, kv: int = 2, attn: str = "varlen"):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from finetune.attention import resolve_attn_implementation
    from finetune.kernels.varlen import register
    cfg = LlamaConfig(vocab_size=1024, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=resolve_attn_implementation(cfg, attn, register))


def packed_batch(lengths: list[int], device, vocab: int = 1024) -> dict:
    from finetune.data import pad_collate
    row = {"input_ids": torch.randint(0, vocab, (sum(lengths),)).tolist(), "labels": [1] * sum(lengths),
           "position_ids": [i for n in lengths for i in range(n)]}
    batch = pad_collate([row], pad_id=0)
    batch["labels"] = batch["input_ids"].clone()
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def stage_varlen() -> None:
    from finetune.kernels import varlen as attention
    from finetune.data.collate import sample_boundaries
    attention.register()
    k = attention._VARLEN
    emit("varlen", torch=torch.__version__, kernel=f"{k['kernel'].__module__}.{k['kernel'].__name__}",
         window=k["window"], gqa=k["gqa"])
    dev = need_cuda("varlen")

    def ref(q, k, v, cu, win):  # fp32 per-segment sdpa, K/V repeated to the query heads
        b, h, s, d = q.shape
        f = lambda x: x.float().transpose(1, 2).reshape(b * s, x.shape[1], d).repeat_interleave(h // x.shape[1], 1)  # noqa: E731
        return attention.segment_attention(f(q), f(k), f(v), cu, cu, 0, 0,
                                           window_size=(win - 1 if win else -1, 0)).view(b, s, h, d)

    torch.manual_seed(0)
    for b, s, h, kv, d, win, dtype in [(2, 1024, 32, 8, 128, None, torch.bfloat16),
                                       (1, 4096, 16, 16, 64, None, torch.bfloat16),
                                       (2, 1024, 8, 2, 128, 256, torch.bfloat16),
                                       (4, 512, 4, 2, 16, None, torch.bfloat16),
                                       (2, 1024, 32, 8, 128, None, torch.float32)]:
        lens = []
        for _ in range(b):
            cuts, n = sorted(torch.randint(1, s - 64, (3,)).tolist()), s - 40
            lens += [x for x in (cuts[0], cuts[1] - cuts[0], cuts[2] - cuts[1], n - cuts[2], s - n) if x > 0]
        bd = sample_boundaries(lens)
        cu = bd["cu_seq_lens_q"].to(dev)
        q, kk, v = (torch.randn(b, n_, s, d, device=dev, dtype=dtype, requires_grad=True) for n_ in (h, kv, kv))
        t0 = time.perf_counter()
        try:
            out, _ = attention.varlen_attention(torch.nn.Module(), q, kk, v, None, scaling=d ** -0.5,
                                                sliding_window=win, cu_seq_lens_q=cu, max_length_q=bd["max_length_q"])
        except RuntimeError as e:
            emit("varlen", case=f"b{b} s{s} h{h}/{kv} d{d} win{win} {dtype}", error=str(e).splitlines()[0], ok=False)
            continue
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, kk, v), g)
        torch.cuda.synchronize()
        qr, kr, vr = (x.detach().float().requires_grad_() for x in (q, kk, v))
        o_ref = ref(qr, kr, vr, cu, win)
        g_ref = torch.autograd.grad(o_ref, (qr, kr, vr), g.float())
        err = [((a.float() - r).abs().max() / r.abs().max()).item() for a, r in zip((out, *grads), (o_ref, *g_ref))]
        emit("varlen", case=f"b{b} s{s} h{h}/{kv} d{d} win{win} {str(dtype)[6:]}", out_dtype=str(out.dtype)[6:],
             rel_max_err_out_dq_dk_dv=[round(e, 5) for e in err], seconds=round(time.perf_counter() - t0, 3),
             ok=max(err) < 3e-2 and out.dtype == dtype)


def stage_evalcompile() -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import make_chat_rows, make_model_dir
    from helpers import write_jsonl
    from torch._dynamo.utils import counters

    from finetune.tasks.evaluate import evaluate
    from finetune.model import apply_compile, load_tokenizer
    root = Path("/tmp/gpu-evalcompile")
    model_dir = root / "llama" if (root / "llama" / "config.json").exists() else make_model_dir(
        root / "llama", "llama3", "llama", tied=False)
    data = write_jsonl(root / "chat.jsonl", make_chat_rows(8))
    dev = need_cuda("evalcompile")
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.attention import resolve_attn_implementation
    from finetune.kernels.varlen import register
    attn = resolve_attn_implementation(AutoConfig.from_pretrained(model_dir), "auto", register)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation=attn).to(dev)
    apply_compile(model, True)
    counters.clear()
    t0 = time.perf_counter()
    result = evaluate(model, load_tokenizer(str(model_dir)), str(data), 4, 16, dev)
    emit("evalcompile", phase="evaluation", attention=attn, graphs=counters["stats"]["unique_graphs"],
         seconds=round(time.perf_counter() - t0, 1), scored=result["num_samples"],
         ok=counters["stats"]["unique_graphs"] == 0)
    model.train()
    for lengths in ([100, 200], [300, 50, 80], [64], [120, 120, 120]):
        batch = packed_batch(lengths, dev, model.config.vocab_size)
        model(**batch, use_cache=False).loss.backward()
    emit("evalcompile", phase="training (4 packed rows)", graphs=counters["stats"]["unique_graphs"],
         stats={k: v for k, v in counters["stats"].items()}, recompiles=dict(counters.get("recompiles", {})),
         ok=counters["stats"]["unique_graphs"] >= 1)


def stage_offload() -> None:
    from torch import nn

    from functools import partial

    from finetune.compat import storage_key
    from finetune.memory.offload import HostOffload, Offloaded
    from finetune.model import apply_ac, apply_compile, find_layers
    base = tiny_llama()
    dev = need_cuda("offload")
    base = base.to(dev, torch.bfloat16)
    batch = packed_batch([500, 300, 200], dev)

    def grads(model):
        model.zero_grad(set_to_none=True)
        model(**batch, use_cache=False).loss.backward()
        return [p.grad.float() for p in model.parameters()]

    import copy
    want = grads(copy.deepcopy(base))
    for compiled in (False, True):
        model = copy.deepcopy(base)
        apply_ac(model, 1.0, "block", partial(Offloaded, offload=HostOffload()))  # the ac_wrap slot
        apply_compile(model, compiled)
        host = find_layers(model)[0].offload
        params = {storage_key(p.untyped_storage()) for p in model.parameters()}
        packed, pack = [], host.pack

        def counting(t, pack=pack):
            out = pack(t)
            if out is not t:
                packed.append((isinstance(t, nn.Parameter) or storage_key(t.untyped_storage()) in params,
                               t.numel() * t.element_size()))
            return out

        host.pack = counting
        got = grads(model)
        err = max(((g - w).norm() / w.norm().clamp(min=1e-12)).item() for g, w in zip(got, want))
        emit("offload", compiled=compiled, offloaded=len(packed), parameters_offloaded=sum(p for p, _ in packed),
             offloaded_mb=round(sum(b for _, b in packed) / 2**20, 2), max_rel_grad_err=err,
             ok=bool(packed) and not any(p for p, _ in packed) and err < 2e-2)


def stage_flce() -> None:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as flce

    from finetune.kernels.liger import FUSED_ACCUM_DTYPE
    emit("flce", finetune_accum_dtype=str(FUSED_ACCUM_DTYPE))
    dev = need_cuda("flce")
    torch.manual_seed(0)
    for V, H, N in [(32000, 2048, 16384), (128256, 4096, 8192)]:
        x = (torch.randn(N, H, device=dev) * 0.5).bfloat16().requires_grad_()
        w = (torch.randn(V, H, device=dev) * 0.02).bfloat16().requires_grad_()
        t = torch.randint(V, (N,), device=dev)
        ref = torch.nn.functional.cross_entropy(x.float() @ w.float().t(), t, reduction="sum")
        gw_ref, = torch.autograd.grad(ref, w)
        for acc in (None, torch.float32):
            loss = flce(x, w, t, reduction="sum", accum_dtype=acc)
            gw, = torch.autograd.grad(loss, w)
            emit("flce", vocab=V, hidden=H, tokens=N, accum_dtype=str(acc),
                 loss_rel_err=((loss - ref) / ref).abs().item(),
                 grad_w_rel_err=((gw.float() - gw_ref).norm() / gw_ref.norm()).item())
            del loss, gw
        del x, w, ref, gw_ref
        torch.cuda.empty_cache()


def stage_opac() -> None:
    import copy

    from finetune.compat import TorchDispatchMode
    from finetune.memory.sac import checkpoint_kwargs
    from finetune.model import apply_ac
    base = tiny_llama(layers=4)
    dev = need_cuda("opac")
    base = base.to(dev, torch.bfloat16)
    batch = packed_batch([700, 300], dev)
    from torch.nn.attention import varlen  # noqa: F401 - registers torch_attn::_varlen_attn
    kernels = {torch.ops.torch_attn._varlen_attn.default, torch.ops.aten._flash_attention_forward.default,
               torch.ops.aten._cudnn_attention_forward.default}  # the op, or its kernel where a mode sees inside

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func in kernels
            return func(*args, **(kwargs or {}))

    for mode in ("block", "op"):
        model = copy.deepcopy(base)
        apply_ac(model, 1.0, mode, sac=checkpoint_kwargs)
        with Count() as fwd:
            loss = model(**batch, use_cache=False).loss
        with Count() as bwd:
            loss.backward()
        emit("opac", mode=mode, layers=4, attention_forward=fwd.n, attention_in_backward=bwd.n,
             ok=bwd.n == (0 if mode == "op" else 4))


def main() -> None:
    global OUT
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage", choices=STAGES)
    p.add_argument("--out", default=None, help="append <stage>.jsonl here")
    args = p.parse_args()
    if args.out:
        OUT = Path(args.out)
        OUT.mkdir(parents=True, exist_ok=True)
    globals()[f"stage_{args.stage}"]()


if __name__ == "__main__":
    main()
