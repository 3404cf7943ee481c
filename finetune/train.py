"""The training loop: one explicit loop from the first batch to the last checkpoint, readable top to bottom."""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from . import build
from . import checkpoint as ckpt
from .config import Config, to_toml
from .data import IGNORE_INDEX, describe_counts
from .data.chat_template import run_tokenizer
from .distributed import all_reduce, init_distributed, is_main, print0, world_size
from .errors import FinetuneError
from .loss import collate_labelled
from .metrics import MetricsLogger, peak_mem_mb
from .model import Transform, build_model, compute_device
from .optim import build_optimizer, build_scheduler, by_mesh, clip_grad_norm
from .run.checks import validate
from .run import locks
from .run.report import Report
from .run.saving import Checkpointer
from .task import Run, Task, build_run_samples


class NonFiniteError(FinetuneError):
    """Loss or grad norm became NaN/inf with train.nan_policy = "stop": the run failed (exit 1)."""

    exit_code = 1


def next_micro_batches(samples, micro_batch_size: int, grad_accum_steps: int, pad_id: int, pad_to: int | None,
                       collate=collate_labelled, ranks_per_row: int = 1):
    """This rank's micro-batches for one step and its share of their real tokens (1/ranks_per_row of a split row)."""
    batches, num_input_tokens = [], 0
    for _ in range(grad_accum_steps):
        items = [next(samples) for _ in range(micro_batch_size)]
        num_input_tokens += sum(len(x["input_ids"]) for x in items) / ranks_per_row
        batches.append(collate(items, pad_id, pad_to or max(len(x["input_ids"]) for x in items)))
    return batches, num_input_tokens


def train_step(model, optimizer, micro_batches: list[dict], *, num_input_tokens: int, max_grad_norm: float,
               skip_nonfinite: bool = False, stop: bool = False, task: Task | None = None) -> tuple[dict, bool]:
    """One optimizer step: forward/backward, ONE all_reduce of the step's sums, gradients / the global count, clip,
    step. Returns ({CORE_STATS and the task's: float64 0-dim device tensor, not read here}, whether skipped)."""
    task = task or Task()
    device = compute_device(model)  # with parallel.cpu_offload not its parameters' (host memory)
    task.begin_step(micro_batches, device)
    sums: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        model.set_requires_gradient_sync(last)
        model.set_is_last_backward(last)
        batch = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        loss, stats = task.loss(model, batch)
        loss.backward()
        for k, v in {"loss": loss.detach(), **stats}.items():
            sums[k] = sums[k] + v.double() if k in sums else v.double()
    # host-to-device copies with non_blocking: no wait for the GPU here (a blocking copy would be a sync)
    counts = {"num_tokens": sum(int((b["label_targets"] != IGNORE_INDEX).sum()) for b in micro_batches),
              "num_input_tokens": num_input_tokens, "stop": float(stop),
              "num_computed_tokens": sum(b["input_ids"].numel() for b in micro_batches)}
    keys = [*sums, *counts]
    host = torch.tensor(list(counts.values()), dtype=torch.float64).to(device, non_blocking=True)
    values = torch.cat([torch.stack(list(sums.values())), host])
    all_reduce(values)
    total = dict(zip(keys, values))
    count = total.get("count", total["num_tokens"]).clamp(min=1)
    for group in by_mesh(p for p in model.parameters() if p.grad is not None):  # one foreach per device mesh
        torch._foreach_mul_([p.grad for p in group], (1 / count).float().to(group[0].grad.device))
    grad_norm = clip_grad_norm(model, max_grad_norm)  # on the host with parallel.cpu_offload
    result = {"loss": total["loss"] / count, "grad_norm": grad_norm.double().to(device),
              **{k: total[k] for k in counts}, **{k: total[k] / count for k in task.means}, **task.end_step()}
    skipped = skip_nonfinite and not bool(torch.isfinite(torch.stack([result["loss"], result["grad_norm"]])).all())
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return result, skipped


def build_model_and_optimizer(cfg: Config, device: torch.device, dims, transforms: list[Transform]):
    """(the model with `transforms`, its AdamW, its adapters' settings) as configured."""
    m, tc = cfg.model, cfg.train
    model, lora = build_model(m.path, device, dims.mesh, transforms, mixed_precision=tc.mixed_precision,
                              ac_ratio=cfg.ac.ratio, compile=m.compile, packing=cfg.data.packing,
                              attn_implementation=m.attn_implementation, trust_remote_code=m.trust_remote_code,
                              cpu_offload=cfg.parallel.cpu_offload)
    return model, build_optimizer(model, tc.lr, tc.weight_decay, (tc.beta1, tc.beta2), tc.eps), lora


def train(cfg: Config, task: str = "sft") -> dict:
    """Run `task` ("sft", "dpo") as `cfg` says (build.py turns the config into the model's transforms and the
    loop's Task); returns the final metrics record and held-out results."""
    validate(cfg, task)
    device, dims = init_distributed(cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cp=cfg.parallel.cp,
                                    ep=cfg.parallel.ep)
    out, tc, dc = Path(cfg.output_dir), cfg.train, cfg.data
    accum = tc.grad_accum_steps
    if tc.tokens_per_step:
        from .run.tokens_per_step import run_accum
        accum = run_accum(cfg, dims.dp_size)
    torch.manual_seed(tc.seed)
    resume_dir = ckpt.find_resume(out, cfg.checkpoint.resume, cfg.checkpoint.resume_from)
    ckpt.check_run(out, resume_dir, cfg.checkpoint.resume_from, task)  # a run of this task (the CLI: and model)
    tokenizer, chat_template = run_tokenizer(cfg, resume_dir)
    model, optimizer, lora = build_model_and_optimizer(cfg, device, dims, build.transforms(cfg, dims, device))
    scheduler = build_scheduler(optimizer, warmup_steps=tc.warmup_steps, max_steps=tc.max_steps,
                                min_lr_ratio=tc.min_lr_ratio)
    state = ckpt.TrainState()
    if resume_dir is not None:
        from .run.resume import load_checkpoint, resume_note
        load_checkpoint(resume_dir, model, optimizer, scheduler, state, model.config, lora)
        print0(f"resumed from {resume_dir} at step {state.step} ({state.samples_seen} samples seen)")
        if line := resume_note(ckpt.read_marker(resume_dir).get("config", {}), cfg, state.samples_seen):
            print0(line)

    samples = build_run_samples(cfg, tokenizer, rank=dims.dp_rank, world_size=dims.dp_size,
                                start_sample=state.samples_seen, **build.samples(cfg, build.labellers(task)))
    sample_iter, pad_to = iter(samples), dc.max_seq_len if dc.pad_to_max else None
    global_batch = tc.micro_batch_size * accum * dims.dp_size
    report = Report(cfg, model, samples, dims, device, global_batch, state)
    # MFU: against the GPU's peak (none is known for a CPU)
    flops_tok, peak = None, None
    if device.type == "cuda":
        from .run.mfu import meter
        flops_tok, peak = meter(model, device)
    name, task = task, build.task(cfg, Run(model, optimizer, tokenizer, dims, device, out, resume_dir), task)
    before = task.evaluate_before() if task.evaluate_before and state.step == 0 else None
    pending, record = [], {}  # pending: (result, timing) of the steps not read on the host yet (flush_steps)
    with ckpt.SignalFlag() as signals:  # until train returns: a signal during the final export and eval waits too
        with open_outputs(cfg, out, state.step, chat_template, lora, name) as (logger, saver), report as show:
            while state.step < tc.max_steps:
                step = state.step + 1
                t0 = time.perf_counter()
                micro_batches, num_input_tokens = next_micro_batches(sample_iter, tc.micro_batch_size, accum,
                                                                     tokenizer.pad_token_id, pad_to, task.collate,
                                                                     dims.cp)
                result, skipped = train_step(model, optimizer, micro_batches, num_input_tokens=num_input_tokens,
                                             max_grad_norm=tc.max_grad_norm, skip_nonfinite=tc.nan_policy == "skip",
                                             stop=signals.name is not None, task=task)
                lr = scheduler.get_last_lr()[0]
                scheduler.step()
                state.step, state.samples_seen = step, state.samples_seen + global_batch
                if device.type == "cuda":  # the step's kernels are done: its time, not its launch time (as the
                    torch.cuda.synchronize(device)  # peers time theirs); costs the GPU the next step's host prep
                pending.append((result, {"step": step, "lr": lr, "step_time_s": time.perf_counter() - t0,
                                         "skipped": skipped, "flops_tok": peak and flops_tok(micro_batches)}))
                save = step == tc.max_steps or (cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0)
                if device.type != "cuda" or save or step % tc.log_interval == 0 or tc.nan_policy == "skip":
                    record, stop = flush_steps(pending, state, logger, show, tc, device, peak)
                    if save or stop:
                        path = saver.save(step, model, optimizer, scheduler, state, model.config)
                    if stop:
                        saver.wait()
                        print0(f"received {signals.name or 'a signal (on another rank)'}: saved checkpoint {path} at "
                               f"step {step}; exiting")
                        return record
            saver.wait()
            if samples.num_samples is None:
                print0(f"data (streamed so far): {describe_counts(samples.counts)}")
        # every rank gathers, writes and checks whole files (plan: the final checkpoint)
        if cfg.checkpoint.export_hf:
            from .export import export_hf
            export_hf(str(out), str(out / "hf"), live=model)
        if task.evaluate_after is not None:
            record["eval"] = task.evaluate_after(before)
    return record


@contextmanager
def open_outputs(cfg: Config, out: Path, start_step: int, chat_template: str | dict | None, lora: dict | None,
                 task: str):
    """Once the run is accepted (a refused run rewrites nothing): config.toml; (metrics logger, checkpointer)."""
    if is_main():
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(to_toml(cfg))
        ckpt.keep_earlier_run(out / "checkpoints", cfg.checkpoint.resume)
    if cfg.log.wandb:
        from .run.wandb import WandbLogger
        logger = WandbLogger(out, start_step=start_step, cfg=cfg)
    else:
        logger = MetricsLogger(out, start_step=start_step)
    run = asdict(cfg)
    if Path(cfg.model.path).exists():
        run["model"]["path"] = str(Path(cfg.model.path).resolve())
    saver = Checkpointer(out / "checkpoints", keep=cfg.checkpoint.keep, use_async=cfg.checkpoint.async_, lora=lora,
                         run={"config": run, "chat_template": chat_template, "task": task}, locks=locks)
    try:
        yield logger, saver
    finally:
        saver.close()
        logger.close()


CORE_STATS = ("loss", "grad_norm", "num_tokens", "num_input_tokens", "stop", "num_computed_tokens")


def flush_steps(pending: list, state: ckpt.TrainState, logger, show, tc, device,
                peak: float | None) -> tuple[dict, bool]:
    """Read the pending steps' results on the host (one read) and log each; (the last record, whether to stop)."""
    keys = list(pending[0][0])
    rows = torch.stack([torch.stack([r[k] for k in keys]) for r, _ in pending]).tolist()  # the one host read
    for row, (_, timing) in zip(rows, pending):
        values = dict(zip(keys, row))
        if timing["skipped"]:  # only under nan_policy "skip", which reads every step at once
            state.skipped_steps += 1
            print0(f"step {timing['step']}: non-finite loss/grad norm, update skipped ({state.skipped_steps} skipped "
                   f"so far)")
        loss, grad_norm = values["loss"], values["grad_norm"]
        if tc.nan_policy == "stop" and not (math.isfinite(loss) and math.isfinite(grad_norm)):
            raise NonFiniteError(f"non-finite {'loss' if not math.isfinite(loss) else 'grad norm'} at step "
                                 f"{timing['step']} (loss={loss}, grad_norm={grad_norm}); stopping "
                                 f"(train.nan_policy=\"stop\")")
        state.tokens_seen += int(values["num_tokens"])
        tokens_per_s = values["num_input_tokens"] / timing["step_time_s"]  # all real (non-pad) tokens, not only labels
        record = {"step": timing["step"], "loss": loss, "lr": timing["lr"], "grad_norm": grad_norm,
                  "num_tokens": int(values["num_tokens"]), "tokens_per_s": tokens_per_s,
                  "tokens_per_s_per_gpu": tokens_per_s / world_size(),
                  "padding_fraction": 1 - values["num_input_tokens"] / values["num_computed_tokens"],
                  "step_time_s": timing["step_time_s"], "peak_mem_mb": peak_mem_mb(device),
                  "tokens_seen": state.tokens_seen}
        if device.type == "cuda":
            record["peak_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20
        record.update((k, x) for k, x in values.items() if k not in CORE_STATS)  # a task's means (dpo's rewards)
        # run/mfu: "mfu" by MFU_CONVENTION, "mfu_ran" with lm_head at the label positions (MFU_RAN)
        if peak:
            record.update((k, tokens_per_s * f / (peak * world_size())) for k, f in timing["flops_tok"].items())
        logger.log(record)
        show(record)
    pending.clear()
    return record, values["stop"] > 0
