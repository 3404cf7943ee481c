"""`finetune dpo`: preference tuning on train.py's loop, with a loss over pairs instead of tokens.

A pair is ONE sample, chosen then rejected (ext/pairs.py), so both sides are always in one micro-batch; packed rows
hold whole pairs. loss.token_loss_sum's per-target log-probs sum per side by `label_seq` (collate_pairs). The loss
is a sum over pairs: train_step divides by the global pair count (one all_reduce, as for tokens).

The reference (dpo.reference): "adapters" (LoRA) runs the same model with its adapters off under no_grad: no memory
beyond one more forward's transient activations. "precomputed" runs the initial model over the data once before
training (sharded like training, ~1/3 of an epoch's compute), keeps 2 float64 per pair on every rank and in
<output_dir>/ref_logps.pt, reused on resume. (A frozen sharded copy would cost the model's bf16 weights again,
divided by the ranks, and a forward per step: not built.) SimPO needs no reference.
"""
from __future__ import annotations

import itertools
import json
import math
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..distributed import is_main, print0, world_size
from ..errors import FinetuneError
from ..loss import collate_labelled, token_loss_sum

PAIR_KEYS = ("label_seq", "pair_keys", "seq_tokens", "ref_logps")  # batch entries the model never sees
REF_FILE = "ref_logps.pt"


def reference_kind(cfg) -> str | None:
    """"adapters" | "precomputed" | None (SimPO), checked against the config."""
    if cfg.dpo.loss == "simpo":
        return None
    kind = cfg.dpo.reference if cfg.dpo.reference != "auto" else "adapters" if cfg.lora.rank else "precomputed"
    if kind == "adapters" and not cfg.lora.rank:
        raise ConfigError("dpo.reference=\"adapters\" needs LoRA (lora.rank > 0); full fine-tuning uses "
                          "\"precomputed\"")
    if kind == "precomputed" and cfg.data.streaming:
        raise ConfigError("dpo.reference=\"precomputed\" needs the data's size before training: set "
                          "data.streaming=false")
    return kind


def collate_pairs(items: list[dict], pad_id: int, pad_to: int | None = None, table: dict | None = None) -> dict:
    """(host) loss.collate_labelled, and per pair: label_seq (2 x pair + side of each target), seq_tokens
    (P, 2) its label counts, pair_keys (source, row), and from `table` its reference log-probs ref_logps (P, 2)."""
    batch = collate_labelled(items, pad_id, pad_to)
    pos = batch["position_ids"]
    real = torch.arange(pos.shape[1]) < torch.tensor([len(item["input_ids"]) for item in items])[:, None]
    seq = torch.cumsum(((pos == 0) & real).flatten(), 0) - 1  # each side starts where its position_ids restart
    keys = [(s["source"], s["row"]) for item in items for s in item["sources"]]
    batch["label_seq"] = seq[batch["label_index"]]
    batch["seq_tokens"] = torch.bincount(batch["label_seq"], minlength=2 * len(keys)).view(-1, 2).double()
    batch["pair_keys"] = keys
    if table is not None:
        try:
            batch["ref_logps"] = torch.tensor([table[k] for k in keys], dtype=torch.float64)
        except KeyError as e:
            source, row = e.args[0]
            raise ConfigError(f"{REF_FILE} has no reference log-probs for row {row} of source {source}: the data "
                              f"changed since they were computed; resume on the same data or start afresh "
                              f"(--no-resume)") from None
    return batch


def pair_logps(model, batch: dict) -> torch.Tensor:
    """(P, 2) float32: each side's log-prob summed over its trained tokens."""
    logp = -token_loss_sum(model, {k: v for k, v in batch.items() if k not in PAIR_KEYS}, reduction="none")
    return logp.new_zeros(2 * len(batch["pair_keys"])).index_add_(0, batch["label_seq"], logp).view(-1, 2)


@contextmanager
def adapters_off(model):
    """The base model: every peft layer's adapters disabled and every lora.modules_to_save module back to its frozen
    original (a flag per layer; FSDP2 gathers the same parameters)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    # the wrapper's own flag only: ModulesToSaveWrapper.enable_adapters also flips requires_grad of the trained copy
    wrappers = [m for m in model.modules() if isinstance(m, AuxiliaryTrainingWrapper)]
    for m in layers:
        m.enable_adapters(False)
    for m in wrappers:
        AuxiliaryTrainingWrapper.enable_adapters(m, False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)
        for m in wrappers:
            AuxiliaryTrainingWrapper.enable_adapters(m, True)


def make_loss(dc, reference: str | None):
    """loss_fn(model, batch) -> (sum of the pair losses, float64 [pairs, chosen reward sum, rejected reward sum,
    pairs whose chosen reward is higher]); rewards are beta x (log-prob - reference) (SimPO: beta x mean log-prob)."""
    def loss_fn(model, batch):
        logps = pair_logps(model, batch)
        if reference == "adapters":
            with torch.no_grad(), adapters_off(model):
                ref = pair_logps(model, batch)
        if reference is None:  # SimPO
            scores = logps / batch["seq_tokens"].to(logps.device).clamp(min=1)
            rewards = dc.beta * scores
            losses = -F.logsigmoid(rewards[:, 0] - rewards[:, 1] - dc.simpo_gamma)
        else:
            ref = ref if reference == "adapters" else batch["ref_logps"].to(logps.device)
            rewards = dc.beta * (logps - ref)
            z = rewards[:, 0] - rewards[:, 1]
            losses = -(1 - dc.label_smoothing) * F.logsigmoid(z) - dc.label_smoothing * F.logsigmoid(-z)
        r = rewards.detach().double()
        stats = torch.stack([torch.full_like(r[0, 0], len(r)), r[:, 0].sum(), r[:, 1].sum(),
                             (r[:, 0] > r[:, 1]).double().sum()])
        return losses.sum(), stats
    return loss_fn


def pair_batches(samples, num_units: int, micro_batch_size: int, collate):
    """Micro-batches of the next num_units units of `samples`."""
    units = iter(itertools.islice(samples, num_units))
    while chunk := list(itertools.islice(units, micro_batch_size)):
        yield collate(chunk)


@torch.no_grad()
def reference_table(model, batches, device) -> dict:
    """{(source, row): [chosen, rejected] log-probs} of the current model over `batches`."""
    table = {}
    for batch in batches:
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        for key, v in zip(batch["pair_keys"], pair_logps(model, batch).double().tolist()):
            table.setdefault(key, v)
    return table


def reference_tables(model, train_samples, eval_samples, num_eval: int, micro_batch_size: int, collate, device,
                     out: Path, resume_dir) -> dict:
    """{"train": ..., "eval": ...} reference log-probs: read from out/ref_logps.pt when resuming, else one pass of
    the initial model (the training data sharded as training; every rank all of the eval pairs), saved there."""
    path = out / REF_FILE
    if resume_dir is not None:
        if not path.is_file():
            raise FinetuneError(f"{path} is missing: a resumed dpo run needs the reference log-probs computed before "
                                f"its first step (start afresh with --no-resume)")
        return torch.load(path, weights_only=False)
    ranks = world_size()
    per_rank = math.ceil(train_samples.num_samples / ranks)  # the same number of forwards on every rank
    local = reference_table(model, pair_batches(iter(train_samples), per_rank, micro_batch_size, collate), device)
    parts = [local]
    if ranks > 1:
        parts = [None] * ranks
        torch.distributed.all_gather_object(parts, local)
    tables = {"train": {k: v for part in parts for k, v in part.items()}, "eval": {}}
    if eval_samples is not None:
        tables["eval"] = reference_table(model, pair_batches(iter(eval_samples), num_eval, micro_batch_size, collate),
                                         device)
    if is_main():
        out.mkdir(parents=True, exist_ok=True)
        torch.save(tables, path)
    print0(f"dpo: reference log-probs of {len(tables['train'])} training and {len(tables['eval'])} held-out pairs "
           f"-> {path}")
    return tables


@torch.no_grad()
def evaluate_pairs(model, loss_fn, batches, device, out: Path) -> dict:
    """Held-out pairs (every rank all of them): reward accuracy, rewards and margin; printed, in eval.json."""
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    for batch in batches:
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        sums += loss_fn(model, batch)[1]
    n, chosen, rejected, correct = (sums / sums[0].clamp(min=1)).tolist()
    result = {"num_pairs": int(sums[0]), "accuracy": correct, "rewards_chosen": chosen, "rewards_rejected": rejected,
              "margin": chosen - rejected}
    print0(f"held-out ({result['num_pairs']} pairs): reward accuracy {correct:.1%}, margin {chosen - rejected:.4f}")
    if is_main():
        (out / "eval.json").write_text(json.dumps({"after": result}))
    return result
