"""Mixture-of-experts models: the router's load-balancing loss over the global batch (RouterLoss), the experts
implementation (grouped GEMM, batched or per-expert loop).

The load-balancing loss is transformers' `load_balancing_loss_func` (Switch Transformer eq. 4-6, summed over the MoE
layers): aux = E * sum_e f_e * P_e, f_e the share of the router's own top-k assignments to expert e (DeepSeek-V3's
grouped, bias-corrected ones; transformers recounts a softmax top-k), P_e its mean router probability (softmax),
over the real tokens of the GLOBAL batch (counts all-reduced: the same value at any world size and micro-batch split).
The gradient flows through each rank's own P_e; f_e counts every rank's tokens of the micro-batch (2 ranks == 1
process, exactly), and across the micro-batches of a step each one's f_e is weighed by its share of the step's tokens
(the later ones have not run at its backward); the reported value is the exact global one.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch
from torch import nn

from ..config import ConfigError
from ..distributed import all_reduce, print0
from ..data import IGNORE_INDEX
from ..errors import ModelError, one_line
from ..model import find_experts, router_recorder
from ..task import Task

EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "eager", "batched_mm")


def apply_experts_implementation(model: nn.Module, name: str) -> None:
    """Run the experts of an MoE `model` (built from its config, before any wrapping) with `name` (one of
    EXPERTS_IMPLEMENTATIONS), printed once; a model whose experts cannot (custom code, a per-expert module list)
    runs its own loop, with a one-line note. A dense model is left as it is."""
    if name not in EXPERTS_IMPLEMENTATIONS:
        raise ConfigError(f"model.experts_implementation must be one of {', '.join(map(repr, EXPERTS_IMPLEMENTATIONS))}"
                          f", got {name!r}")
    if router_recorder(model) is None:
        return
    model.config.output_router_logits = False  # RouterLoss records them: transformers' capture recompiles per layer
    if not type(model)._can_set_experts_implementation():
        print0(f"note: the experts of {type(model).__name__} cannot use model.experts_implementation={name}: they run "
               f"the model's own per-expert loop (eager)")
        return
    try:
        model.set_experts_implementation(name)
    except (ValueError, ImportError, KeyError) as e:
        print0(f"note: model.experts_implementation={name} cannot run here ({one_line(e)}): the experts run eager")
        model.set_experts_implementation("eager")
    experts = find_experts(model)
    print0(f"moe: experts {model.config._experts_implementation} ({len(experts)} MoE layers"
           f"{f' of {experts[0].num_experts} experts' if experts else ''})")


class ExpertsView:
    """An experts module as its own forward sees it through `self`: the tensors it computes with, their count."""

    def __init__(self, module: nn.Module, tensors: dict, num_experts: int):
        self.__dict__.update(tensors, num_experts=num_experts, _module=module)

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def expert_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the experts forward of `module` computes with: each of its own parameters (a DTensor's local part:
    this rank's experts under expert parallel), through its `adapt_experts` (LoRA on the experts) where it has one."""
    tensors = {n: p.to_local() if hasattr(p, "to_local") else p for n, p in module.named_parameters(recurse=False)}
    adapt = vars(module).get("adapt_experts")
    return adapt(tensors) if adapt is not None else tensors


def default_aux_coef(model: nn.Module) -> float:
    """The architecture's router_aux_loss_coef; 0 without routers or one (DeepSeek-V3 balances with a bias)."""
    if router_recorder(model) is None:
        return 0.0
    return float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)


def real_token_mask(batch: dict) -> torch.Tensor:
    """(batch * seq,) float: 1 for the real tokens of a micro-batch, 0 for padding. Padded rows carry an
    attention_mask; packed rows (position_ids, no mask) end in padding whose position ids are 0 after the last
    sample's (a sample of 2+ tokens ends at a position > 0; a 1-token sample has no label and is never kept)."""
    if "attention_mask" in batch:
        return batch["attention_mask"].reshape(-1).float()
    pos = batch["position_ids"]
    idx = torch.arange(pos.shape[-1], device=pos.device).expand_as(pos)
    last = torch.where(pos != 0, idx, torch.zeros_like(idx)).amax(dim=-1, keepdim=True)
    return (idx <= last).reshape(-1).float()


class RouterLoss:
    """Collects each router's logits through forward hooks while `collect(batch)` is open (a recompute under
    activation checkpointing runs in backward, outside it, and is not counted twice). Per step: begin_step, then per
    micro-batch `with collect(batch): loss = ...; loss = loss + micro_batch_loss()`, then end_step (the value)."""

    def __init__(self, model: nn.Module, coef: float):
        cls, self.index = router_recorder(model)
        self.coef, self.top_k = coef, int(model.config.num_experts_per_tok)
        self.gates = [m for m in model.modules() if isinstance(m, cls)]
        if not self.gates:
            raise ModelError(f"{type(model).__name__} records router logits from {cls.__name__}, but has none")
        self.active, self.mask = False, None
        for gate in self.gates:
            gate.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        # no op here, only a reference: under activation checkpointing the block re-runs in backward and must save
        # the same tensors as in forward, so the loss's ops run after the forward (micro_batch_loss). Kept on the
        # router itself: a shared list's length would be a guard of the compiled block, a recompile per layer
        if self.active:
            module.routed_logits = output[self.index] if isinstance(output, tuple) else output
            module.routed_experts = self.selection(output)

    def selection(self, output) -> torch.Tensor | None:
        """The experts the router sent each token to: the integer (tokens, top_k) tensor of its output (DeepSeek-V3's
        and GLM-4.5's pick groups, then adds a bias: no top-k of the logits recomputed here gives it); None where the
        router hands out only logits, whose top-k (softmax and sigmoid keep their order) is then its selection."""
        for t in output if isinstance(output, tuple) else ():
            if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.shape[-1:] == (self.top_k,):
                return t
        return None

    def _sums(self, name: str, logits: torch.Tensor, selected) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-k assignment counts per expert of the router's own `selected`, detached; router probability sums per
        expert) over the real tokens."""
        logits = logits.reshape(-1, logits.shape[-1])
        if logits.shape[0] != self.mask.numel():
            raise ModelError(f"the router of {name} saw {logits.shape[0]} tokens, the micro-batch has "
                             f"{self.mask.numel()}: moe.aux_loss_coef cannot run with this layout (set it to 0)")
        probs = torch.softmax(logits.float(), dim=-1)
        if selected is None:
            selected = torch.topk(probs, self.top_k, dim=-1).indices
        num_experts = probs.shape[-1]
        # an index outside the experts (a token the router dropped) is counted in a slot that is cut off
        selected = selected.reshape(-1).long()
        selected = torch.where((selected >= 0) & (selected < num_experts), selected, num_experts)
        counts = torch.zeros(num_experts + 1, device=probs.device).scatter_add_(
            0, selected, self.mask.repeat_interleave(self.top_k))[:num_experts]
        return counts, (probs * self.mask[:, None]).sum(dim=0)

    def begin_step(self, micro_batches: list[dict], num_label_tokens: int, device) -> None:
        """The step's global label-token count (train_step divides the gradients by it: the loss term is scaled up
        to match) and real-token count, in one all-reduce."""
        num_real = sum(float(real_token_mask(b).sum()) for b in micro_batches)
        totals = torch.tensor([num_label_tokens, num_real], dtype=torch.float64, device=device)
        all_reduce(totals)
        self.label_count, self.num_rows = totals[0].clamp(min=1), totals[1] * len(self.gates)
        self.step_sums = None

    @contextmanager
    def collect(self, batch: dict):
        self.mask, self.active = real_token_mask(batch), True
        try:
            yield
        finally:
            self.active = False

    def micro_batch_loss(self) -> torch.Tensor:
        """The differentiable term of this micro-batch (scaled by the global label count: see begin_step)."""
        parts = [(type(g).__name__, vars(g).pop("routed_logits"), vars(g).pop("routed_experts"))
                 for g in self.gates if "routed_logits" in vars(g)]
        if not parts:
            raise ModelError("moe.aux_loss_coef: no router ran in this micro-batch")
        sums = [self._sums(*part) for part in parts]
        counts = torch.stack([c for c, _ in sums]).sum(dim=0)
        probs = torch.stack([p for _, p in sums]).sum(dim=0)
        rows = self.mask.sum() * len(parts)
        local = torch.cat([counts, probs.detach(), rows[None]]).double()
        self.step_sums = local if self.step_sums is None else self.step_sums + local
        this = torch.cat([counts, rows[None]]).double()
        all_reduce(this)  # this micro-batch's counts over every rank
        share = (this[:-1] / this[-1].clamp(min=1)).float()
        scale = (self.coef * counts.numel() * self.label_count / self.num_rows.clamp(min=1)).float()
        return scale * (share * probs).sum()

    def end_step(self) -> torch.Tensor:
        """The step's load-balancing loss over the global batch (float64 device tensor; without the coefficient)."""
        sums = self.step_sums.clone()
        all_reduce(sums)
        num_experts = (sums.numel() - 1) // 2
        rows = sums[-1].clamp(min=1)
        return num_experts * ((sums[:num_experts] / rows) * (sums[num_experts:-1] / rows)).sum()


def build_router_loss(model: nn.Module, coef: float, task: str = "sft") -> RouterLoss | None:
    """The RouterLoss of `model` at `coef` (-1: the architecture's, default_aux_coef), or None when that is 0 or the
    model has no router; prints the coefficient an MoE model trains with."""
    if router_recorder(model) is None:
        if coef > 0:
            raise ConfigError(f"moe.aux_loss_coef={coef}: {type(model).__name__} has no router")
        return None
    resolved = default_aux_coef(model) if coef == -1 else coef
    if task != "sft" and resolved > 0:
        print0(f"note: finetune {task} adds no router load-balancing loss (moe.aux_loss_coef applies to sft)")
        return None
    print0(f"moe: router load-balancing loss coefficient {resolved:g}"
           f"{' (the architecture default)' if coef == -1 else ''}{', off' if resolved == 0 else ''}")
    return RouterLoss(model, resolved) if resolved > 0 else None


def router_task(task: Task, router: RouterLoss) -> Task:
    """`task` plus the router's load-balancing term per micro-batch (the reported loss stays the task's), aux_loss."""
    def begin_step(micro_batches: list[dict], device) -> None:
        task.begin_step(micro_batches, device)
        router.begin_step(micro_batches, sum(int((b["label_targets"] != IGNORE_INDEX).sum()) for b in micro_batches),
                          device)

    def loss(model, batch: dict):
        with router.collect(batch):
            value, stats = task.loss(model, batch)
        return value + router.micro_batch_loss(), {"loss": value.detach(), **stats}

    def end_step() -> dict:
        return {**task.end_step(), "aux_loss": router.end_step()}
    return replace(task, loss=loss, begin_step=begin_step, end_step=end_step)
