"""`finetune preview-data`: the first samples in dataset order as the trainer sees them, trained tokens highlighted."""
from __future__ import annotations

import itertools
import json
import os
import sys

from ..config import Config
from ..data import IGNORE_INDEX
from ..task import build_run_samples
from ..data.chat_template import run_tokenizer

SPLIT_WHY = {"history": "the full conversation renders this turn differently",
             "context": "the full conversation renders what precedes it differently"}


def format_preview(tokenizer, sample: dict, color: bool = True) -> str:
    """The decoded sample with trained tokens highlighted (ANSI green, or [[...]] without color), then counts."""
    ids, labels = list(sample["input_ids"]), list(sample["labels"])
    parts = []
    for trained, group in itertools.groupby(zip(ids, labels), key=lambda t: t[1] != IGNORE_INDEX):
        text = tokenizer.decode([t for t, _ in group], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        parts.append((f"\x1b[30;42m{text}\x1b[0m" if color else f"[[{text}]]") if trained else text)
    trained = sum(x != IGNORE_INDEX for x in labels)
    return "".join(parts) + f"\ntrained tokens: {trained} / total: {len(ids)}"


def preview(cfg: Config, num: int, json_out: bool) -> None:
    """Print `num` samples (json_out: one {"input_ids", "labels"} object per line), each with where it comes from and
    the turns left untrained, then the data summary."""
    from ..tasks import dpo
    from .. import build
    tok, _ = run_tokenizer(cfg)
    samples = build_run_samples(cfg, tok, shuffle=False, epoch_limit=1, **build.samples(cfg, dpo.LABELLERS))
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    for i, sample in zip(range(num), samples):
        if json_out:
            print(json.dumps({"input_ids": list(sample["input_ids"]), "labels": list(sample["labels"])}))
            continue
        where = "; ".join((f"source {s['source']} " if len(cfg.data.sources) > 1 else "")
                          + f"row {s['row']} turns {','.join(map(str, s['turns']))}"
                          + (f" (own sample: {SPLIT_WHY[s['split']]})" if s["split"] else "")
                          for s in sample["sources"])
        untrained = "".join(f"\n    left untrained: {x.split(' ', 1)[1]} ({x.split(' ', 1)[0]})"
                            for s in sample["sources"] for x in s["left_out"])
        print(f"--- sample {i}: {where}{untrained}\n{format_preview(tok, sample, color=color)}")
    if not json_out:  # streamed data is counted as it is read: the summary covers the rows read so far
        print("\n".join(f"--- {line}" for line in samples.summary()))
