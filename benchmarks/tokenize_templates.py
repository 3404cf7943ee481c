"""Labelling cost: rows/s of finetune's inference-exact labels against one apply_chat_template(tokenize=True) per row.

Rows: 8 messages (user, assistant reasoning + tool call, tool, assistant reasoning + answer, user, assistant tool call,
tool, assistant answer), about 1k tokens with the row's tools, rendered by the Qwen3-style template of the tests
(tests/_tokenizers.py; byte-level BPE). Variants: "split" as written (the first query's two turns are rendered
differently once the second query follows, so they get samples of their own) and "one query" (the second user
message folded into a tool result: two turns in one sample, the tool call after the last tool result alone, as
its empty think block is only written in the last turn). "labels" is tokenize_messages per row in this process
(normalising included); "build_samples" is end to end (reading the file, datasets map with num_proc workers,
Arrow). Rounds alternate the four; medians and spread of rows/s are printed as a Markdown table.
Then, on this shared machine the steadier figure: labels / floor alternating row by row (the same load for both),
per round; with --baseline REV also the labels of that git revision (exported to a temp dir), row by row beside them.

    uv run python benchmarks/tokenize_templates.py [--rows 400] [--rounds 5] [--baseline 072fff4]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "benchmarks")]

WORDS = ("the weather in paris is sunny and warm today so we can walk along the river then check the forecast "
         "for tomorrow because rain might come later with wind from the west").split()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "search", "description": "Search the web",
                                           "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]


def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_row(rng, one_query: bool) -> dict:
    def call(name, **args):
        return [{"type": "function", "function": {"name": name, "arguments": args}}]
    second = {"role": "tool", "content": text(rng, 22)} if one_query else {"role": "user", "content": text(rng, 22)}
    return {"tools": TOOLS, "messages": [
        {"role": "user", "content": text(rng, 32)},
        {"role": "assistant", "reasoning_content": text(rng, 32), "content": "", "tool_calls": call("get_weather",
                                                                                                    city="Paris")},
        {"role": "tool", "content": text(rng, 27)},
        {"role": "assistant", "reasoning_content": text(rng, 27), "content": text(rng, 32)},
        second,
        {"role": "assistant", "content": None, "tool_calls": call("search", q=text(rng, 6))},
        {"role": "tool", "content": text(rng, 32)},
        {"role": "assistant", "reasoning_content": text(rng, 22), "content": text(rng, 32)}]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline", default="", help="a git revision whose labels to time beside (row by row)")
    args = ap.parse_args()
    from _tokenizers import build_tokenizer
    from compare_peers import machine

    from finetune.data import build_samples, to_conversation, tokenize_messages
    tok = build_tokenizer("qwen3")
    results = {}
    for one_query in (False, True):
        rng = random.Random(0)
        rows = [make_row(rng, one_query) for _ in range(args.rows)]
        path = Path(tempfile.mkdtemp()) / "rows.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tokens = [len(tok.apply_chat_template(r["messages"], tools=r["tools"], tokenize=True)["input_ids"])
                  for r in rows]

        def floor():
            for r in rows:
                tok.apply_chat_template(r["messages"], tools=r["tools"], tokenize=True)

        def labels():
            for r in rows:
                conv = to_conversation(r, "messages", "r")
                tokenize_messages(tok, conv.messages, 4096, "r", conv.tools)

        def ours(num_proc):
            s = build_samples(str(path), tok, shuffle=False, max_seq_len=4096, num_proc=num_proc)
            ours.counts = s.counts
        runs = {"floor: apply_chat_template(tokenize=True)": floor, "labels (tokenize_messages)": labels,
                "build_samples, num_proc=1": lambda: ours(1), "build_samples, num_proc=2": lambda: ours(2)}
        times = {k: [] for k in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(args.rows / (time.perf_counter() - t0))
        results["one query" if one_query else "split"] = (times, statistics.median(tokens), ours.counts)
    rowwise(tok, args, labels_of(args.baseline) if args.baseline else None)
    print(f"machine: {machine()} (shared with other jobs while measured)\n")
    for variant, (times, tokens, counts) in results.items():
        floor_med = statistics.median(next(iter(times.values())))
        print(f"### {variant}: {args.rows} rows, median {tokens:.0f} tokens/row, {counts['samples']} samples, "
              f"{counts['turns_trained']} turns trained, {sum(v for k, v in counts.items() if 'split' in k)} split out")
        print("| | rows/s (median) | min-max | floor / this |\n|---|---|---|---|")
        for name, xs in times.items():
            med = statistics.median(xs)
            print(f"| {name} | {med:.0f} | {min(xs):.0f}-{max(xs):.0f} | {floor_med / med:.2f}x |")
        print()


def labels_of(rev: str):
    """finetune.data of git revision `rev`, imported as finetune_base (its imports inside the package are relative)."""
    root = Path(tempfile.mkdtemp())
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "finetune"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive.stdout, check=True)
    (root / "finetune").rename(root / "finetune_base")
    sys.path.insert(0, str(root))
    import finetune_base.data
    return finetune_base.data


def rowwise(tok, args, base):
    import finetune.data as data
    for one_query in (True, False):
        rng = random.Random(0)
        rows = [make_row(rng, one_query) for _ in range(args.rows)]
        fns = {"floor": lambda r: tok.apply_chat_template(r["messages"], tools=r["tools"], tokenize=True)}
        for name, mod in (("labels", data), (f"labels at {args.baseline}", base)):
            if mod is not None:
                fns[name] = (lambda mod: lambda r: mod.tokenize_messages(
                    tok, (c := mod.to_conversation(r, "messages", "r")).messages, 4096, "r", c.tools))(mod)
        ratios = {k: [] for k in fns}
        for _ in range(args.rounds):
            total = dict.fromkeys(fns, 0.0)
            for r in rows:
                for k, f in fns.items():
                    t0 = time.perf_counter()
                    f(r)
                    total[k] += time.perf_counter() - t0
            for k in fns:
                ratios[k].append(total[k] / total["floor"])
        print(f"### {'one query' if one_query else 'split'}, row by row: time / the floor's, median (min-max) of "
              f"{args.rounds} rounds\n| | x floor |\n|---|---|")
        for k, xs in ratios.items():
            print(f"| {k} | {statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f}) |")
        print()


if __name__ == "__main__":
    main()
