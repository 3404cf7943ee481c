"""The one place a capability enters a run, from its config: `transforms` (what model.parallelize applies, in its
order), `task` (the loop's Task for the built run) and `samples` (how rows become samples). Each capability is
imported where its key turns it on, so a run loads only what it uses."""
from __future__ import annotations

from functools import partial

import torch

from .config import Config
from .attention import mixing_problem
from .model import Transform, resolve_compile, router_recorder
from .task import Run, Task


def transforms(cfg: Config, dims, device: torch.device) -> list[Transform]:
    """The model transforms `cfg` asks for, in model.STAGES order: the varlen attention, per-sample token mixing, the
    experts' implementation and Liger, fp8, cp, ep, LoRA (QLoRA), op-level AC, activation offload."""
    from .distributed import print0
    from .kernels.varlen import register
    cuda = device.type == "cuda"
    compile, liger = resolve_compile(cfg.model.compile, cuda), False
    # "auto" is on only on CUDA: a CPU run does not load the Liger module
    if cfg.model.liger is True or (cfg.model.liger == "auto" and cuda):
        from .kernels.liger import resolve_liger
        liger = resolve_liger(cfg.model.liger, cuda)
    # without Liger the kernels say nothing: build_model's line says "Liger off"
    note = ("Liger fused loss only (compiled blocks)" if compile else "Liger on") if liger else ""
    shards = dims.mesh.shape[-1] if dims is not None else 1
    t = [Transform("attention", register), Transform("kernels", _samples_apart),
         Transform("kernels", partial(_kernels, experts=cfg.model.experts_implementation, liger=liger,
                                      compile=compile), note=note, lm_head_in_root=liger)]
    if cfg.model.fp8 != "off":
        from .run.checks import check_fp8
        # again: bench sets model.fp8 for each point after the command checked its config
        check_fp8(cfg)
        from .kernels.float8 import float8_transform
        t.append(Transform("float8", partial(float8_transform, cfg=cfg, device=device, shards=shards)))
    if dims is not None and dims.cp > 1:
        from .parallel.context import apply_cp, cp_group
        t.append(Transform("context_parallel", partial(apply_cp, group=cp_group(dims, device.type))))
    if dims is not None and dims.ep > 1:
        from .parallel.expert import apply_ep
        t.append(Transform("expert_parallel", partial(apply_ep, mesh=dims.expert_mesh)))
    if cfg.lora.rank:
        from .adapters.lora import lora_settings, lora_transforms
        t += lora_transforms(lora_settings(cfg), seed=cfg.train.seed, path=cfg.model.path,
                             mixed_precision=cfg.train.mixed_precision, quantize_base=cfg.lora.quantize_base,
                             shards=shards)
    if cfg.ac.mode == "op":
        from .memory.sac import op_level
        t.append(Transform("ac", op_level()))
    if cfg.ac.offload and not cuda:
        print0("note: ac.offload is a no-op on CPU: activations already live in host memory")
    elif cfg.ac.offload:
        from .memory.offload import HostOffload, Offloaded
        # one copy stream and block order for the model
        t.append(Transform("ac", partial(Offloaded, offload=HostOffload())))
    return t


def _samples_apart(model, layers) -> None:
    """Layers that mix tokens other than through attention (attention.mixing_problem) run each packed sample apart."""
    if mixing_problem(model, layers):
        from .kernels.linear_attention import apply_sample_boundaries
        apply_sample_boundaries(model, layers)


def _kernels(model, layers, *, experts: str, liger: bool, compile: bool) -> None:
    """The MoE experts' implementation (a dense model has none), then Liger's kernels."""
    if router_recorder(model) is not None:
        from .kernels.moe import apply_experts_implementation
        apply_experts_implementation(model, experts)
    if liger:
        from .kernels.liger import apply_kernels
        apply_kernels(model, compile)


def task(cfg: Config, run: Run, name: str = "sft") -> Task:
    """The loop's Task of `name` ("sft", "dpo": tasks/dpo.py) for the built `run`, with what the model's capabilities
    add: float8's scales after each optimizer step, an MoE router's load-balancing loss (sft)."""
    if cfg.model.fp8 != "off":
        from .kernels.float8 import float8_scales
        float8_scales(cfg, run)
    if name == "dpo":
        from .tasks.dpo import dpo_task
        setup = dpo_task(cfg, run)
    else:
        setup = sft_task(cfg, run)
    if router_recorder(run.model) is None and cfg.moe.aux_loss_coef <= 0:
        return setup
    from .kernels.moe import build_router_loss, router_task
    router = build_router_loss(run.model, cfg.moe.aux_loss_coef, name)
    return router_task(setup, router) if router is not None else setup


def sft_task(cfg: Config, run: Run) -> Task:
    """sft's task: the label loss; cp's row split; held-out evaluation before and after."""
    task = Task()
    if run.dims.cp > 1:
        from .parallel.context import collate_split, cp_rank
        task.collate = partial(collate_split, rank=cp_rank(run.dims), n=run.dims.cp)
    # eval.num_samples=0: no evaluation (not 0 of 0)
    if cfg.eval.path and cfg.eval.num_samples:
        from .tasks.evaluate import evaluate, report_eval
        ec = cfg.eval
        held_out = partial(evaluate, run.model, run.tokenizer, ec.path, ec.num_samples, ec.max_new_tokens, run.device,
                           cfg.data.chat_template_kwargs)
        task.evaluate_before = held_out
        task.evaluate_after = lambda before: report_eval(held_out(), before, run.out)
    return task


def labellers(name: str) -> dict:
    """The formats `name`'s rows are labelled by besides conversations (dpo: preference pairs)."""
    if name != "dpo":
        return {}
    from .tasks.dpo import LABELLERS
    return LABELLERS


def samples(cfg: Config, labellers: dict) -> dict:
    """build_samples' labellers, hint and stream for `cfg`: rows streamed (data/streaming.py), else a mixture."""
    from .data.label_hints import way_out
    if cfg.data.streaming:
        from .data.streaming import Streamed as stream
    else:
        from .data.mixture import Mixture as stream
    return {"labellers": labellers, "hint": way_out, "stream": stream}
