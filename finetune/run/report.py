"""What a run prints on the console (train.train): the start-up lines (data, packing, model, mesh, batch) and,
on rank 0, a progress bar and every log_interval steps one line of the step's metrics."""
from __future__ import annotations

import os
import sys

import numpy as np

from ..distributed import is_main, print0, world_size


def batch_efficiency(lengths, micro_batch_size: int, num_ranks: int, pad_to: int | None = None) -> float:
    """Real / computed tokens of units of these lengths (in global order) batched as train does: unit g on rank
    g % num_ranks, micro_batch_size of a rank per micro-batch, padded to its longest (or pad_to); whole rounds only."""
    lengths = np.asarray(lengths, dtype=np.int64)
    group = micro_batch_size * num_ranks
    n = max(len(lengths) // group, 1) * group
    x = np.resize(lengths, n).reshape(-1, micro_batch_size, num_ranks)  # [micro-batch round, row, rank]
    width = x.max(axis=1) if pad_to is None else np.full(x[:, 0].shape, pad_to)
    return float(x.sum() / (width.sum() * micro_batch_size))


class Report:
    """Prints what the run trains on when built; as a context (once the outputs are open): the progress bar, and
    the call that reports one step's record."""

    def __init__(self, cfg, model, samples, dims, device, global_batch: int, state):
        tc, dc = cfg.train, cfg.data
        self.cfg, self.start_step, self.bar = cfg, state.step, None
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
        print0(f"model: {cfg.model.path} ({num_params / 1e6:.1f}M params) on {world_size()} x {device.type} ({dims}), "
               f"{tc.mixed_precision}, ac.ratio={cfg.ac.ratio}; global batch {global_batch} "
               + (f"packed rows (<= {global_batch * dc.max_seq_len} tokens)" if dc.packing else "samples"))

    def __enter__(self):
        """A tqdm bar on rank 0 when stderr is a terminal (or FINETUNE_PROGRESS is set)."""
        if self.cfg.log.progress and is_main():
            from tqdm.auto import tqdm
            quiet = not sys.stderr.isatty() and not os.environ.get("FINETUNE_PROGRESS")
            self.bar = tqdm(total=self.cfg.train.max_steps, initial=self.start_step, desc="sft", dynamic_ncols=True,
                            file=sys.stderr, disable=quiet)
        return self.step

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()

    def step(self, record: dict) -> None:
        """Advance the bar; every log_interval steps (and the last), one console line."""
        bar, max_steps = self.bar, self.cfg.train.max_steps
        line = (f"step {record['step']:>5}/{max_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                f"grad norm {record['grad_norm']:.3f} | {record['tokens_per_s']:.0f} tok/s "
                f"({record['tokens_per_s_per_gpu']:.0f}/device"
                + (f", MFU {record['mfu']:.1%}" if "mfu" in record else "")
                + f") | mem {record['peak_mem_mb']:.0f} MB"
                + (f" | reward acc {record['accuracy']:.2f} margin {record['margin']:.3f}" if "accuracy" in record
                   else "")
                + (f" | aux loss {record['aux_loss']:.4f}" if "aux_loss" in record else ""))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}")
        if record["step"] % self.cfg.train.log_interval == 0 or record["step"] == max_steps:
            if bar is not None and not bar.disable:
                bar.write(line)
            else:
                print0(line)
