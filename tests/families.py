"""Tiny offline models of the large-model families for the export tests: built from a transformers config class,
every tensor and buffer moved off its init, stored in the dtypes a released checkpoint has (bf16, fp32 where the
class keeps a tensor in fp32 on load), with the tensors the class does not own (MTP layers) beside them."""
from __future__ import annotations

import re
from pathlib import Path

import torch

from _tokenizers import build_tokenizer


def fp32_on_load(model) -> re.Pattern | None:
    """What transformers keeps in fp32 when it loads `model` in bf16 (its _keep_in_fp32_modules_strict)."""
    plan = model._get_dtype_plan(torch.bfloat16)
    return re.compile("|".join(p.replace("*", ".*") for p in plan)) if plan else None


def mtp_tensors(config_cls, kwargs: dict, extra_layer: str) -> dict[str, torch.Tensor]:
    """A DeepSeek-V3-style MTP layer stored as `extra_layer` (model.layers.<num_hidden_layers>): one more decoder
    block plus the MTP projections and norms, as MtpModel reads them."""
    from transformers import AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion
    n = kwargs["num_hidden_layers"]
    bigger = AutoModelForCausalLM.from_config(config_cls(**{**kwargs, "num_hidden_layers": n + 1}))
    on_disk = revert_weight_conversion(bigger, {k: v.detach() for k, v in bigger.state_dict().items()
                                                if k.startswith(f"model.layers.{n}.")})
    block = {k.replace(f"model.layers.{n}.", extra_layer): v.to(torch.bfloat16) for k, v in on_disk.items()}
    h = kwargs["hidden_size"]
    block.update({f"{extra_layer}{k}": torch.ones(shape, dtype=torch.bfloat16) for k, shape in
                  {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
                   "shared_head.norm.weight": (h,)}.items()})
    return block


def make_family_dir(path: Path, config_cls, kwargs: dict, extra: dict[str, tuple] | None = None,
                    mtp: bool = False, fp8: tuple = (), seed: int = 0) -> Path:
    """Save the tiny model of `config_cls(**kwargs)` (ChatML tokenizer) to `path`: each tensor and persistent buffer
    perturbed, bf16 but fp32 where transformers keeps it so, plus `extra` ({name: shape}, random bf16) and with
    `mtp` an MTP layer after the last: tensors the model class does not own; those named in `fp8` stored as a
    released FP8 checkpoint stores them (F8_E4M3 and a weight_scale_inv beside)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    tok = build_tokenizer("chatml")
    kwargs = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, max_position_embeddings=256, **kwargs)
    torch.manual_seed(seed)
    # as from_pretrained(dtype=bfloat16) holds it: bf16, but what the class creates in fp32 (lfm2_moe's expert_bias)
    # or keeps in fp32 (its dtype plan)
    model = AutoModelForCausalLM.from_config(config_cls(**kwargs), dtype=torch.bfloat16)
    keep = fp32_on_load(model)
    owned = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in model.state_dict())]
    extras = mtp_tensors(config_cls, kwargs, f"model.layers.{kwargs['num_hidden_layers']}.") if mtp else {}
    extras.update({k: torch.zeros(shape, dtype=torch.bfloat16) for k, shape in (extra or {}).items()})
    with torch.no_grad():
        for name, t in [*owned, *extras.items()]:
            if keep is not None and keep.search(name):
                t.data = t.data.float()
            # off its init (ones, zeros, a constant): a tensor dropped or re-initialised shows
            if t.is_floating_point():
                t.copy_(t.float() + torch.randn(t.shape) * 0.05 + 0.01 * (1 + t.float().abs().mean()))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    for name in fp8:
        extras[name] = extras[name].to(torch.float8_e4m3fn)
        extras[f"{name}_scale_inv"] = torch.ones(1, 1)
    if extras:
        stored = load_file(Path(path) / "model.safetensors")
        stored.update({k: t.contiguous() for k, t in extras.items()})
        save_file(stored, Path(path) / "model.safetensors", metadata={"format": "pt"})
    return Path(path)
