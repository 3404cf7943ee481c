"""Held-out evaluation: loss on assistant tokens and exact match of greedy answers to the last user turn."""
from __future__ import annotations

import torch

from .data import IGNORE_INDEX, columns_of, detect_format, load_rows, pad_collate, to_messages, tokenize_messages


def load_eval_conversations(path: str, num_samples: int) -> list[list[dict]]:
    rows = load_rows(path)
    fmt = detect_format(columns_of(rows))
    return [to_messages(row, fmt, f"{path} row {i}") for i, row in zip(range(num_samples), rows)]


@torch.no_grad()
def evaluate(model, tokenizer, eval_cfg, device: torch.device) -> dict:
    """Every rank runs the same conversations (FSDP needs every rank in every forward); fine for small sets."""
    was_training = model.training
    model.eval()
    convs = load_eval_conversations(eval_cfg.path, eval_cfg.num_samples)
    loss_sum, num_tokens, correct, scored = 0.0, 0, 0, 0
    for messages in convs:
        sample, _ = tokenize_messages(tokenizer, messages, max_seq_len=4096)
        if sample is not None:
            batch = pad_collate([sample], pad_id=tokenizer.pad_token_id)
            labels = batch["labels"].to(device)
            n = int((labels[:, 1:] != IGNORE_INDEX).sum())
            out = model(input_ids=batch["input_ids"].to(device), labels=labels, use_cache=False,
                        num_items_in_batch=torch.tensor(1.0, device=device))
            loss_sum, num_tokens = loss_sum + out.loss.item(), num_tokens + n
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            continue
        prompt = tokenizer.apply_chat_template(messages[:last], add_generation_prompt=True, tokenize=False)
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=eval_cfg.max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answer = tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip()
        correct += answer == str(messages[last]["content"]).strip()
        scored += 1
    model.train(was_training)
    return {"exact_match": correct / max(scored, 1), "loss": loss_sum / max(num_tokens, 1), "num_samples": scored}
