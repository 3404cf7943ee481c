"""ac.offload moves activations only: a compiled checkpointed block's autograd function saves the block's
parameters beside its input; those stay where they are (no host copy, no copy back), with and without compile."""
from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from torch import nn

from finetune.compat import storage_key
from finetune.memory.offload import HostOffload, Offloaded
from finetune.model import apply_ac, apply_compile, find_layers
from finetune.weights import clean_fqn


@pytest.fixture(scope="module")
def model2():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).float().train()


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {clean_fqn(n): p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_offload_packs_activations_and_never_a_parameter(model2, monkeypatch, compiled):
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    want = loss_and_grads(copy.deepcopy(model2), ids)
    model = copy.deepcopy(model2)
    apply_ac(model, 1.0, [partial(Offloaded, offload=HostOffload())])  # the "ac" transform, as build makes
    if compiled:  # apply_compile's path, with a backend that needs no C++ compiler: AOTAutograd saves as inductor
        compile_ = nn.Module.compile
        monkeypatch.setattr(nn.Module, "compile", lambda self, **kw: compile_(self, backend="aot_eager", **kw))
        torch._dynamo.reset()
        apply_compile(model, True)
    host = find_layers(model)[0].offload
    params = {storage_key(p.untyped_storage()) for p in model.parameters()}
    packed = []
    pack = host.pack

    def counting_pack(t):
        packed.append(isinstance(t, nn.Parameter) or storage_key(t.untyped_storage()) in params)
        out = pack(t)
        packed[-1] = (packed[-1], out is not t)  # (a parameter, copied to the host)
        return out

    monkeypatch.setattr(host, "pack", counting_pack)
    got = loss_and_grads(model, ids)
    copied = [is_param for is_param, moved in packed if moved]
    assert copied and not any(copied), packed  # activations went to the host; no parameter did
    torch.testing.assert_close(got[0], want[0])
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, msg=name)
