"""The linear-attention layers' packed path where flash-linear-attention and causal-conv1d are installed (CUDA), shown
on CPU: pure-torch stand-ins for the two packages' entry points, which transformers resolves (its
use_kernel_func_from_hub_with_fallback, as at import) and calls with the arguments it would give the real ones."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from families import FAMILIES, family_kwargs
from test_families import chats  # noqa: F401 - the fixture

LENGTHS = [5, 7, 9, 3]  # two rows of 12: samples of 5 and 7; a sample of 9, then 3 of padding


def segments(cu: torch.Tensor) -> list[tuple[int, int]]:
    return list(zip(cu[:-1].tolist(), cu[1:].tolist()))


def install_kernels(monkeypatch, module, calls: list, conv_reads_seq_idx: bool | None = True) -> None:
    """Fake `fla` and `causal_conv1d` packages (the real entry points' signatures; each packed sample run by
    transformers' torch reference) in sys.modules, and `module`'s kernel functions resolved again against them.
    `conv_reads_seq_idx=False`: a convolution blind to the boundaries (it mixes packed samples); None: one that
    rejects them (a RuntimeError, as a kernel refusing an index dtype would)."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback as resolve
    chunk_ref, conv_ref = module.torch_chunk_gated_delta_rule.__wrapped__, module.causal_conv1d_fn.__wrapped__

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False):
        calls.append(("chunk", tuple(q.shape[:2]), cu_seqlens))
        assert cu_seqlens is None or q.shape[0] == 1, "fla takes packed samples as one row"
        spans = segments(cu_seqlens) if cu_seqlens is not None else [(0, q.shape[1])]
        outs = [chunk_ref(*(t[:, a:b] for t in (q, k, v, g, beta)), use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0]
                for a, b in spans]
        return torch.cat(outs, dim=1), None

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                         final_states_out=None, activation=None):
        calls.append(("conv", tuple(x.shape), seq_idx))
        if seq_idx is not None and conv_reads_seq_idx is None:
            raise RuntimeError("seq_idx must be int32 on the same device")
        if seq_idx is None or not conv_reads_seq_idx:
            return conv_ref(x, weight, bias, activation)
        starts = torch.nonzero(seq_idx[0].diff()).flatten().add(1).tolist()
        cuts = [0, *starts, x.shape[-1]]
        return torch.cat([conv_ref(x[..., a:b], weight, bias, activation) for a, b in zip(cuts, cuts[1:])], dim=-1)

    fla, conv = types.ModuleType("fla"), types.ModuleType("causal_conv1d")
    fla.chunk_gated_delta_rule, conv.causal_conv1d_fn = chunk_gated_delta_rule, causal_conv1d_fn
    monkeypatch.setitem(sys.modules, "fla", fla)
    monkeypatch.setitem(sys.modules, "causal_conv1d", conv)
    monkeypatch.setattr(module, "torch_chunk_gated_delta_rule", resolve("chunk_gated_delta_rule", "fla")(chunk_ref))
    monkeypatch.setattr(module, "causal_conv1d_fn", resolve("causal_conv1d_fn", "causal_conv1d")(conv_ref))


@pytest.mark.parametrize("conv_reads_seq_idx", [True, False, None],
                         ids=["kernels", "a-conv-blind-to-boundaries", "a-conv-that-rejects-them"])
def test_packed_linear_attention_hands_the_kernels_the_boundaries_and_equals_unpacked(conv_reads_seq_idx,
                                                                                      monkeypatch, capsys):
    """Qwen3.5's gated delta-net layers, two packed rows: the kernels get one row of 24 tokens with cu_seqlens
    [0, 5, 12, 21, 24] (fla) and each token's sample index (causal-conv1d), and the logits are each sample's alone;
    where the module's packed path would mix samples (the conv blind to seq_idx) or raises, it runs per sample
    instead."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from finetune.data.collate import sample_boundaries
    from finetune.kernels import linear_attention
    from finetune.model import find_layers
    calls: list = []
    install_kernels(monkeypatch, modeling_qwen3_5, calls, conv_reads_seq_idx)
    monkeypatch.setattr(linear_attention, "packed_kernels", lambda: True)
    config = FAMILIES["qwen3_5_text"][0](**{**family_kwargs("qwen3_5_text"), "layer_types": ["linear_attention"] * 2},
                                         vocab_size=64, pad_token_id=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    linear_attention.apply_sample_boundaries(model, find_layers(model))
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    boundaries = sample_boundaries(LENGTHS)
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS]).view(2, 12)
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=position_ids, use_cache=False, **boundaries).logits.flatten(0, 1)
        said, packed_calls = capsys.readouterr().out, calls[:]
        for i, (a, b) in enumerate(segments(boundaries["cu_seq_lens_q"])[:3]):
            alone = model(input_ids=ids.flatten()[None, a:b], use_cache=False).logits[0]
            torch.testing.assert_close(packed[a:b], alone, rtol=1e-5, atol=1e-6, msg=f"sample {i}")
    seq_idx = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])
    flat = [c for c in packed_calls if c[2] is not None]
    want = ["conv"] * 2 if conv_reads_seq_idx is None else ["conv", "chunk"] * 2 * (2 if conv_reads_seq_idx else 1)
    assert [c[0] for c in flat] == want, packed_calls
    for kind, shape, boundary in flat:  # the first two: the check of the route, on the first layer
        assert shape[0] == 1 and boundary.tolist() == ([seq_idx.tolist()] if kind == "conv" else
                                                       boundaries["cu_seq_lens_q"].tolist())
    how = {True: "get the packed boundaries (fla/causal-conv1d)",
           False: "run per packed sample (their packed path differs from it)",
           None: "run per packed sample (their packed path raised RuntimeError: seq_idx must be int32 on the same "
                 "device)"}[conv_reads_seq_idx]
    assert said == f"kernels: linear-attention layers {how}\n"


def packed_and_unpacked_with_kernels(source: str, data: str, out: str) -> tuple[list, list]:
    """On one rank, with the stand-in kernels: test_families.packed_and_unpacked (sft's model: FSDP, the default
    attention) and the kernels' calls that were given boundaries."""
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from finetune.kernels import linear_attention
    from helpers import sft_config
    from test_families import RUN, packed_and_unpacked
    calls: list = []
    with pytest.MonkeyPatch.context() as patch:
        install_kernels(patch, modeling_qwen3_5, calls)
        patch.setattr(linear_attention, "packed_kernels", lambda: True)
        results = packed_and_unpacked(sft_config(source, data, out, *RUN, "train.micro_batch_size=2"))
    return results, [(kind, shape) for kind, shape, boundary in calls if boundary is not None]


def test_sft_s_packed_rows_through_the_kernels_give_the_loss_and_grad_norm_unpacked(chats, tmp_path):  # noqa: F811
    """Qwen3.5 (a gated delta-net layer, then a full-attention one), two packed rows in a train_step, then their
    samples unpacked: the same loss and gradient norm, the packed one computed by the kernels on one row."""
    from families import make_family_dir
    from helpers import run_ranks
    source = make_family_dir(tmp_path / "source", FAMILIES["qwen3_5_text"][0], family_kwargs("qwen3_5_text"))
    (packed, unpacked), flat = run_ranks(packed_and_unpacked_with_kernels, 1, str(source), str(chats),
                                         str(tmp_path / "run"))[0]
    assert packed == pytest.approx(unpacked, rel=1e-5)
    assert flat and all(shape[0] == 1 for _, shape in flat) and {kind for kind, _ in flat} == {"conv", "chunk"}
