"""What a run passes to the core, from its config: `recipe(cfg, task)` (the task's setup, the model transforms, the
export's hooks) for train.train, `export_hooks()` for export.export_hf (cli.py, bench, plan and tests call these)."""
from __future__ import annotations

from functools import partial

import torch

from .config import Config
from .model import Transforms, resolve_compile
from .train import Recipe, Run, Task


def transforms(cfg: Config, dims, device: torch.device) -> Transforms:
    """The model transforms `cfg` asks for (varlen, per-sample linear attention, experts, Liger, fp8, cp, LoRA,
    op-level AC, offload), configured."""
    from .distributed import print0
    from .memory.sac import checkpoint_kwargs
    from .hf import loader
    from .kernels.linear_attention import apply_sample_boundaries
    from .kernels.varlen import register
    t = Transforms(varlen=register, sac=checkpoint_kwargs, loader=loader, samples_apart=apply_sample_boundaries)
    cuda = device.type == "cuda"
    compile, liger = resolve_compile(cfg.model.compile, cuda), False
    if cfg.model.liger is not False:
        from .kernels.liger import resolve_liger
        if liger := resolve_liger(cfg.model.liger, cuda):
            t.lm_head_in_root = True
            t.note = "Liger fused loss only (compiled blocks)" if compile else "Liger on"
    t.kernels = partial(_kernels, experts=cfg.model.experts_implementation, liger=liger, compile=compile)
    if cfg.model.fp8 != "off":
        from .run.checks import check_fp8
        check_fp8(cfg)  # again: bench sets model.fp8 for each point after the command checked its config
        t.float8 = partial(_float8, cfg=cfg, device=device, shards=dims.mesh.shape[-1] if dims is not None else 1)
    if dims is not None and dims.cp > 1:
        from .parallel.context import apply_cp, cp_group
        t.context_parallel = partial(apply_cp, group=cp_group(dims, device.type))
    if dims is not None and dims.ep > 1:
        from .parallel.expert import apply_ep
        t.expert_parallel = partial(apply_ep, mesh=dims.expert_mesh)
    if cfg.lora.rank:
        from .adapters.lora import lora_settings
        t = lora_transforms(lora_settings(cfg), seed=cfg.train.seed, path=cfg.model.path,
                            mixed_precision=cfg.train.mixed_precision, into=t, quantize_base=cfg.lora.quantize_base,
                            shards=dims.mesh.shape[-1] if dims is not None else 1)
    if cfg.ac.offload and not cuda:
        print0("note: ac.offload is a no-op on CPU: activations already live in host memory")
    elif cfg.ac.offload:
        from .memory.offload import HostOffload, Offloaded
        t.ac_wrap = partial(Offloaded, offload=HostOffload())  # one copy stream and block order for the model
    return t


def lora_transforms(settings: dict, *, seed: int, path: str, mixed_precision: str = "bf16",
                    into: Transforms | None = None, quantize_base: str = "none", shards: int = 1) -> Transforms:
    """`into` (or empty transforms) with LoRA's slots filled: apply_lora's `settings` on a frozen base in bf16 (fp32
    when mixed_precision is fp32; quantize_base "nf4": its linear weights NF4, sharded over `shards` ranks),
    adapters initialised from `seed`, tied to the base weights at `path`."""
    from .hf import loader
    from .adapters.lora import apply_lora
    t = into or Transforms(loader=loader)
    base_dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float32
    quantize = None
    if quantize_base == "nf4":
        from .adapters.qlora import apply_nf4, fill_nf4, nf4_params
        quantize, t.fill, t.unsharded = partial(apply_nf4, shards=shards, dtype=base_dtype), fill_nf4, nf4_params
    t.adapters = partial(apply_lora, **settings, base_dtype=base_dtype, quantize=quantize)
    t.after_load = partial(_init_adapters, seed=seed, path=path)
    return t


def _init_adapters(model, settings: dict, *, seed: int, path: str) -> None:
    """After the load: the adapters initialised from `seed`, the base weights' fingerprint recorded in `settings`."""
    from .hf.fingerprint import base_fingerprint
    from .adapters.lora import init_lora_weights
    init_lora_weights(model, seed)
    settings["base_fingerprint"] = base_fingerprint(path)


def _kernels(model, layers, *, experts: str, liger: bool, compile: bool) -> None:
    """The kernels slot: the MoE experts' implementation (a no-op for a dense model), then Liger's kernels."""
    from .kernels.moe import apply_experts_implementation
    apply_experts_implementation(model, experts)
    if liger:
        from .kernels.liger import apply_kernels
        apply_kernels(model, compile)


def _float8(model, layers, *, cfg: Config, device: torch.device, shards: int) -> None:
    """The float8 slot: refusals and notes for this device, then Linear layers swapped for torchao's Float8Linear."""
    from .kernels.float8 import apply_float8, check_float8
    m = cfg.model
    check_float8(m.fp8, device, compile=resolve_compile(m.compile, device.type == "cuda"),
                 hidden_size=model.config.get_text_config().hidden_size)
    apply_float8(model, m.fp8, shards=shards, all_gather=m.fp8_all_gather, emulate=device.type != "cuda")


def sft_task(cfg: Config, run: Run) -> Task:
    """sft's task with its extensions: cp's row split, held-out evaluation before and after, an MoE router's loss;
    with expert parallel the gradients clipped over both meshes."""
    from .kernels.float8 import float8_scales
    from .kernels.moe import build_router_loss, clip_grad_norm_by_mesh, router_task
    float8_scales(cfg, run)
    task = Task(clip=clip_grad_norm_by_mesh if run.dims.ep > 1 else None)
    if run.dims.cp > 1:
        from .parallel.context import collate_split, cp_rank
        task.collate = partial(collate_split, rank=cp_rank(run.dims), n=run.dims.cp)
    if cfg.eval.path and cfg.eval.num_samples:  # eval.num_samples=0: no evaluation (not 0 of 0)
        from .tasks.evaluate import evaluate, report_eval
        ec = cfg.eval
        held_out = partial(evaluate, run.model, run.tokenizer, ec.path, ec.num_samples, ec.max_new_tokens, run.device,
                           cfg.data.chat_template_kwargs)
        task.evaluate_before = held_out
        task.evaluate_after = lambda before: report_eval(held_out(), before, run.out)
    router = build_router_loss(run.model, cfg.moe.aux_loss_coef, "sft")
    return router_task(task, router) if router is not None else task


def export_hooks() -> dict:
    """export.export_hf's hooks: LoRA checkpoints merged or written as adapter dirs, the streamed check, the locks (also
    the run's and its retention's: cli.py, train.open_outputs), the chat template's defaults, the live gather, the
    source's dtypes and the tensors its class does not own."""
    from .hf import live, passthrough, template_defaults, verify
    from .run import locks
    from .adapters import lora_export
    return {"adapters": lora_export, "check": verify.verify_export, "locks": locks, "templates": template_defaults,
            "gather": live.open_live, "passthrough": passthrough}


def samples(cfg: Config, labellers: dict) -> dict:
    """build_samples' labellers, hint and stream for `cfg`: rows streamed (data/streaming.py), else a mixture."""
    from .data.label_hints import way_out
    from .data.mixture import Mixture
    from .data.streaming import Streamed
    return {"labellers": labellers, "hint": way_out, "stream": Streamed if cfg.data.streaming else Mixture}


def recipe(cfg: Config, task: str = "sft") -> Recipe:
    """What a run of `task` ("sft", "dpo") passes to train.train (cfg checked again by run/checks: API callers)."""
    from .run.checks import validate
    validate(cfg, task)
    labellers, setup = {}, sft_task
    if task == "dpo":
        from .tasks import dpo
        labellers, setup = dpo.LABELLERS, dpo.dpo_task
    from .data.chat_template import run_tokenizer
    from .run.mfu import meter
    from .run.report import Report
    from .run.resume_note import resume_note
    from .run.saving import Checkpointer
    from .run.tokens_per_step import run_accum
    from .run.wandb import WandbLogger
    return Recipe(task, setup, transforms, export_hooks(), samples(cfg, labellers), accum=run_accum,
                  mfu=meter, resume_note=resume_note, logger=partial(WandbLogger, cfg=cfg), report=Report,
                  checkpointer=partial(Checkpointer, use_async=cfg.checkpoint.async_), tokenizer=run_tokenizer)
