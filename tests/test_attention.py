"""Per-sample attention in packed rows: every accepted attention implementation gives the loss and gradients of the
same samples unpacked, at any micro-batch size. Kernels that run only on CUDA (flash-attn, torch's varlen) are
replaced by CPU references that attend per sample when the sample boundaries reach them and across the whole row
when they do not, as those kernels do: so the boundaries are checked where they reach the attention call.
(varlen runs its CPU kernel; what torch's CUDA kernel is handed is checked below. flex_attention, CUDA only for
training, keeps samples apart with the mask transformers builds from the position_ids
restarts, as for sdpa and eager; tests/test_gpu.py checks it.)"""
from __future__ import annotations

import pytest
import torch

from helpers import run_ranks


def reference_flash(module, query, key, value, attention_mask, scaling=None, dropout=0.0, position_ids=None,
                    cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """transformers' flash_attention_2 on CPU: per sample with cu_seq_lens; without them, at batch size 1 boundaries
    inferred from position_ids (transformers' _is_packed_sequence), else causal over the whole row (right padding
    needs no mask). Returns (batch, seq, heads, head_dim) as flash does."""
    batch, heads, seq, dim = query.shape
    if cu_seq_lens_q is None and batch == 1 and position_ids is not None:
        starts = torch.nonzero(position_ids.flatten() == 0).flatten().tolist()
        cu_seq_lens_q = torch.tensor(starts + [seq])
    if cu_seq_lens_q is None:
        cu_seq_lens_q = torch.arange(batch + 1) * seq
    q, k, v = (x.transpose(1, 2).reshape(batch * seq, x.shape[1], dim).transpose(0, 1) for x in (query, key, value))
    out = torch.empty_like(q)
    bounds = cu_seq_lens_q.tolist()
    for a, b in zip(bounds, bounds[1:]):
        out[:, a:b] = torch.nn.functional.scaled_dot_product_attention(
            q[:, a:b], k[:, a:b], v[:, a:b], is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(0, 1).reshape(batch, seq, heads, dim), None


ATTENTION = ["sdpa", "eager", "varlen", "flash_attention_2", "flash_attention_3"]


def packed_and_unpacked(model_dir: str, data: str, attentions: list[str] = ATTENTION, references: bool = True,
                        mixed_precision: str = "fp32") -> dict:
    """On one rank, for each attention implementation and micro-batch size (1 and 4 packed rows): train_step's
    loss and grad norm on the packed rows, then on the same samples unpacked (one per row, right-padded). The model
    is built once with sdpa, lr 0 (its weights never change), then switched to each implementation (with
    `references`, flash-attn's kernels replaced by their CPU reference first; varlen runs its CPU kernel)."""
    from transformers import AttentionInterface

    from finetune.kernels import varlen as attention
    from finetune.data import build_samples
    from finetune.distributed import init_distributed
    from finetune.model import build_model, load_tokenizer
    from finetune.train import next_micro_batches, train_step
    if references:
        for name in attentions:
            if name.startswith("flash"):
                AttentionInterface.register(name, reference_flash)
    attention.register()
    device, dims = init_distributed()
    tok = load_tokenizer(model_dir)
    packed = list(build_samples(data, tok, max_seq_len=256, packing=True, shuffle=False, epoch_limit=1))
    model, _ = build_model(model_dir, device, dims.mesh, mixed_precision=mixed_precision, attn_implementation="sdpa")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights never change
    results = {}
    for micro_batch_size in (1, 4):
        rows = packed[:micro_batch_size]
        assert any(r["position_ids"].count(0) > 1 for r in rows)
        singles = []
        for r in rows:
            starts = [i for i, p in enumerate(r["position_ids"]) if p == 0] + [len(r["input_ids"])]
            singles += [{k: r[k][a:b] for k in ("input_ids", "labels")} for a, b in zip(starts, starts[1:])]
        for attn in attentions:
            model.config._attn_implementation = attn
            for units in (rows, singles):
                batches, num_input_tokens = next_micro_batches(iter(units), len(units), 1, tok.pad_token_id, None)
                result, _ = train_step(model, optimizer, batches, num_input_tokens=num_input_tokens,
                                       max_grad_norm=0.0)
                results.setdefault((attn, micro_batch_size), []).append((result["loss"].item(),
                                                                         result["grad_norm"].item()))
    return results


def test_packed_rows_train_as_the_samples_unpacked(llama_dir, chat_file):
    """flash_attention_2/3 at micro_batch_size 4 attended across the samples of a row before the collate handed
    the boundaries to the attention call (transformers infers them for one row only)."""
    results = run_ranks(packed_and_unpacked, 1, str(llama_dir), str(chat_file))[0]
    wrong = {key: pair for key, pair in results.items()
             if pair[0] != pytest.approx(pair[1], rel=1e-5)}  # (loss, grad norm) packed vs unpacked
    assert len(results) == 2 * len(ATTENTION) and not wrong, wrong


def test_varlen_hands_torch_kernel_the_boundaries_and_equals_its_cpu_kernel():
    """What reaches torch's varlen_attn (CUDA): the flattened tokens, the same int32 offsets for queries and keys,
    the longest segment, a causal window (sliding where the layer has one) and GQA; the CPU kernel gives the same
    result as sdpa run on each sample alone."""
    from finetune.kernels import varlen as attention
    from finetune.data.collate import sample_boundaries
    torch.manual_seed(0)
    module = torch.nn.Module()
    q, k, v = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    bounds = sample_boundaries([3, 7, 6, 4])  # row 0: samples of 3 and 7; row 1: 6, then 4 of padding
    calls = []

    def kernel(*args, **kwargs):
        calls.append((args, kwargs))
        return attention.segment_attention(*args, **kwargs)

    attention.register()
    attention._VARLEN.update(kernel=kernel, window=True, gqa=True)
    try:
        out, _ = attention.varlen_attention(module, q, k, v, None, scaling=0.3, **bounds)
        windowed, _ = attention.varlen_attention(module, q, k, v, None, scaling=0.3, sliding_window=2, **bounds)
    finally:
        attention.register()
    (tq, tk, tv, cu_q, cu_k, max_q, max_k), kwargs = calls[0]
    assert tq.shape == (20, 4, 8) and tk.shape == (20, 2, 8) and cu_q is cu_k and cu_q.dtype == torch.int32
    assert cu_q.tolist() == [0, 3, 10, 16, 20] and max_q == max_k == 7
    assert kwargs == {"scale": 0.3, "window_size": (-1, 0), "enable_gqa": True}
    assert calls[1][1]["window_size"] == (1, 0)
    flat = [x.transpose(1, 2).reshape(20, x.shape[1], 8) for x in (q, k, v)]
    for (a, b), got in ((s, out.reshape(20, 4, 8)[s[0]:s[1]]) for s in ((0, 3), (3, 10), (10, 16), (16, 20))):
        want = torch.nn.functional.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in flat), scale=0.3,
                                                                is_causal=True, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(got, want)
    i = torch.arange(7)  # the second sample under a window of 2: each position sees itself and the one before
    band = (i[:, None] >= i) & (i[:, None] - i <= 1)
    want = torch.nn.functional.scaled_dot_product_attention(*(x[3:10].transpose(0, 1) for x in flat), scale=0.3,
                                                            attn_mask=band, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(windowed.reshape(20, 4, 8)[3:10], want)


def test_varlen_casts_fp32_for_the_cuda_kernel_and_hands_torch_2_11_gqa_unrepeated():
    """torch's CUDA varlen kernel takes fp16/bf16 only: fp32 q/k/v (train.mixed_precision=fp32) reach it as bf16 and
    the output comes back fp32. torch 2.10/2.11's kernel has no enable_gqa (Flash only, which takes fewer K/V heads
    directly): K/V reach it with their own head count, not repeated to every query head."""
    from finetune.kernels import varlen as attention
    from finetune.data.collate import sample_boundaries
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    bounds = sample_boundaries([3, 7, 6, 4])
    seen = []

    def cuda_kernel(q, k, v, *args, is_causal, **kwargs):  # torch 2.10's signature: no window, no enable_gqa
        seen.append((q.dtype, k.dtype, v.dtype, k.shape[1]))
        out = attention.segment_attention(q.float(), k.float(), v.float(), *args, window_size=(-1, 0),
                                          enable_gqa=True, **kwargs)
        return out.to(q.dtype)

    attention.register()
    reference, _ = attention.varlen_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, **bounds)
    attention._VARLEN.update(kernel=cuda_kernel, window=False, gqa=False, half_only=True)
    try:
        out, _ = attention.varlen_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, **bounds)
    finally:
        attention.register()
    assert seen == [(torch.bfloat16, torch.bfloat16, torch.bfloat16, 2)]
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference, atol=3e-2, rtol=3e-2)  # bf16 inputs


def test_cpu_segments_run_the_flash_kernel_and_save_no_probabilities():
    """Each segment goes to sdpa in 4-D: torch 2.11's CPU sdpa runs 3-D inputs in its math path, which saves every
    sample's heads x seq x seq probabilities for backward (11x the bytes here, and slower); its flash kernel saves the
    output and the log-sum-exp, O(seq)."""
    from finetune.kernels.varlen import segment_attention
    q, k, v = (torch.randn(512, heads, 16, requires_grad=True) for heads in (4, 2, 2))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = segment_attention(q, k, v, torch.tensor([0, 256, 512]), None, 256, 256, enable_gqa=True,
                                window_size=(-1, 0))
    probabilities = 2 * 4 * 256 * 256 * 4  # two samples' fp32 heads x seq x seq
    assert out.shape == (512, 4, 16) and 0 < sum(saved) < probabilities / 4
