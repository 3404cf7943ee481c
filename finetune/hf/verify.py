"""The checks of an export-hf output dir, handed what the export wrote from (meta skeleton, planned tensors, name ->
source tensor): one tensor, or one decoder block in fp32, at a time, never the model; an adapter dir: loaded by peft.
"""
from __future__ import annotations

import math
import warnings
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..distributed import is_main, is_my_file, print0
from ..errors import FinetuneError, ModelError
from ..metrics import peak_rss_mb
from ..model import build_skeleton, find_layers
from ..weights import (SAFETENSORS_CODES, STORED_DTYPES, Entry, disk_to_memory, open_dir, persistent_buffers,
                       read_tensor)
from .files import Plan, open_dcp, to_disk
from ..hub import local_dir


class VerifyError(FinetuneError):
    """The exported model does not reproduce the checkpoint (a failure: exit 1); the message is one line."""

    exit_code = 1


def open_safetensors(path: str, what: str = "model") -> tuple[dict, Callable[[str], torch.Tensor]]:
    """An HF model's safetensors files (a dir, or a hub id in the cache), by stored name; `what` names it in errors."""
    from torch.distributed.checkpoint.metadata import TensorProperties, TensorStorageMetadata
    entries = open_dir(local_dir(path))
    if not entries:
        raise ModelError(f"the {what} '{path}' has no safetensors weights")
    metas = {k: TensorStorageMetadata(TensorProperties(dtype=STORED_DTYPES[e.dtype]), torch.Size(e.shape), [])
             for k, e in entries.items()}
    return metas, lambda name: read_tensor(entries[name])


def verify_export(out: Path, skeleton: nn.Module, load: Callable[[str], torch.Tensor], hf_config, plan: Plan,
                  shards: dict, *, live: bool = False, trust_remote_code: bool = False,
                  source: str | None = None) -> float:
    """`out` holds, bit for bit, what `plan`/`shards` planned from `load` (a collective if `live`) and the source's
    files, and config.json from hf_config, and reads back as the same model; says so and returns the max abs logit
    diff (0.0 off rank 0). `source`: the starting model, which the tensors a run never trains (untrained_keys) must
    match."""
    entries = check_files(out, skeleton, load, plan, shards, live)
    if not is_main():  # the other ranks checked their own files; rank 0 does the rest
        return 0.0
    check_source(entries, plan)
    if source:
        check_untrained(entries, skeleton, plan.disk, source, untrained_keys(skeleton))
    diff = check_logits(out, skeleton, load, hf_config, plan, entries, trust_remote_code)
    untouched = f", {len(plan.untouched)} copied through equal the source's" if plan.untouched else ""
    print0(f"verified: {len(plan.kept)} tensors equal the checkpoint's{untouched}; logits streamed from the files "
           f"(fp32) max abs diff {diff:.3g}; peak RSS {peak_rss_mb():.0f} MB")
    return diff


@torch.no_grad()
def check_files(out: Path, skeleton: nn.Module, load, plan: Plan, shards: dict, live: bool) -> dict[str, Entry]:
    """The files and index hold exactly the planned tensors and dtypes, and those of this rank's files equal the
    checkpoint's rounded to their dtype (converted ones piece by piece); returns {stored name: Entry} of the
    export."""
    disk, dtypes = plan.disk, {**plan.dtypes, **{d: STORED_DTYPES[e.dtype] for d, e in plan.untouched.items()}}
    try:
        entries = open_dir(out) or {}  # strict: the index names existing files that hold what it lists
    except ModelError as e:
        raise VerifyError(f"export check: {e}") from e
    for filename, names in shards.items():
        held = {n: e.dtype for n, e in entries.items() if e.file.name == filename}
        planned = {n: SAFETENSORS_CODES[dtypes[n]] for n in names}
        if held != planned:
            wrong = next(n for n in {**held, **planned} if held.get(n) != planned.get(n))
            raise VerifyError(f"export check: {filename} holds {wrong} as {held.get(wrong, 'nothing')}, the plan was "
                              f"{planned.get(wrong, 'none')}")
    if set(entries) != set(dtypes):
        unplanned, missing = sorted(set(entries) - set(dtypes)), sorted(set(dtypes) - set(entries))
        raise VerifyError(f"export check: the exported files hold {len(entries)} tensors, {len(dtypes)} were planned "
                          f"(not planned: {unplanned[:2]}, missing: {missing[:2]})")
    pieces_of: dict[str, list[str]] = {}
    for d, (k, _) in disk.items():
        pieces_of.setdefault(k, []).append(d)
    for k, pieces in pieces_of.items():
        if not is_my_file(entries[pieces[0]].file.name, shards):
            if live:
                load(k)  # take part in the owner's gather
            continue
        want = load(k)
        want = to_disk(skeleton, {k: want}) if pieces != [k] else {k: want}
        for d in pieces:
            got, want[d] = read_tensor(entries[d]), want[d].to(dtypes[d])
            if got.dtype != want[d].dtype or not torch.equal(got, want[d]):
                raise VerifyError(f"export check: {d} in {entries[d].file.name} differs from the checkpoint's tensor")
        del want
    return entries


def read_bytes(entry: Entry) -> bytes:
    """The stored bytes of a tensor, as they are in its file."""
    with open(entry.file, "rb", buffering=0) as f:
        f.seek(entry.start)
        return f.read(math.prod(entry.shape) * STORED_DTYPES[entry.dtype].itemsize)


def check_source(entries: dict[str, Entry], plan: Plan) -> None:
    """What the export copied through is the source's, byte for byte; with --dtype auto each tensor is in the dtype
    the source stores it in, or fp32 (where transformers keeps it so)."""
    for d, src in plan.untouched.items():
        got = entries[d]
        if (got.dtype, got.shape) != (src.dtype, src.shape) or read_bytes(got) != read_bytes(src):
            raise VerifyError(f"export check: {d} in {got.file.name} is not the source's ({src.file}), which it "
                              f"copies through untouched")
    for d in plan.disk if plan.dtype is None else []:
        if d in plan.source and entries[d].dtype not in (plan.source[d].dtype, "F32"):
            raise VerifyError(f"export check: {d} is {entries[d].dtype} in the export, {plan.source[d].dtype} in the "
                              f"source model ({plan.where})")


def untrained_keys(skeleton: nn.Module) -> list[str]:
    """The tensors a run never trains: persistent buffers (a router's bias). A LoRA export reads its base as is."""
    return [n for n, _ in persistent_buffers(skeleton)]


@torch.no_grad()
def check_untrained(entries: dict[str, Entry], skeleton: nn.Module, disk: dict, model_path: str,
                    untrained: list[str]) -> None:
    """Each tensor the run never trained is exported as the source model holds it (rounded to the export dtype): a
    load that dropped one (a routing bias left at its initial zeros) would also be in the checkpoint, so comparing
    with the checkpoint alone cannot see it."""
    from ..weights import is_prepared
    if not untrained:  # nothing to compare: the source is not opened
        return
    if is_prepared(model_path):
        metas, load_source = open_dcp(Path(model_path) / "weights")
        by_key = {k: k for k in metas}
    else:
        metas, load_source = open_safetensors(model_path, "source model")
        by_key = {k: d for d, k in disk_to_memory(skeleton, metas).items() if k is not None}
    from collections import Counter
    count = Counter(k for k, _ in disk.values())  # a tensor exported in pieces (fused experts) is converted: skipped
    pieces = {k: d for d, (k, _) in disk.items() if count[k] == 1}
    for key in untrained:
        name = pieces.get(key)
        if key not in by_key or name not in entries:  # converted on disk, or computed on load
            continue
        got = read_tensor(entries[name])
        if not torch.equal(got, load_source(by_key[key]).to(got.dtype)):
            raise VerifyError(f"export check: {name} differs from the source model's ('{model_path}'): the run never "
                              f"trains it, so it was not loaded from there")


@torch.no_grad()
def check_logits(out: Path, skeleton: nn.Module, load, hf_config, plan: Plan, entries: dict[str, Entry],
                 trust_remote_code: bool) -> float:
    """The model config.json describes, its weights streamed from the files under the names from_pretrained gives
    them, has the logits of `skeleton`'s model on the same tensors; and config.json reads back as hf_config."""
    from transformers import AutoConfig
    exported = AutoConfig.from_pretrained(out, trust_remote_code=trust_remote_code)
    reloaded = build_skeleton(exported, None, trust_remote_code)
    to_memory = disk_to_memory(reloaded, entries)
    stored = {k: entries[d] for d, k in to_memory.items() if k is not None}
    # these enter from the checkpoint, in the dtype their pieces are written in
    converted = {plan.disk[d][0]: plan.dtypes[d] for d, k in to_memory.items() if k is None and d in plan.disk}

    def fetch(name: str) -> torch.Tensor:
        if name in stored:
            return read_tensor(stored[name])
        if name in converted:
            return load(name).to(converted[name])
        expected = reloaded.state_dict()
        found = next((f"{d} -> {k}" for d, k in to_memory.items() if k is not None and k not in expected
                      and d not in plan.untouched), "none")
        raise VerifyError(f"export check: from_pretrained would find no {name} in the exported files and initialise "
                          f"it itself (a stored tensor it reads as a name the model lacks: {found})")
    vocab_size = skeleton.get_input_embeddings().weight.shape[0]
    input_ids = torch.randint(vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    ref_logits = streamed_logits(skeleton, fetch, input_ids)
    logits = streamed_logits(reloaded, fetch, input_ids)
    diff = (logits - ref_logits).abs().max().item()
    tol = 1e-4 * max(1.0, ref_logits.abs().max().item())
    if not diff <= tol:
        raise VerifyError(f"export check failed: the exported model's logits differ from the checkpoint's by "
                          f"{diff:.3g} (tolerance {tol:.3g})")
    want, got = hf_config.to_dict(), exported.to_dict()
    wrong = sorted(k for k in want.keys() | got.keys()
                   if k != "transformers_version" and not k.startswith("_") and want.get(k) != got.get(k))
    if wrong:
        raise VerifyError(f"export check: config.json reads back with {wrong[0]}={got.get(wrong[0])!r}, the "
                          f"checkpoint's config has {want.get(wrong[0])!r}")
    return diff


@torch.no_grad()
def streamed_logits(model: nn.Module, fetch, input_ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the meta `model` (left as it was) on `input_ids`, each decoder block's (or other module's)
    weights fetched by fetch(in-memory name) just before it runs and dropped right after."""
    canonical = {id(p): name for name, p in model.named_parameters()}  # a tied weight: the name it is stored by
    layers = set(find_layers(model))
    inside = {id(m) for layer in layers for m in layer.modules()}
    units = [m for m in model.modules() if m in layers or (id(m) not in inside and m._parameters)]

    def load(params, module, args):
        for m, a, p in params:
            m._parameters[a] = nn.Parameter(fetch(canonical[id(p)]).float(), requires_grad=False)

    # Between its unit's runs a weight is one NaN on CPU, broadcast to its shape, not a meta tensor: a model may
    # consult a weight outside its module (Llama 4 moves input_ids to embed_tokens.weight.device before calling it),
    # and meta indices make F.embedding return uninitialised memory (NaN or a different gap in each run); a value
    # read outside its module makes the logits NaN, so the check fails instead of passing by chance
    def drop(params, module=None, args=None, output=None):
        for m, a, p in params:
            m._parameters[a] = nn.Parameter(torch.full((1,) * p.dim(), math.nan).expand(p.shape), requires_grad=False)

    handles, restore, was_training = [], [], model.training
    for unit in units:  # (module, attribute, meta parameter) for each parameter the unit runs with
        params = [(m, a, p) for m in (unit.modules() if unit in layers else [unit])
                  for a, p in m._parameters.items() if p is not None]
        handles += [unit.register_forward_pre_hook(partial(load, params)),
                    unit.register_forward_hook(partial(drop, params))]
        drop(params)
        restore += params
    try:
        return model.eval()(input_ids=input_ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
        for m, a, p in restore:
            m._parameters[a] = p
        model.train(was_training)


def check_adapter(out: Path, tensors: dict, hf_config, dtype: torch.dtype, trust_remote_code: bool) -> None:
    """peft loads exactly the adapter tensors of `out` on a base from the config, the checkpoint's rounded to dtype."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code)
    with warnings.catch_warnings():  # transformers' deprecation notes from inside peft
        warnings.simplefilter("ignore", FutureWarning)
        state = PeftModel.from_pretrained(base, str(out)).state_dict()
    lora_keys = {k for k in state if ".lora_" in k or ".modules_to_save." in k}
    if lora_keys != {"base_model.model." + k for k in tensors}:
        raise VerifyError(f"adapter check: peft loads {len(lora_keys)} adapter tensors, the checkpoint has "
                          f"{len(tensors)}")
    for k, t in tensors.items():
        if not torch.equal(state["base_model.model." + k], t.to(dtype).to(state["base_model.model." + k].dtype)):
            raise VerifyError(f"adapter check: peft's {k} differs from the checkpoint's")
