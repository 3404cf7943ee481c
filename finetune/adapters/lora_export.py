"""Exporting a LoRA checkpoint (export.export_hf imports this for one): merged onto its base (W + alpha/r * B @ A in
fp32), or written as a PEFT adapter dir; tied embeddings that LoRA trained apart are exported untied."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from ..checkpoint import read_marker
from ..hf.files import Source, find_source, open_dcp
from ..config import ConfigError
from ..distributed import print0, world_size
from ..errors import ModelError
from ..weights import is_adapter, is_prepared
from ..model import build_skeleton
from ..weights import arch_diffs, disk_to_memory
from ..hf.fingerprint import base_fingerprint
from .lora import check_base as check_trained_base, merge_lora_tensor, peft_config, peft_key
from ..hf.verify import open_safetensors


CONVERTED = "stores tensors in a layout that transformers converts on load (e.g. {})"


def converted_names(skeleton, names) -> list[str]:
    """The stored `names` that transformers converts on load, not renames (MoE experts stored one by one, fused in
    memory): the merge reads the base tensor by tensor, as the model holds them, and cannot read these yet."""
    return sorted(name for name, key in disk_to_memory(skeleton, names).items() if key is None)


def embedding_names(skeleton) -> tuple[str, str | None]:
    """The parameter names of the input embedding's weight and the output layer's (None: the model has none)."""
    names = {id(m): f"{n}.weight" for n, m in skeleton.named_modules()}
    return names[id(skeleton.get_input_embeddings())], names.get(id(skeleton.get_output_embeddings()))


def check_base(source: Source, hf_config, adapter: bool) -> None:
    """The base a LoRA checkpoint is merged onto is the one it trained on; `adapter` (--adapter) runs in one process."""
    diffs = arch_diffs(read_marker(source.weights).get("arch", {}), hf_config, "checkpoint", "base model")
    if diffs:
        raise ModelError(f"the LoRA base model '{source.model_path}' is not the one {source.label} trained: "
                         f"{'; '.join(diffs)}")
    check_trained_base(source.weights, source.lora, base_fingerprint(source.model_path), source.model_path)
    if adapter and world_size() > 1:
        raise ConfigError("--adapter writes one small file: use one process (no --nproc-per-node)")


def trained_apart(skeleton, adapters: dict) -> list[str]:
    """The tied embeddings that LoRA changed apart from their twin (modules_to_save, or an adapter on one)."""
    head = skeleton.get_output_embeddings()
    if head is None or head.weight is not skeleton.get_input_embeddings().weight:
        return []
    return [n for n in embedding_names(skeleton) if f"{n[:-len('.weight')]}.modules_to_save.default.weight" in adapters
            or f"{n[:-len('.weight')]}.lora_A.default.weight" in adapters]


def open_merged(source: Source, hf_config, adapters: dict, load_adapter) -> tuple[object, dict, Callable]:
    """(the meta skeleton, {HF name: metadata}, name -> tensor) of the merged model (W + alpha/r * B @ A in fp32 over
    the base weights of a prepared or HF dir); tied embeddings that LoRA trained apart untied (in hf_config too)."""
    from .expert_lora import transposed_params
    skeleton = build_skeleton(hf_config, None, source.trust_remote_code)
    if apart := trained_apart(skeleton, adapters):  # exported untied: the model is then another one
        hf_config.tie_word_embeddings = False
        print0(f"note: LoRA trained {', '.join(apart)} apart from its tied twin: the export unties them "
               f"(tie_word_embeddings=false)")
        skeleton = build_skeleton(hf_config, None, source.trust_remote_code)
    if is_prepared(source.model_path):
        metas, load_base = open_dcp(find_source(source.model_path).weights)
    else:
        metas, load_base = open_safetensors(source.model_path, "LoRA base model")
        if converted := converted_names(skeleton, metas):
            raise ModelError(f"the LoRA base model '{source.model_path}' {CONVERTED.format(converted[0])}, which a "
                             f"merged export cannot read yet: export the adapter with --adapter (a PEFT dir that "
                             f"peft loads over the base)")
    on_disk = set(metas)
    embedding, head = embedding_names(skeleton)
    if head and head not in on_disk:  # a tied base stores its embedding once; an untied export's head starts there
        metas[head] = metas[embedding]
    scale = source.lora["alpha"] / source.lora["rank"]
    # QLoRA: the adapters trained on a 4-bit copy of the base; the export keeps the base as stored
    if (quantized := read_marker(source.weights).get("config", {}).get("lora", {}).get("quantize_base")) == "nf4":
        print0(f"merged into the original base weights of {source.model_path} as stored (the adapters trained on "
               f"them held as {quantized}; the export is not quantized)")

    transposed = transposed_params(skeleton)

    def load(name: str) -> torch.Tensor:
        return merge_lora_tensor(name, load_base(name if name in on_disk else embedding),
                                 lambda k: load_adapter(k) if k in adapters else None, scale, name in transposed)
    return skeleton, metas, load


def save_adapter(out: Path, source: Source, adapters: dict, load, hf_config, dtype: torch.dtype, verify: bool) -> dict:
    """A LoRA checkpoint's PEFT adapter dir as save_pretrained lays it out, checked by peft; returns the marker's."""
    from safetensors.torch import save_file
    from ..hf.verify import check_adapter
    from .expert_lora import peft_tensor
    # LoRA on the experts: peft's layout of its factors (peft's target_parameters); the base's persistent buffers
    # that the checkpoint holds too (DeepSeek-V3's routing biases) are not the adapter's
    tensors = dict(peft_tensor(k, load(k), source.lora.get("target_parameters", [])) for k in adapters
                   if is_adapter(k) or ".modules_to_save." in k)
    peft_config(source.lora, task_type="CAUSAL_LM", base_model_name_or_path=source.model_path).save_pretrained(str(out))
    save_file({peft_key(k): t.to(dtype).contiguous() for k, t in tensors.items()},
              str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    if verify:
        check_adapter(out, tensors, hf_config, dtype, source.trust_remote_code)
    print0(f"exported the LoRA adapter of {source.label}: {len(tensors)} tensors "
           f"({sum(t.numel() for t in tensors.values()) / 1e6:.3f}M params){', verified with peft' if verify else ''}")
    return {"source": str(source.weights.resolve()), "base_model": source.model_path, "adapter": True,
            "dtype": str(dtype).split(".")[1], "lora": source.lora}


