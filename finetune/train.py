"""The training loop: one explicit loop from the first batch to the last checkpoint, readable top to bottom."""
from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

from . import checkpoint as ckpt
from . import faults
from .ext import dpo
from .config import Config, ConfigError, resume_note, to_toml
from .ext.context import cp_width, split_batch
from .data import IGNORE_INDEX, batch_efficiency, build_samples, describe_counts, read_chat_template
from .distributed import all_reduce, init_distributed, is_main, print0, world_size
from .errors import FinetuneError
from .ext.evaluate import evaluate, report_eval
from .export import export_hf
from .loss import collate_labelled, token_loss_sum
from .metrics import MetricsLogger, flops_per_token, peak_flops, peak_mem_mb, progress_bar, report
from .model import build_model, load_tokenizer
from .optim import build_optimizer, build_scheduler


class NonFiniteError(FinetuneError):
    """Loss or grad norm became NaN/inf with train.nan_policy = "stop": the run failed (exit 1)."""

    exit_code = 1


def next_micro_batches(samples, micro_batch_size: int, grad_accum_steps: int, pad_id: int, pad_to: int | None,
                       collate=None, cp: tuple[int, int] = (0, 1)):
    """This rank's micro-batches for one optimizer step (loss.collate_labelled, or `collate`: dpo) and their number
    of real tokens. With cp = (cp rank, N > 1) this rank takes its slice of the data rank's rows
    (context.split_batch: 1/N of the real tokens)."""
    batches, num_input_tokens = [], 0
    for _ in range(grad_accum_steps):
        items = [next(samples) for _ in range(micro_batch_size)]
        num_input_tokens += sum(len(x["input_ids"]) for x in items) / cp[1]
        if collate is not None:
            batches.append(collate(items, pad_id, pad_to))
            continue
        width = pad_to or max(len(x["input_ids"]) for x in items)
        batch = collate_labelled(items, pad_id, cp_width(width, cp[1]))
        batches.append(split_batch(batch, *cp) if cp[1] > 1 else batch)
    return batches, num_input_tokens


def accum_steps(micro_batch_size: int, grad_accum_steps: int, tokens_per_step: int, max_seq_len: int,
                num_ranks: int) -> int:
    """Micro-batches per rank per step. With tokens_per_step (packed data), a step is R = tokens_per_step /
    max_seq_len rows (the next R global units, rank r taking those with g % num_ranks == r), so R / (ranks x
    micro_batch_size) micro-batches: the same global batch at any world size that divides it."""
    if not tokens_per_step:
        return grad_accum_steps
    rows = tokens_per_step // max_seq_len
    if rows % (micro_batch_size * num_ranks):
        raise ConfigError(f"train.tokens_per_step={tokens_per_step} is {rows} rows of data.max_seq_len={max_seq_len}, "
                          f"not a multiple of train.micro_batch_size ({micro_batch_size}) x ranks ({num_ranks})")
    return rows // (micro_batch_size * num_ranks)


# what train_step returns, one float64 device tensor per step: index of each value (then a loss_fn's means)
LOSS, GRAD_NORM, NUM_TOKENS, NUM_INPUT_TOKENS, STOP, NUM_COMPUTED_TOKENS = range(6)
DPO_KEYS = ("rewards_chosen", "rewards_rejected", "accuracy")  # the means dpo's loss_fn adds


def train_step(model, optimizer, micro_batches: list[dict], *, num_input_tokens: int, max_grad_norm: float,
               skip_nonfinite: bool = False, stop: bool = False, loss_fn=None) -> tuple[torch.Tensor, bool]:
    """One optimizer step over this rank's micro-batches (what `sft` and `bench` both run): forward/backward on the
    summed token losses (gradient sync on the last), ONE all_reduce of the step's counts, gradients divided by the
    global label-token count (the mean over every label token of the global batch, whatever the split), clip,
    step. Returns (the float64 device tensor indexed by LOSS, GRAD_NORM, ... above: never read here, whether the
    update was skipped: `skip_nonfinite`, nan_policy "skip", reads it). `loss_fn(model, batch)` (dpo) -> (loss sum,
    float64 [count, sums...]): normalised by the global count instead; the sums' global means follow."""
    device = next(model.parameters()).device
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    sums = torch.zeros(0, device=device, dtype=torch.float64)  # loss_fn's [count, sums...] over the micro-batches
    num_tokens = sum(int((b["label_targets"] != IGNORE_INDEX).sum()) for b in micro_batches)
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        model.set_requires_gradient_sync(last)
        model.set_is_last_backward(last)
        batch = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        if loss_fn is None:
            loss = token_loss_sum(model, batch)
        else:
            loss, more = loss_fn(model, batch)
            sums = more if not sums.numel() else sums + more
        loss.backward()
        loss_sum += loss.detach().double()
    # host-to-device copies with non_blocking: no wait for the GPU here (a blocking copy would be a sync)
    num_computed = sum(b["input_ids"].numel() for b in micro_batches)
    counts = torch.tensor([num_tokens, num_input_tokens, float(stop), num_computed], dtype=torch.float64)
    counts = counts.to(device, non_blocking=True)
    stats = torch.cat([counts[:1], loss_sum[None], counts[1:], sums])
    all_reduce(stats)
    count = (stats[5] if sums.numel() else stats[0]).clamp(min=1)  # label tokens, or loss_fn's count (pairs)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    torch._foreach_mul_(grads, (1 / count).float())
    grad_norm = clip_grad_norm(model, max_grad_norm)
    # [LOSS, GRAD_NORM, NUM_TOKENS], then stats[2:] as they are: NUM_INPUT_TOKENS, STOP, NUM_COMPUTED_TOKENS
    result = torch.cat([torch.stack([stats[1] / count, grad_norm.double(), stats[0]]), stats[2:5], stats[6:] / count])
    skipped = skip_nonfinite and not bool(torch.isfinite(result[:2]).all())
    if not skipped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return result, skipped


def build_run_samples(cfg: Config, tokenizer, **kwargs):
    """The sample stream `cfg.data` describes (one call for sft, bench and preview-data, so they see the same data)."""
    dc = cfg.data
    return build_samples([asdict(s) for s in dc.sources] or dc.path, tokenizer, fmt=dc.format, split=dc.split,
                         name=dc.name or None, streaming=dc.streaming, max_seq_len=dc.max_seq_len, packing=dc.packing,
                         seed=cfg.train.seed, on_unsupported=dc.on_unsupported, num_proc=dc.num_proc,
                         chat_template_kwargs=dc.chat_template_kwargs, **kwargs)


def run_tokenizer(cfg: Config, resume_dir: Path | None = None):
    """(the model's tokenizer, with data.chat_template's in place of its own; that template or None). Resuming, the
    template saved with the checkpoint is used, whatever the file holds now."""
    path, template = cfg.data.chat_template, None
    if path:
        template = ckpt.read_marker(resume_dir).get("chat_template") if resume_dir is not None else None
        if template and Path(path).exists() and read_chat_template(path) != template:
            print0(f"note: data.chat_template {cfg.data.chat_template} changed since {resume_dir}; resuming with the "
                   f"template saved with it")
        template = template or read_chat_template(path)
    return load_tokenizer(cfg.model.path, cfg.model.trust_remote_code, chat_template=template), template


def build_model_and_optimizer(cfg: Config, device: torch.device, dims):
    """The model, its AdamW and its LoRA settings (build_model's) as configured: what `sft` and `bench` train."""
    tc = cfg.train
    model, lora = build_model(cfg.model.path, device, dims.mesh, mixed_precision=tc.mixed_precision,
                              ac_ratio=cfg.ac.ratio, ac_mode=cfg.ac.mode, compile=cfg.model.compile,
                              liger=cfg.model.liger, attn_implementation=cfg.model.attn_implementation,
                              trust_remote_code=cfg.model.trust_remote_code, lora=asdict(cfg.lora), seed=tc.seed,
                              packing=cfg.data.packing, cp_group=dims.cp_group, ac_offload=cfg.ac.offload,
                              fp8=cfg.model.fp8, fp8_all_gather=cfg.model.fp8_all_gather)
    optimizer = build_optimizer(model, tc.lr, tc.weight_decay, (tc.beta1, tc.beta2), tc.eps)
    if cfg.model.fp8 == "tensorwise" and cfg.model.fp8_all_gather:  # the fp8 scales after each optimizer.step
        from .ext.float8 import precompute_scales_after_step  # wired by the lead
        precompute_scales_after_step(model, optimizer)
    return model, optimizer, lora


def setup_dpo(cfg: Config, model, tokenizer, dims, device, out: Path, resume_dir):
    """`finetune dpo`'s (loss_fn, collate, held-out evaluation or None): see dpo.py."""
    reference, pad = dpo.reference_kind(cfg), tokenizer.pad_token_id
    held_out = None
    if cfg.eval.path:  # every rank all of the first eval.num_samples pairs (preflight: pairs), unpacked
        held_out = build_samples(cfg.eval.path, tokenizer, max_seq_len=cfg.data.max_seq_len, shuffle=False,
                                 on_unsupported=cfg.data.on_unsupported, epoch_limit=1,
                                 chat_template_kwargs=cfg.data.chat_template_kwargs)
    num_held_out = min(cfg.eval.num_samples, held_out.num_samples) if held_out else 0
    tables = {"train": None, "eval": None}
    if reference == "precomputed":
        tables = dpo.reference_tables(model, build_run_samples(cfg, tokenizer, rank=dims.dp_rank,
                                                               world_size=dims.dp_size, shuffle=False),
                                      held_out, num_held_out, cfg.train.micro_batch_size,
                                      partial(dpo.collate_pairs, pad_id=pad), device, out, resume_dir)
    loss_fn = dpo.make_loss(cfg.dpo, reference)

    def evaluate_held_out():
        batches = dpo.pair_batches(iter(held_out), num_held_out, cfg.train.micro_batch_size,
                                   partial(dpo.collate_pairs, pad_id=pad, table=tables["eval"]))
        return dpo.evaluate_pairs(model, loss_fn, batches, device, out)
    return loss_fn, partial(dpo.collate_pairs, table=tables["train"]), evaluate_held_out if held_out else None


def train(cfg: Config, task: str = "sft") -> dict:
    """Run SFT (task "dpo": preference tuning, dpo.py) as configured; returns the final metrics record (rank 0) and
    held-out results."""
    if task == "dpo" and cfg.parallel.cp > 1:
        raise ConfigError("finetune dpo does not split rows over ranks yet: set parallel.cp=1")
    device, dims = init_distributed(cfg.parallel.dp_replicate, cfg.parallel.dp_shard, cp=cfg.parallel.cp)
    out, tc, dc = Path(cfg.output_dir), cfg.train, cfg.data
    accum = accum_steps(tc.micro_batch_size, tc.grad_accum_steps, tc.tokens_per_step, dc.max_seq_len, dims.dp_size)
    torch.manual_seed(tc.seed)
    resume_dir = ckpt.find_resume(out, cfg.checkpoint.resume, cfg.checkpoint.resume_from)
    tokenizer, chat_template = run_tokenizer(cfg, resume_dir)
    model, optimizer, lora = build_model_and_optimizer(cfg, device, dims)
    scheduler = build_scheduler(optimizer, warmup_steps=tc.warmup_steps, max_steps=tc.max_steps,
                                min_lr_ratio=tc.min_lr_ratio)
    state = ckpt.TrainState()
    if resume_dir is not None:
        resume(resume_dir, cfg, model, optimizer, scheduler, state, lora)

    samples = build_run_samples(cfg, tokenizer, rank=dims.dp_rank, world_size=dims.dp_size,
                                start_sample=state.samples_seen)
    sample_iter, pad_to = iter(samples), dc.max_seq_len if dc.pad_to_max else None
    global_batch = tc.micro_batch_size * accum * dims.dp_size
    flops_tok, peak = describe_run(cfg, model, samples, dims, device, global_batch, state)
    loss_fn, collate, evaluate_pairs = setup_dpo(cfg, model, tokenizer, dims, device, out, resume_dir) \
        if task == "dpo" else (None, None, None)
    held_out = partial(evaluate, model, tokenizer, cfg.eval.path, cfg.eval.num_samples, cfg.eval.max_new_tokens,
                       device, dc.chat_template_kwargs)
    eval_before = held_out() if cfg.eval.path and state.step == 0 and task == "sft" else None
    pending, record = [], {}  # pending: (result, timing) of the steps not read on the host yet (flush_steps)
    with ckpt.SignalFlag() as signals:  # until train returns: a signal during the final export and eval waits too
        with open_outputs(cfg, out, state.step, chat_template, lora) as (logger, saver, bar):
            while state.step < tc.max_steps:
                step = state.step + 1
                faults.kill_if("kill_at_step", step)
                faults.pause_if(step, lambda: signals.name is not None)
                t0 = time.perf_counter()
                micro_batches, num_input_tokens = next_micro_batches(sample_iter, tc.micro_batch_size,
                                                                     accum, tokenizer.pad_token_id, pad_to, collate,
                                                                     (dims.cp_rank, dims.cp))
                result, skipped = train_step(model, optimizer, micro_batches, num_input_tokens=num_input_tokens,
                                             max_grad_norm=tc.max_grad_norm, skip_nonfinite=tc.nan_policy == "skip",
                                             stop=signals.name is not None, loss_fn=loss_fn)
                lr = scheduler.get_last_lr()[0]
                scheduler.step()
                state.step, state.samples_seen = step, state.samples_seen + global_batch
                pending.append((result, {"step": step, "lr": lr, "step_time_s": time.perf_counter() - t0,
                                         "skipped": skipped}))
                save = step == tc.max_steps or (cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0)
                if device.type != "cuda" or save or step % tc.log_interval == 0 or tc.nan_policy == "skip":
                    record, stop = flush_steps(pending, state, logger, bar, tc, device, flops_tok, peak)
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
        if cfg.checkpoint.export_hf:  # every rank gathers, writes and checks whole files (plan: the final checkpoint)
            export_hf(str(out), str(out / "hf"), live=model)
        if evaluate_pairs is not None:
            record["eval"] = evaluate_pairs()
        elif cfg.eval.path:
            record["eval"] = report_eval(held_out(), eval_before, out)
    return record


def resume(path: Path, cfg: Config, model, optimizer, scheduler, state: ckpt.TrainState, lora: dict | None) -> None:
    """Load the checkpoint at `path` into the run; say where it continues, and what differs from the run saved."""
    ckpt.load_checkpoint(path, model, optimizer, scheduler, state, model.config, lora)
    print0(f"resumed from {path} at step {state.step} ({state.samples_seen} samples seen)")
    if note := resume_note(ckpt.read_marker(path).get("config", {}), cfg, state.samples_seen):
        print0(note)


@contextmanager
def open_outputs(cfg: Config, out: Path, start_step: int, chat_template: str | dict | None, lora: dict | None):
    """Once the run is accepted (a refused run rewrites nothing): config.toml, and (the metrics logger, the
    checkpointer, whose checkpoints record the config export-hf reads and `lora`, the progress bar or None), closed
    on exit."""
    if is_main():
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.toml").write_text(to_toml(cfg))
        ckpt.keep_earlier_run(out / "checkpoints", cfg.checkpoint.resume)
    logger = MetricsLogger(out, cfg.log.wandb, cfg.log.wandb_project, asdict(cfg), start_step=start_step)
    run = asdict(cfg)
    if Path(cfg.model.path).exists():
        run["model"]["path"] = str(Path(cfg.model.path).resolve())
    saver = ckpt.Checkpointer(out / "checkpoints", keep=cfg.checkpoint.keep, use_async=cfg.checkpoint.async_,
                              lora=lora, run={"config": run, "chat_template": chat_template})
    bar = progress_bar(cfg.train.max_steps, start_step, cfg.log.progress)
    try:
        yield logger, saver, bar
    finally:
        saver.close()
        logger.close()
        if bar is not None:
            bar.close()


def describe_run(cfg: Config, model, samples, dims, device, global_batch: int, state: ckpt.TrainState):
    """Print what this run trains on (data, packing, model, mesh, batch; a resumed run's changed global batch);
    returns (training FLOPs per token, the device's peak FLOP/s or None) for MFU."""
    tc, dc = cfg.train, cfg.data
    for line in samples.summary():  # streaming counts fill in as rows go by; reported at the end
        print0(f"data: {line}")
    if samples.num_samples is not None:
        packed = (f"packed into {samples.num_samples} rows of <= {dc.max_seq_len} tokens" if dc.packing else
                  "not packed: each micro-batch pads to its longest sample")
        efficiency = batch_efficiency(samples.unit_lengths(), tc.micro_batch_size, dims.dp_size,
                                      dc.max_seq_len if dc.pad_to_max else None)
        print0(f"data: {packed}; packing efficiency {efficiency:.1%} (real tokens / computed tokens, first epoch)")
    if state.step and state.samples_seen != state.step * global_batch:  # allowed, but then not the same run
        print0(f"note: the global batch is now {global_batch} samples; the checkpoint's run used "
               f"{state.samples_seen / state.step:g} per step (micro_batch_size x grad_accum_steps x ranks)")
    num_params = sum(p.numel() for p in model.parameters())
    flops_tok = flops_per_token(model, dc.max_seq_len)
    print0(f"model: {cfg.model.path} ({num_params / 1e6:.1f}M params) on {world_size()} x {device.type} ({dims}), "
           f"{tc.mixed_precision}, ac.ratio={cfg.ac.ratio}; global batch {global_batch} "
           + (f"packed rows (<= {global_batch * dc.max_seq_len} tokens)" if dc.packing else "samples"))
    return flops_tok, peak_flops(device)


def flush_steps(pending: list, state: ckpt.TrainState, logger, bar, tc, device, flops_tok: float,
                peak: float | None) -> tuple[dict, bool]:
    """Read the pending steps' results on the host (one read) and log each; returns (the last record, whether a
    rank asked to stop). On GPU train calls it only on log and checkpoint steps (every step under nan_policy
    "skip"), so the GPU never waits for the host in between; signals and "stop" non-finite steps are acted on
    here, always before a checkpoint is written."""
    values = torch.stack([r for r, _ in pending]).tolist()  # the one host read
    for v, (_, timing) in zip(values, pending):
        if timing["skipped"]:  # only under nan_policy "skip", which reads every step at once
            state.skipped_steps += 1
            print0(f"step {timing['step']}: non-finite loss/grad norm, update skipped ({state.skipped_steps} skipped "
                   f"so far)")
        record = make_record(v, timing, state, tc.nan_policy, device, flops_tok, peak)
        logger.log(record)
        report(bar, record, tc.log_interval, tc.max_steps)
    pending.clear()
    return record, values[-1][STOP] > 0


def make_record(values: list[float], timing: dict, state: ckpt.TrainState, nan_policy: str, device, flops_tok: float,
                peak: float | None) -> dict:
    """One step's metrics from train_step's values; counts tokens_seen; raises on non-finite (policy "stop")."""
    loss, grad_norm = values[LOSS], values[GRAD_NORM]
    if nan_policy == "stop" and not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise NonFiniteError(f"non-finite {'loss' if not math.isfinite(loss) else 'grad norm'} at step "
                             f"{timing['step']} (loss={loss}, grad_norm={grad_norm}); stopping "
                             f"(train.nan_policy=\"stop\")")
    state.tokens_seen += int(values[NUM_TOKENS])
    tokens_per_s = values[NUM_INPUT_TOKENS] / timing["step_time_s"]  # all real (non-pad) tokens, not only labels
    record = {"step": timing["step"], "loss": loss, "lr": timing["lr"], "grad_norm": grad_norm,
              "num_tokens": int(values[NUM_TOKENS]), "tokens_per_s": tokens_per_s,
              "tokens_per_s_per_gpu": tokens_per_s / world_size(),
              "padding_fraction": 1 - values[NUM_INPUT_TOKENS] / values[NUM_COMPUTED_TOKENS],
              "step_time_s": timing["step_time_s"], "peak_mem_mb": peak_mem_mb(device),
              "tokens_seen": state.tokens_seen}
    if device.type == "cuda":
        record["peak_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20
    record.update(zip(DPO_KEYS, values[NUM_COMPUTED_TOKENS + 1:]))
    if "accuracy" in record:
        record["margin"] = record["rewards_chosen"] - record["rewards_rejected"]
    if peak:
        record["mfu"] = tokens_per_s * flops_tok / (peak * world_size())  # metrics.MFU_CONVENTION
    return record


def clip_grad_norm(model, max_norm: float) -> torch.Tensor:
    """Global grad norm over all shards (clipped when max_norm > 0), as a tensor on the device."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"), foreach=True)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

