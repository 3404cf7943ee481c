"""What a resumed run does (train.train imports it then): the checkpoint loaded into the built run, its kind, model
and parameters checked first; and the one line it prints about the config keys changed since."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

from ..checkpoint import CheckpointError, TrainState, check_arch, read_marker, train_state_dict
from ..config import PATH_KEYS, Config
from ..keys import flatten
from ..optim import reapply_settings, settings



def check_compatible(path: Path, run: dict | None, want: set[str], hf_config) -> None:
    """Same architecture, LoRA settings (`run`) and parameter names (`want`) as the checkpoint, or a CheckpointError."""
    saved = read_marker(path).get("lora")
    if saved and run:  # `run`: adapters/lora.LoraSettings, which check a LoRA checkpoint's settings and base
        run.check(path, saved, hf_config)
    elif saved or run:
        kinds = [f"LoRA (lora.rank={s['rank']})" if s else "full fine-tuning (lora.rank=0)" for s in (saved, run)]
        raise CheckpointError(f"checkpoint {path} is from {kinds[0]}, this run is {kinds[1]}: resume a run of the "
                              f"same kind, or start a new one (--no-resume / another --output-dir)")
    check_arch(path, hf_config)
    saved = {k[len("model."):] for k in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
             if k.startswith("model.")}
    if saved != want:
        missing, extra = sorted(want - saved), sorted(saved - want)
        raise CheckpointError(f"checkpoint {path} has other parameters than the model: {len(missing)} missing "
                              f"(e.g. {missing[:2]}), {len(extra)} unexpected (e.g. {extra[:2]})")


def load_checkpoint(path: Path, model, optimizer, scheduler, state: TrainState, hf_config, lora: dict | None) -> None:
    sd = train_state_dict(model, optimizer, scheduler, state)
    check_compatible(path, lora, set(sd["model"]), hf_config)
    run_settings = settings(optimizer)  # the checkpoint gives the state; the run's config, its settings
    # so the groups are this run's too: their number follows the meshes (expert parallel adds the experts' own)
    groups = sd["optim"].pop("param_groups")
    dcp.load(sd, checkpoint_id=str(path))
    sd["optim"]["param_groups"] = groups
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"],  # frozen keys absent
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))
    scheduler.load_state_dict(sd["scheduler"])
    reapply_settings(optimizer, scheduler, run_settings)


# On resume a changed key takes effect from the resumed step (the optimizer settings and the schedule too:
# optim.reapply_settings), except: a changed DATA_KEY moves what the checkpoint's data position (samples seen) points
# at, which is announced; lora.* and the architecture are refused (check_compatible); and where the run
# starts from is not compared.
DATA_KEYS = ("model.path", "data.path", "data.split", "data.name", "data.format", "data.streaming",
             "data.max_seq_len", "data.packing", "train.seed")  # (and data.sources, data.chat_template_kwargs.*:
# resume_note names what changed in them)
NOT_COMPARED = ("output_dir", "model.arch", "checkpoint.resume", "checkpoint.resume_from")


def resume_note(saved: dict, cfg: Config, samples_seen: int) -> str | None:
    """The line a resumed run prints about the keys whose value differs from `saved` (its marker's config), or None."""
    def value(key, v):  # the same local path, however written
        return str(Path(v).resolve()) if key in PATH_KEYS and v and Path(v).exists() else v

    def listed(keys):
        return ", ".join(f"{k.rstrip('_')} {before[k]!r} -> {now[k]!r}" for k in keys)
    before, now = flatten(saved), flatten(dataclasses.asdict(cfg))
    kwargs = "data.chat_template_kwargs."  # a table: an entry added or removed is a change too
    changed = [k for k in now if k in before and k not in NOT_COMPARED and not k.startswith(("lora.", kwargs))
               and k != "data.sources" and value(k, before[k]) != value(k, now[k])]
    notes = []
    if effect := [k for k in changed if k not in DATA_KEYS]:
        notes.append(f"{listed(effect)} (in effect from here)")
    if data := [k for k in changed if k in DATA_KEYS]:
        notes.append(f"{listed(data)} (the data position, {samples_seen} samples, was counted under the checkpoint's "
                     f"values: what comes next is not what its run would have read)")
    if "data.max_seq_len" in before:  # a marker of this config's shape (not an older finetune's without these keys)
        def shown(values, k):
            return repr(values[k]) if k in values else "unset"
        entries = sorted({k for k in (*before, *now) if k.startswith(kwargs)})
        if moved := [k for k in entries if shown(before, k) != shown(now, k)]:
            notes.append(", ".join(f"{k} {shown(before, k)} -> {shown(now, k)}" for k in moved)
                         + f" (a change of the data: the chat template renders other text to train from here, and the "
                         f"data position, {samples_seen} samples, was counted under the checkpoint's values)")
        if sources := changed_sources(before.get("data.sources") or [], now["data.sources"], value):
            notes.append(f"{sources} (a change of the mixture: the data position, {samples_seen} samples, now "
                         f"indexes the new mixture's order: the run skips its first {samples_seen} samples, not the "
                         f"ones the checkpoint's run trained on; some of those come again, others are never read)")
    return "note: changed since the checkpoint: " + "; ".join(notes) if notes else None


def changed_sources(before: list[dict], now: list[dict], value) -> str:
    """"data.sources[1] (b.jsonl): weight 1.0 -> 3.0, ..." for each source of the mixture that differs ("" if none);
    `value(key, v)` normalises paths."""
    def path(src):
        return src.get("path", "")
    out = []
    for j in range(max(len(before), len(now))):
        b, n = (before[j] if j < len(before) else None), (now[j] if j < len(now) else None)
        if b is None or n is None:
            out.append(f"data.sources[{j}] {path(b or n)} {'added' if b is None else 'removed'}")
            continue
        diffs = [f"{k} {b.get(k)!r} -> {v!r}" for k, v in n.items()
                 if value("data.path" if k == "path" else k, b.get(k)) != value("data.path" if k == "path" else k, v)]
        if diffs:
            out.append(f"data.sources[{j}] ({path(b)}): {', '.join(diffs)}")
    return "; ".join(out)
