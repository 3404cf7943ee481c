"""Issue 49 item 6 on one GPU: Llama-3-70B's widths (hidden 8192, intermediate 28672, 64/8 heads, vocab 128256) at
--layers decoder layers, QLoRA r16 (lora.quantize_base=nf4) vs bf16 LoRA r16 on the same random weights, alternating,
each against `finetune plan` on the same config. The script writes the random bf16 safetensors (no hub), a file per
decoder layer, so the model of --small-layers links them; per layer = (figure at --layers - figure at --small-layers)
/ the layers between (embedding, lm_head, logits drop out). Each build runs in this process through finetune's own
functions (build_model_and_optimizer, train_step, the sft task and sample stream, as `bench`), on fixed packed rows:
  built   memory_allocated after the build (NF4 or bf16 base, bf16 embedding and lm_head, fp32 adapters); load_peak
  steady  memory_allocated after the warm-up steps (+ AdamW's state; no gradients), vs plan's state less gradients
  peak    max_memory_allocated over the steps, vs plan's total (its terms per layer printed)
  tokens/s  real tokens a step / its synchronised time: median and spread of the timed steps of all rounds
On one rank FSDP leaves the NF4 weights out (adapters/qlora.nf4_params): not all-gathered, where plan counts two 4-bit
blocks in flight. Without CUDA the memory figures are skipped (said once): --width tiny runs the path on any CPU.

    python3 benchmarks/qlora_gpu.py --layers 8 --out $OUT/qlora_gpu.json     # one GPU: ~4 min (gpu_check.sh qlora)
    python3 benchmarks/qlora_gpu.py --width tiny --out /tmp/qlora_gpu.json    # any machine: ~2 min on 2 cores
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

WIDTHS = {"70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8,
                      vocab_size=128256),
          # every linear weight splits into whole NF4 factor blocks (16,384 values): quantized as at 70B's widths
          "tiny": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=1024)}
VARIANTS = {"qlora": "nf4", "lora": "none"}
GIB = 2**30
BAR = 0.05  # measured within 5% of plan


def write_weights(path: Path) -> None:
    """Random bf16 weights for the config in `path` (normal(0, 0.02) matrices, norms 1), tensor by tensor: a
    safetensors file per decoder layer (layer-00000.safetensors, ...), one for the rest (rest.safetensors)."""
    import torch
    from safetensors.torch import save_file

    from finetune.model import build_skeleton, load_hf_config
    device = "cuda" if torch.cuda.is_available() else "cpu"
    files: dict[str, list] = {}
    for name, p in build_skeleton(load_hf_config(str(path))).named_parameters():
        layer = re.search(r"\.layers\.(\d+)\.", name)
        files.setdefault(f"layer-{int(layer[1]):05d}" if layer else "rest", []).append((name, p.shape))
    torch.manual_seed(0)
    for file, params in files.items():
        tensors = {n: (torch.ones(s) if len(s) == 1 else torch.randn(s, device=device) * 0.02).to(torch.bfloat16)
                   .cpu() for n, s in params}
        save_file(tensors, str(path / f"{file}.safetensors"), metadata={"format": "pt"})
        del tensors
    write_index(path, {n: f"{f}.safetensors" for f, params in files.items() for n, _ in params})


def write_index(path: Path, weight_map: dict) -> None:
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def model_dirs(root: Path, width: str, depths: list[int]) -> dict[int, Path]:
    """{layers: a model dir (config and tokenizer)} at each depth."""
    from gpu_points import config_dir
    return {n: config_dir(root / f"{width}-{n}layers", {**WIDTHS[width], "num_hidden_layers": n}) for n in depths}


def fill_weights(dirs: dict[int, Path]) -> None:
    """The deepest dir's random weights written (once), the other dirs' files linked to its, each with its index."""
    deepest = dirs[max(dirs)]
    if not (deepest / "model.safetensors.index.json").exists():
        t0 = time.perf_counter()
        write_weights(deepest)
        print(f"wrote {max(dirs)} random layers in {time.perf_counter() - t0:.0f} s", flush=True)
    index = json.loads((deepest / "model.safetensors.index.json").read_text())["weight_map"]
    for n, path in dirs.items():
        if path == deepest:
            continue
        kept = {k: f for k, f in index.items() if not (m := re.search(r"\.layers\.(\d+)\.", k)) or int(m[1]) < n}
        for f in set(kept.values()):
            if not (path / f).exists():
                (path / f).symlink_to(deepest / f)
        write_index(path, kept)


def overrides(args, quantize_base: str) -> list[str]:
    """The config of a run and of its plan (the same keys)."""
    return [f"data.max_seq_len={args.seq_len}", "data.packing=true", "data.pad_to_max=true",
            f"train.micro_batch_size={args.micro_batch_size}", "train.mixed_precision=bf16",
            f"ac.ratio={args.ac_ratio}", "model.compile=false", "model.liger=false", f"lora.rank={args.rank}",
            f"lora.alpha={2 * args.rank}", f"lora.quantize_base={quantize_base}", *args.set]


def start_plan(model_dir: Path, args, quantize_base: str, gpu_bytes: int) -> subprocess.Popen:
    """`finetune plan --json` of one GPU at the run's point (ac.ratio, micro-batch), in the background."""
    return subprocess.Popen([sys.executable, "-m", "finetune", "plan", "--model", str(model_dir), "--nproc-per-node",
                             "1", "--gpu-memory", f"{gpu_bytes // 2**20}MB", "--sac-ratios", str(args.ac_ratio),
                             "--micro-batch-sizes", str(args.micro_batch_size), "--json",
                             *overrides(args, quantize_base)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_plan(proc: subprocess.Popen) -> dict:
    """plan's figures for the point: its total (the peak), its state, and the state without gradients (steady)."""
    out, err = proc.communicate()
    if not out.strip():
        return {"error": (err.strip().splitlines() or ["no output"])[-1]}
    try:  # a plan whose JSON changed shape is reported, the runs still go on
        plan = json.loads(out)
        state = plan["state"]
        return {"total": plan["points"][0]["total"], "state": sum(state.values()),
                "steady": sum(v for k, v in state.items() if not k.startswith("grads")), "state_by_kind": state,
                "in_flight": plan["in_flight"], "num_params": plan["num_params"],
                "terms": {"state": sum(state.values()), "in flight": sum(plan["in_flight"].values()),
                          **{k: plan["points"][0][k] for k in ("activations", "recompute", "logits_loss")}}}
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        return {"error": f"unreadable plan JSON ({type(e).__name__}: {e})"}


class Runner:
    """Builds and steps the model of each config in this process (one rank), on the same packed rows."""

    def __init__(self, data: Path, work: Path):
        from finetune.distributed import init_distributed
        self.device, self.dims = init_distributed()
        self.cuda, self.data, self.work, self.steps_data = self.device.type == "cuda", data, work, None
        if self.cuda:  # cuBLAS's workspaces (the caching allocator's) before any baseline: not the first build's
            import torch
            x = torch.randn(64, 64, device=self.device, dtype=torch.bfloat16, requires_grad=True)
            torch.nn.functional.linear(x, x, x[0]).sum().backward()

    def memory(self, peak: bool = False) -> int | None:
        import torch
        if not self.cuda:
            return None
        return torch.cuda.max_memory_allocated(self.device) if peak else torch.cuda.memory_allocated(self.device)

    def run(self, model_dir: Path, config: list[str], steps: int, warmup: int) -> dict:
        import torch

        from finetune.args import build_config
        from finetune.build import samples, task as build_task, transforms
        from finetune.data.chat_template import run_tokenizer
        from finetune.task import Run, build_run_samples
        from finetune.tasks import dpo
        from finetune.train import build_model_and_optimizer, next_micro_batches, train_step
        cfg = build_config(None, [*config, "log.progress=false", "eval.path="], **{
            "model.path": str(model_dir), "data.path": str(self.data), "output_dir": str(self.work / "out")})
        tc, device = cfg.train, self.device
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        base = self.memory()
        torch.manual_seed(tc.seed)
        model, optimizer, _ = build_model_and_optimizer(cfg, device, self.dims, transforms(cfg, self.dims, device))
        built, load_peak = self.memory(), self.memory(peak=True)
        tok = run_tokenizer(cfg)[0]
        task = build_task(cfg, Run(model, optimizer, tok, self.dims, device, Path(cfg.output_dir), None))
        if self.steps_data is None:  # the same rows for every build (one tokenizer: the configs differ in width)
            stream = iter(build_run_samples(cfg, tok, rank=0, world_size=1, **samples(cfg, dpo.LABELLERS)))
            self.steps_data = [next_micro_batches(stream, tc.micro_batch_size, 1, tok.pad_token_id,
                                                  cfg.data.max_seq_len, task.collate) for _ in range(warmup + steps)]
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
        sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        times, losses, steady = [], [], None
        for i, (micro_batches, num_tokens) in enumerate(self.steps_data[:warmup + steps]):
            if i == warmup:
                steady = self.memory()
            sync()
            t0 = time.perf_counter()
            result = train_step(model, optimizer, micro_batches, num_input_tokens=num_tokens,
                                max_grad_norm=tc.max_grad_norm, task=task)[0]
            sync()
            times.append(time.perf_counter() - t0)
            losses.append(float(result["loss"]))
        from finetune.adapters.qlora import nf4_params
        from finetune.compat import fsdp_param_group
        nf4 = nf4_params(model)
        managed = {id(fp.sharded_param) for m in model.modules() if (g := fsdp_param_group(m)) for fp in g.fsdp_params}
        record = {"step_times_s": times[warmup:], "warmup_times_s": times[:warmup], "losses": losses,
                  "tokens_per_step": [n for _, n in self.steps_data[warmup:warmup + steps]],
                  "nf4_weights": len(nf4), "nf4_in_fsdp": sum(id(p) in managed for p in nf4),
                  **({"built": built - base, "load_peak": load_peak - base, "steady": steady - base,
                      "peak": self.memory(peak=True) - base} if self.cuda else {})}
        del model, optimizer, task
        return record


def summarize(results: dict, depths: list[int], gpu_bytes: int) -> dict:
    """Per variant: tokens/s of the deepest model; per layer (deepest minus smallest) measured and planned, their
    ratio; the layers that would fit this GPU (plan's 10% kept free) at the measured per-layer peak."""
    deep, small = max(depths), min(depths)
    out = {}
    for variant in VARIANTS:
        runs = [r for r in results["runs"] if r["variant"] == variant]
        # each step computes its padded rows whatever their real tokens: the mean real tokens a step over each time
        rates = [statistics.mean(r["tokens_per_step"]) / t for r in runs if r["layers"] == deep
                 for t in r["step_times_s"]]
        s = {"tokens_per_s": {"median": statistics.median(rates), "min": min(rates), "max": max(rates),
                              "n": len(rates)} if rates else None}
        plans = results["plans"].get(variant, {})
        for key, plan_key in (("built", None), ("load_peak", None), ("steady", "steady"), ("peak", "total")):
            got = {n: statistics.median(r[key] for r in runs if r["layers"] == n and key in r) for n in depths
                   if any(r["layers"] == n and key in r for r in runs)}
            if len(got) < 2:
                continue
            per_layer = (got[deep] - got[small]) / (deep - small)
            s[key] = {"measured": got[deep], "per_layer": per_layer}
            planned = (plans[str(deep)][plan_key] - plans[str(small)][plan_key]) / (deep - small) \
                if plan_key and all(plan_key in plans.get(str(n), {}) for n in (deep, small)) else 0
            # (with parallel.cpu_offload plan puts the state in host memory: none planned on the GPU, no ratio)
            if planned:
                s[key].update(plan=plans[str(deep)][plan_key], plan_per_layer=planned,
                              ratio=per_layer / planned, within_bar=abs(per_layer / planned - 1) <= BAR)
        if all("terms" in plans.get(str(n), {}) for n in (deep, small)):  # what plan's peak per layer is made of
            s["plan_terms_per_layer"] = {k: (v - plans[str(small)]["terms"][k]) / (deep - small)
                                         for k, v in plans[str(deep)]["terms"].items()}
        if "peak" in s and s["peak"]["per_layer"] > 0:
            fixed = s["peak"]["measured"] - deep * s["peak"]["per_layer"]
            s["layers_that_fit"] = int((gpu_bytes * 0.9 - fixed) // s["peak"]["per_layer"])
        out[variant] = s
    if all(out[v]["tokens_per_s"] for v in VARIANTS):
        out["qlora_over_lora_tokens_per_s"] = out["qlora"]["tokens_per_s"]["median"] / \
            out["lora"]["tokens_per_s"]["median"]
    return out


def report(summary: dict) -> None:
    for variant in VARIANTS:
        s = summary[variant]
        if s["tokens_per_s"]:
            t = s["tokens_per_s"]
            print(f"{variant}: {t['median']:,.0f} tokens/s (median of {t['n']}; {t['min']:,.0f}-{t['max']:,.0f})")
        for key in ("built", "load_peak", "steady", "peak"):
            if key in s:
                f = s[key]
                line = f"  {key:9s} {f['measured'] / GIB:7.2f} GiB, per layer {f['per_layer'] / GIB:.3f} GiB"
                if "plan" in f:
                    line += (f"; plan {f['plan'] / GIB:.2f} GiB ({f['measured'] / f['plan'] - 1:+.1%}), per layer "
                             f"{f['plan_per_layer'] / GIB:.3f} GiB: {f['ratio'] - 1:+.1%} "
                             f"{'(within 5%)' if f['within_bar'] else '(OUTSIDE 5%)'}")
                print(line)
        if "plan_terms_per_layer" in s:
            print("  plan's peak per layer, by term: " + ", ".join(f"{k} {v / GIB:.3f}" for k, v in
                                                              s["plan_terms_per_layer"].items()) + " GiB")
        if "layers_that_fit" in s:
            print(f"  at the measured per-layer peak {s['layers_that_fit']} layers fit this GPU with 10% kept free "
                  f"(Llama-3-70B has 80)")
    if "qlora_over_lora_tokens_per_s" in summary:
        print(f"qlora / lora tokens/s: {summary['qlora_over_lora_tokens_per_s']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", choices=list(WIDTHS), default="70b")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; tiny: 2)")
    p.add_argument("--small-layers", type=int, default=None, help="the second depth (default: half of --layers; "
                   "3 or more: plan's two blocks in flight at both depths)")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the 4 builds (2 variants x 2 depths)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=None, help="packed row length (default 2048; tiny: 512)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--ac-ratio", type=float, default=1.0)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--set", nargs="*", default=[], help="more key=value overrides for the runs and the plans")
    p.add_argument("--work", default="/tmp/qlora_gpu", help="model dirs and run outputs")
    p.add_argument("--out", default=None, help="the JSON results (rewritten after each build)")
    args = p.parse_args()
    import torch
    os.environ.setdefault("WANDB_MODE", "disabled")
    layers = args.layers or (8 if args.width == "70b" else 2)
    args.seq_len = args.seq_len or (2048 if args.width == "70b" else 512)
    depths = sorted({layers, args.small_layers or max(1, layers // 2)}, reverse=True)
    if len(depths) < 2:
        sys.exit("--small-layers must differ from --layers (per layer = the difference between the two)")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if cuda else 80 * GIB
    if not cuda:
        print("no CUDA device: the memory figures (torch.cuda memory_allocated, max_memory_allocated) are skipped; "
              "plan still runs (for an 80 GiB GPU), tokens/s are this CPU's", flush=True)
    dirs = model_dirs(work, args.width, depths)
    # plan reads config.json only: it runs while the weights are written
    plans = {(v, n): start_plan(dirs[n], args, q, gpu_bytes) for v, q in VARIANTS.items() for n in depths}
    fill_weights(dirs)
    results = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "gpu_memory": gpu_bytes,
               "torch": torch.__version__, "commit": os.environ.get("FINETUNE_COMMIT"), "width": args.width,
               "widths": WIDTHS[args.width], "depths": depths, "config": overrides(args, "<nf4|none>"),
               "steps": args.steps, "warmup": args.warmup, "plans": {}, "runs": []}

    def save():
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=1))
    for (variant, n), proc in plans.items():  # a few seconds each, in parallel, while nothing is timed
        results["plans"].setdefault(variant, {})[str(n)] = plan = read_plan(proc)
        print(f"plan {variant} {n} layers: " + (plan["error"] if "error" in plan else
              f"peak {plan['total'] / GIB:.2f} GiB, state {plan['state'] / GIB:.2f} GiB"), flush=True)
    save()
    runner = Runner(REPO / "examples" / "data" / "tiny_chat.jsonl", work)
    for r in range(args.rounds):
        for n in depths:
            for variant, quantize_base in list(VARIANTS.items())[::1 if r % 2 == 0 else -1]:
                t0 = time.perf_counter()
                record = runner.run(dirs[n], overrides(args, quantize_base), args.steps, args.warmup)
                record.update(variant=variant, layers=n, round=r, wall_s=time.perf_counter() - t0)
                results["runs"].append(record)
                mem = (f"built {record['built'] / GIB:.2f} GiB, steady {record['steady'] / GIB:.2f}, peak "
                       f"{record['peak'] / GIB:.2f}; " if "peak" in record else "")
                print(f"round {r} {variant} {n} layers: {mem}median step "
                      f"{statistics.median(record['step_times_s']):.3f} s, {record['wall_s']:.0f} s in all; "
                      f"NF4 weights {record['nf4_weights']} ({record['nf4_in_fsdp']} in FSDP)", flush=True)
                save()
    results["summary"] = summarize(results, depths, gpu_bytes)
    save()
    report(results["summary"])


if __name__ == "__main__":
    main()
