"""What an export reads and writes: the checkpoint it reads (`find_source`, `open_dcp`: its tensors one at a time),
its `Plan`, and the files of a Hugging Face model dir (safetensors written tensor by tensor, config, generation config
and tokenizer as save_pretrained writes them)."""
from __future__ import annotations

import json
import math
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..checkpoint import MARKER, CheckpointError, check_intact, latest_complete, read_marker, step_dirs
from ..errors import ModelError, one_line
from ..model import load_tokenizer
from ..weights import MANIFEST, SAFETENSORS_CODES, is_prepared


@dataclass(frozen=True)
class Source:
    """Where an export reads from: DCP weights ({"model": <HF-named tensors>}), the HF config/tokenizer source."""
    weights: Path
    model_path: str
    trust_remote_code: bool
    label: str
    lora: dict | None = None  # a LoRA checkpoint's settings: weights hold the adapters, model_path the base
    chat_template: str | dict = ""  # the data.chat_template the run trained with (its marker's), for the tokenizer
    chat_template_kwargs: dict | None = None  # the run's data.chat_template_kwargs: the exported template's defaults


def find_source(path: str) -> Source:
    """The newest intact checkpoint of a training output dir, a step-N dir (checked intact), or a prepared dir."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"no checkpoint at {p}: not a directory")
    if is_prepared(p):
        if not (p / "weights" / ".metadata").is_file():
            raise CheckpointError(f"prepared checkpoint {p} has no weights/.metadata (incomplete copy?)")
        manifest = json.loads((p / MANIFEST).read_text())
        return Source(p / "weights", str(p), bool(manifest.get("trust_remote_code", False)), f"prepared {p}")
    if (p / ".metadata").exists() or (p / MARKER).exists() or p.name.startswith("step-"):
        check_intact(p)
        step = p
    elif (p / "checkpoints").is_dir():
        step = latest_complete(p / "checkpoints")  # says which newer step dirs it passes over
        if step is None:
            found = ", ".join(d.name for d in step_dirs(p / "checkpoints")) or "none"
            raise CheckpointError(f"no complete checkpoint under {p / 'checkpoints'} that is intact (step dirs: "
                                  f"{found})")
    else:
        raise CheckpointError(f"no checkpoint at {p}: expected a training output dir (with checkpoints/), a step-N "
                              f"dir or a prepared checkpoint (with {MANIFEST})")
    # the model (config, tokenizer) this checkpoint trained: its marker says, whatever config.toml says now
    marker = read_marker(step)
    model = marker.get("config", {}).get("model", {})
    if not model.get("path"):
        raise CheckpointError(f"{step / 'finetune_complete.json'} does not name the model it trained (saved by an "
                              f"older finetune)")
    return Source(step, model["path"], bool(model.get("trust_remote_code")), str(step), marker.get("lora"),
                  chat_template=marker.get("chat_template") or "",
                  chat_template_kwargs=marker.get("config", {}).get("data", {}).get("chat_template_kwargs"))


def open_dcp(weights: Path) -> tuple[dict, Callable[[str], torch.Tensor]]:
    """The model tensors of a DCP dir (state dict {"model": ...}), each full and in its saved dtype."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    reader = dcp.FileSystemReader(str(weights))
    metadata = reader.read_metadata()
    # dcp.load re-reads .metadata on every call: loading tensor by tensor would be quadratic in the number of tensors
    reader.read_metadata = lambda *args, **kwargs: metadata
    stored = {k[len("model."):]: v for k, v in metadata.state_dict_metadata.items()
              if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}

    def load(name: str) -> torch.Tensor:
        t = torch.empty(stored[name].size, dtype=stored[name].properties.dtype)
        with warnings.catch_warnings():  # torch warns on every single-process load; that is exactly what we mean
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({f"model.{name}": t}, storage_reader=reader, no_dist=True)
        return t
    return stored, load


@dataclass(frozen=True)
class Plan:
    """What an export writes, and from where (planned by hf/passthrough from the source)."""
    kept: dict  # {in-memory name: checkpoint metadata} of what it writes from the checkpoint
    disk: dict  # {on-disk name: (in-memory name, shape)} of those, as save_pretrained names them
    dtypes: dict  # {on-disk name: the dtype it is written in}
    untouched: dict  # {stored name: weights.Entry}: the source's tensors the model class does not own, copied as stored
    source: dict  # {stored name: weights.Entry} of the source's files ({}: none at hand)
    where: str  # their dir
    dtype: torch.dtype | None  # --dtype; None: auto


def to_disk(skeleton: nn.Module, tensors: dict) -> dict:
    """{on-disk name: tensor} that save_pretrained writes for these in-memory {name: tensor}."""
    from transformers.core_model_loading import revert_weight_conversion
    return dict(revert_weight_conversion(skeleton, dict(tensors)))


def write_safetensors(path: Path, specs: dict, fetch) -> None:
    """A safetensors file of `specs` ({name: (shape, dtype)}) written tensor by tensor from fetch(name)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (shape, dtype) in specs.items():
        num_bytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_CODES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + num_bytes]}
        offset += num_bytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name, (shape, dtype) in specs.items():
            t = fetch(name).to(dtype).contiguous()
            assert tuple(t.shape) == tuple(shape) and t.dtype == dtype, (name, t.shape, t.dtype)
            f.write(t.reshape(-1).view(torch.uint8).numpy().data)
            del t


def load_generation_config(model_path: str, hf_config):
    """The source's generation_config.json, else one derived from `hf_config`; one there but invalid is an error."""
    from transformers import GenerationConfig
    try:
        return GenerationConfig.from_pretrained(model_path)
    except Exception as e:  # noqa: BLE001 - OSError (missing file, bad JSON), ValueError (bad values), ...
        there = (Path(model_path) / "generation_config.json").exists() if Path(model_path).is_dir() else \
            not isinstance(e, OSError)  # a hub id: a missing file is an OSError (so is one that cannot be fetched)
        if there:
            raise ModelError(f"cannot load the generation config of '{model_path}': {one_line(e)}") from e
    return GenerationConfig.from_model_config(hf_config)


def save_hf_files(out: Path, model_path: str, hf_config, trust_remote_code: bool, chat_template: str | dict = "",
                  template_kwargs: dict | None = None, with_defaults=None):
    """config.json, generation_config.json and the tokenizer files of `model_path`, with `chat_template` if given
    (and `template_kwargs` as its defaults, by `with_defaults`: hf/template_defaults), as save_pretrained would."""
    hf_config.save_pretrained(out)
    load_generation_config(model_path, hf_config).save_pretrained(out)
    tok = load_tokenizer(model_path, trust_remote_code, pad=False, chat_template=chat_template)
    if template_kwargs and with_defaults and tok.chat_template:  # it renders as trained when a request passes none
        tok.chat_template = with_defaults(tok.chat_template, template_kwargs)
    tok.save_pretrained(out)
    # transformers 5 also writes where *this* process loaded the tokenizer from (is_local, local_files_only) into
    # tokenizer_config.json; that describes our load, not the tokenizer, so it is dropped
    tok_config = out / "tokenizer_config.json"
    if tok_config.is_file():
        entries = json.loads(tok_config.read_text())
        if [entries.pop(k) for k in ("is_local", "local_files_only") if k in entries]:
            tok_config.write_text(json.dumps(entries, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
