"""Rows of local .json/.jsonl/.parquet files, dataset dirs or hub datasets -> OpenAI-shaped Conversations."""

from __future__ import annotations

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
# Local JSON rows are kept as the JSON text they were read from (decoded per row: byte for byte what was written,
# where Arrow would merge their types) beside where they are; local parquet rows get where they are too.
WHERE, JSON_ROW = "__where__", "__json__"


class Conversation(NamedTuple):
    messages: list[dict]  # role, content, and where present reasoning_content, tool_calls, tool_call_id, name, train
    tools: list[dict] | None  # function schemas passed to the chat template


class Rows(NamedTuple):
    data: datasets.Dataset | datasets.IterableDataset  # items: see row_of
    columns: list[str]  # the rows' keys (streamed local data: the first row's)
    files: list[str]  # the local files read, in order ([]: hub data)


class DataError(FinetuneError):
    """Bad input data; str(e) is ONE line naming the file, the line/row index and what is wrong."""


def _split_files(path: str, split: str, name: str | None) -> list[str]:
    """A dataset dir's files for `split`, resolved as `datasets` resolves them (README `configs`, else split names)."""
    from datasets.data_files import DataFilesDict, get_data_patterns, sanitize_patterns
    from datasets.utils.metadata import MetadataConfigs
    from huggingface_hub import DatasetCard
    base, card = path, os.path.join(path, "README.md")
    try:
        yaml = os.path.isfile(card) and open(card, encoding="utf-8").read(3) == "---"  # a card with YAML metadata
        configs = MetadataConfigs.from_dataset_card_data(DatasetCard.load(card).data) if yaml else {}
        if configs:
            chosen = name or configs.get_default_config_name()
            if chosen not in configs:
                raise DataError(f"{path}: no dataset config {chosen!r} in its README (data.name); configs: "
                                f"{', '.join(configs)}")
            base = os.path.join(path, configs[chosen].get("data_dir", ""))
            patterns = sanitize_patterns(configs[chosen].get("data_files", "**"))
        else:
            patterns = get_data_patterns(path)
        splits = DataFilesDict.from_patterns(patterns, base_path=base)
    except (ValueError, FileNotFoundError) as e:  # datasets' EmptyDatasetError is a FileNotFoundError
        raise DataError(f"{path}: cannot resolve its data files ({one_line(e)})") from e
    splits = {str(k): [f for f in v if f.endswith(_EXTS)] for k, v in splits.items()}
    if split not in splits:
        raise DataError(f"{path}: no split {split!r} (data.split); its splits: {', '.join(splits)}")
    if not splits[split]:
        raise DataError(f"{path}: split {split!r} holds no .json, .jsonl or .parquet files")
    return splits[split]


def _local_files(path: str, split: str, name: str | None) -> list[str] | None:
    """The data files behind a local path, or None when `path` should be tried as a hub dataset id."""
    if os.path.isdir(path):
        return _split_files(path, split, name)
    if os.path.isfile(path):
        if not path.endswith(_EXTS):
            raise DataError(f"{path}: unsupported file type (expected .json, .jsonl or .parquet)")
        return [path]
    if path.endswith(_EXTS) or path.startswith((".", "/", "~")) or not _HUB_ID.match(path):
        raise DataError(f"{path}: no such file or directory")
    return None


def _iter_file(file: str):
    """(location "file:line" or "file item N", JSON text, row) of each row of a JSON/JSONL file."""
    with open(file, encoding="utf-8-sig") as f:  # -sig: tolerate a BOM
        head = f.read(4096).lstrip()
        f.seek(0)
        if file.endswith(".json") and head.startswith("["):
            try:
                rows = json.load(f)
            except json.JSONDecodeError as e:
                raise DataError(f"{file}:{e.lineno}: malformed JSON ({e.msg})") from e
            for i, row in enumerate(rows):
                yield f"{file} item {i}", json.dumps(row, ensure_ascii=False), row
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
                yield f"{file}:{n}", line, row


def _iter_rows(files):
    for file in files:
        try:
            for where, text, row in _iter_file(file):
                if not isinstance(row, dict):
                    raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
                yield {WHERE: where, JSON_ROW: text}, row
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


def load_rows(path: str, *, split: str = "train", name: str | None = None, stream=None) -> Rows:
    """Rows of a local .json/.jsonl/.parquet file, a dataset dir's split or a hub dataset id ("id:split") as a Dataset
    (items: row_of); `stream` (data/streaming.py): hub data streamed, local files read by stream(path, split, files)."""
    files = _local_files(path, split, name)
    if files is None:
        ref, _, hub_split = path.partition(":")
        try:
            data = datasets.load_dataset(ref, name=name, split=hub_split or split, streaming=stream is not None)
            return Rows(data, data.column_names or list(next(iter(data), {})), [])
        except Exception as e:  # noqa: BLE001 - any hub failure is reported as one line
            raise DataError(f"{path}: not a local path, and loading it from the hub failed ({one_line(e)})") from e
    if len({f.endswith(".parquet") for f in files}) > 1:
        raise DataError(f"{path}: mixes parquet and JSON files in split {split!r}; convert them to one kind")
    if stream is not None:
        return stream(path, split, files)
    if files[0].endswith(".parquet"):  # straight to Arrow, no Python round trip
        try:
            tables = [pq.read_table(f) for f in files]
            where = pa.array([f"{f} row {k}" for f, t in zip(files, tables) for k in range(t.num_rows)])
            table = pa.concat_tables(tables)
        except (pa.ArrowInvalid, OSError) as e:
            raise DataError(f"{path}: cannot read parquet ({one_line(e)})") from e
        if not table.num_rows:
            raise DataError(_no_rows(path, split, files))
        return Rows(datasets.Dataset(table.append_column(WHERE, where)), table.column_names, files)
    items, columns = [], {}
    for item, row in _iter_rows(files):
        items.append(item)
        columns.update(dict.fromkeys(row))
    if not items:
        raise DataError(_no_rows(path, split, files))
    return Rows(datasets.Dataset.from_list(items), list(columns), files)


def _no_rows(path: str, split: str, files: list[str]) -> str:
    return (f"{path}: has no rows (the file is empty)" if files == [path] else
            f"{path}: split {split!r} has no rows (its files are empty: {', '.join(files)})")


def row_of(item: dict, source: str, index: int) -> tuple[dict, str]:
    """(the row, where it is) of an item of Rows.data."""
    where = item.get(WHERE) or f"{source} row {index}"
    if JSON_ROW in item:
        return json.loads(item[JSON_ROW]), where
    return {k: v for k, v in item.items() if k != WHERE}, where


def detect_format(columns: list[str], fmt: str = "auto") -> str:
    """fmt checked against the column names, or with fmt='auto' the first format they fit (pairs: tasks/pairs.py)."""
    cols = set(columns)
    fits = {"pairs": {"chosen", "rejected"} <= cols, "messages": "messages" in cols,
            "sharegpt": "conversations" in cols, "alpaca": {"instruction", "output"} <= cols}
    if fmt == "auto":
        fmt = next((f for f, ok in fits.items() if ok), fmt)
    elif fmt in ("messages", "sharegpt"):  # either reads either column
        fits[fmt] = fits["messages"] or fits["sharegpt"]
    if fits.get(fmt):
        return fmt
    raise DataError(f"cannot use format {fmt!r} with columns {list(columns)}; valid formats: messages (column "
                    f"'messages'), sharegpt (column 'conversations'), alpaca (columns 'instruction' and 'output'), "
                    f"pairs (columns 'chosen' and 'rejected')")


def _first(d: dict, *keys):
    return next((d[k] for k in keys if d.get(k) is not None), None)


def _text(value, where: str, what: str) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI-style content parts: keep the text ones
        return "".join(p if isinstance(p, str) else (p.get("text") or "") for p in value
                       if isinstance(p, str) or (isinstance(p, dict) and p.get("type", "text") == "text"))
    raise DataError(f"{where}: {what} must be text, got {type(value).__name__}")


def _content(value, where: str, what: str) -> str | list[dict]:
    """A message's content: text, or a list of text parts kept as the row has them (other parts are refused)."""
    if not isinstance(value, list):
        return _text(value, where, what)
    for k, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise DataError(f"{where}: {what} part {k} is of type {kind!r}; only text parts "
                            f"({{\"type\": \"text\", \"text\": ...}}) can be trained")
    return value


def text_of(content) -> str:
    """The text of a message's content (None, a string, or text parts)."""
    return "".join(part["text"] for part in content) if isinstance(content, list) else content or ""


def _json(value, where: str, what: str):
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: {what} is not valid JSON ({e.msg})") from e


def _tool_calls(raw, where: str, what: str) -> list[dict]:
    """OpenAI tool calls ({id, type, function: {name, arguments}}), arguments as an object."""
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
    conv = _first(row, "messages", "conversations")
    if not isinstance(conv, list):
        raise DataError(f"{where}: expected a list of messages, got {type(conv).__name__}")
    out = []
    for j, m in enumerate(conv):
        if not isinstance(m, dict):
            raise DataError(f"{where}: message {j} is a {type(m).__name__}, not an object")
        raw_role = _first(m, "role", "from")
        tag = raw_role.strip().lower() if isinstance(raw_role, str) else None
        role = _ROLES.get(tag)
        if role is None:
            raise DataError(f"{where}: unknown role {raw_role!r} in message {j} (allowed: system, user, assistant, "
                            f"tool; also human, gpt, function_call, observation, function)")
        content = _first(m, "content", "value")
        msg = {"role": role}
        if tag == "function_call":  # ShareGPT: the value is the call as JSON
            calls, content = content, None
        else:
            calls = m.get("tool_calls") or m.get("function_call")
        if calls and role == "assistant":
            msg["tool_calls"] = _tool_calls(calls, where, f"message {j} tool call")
        elif calls:
            raise DataError(f"{where}: message {j} has tool calls but role {raw_role!r}")
        # null content next to tool calls stays null: templates test for it
        msg["content"] = None if content is None and calls else _content(content, where, f"message {j} content")
        reasoning = _first(m, "reasoning_content", "reasoning", "thinking")
        if reasoning is not None:
            msg["reasoning_content"] = _text(reasoning, where, f"message {j} reasoning")
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None and role == "tool":
                msg[key] = str(m[key])
        if m.get("train") is not None and not isinstance(m["train"], bool):
            raise DataError(f"{where}: message {j} train must be true or false, got {m['train']!r}")
        if m.get("train") is False:
            msg["train"] = False
        out.append(msg)
    return Conversation(out, _tools(row.get("tools"), where))
