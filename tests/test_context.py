"""Context parallelism (parallel.cp) on in-process gloo ranks against one process: cp 2 on 2 ranks, FSDP 2 x cp 2
on 4, a tied grouped-query Qwen2 with LoRA at cp 4 (fewer KV heads than ranks: repeated), HSDP 2 x cp 2 with LoRA
and AC on Llama, bench's point at cp 2 (half the activations per rank); resume cp 2 -> 1 -> 4; the split of a packed
micro-batch (no target lost at a shard edge, a width N does not divide); layouts refused in one line. Activation
offload (ac.offload) trains as without it, keeps less for backward and fetches each block's inputs ahead."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

from finetune.config import ConfigError
from helpers import BASE, invoke, read_metrics, run_ranks, sft, sft_config, train_rank

RUN = ("train.max_steps=5", "data.max_seq_len=160")  # packed rows of several samples, widths N may not divide


def close(a: list[dict], b: list[dict]) -> None:
    assert [r["num_tokens"] for r in a] == [r["num_tokens"] for r in b]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-5), key


def test_cp_2_and_fsdp_2_x_cp_2_equal_one_process_and_resume_cp_2_1_4(llama_dir, chat_file, tmp_path):
    """Five fp32 steps of packed rows: 1 process (2 rows a step), cp 2 on 2 ranks (one data rank: both rows, half
    of each), FSDP 2 x cp 2 on 4 ranks (2 data ranks of a row each). Then the cp 2 run's step-2 checkpoint goes on
    at cp 1 (one process, step 3) and cp 4 (4 ranks, steps 4-5): the same steps."""
    one = sft(llama_dir, chat_file, tmp_path / "one", *RUN, "train.micro_batch_size=2")
    cp2 = sft(llama_dir, chat_file, tmp_path / "cp2", *RUN, "train.micro_batch_size=2", "parallel.cp=2",
              "checkpoint.interval=2", "checkpoint.keep=0", nproc=2)
    fsdp_cp = sft(llama_dir, chat_file, tmp_path / "2x2", *RUN, "train.micro_batch_size=1", "parallel.cp=2", nproc=4)
    assert one[-1]["loss"] < one[0]["loss"]
    close(cp2, one)  # and its rows are one process's, padded by at most one token for the split:
    assert [r["padding_fraction"] for r in cp2] == pytest.approx([r["padding_fraction"] for r in one], abs=0.01)
    close(fsdp_cp, one)
    moved, start = tmp_path / "moved", tmp_path / "cp2" / "checkpoints" / "step-2"
    for steps, cp in ((3, 1), (5, 4)):  # each saves at its end
        sft(llama_dir, chat_file, moved, *RUN, f"train.max_steps={steps}", "train.micro_batch_size=2",
            f"parallel.cp={cp}", "checkpoint.keep=0", f"checkpoint.resume_from={start}", nproc=cp)
        start = moved / "checkpoints" / f"step-{steps}"
    recs = read_metrics(moved)
    assert [r["step"] for r in recs] == [3, 4, 5]
    close(recs, one[2:])


def test_cp_4_equals_one_process_for_a_tied_gqa_qwen2_with_lora(qwen_tied_dir, chat_file, tmp_path):
    """2 KV heads on 4 cp ranks: each is repeated to 4 before the exchange; tied embeddings in the root unit."""
    run = (*RUN, "train.max_steps=3", "train.micro_batch_size=2", "lora.rank=8")
    close(sft(qwen_tied_dir, chat_file, tmp_path / "cp", *run, "parallel.cp=4", nproc=4),
          sft(qwen_tied_dir, chat_file, tmp_path / "one", *run))


def test_hsdp_2_x_cp_2_equals_one_process_for_llama_with_lora(llama_dir, chat_file, tmp_path):
    """4 ranks: 2 replicas (HSDP) of 2 cp ranks each; one data rank per replica, a row each; half the blocks
    checkpointed (their recompute exchanges again)."""
    run = (*RUN, "train.max_steps=3", "lora.rank=8")
    close(sft(llama_dir, chat_file, tmp_path / "hsdp", *run, "train.micro_batch_size=1", "parallel.dp_replicate=2",
              "parallel.cp=2", "ac.ratio=0.5", nproc=4),
          sft(llama_dir, chat_file, tmp_path / "one", *run, "train.micro_batch_size=2"))


def bench_point(cfg) -> dict:
    from finetune.tools.bench import run_point
    return run_point(cfg, 2, 1)


def test_bench_on_cp_ranks_measures_the_same_steps_with_half_the_activations_per_rank(llama_dir, chat_file, tmp_path):
    """bench's point on 2 cp ranks (what `finetune bench --nproc-per-node 2 parallel.cp=2` runs on each): the
    losses of one process, and each rank keeps about half of what one process keeps for backward (its half of
    every row), at a fixed row length."""
    run = ("data.max_seq_len=512", "data.pad_to_max=true", "train.micro_batch_size=1", "train.grad_accum_steps=1")
    one, = run_ranks(bench_point, 1, sft_config(llama_dir, chat_file, tmp_path / "one", *run))
    two = run_ranks(bench_point, 2, sft_config(llama_dir, chat_file, tmp_path / "cp", *run, "parallel.cp=2"))
    assert two[0]["losses"] == pytest.approx(one["losses"], rel=1e-5) and two[0]["cp"] == 2
    for rank in two:
        assert 0.45 < rank["saved_mb"] / one["saved_mb"] < 0.55, (rank["saved_mb"], one["saved_mb"])
    # per device: its half of each row's real tokens (the padding to 512 not counted)
    assert two[0]["real_tokens_per_step"] == pytest.approx(one["real_tokens_per_step"] / 2)
    assert two[0]["real_tokens_per_step"] < 512 / 2
    assert two[0]["tokens_per_s"] == pytest.approx(two[0]["real_tokens_per_step"] / two[0]["step_time_s"])


def test_split_keeps_every_target_and_pads_a_width_n_does_not_divide():
    """A packed micro-batch of 2 rows (widths 13 and 11: padded to 15 for 3 ranks) whose samples cross the shard
    edges: the slices put back together are the rows; the targets, each on the rank of the token that predicts it
    (the last token of a shard predicts the first of the next), are the full rows' targets exactly once."""
    from finetune.parallel.context import cp_width, split_batch
    from finetune.data import IGNORE_INDEX, pad_collate
    from finetune.loss import label_targets
    samples = [{"input_ids": list(range(100, 113)), "labels": list(range(200, 213)),
                "position_ids": [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7]},
               {"input_ids": list(range(300, 311)), "labels": [IGNORE_INDEX] * 3 + list(range(403, 411)),
                "position_ids": list(range(11))}]
    width = cp_width(13, 3)
    batch = pad_collate(samples, pad_id=0, pad_to=width)
    batch.update(label_targets(batch.pop("labels"), batch["position_ids"]))
    assert width == 15 and batch["cu_seq_lens_q"].tolist() == [0, 5, 13, 15, 26, 30]
    parts = [split_batch(batch, r, 3) for r in range(3)]
    for key in ("input_ids", "position_ids"):
        assert torch.equal(torch.cat([p[key] for p in parts], dim=1), batch[key])
    assert all(p["cu_seq_lens_q"] is batch["cu_seq_lens_q"] for p in parts)  # the full rows' boundaries
    found = {}
    for r, p in enumerate(parts):
        for i, t in zip(p["label_index"].tolist(), p["label_targets"].tolist()):
            if t != IGNORE_INDEX:
                found[(i // 5, r * 5 + i % 5)] = t
    want = {(i // width, i % width): t for i, t in zip(batch["label_index"].tolist(), batch["label_targets"].tolist())}
    assert found == want and (0, 4) not in want and want[(0, 9)] == 210 and want[(1, 4)] == 405
    # token 9 of row 0 (the last of rank 1's shard) predicts token 10 (rank 2's first): kept on rank 1
    assert 210 in parts[1]["label_targets"].tolist()
    assert parts[2]["label_targets"].tolist() == [211, 212]  # row 1's last token (10) has no next token


class _Group:  # what apply_cp reads of a process group, for checks that refuse before any collective
    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


def test_models_and_layouts_cp_cannot_split_are_refused_in_one_line(llama_dir, chat_file, tmp_path):
    import transformers as T

    from finetune.parallel.context import apply_cp
    from finetune.kernels.varlen import register
    from finetune.model import build_skeleton, find_layers
    llama = T.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    for config, attn, n, message in [
        (llama, "varlen", 3, "parallel.cp=3 must divide the attention heads of LlamaForCausalLM (4)"),
        (llama, "sdpa", 2, "parallel.cp=2 wraps per-sample attention (model.attn_implementation=auto or varlen, in "
                           "a model class that passes attention kwargs); LlamaForCausalLM has sdpa"),
        (T.Qwen3_5TextConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=16), "sdpa", 2,
         "parallel.cp=2: Qwen3_5ForCausalLM cannot be split over ranks: its linear_attention layers mix tokens "
         "outside attention")]:
        model = build_skeleton(config, attn, varlen=register)
        with pytest.raises(ConfigError) as e:
            apply_cp(model, find_layers(model), _Group(n))
        assert str(e.value) == message
    result = invoke("sft", "--model", llama_dir, "--dataset", chat_file, "--output-dir", tmp_path / "run",
                    "--nproc-per-node", 2, *BASE, "parallel.cp=4")
    assert result.exit_code == 2 and not (tmp_path / "run").exists()
    assert result.stderr.strip() == ("error: parallel.cp=4 does not divide the 2 ranks of a replica (2 launched, "
                                     "parallel.dp_replicate=1)")
    with pytest.raises(ConfigError, match="parallel.cp=3 must divide the attention heads"):  # checked on the ranks
        run_ranks(train_rank, 3, sft_config(llama_dir, chat_file, tmp_path / "run", "parallel.cp=3"))


def offload_saved(model_dir: str, offload: bool) -> tuple[float, list[float], list[tuple[int, bool]]]:
    """(bytes one forward keeps on the device, the gradients' norms, for each tensor the backward took back from
    host memory: (its block, whether it was already fetched)) of a model with every block checkpointed, its inputs
    offloaded or not: apply_ac (on the CPU, where build_model would skip the offload, copies without streams)."""
    from finetune.tools.bench import saved_for_backward_mb
    from finetune.distributed import init_distributed
    from finetune.loss import label_targets
    from finetune.model import apply_ac, build_model, find_layers
    device, dims = init_distributed()
    model, _ = build_model(model_dir, device, dims.mesh, mixed_precision="fp32", ac_ratio=0.0)
    from functools import partial

    from finetune.memory.offload import HostOffload, Offloaded
    wraps = [partial(Offloaded, offload=HostOffload())] if offload else []  # the "ac" transform, as build makes it
    apply_ac(model, 1.0, wraps)  # wraps the FSDP-sharded blocks: what parallelize does before FSDP
    taken, entries, blocks = [], [], []
    if offload:
        host = find_layers(model)[0].offload
        pack, unpack = host.pack, host.unpack

        def logged_pack(t):
            if host.block not in blocks:
                blocks.append(host.block)
            entries.append(weakref.ref(saved := pack(t)))
            return saved

        def logged_unpack(saved):
            taken.append((blocks.index(saved.block), saved.fetched is not None))
            return unpack(saved)
        host.pack, host.unpack = logged_pack, logged_unpack
    ids = torch.randint(model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    gc.disable()  # the host copies are freed with the graph, not by a later collection
    try:
        saved = saved_for_backward_mb(model, {"input_ids": ids, **label_targets(ids, None)})
        assert all(ref() is None for ref in entries)
    finally:
        gc.enable()
    return saved, [p.grad.norm().item() for p in model.parameters()], taken


def test_ac_offload_trains_as_without_and_keeps_the_block_inputs_off_the_device(llama_dir):
    (plain, grads, _), = run_ranks(offload_saved, 1, str(llama_dir), False)
    (offloaded, grads_off, taken), = run_ranks(offload_saved, 1, str(llama_dir), True)
    assert grads_off == pytest.approx(grads, rel=1e-6)
    # the 4 blocks' inputs (2 rows x 64 tokens x hidden 64, fp32) and those they share once: RoPE's cos and sin
    # (1 x 64 x head_dim 16, fp32) and the position_ids (64, int64)
    assert (plain - offloaded) * 2**20 == 4 * 2 * 64 * 64 * 4 + 2 * 64 * 16 * 4 + 64 * 8
    # the backward takes the blocks back last to first; each block's inputs were on their way back (fetched when
    # the backward took the block after it), except the last block's, which the backward needs first
    per_block = len(taken) // 4
    assert per_block and [b for b, _ in taken] == [b for b in (3, 2, 1, 0) for _ in range(per_block)]
    assert [f for _, f in taken] == [False] * per_block + [True] * 3 * per_block
