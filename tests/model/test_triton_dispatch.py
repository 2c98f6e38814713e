"""The whole K3 model through the Triton kernels, interpreted on the CPU.

With K3RL_FORCE_TRITON=1 every op entry point (kernels/dispatch.py) takes its Triton path on CPU tensors:
chunked KDA with the fused gate (forward and backward), the KDA decode step, the AttnRes mix, the routed experts
(grouped GEMM with SiTU-GLU fused) and the shared experts' SiTU-GLU. A float32 model run that way must give the
logits and the gradients of every parameter that the PyTorch paths give, for both gate forms, and a prefill
followed by decode steps must give the full pass's logits. Each Triton entry is counted, so a dispatch that
silently fell back to PyTorch fails here.
"""

from __future__ import annotations

import pytest
import torch
from k3_factory import make_model

import k3rl.kernels.attn_res as attn_res_entry
import k3rl.kernels.kda.chunk_triton as kda_chunk_triton
import k3rl.kernels.kda.recurrent_triton as kda_recurrent_triton
import k3rl.kernels.moe as moe
import k3rl.kernels.situ.fused as situ_fused

pytestmark = pytest.mark.triton


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def count_triton_calls(monkeypatch) -> dict[str, int]:
    """Wrap each Triton entry so the test sees which ones ran."""
    calls: dict[str, int] = {}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(kda_chunk_triton, "chunk_kda_triton", counted("chunk_kda", kda_chunk_triton.chunk_kda_triton))
    monkeypatch.setattr(kda_recurrent_triton, "fused_recurrent_kda_triton",
                        counted("fused_recurrent_kda", kda_recurrent_triton.fused_recurrent_kda_triton))
    monkeypatch.setattr(attn_res_entry, "attn_res_mix_triton", counted("attn_res", attn_res_entry.attn_res_mix_triton))
    monkeypatch.setitem(moe.IMPLEMENTATIONS, "triton", counted("moe", moe.IMPLEMENTATIONS["triton"]))
    monkeypatch.setattr(situ_fused, "situ_glu_triton", counted("situ", situ_fused.situ_glu_triton))
    return calls


def logits_and_grads(model, ids, weights):
    model.zero_grad()
    logits = model(ids).logits  # [B, T, V]
    (logits * weights).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_model_forward_backward_through_triton(lower_bound, monkeypatch):
    # layer 0 MLA with a dense SiTU FFN, layer 1 KDA with routed + shared experts; the interpreter is slow, so
    # one 40-token row (a partial chunk: the kernel tests cover full chunks, lengths and varlen)
    model = make_model(dtype=torch.float32, num_hidden_layers=2, kda_layers=(1,),
                       linear_attn_config={"gate_lower_bound": lower_bound})
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=gen)
    weights = torch.randn(1, 40, model.config.vocab_size, generator=gen)
    ref_logits, ref_grads = logits_and_grads(model, ids, weights)

    calls = count_triton_calls(monkeypatch)
    monkeypatch.setenv("K3RL_FORCE_TRITON", "1")
    logits, grads = logits_and_grads(model, ids, weights)
    assert {"chunk_kda", "attn_res", "moe", "situ"} <= set(calls), calls
    # fp32 both ways; the kernels sum in other orders (tiles, fused gate): agreement to ~1e-6 relative
    assert rel(logits, ref_logits) < 1e-4
    assert set(grads) == set(ref_grads)
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        assert rel(grad, ref_grads[name]) < 1e-3, f"{name}: {rel(grad, ref_grads[name]):.2e}"


def test_prefill_then_decode_through_triton(monkeypatch):
    model = make_model(dtype=torch.float32, num_hidden_layers=2, kda_layers=(1,))
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(ids).logits
        calls = count_triton_calls(monkeypatch)
        monkeypatch.setenv("K3RL_FORCE_TRITON", "1")
        out = model(ids[:, :21], use_cache=True)
        steps = [out.logits] + [model(ids[:, t:t + 1], cache=out.cache).logits for t in range(21, 24)]
    assert calls.get("chunk_kda", 0) > 0 and calls.get("fused_recurrent_kda", 0) > 0, calls
    assert rel(torch.cat(steps, dim=1), full) < 1e-4
