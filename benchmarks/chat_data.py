"""Bench rows with the length profile of real SFT chat data, made offline and reproducibly (a seeded generator, no
download): `examples/data/tiny_chat.jsonl` averages 46 tokens a sample, so attention's share of a step there is near
zero; real chat SFT sets have a median of several hundred tokens and a tail into the thousands.

The profile (stated here, not fitted to any one data set): 1 to 6 user/assistant turns (1 + a geometric count, p=0.55
of stopping after each turn), user turns lognormal with a median of 40 tokens (sigma 1.0), assistant turns lognormal
with a median of 300 tokens (sigma 0.9); a conversation stops taking turns at `max_tokens` (the last answer is cut to
fit). Words are the tiny chat data's, so any tokenizer reads them; a turn's word count comes from the tokenizer's
tokens per word, so lengths land near the profile under that tokenizer (the chat template adds its own tokens).
With the bundled tiny model's tokenizer and 2,000 rows (seed 0), tokenized with the chat template (`--stats`):
median 636, mean 936, p90 2,035, p99 4,999, max 7,935 tokens.

    python3 benchmarks/chat_data.py OUT.jsonl [--rows 2000] [--seed 0] [--max-tokens 8192] [--tokenizer DIR] [--stats]
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TINY = REPO / "examples" / "tiny-llama"
USER_MEDIAN, USER_SIGMA, ASSISTANT_MEDIAN, ASSISTANT_SIGMA, STOP_P, MAX_TURNS = 40, 1.0, 300, 0.9, 0.55, 6


def words_and_rate(tok, rng: random.Random) -> tuple[list[str], float]:
    """The tiny chat data's words (sorted: the same list on every machine) and the tokenizer's tokens per word."""
    words = sorted({w for line in (REPO / "examples" / "data" / "tiny_chat.jsonl").read_text().splitlines()
                    for m in json.loads(line)["messages"] for w in m["content"].split()})
    sample = " ".join(rng.choice(words) for _ in range(2000))
    return words, len(tok(sample, add_special_tokens=False)["input_ids"]) / 2000


def make_rows(tok, num_rows: int, seed: int = 0, max_tokens: int = 8192) -> list[dict]:
    """`num_rows` conversations of the profile above; the same rows for the same seed, tokenizer and max_tokens."""
    rng = random.Random(seed)
    words, rate = words_and_rate(tok, rng)

    def text(num_tokens: float) -> str:
        return " ".join(rng.choice(words) for _ in range(max(1, round(num_tokens / rate))))

    rows = []
    for _ in range(num_rows):
        messages, total = [], 0
        for turn in range(MAX_TURNS):
            user = rng.lognormvariate(math.log(USER_MEDIAN), USER_SIGMA)
            answer = rng.lognormvariate(math.log(ASSISTANT_MEDIAN), ASSISTANT_SIGMA)
            if turn and total + user + answer > max_tokens:
                break
            answer = min(answer, max(1.0, max_tokens - total - user - 16))  # 16: a turn's template tokens, roughly
            messages += [{"role": "user", "content": text(user)}, {"role": "assistant", "content": text(answer)}]
            total += user + answer + 16
            if rng.random() < STOP_P:
                break
        rows.append({"messages": messages})
    return rows


def write_rows(path: Path, tok, num_rows: int, seed: int = 0, max_tokens: int = 8192) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in make_rows(tok, num_rows, seed, max_tokens)))
    return path


def length_stats(path: Path, tokenizer_dir: Path, max_seq_len: int) -> dict:
    """Tokenized sample lengths (finetune's chat template and labels, no packing): median, mean, p90, p99, max."""
    from finetune.data import build_samples
    from finetune.model import load_tokenizer
    samples = build_samples(str(path), load_tokenizer(str(tokenizer_dir)), max_seq_len=max_seq_len, packing=False)
    lengths = sorted(int(n) for n in samples.unit_lengths())
    pick = lambda q: lengths[min(len(lengths) - 1, int(q * len(lengths)))]  # noqa: E731
    return {"rows": len(lengths), "median": statistics.median(lengths), "mean": round(statistics.mean(lengths)),
            "p90": pick(0.9), "p99": pick(0.99), "max": lengths[-1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--tokenizer", type=Path, default=TINY)
    p.add_argument("--stats", action="store_true", help="print the tokenized lengths' median, mean, p90, p99, max")
    args = p.parse_args()
    from transformers import AutoTokenizer
    write_rows(args.out, AutoTokenizer.from_pretrained(args.tokenizer), args.rows, args.seed, args.max_tokens)
    print(f"wrote {args.rows} rows to {args.out}")
    if args.stats:
        print(json.dumps(length_stats(args.out, args.tokenizer, args.max_tokens)))


if __name__ == "__main__":
    main()
