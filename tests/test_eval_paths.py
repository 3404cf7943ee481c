"""Evaluation's paths without sample boundaries (held-out loss, generate) on the default attention: sliding-window
layers keep their window, as sdpa's; and evaluation before training does not spend the compiled blocks' recompile
budget."""
from __future__ import annotations

import pytest
import torch
from torch import nn


@pytest.fixture(scope="module")
def sliding_dir(tmp_path_factory):
    """A Qwen2 whose layers after the first attend over a window of 6 tokens, far shorter than the samples."""
    from conftest import make_model_dir
    return make_model_dir(tmp_path_factory.mktemp("qwen_sliding"), "chatml", "qwen2", tied=True, num_layers=3,
                          use_sliding_window=True, sliding_window=6, max_window_layers=1)


def load(path, attn):
    from transformers import AutoConfig, AutoModelForCausalLM

    from finetune.attention import resolve_attn_implementation
    from finetune.kernels.varlen import register
    attn = resolve_attn_implementation(AutoConfig.from_pretrained(path), attn, register)  # registers varlen
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).eval()


def test_held_out_loss_and_greedy_tokens_keep_the_sliding_window(sliding_dir, chat_file):
    from finetune.tasks.evaluate import evaluate
    from finetune.model import load_tokenizer
    tok = load_tokenizer(sliding_dir)
    results, tokens = {}, {}
    for attn in ("sdpa", "varlen"):
        model = load(sliding_dir, attn)
        assert model.config.layer_types[1:] == ["sliding_attention"] * 2
        results[attn] = evaluate(model, tok, str(chat_file), 3, 4, torch.device("cpu"))
        ids = torch.randint(0, 100, (1, 20), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            tokens[attn] = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                          do_sample=False, pad_token_id=tok.pad_token_id)[0, 20:].tolist()
    assert results["varlen"]["num_samples"] == 3
    assert results["varlen"]["loss"] == pytest.approx(results["sdpa"]["loss"], rel=1e-5)
    assert tokens["varlen"] == tokens["sdpa"]


def test_evaluation_before_training_compiles_nothing_and_training_still_compiles(llama_dir, chat_file, monkeypatch):
    """Held-out evaluation (a loss forward per sample, then generate with its KV cache) on regionally compiled
    blocks compiles no graph, so dynamo's recompile budget is whole when training starts; training then compiles."""
    from torch._dynamo.utils import counters

    from finetune.tasks.evaluate import evaluate
    from finetune.model import apply_compile, load_tokenizer
    compile_ = nn.Module.compile  # apply_compile's path, with dynamo's plain backend (counts graphs, no codegen)
    monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: compile_(self, backend="eager", **kw))
    torch._dynamo.reset()
    model = load(llama_dir, "auto")
    apply_compile(model, True)
    counters.clear()
    result = evaluate(model, load_tokenizer(llama_dir), str(chat_file), 2, 4, torch.device("cpu"))
    assert result["num_samples"] == 2
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
    model.train()
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
