"""The training loop: one explicit loop from the first batch to the last checkpoint, readable top to bottom."""
from __future__ import annotations

import math
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule

from . import checkpoint as ckpt
from .config import Config, to_toml
from .data import build_samples, pad_collate
from .distributed import all_reduce_sum, init_distributed, is_main, print0, world_size
from .evaluate import evaluate
from .metrics import MetricsLogger, flops_per_token, peak_flops, peak_mem_mb
from .model import build_model, find_layers, load_tokenizer
from .optim import build_optimizer, build_scheduler


class NonFiniteError(RuntimeError):
    """Loss or grad norm became NaN/inf with train.nan_policy = "stop"."""


def shift_labels(labels: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """Targets for each position (label of the next token); no target across a packed-sample boundary."""
    shifted = torch.full_like(labels, -100)
    shifted[:, :-1] = labels[:, 1:]
    if position_ids is not None:
        shifted[:, :-1][position_ids[:, 1:] == 0] = -100
    return shifted


def next_micro_batches(samples, micro_batch_size: int, grad_accum_steps: int, pad_id: int, pad_to: int | None):
    """This rank's micro-batches for one optimizer step, with shifted targets; and their number of real tokens."""
    batches, num_input_tokens = [], 0
    for _ in range(grad_accum_steps):
        items = [next(samples) for _ in range(micro_batch_size)]
        num_input_tokens += sum(len(x["input_ids"]) for x in items)
        batch = pad_collate(items, pad_id=pad_id, pad_to=pad_to)
        batch["shift_labels"] = shift_labels(batch["labels"], batch.get("position_ids"))
        batches.append(batch)
    return batches, num_input_tokens


def train(cfg: Config) -> dict:
    """Run SFT as configured; returns the final metrics record (rank 0) and held-out results."""
    device, mesh = init_distributed()
    out = Path(cfg.output_dir)
    t, d = cfg.train, cfg.data
    if is_main():
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(to_toml(cfg))
    torch.manual_seed(t.seed)
    tokenizer = load_tokenizer(cfg.model.path)

    resume_dir = ckpt.find_resume(out, cfg.checkpoint.resume, cfg.checkpoint.resume_from)
    model = build_model(cfg.model.path, device, mesh, mixed_precision=t.mixed_precision, ac_ratio=cfg.ac.ratio,
                        ac_mode=cfg.ac.mode, compile=cfg.model.compile, liger=cfg.model.liger,
                        attn_implementation=cfg.model.attn_implementation,
                        trust_remote_code=cfg.model.trust_remote_code, lora=asdict(cfg.lora), seed=t.seed)
    for m in model.modules():  # our loss is already the global mean: FSDP must sum, not average, over ranks
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    optimizer = build_optimizer(model, t.lr, t.weight_decay, (t.beta1, t.beta2), t.eps)
    scheduler = build_scheduler(optimizer, warmup_steps=t.warmup_steps, max_steps=t.max_steps,
                                min_lr_ratio=t.min_lr_ratio)
    state = ckpt.TrainState()
    if resume_dir is not None:
        ckpt.load_checkpoint(resume_dir, model, optimizer, scheduler, state, hf_config=model.config)
        print0(f"resumed from {resume_dir} at step {state.step} ({state.samples_seen} samples seen)")

    samples = build_samples(d.path, tokenizer, fmt=d.format, split=d.split, name=d.name or None,
                            streaming=d.streaming, max_seq_len=d.max_seq_len, packing=d.packing, seed=t.seed,
                            rank=mesh.get_local_rank(), world_size=world_size(), start_sample=state.samples_seen)
    if samples.num_samples is not None:  # streaming counts fill in as rows go by; reported at the end
        print0(f"data: {describe_counts(samples.counts)}")
    sample_iter = iter(samples)
    pad_to = d.max_seq_len if d.pad_to_max else None
    global_batch = t.micro_batch_size * t.grad_accum_steps * world_size()
    if state.step and state.samples_seen != state.step * global_batch:  # allowed, but then not the same run
        print0(f"note: the global batch is now {global_batch} samples; the checkpoint's run used "
               f"{state.samples_seen / state.step:g} per step (micro_batch_size x grad_accum_steps x ranks)")

    num_params = sum(p.numel() for p in model.parameters())
    cfg_hf = model.config
    flops_tok = flops_per_token(num_params, len(find_layers(model)), cfg_hf.hidden_size, d.max_seq_len)
    peak = peak_flops(device)
    print0(f"model: {cfg.model.path} ({num_params / 1e6:.1f}M params) on {world_size()} x {device.type}, "
           f"{t.mixed_precision}, ac.ratio={cfg.ac.ratio}; global batch {global_batch} samples")

    eval_before = evaluate(model, tokenizer, cfg.eval, device) if cfg.eval.path and state.step == 0 else None
    logger = MetricsLogger(out, cfg.log.wandb, cfg.log.wandb_project, asdict(cfg), start_step=state.step)
    saver = ckpt.Checkpointer(out / "checkpoints", keep=cfg.checkpoint.keep, use_async=cfg.checkpoint.async_)
    signals = ckpt.SignalFlag()
    faults = fault_injection()
    bar = progress_bar(t.max_steps, state.step, cfg.log.progress)
    record: dict = {}
    try:
        while state.step < t.max_steps:
            t0 = time.perf_counter()
            micro_batches, local_input_tokens = next_micro_batches(sample_iter, t.micro_batch_size, t.grad_accum_steps,
                                               tokenizer.pad_token_id, pad_to)
            local_tokens = sum(int((b["shift_labels"] != -100).sum()) for b in micro_batches)
            num_tokens = all_reduce_sum(local_tokens, device)
            num_input_tokens = all_reduce_sum(local_input_tokens, device)
            denom = torch.tensor(max(num_tokens, 1.0), device=device)
            loss_sum = torch.zeros((), device=device, dtype=torch.float64)
            for i, batch in enumerate(micro_batches):
                last = i == len(micro_batches) - 1
                model.set_requires_gradient_sync(last)
                model.set_is_last_backward(last)
                batch = {k: v.to(device) for k, v in batch.items() if v is not None}
                loss = model(**batch, num_items_in_batch=denom, use_cache=False).loss
                if state.step + 1 == faults.get("nan_at_step"):
                    loss = loss * float("nan")
                if state.step + 1 == faults.get("kill_at_step"):
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(faults.get("step_sleep_s", 0))
                loss.backward()
                loss_sum += loss.detach().double()
            loss_value = all_reduce_sum(loss_sum.item(), device)
            grad_norm = clip_grad_norm(model, t.max_grad_norm)
            if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                if t.nan_policy == "stop":
                    raise NonFiniteError(f"non-finite {'loss' if not math.isfinite(loss_value) else 'grad norm'} "
                                         f"at step {state.step + 1} (loss={loss_value}, grad_norm={grad_norm}); "
                                         f"stopping (train.nan_policy=\"stop\")")
                state.skipped_steps += 1
                print0(f"step {state.step + 1}: non-finite loss/grad norm, update skipped "
                       f"({state.skipped_steps} skipped so far)")
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            state.step += 1
            state.samples_seen += global_batch
            state.tokens_seen += int(num_tokens)
            dt = time.perf_counter() - t0
            tokens_per_s = num_input_tokens / dt  # all real (non-pad) tokens processed, not only labels
            record = {"step": state.step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                      "num_tokens": int(num_tokens), "tokens_per_s": tokens_per_s, "step_time_s": dt,
                      "peak_mem_mb": peak_mem_mb(device), "tokens_seen": state.tokens_seen}
            if peak:
                record["mfu"] = tokens_per_s * flops_tok / (peak * world_size())
            logger.log(record)
            report(bar, record, t.log_interval, t.max_steps)
            stop = signals.any_set(device)
            if stop or state.step == t.max_steps or (cfg.checkpoint.interval and
                                                     state.step % cfg.checkpoint.interval == 0):
                path = saver.save(state.step, model, optimizer, scheduler, state, model.config)
                if stop:
                    saver.wait()
                    print0(f"received {signals.name}: saved checkpoint {path} at step {state.step}; exiting")
                    return record
        saver.wait()
        if samples.num_samples is None:
            print0(f"data (streamed so far): {describe_counts(samples.counts)}")
    finally:
        saver.close()
        logger.close()
        if bar is not None:
            bar.close()
    if cfg.eval.path:
        result = evaluate(model, tokenizer, cfg.eval, device)
        record["eval"] = result
        before = f"{eval_before['exact_match']:.1%} -> " if eval_before else ""
        lbefore = f"{eval_before['loss']:.3f} -> " if eval_before else ""
        print0(f"held-out ({result['num_samples']} questions): exact match {before}{result['exact_match']:.1%}, "
               f"loss {lbefore}{result['loss']:.3f}")
        if is_main():
            (out / "eval.json").write_text(__import__("json").dumps({"before": eval_before, "after": result}))
    return record


def fault_injection() -> dict:
    """Faults the tests inject: FINETUNE_TEST_FAULTS="nan_at_step=6,kill_at_step=6,step_sleep_s=0.5"."""
    spec = os.environ.get("FINETUNE_TEST_FAULTS", "")
    return {k: float(v) if "." in v else int(v) for k, _, v in (x.partition("=") for x in spec.split(",") if x)}


def clip_grad_norm(model, max_norm: float) -> float:
    """Global grad norm over all shards (clipped when max_norm > 0)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm.item()


def describe_counts(counts: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in counts.items())


def progress_bar(total: int, initial: int, enabled: bool):
    if not (enabled and is_main()):
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=initial, desc="sft", dynamic_ncols=True, file=sys.stderr,
                disable=not sys.stderr.isatty() and not os.environ.get("FINETUNE_PROGRESS"))


def report(bar, record: dict, log_interval: int, max_steps: int) -> None:
    line = (f"step {record['step']:>5}/{max_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"grad norm {record['grad_norm']:.3f} | {record['tokens_per_s']:.0f} tok/s | "
            f"mem {record['peak_mem_mb']:.0f} MB")
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{record['loss']:.4f}")
    if record["step"] % log_interval == 0 or record["step"] == max_steps:
        if bar is not None and not bar.disable:
            bar.write(line)
        else:
            print0(line)
