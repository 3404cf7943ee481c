"""Every model family of the table in families.py, a tiny model built offline from its config class, trains on the
defaults and exports exactly: an sft run (fp32, packed, lr 0, one step) on 2 gloo ranks gives the loss and gradient
norm of 1 process; its export holds every source tensor byte- and dtype-equal (fp32 router biases and the tensors the
class does not own, MTP layers, included), with the check on; packed rows give the loss and gradient norm of their
samples unpacked. Add a family to the table, and it is covered."""
from __future__ import annotations

import pytest
import torch

from families import FAMILIES, UNVERIFIED, family_kwargs, make_family_dir, stored
from helpers import read_metrics, run_ranks, sft_config, train_rank, write_jsonl

RUN = ("train.lr=0", "train.max_steps=1", "data.max_seq_len=64")
# every other family here, the rest in test_families_b.py: the two xdist workers share the table
HALVES = list(FAMILIES)[::2], list(FAMILIES)[1::2]


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    """16 conversations of 15 to 40 tokens: rows of 64 pack 2 or 3, some longer than Llama 4's chunks of 8."""
    words = "alpha beta gamma delta echo fox golf hotel".split()
    return write_jsonl(tmp_path_factory.mktemp("chats") / "chats.jsonl", [
        {"messages": [{"role": "user", "content": " ".join(words[: 1 + i % 3])},
                      {"role": "assistant", "content": " ".join(words[i % 5: 1 + i % 5 + i % 4])}]} for i in range(16)])


def packed_and_unpacked(cfg) -> list[tuple[float, float]]:
    """On one rank, sft's model of `cfg` (its transforms, default attention, fp32) at lr 0: train_step's (loss, grad
    norm) on the first 2 packed rows of the data, then on their samples unpacked (one per row, right-padded), as
    data.packing=false batches them."""
    from finetune.data import build_samples
    from finetune.distributed import init_distributed
    from finetune.build import transforms
    from finetune.model import build_model, load_tokenizer
    from finetune.train import next_micro_batches, train_step
    device, dims = init_distributed()
    tok = load_tokenizer(cfg.model.path)
    rows = list(build_samples(cfg.data.path, tok, max_seq_len=cfg.data.max_seq_len, packing=True, shuffle=False,
                              epoch_limit=1))[:2]
    singles = []
    for r in rows:
        starts = [i for i, p in enumerate(r["position_ids"]) if p == 0] + [len(r["input_ids"])]
        singles += [{k: r[k][a:b] for k in ("input_ids", "labels")} for a, b in zip(starts, starts[1:])]
    assert len(singles) > len(rows), "no row packs 2 samples"
    model, _ = build_model(cfg.model.path, device, dims.mesh, transforms(cfg, dims, device), mixed_precision="fp32",
                           attn_implementation=cfg.model.attn_implementation, packing=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    results = []
    for units in (rows, singles):
        batches, num_input_tokens = next_micro_batches(iter(units), len(units), 1, tok.pad_token_id, None)
        result, _ = train_step(model, optimizer, batches, num_input_tokens=num_input_tokens, max_grad_norm=0.0)
        results.append((result["loss"].item(), result["grad_norm"].item()))
    return results


def one_process(source: str, data: str, out: str, verify: bool) -> tuple[dict, list]:
    """On one rank: the sft run (2 packed rows in its step, the export at its end: without `verify`, from its
    checkpoint and unchecked), then packed_and_unpacked."""
    cfg = sft_config(source, data, out, *RUN, "train.micro_batch_size=2", f"checkpoint.export_hf={str(verify).lower()}")
    record = train_rank(cfg)
    if not verify:
        from helpers import export_hf
        export_hf(out, f"{out}/hf", verify=False)
    return record, packed_and_unpacked(cfg)


@pytest.mark.parametrize("name", HALVES[0])
def test_a_family_trains_on_2_ranks_as_on_1_exports_exactly_and_packs_exactly(name, chats, tmp_path, capfd):
    check_family(name, chats, tmp_path, capfd)


def check_family(name: str, chats, tmp_path, capfd) -> None:
    """The three checks on family `name` of the table, every failure named."""
    config_cls, _, extras = FAMILIES[name]
    source = make_family_dir(tmp_path / "source", config_cls, family_kwargs(name), **extras)
    capfd.readouterr()
    one, (packed, unpacked) = run_ranks(one_process, 1, str(source), str(chats), str(tmp_path / "one"),
                                          name not in UNVERIFIED)[0]
    printed = capfd.readouterr().out
    run_ranks(train_rank, 2, sft_config(source, chats, tmp_path / "two", *RUN, "train.micro_batch_size=1"))
    two = read_metrics(tmp_path / "two")[-1]
    wrong = {}
    # (a) 2 ranks of one row each == 1 process of both rows
    if (two["loss"], two["grad_norm"]) != pytest.approx((one["loss"], one["grad_norm"]), rel=1e-5) or \
            two["num_tokens"] != one["num_tokens"]:
        wrong["2 ranks"] = {k: (one[k], two[k]) for k in ("loss", "grad_norm", "num_tokens")}
    # (b) the lr=0 export: every source tensor, bytes and dtype; checked; what the class does not own said
    want, got = stored(source), stored(tmp_path / "one" / "hf")
    if sorted(got) != sorted(want):
        wrong["export names"] = sorted(set(want) - set(got))[:4], sorted(set(got) - set(want))[:4]
    if bad := [(k, want[k][0], got[k][0]) for k in want if k in got and got[k] != want[k]]:
        wrong["export tensors"] = bad[:4]
    if ("verified" not in printed or "max abs diff 0;" not in printed) is (name not in UNVERIFIED) or \
            ("copied through untouched" in printed) is not bool(extras):
        wrong["export check"] = printed[-2000:]
    # (c) packed rows == their samples unpacked
    if packed != pytest.approx(unpacked, rel=1e-5):
        wrong["packed"] = packed, unpacked
    assert not wrong, wrong
