"""The streaming check of an export-hf output dir (verify_export): one tensor, or one decoder block in fp32, at a
time, so it never holds the model.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .distributed import is_main
from .errors import FinetuneError
from .export import ST_DTYPES, Source, mine, open_tensors, out_dtype_of, to_disk
from .weights import disk_to_memory, open_dir, read_tensor, streamed_logits
from .model import ModelError, build_skeleton


class VerifyError(FinetuneError):
    """The exported model does not reproduce the checkpoint (a failure: exit 1); the message is one line."""

    exit_code = 1


@torch.no_grad()
def verify_export(out: Path, source: Source, hf_config, plan: dict, disk: dict, dtype: torch.dtype,
                  shards: dict) -> float:
    """Check `out` without ever holding the model: the files and index hold exactly the planned tensors, each equal
    to the checkpoint's (rounded to dtype) bit for bit, read one at a time; then logits of the exported config's
    model, its weights streamed block by block from the exported files under the names from_pretrained gives them,
    must equal those of the source config's model on the same tensors, and config.json must read back as the
    config. (Tensors transformers converts on load, e.g. fused MoE experts, are checked piece by piece on disk and
    enter the logits from the checkpoint.) Returns the max abs logit difference."""
    from transformers import AutoConfig
    try:
        entries = open_dir(out) or {}  # strict: the index names existing files that hold what it lists
    except ModelError as e:
        raise VerifyError(f"export check: {e}") from e
    for filename, names in shards.items():
        held = {n: e.dtype for n, e in entries.items() if e.file.name == filename}
        if held != {n: ST_DTYPES[out_dtype_of(plan[disk[n][0]], dtype)] for n in names}:
            raise VerifyError(f"export check: {filename} does not hold the planned tensors and dtypes")
    if set(entries) != set(disk):
        raise VerifyError(f"export check: the exported files hold {len(entries)} tensors, {len(disk)} were planned")
    skeleton = build_skeleton(hf_config, None, source.trust_remote_code)
    _, load = open_tensors(source, hf_config)
    pieces_of: dict[str, list[str]] = {}
    for d, (k, _) in disk.items():
        pieces_of.setdefault(k, []).append(d)
    for k, pieces in pieces_of.items():
        if not mine(entries[pieces[0]].file.name, shards):
            if source.live:
                load(k)  # take part in the owner's gather
            continue
        want = load(k).to(out_dtype_of(plan[k], dtype))
        want = to_disk(skeleton, {k: want}) if pieces != [k] else {k: want}
        for d in pieces:
            got = read_tensor(entries[d])
            if got.dtype != want[d].dtype or not torch.equal(got, want[d]):
                raise VerifyError(f"export check: {d} in {entries[d].file.name} differs from the checkpoint's tensor")
        del want
    if not is_main():  # the other ranks checked their own files; rank 0 does the rest
        return 0.0
    exported = AutoConfig.from_pretrained(out, trust_remote_code=source.trust_remote_code)
    to_memory = disk_to_memory(build_skeleton(exported, None, source.trust_remote_code), entries)
    stored = {k: entries[d] for d, k in to_memory.items() if k is not None}
    converted = {disk[d][0] for d, k in to_memory.items() if k is None}

    def fetch(name: str) -> torch.Tensor:
        if name in stored:
            return read_tensor(stored[name])
        if name in converted:
            return load(name).to(out_dtype_of(plan[name], dtype))
        raise VerifyError(f"export check: the exported files hold no {name}: from_pretrained would initialise it "
                          f"itself")
    vocab_size = skeleton.get_input_embeddings().weight.shape[0]
    input_ids = torch.randint(vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    ref_logits = streamed_logits(hf_config, fetch, input_ids, source.trust_remote_code)
    logits = streamed_logits(exported, fetch, input_ids, source.trust_remote_code)
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
