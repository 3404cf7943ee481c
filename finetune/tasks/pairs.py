"""Preference pairs: a row -> ONE sample holding its chosen then its rejected sequence (position_ids restart between
them), each labelled by labels.tokenize_messages' inference-exact rule for the final assistant turn only.

Shapes (format "pairs", detected from the columns `chosen` and `rejected`): `chosen` / `rejected` as whole
conversations sharing everything before their final assistant turn; or `prompt` (a string or messages) with
`chosen` / `rejected` as a string, an assistant message or a list of messages ending in one. The row's `tools`
apply to both. A pair fits data.max_seq_len: each side is cut at max_seq_len // 2 tokens.
"""

from __future__ import annotations

from ..data.formats import DataError, text_of, to_conversation
from ..data.labels import Labelled, refuse
from ..data.template import Unsupported
from ..data.label_hints import tokenize_messages  # with the not_prefix hint

PAIR_REASONS = ("missing_side", "prompt_mismatch", "empty_completion")


def _side(row: dict, key: str, where: str) -> list[dict]:
    """prompt + this side as normalised messages (ending in the trained assistant turn)."""
    value, prompt = row.get(key), row.get("prompt")
    if value in (None, "", []):
        raise Unsupported("missing_side", f"no {key} completion")
    value = [{"role": "assistant", "content": value}] if isinstance(value, str) else value
    value = [value] if isinstance(value, dict) else value
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt or []
    if not isinstance(value, list) or not isinstance(prompt, list):
        raise DataError(f"{where}: {key} and prompt must be text, a message or a list of messages")
    msgs = to_conversation({"messages": prompt + value}, "messages", f"{where} ({key})").messages
    last = msgs[-1]
    if last["role"] != "assistant" or len(msgs) < 2:
        raise Unsupported("missing_side", f"{key} does not end in an assistant turn after a prompt")
    if not text_of(last.get("content")).strip() and not last.get("tool_calls"):
        raise Unsupported("empty_completion", f"the {key} completion is empty")
    return [{**m, "train": False} if m["role"] == "assistant" else m for m in msgs[:-1]] + [last]


def label_pair(tokenizer, row: dict, where: str, max_seq_len: int, on_unsupported: str = "error",
               template_kwargs: dict | None = None) -> Labelled:
    """The pair's one sample: input_ids/labels of chosen then rejected, `starts` [0, len(chosen)]; or why the row is
    dropped (PAIR_REASONS, or the labeller's reasons): a DataError naming `where` unless on_unsupported="drop"."""
    tools = to_conversation({"messages": [], "tools": row.get("tools")}, "messages", where).tools
    try:
        chosen, rejected = _side(row, "chosen", where), _side(row, "rejected", where)
        if chosen[:-1] != rejected[:-1]:
            raise Unsupported("prompt_mismatch", "chosen and rejected differ before their final assistant turn")
    except Unsupported as e:
        refuse(e, where, on_unsupported, "drops and counts such rows")
        return Labelled([], e.reason, [])
    sides = [tokenize_messages(tokenizer, msgs, max_seq_len // 2, where, tools, on_unsupported, template_kwargs)
             for msgs in (chosen, rejected)]
    for s in sides:
        if not s.samples:
            return Labelled([], s.dropped or "no_labels_after_truncation", s.left_out)
    c, r = (s.samples[0] for s in sides)
    return Labelled([{"input_ids": c["input_ids"] + r["input_ids"], "labels": c["labels"] + r["labels"],
                      "turns": c["turns"], "split": "", "starts": [0, len(c["input_ids"])]}], None, [])
