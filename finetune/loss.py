"""Token loss only where labels are: the model's own forward with the decoder's output gathered at label_index before
lm_head, so lm_head and the cross-entropy see the N labelled positions, never the B x S x vocab logits."""
from __future__ import annotations

import torch

from .attention import packed_samples
from .data import IGNORE_INDEX, pad_collate
from .model import find_decoder

LOSS_KEYS = ("labels", "label_index", "label_targets")  # batch entries the loss reads; the model gets the rest


def label_targets(labels: torch.Tensor, position_ids: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """(host) label_index (N,): the flattened positions with a target; label_targets (N,): the next position's label."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    if position_ids is not None:
        shifted[:, :-1][position_ids[:, 1:] == 0] = IGNORE_INDEX
    flat = shifted.flatten()
    index = torch.nonzero(flat != IGNORE_INDEX).flatten()
    if index.numel() == 0:  # keep one ignored position: every rank still runs forward and backward
        index = torch.zeros(1, dtype=torch.long)
    return {"label_index": index, "label_targets": flat[index]}


def collate_labelled(items: list[dict], pad_id: int, pad_to: int | None = None) -> dict:
    """(host) pad_collate's micro-batch with label_targets in place of labels."""
    batch = pad_collate(items, pad_id=pad_id, pad_to=pad_to)
    batch.update(label_targets(batch.pop("labels"), batch["position_ids"]))
    return batch


def token_loss_sum(model, batch: dict, reduction: str = "sum") -> torch.Tensor:
    """The fp32 cross-entropy summed over the batch's label targets (0-dim; reduction="none": each target's, (N,));
    a model with `fused_loss` ((targets) -> kwargs, kernels/liger.py) computes the sum in its own forward."""
    index, targets = batch["label_index"], batch["label_targets"]

    def keep_labelled(module, args, output):  # the decoder's output, before the final projection
        output["last_hidden_state"] = output[0].flatten(0, 1).index_select(0, index).unsqueeze(0)
        return output

    fused = model.fused_loss(targets) if reduction == "sum" and getattr(model, "fused_loss", None) else {}
    handle = find_decoder(model).register_forward_hook(keep_labelled)
    # packed rows come without attention_mask: their samples are kept apart in every mask transformers builds
    packed = batch.get("position_ids") if "attention_mask" not in batch else None
    try:
        with packed_samples(packed):
            out = model(**{k: v for k, v in batch.items() if k not in LOSS_KEYS}, **fused, use_cache=False)
    finally:
        handle.remove()
    if fused:
        return out.loss
    # flatten (a view), not [0]: a select's backward zero-fills a tensor of all the logits
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), targets, reduction=reduction)
