"""Held-out evaluation: loss on trained tokens and exact match of greedy answers to the last assistant turn."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch

from ..data import IGNORE_INDEX, detect_format, load_rows, pad_collate, row_of, to_conversation
from ..data.template import prepared, template_of
from ..distributed import is_main, print0
from ..data.label_hints import tokenize_messages  # with the not_prefix hint, as before


# a held-out conversation is scored whole up to this many tokens, not cut at the training data.max_seq_len
MAX_EVAL_TOKENS = 4096


def prompt_text(tokenizer, messages: list[dict], tools=None, template_kwargs: dict | None = None) -> str:
    """The context the model answers after messages, rendered as the labels are."""
    t = template_of(tokenizer, template_kwargs)
    return t.render(prepared(messages, t.args_as_string[bool(tools)], t.reads_parts), tools, True)


def evaluate(model, tokenizer, path: str, num_samples: int, max_new_tokens: int, device: torch.device,
             template_kwargs: dict | None = None, max_seq_len: int = MAX_EVAL_TOKENS) -> dict:
    """Loss and exact match on the first `num_samples` conversations of `path`, each truncated to max_seq_len tokens,
    all on every rank (FSDP needs every rank in every forward). The exact-match target is the last assistant turn's
    trained text (reasoning and tool calls included) without special tokens. Compiled blocks run eagerly here:
    generate's KV-cache shapes would spend dynamo's recompile limit before training (which would then run eager)."""
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):  # torch 2.6+ (2.11, 2.15)
        return _evaluate(model, tokenizer, path, num_samples, max_new_tokens, device, template_kwargs, max_seq_len)


def _evaluate(model, tokenizer, path: str, num_samples: int, max_new_tokens: int, device: torch.device,
              template_kwargs: dict | None, max_seq_len: int) -> dict:
    was_training = model.training
    model.eval()
    loss_sum, num_tokens, correct, scored = 0.0, 0, 0, 0
    data = load_rows(path)
    fmt = detect_format(data.columns)
    for i, item in zip(range(num_samples), data.data):
        row, where = row_of(item, path, i)
        messages, tools = to_conversation(row, fmt, where)
        samples = tokenize_messages(tokenizer, messages, max_seq_len, f"{path} row {i}", tools, "drop",
                                    template_kwargs).samples  # a turn the template cannot hold is not scored
        for sample in samples:
            batch = pad_collate([sample], pad_id=tokenizer.pad_token_id)
            labels = batch["labels"].to(device)
            out = model(input_ids=batch["input_ids"].to(device), labels=labels, use_cache=False,
                        num_items_in_batch=torch.tensor(1.0, device=device))
            loss_sum, num_tokens = loss_sum + out.loss.item(), num_tokens + int((labels[:, 1:] != IGNORE_INDEX).sum())
        last = max((j for j, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        turn = next((s for s in samples if last in s["turns"]), None)
        if turn is None:
            continue
        prompt = prompt_text(tokenizer, messages[:last], tools, template_kwargs)
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answer = tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip()
        # the last run of labels in that sample is the last turn (the one whose context is the prompt above)
        runs = [list(run) for trained, run in itertools.groupby(turn["labels"], lambda x: x != IGNORE_INDEX) if trained]
        target = tokenizer.decode(runs[-1], skip_special_tokens=True).strip()
        correct += answer == target
        scored += 1
    model.train(was_training)
    return {"exact_match": correct / max(scored, 1), "loss": loss_sum / max(num_tokens, 1), "num_samples": scored}


def report_eval(result: dict, before: dict | None, out: Path) -> dict:
    """Print the held-out result (beside the one before training) and write eval.json; returns the result."""
    em = f"{before['exact_match']:.1%} -> " if before else ""
    loss = f"{before['loss']:.3f} -> " if before else ""
    print0(f"held-out ({result['num_samples']} questions): exact match {em}{result['exact_match']:.1%}, "
           f"loss {loss}{result['loss']:.3f}")
    if is_main():
        (out / "eval.json").write_text(json.dumps({"before": before, "after": result}))
    return result
