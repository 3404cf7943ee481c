"""Attention that fits the model, per family: on the tiny models (families.py) of the families whose attention
differs from Llama's (attention sinks, MLA's value head dim, Llama 4's chunked layers, masks built without the
position_ids), auto picks the attention it should, and eager keeps packed samples apart too: packed loss and gradient
== the same samples unpacked, as test_families.py checks for the default attention of every family."""
from __future__ import annotations

import pytest
import torch

from helpers import run_ranks

PICKS = {  # a family of families.py whose attention differs from Llama's: what auto picks for it
    "gpt_oss": "varlen",  # attention sinks, sliding layers
    "falcon": "sdpa",  # builds its masks without position_ids
    "opt": "varlen",  # as falcon
    "deepseek_v3": "varlen",  # MLA: value head dim 6, query/key 12
    "glm4_moe_lite": "varlen",
    "llama4_text": "varlen",  # chunked layers
}


def packed_and_unpacked(model_dir: str, data: str) -> tuple[dict, str]:
    """On one rank: the model as sft builds it (default attention, packing on, fp32), then for what auto picked and
    for eager: train_step's (loss, grad norm) on 2 packed rows and on their samples unpacked (lr 0); and what the
    build printed."""
    import contextlib
    import io
    from finetune.args import build_config
    from finetune.data import build_samples
    from finetune.distributed import init_distributed
    from finetune.build import transforms
    from finetune.model import build_model, load_tokenizer
    from finetune.train import next_micro_batches, train_step
    device, dims = init_distributed()
    cfg = build_config(None, ["train.mixed_precision=fp32"], **{"model.path": model_dir, "data.path": data})
    tok = load_tokenizer(model_dir)
    rows = list(build_samples(data, tok, max_seq_len=256, packing=True, shuffle=False, epoch_limit=1))[:2]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        model, _ = build_model(model_dir, device, dims.mesh, transforms(cfg, dims, device), mixed_precision="fp32",
                               attn_implementation=cfg.model.attn_implementation, packing=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    singles = []
    for r in rows:
        starts = [i for i, p in enumerate(r["position_ids"]) if p == 0] + [len(r["input_ids"])]
        singles += [{k: r[k][a:b] for k in ("input_ids", "labels")} for a, b in zip(starts, starts[1:])]
    assert len(singles) > len(rows) and max(b - a for a, b in zip(starts, starts[1:])) > 16  # past a chunk of 8
    results = {}
    for attn in dict.fromkeys([model.config._attn_implementation, "eager"]):
        model.config._attn_implementation = attn
        for units in (rows, singles):
            batches, num_input_tokens = next_micro_batches(iter(units), len(units), 1, tok.pad_token_id, None)
            result, _ = train_step(model, optimizer, batches, num_input_tokens=num_input_tokens, max_grad_norm=0.0)
            results.setdefault(attn, []).append((result["loss"].item(), result["grad_norm"].item()))
    return results, printed.getvalue()


def every_family(root: str, data: str) -> dict:
    """packed_and_unpacked on a model of each family, in one rank (one process start for them all); a family that
    raises gets its error's text."""
    from pathlib import Path
    from families import FAMILIES, family_kwargs, make_family_dir
    results = {}
    for family in PICKS:
        try:
            source = make_family_dir(Path(root) / family, FAMILIES[family][0], family_kwargs(family))
            results[family] = packed_and_unpacked(str(source), data)
        except Exception as e:  # noqa: BLE001 - reported by that family's test
            results[family] = f"{type(e).__name__}: {e}"
    return results


@pytest.fixture(scope="module")
def family_root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


@pytest.fixture(scope="module")
def family_results(family_root, chat_file):
    return run_ranks(every_family, 1, str(family_root), str(chat_file))[0]


@pytest.mark.parametrize("family", list(PICKS))
def test_packed_rows_train_as_the_samples_unpacked(family, family_results):
    """Before: gpt-oss's default attention refused its sinks at the first step, eager let packed samples see each
    other on gpt-oss, Falcon and OPT (their masks are built without the position_ids), MLA crashed on its value head
    dim and Llama 4 in the loss (its get_decoder() is the whole model)."""
    assert not isinstance(family_results[family], str), family_results[family]
    results, printed = family_results[family]
    picked = PICKS[family]
    assert list(results) == list(dict.fromkeys([picked, "eager"])), results
    wrong = {attn: pair for attn, pair in results.items() if pair[0] != pytest.approx(pair[1], rel=1e-5)}
    assert not wrong, wrong  # attn: [(loss, grad norm) packed, unpacked]
    if picked != "eager":  # the default attention and eager run the same model
        assert results[picked][1][0] == pytest.approx(results["eager"][1][0], rel=1e-5)
    assert f"kernels: attention {picked}" in printed, printed


def eager_reference(module, q, k, v, sinks, scaling, window, lengths):
    """transformers' GPT-OSS eager attention (sinks) on each segment of `lengths` of the rows alone, causal with a
    sliding `window`: (batch, seq, heads, dim)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    from finetune.kernels.varlen import window_mask
    module.sinks, outs, start = sinks, [], 0
    for n in lengths:
        band = window_mask(n, n, window, q.device)
        mask = torch.zeros(band.shape).masked_fill(~band, torch.finfo(torch.float32).min)
        seg = (x[:, :, start:start + n] for x in (q, k, v))
        outs.append(eager_attention_forward(module, *seg, mask, scaling=scaling)[0])
        start += n
    return torch.cat(outs, dim=1)


def test_varlen_sinks_are_gpt_oss_eager_with_and_without_boundaries():
    """Attention sinks: per sample (packed rows) and over whole rows (evaluation, generate: no boundaries), values
    and the sinks' gradient as transformers' eager GPT-OSS attention. Before, varlen refused sinks with boundaries
    and, without them, silently ran sdpa without the sinks."""
    from finetune.data.collate import sample_boundaries
    from finetune.kernels import varlen
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    q, k, v = torch.randn(2, 4, 10, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    sinks = torch.randn(4, requires_grad=True)
    varlen.register()
    for bounds, lengths in ((sample_boundaries([3, 7, 10]), ([3, 7], [10])), ({}, ([10], [10]))):
        out, _ = varlen.varlen_attention(module, q, k, v, None, scaling=0.3, sliding_window=4, s_aux=sinks, **bounds)
        got = torch.autograd.grad(out.square().sum(), sinks)[0]
        want = torch.cat([eager_reference(module, q[i:i + 1], k[i:i + 1], v[i:i + 1], sinks, 0.3, 4, lengths[i])
                          for i in (0, 1)])
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(got, torch.autograd.grad(want.square().sum(), sinks)[0])


def test_varlen_hands_the_cuda_kernel_padded_mla_values_and_chunks():
    """What torch's CUDA varlen kernel is handed: MLA's value head dim (6) zero-padded to the query/key one (8), the
    output cut back; a chunked layer's samples (3 and 7 tokens, chunks of 4) cut into their chunks; without
    boundaries, the row's chunks. Before, the value dim crashed the reshape and chunked layers attended across
    chunks."""
    from finetune.data.collate import sample_boundaries
    from finetune.kernels import varlen
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.config = type("Config", (), {"layer_types": ["chunked_attention"], "attention_chunk_size": 4})
    module.layer_idx, module.num_key_value_groups = 0, 2
    q, k, v = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 6)
    seen = []

    def cuda_kernel(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1], cu_q.tolist(), max_q, v[..., 6:].abs().sum().item()))
        return varlen.segment_attention(q.float(), k.float(), v.float(), cu_q, cu_k, max_q, max_k,
                                        **kwargs).to(q.dtype)

    varlen.register()
    varlen._VARLEN.update(kernel=cuda_kernel, window=True, gqa=True, half_only=True)
    try:
        out, _ = varlen.varlen_attention(module, q, k, v, None, scaling=0.3, **sample_boundaries([3, 7]))
    finally:
        varlen.register()
    assert seen == [(8, 8, 8, [0, 3, 7, 10], 4, 0.0)] and out.shape == (1, 10, 4, 6)
    flat = [x.transpose(1, 2).reshape(10, x.shape[1], x.shape[-1]) for x in (q, k, v)]
    whole, _ = varlen.varlen_attention(module, q, k, v, None, scaling=0.3)  # no boundaries: the row's chunks
    for (a, b), got, tolerance in [*(((a, b), out, 3e-2) for a, b in ((0, 3), (3, 7), (7, 10))),  # bf16 inputs
                                   *(((a, b), whole, 1e-5) for a, b in ((0, 4), (4, 8), (8, 10)))]:
        want = torch.nn.functional.scaled_dot_product_attention(*(x[a:b].transpose(0, 1) for x in flat), scale=0.3,
                                                                is_causal=True, enable_gqa=True).transpose(0, 1)
        torch.testing.assert_close(got[0, a:b], want, atol=tolerance, rtol=tolerance)


def test_auto_passes_over_what_varlen_lacks_and_varlen_asked_for_it_is_refused_at_start_up():
    """Soft-capping and attention dropout (which varlen cannot run) decide auto and refuse varlen from the config,
    before anything loads; before, auto picked varlen for dropout, and varlen asked for either stopped at the first
    step. Sinks, MLA and chunked layers are varlen's: auto picks it for them."""
    import transformers as T

    from finetune.attention import resolve_attn_implementation as resolve
    from finetune.config import ConfigError
    from finetune.kernels.varlen import register
    assert resolve(T.LlamaConfig(attention_dropout=0.1), "auto", register) == "sdpa"
    for config in (T.GptOssConfig(), T.DeepseekV3Config(), T.Llama4TextConfig()):
        assert resolve(config, "auto", register) == "varlen"
    for config, why in ((T.Gemma2Config(), "attention logit soft-capping"),
                        (T.LlamaConfig(attention_dropout=0.1), r"attention dropout \(0.1\)")):
        with pytest.raises(ConfigError, match=f"^model.attn_implementation=varlen: the model uses {why}, which "
                                              "varlen lacks; set model.attn_implementation=auto \\(or sdpa\\)$"):
            resolve(config, "varlen", register)


def cp_sink_error() -> float:
    """On each of 2 cp ranks (its half of a row of samples of 5 and 7 tokens): the largest difference between
    context parallel's attention with sinks and varlen's over the whole row."""
    import torch.distributed as dist

    from finetune.data.collate import sample_boundaries
    from finetune.parallel import context
    from finetune.kernels import varlen
    varlen.register()
    context._CP["group"] = dist.group.WORLD
    torch.manual_seed(0)
    q, k, v, sinks = torch.randn(1, 4, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(1, 2, 12, 8), torch.randn(4)
    bounds, mine = sample_boundaries([5, 7]), slice(6 * dist.get_rank(), 6 * dist.get_rank() + 6)
    out, _ = context.cp_attention(torch.nn.Module(), *(x[:, :, mine] for x in (q, k, v)), None, scaling=0.3,
                                  s_aux=sinks, **bounds)
    whole, _ = varlen.varlen_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, s_aux=sinks, **bounds)
    return (out - whole[:, mine]).abs().max().item()


def test_context_parallel_hands_each_rank_its_heads_sinks():
    """parallel.cp splits the heads over the ranks: each gets its heads' sinks (it got all, and crashed)."""
    assert max(run_ranks(cp_sink_error, 2)) < 1e-6
