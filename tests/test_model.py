"""Model building: the attention implementation resolved per model class and device; what cannot keep packed samples
apart is refused in one line."""
from __future__ import annotations

import pytest
import torch
import transformers as T

from helpers import BASE, invoke


def test_attention_implementation_is_resolved_per_model_class_and_device(monkeypatch):
    from finetune.attention import resolve_attn_implementation as resolve
    from finetune.config import ConfigError
    from finetune.kernels.varlen import register
    assert resolve(T.LlamaConfig(), "sdpa") == "sdpa" and resolve(T.LlamaConfig(), "eager") == "eager"
    assert resolve(T.Gemma2Config(), "sdpa") == "eager"  # Gemma2 has no sdpa path
    assert resolve(T.LlamaConfig(), "auto", register) == "varlen"
    assert resolve(T.LlamaConfig(), "varlen", register) == "varlen"
    assert resolve(T.Gemma2Config(), "auto", register) == "eager"  # attention logit soft-capping: not in varlen
    assert resolve(T.RwkvConfig(), "auto", register) == "eager"  # its layers take no attention kwargs (nor sdpa)
    assert resolve(T.LlamaConfig(), "auto") == "sdpa"  # without the varlen kernel (no varlen register given)
    with pytest.raises(ConfigError, match=r"^model.attn_implementation=varlen needs kernels/varlen.py's register "
                                          r"\(an attention-stage model.Transform\), which this model build was not "
                                          r"given$"):
        resolve(T.LlamaConfig(), "varlen")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="model.attn_implementation=flash_attention_2 needs a CUDA device and the "
                                          "flash_attn package"):
        resolve(T.LlamaConfig(), "flash_attention_2")


@pytest.mark.parametrize("config, why", [
    (lambda: T.Qwen3NextConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=16, num_experts=4, moe_intermediate_size=32, linear_num_value_heads=4,
                               linear_num_key_heads=2), "its linear_attention layers"),
    (lambda: T.Qwen3_5TextConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=16),
     "its linear_attention layers"),
    (lambda: T.MambaConfig(hidden_size=64, num_hidden_layers=2, state_size=8), "its linear_attention layers"),
    (lambda: T.RwkvConfig(hidden_size=64, num_hidden_layers=2), r"its layers \(no attention heads\)"),
], ids=["qwen3_next", "qwen3_5", "mamba", "rwkv"])
def test_layers_that_ignore_sample_boundaries_are_refused_with_packing(config, why):
    from finetune.attention import check_packing
    from finetune.config import ConfigError
    from finetune.model import build_skeleton, find_layers
    model = build_skeleton(config(), "sdpa")
    with pytest.raises(ConfigError, match=f"cannot keep packed samples apart: {why}.*; set data.packing=false$"):
        check_packing(model, find_layers(model), "sdpa")


def test_a_sequence_convolution_is_refused_and_attention_models_pass():
    from finetune.attention import check_packing
    from finetune.config import ConfigError
    from finetune.model import build_skeleton, find_layers
    model = build_skeleton(T.Lfm2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        layer_types=["conv", "full_attention"]), "sdpa")
    with pytest.raises(ConfigError, match="its conv layers ignore"):
        check_packing(model, find_layers(model), "sdpa")
    model.config.layer_types = None  # the convolution module alone tells too
    with pytest.raises(ConfigError, match=r"its sequence convolutions \(Conv1d in Lfm2DecoderLayer\) ignore"):
        check_packing(model, find_layers(model), "sdpa")
    for config in (T.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
                   T.Gemma2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16)):
        model = build_skeleton(config, "sdpa")
        for attn in ("sdpa", "eager", "varlen", "flash_attention_2"):
            check_packing(model, find_layers(model), attn)
    type(model)._supports_attention_backend = False  # a class whose layers do not pass attention kwargs on
    try:
        with pytest.raises(ConfigError, match="model.attn_implementation=varlen gets packed-sample boundaries as "
                                              "attention kwargs, which Gemma2ForCausalLM's layers do not pass on"):
            check_packing(model, find_layers(model), "varlen")
    finally:
        del type(model)._supports_attention_backend


@pytest.mark.parametrize("override, message", [
    ("model.attn_implementation=flash_attention_3", "error: model.attn_implementation=flash_attention_3 needs a CUDA "
     "device and the flash_attn_interface package (uv sync --extra gpu); use sdpa otherwise"),
    ("model.liger=maybe", "error: model.liger must be true, false or \"auto\", got 'maybe'"),
])
def test_refused_attention_settings_are_one_line_and_exit_2(llama_dir, chat_file, tmp_path, override, message):
    result = invoke("sft", "--model", llama_dir, "--dataset", chat_file, "--output-dir", tmp_path / "run", *BASE,
                    "train.max_steps=1", override)
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [message], result.output


def test_a_packed_run_of_a_recurrent_model_is_one_line_and_exit_2(chat_file, tmp_path):
    """RWKV's time mixing has no conv and no cache_params: not run per sample (kernels/linear_attention), so refused.
    (Linear-attention and state-space families pack: tests/test_hybrids.py.)"""
    from _tokenizers import build_tokenizer
    model_dir = tmp_path / "rwkv"  # config and tokenizer only: the run stops before any weight is read
    T.RwkvConfig(hidden_size=64, num_hidden_layers=2).save_pretrained(model_dir)
    # its module imported here, not in the run: torchao, which it imports, warns on stderr once per process
    from transformers import RwkvForCausalLM  # noqa: F401
    build_tokenizer("chatml").save_pretrained(model_dir)
    result = invoke("sft", "--model", model_dir, "--dataset", chat_file, "--output-dir", tmp_path / "run", *BASE)
    assert result.exit_code == 2 and result.stderr.strip().splitlines() == [
        "error: RwkvForCausalLM cannot keep packed samples apart: its layers (no attention heads) ignore position_ids "
        "restarts; set data.packing=false"], result.output
