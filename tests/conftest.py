"""Shared fixtures: tiny offline models (Llama untied, Qwen2 tied) with chat tokenizers, and small chat data."""
from __future__ import annotations

import os
import random
import sys
import tempfile
from pathlib import Path

# Every interpreter the suite starts (this one, the ranks' fork server, each CLI run and the ranks it launches)
# imports torch and transformers: where bytecode writing is off (PYTHONDONTWRITEBYTECODE) each would compile them from
# source again (~10 s of CPU each). They share one compiled cache instead, before this process imports torch.
PYCACHE = os.path.join(tempfile.gettempdir(), "finetune-pycache")
os.environ.update(PYTHONDONTWRITEBYTECODE="", PYTHONPYCACHEPREFIX=PYCACHE)
sys.dont_write_bytecode, sys.pycache_prefix = False, PYCACHE
# the processes the tests start (the CLI, the ranks it launches) import tests/faults.py from here (FINETUNE_TEST_FAULTS)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))

# under pytest-xdist two workers share the cores with the ranks and CLI runs the tests start (each of those on one
# thread): one compute thread per worker too, not OpenMP threads that spin waiting for a core another process holds
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():  # Triton runs on CPU only in its interpreter (Liger's kernels): every process the
    os.environ.setdefault("TRITON_INTERPRET", "1")  # suite starts, its ranks' fork server first, before any @triton.jit

from _tokenizers import build_tokenizer  # noqa: E402


def make_model_dir(path, family: str, arch: str, tied: bool, num_layers: int = 4, seed: int = 0, **sizes):
    """Save a random bf16 model of `arch` with the `family` chat tokenizer to path (`sizes` override config
    fields, e.g. intermediate_size); returns path."""
    import transformers as T
    from transformers import AutoModelForCausalLM
    tok = build_tokenizer(family)
    kw = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=160, num_hidden_layers=num_layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              tie_word_embeddings=tied, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
              pad_token_id=tok.pad_token_id)
    extra = {  # architectures whose attention or on-disk layout differs from Llama's
        "gemma2": dict(head_dim=16, sliding_window=16, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
        "gpt_neox": dict(num_key_value_heads=None),  # lm_head is stored as embed_out
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),  # experts fused in memory, per expert on disk
    }.get(arch, {})
    kw = {k: v for k, v in {**kw, **extra, **sizes}.items() if v is not None}
    config = {"llama": T.LlamaConfig, "qwen2": T.Qwen2Config, "gemma2": T.Gemma2Config, "gpt_neox": T.GPTNeoXConfig,
              "mixtral": T.MixtralConfig}[arch](**kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("llama"), "llama3", "llama", tied=False)


@pytest.fixture(scope="session")
def qwen_tied_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("qwen"), "chatml", "qwen2", tied=True, num_layers=3)


def make_chat_rows(n: int, seed: int = 0) -> list[dict]:
    """Conversations of varied length: some with a system prompt, some multi-turn."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta echo fox golf hotel india juliet kilo lima mike".split()
    rows = []
    for i in range(n):
        msgs = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for _ in range(1 + (i % 4 == 0)):
            q = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
            a = " ".join(rng.choice(words) for _ in range(rng.randint(1, 20)))
            msgs += [{"role": "user", "content": f"Repeat {q}?"}, {"role": "assistant", "content": a}]
        rows.append({"messages": msgs})
    return rows


@pytest.fixture(scope="session")
def chat_file(tmp_path_factory):
    from helpers import write_jsonl
    return write_jsonl(tmp_path_factory.mktemp("data") / "chat.jsonl", make_chat_rows(96))


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """reference(model_dir, data, *overrides, nproc=1) -> the output dir of that in-process sft run (helpers.sft),
    run once per session and shared by every test that compares against it (do not write into it)."""
    from helpers import sft
    runs = {}

    def run(model_dir, data, *overrides, nproc=1):
        key = (str(model_dir), str(data), tuple(map(str, overrides)), nproc)
        if key not in runs:
            out = tmp_path_factory.mktemp("reference")
            sft(model_dir, data, out, *overrides, nproc=nproc)
            runs[key] = out
        return runs[key]
    return run
