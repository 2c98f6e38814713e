"""The remote code copied into every checkpoint (model/formats/remote/) gives k3rl's logits without k3rl.

Two tiny K3 models, one per on-disk layout (the contract of issue 18), together covering: KDA with the
gate lower bound and KDA unbounded, the full-rank and the low-rank output gate, NoPE MLA and RoPE MLA,
q_lora and a full-rank q_proj, MoE with shared experts and latent MoE (with its norm), sigmoid and softmax
routers, grouped top-k, a non-zero selection bias, routed scaling, SiTU-GLU and SwiGLU, AttnRes, dense first
layers, logit_scale, and (kimi_k3) images on, whose native patch weight stays outside the index.

Each is saved by model/formats/save.py `save_model` (which copies model/formats/remote/*.py in); then ONE fresh Python
process loads both with `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` in float32 and
float64, checks that no key is missing, unexpected or mismatched and that the experts keep their per-expert
names, writes its logits on fixed tokens (one row left-padded) and runs `generate`. k3rl (the `k3rl`
namespace, and the bare folder names `model`, `kernels`, `rl`, `rollout`, `envs`, `util` in case a stray copy
exists) is out of that process's reach: the venv installs k3rl in editable mode, so the child removes that
install's meta-path finder and the repository from sys.path, checks that `importlib.util.find_spec` finds none
of them, and at the end that none was imported. (A finder that
raises ImportError for them would not model a machine without k3rl: transformers probes
`find_spec("kernels")`, the name of Hugging Face's kernel-hub package, and expects None.)
The parent compares:

* float32 load vs the native float32 model: max |Δ| ≤ 2e-5 (logits here are O(0.1–1)). The two differ only
  in the order of float32 operations — the native model runs KDA chunked (64-token chunks, a triangular
  inverse), MLA through SDPA and the experts grouped; the remote code runs the per-token recurrence, an
  explicit softmax and an expert loop — measured ~1e-6;
* float64 load vs the native model in float64 (the same fp32-valued weights): max |Δ| ≤ 1e-10, so any
  difference in the math, not rounding, fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from k3_factory import make_config, make_model

from k3rl.model.formats.save import save_model

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = ("kimi_linear", "kimi_k3")
FP32_TOL, FP64_TOL = 2e-5, 1e-10

CHILD = r'''
import importlib.abc, importlib.util, re, sys
from pathlib import Path

# k3rl installs one namespace; the folder names are listed too so that a stray top-level copy is caught
BLOCKED = ("k3rl", "model", "kernels", "rl", "rollout", "envs", "util")
REPO = sys.argv[2]

# k3rl out of reach: the editable install's finder and path hook go, and so does the repository on sys.path;
# every look-up of k3rl's top-level names is recorded (transformers itself probes `kernels`, the name of
# Hugging Face's kernel-hub package, with importlib.util.find_spec).
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path[:] = [p for p in sys.path if "__editable__" not in p and Path(p or ".").resolve() != Path(REPO)]
sys.path_importer_cache.clear()
asked = set()


class RecordK3rl(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            asked.add(name)
        return None


sys.meta_path.insert(0, RecordK3rl())
absent = {name: importlib.util.find_spec(name) for name in BLOCKED}
assert not any(absent.values()), f"k3rl still importable: {absent}"

import torch
from transformers import AutoModelForCausalLM

root = Path(sys.argv[1])
ids, mask = torch.load(root / "inputs.pt")
for layout in ("kimi_linear", "kimi_k3"):
    for dtype in (torch.float32, torch.float64):
        model, info = AutoModelForCausalLM.from_pretrained(
            root / layout, trust_remote_code=True, dtype=dtype, output_loading_info=True)
        bad = {k: sorted(v) for k, v in info.items() if v}
        assert not bad, f"{layout}: {bad}"
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        experts = [n for n in model.state_dict() if ".experts." in n]
        assert experts and all(re.search(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$", n)
                               for n in experts), experts
        with torch.no_grad():
            logits = model.eval()(ids, attention_mask=mask).logits
        torch.save(logits, root / f"{layout}_{str(dtype)[6:]}.pt")
        if dtype == torch.float32:
            # generate (no cache: each step reruns the sequence) starts with the greedy token of these logits
            out = model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
            assert torch.equal(out[:, ids.shape[1]], logits[:, -1].argmax(-1)), (out, logits[:, -1].argmax(-1))
        print(layout, dtype, type(model).__name__, model.config.model_type, flush=True)
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not leaked, f"k3rl modules imported: {leaked}"
print("k3rl names looked up (none found):", sorted(asked))
'''


def _configs():
    """kimi_linear: bounded gate, NoPE, q_lora, SiTU, sigmoid router, shared experts, full-rank KDA gate.
    kimi_k3: unbounded gate, RoPE, full-rank q_proj, SwiGLU, softmax grouped router, latent MoE + norm,
    low-rank KDA gate, routed scaling, logit_scale, images on."""
    return {
        "kimi_linear": make_config(),
        "kimi_k3": make_config(
            num_hidden_layers=5, kda_layers=(1, 2, 4),
            linear_attn_config=dict(gate_lower_bound=None, use_full_rank_gate=False),
            mla_use_nope=False, rope_theta=500.0, q_lora_rank=None, hidden_act="silu",
            num_experts=8, num_expert_group=4, topk_group=2, moe_router_activation_func="softmax",
            routed_scaling_factor=2.5, routed_expert_hidden_size=24, latent_moe_use_norm=True,
            num_shared_experts=2, logit_scale=0.7, media_placeholder_token_id=5, attn_res_block_size=3),
    }


def _native_logits(model, ids, mask) -> dict:
    """{dtype: logits} of the native model in float32 and float64 (its weights hold fp32 values: exact in both)."""
    out = {}
    for dtype in (torch.float32, torch.float64):
        with torch.no_grad():
            out[dtype] = model.to(dtype)(ids, attention_mask=mask).logits
    return out


def test_remote_code_without_k3rl(tmp_path):
    root = tmp_path
    models = {}
    for seed, (layout, config) in enumerate(_configs().items()):
        model = make_model(config, dtype=torch.float32, seed=seed)
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "e_score_correction_bias"):
                    # a non-zero selection bias, so selecting on s + b vs s is visible in the logits
                    module.e_score_correction_bias.normal_(0.0, 0.05)
        save_model(model, root / layout, layout=layout)
        models[layout] = model
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(6, 97, (2, 19), generator=gen)  # [B, T], no image placeholder (5)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # row 0: four left-padding tokens
    torch.save((ids, mask), root / "inputs.pt")

    script = root / "load_without_k3rl.py"
    script.write_text(textwrap.dedent(CHILD))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # One intra-op thread: the ops are tiny, and on a busy machine threads that wait for each other made each
    # forward seconds instead of tens of milliseconds.
    env.update(HF_MODULES_CACHE=str(root / "hf_modules"), HF_HUB_OFFLINE="1", PYTHONNOUSERSITE="1",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    child = subprocess.Popen([sys.executable, str(script), str(root), str(REPO)], cwd=root, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # The native logits are computed while the child imports torch and transformers (on one thread, as there).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        native = {layout: _native_logits(model, ids, mask) for layout, model in models.items()}
    finally:
        torch.set_num_threads(threads)
    out, err = child.communicate(timeout=300)
    assert child.returncode == 0, out[-3000:] + err[-5000:]
    assert "KimiLinearForCausalLM" in out and "KimiK3ForConditionalGeneration" in out, out

    valid = mask.bool()  # padding positions are not compared (neither model defines them)
    diffs = {}
    for layout in LAYOUTS:
        for dtype, tol in ((torch.float32, FP32_TOL), (torch.float64, FP64_TOL)):
            logits = torch.load(root / f"{layout}_{str(dtype)[6:]}.pt")
            assert logits.dtype == dtype and logits.shape == native[layout][dtype].shape, (layout, dtype)
            diff = (logits[valid] - native[layout][dtype][valid]).abs().max().item()
            assert diff <= tol, f"{layout} {dtype}: max |Δlogits| = {diff:.3g} > {tol:g}"
            diffs[f"{layout} {dtype}"] = f"{diff:.2e}"
    print("max |Δlogits| remote vs native:", diffs)
