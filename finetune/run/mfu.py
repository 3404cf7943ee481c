"""MFU (model FLOPs utilisation) for a run's metrics: training FLOPs per token as torchtitan counts them, and as they
run (lm_head only at the label positions), over the device's dense bf16 peak (`meter`: train.train's); the device's
name (`device_name`: bench's)."""
from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from ..model import find_experts

# dense bf16 peak FLOP/s by device name (no sparsity); MFU is reported only for devices listed here
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "B200": 2250e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def device_name() -> str:
    """GPU name, or the CPU model from /proc/cpuinfo. (Called in the workers: the parent never touches CUDA.)"""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    import platform
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    cpu = next((x.split(":", 1)[1].strip() for x in info if x.startswith("model name")), platform.processor())
    return f"{cpu or 'unknown'} (CPU)"


def flops_per_token(model, seq_len: float, label_fraction: float = 1.0) -> float:
    """Training FLOPs per token (MFU_CONVENTION): 6N + 12 * L * H * Q * T, N the parameters a token runs (not the input
    embedding, an MoE layer's k of E experts; a tied lm_head once), L layers, H attention heads of Q dims, T = seq_len,
    the length each token attends over (causal attention in full, as torchtitan does; packed: attention_length()).
    label_fraction < 1 counts lm_head's 6 * V * D at that fraction of the tokens only (MFU_RAN: the loss projects
    the label positions alone)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and {id(p) for p in embed.parameters()} & {id(p) for p in head.parameters()}
    num_params = sum(p.numel() for p in model.parameters()) - (0 if tied else embed.weight.numel())
    if head is not None:
        num_params -= head.weight.numel() * (1 - label_fraction)
    config = model.config.get_text_config()
    num_params -= sum(p.numel() * (1 - getattr(config, "num_experts_per_tok", m.num_experts) / m.num_experts)
                      for m in find_experts(model) for p in m.parameters())  # a token runs k of a layer's E experts
    head_dims = config.num_attention_heads * (getattr(config, "head_dim", None) or
                                              config.hidden_size // config.num_attention_heads)
    return 6 * num_params + 12 * config.num_hidden_layers * head_dims * seq_len


MFU_CONVENTION = ("MFU: torchtitan's convention, 6N + 12*L*H*Q*T FLOPs per token (N without the input embedding, "
                  "T = sum(s^2)/sum(s) over the real samples s of the step: each sample attends within itself, not "
                  "across its packed row) over the dense bf16 peak")
MFU_RAN = ("MFU ran: the same with lm_head (6 * vocab * hidden) counted only at the label positions, where the loss "
           "runs it (finetune.loss: the hidden states are gathered there first), not at every token")


def segment_counts(batches: list[dict]) -> tuple[int, int, int]:
    """(host) (sum of s^2, sum of s, label positions) over the micro-batches' real samples s: read from each batch's
    segments (cu_seq_lens_q; a row's padding is one segment whose position_ids are all 0); a batch without segments
    counts its rows whole (an unpacked row is one sample, padded to the longest). Label positions: label_index's
    length (the loss's gathered positions), else every token."""
    squares, tokens, labels = 0, 0, 0
    for b in batches:
        if "cu_seq_lens_q" not in b:
            ids = b["input_ids"]
            squares, tokens = squares + ids.numel() * ids.shape[-1], tokens + ids.numel()
        else:
            cu = b["cu_seq_lens_q"].long()
            lengths = cu.diff()
            pos = b["position_ids"].flatten()
            real = (lengths == 1) | (pos[cu[1:] - 1] != 0) if pos.numel() == int(cu[-1]) else \
                lengths > 0  # a cp rank's slice of the rows (context.split_batch): the full rows' segments, padding too
            squares, tokens = squares + int((lengths[real] ** 2).sum()), tokens + int(lengths[real].sum())
        labels += b["label_index"].numel() if "label_index" in b else b["input_ids"].numel()
    return squares, tokens, labels


def attention_length(batches: list[dict]) -> float:
    """(host) T of MFU_CONVENTION for these micro-batches: sum(s^2) / sum(s) over their real samples s
    (segment_counts)."""
    squares, tokens, _ = segment_counts(batches)
    return squares / max(tokens, 1)


def step_flops_per_token(model, batches: list[dict]) -> dict[str, float]:
    """(host) FLOPs per real token of this step: {"mfu": MFU_CONVENTION's, "mfu_ran": MFU_RAN's}. Under cp a rank
    holds a slice of the rows but counts the full rows' segments, so its label fraction reads low (an undercount)."""
    squares, tokens, labels = segment_counts(batches)
    seq_len = squares / max(tokens, 1)
    return {"mfu": flops_per_token(model, seq_len),
            "mfu_ran": flops_per_token(model, seq_len, min(1.0, labels / max(tokens, 1)))}


def meter(model, device: torch.device) -> tuple:
    """(the step's micro-batches -> {record key: training FLOPs per token} (step_flops_per_token), the device's peak
    FLOP/s or None: no MFU)."""
    return partial(step_flops_per_token, model), peak_flops(device)
