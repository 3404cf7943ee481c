"""`finetune dpo`: preference tuning on train.py's loop, with a loss over pairs instead of tokens.

A pair is ONE sample, chosen then rejected (tasks/pairs.py), so both sides are always in one micro-batch; packed rows
hold whole pairs. The loss is a sum over pairs: train_step divides by the global pair count.

The reference (dpo.reference): "adapters" (LoRA) runs the same model with its adapters off under no_grad.
"precomputed" runs the initial model over the data once before training, keeps 2 float64 per pair on every rank and
in <output_dir>/checkpoints/ref_logps.pt (moved aside with the checkpoints by --no-resume), reused on resume once each
pair's tokens are checked against the digest saved with them (a frozen copy would cost the weights again and a forward
per step). SimPO needs no reference.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .. import checkpoint as ckpt
from ..config import ConfigError
from ..data import build_samples
from ..distributed import is_main, print0, world_size
from ..errors import FinetuneError
from ..loss import collate_labelled, token_loss_sum
from ..task import Run, Task, build_run_samples
from ..data.mixture import Mixture
from .pairs import label_pair

LABELLERS = {"pairs": label_pair}  # build_samples' labeller of the preference-pair format
MEANS = ("rewards_chosen", "rewards_rejected", "accuracy", "margin")  # the loss's statistics, per pair

PAIR_KEYS = ("label_seq", "pair_keys", "seq_tokens", "ref_logps")  # batch entries the model never sees
REF_FILE = "ref_logps.pt"  # in <output_dir>/checkpoints/: it moves with the checkpoints it belongs to


def reference_kind(cfg) -> str | None:
    """"adapters" | "precomputed" | None (SimPO), checked against the config."""
    if cfg.parallel.cp > 1:
        raise ConfigError("finetune dpo does not split rows over ranks yet: set parallel.cp=1")
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
    """The base model: peft's adapters, the experts' and lora.modules_to_save copies switched off (a flag per layer)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper
    from ..adapters.expert_lora import switch_expert_adapters
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    # the wrapper's own flag only: ModulesToSaveWrapper.enable_adapters also flips requires_grad of the trained copy
    wrappers = [m for m in model.modules() if isinstance(m, AuxiliaryTrainingWrapper)]

    def switch(on: bool) -> None:
        switch_expert_adapters(model, on)
        for m in layers:
            m.enable_adapters(on)
        for m in wrappers:
            AuxiliaryTrainingWrapper.enable_adapters(m, on)
    switch(False)
    try:
        yield
    finally:
        switch(True)


def make_loss(dc, reference: str | None):
    """loss_fn(model, batch) -> (sum of the pair losses, {"count": pairs, and the sums of MEANS: chosen and rejected
    rewards, pairs whose chosen reward is higher, margins}); a reward: beta x (log-prob - reference) (SimPO: mean)."""
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
        sums = (r[:, 0].sum(), r[:, 1].sum(), (r[:, 0] > r[:, 1]).double().sum(), (r[:, 0] - r[:, 1]).sum())
        return losses.sum(), {"count": torch.full_like(r[0, 0], len(r)), **dict(zip(MEANS, sums))}
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


def pair_digests(item: dict) -> dict:
    """{(source, row): digest} of each pair of a unit (packed rows hold several): both sides' ids and labels."""
    pos, ids, labels = item["position_ids"], item["input_ids"], item["labels"]
    cuts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
    digests = {}
    for j, s in enumerate(item["sources"]):
        a, mid, z = cuts[2 * j:2 * j + 3]
        h = hashlib.blake2b(f"{mid - a}:".encode(), digest_size=8)
        h.update(np.asarray(ids[a:z], dtype=np.int64).tobytes())
        h.update(np.asarray(labels[a:z], dtype=np.int64).tobytes())
        digests[(s["source"], s["row"])] = h.hexdigest()
    return digests


def with_digests(items, digests: dict):
    """`items`, recording each pair's digest (pair_digests) into `digests` as they pass."""
    for item in items:
        digests.update(pair_digests(item))
        yield item


def gathered(local: tuple[dict, ...]) -> list[dict]:
    """Each of the dicts in `local` merged over the ranks."""
    parts = [local]
    if world_size() > 1:
        parts = [None] * world_size()
        torch.distributed.all_gather_object(parts, local)
    return [{k: v for part in parts for k, v in part[i].items()} for i in range(len(local))]


def read_tables(resume_dir: Path) -> tuple[dict, Path]:
    """The reference tables of checkpoint `resume_dir`: in its checkpoints dir, or its output dir (older finetune)."""
    path, legacy = resume_dir.parent / REF_FILE, resume_dir.parent.parent / REF_FILE
    if not path.is_file() and legacy.is_file():
        path = legacy
    if not path.is_file():
        raise FinetuneError(f"{resume_dir.parent / REF_FILE} is missing: a resumed dpo run needs the reference "
                            f"log-probs computed before its first step (start afresh with --no-resume)")
    return torch.load(path, weights_only=False), path


def check_digests(tables: dict, now: dict, path: Path, names: dict) -> None:
    """The pairs used now (`now`: {"train"/"eval": {key: digest}}) are those `tables` were computed on, or a
    ConfigError naming one that changed (`names`: part -> source index -> its path)."""
    saved = tables.get("digests")
    if saved is None:
        print0(f"note: {path} records no fingerprint of the pairs it was computed on (saved by an older finetune): "
               f"not checked that the data is the same")
        return
    for part, digests in now.items():
        if changed := [k for k, d in digests.items() if saved[part].get(k) != d]:
            source, row = changed[0]
            raise ConfigError(f"{path} was computed on other pairs than the data holds now: {len(changed)} of the "
                              f"{len(digests)} {'held-out ' * (part == 'eval')}pairs are not those it holds (e.g. "
                              f"{names[part][source]} row {row}), and the reference of a changed pair is the initial "
                              f"model's log-probs of it: resume on the data they were computed on, or start afresh "
                              f"(--no-resume)")


def save_tables(tables: dict, root: Path, resume: bool) -> None:
    """(rank 0) `tables` into the checkpoints dir `root`; an earlier run's checkpoints are moved aside first."""
    if not is_main():
        return
    ckpt.keep_earlier_run(root, resume)
    root.mkdir(parents=True, exist_ok=True)
    torch.save(tables, root / (REF_FILE + ".tmp"))
    (root / (REF_FILE + ".tmp")).rename(root / REF_FILE)


def reference_tables(model, train_samples, eval_samples, num_eval: int, micro_batch_size: int, collate, device,
                     out: Path, resume_dir, resume: bool = True) -> dict:
    """{"train": ..., "eval": ..., "digests": ...} reference log-probs and the pairs' digests: read from beside the
    checkpoint when resuming (the pairs checked), else one pass of the initial model (training data sharded as
    training, every rank all of the eval pairs); kept in out/checkpoints/ref_logps.pt."""
    root, ranks = out / "checkpoints", world_size()
    per_rank = math.ceil(train_samples.num_samples / ranks)  # the same number of forwards on every rank
    digests, held_out = {}, {}
    names = {"train": {k: src.spec["path"] for k, src in enumerate(train_samples.sources)},
             "eval": {k: src.spec["path"] for k, src in enumerate(eval_samples.sources)} if eval_samples else {}}
    if resume_dir is not None:
        tables, path = read_tables(Path(resume_dir))
        for _ in with_digests(itertools.islice(iter(train_samples), per_rank), digests):
            pass
        if eval_samples is not None:
            for _ in with_digests(itertools.islice(iter(eval_samples), num_eval), held_out):
                pass
        check_digests(tables, {"train": gathered((digests,))[0], "eval": held_out}, path, names)
        # from another checkpoints dir, or one moved aside (resume=false): kept beside this run's checkpoints too
        if not resume or path.resolve() != (root / REF_FILE).resolve():
            save_tables(tables, root, resume)
        return tables
    local = reference_table(model, pair_batches(with_digests(iter(train_samples), digests), per_rank,
                                                micro_batch_size, collate), device)
    train, digests = gathered((local, digests))
    tables = {"train": train, "eval": {}}
    if eval_samples is not None:
        tables["eval"] = reference_table(model, pair_batches(with_digests(iter(eval_samples), held_out), num_eval,
                                                             micro_batch_size, collate), device)
    tables["digests"] = {"train": digests, "eval": held_out}
    save_tables(tables, root, resume)
    print0(f"dpo: reference log-probs of {len(tables['train'])} training and {len(tables['eval'])} held-out pairs "
           f"-> {root / REF_FILE}")
    return tables


@torch.no_grad()
def evaluate_pairs(model, loss_fn, batches, device, out: Path) -> dict:
    """Held-out pairs (every rank all of them): reward accuracy, rewards and margin; printed, in eval.json."""
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    for batch in batches:
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        stats = loss_fn(model, batch)[1]
        sums += torch.stack([stats[k] for k in ("count", *MEANS[:3])])
    n, chosen, rejected, correct = (sums / sums[0].clamp(min=1)).tolist()
    result = {"num_pairs": int(sums[0]), "accuracy": correct, "rewards_chosen": chosen, "rewards_rejected": rejected,
              "margin": chosen - rejected}
    print0(f"held-out ({result['num_pairs']} pairs): reward accuracy {correct:.1%}, margin {chosen - rejected:.4f}")
    if is_main():
        (out / "eval.json").write_text(json.dumps({"after": result}))
    return result


def dpo_task(cfg, run: Run) -> Task:
    """`finetune dpo`'s task: the pair loss (its reference computed first), pair collate, held-out evaluation after."""
    reference, pad = reference_kind(cfg), run.tokenizer.pad_token_id
    held_out = None
    if cfg.eval.path and cfg.eval.num_samples:  # every rank all of the first eval.num_samples pairs, unpacked
        held_out = build_samples(cfg.eval.path, run.tokenizer, max_seq_len=cfg.data.max_seq_len, shuffle=False,
                                 on_unsupported=cfg.data.on_unsupported, epoch_limit=1,
                                 chat_template_kwargs=cfg.data.chat_template_kwargs, labellers=LABELLERS)
    num_held_out = min(cfg.eval.num_samples, held_out.num_samples) if held_out else 0
    tables = {"train": None, "eval": None}
    if reference == "precomputed":
        train_samples = build_run_samples(cfg, run.tokenizer, rank=run.dims.dp_rank, world_size=run.dims.dp_size,
                                          shuffle=False, labellers=LABELLERS, stream=Mixture)
        tables = reference_tables(run.model, train_samples, held_out, num_held_out, cfg.train.micro_batch_size,
                                  partial(collate_pairs, pad_id=pad), run.device, run.out, run.resume_dir,
                                  cfg.checkpoint.resume)
    loss_fn = make_loss(cfg.dpo, reference)

    def evaluate_after(before):
        batches = pair_batches(iter(held_out), num_held_out, cfg.train.micro_batch_size,
                               partial(collate_pairs, pad_id=pad, table=tables["eval"]))
        return evaluate_pairs(run.model, loss_fn, batches, run.device, run.out)
    return Task(loss=loss_fn, collate=partial(collate_pairs, table=tables["train"]), means=MEANS,
                evaluate_after=evaluate_after if held_out else None)
