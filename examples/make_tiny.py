"""Build the tiny default model and chat dataset shipped in ``examples/``.

Writes (deterministically, byte-identical on every run):

* ``examples/data/tiny_chat.jsonl``       synthetic chat conversations (train)
* ``examples/data/tiny_chat_eval.jsonl``  held-out single-question conversations
* ``examples/data/tiny_prefs.jsonl``, ``tiny_prefs_eval.jsonl``  preference pairs (correct vs corrupted last answer)
* ``examples/tiny-llama/``                a randomly initialised Llama model (bf16)
  with a byte-level BPE tokenizer trained on the training data and a
  Llama-3 style chat template.

Everything runs offline on CPU in a few seconds::

    uv run python examples/make_tiny.py
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
from pathlib import Path

# Must be set before ``tokenizers`` is imported: keeps BPE training single-threaded.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import torch  # noqa: E402
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

HERE = Path(__file__).resolve().parent
SEED = 1234

N_TRAIN = 4000
N_EVAL = 160
N_PAIRS = 2000  # preference pairs (tiny_prefs.jsonl) from the first training conversations

BOS = "<|begin_of_text|>"
EOT_TEXT = "<|end_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
PAD = "<|finetune_pad|>"
SPECIAL_TOKENS = [BOS, EOT_TEXT, START_HEADER, END_HEADER, EOT, PAD]  # ids 0..5

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)

SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
VOCAB_SIZE_TARGET = 1024  # BPE stops early if the corpus runs out of merges
INIT_STD = 0.08
MODEL = dict(
    hidden_size=160,
    intermediate_size=432,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)

# --------------------------------------------------------------------------- data

# Every word, its uppercase and its reverse end up as single BPE tokens.
WORDS = [
    "cat", "dog", "sun", "hat", "cup", "pen", "box", "egg",
    "fish", "bird", "tree", "milk", "cake", "book", "frog", "moon",
    "apple", "bread", "chair", "clock", "horse", "lemon", "mouse", "zebra",
]  # fmt: skip

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a helpful assistant. Answer briefly.",
    "Reply with only the answer.",
    "You are a concise tutor. Give the answer and nothing else.",
    "You are a tiny model that answers math and word questions.",
    "Be brief.",
]

UNITS = [  # (from, to, factor, names for phrasing)
    ("km", "m", 1000, "kilometers", "meters"),
    ("m", "cm", 100, "meters", "centimeters"),
    ("kg", "g", 1000, "kilograms", "grams"),
    ("L", "mL", 1000, "liters", "milliliters"),
]

GREETINGS = [
    ("Hello!", "Hello! Ask me a question."),
    ("Hi", "Hi! How can I help?"),
    ("Hey there.", "Hello! How can I help?"),
    ("Thanks!", "You are welcome."),
    ("Thank you.", "You are welcome."),
    ("Who are you?", "I am a tiny assistant."),
    ("What can you do?", "I can do small sums and word puzzles."),
]


def _add(r: random.Random) -> tuple[str, str]:
    a, b = r.randint(0, 9), r.randint(0, 9)
    t = r.choice(
        [
            "What is {a} + {b}?",
            "What is {a} plus {b}?",
            "Add {a} and {b}.",
            "Compute {a} + {b}.",
            "{a} + {b} = ?",
            "What is the sum of {a} and {b}?",
            "Please add {a} and {b}.",
        ]
    )
    return t.format(a=a, b=b), str(a + b)


def _sub(r: random.Random) -> tuple[str, str]:
    a = r.randint(0, 9)
    b = r.randint(0, a)
    t = r.choice(
        [
            "What is {a} - {b}?",
            "What is {a} minus {b}?",
            "Subtract {b} from {a}.",
            "Compute {a} - {b}.",
            "{a} - {b} = ?",
        ]
    )
    return t.format(a=a, b=b), str(a - b)


def _next(r: random.Random) -> tuple[str, str]:
    if r.random() < 0.5:
        n = r.randint(0, 19)
        t = r.choice(["What number comes after {n}?", "What is one more than {n}?", "What is {n} + 1?"])
        return t.format(n=n), str(n + 1)
    n = r.randint(1, 20)
    t = r.choice(["What number comes before {n}?", "What is one less than {n}?", "What is {n} - 1?"])
    return t.format(n=n), str(n - 1)


def _bigger(r: random.Random) -> tuple[str, str]:
    a, b = r.sample(range(0, 10), 2)
    if r.random() < 0.6:
        t = r.choice(
            ["Which is larger, {a} or {b}?", "Which number is bigger: {a} or {b}?", "What is the max of {a} and {b}?"]
        )
        return t.format(a=a, b=b), str(max(a, b))
    t = r.choice(
        ["Which is smaller, {a} or {b}?", "Which number is smaller: {a} or {b}?", "What is the min of {a} and {b}?"]
    )
    return t.format(a=a, b=b), str(min(a, b))


def _times(r: random.Random) -> tuple[str, str]:
    n, f = r.randint(1, 20), r.choice([10, 100])
    t = r.choice(["What is {n} x {f}?", "What is {n} times {f}?", "Multiply {n} by {f}.", "{n} x {f} = ?"])
    return t.format(n=n, f=f), str(n * f)


def _convert(r: random.Random) -> tuple[str, str]:
    src, dst, f, src_name, dst_name = r.choice(UNITS)
    n = r.randint(1, 20)
    t = r.choice(
        [
            "Convert {n} {src} to {dst}.",
            "How many {dst_name} are in {n} {src_name}?",
            "What is {n} {src} in {dst}?",
            "{n} {src} = ? {dst}",
        ]
    )
    return t.format(n=n, src=src, dst=dst, src_name=src_name, dst_name=dst_name), f"{n * f} {dst}"


def _upper(r: random.Random) -> tuple[str, str]:
    w = r.choice(WORDS)
    t = r.choice(
        [
            "Uppercase the word {w}.",
            "Write in capital letters: {w}",
            "Make this word uppercase: {w}",
            "What is the upper case of {w}?",
        ]
    )
    return t.format(w=w), w.upper()


def _reverse(r: random.Random) -> tuple[str, str]:
    w = r.choice(WORDS)
    t = r.choice(
        ["Reverse the letters of {w}.", "Spell backwards: {w}", "Write in reverse: {w}", "What is the reverse of {w}?"]
    )
    return t.format(w=w), w[::-1]


def _count(r: random.Random) -> tuple[str, str]:
    w = r.choice(WORDS)
    t = r.choice(
        [
            "How many letters are in {w}?",
            "Count the letters in the word {w}.",
            "How long is the word {w}?",
            "Number of letters in {w}?",
        ]
    )
    return t.format(w=w), str(len(w))


def _letter(r: random.Random) -> tuple[str, str]:
    w = r.choice(WORDS)
    if r.random() < 0.5:
        t = r.choice(["What is the first letter of {w}?", "First letter of {w}?", "Give the first letter of {w}."])
        return t.format(w=w), w[0]
    t = r.choice(["What is the last letter of {w}?", "Last letter of {w}?", "Give the last letter of {w}."])
    return t.format(w=w), w[-1]


TASKS = [  # (generator, weight)
    (_add, 0.16),
    (_sub, 0.08),
    (_times, 0.08),
    (_convert, 0.16),
    (_next, 0.07),
    (_bigger, 0.07),
    (_upper, 0.11),
    (_letter, 0.10),
    (_count, 0.09),
    (_reverse, 0.08),
]


def _question(r: random.Random, banned: set[str]) -> tuple[str, str]:
    gens, weights = zip(*TASKS)
    while True:
        gen = r.choices(gens, weights=weights)[0]
        q, a = gen(r)
        if q not in banned:
            return q, a


def _conversation(r: random.Random, banned: set[str]) -> dict:
    msgs = []
    if r.random() < 0.30:
        msgs.append({"role": "system", "content": r.choice(SYSTEM_PROMPTS)})
    u = r.random()
    turns = 1 if u < 0.80 else (2 if u < 0.93 else 3)
    for i in range(turns):
        if i == 0 and r.random() < 0.04:
            q, a = r.choice(GREETINGS)
        else:
            q, a = _question(r, banned)
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": msgs}


def make_data() -> tuple[list[dict], list[dict]]:
    r = random.Random(SEED)
    eval_rows, seen = [], {}  # dict as an insertion-ordered set
    while len(eval_rows) < N_EVAL:
        q, a = _question(r, seen)
        seen[q] = None
        msgs = [{"role": "system", "content": r.choice(SYSTEM_PROMPTS)}] if r.random() < 0.30 else []
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        eval_rows.append({"messages": msgs})
    banned = set(seen)
    train_rows = [_conversation(r, banned) for _ in range(N_TRAIN)]
    return train_rows, eval_rows


def _corrupt(r: random.Random, answer: str) -> str:
    """A wrong answer of the same kind: a nearby number, else the word's letters shuffled (or another word)."""
    num = re.search(r"\d+", answer)
    if num:
        n = int(num.group())
        wrong = r.choice([m for m in (n - 2, n - 1, n + 1, n + 2, n * 10) if m >= 0 and m != n])
        return answer[: num.start()] + str(wrong) + answer[num.end():]
    letters = list(answer)
    for _ in range(10):
        r.shuffle(letters)
        if "".join(letters) != answer:
            return "".join(letters)
    return r.choice([w for w in WORDS if w != answer])


def make_pairs(rows: list[dict], seed: int) -> list[dict]:
    """Preference pairs for `finetune dpo`: the prompt (the conversation before its last answer), the correct last
    answer (chosen) and a corrupted one (rejected)."""
    r = random.Random(seed)
    return [{"prompt": row["messages"][:-1], "chosen": row["messages"][-1]["content"],
             "rejected": _corrupt(r, row["messages"][-1]["content"])} for row in rows]


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------- tokenizer


def make_tokenizer(train_rows: list[dict]) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    # Llama-3 style split, except that every digit is its own token (keeps arithmetic learnable).
    # Unlike the GPT-2 regex, "\n\n" is one piece whatever follows it, so the "\n\n" that ends a
    # generation prompt tokenizes exactly as it does inside a training conversation.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE_TARGET,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def corpus():
        for row in train_rows:
            for m in row["messages"]:
                yield m["role"] + "\n\n"
                yield m["content"].strip()

    tok.train_from_iterator(corpus(), trainer=trainer)
    # Llama-3 behaviour: a plain ``tok(text)`` prepends BOS; the chat template writes BOS itself, so
    # chat-formatted text must be encoded with ``add_special_tokens=False`` (as apply_chat_template does).
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        additional_special_tokens=[EOT_TEXT, START_HEADER, END_HEADER],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL["max_position_embeddings"],
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )


# -------------------------------------------------------------------------- model


def make_model(tokenizer: PreTrainedTokenizerFast, out: Path) -> LlamaForCausalLM:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    vocab_size = -(-len(tokenizer) // 64) * 64  # round up to a multiple of 64, like real checkpoints
    config = LlamaConfig(
        vocab_size=vocab_size,
        **MODEL,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        # ~1/sqrt(hidden) instead of Llama's 0.02: with 0.02 a model this narrow starts with near-uniform attention
        # and needs 2-3x more steps before it learns to look at the operands (see examples/README.md).
        initializer_range=INIT_STD,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=ids[BOS],
        eos_token_id=[ids[EOT], ids[EOT_TEXT]],
        pad_token_id=ids[PAD],
        dtype=torch.bfloat16,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config)  # random init on CPU is deterministic for a fixed seed
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=ids[BOS],
        eos_token_id=[ids[EOT], ids[EOT_TEXT]],
        pad_token_id=ids[PAD],
        do_sample=False,
        max_new_tokens=32,
    )
    model.save_pretrained(out, safe_serialization=True)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE, help="output root (default: examples/)")
    args = ap.parse_args()
    out: Path = args.out

    train_rows, eval_rows = make_data()
    write_jsonl(train_rows, out / "data" / "tiny_chat.jsonl")
    write_jsonl(eval_rows, out / "data" / "tiny_chat_eval.jsonl")
    write_jsonl(make_pairs(train_rows[:N_PAIRS], SEED + 1), out / "data" / "tiny_prefs.jsonl")
    write_jsonl(make_pairs(eval_rows, SEED + 2), out / "data" / "tiny_prefs_eval.jsonl")

    model_dir = out / "tiny-llama"
    if model_dir.exists():  # drop stale files (e.g. a chat_template.jinja that would shadow the config's template)
        shutil.rmtree(model_dir)
    model_dir.mkdir(parents=True)
    tokenizer = make_tokenizer(train_rows)
    tokenizer.save_pretrained(model_dir, save_jinja_files=False)  # template in tokenizer_config.json
    model = make_model(tokenizer, model_dir)
    for f in model_dir.iterdir():
        f.chmod(0o644)  # safetensors writes 0600

    n_params = sum(p.numel() for p in model.parameters())
    print(f"train rows: {len(train_rows)}  eval rows: {len(eval_rows)}")
    print(f"tokenizer: {len(tokenizer)} tokens  model vocab: {model.config.vocab_size}  params: {n_params:,}")
    print(f"wrote {model_dir}")


if __name__ == "__main__":
    main()
