"""Rows in: local .json/.jsonl/.parquet files or hub datasets -> Conversation(messages, tools) in the OpenAI shape."""

from __future__ import annotations

import glob
import json
import os
import re
from typing import NamedTuple

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from ..errors import FinetuneError, one_line

FORMATS = ("messages", "sharegpt", "alpaca")
_EXTS = (".json", ".jsonl", ".parquet")
# ShareGPT's `from` values and OpenAI roles; function_call turns become assistant tool calls.
_ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
          "tool": "tool", "observation": "tool", "function": "tool", "function_call": "assistant"}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")


class Conversation(NamedTuple):
    messages: list[dict]  # role, content, and where present reasoning_content, tool_calls, tool_call_id, name, train
    tools: list[dict] | None  # function schemas passed to the chat template


class DataError(FinetuneError):
    """Bad input data; str(e) is ONE line naming the file, the line/row index and what is wrong."""


def _local_files(path: str) -> list[str] | None:
    """The data files behind a local path, or None when `path` should be tried as a hub dataset id."""
    if os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                       if f.endswith(_EXTS) and os.path.isfile(f))
        if not files:
            raise DataError(f"{path}: directory holds no .json, .jsonl or .parquet files")
        return files
    if os.path.isfile(path):
        if not path.endswith(_EXTS):
            raise DataError(f"{path}: unsupported file type (expected .json, .jsonl or .parquet)")
        return [path]
    if path.endswith(_EXTS) or path.startswith((".", "/", "~")) or not _HUB_ID.match(path):
        raise DataError(f"{path}: no such file or directory")
    return None


def _iter_file(file: str):
    """Yield (location, row) with exact line numbers, so errors point at the offending line."""
    if file.endswith(".parquet"):
        for b, batch in enumerate(pq.ParquetFile(file).iter_batches(batch_size=1024)):
            for i, row in enumerate(batch.to_pylist()):
                yield f"{file} row {b * 1024 + i}", row
        return
    with open(file, encoding="utf-8-sig") as f:  # -sig: tolerate a BOM
        head = f.read(4096).lstrip()
        f.seek(0)
        if file.endswith(".json") and head.startswith("["):
            try:
                rows = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"{file}:{e.lineno}: malformed JSON ({e.msg})") from e
            for i, row in enumerate(rows):
                yield f"{file} item {i}", row
            return
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    if n == 1 and head.startswith("{") and not line.rstrip().endswith("}"):  # a pretty-printed object
                        raise DataError(f"{file}: holds one multi-line JSON object; expected JSON Lines (one row "
                                        f"object per line) or a JSON array of row objects") from e
                    raise DataError(f"{file}:{n}: malformed JSON ({e.msg} at column {e.colno})") from e
                yield f"{file}:{n}", row


def locate(path: str, index: int) -> str:
    """Where row `index` of local data is ("file:line", "file item N", "file row N"), for error messages: read again
    only when an error is reported. Hub data: "path row N"."""
    files = _local_files(path) if os.path.exists(path) else None
    for k, (where, _) in enumerate(w for file in files or () for w in _iter_file(file)):
        if k == index:
            return where
    return f"{path} row {index}"


def _iter_rows(files):
    for file in files:
        try:
            for where, row in _iter_file(file):
                if not isinstance(row, dict):
                    raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
                yield row
        except UnicodeDecodeError:
            raise DataError(_not_utf8(file)) from None


def _not_utf8(file: str) -> str:
    """Where a file stops being UTF-8 (the decoder's position is relative to its buffer, not to the file)."""
    with open(file, "rb") as f:
        for n, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"{file}:{n}: not UTF-8 text (byte {line[e.start]:#04x} at column {e.start + 1}); re-encode it"
    return f"{file}: not UTF-8 text"


def _from_list(rows: list[dict], path: str) -> datasets.Dataset:
    try:
        # Odd rows (content a string here, a list of parts there) defeat Arrow's type inference: store as JSON.
        # from_dict over the union of keys: from_list keeps only the first row's columns (a later `tools` is lost).
        keys = list(dict.fromkeys(k for row in rows for k in row))
        return datasets.Dataset.from_dict({k: [row.get(k) for row in rows] for k in keys}, on_mixed_types="use_json")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise DataError(f"{path}: rows have inconsistent value types ({one_line(e)})") from e


def load_rows(path: str, *, split: str = "train", name: str | None = None, streaming: bool = False):
    """Rows from a local .json/.jsonl/.parquet file, a directory of such files, or a hub dataset id
    (optionally "id:split"). Returns a datasets.Dataset (streaming=False) or datasets.IterableDataset."""
    files = _local_files(path)
    if files is None:
        ref, _, hub_split = path.partition(":")
        try:
            return datasets.load_dataset(ref, name=name, split=hub_split or split, streaming=streaming)
        except Exception as e:  # noqa: BLE001 - any hub failure is reported as one line
            raise DataError(f"{path}: not a local path, and loading it from the hub failed ({one_line(e)})") from e
    if streaming:
        # A tuple, not a list: datasets would shard list gen_kwargs, and the order must stay the file order.
        return datasets.IterableDataset.from_generator(_iter_rows, gen_kwargs={"files": tuple(files)})
    if all(f.endswith(".parquet") for f in files):  # straight to Arrow, no Python round trip
        try:
            return datasets.Dataset(pa.concat_tables([pq.read_table(f) for f in files]))
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{path}: cannot read parquet ({one_line(e)})") from e
    return _from_list(list(_iter_rows(files)), path)


def columns_of(rows) -> list[str]:
    """Column names of a Dataset/IterableDataset; local streaming data only knows them from its first row."""
    names = rows.column_names
    return list(names) if names is not None else list(next(iter(rows), {}).keys())


def detect_format(column_names, fmt: str = "auto") -> str:
    """'messages' | 'sharegpt' | 'alpaca', detected from the columns when fmt == 'auto'.
    column_names may also be the rows themselves (see columns_of)."""
    if column_names is None:
        raise ValueError("column names unknown (streaming local data): pass the rows or columns_of(rows)")
    cols = columns_of(column_names) if hasattr(column_names, "column_names") else list(column_names)
    has_conv = "messages" in cols or "conversations" in cols
    has_alpaca = "instruction" in cols and "output" in cols
    if fmt == "auto":
        if "messages" in cols:
            return "messages"
        if "conversations" in cols:
            return "sharegpt"
        if has_alpaca:
            return "alpaca"
    elif (fmt in ("messages", "sharegpt") and has_conv) or (fmt == "alpaca" and has_alpaca):
        return fmt
    raise DataError(f"cannot use format {fmt!r} with columns {cols}; valid formats: messages (column 'messages'), "
                    f"sharegpt (column 'conversations'), alpaca (columns 'instruction' and 'output')")


def _text(value, where: str, what: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI-style content parts: keep the text ones
        return "".join(p if isinstance(p, str) else (p.get("text") or "") for p in value
                       if isinstance(p, str) or (isinstance(p, dict) and p.get("type", "text") == "text"))
    raise DataError(f"{where}: {what} must be text, got {type(value).__name__}")


def _json(value, where: str, what: str):
    """A JSON string decoded, anything else as is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: {what} is not valid JSON ({e.msg})") from e


def _tool_calls(raw, where: str, what: str) -> list[dict]:
    """OpenAI tool calls ({id, type, function: {name, arguments}}), arguments as an object (most templates `tojson`
    it; labels.py turns it back into a string for templates that concatenate one)."""
    calls = _json(raw, where, what)
    calls = calls if isinstance(calls, list) else [calls]
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") or call if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise DataError(f"{where}: {what} {k} has no function name")
        args = _json(fn.get("arguments"), where, f"{what} {k} arguments")
        if not isinstance(args, dict | None):
            raise DataError(f"{where}: {what} {k} arguments must be an object, got {type(args).__name__}")
        out.append({**({"id": call["id"]} if call.get("id") else {}), "type": "function",
                    "function": {"name": fn["name"], "arguments": args or {}}})
    return out


def _tools(raw, where: str) -> list[dict] | None:
    tools = _json(raw, where, "tools") if raw not in (None, "") else None
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"{where}: tools must be a list of function schemas")
    return [t if "function" in t or "name" not in t else {"type": "function", "function": t} for t in tools] or None


def to_conversation(row: dict, fmt: str, where: str) -> Conversation:
    """Normalise one row; every error names `where`."""
    if fmt == "alpaca":
        f = {k: _text(row.get(k), where, k) for k in ("instruction", "input", "system", "output")}
        user = f["instruction"] + ("\n\n" + f["input"] if f["input"].strip() else "")
        head = [{"role": "system", "content": f["system"]}] if f["system"] else []
        return Conversation(head + [{"role": "user", "content": user}, {"role": "assistant", "content": f["output"]}],
                            None)
    if fmt not in FORMATS:
        raise DataError(f"{where}: unknown format {fmt!r}; valid formats: {', '.join(FORMATS)}")
    conv = row.get("messages") if row.get("messages") is not None else row.get("conversations")
    if not isinstance(conv, list):
        raise DataError(f"{where}: expected a list of messages, got {type(conv).__name__}")
    out = []
    for j, m in enumerate(conv):
        if not isinstance(m, dict):
            raise DataError(f"{where}: message {j} is a {type(m).__name__}, not an object")
        raw_role = m.get("role") if m.get("role") is not None else m.get("from")
        role = _ROLES.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise DataError(f"{where}: unknown role {raw_role!r} in message {j} (allowed: system, user, assistant, "
                            f"tool; also human, gpt, function_call, observation, function)")
        content = m.get("content") if m.get("content") is not None else m.get("value")
        msg = {"role": role}
        if raw_role.strip().lower() == "function_call":  # ShareGPT: the value is the call as JSON
            calls, content = content, None
        else:
            calls = m.get("tool_calls") or m.get("function_call")
        if calls and role == "assistant":
            msg["tool_calls"] = _tool_calls(calls, where, f"message {j} tool call")
        elif calls:
            raise DataError(f"{where}: message {j} has tool calls but role {raw_role!r}")
        # null content next to tool calls stays null: templates test for it
        msg["content"] = None if content is None and calls else _text(content, where, f"message {j} content")
        reasoning = next((m[k] for k in ("reasoning_content", "reasoning", "thinking") if m.get(k) is not None), None)
        if reasoning is not None:
            msg["reasoning_content"] = _text(reasoning, where, f"message {j} reasoning")
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None and role == "tool":
                msg[key] = str(m[key])
        if m.get("train") is not None:
            if not isinstance(m["train"], bool):
                raise DataError(f"{where}: message {j} train must be true or false, got {m['train']!r}")
            if not m["train"]:
                msg["train"] = False
        out.append(msg)
    return Conversation(out, _tools(row.get("tools"), where))


def to_messages(row: dict, fmt: str, where: str) -> list[dict]:
    """The messages of to_conversation (without the row's tools)."""
    return to_conversation(row, fmt, where).messages
