"""Tests of rl/train/optim.py: `ExpertMuon` on stacked experts equals `torch.optim.Muon` on the experts as separate
2-D parameters, and `build_optimizers` routes each parameter to the right optimizer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from k3rl.rl.train.optim import ExpertMuon, build_optimizers


def test_expert_muon_equals_torch_muon_per_expert():
    g = torch.Generator().manual_seed(0)
    stacked = torch.nn.Parameter(torch.randn(3, 6, 10, generator=g))
    separate = [torch.nn.Parameter(stacked.detach()[e].clone()) for e in range(3)]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="match_rms_adamw")
    ours, theirs = ExpertMuon([stacked], **kw), torch.optim.Muon(separate, **kw)
    for _ in range(3):
        grad = torch.randn(3, 6, 10, generator=g)
        stacked.grad = grad.clone()
        for e, p in enumerate(separate):
            p.grad = grad[e].clone()
        ours.step()
        theirs.step()
    for e, p in enumerate(separate):
        torch.testing.assert_close(stacked.detach()[e], p.detach(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="stacked matrices"):
        ExpertMuon([torch.nn.Parameter(torch.zeros(4, 4))])


class Tiny(torch.nn.Module):
    """Embedding, LM head, one hidden matrix, stacked experts, a norm weight."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 4)
        self.hidden = torch.nn.Linear(4, 4, bias=False)
        self.experts = torch.nn.Parameter(torch.randn(3, 5, 4))
        self.norm = torch.nn.Parameter(torch.ones(4))
        self.head = torch.nn.Linear(4, 11, bias=False)

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head


def test_build_optimizers_groups():
    model = Tiny()
    params = list(model.parameters())
    cfg = SimpleNamespace(optimizer="muon", lr=1e-3, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.95,
                          adam_eps=1e-8, muon_momentum=0.95)
    adamw, muon, expert_muon = build_optimizers(model, params, cfg)
    assert expert_muon.param_groups[0]["params"] == [model.experts]
    assert muon.param_groups[0]["params"] == [model.hidden.weight]
    decay, no_decay = adamw.param_groups
    assert decay["params"] == [model.embed.weight, model.head.weight] and decay["weight_decay"] == 0.01
    assert no_decay["params"] == [model.norm] and no_decay["weight_decay"] == 0.0
    cfg.optimizer = "adamw"
    (only,) = build_optimizers(model, params, cfg)
    assert sum(len(g["params"]) for g in only.param_groups) == 5
