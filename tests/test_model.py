"""Model building: the attention implementation resolved per model class."""
from __future__ import annotations

import pytest
import torch


def test_attention_implementation_is_resolved_per_model_class(monkeypatch):
    from transformers import Gemma2Config, LlamaConfig
    from finetune.errors import ModelError
    from finetune.model import resolve_attn_implementation
    assert resolve_attn_implementation(LlamaConfig(), "sdpa") == "sdpa"
    assert resolve_attn_implementation(LlamaConfig(), "eager") == "eager"
    assert resolve_attn_implementation(Gemma2Config(), "sdpa") == "eager"  # Gemma2 has no sdpa path
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelError, match="flash_attention_2 needs a CUDA device and the flash_attn package"):
        resolve_attn_implementation(LlamaConfig(), "flash_attention_2")
