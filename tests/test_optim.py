"""AdamW parameter groups and the learning-rate schedule."""
from __future__ import annotations

import pytest


def test_adamw_groups_exclude_embeddings_norms_biases():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from finetune.optim import param_groups
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    decay, no_decay = param_groups(model, weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    name = {id(p): n for n, p in model.named_parameters()}
    decayed = {name[id(p)] for p in decay["params"]}
    kept = {name[id(p)] for p in no_decay["params"]}
    assert "model.embed_tokens.weight" in kept  # also the tied lm_head
    assert all(n.endswith("bias") or "norm" in n or "embed" in n for n in kept), kept
    assert all(n.endswith(".weight") and "norm" not in n and "embed" not in n for n in decayed), decayed
    assert "model.layers.0.self_attn.q_proj.bias" in kept  # Qwen2 has q/k/v biases
    assert len(decayed) + len(kept) == len(list(model.parameters()))


def test_lr_schedule_warmup_then_cosine():
    from finetune.optim import lr_at
    kw = dict(warmup_steps=4, max_steps=20, min_lr_ratio=0.1)
    values = [lr_at(s, **kw) for s in range(20)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert values[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(values[4:], values[5:]))
    assert values[-1] == pytest.approx(0.1)


def test_adamw_is_fused_on_cpu_and_steps_as_the_reference_adamw():
    """One kernel a group on every device (on CPU several times faster a step than foreach): the same AdamW."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from finetune.optim import build_optimizer
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    reference = [p.detach().clone().requires_grad_() for p in model.parameters()]
    start = [p.detach().clone() for p in reference]
    ours = build_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    twin = {id(p): r for p, r in zip(model.parameters(), reference)}
    groups = [{"params": [twin[id(p)] for p in g["params"]], "weight_decay": g["weight_decay"]}
              for g in ours.param_groups]
    adamw = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    assert ours.defaults["fused"] and sum(len(g["params"]) for g in groups) == len(reference)
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p, r in zip(model.parameters(), reference):
            p.grad = torch.randn(p.shape, generator=generator)
            r.grad = p.grad.clone()
        ours.step()
        adamw.step()
    for p, r in zip(model.parameters(), reference):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    assert all((p - s).abs().max() > 1e-3 for p, s in zip(model.parameters(), start))  # 5 steps of lr 1e-2 moved each
