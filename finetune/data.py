"""Instruct data: load rows, normalise to chat, tokenize with exact assistant-only labels, stream, pack, collate."""

from __future__ import annotations

import glob
import itertools
import json
import os
import re
from collections.abc import Mapping

import datasets
import numpy as np
import torch

from .errors import FinetuneError, one_line

IGNORE_INDEX = -100
FORMATS = ("messages", "sharegpt", "alpaca")
DROP_REASONS = ("no_assistant", "no_labels_after_truncation")
_EXTS = (".json", ".jsonl", ".parquet")
_ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}
_PROBE = "finetuneprobe"  # stands in for an assistant message's content, to find what the template writes after it
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$")


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
        import pyarrow.parquet as pq

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
    import pyarrow as pa

    try:
        # Odd rows (content a string here, a list of parts there) defeat Arrow's type inference: store as JSON.
        return datasets.Dataset.from_list(rows, on_mixed_types="use_json")
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
        import pyarrow as pa
        import pyarrow.parquet as pq

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


def to_messages(row: dict, fmt: str, where: str) -> list[dict]:
    """Normalise one row to [{'role', 'content'}]; every error names `where`."""
    if fmt == "alpaca":
        user = _text(row.get("instruction"), where, "instruction")
        extra = _text(row.get("input"), where, "input")
        if extra.strip():
            user += "\n\n" + extra
        system = _text(row.get("system"), where, "system")
        head = [{"role": "system", "content": system}] if system else []
        return head + [{"role": "user", "content": user},
                       {"role": "assistant", "content": _text(row.get("output"), where, "output")}]
    if fmt not in FORMATS:
        raise DataError(f"{where}: unknown format {fmt!r}; valid formats: {', '.join(FORMATS)}")
    conv = row.get("messages") if row.get("messages") is not None else row.get("conversations")
    if not isinstance(conv, list):
        raise DataError(f"{where}: expected a list of messages, got {type(conv).__name__}")
    out = []
    for j, m in enumerate(conv):
        if not isinstance(m, dict):
            raise DataError(f"{where}: message {j} is a {type(m).__name__}, not an object")
        role = m.get("role") if m.get("role") is not None else m.get("from")
        mapped = _ROLES.get(role.strip().lower()) if isinstance(role, str) else None
        if mapped is None:
            raise DataError(f"{where}: unknown role {role!r} in message {j} "
                            f"(allowed: system, user, assistant; sharegpt also human, gpt)")
        if m.get("tool_calls") or m.get("function_call"):
            raise DataError(f"{where}: message {j} has tool calls, which are not supported (its text would be "
                            f"trained as the whole answer)")
        content = m.get("content") if m.get("content") is not None else m.get("value")
        out.append({"role": mapped, "content": _text(content, where, f"message {j} content")})
    return out


def _render(tokenizer, messages: list[dict], generation_prompt: bool, where: str) -> str:
    try:
        if messages:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        # apply_chat_template refuses an empty conversation, but an assistant-first row needs its prompt prefix.
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(conversations=[[]], chat_template=tokenizer.get_chat_template(),
                                            add_generation_prompt=generation_prompt, **tokenizer.special_tokens_map)
        return rendered[0]
    except Exception as e:  # noqa: BLE001 - template errors are data errors for this row
        raise DataError(f"{where}: chat template failed ({one_line(e)})") from e


def tokenize_messages(tokenizer, messages: list[dict], max_seq_len: int,
                      where: str = "") -> tuple[dict | None, str | None]:
    """Render with the tokenizer's chat template; label exactly the assistant contents and their end-of-turn tokens.
    Returns ({'input_ids', 'labels'}, None) or (None, reason), reason in DROP_REASONS."""
    where = where or "conversation"
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}: the tokenizer has no chat template; use a chat/instruct model's tokenizer")
    if not any(m["role"] == "assistant" for m in messages):
        return None, "no_assistant"
    full = _render(tokenizer, messages, False, where)
    # Added tokens mark where a turn ends; whitespace ones (e.g. Gemma's "\n") are ordinary template text.
    added = tokenizer.added_tokens_decoder  # {id: AddedToken}
    control = [t.content for t in added.values() if t.content.strip()]
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], True, where)
        upto = _render(tokenizer, messages[: i + 1], False, where)
        if not (full.startswith(prefix) and full.startswith(upto) and len(prefix) <= len(upto)):
            raise DataError(f"{where}: chat template is not prefix-stable (rendering the conversation up to "
                            f"message {i} is not a prefix of the full rendering), so labels cannot be exact")
        segment = full[len(prefix):len(upto)]
        # Train through the end-of-turn token but not the template text after it (e.g. the '\n' after <|im_end|>,
        # or Phi-3's '\n<|endoftext|>' after <|end|>): the tail the template writes after any content, up to its
        # first control token.
        probe = _render(tokenizer, messages[:i] + [{"role": "assistant", "content": _PROBE}], False, where)
        tail = probe[probe.rfind(_PROBE) + len(_PROBE):] if _PROBE in probe else None
        if tail is not None and segment.endswith(tail):  # cut after the tail's first (longest there) control token
            hits = [(tail.find(t), t) for t in control if t in tail]
            if hits:
                pos, token = min(hits, key=lambda h: (h[0], -len(h[1])))
                cut = len(segment) - len(tail) + pos + len(token)
            else:
                cut = -1
        else:  # the template changes what follows the content: the last control token
            cut = max((segment.rfind(t) + len(t) for t in control if t in segment), default=-1)
        end = len(prefix) + (cut if cut >= 0 else len(segment.rstrip()))
        if end > len(prefix):
            spans.append((len(prefix), end))
    # The template already holds bos etc.: this is exactly what apply_chat_template(tokenize=True) feeds the model.
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    if "offset_mapping" not in enc:
        raise DataError(f"{where}: the tokenizer ({type(tokenizer).__name__}) gives no character offsets, so labels "
                        f"cannot be placed; use a fast (tokenizers-backed) tokenizer")
    ids = list(enc["input_ids"])
    ref = tokenizer.apply_chat_template(messages, tokenize=True)
    if list(ref["input_ids"] if isinstance(ref, Mapping) else ref) != ids:
        raise DataError(f"{where}: tokenizing the rendered text differs from apply_chat_template(tokenize=True)")
    labels = [IGNORE_INDEX] * len(ids)
    k = 0
    for t, (s, e) in enumerate(enc["offset_mapping"]):
        while k < len(spans) and spans[k][1] <= s:
            k += 1
        # Every token that holds answer text, also one straddling the prompt/answer boundary ('ĠParis' after a
        # prompt ending in ' ', an end-of-turn token with rstrip that swallowed the '\n' after it), but never a
        # template token that only swallowed the answer's leading whitespace (a header with rstrip).
        if k < len(spans) and s < spans[k][1] and e > spans[k][0] and (s >= spans[k][0] or ids[t] not in added):
            labels[t] = ids[t]
    ids, labels = ids[:max_seq_len], labels[:max_seq_len]
    if all(x == IGNORE_INDEX for x in labels):
        return None, "no_labels_after_truncation"
    return {"input_ids": ids, "labels": labels}, None


def _greedy_packs(items, max_len: int):
    """Group consecutive (item, length) pairs into lists whose lengths sum to at most max_len."""
    group, used = [], 0
    for item, n in items:
        if group and used + n > max_len:
            yield group
            group, used = [], 0
        group.append(item)
        used += n
    if group:
        yield group


class SampleStream(torch.utils.data.IterableDataset):
    """This rank's samples, forever (or epoch_limit epochs). Global sample g (world-size independent, counted
    across epochs) goes to rank g % world_size; iteration starts at global sample start_sample. Iterate it in the
    training process (DataLoader num_workers=0): counts for streaming data are filled in as it goes."""

    def __init__(self, rows, tokenize, *, streaming, shuffle, packing, max_seq_len, seed, rank, world_size,
                 start_sample, epoch_limit, source):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        self.streaming, self.shuffle, self.packing, self.max_seq_len = streaming, shuffle, packing, max_seq_len
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.start_sample, self.epoch_limit, self.source = start_sample, epoch_limit, source
        self._rows, self._tokenize = rows, tokenize
        self.counts = dict(rows=0, kept=0, **{f"dropped_{r}": 0 for r in DROP_REASONS})
        self.num_samples: int | None = None
        if streaming:
            return
        ints = getattr(datasets, "List", datasets.Sequence)(datasets.Value("int32"))  # List is datasets>=4
        features = datasets.Features({"input_ids": ints, "labels": ints,
                                      "length": datasets.Value("int32"), "drop": datasets.Value("string")})
        # Tokenize once; every epoch then only reorders row indices.
        self._tok = rows.map(tokenize, with_indices=True, remove_columns=rows.column_names, features=features,
                             keep_in_memory=True, load_from_cache_file=False, desc="Tokenizing")
        drops = self._tok["drop"]
        kept = [i for i, d in enumerate(drops) if not d]
        self.counts.update(rows=len(drops), kept=len(kept),
                           **{f"dropped_{r}": sum(d == r for d in drops) for r in DROP_REASONS})
        if packing:  # pack once in file order, then shuffle the packs each epoch: a constant epoch length
            lengths = self._tok["length"]
            self._units = list(_greedy_packs(((i, lengths[i]) for i in kept), max_seq_len))
        else:
            self._units = np.asarray(kept, dtype=np.int64)
        self.num_samples = len(self._units)
        if not self.num_samples:
            raise DataError(f"{source}: no usable samples ({self.counts})")

    def _assemble(self, samples: list[dict]) -> dict:
        if not self.packing:
            return {"input_ids": list(samples[0]["input_ids"]), "labels": list(samples[0]["labels"])}
        # position_ids restart per sample: transformers derives the block-diagonal attention from them.
        return {"input_ids": [t for s in samples for t in s["input_ids"]],
                "labels": [t for s in samples for t in s["labels"]],
                "position_ids": [p for s in samples for p in range(len(s["input_ids"]))]}

    def _epoch_indexed(self, epoch: int, g0: int):
        n = self.num_samples
        order = np.random.default_rng(self.seed + epoch).permutation(n) if self.shuffle else np.arange(n)
        first = max(0, self.start_sample - g0)
        first += (self.rank - g0 - first) % self.world_size
        for p in range(first, n, self.world_size):
            unit = self._units[order[p]]
            rows = self._tok[[int(unit)] if not self.packing else unit]
            yield self._assemble([{"input_ids": a, "labels": b} for a, b in zip(rows["input_ids"], rows["labels"])])
        return n

    def _epoch_streamed(self, epoch: int, g0: int):
        first_pass = self.num_samples is None
        if first_pass:  # counts describe one pass over the data
            self.counts.update({k: 0 for k in self.counts})

        def kept():
            for idx, row in enumerate(self._rows):
                out = self._tokenize(row, idx)
                if first_pass:
                    self.counts["rows"] += 1
                    self.counts["dropped_" + out["drop"] if out["drop"] else "kept"] += 1
                if not out["drop"]:
                    yield out, out["length"]

        units = _greedy_packs(kept(), self.max_seq_len) if self.packing else ([s] for s, _ in kept())
        n = 0
        for n, unit in enumerate(units, 1):
            g = g0 + n - 1
            if g >= self.start_sample and g % self.world_size == self.rank:
                yield self._assemble(unit)
        if not n:
            raise DataError(f"{self.source}: no usable samples ({self.counts})")
        if first_pass:
            self.num_samples = n
        return n

    def __iter__(self):
        g0, epoch = 0, 0
        while self.epoch_limit is None or epoch < self.epoch_limit:
            if self.num_samples is not None and g0 + self.num_samples <= self.start_sample:
                n = self.num_samples  # the whole epoch lies before the resume point
            elif self.streaming:
                n = yield from self._epoch_streamed(epoch, g0)
            else:
                n = yield from self._epoch_indexed(epoch, g0)
            g0, epoch = g0 + n, epoch + 1


def build_samples(path, tokenizer, *, fmt="auto", split="train", name=None, streaming=False, max_seq_len=2048,
                  packing=False, shuffle=True, seed=0, rank=0, world_size=1, start_sample=0,
                  epoch_limit=None) -> SampleStream:
    """This rank's tokenized (optionally packed) samples; see SampleStream for the order contract.
    Non-streaming data is tokenized up front and shuffled per epoch (seed + epoch) when shuffle; streaming data
    is read lazily in file order (never shuffled), so it matches non-streaming with shuffle=False."""
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{path}: the tokenizer has no chat template; use a chat/instruct model's tokenizer")
    rows = load_rows(path, split=split, name=name, streaming=streaming)
    fmt = detect_format(columns_of(rows), fmt)

    def tokenize(row: dict, idx: int) -> dict:
        where = f"{path} row {idx}"
        sample, reason = tokenize_messages(tokenizer, to_messages(row, fmt, where), max_seq_len, where)
        sample = sample or {"input_ids": [], "labels": []}
        return {**sample, "length": len(sample["input_ids"]), "drop": reason or ""}

    return SampleStream(rows, tokenize, streaming=streaming, shuffle=shuffle and not streaming, packing=packing,
                        max_seq_len=max_seq_len, seed=seed, rank=rank, world_size=world_size,
                        start_sample=start_sample, epoch_limit=epoch_limit, source=path)


def pad_collate(samples: list[dict], pad_id: int, pad_to: int | None = None) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample (or pad_to). Packed samples (with position_ids) get no attention_mask:
    transformers then builds the block-diagonal causal mask from the position_ids restarts (call the model with
    use_cache=False: a cache disables that detection)."""
    longest = max(len(s["input_ids"]) for s in samples)
    width = longest if pad_to is None else pad_to
    if width < longest:
        raise ValueError(f"pad_to={pad_to} is shorter than the longest sample ({longest} tokens)")
    shape = (len(samples), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        input_ids[i, :n] = torch.as_tensor(s["input_ids"])
        labels[i, :n] = torch.as_tensor(s["labels"])
        position_ids[i, :n] = torch.as_tensor(s["position_ids"]) if "position_ids" in s else torch.arange(n)
        attention_mask[i, :n] = 1
    batch = {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
    if not any("position_ids" in s for s in samples):
        batch["attention_mask"] = attention_mask
    return batch


def format_preview(tokenizer, sample: dict, color: bool = True) -> str:
    """The decoded sample with trained tokens highlighted (ANSI green, or [[...]] without color), then counts."""
    ids, labels = list(sample["input_ids"]), list(sample["labels"])
    parts = []
    for trained, group in itertools.groupby(zip(ids, labels), key=lambda t: t[1] != IGNORE_INDEX):
        text = tokenizer.decode([t for t, _ in group], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        parts.append((f"\x1b[30;42m{text}\x1b[0m" if color else f"[[{text}]]") if trained else text)
    trained = sum(x != IGNORE_INDEX for x in labels)
    return "".join(parts) + f"\ntrained tokens: {trained} / total: {len(ids)}"
