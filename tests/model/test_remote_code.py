"""The remote code copied into every checkpoint (model/remote/) gives k3rl's logits without k3rl.

Two tiny K3 models, one per on-disk layout (the contract of issue 18), together covering: KDA with the
gate lower bound and KDA unbounded, the full-rank and the low-rank output gate, NoPE MLA and RoPE MLA,
q_lora and a full-rank q_proj, MoE with shared experts and latent MoE (with its norm), sigmoid and softmax
routers, grouped top-k, a non-zero selection bias, routed scaling, SiTU-GLU and SwiGLU, AttnRes, dense first
layers, logit_scale, and (kimi_k3) images on, whose native patch weight stays outside the index.

Each is saved as a Hugging Face directory; then ONE fresh Python process, whose imports of k3rl's packages
(`model`, `kernels`, `rl`, `rollout`, `envs`) find nothing — the venv installs k3rl in editable mode, so the
child removes that install's meta-path finder and the repository from sys.path, checks that
`importlib.util.find_spec` finds none of the five, and at the end that none was imported (a finder that
raises ImportError for them would not model a machine without k3rl: transformers probes
`find_spec("kernels")`, the name of Hugging Face's kernel-hub package, and expects None) — loads both with
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`, checks that no key is missing,
unexpected or mismatched, and writes its logits on fixed tokens (one row left-padded). The parent compares:

* float32 load vs the native float32 model: max |Δ| ≤ 2e-5 (logits here are O(0.1–1)). The two differ only
  in the order of float32 operations — the native model runs KDA chunked (64-token chunks, a triangular
  inverse), MLA through SDPA and the experts grouped; the remote code runs the per-token recurrence, an
  explicit softmax and an expert loop — measured ~1e-6;
* float64 load vs the native model in float64 (the same fp32-valued weights): max |Δ| ≤ 1e-10, so any
  difference in the math, not rounding, fails.

A second test loads the same directories in this process, after k3rl has registered its own checkpoint
conversions, to show those do not reach the remote classes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from k3_factory import make_config, make_model
from model.hf_names import split_experts

REMOTE = Path(__file__).resolve().parents[2] / "model" / "remote"
LAYOUTS = ("kimi_linear", "kimi_k3")
FP32_TOL, FP64_TOL = 2e-5, 1e-10

CHILD = r'''
import importlib.abc, importlib.util, sys
from pathlib import Path

BLOCKED = ("model", "kernels", "rl", "rollout", "envs")
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
        with torch.no_grad():
            logits = model.eval()(ids, attention_mask=mask).logits
        torch.save(logits, root / f"{layout}_{str(dtype)[6:]}.pt")
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


def _save(model, directory: Path, layout: str) -> None:
    """The model in `layout`: model/hf_layout.py `save_model` when k3rl has it, else written here by the
    contract (config.json with auto_map, per-expert names, an index over two shards, the remote files)."""
    try:
        from model.hf_layout import save_model
    except ImportError:
        save_model = None
    if save_model is not None:
        save_model(model, directory, layout=layout)
        return
    directory.mkdir(parents=True)
    text = {"model_type": "kimi_linear", **model.config.model_config_dict(),
            "head_dim": model.config.hidden_size // model.config.num_attention_heads,
            "num_key_value_heads": model.config.num_attention_heads, "use_grouped_topk": True,
            "topk_method": "noaux_tc", "num_nextn_predict_layers": 0, "dtype": "float32"}
    tensors = {k: v.contiguous() for k, v in split_experts(model.state_dict().items())}
    patch = {k: tensors.pop(k) for k in list(tensors) if k.startswith("model.patch_embed.")}
    arch = "KimiLinearForCausalLM" if layout == "kimi_linear" else "KimiK3ForConditionalGeneration"
    cfg_cls = "KimiLinearConfig" if layout == "kimi_linear" else "KimiK3Config"
    head = {"architectures": [arch], "auto_map": {"AutoConfig": f"configuration_kimi_k3.{cfg_cls}",
                                                  "AutoModelForCausalLM": f"modeling_kimi_k3.{arch}"}}
    if layout == "kimi_linear":
        config = {**text, **head}
    else:
        config = {"model_type": "kimi_k3", **head, "text_config": text,
                  "vision_config": {"patch_size": 14, "text_hidden_size": text["hidden_size"]},
                  "media_placeholder_token_id": text["media_placeholder_token_id"],
                  "pad_token_id": text["pad_token_id"], "ignore_index": -100}
        tensors = {"language_model." + k: v for k, v in tensors.items()}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    names = sorted(tensors)
    shards = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: tensors[k] for k in shard}, directory / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if patch:
        save_file(patch, directory / "k3rl_patch_embed.safetensors")
    for file in REMOTE.glob("*.py"):
        (directory / file.name).write_text(file.read_text())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(root, {layout: native fp32 model}, ids, mask) with both checkpoints and the inputs written under root."""
    root = tmp_path_factory.mktemp("remote_code")
    models = {}
    for seed, (layout, config) in enumerate(_configs().items()):
        model = make_model(config, dtype=torch.float32, seed=seed)
        with torch.no_grad():
            for module in model.modules():
                if hasattr(module, "e_score_correction_bias"):
                    # a non-zero selection bias, so selecting on s + b vs s is visible in the logits
                    module.e_score_correction_bias.normal_(0.0, 0.05)
        _save(model, root / layout, layout)
        models[layout] = model
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(6, 97, (2, 19), generator=gen)  # [B, T], no image placeholder (5)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # row 0: four left-padding tokens
    torch.save((ids, mask), root / "inputs.pt")
    return root, models, ids, mask


def _native(model, ids, mask, dtype):
    m = model.to(dtype)
    with torch.no_grad():
        logits = m(ids, attention_mask=mask).logits
    model.to(torch.float32)
    return logits


def _compare(logits, native, mask, tol, what):
    valid = mask.bool()  # padding positions are not compared (neither model defines them)
    diff = (logits[valid] - native[valid]).abs().max().item()
    assert logits.shape == native.shape, what
    assert diff <= tol, f"{what}: max |Δlogits| = {diff:.3g} > {tol:g}"
    return diff


def test_remote_code_without_k3rl(saved):
    root, models, ids, mask = saved
    script = root / "load_without_k3rl.py"
    script.write_text(textwrap.dedent(CHILD))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    env.update(HF_MODULES_CACHE=str(root / "hf_modules"), HF_HUB_OFFLINE="1", PYTHONNOUSERSITE="1")
    proc = subprocess.run([sys.executable, str(script), str(root), str(REMOTE.parents[1])], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "KimiLinearForCausalLM" in proc.stdout and "KimiK3ForConditionalGeneration" in proc.stdout
    diffs = {}
    for layout, model in models.items():
        for dtype, tol in ((torch.float32, FP32_TOL), (torch.float64, FP64_TOL)):
            logits = torch.load(root / f"{layout}_{str(dtype)[6:]}.pt")
            assert logits.dtype == dtype
            diffs[layout, dtype] = _compare(logits, _native(model, ids, mask, dtype), mask, tol, f"{layout} {dtype}")
    print({f"{k[0]} {k[1]}": f"{v:.2e}" for k, v in diffs.items()})


def test_remote_code_beside_k3rl(saved):
    """In a process where k3rl registered its checkpoint conversions, the remote classes still load every tensor
    under its own name (transformers applies no conversion mapping to remote code)."""
    import model.modeling  # noqa: F401  (registers k3rl's conversions)
    from transformers import AutoModelForCausalLM

    root, models, ids, mask = saved
    for layout, native in models.items():
        remote, info = AutoModelForCausalLM.from_pretrained(root / layout, trust_remote_code=True,
                                                            dtype=torch.float32, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        experts = [n for n in remote.state_dict() if ".experts." in n]
        n_moe = sum(layer.is_moe for layer in native.model.layers)
        assert len(experts) == 3 * native.config.num_experts * n_moe, experts
        assert all(re.search(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$", n) for n in experts), experts
        with torch.no_grad():
            logits = remote.eval()(ids, attention_mask=mask).logits
        _compare(logits, _native(native, ids, mask, torch.float32), mask, FP32_TOL, f"{layout} in-process")
