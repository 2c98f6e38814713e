"""The cost of a staged pretraining run, computed without running it: what `k3rl pretrain CONFIG --plan` prints.

For every stage of `pretrain.stages` (rl/config.py `StageConfig`): the token budget rounded up to whole optimizer
steps, the steps and rows, the training FLOPs, the memory one rank needs (the activations of one micro-batch, the
weights, gradients and optimizer states) and the time on the cluster of `pretrain.plan`. Nothing is allocated: the
parameter counts come from `model.params.count_parameters` (one layer of each kind on the meta device), the rest
is arithmetic.

FLOPs. Forward per token = 2 × the active parameters without the input embedding (the LM head counts; top-k of the
routed experts), plus what the parameters do not show:
  * MLA, causal attention at length T: scores and values over T/2 earlier keys on average, 2 · T/2 · H · (d_qk + d_v)
    per token and layer (the expanded form the learner trains with, d_qk = qk_nope + qk_rope);
  * KDA, per token and head: 6d² + 10Cd + ⅔C² with d the head dim and C = 64 the chunk (docs PERFORMANCE.md).
Training = 3 × forward. A stage trained segment by segment (`segment_tokens` below `seq_len`, rl/train/segments.py)
runs one more forward (pass 1, no grad): `recompute_flops`, counted in the printed FLOPs and in the time.
Time = FLOPs / (num_gpus × peak × MFU).

Activation memory per rank: the bytes autograd saves for backward during one micro-batch, counted per token and
layer for what OUR implementation keeps (model/*.py, kernels/*), times the tokens alive at once =
min(seq_len, segment_tokens) × rows per micro-batch (`learner.micro_batch_tokens // seq_len`, at least 1, at most
the rank's rows of a step and `learner.micro_batch_seqs`):
  * every layer: two RMSNorms (fp32 copy, normalised value, 1/rms), the two Block-AttnRes mixes over n sources
    (stacked sources and their normalised keys in fp32);
  * KDA: the layer input, the gate's low-rank input, the three short convolutions (unfolded windows — a view of the
    input when the micro-batch is one row — and SiLU input, in fp32), the chunked kernel of kernels/kda/chunk.py
    (fp32 whatever the model dtype: 445.4 + 26.66·K + K²/32 values per token and head for head dim K at C = 64, the
    K²/32 being the two per-chunk states; fitted to the byte on what chunk.py saves at K = 16…128), the gated output
    norm and the output projection's input;
  * MLA: the low-rank query and latent norms, RoPE's cos/sin, q, k and v per head, the output, its sigmoid gate;
    scores: PyTorch's fused SDPA keeps O(T) (output and log-sum-exp) — on CUDA, and on the CPU when d_qk = d_v —
    while the CPU's math path (d_qk ≠ d_v, K3's case) keeps the T × T probabilities (fp32) of every head;
  * dense FFN and shared/routed experts: the input, the SiTU-GLU intermediates (7 per hidden unit on the CPU's
    PyTorch expression, gate and up only in the fused CUDA kernel), the down projection's input; routed: per chosen
    expert the gathered input and the weighted fp32 combine; the router's fp32 scores; the latent MoE's norm.
  * top: the output mix, the final norm, the LM head's input rows and log-sum-exp (never the [N, V] logits,
    model/logprobs.py).
A segmented stage adds what rl/train/segments.py keeps across the segments: the MLA latents (kv_lora_rank +
qk_rope_head_dim values per token and MLA layer) of the whole row, three times (the values, their gradient, the
recomputed segment's copy), and per segment boundary each KDA layer's recurrent state (H·K·K, fp32) and conv
window; the segment being recomputed attends to every earlier key, so its key terms run over the whole row (or,
past model/mla.py's `SCORE_BUDGET`, block by block through the absorbed form, recomputed in backward).
Rows are planned as one document each, the worst case of a packed row (a segmented stage cuts a packed row into its
documents; a document as long as the row is the largest unit). Not counted: transient buffers (gradients in flight
during backward, the LM head's [chunk, V] block and fp32 weight gradient), allocator fragmentation, and what packing
several documents into a row adds: the block-diagonal mask [rows, 1, T, T] each MLA layer builds (1 byte per element
on the CPU's math path; an additive bias in the activation dtype under CUDA's fused SDPA) and KDA's padding of
every document to whole 64-token chunks.

Measured against (`measure_step_memory`, tests/rl/test_pretrain_plan.py): on the tiny model in fp32 the plan is
within 1 % of the peak bytes autograd holds during a real learner step (plan / measured: 382.8 / 382.5 MiB at 512 × 4
rows, 404.8 / 404.8 MiB at 2048 × 1, 106.4 / 105.8 MiB for 2048 tokens in segments of 512; bf16, latent MoE, RoPE
and no-AttnRes variants likewise); the test allows ±10 %. The optimizer states match to the byte (AdamW, Muon).
Only the CPU paths are measured here: the CUDA ones (fused SDPA, the Triton SiTU-GLU) are counted from their code.

Optimizer memory per rank, as our learner keeps it (rl/train/learner.py, rl/train/optim.py): the parameters in the learner's
dtype (the fp32-kept KDA gate/conv parameters in fp32), no fp32 master copy (the optimizers update the parameters
in that dtype), gradients in the parameters' dtype, AdamW's two moments (+ a fp32 step scalar per tensor) or, under
`optimizer: muon`, one momentum for the hidden matrices (2-D and stacked experts) and AdamW for the rest
(embeddings, LM head, norms, vectors). Shown twice: replicated (this learner: data-parallel, every rank holds
everything) and sharded over the cluster's GPUs (FSDP2 / expert parallelism, not built yet).
"""

from __future__ import annotations

import io
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

GiB = 2**30

CHUNK = 64
"""KDA chunk length C (kernels/kda/chunk.py CHUNK_SIZE)."""
# What kernels/kda/chunk.py saves for backward, in fp32 values per token and head: KDA_CORE[0] + KDA_CORE[1]·K
# + K²/KDA_CORE[2] (the two per-chunk K×K states over C = 64 tokens). Fitted exactly (to the byte) to the saved
# bytes of the chunked kernel at K = 16, 32, 48, 64 and 128 (the bool masks and sub-chunk constants left out).
KDA_CORE = (445.375, 26.65625, 32)


@dataclass(frozen=True)
class GPU:
    """An accelerator of a named cluster."""

    name: str
    peak_flops: float
    """Peak dense FLOP/s in the training dtype (bf16 on GPUs)."""
    memory_bytes: int
    kernels: str
    """`cuda` (fused SDPA and SiTU-GLU kernels) or `cpu` (PyTorch's CPU paths): what decides some saved tensors."""
    source: str


GPUS: dict[str, GPU] = {
    # NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16 tensor core (1,979 with 2:4 sparsity), 80 GB HBM3.
    "h100": GPU("h100", 989e12, 80 * GiB, "cuda", "H100 SXM datasheet: 989 TFLOP/s dense bf16, 80 GB"),
    # NVIDIA H200 SXM datasheet: same compute as H100 (989 TFLOP/s dense BF16), 141 GB HBM3e; ~790 TFLOP/s measured
    # on a bf16 dense GEMM here (docs PERFORMANCE.md), so an MFU of 0.35 of peak is ~0.44 of what a GEMM reaches.
    "h200": GPU("h200", 989e12, 141 * 10**9, "cuda", "H200 SXM datasheet: 989 TFLOP/s dense bf16 (~790 measured), "
                "141 GB"),
    # NVIDIA HGX B200 datasheet: 36 PFLOP/s FP16/BF16 for 8 GPUs with 2:4 sparsity → 2.25 PFLOP/s dense BF16 per GPU;
    # 192 GB HBM3e per GPU.
    "b200": GPU("b200", 2.25e15, 192 * 10**9, "cuda", "B200 (HGX B200 datasheet): 2.25 PFLOP/s dense bf16, 192 GB"),
    # This machine: 2 Zen 4 cores, sgemm ≈ 190 GFLOP/s fp32 on both (docs PERFORMANCE.md), 24 GiB of memory.
    "cpu-2core": GPU("cpu-2core", 190e9, 24 * GiB, "cpu", "this machine: 2 cores, ≈ 190 GFLOP/s fp32 sgemm, 24 GiB"),
}


@dataclass
class ParamSummary:
    """Parameter counts of a K3 config (meta device) and how the learner's optimizers hold them."""

    total: int
    active: int
    embedding: int
    """Input-side parameters a text token's forward does not multiply (the embedding table, the image patch
    projection): left out of the FLOPs."""
    counts: dict[str, Any]
    """`model.params.count_parameters`' result."""
    adamw: int = 0
    """Parameters under AdamW (two moments each)."""
    muon: int = 0
    """Parameters under Muon (one momentum each; `optimizer: muon` only)."""
    fp32_kept: int = 0
    """Parameters kept in fp32 whatever the model dtype (KDA's A_log, dt_bias, conv weights; all under AdamW)."""
    adamw_tensors: int = 0
    """Parameter tensors under AdamW (each has a fp32 `step` scalar)."""
    untrained: int = 0
    """Parameters text training never reaches, so without gradient or optimizer state (the image patch projection;
    layer 0's mixer AttnRes query and norm, whose mix has one source). Not in `adamw` / `muon`."""

    def memory(self, dtype_bytes: int) -> tuple[int, int, int]:
        """(weights, gradients, optimizer states) in bytes for parameters of `dtype_bytes` (the learner's dtype):
        gradients and moments in each parameter's own dtype (torch.optim's `zeros_like(p)`), no master copy."""
        kept_bytes = max(4, dtype_bytes)
        weights = (self.total - self.fp32_kept) * dtype_bytes + self.fp32_kept * kept_bytes
        grads = (self.adamw + self.muon - self.fp32_kept) * dtype_bytes + self.fp32_kept * kept_bytes
        states = (2 * (self.adamw - self.fp32_kept) * dtype_bytes + 2 * self.fp32_kept * kept_bytes
                  + self.muon * dtype_bytes + 4 * self.adamw_tensors)
        return weights, grads, states


@dataclass
class StagePlan:
    """The cost of one stage (see the module docstring for what is counted)."""

    index: int
    seq_len: int
    segment_tokens: Optional[int]
    """Segment length when the stage trains segment by segment (seq_len > segment_tokens), else None."""
    tokens: int
    """Token budget rounded up to whole steps: steps × batch_tokens."""
    steps: int
    batch_tokens: int
    rows_per_step: int
    """Rows of seq_len tokens per optimizer step, over all ranks."""
    rows_per_rank: int
    micro_batch_rows: int
    micro_batches: int
    """Micro-batches per rank and step."""
    forward_flops_per_token: dict[str, float]
    """Forward FLOPs per token by part: `matmul` (2 × active non-embedding parameters), `mla_attention`, `kda`."""
    flops_per_token: float
    """Training FLOPs per token: 3 × forward."""
    flops: float
    """Training FLOPs of the stage: flops_per_token × tokens."""
    recompute_flops: float
    """The extra no-grad forward of a segmented stage (pass 1 of rl/train/segments.py); 0 otherwise."""
    activation_bytes: int
    """Bytes saved for backward by one micro-batch on one rank (+ the segment states of a segmented stage)."""
    activation_breakdown: dict[str, int]
    activation_dtype_bytes: int
    """Bytes per activation value (`pretrain.plan.dtype_bytes`); what the model computes in fp32 stays fp32."""
    param_dtype_bytes: int
    """Bytes per parameter (the learner's dtype)."""
    weight_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    num_gpus: int
    gpu: str
    time_s: float
    """(flops + recompute_flops) / (num_gpus × peak × mfu)."""

    @property
    def optimizer_bytes_replicated(self) -> int:
        """Weights + gradients + optimizer states on every rank (this learner: data-parallel)."""
        return self.weight_bytes + self.grad_bytes + self.optimizer_state_bytes

    @property
    def optimizer_bytes_sharded(self) -> int:
        """The same, sharded over the cluster's GPUs (FSDP2 / expert parallelism: not built yet)."""
        return math.ceil(self.optimizer_bytes_replicated / self.num_gpus)


def _setting(obj: Any, name: str, default: Any = None) -> Any:
    value = getattr(obj, name, default) if obj is not None else default
    return default if value is None and default is not None else value


def _dtype_bytes(dtype: Any) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}[str(dtype).replace("torch.", "")]


def parameter_summary(config: Any, optimizer: str = "adamw") -> ParamSummary:
    """Counts of `config` on the meta device: total/active (model/params.py) and the learner's optimizer groups
    (rl/train/optim.py `build_optimizers`: Muon for the 2-D and stacked hidden matrices, not the embedding or LM head;
    AdamW for the rest)."""
    import torch
    from torch import nn

    from k3rl.model.attn_res import RMSNorm
    from k3rl.model.modeling import AttnResProj, K3DecoderLayer, K3PreTrainedModel
    from k3rl.model.moe import is_moe_layer
    from k3rl.model.params import count_parameters
    from k3rl.model.vision import PatchEmbed

    counts = count_parameters(config)
    comps = counts["components"]
    summary = ParamSummary(total=counts["total"], active=counts["active"], counts=counts,
                           embedding=sum(comps.get(c, {}).get("active", 0) for c in ("embedding", "image_patch_embed")))
    keep_fp32 = tuple(K3PreTrainedModel._keep_in_fp32_modules_strict)

    def add(name: str, p: torch.Tensor, times: int = 1, head: bool = False, first: bool = False) -> None:
        if name.startswith("patch_embed.") or (first and name.startswith("self_attention_res_")):
            summary.untrained += p.numel()
            times -= 1
        hidden_matrix = p.ndim in (2, 3) and min(p.shape[-2:]) > 1 and not head
        if optimizer == "muon" and hidden_matrix:
            summary.muon += times * p.numel()
            return
        summary.adamw += times * p.numel()
        summary.adamw_tensors += times
        if any(k in name for k in keep_fp32):
            summary.fp32_kept += times * p.numel()

    kinds: dict[tuple[bool, bool], list[int]] = {}
    for i in range(config.num_hidden_layers):
        kinds.setdefault((config.is_kda_layer(i), is_moe_layer(config, i)), []).append(i)
    with torch.device("meta"):
        for layers in kinds.values():
            for name, p in K3DecoderLayer(config, layers[0]).named_parameters():
                add(name, p, len(layers), first=layers[0] == 0)
        d = config.hidden_size
        top = {"embed_tokens": nn.Embedding(config.vocab_size, d),
               "lm_head": nn.Linear(d, config.vocab_size, bias=False), "norm": RMSNorm(d)}
        if config.attn_res_block_size is not None:
            top.update(output_attn_res_norm=RMSNorm(d), output_attn_res_proj=AttnResProj(d))
        if config.media_placeholder_token_id is not None:
            top["patch_embed"] = PatchEmbed(config)
        for module_name, module in top.items():
            for name, p in module.named_parameters():
                add(f"{module_name}.{name}", p, head=module_name in ("embed_tokens", "lm_head"))
    if summary.adamw + summary.muon + summary.untrained != summary.total:  # model/params.py must see the same model
        raise RuntimeError(f"parameter_summary: {summary.adamw + summary.muon + summary.untrained} parameters in "
                           f"the optimizer groups, "
                           f"{summary.total} counted by model/params.py")
    return summary


def forward_flops_per_token(config: Any, summary: ParamSummary, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token at length seq_len, by part (module docstring)."""
    lac = config.linear_attn_config
    n_mla = len(lac["full_attn_layers"])
    n_kda = len(lac["kda_layers"])
    d_qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    H = config.num_attention_heads
    Hk, K = lac["num_heads"], lac["head_dim"]
    return {
        "matmul": 2.0 * (summary.active - summary.embedding),
        "mla_attention": n_mla * 2.0 * (seq_len / 2) * H * (d_qk + config.v_head_dim),
        "kda": n_kda * Hk * (6 * K * K + 10 * CHUNK * K + (2 / 3) * CHUNK * CHUNK),
    }


def _act_units(config: Any, kernels: str) -> int:
    """Tensors of the FFN hidden width saved per token by the gated activation, the down projection's input included."""
    if config.hidden_act == "silu":
        return 4  # silu input, silu(gate), up, down input
    if kernels == "cuda":
        return 3  # fused SiTU-GLU keeps gate and up; down input
    # kernels/situ/naive.py: tanh(g/β), β·tanh, σ(g), their product, tanh(u/β_l) (and β_l·tanh), the product;
    # then the down projection's input
    return 7 if config.activation_situ_linear_beta is not None else 6


def _mla_bytes(config: Any, rows: int, t: int, keys: int, cached: bool, a: int, f: int, kernels: str) -> float:
    """Bytes one MLA layer saves for `rows` × `t` queries over `keys` keys (model/mla.py); `cached`: a segment
    step through the cache, which attends block by block above SCORE_BUDGET scores."""
    d, H = config.hidden_size, config.num_attention_heads
    dn, dr, dv, Lkv = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.kv_lora_rank
    dqk = dn + dr
    q = d * a  # q_a_proj / q_proj input
    if config.q_lora_rank is not None:
        q += (2 * config.q_lora_rank + 1) * f + config.q_lora_rank * a  # query norm, q_b_proj input
    q += (2 * Lkv + 1) * f + (dr * f if a == f else 0)  # latent norm (its input: a view of [kv_c ; k_pe])
    if not config.mla_use_nope:
        q += 2 * dr * f  # RoPE's cos and sin for q and k
    q += H * dv * a * (3 if config.mla_use_output_gate else 1)  # output (+ its sigmoid gate, the gated product)
    from k3rl.model.mla import SCORE_BUDGET

    scores = 0.0
    if cached and rows * H * t * keys > SCORE_BUDGET:  # absorbed, block by block, recomputed in backward
        q += H * dqk * a + H * (Lkv + dr) * a + H * Lkv * a  # q_nope's storage, absorbed q, latent output
        k = (Lkv + dr) * a  # the latents
    elif kernels == "cuda" or dqk == dv:  # fused SDPA: q, k, v (a view of kv_b_proj's output), out, log-sum-exp
        q += H * dqk * a + H * f
        k = (Lkv + dr) * a + H * dqk * a + H * (dn + dv) * a
    else:  # SDPA's math path (the CPU with d_qk ≠ d_v): q, k, v in fp32 and the probabilities
        q += H * dqk * f
        # v: a fp32 copy, or (one row, fp32 model) a view of kv_b_proj's output
        k = (Lkv + dr) * a + H * dqk * f + H * ((dn + dv) if rows == 1 and a == f else dv) * f
        scores = H * t * keys * f
    return rows * (t * q + keys * k + scores)


def activation_bytes(config: Any, rows: int, seq_len: int, segment_tokens: Optional[int], dtype_bytes: int,
                     kernels: str = "cuda") -> dict[str, int]:
    """Bytes saved for backward by one micro-batch of `rows` rows of `seq_len` tokens, by part (module docstring);
    `segment_tokens` below seq_len: segment by segment. `dtype_bytes`: the activations' dtype (2: bf16)."""
    a = dtype_bytes
    f = max(4, a)  # what the model computes in fp32 (norms, KDA, router, …), fp64 for a fp64 model
    segmented = bool(segment_tokens) and seq_len > segment_tokens
    t = min(seq_len, segment_tokens) if segmented else seq_len
    keys = seq_len if segmented else t  # the recomputed last segment attends to the whole row
    n_q = rows * t  # tokens alive at once
    d = config.hidden_size
    lac = config.linear_attn_config
    L = config.num_hidden_layers
    out: dict[str, float] = {}

    def put(part: str, value: float) -> None:
        out[part] = out.get(part, 0.0) + value

    # KDA (model/kda.py, kernels/kda, kernels/short_conv)
    Hk, K, W = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    P = Hk * K
    t_pad = math.ceil(t / CHUNK) * CHUNK
    # a short conv keeps its unfolded windows (W values per channel; one row: a view of the padded input, 1 value)
    # and the SiLU input, in fp32 (the conv weights stay fp32)
    conv = (1 if rows == 1 else W) + 1
    kda_tok = (d * a + K * a + (0 if lac.get("use_full_rank_gate", True) else K * a)  # projections' inputs
               + 3 * P * conv * f  # the three short convs
               + (4 * P + Hk) * f  # gated output norm
               + P * a)  # o_proj input
    kda_core = Hk * (KDA_CORE[0] + KDA_CORE[1] * K + K * K / KDA_CORE[2]) * f
    n_kda = len(lac["kda_layers"])
    put("kda", n_kda * (n_q * kda_tok + rows * t_pad * kda_core))

    # MLA (model/mla.py): a segment attends to every key before its end; the largest is the last segment, or the
    # last one still under the score budget when the longer ones attend block by block
    from k3rl.model.mla import SCORE_BUDGET

    n_mla = len(lac["full_attn_layers"])
    if n_mla:
        ends = [keys]
        if segmented:
            H = config.num_attention_heads
            last_expanded = min(keys, SCORE_BUDGET // (rows * H * t) // t * t)
            if t <= last_expanded < keys:
                ends.append(last_expanded)
        put("mla", n_mla * max(_mla_bytes(config, rows, t, s, segmented, a, f, kernels) for s in ends))

    # FFNs (model/moe.py, kernels/moe, kernels/situ)
    from k3rl.model.moe import is_moe_layer

    units = _act_units(config, kernels)
    n_moe = sum(is_moe_layer(config, i) for i in range(L))
    put("dense_ffn", (L - n_moe) * n_q * (d * a + units * config.intermediate_size * a))
    if n_moe:
        E, k = config.num_experts, config.num_experts_per_token
        I, d_m = config.moe_intermediate_size, config.routed_expert_hidden_size or d
        router = d * f + E * f + (k + 1) * f + 8 * k + (d * a if a != f else 0)
        latent = 0.0
        if config.routed_expert_hidden_size is not None:
            latent = d_m * a + ((2 * d_m + 1) * f if config.latent_moe_use_norm else 0)
        routed = k * (d_m * a + units * I * a + 2 * d_m * f + f + 16)
        shared = units * I * config.num_shared_experts * a if config.num_shared_experts else 0
        put("moe", n_moe * n_q * (router + latent + routed + shared))

    # Norms and Block AttnRes
    put("norms", L * n_q * 2 * (2 * d + 1) * f)
    S = config.attn_res_block_size
    if S is not None:
        # sources of layer i's mixes: the blocks closed before (at every multiple of S) and the partial sum
        n_mix = [(i - 1) // S + 2 if i else 1 for i in range(L)] + [i // S + 2 for i in range(L)]
        n_mix.append(math.ceil(L / S) + 1)  # the output mix
        mixes = sum(2 * n * (d + 1) for n in n_mix if n > 1)  # stacked sources and their fp32 keys
        put("attn_res", n_q * mixes * f)
    # embedding ids, final norm, LM head rows (model/logprobs.py: input rows, log-sum-exp, targets)
    put("head", n_q * (8 + (2 * d + 1) * f + (d * f if a == f else 0) + d * a + f + 9))

    if segmented:
        n_seg = math.ceil(seq_len / segment_tokens)
        put("segment_states", rows * n_seg * n_kda * (3 * P * (W - 1) * a + Hk * K * K * f))
        if n_mla:
            put("segment_latents", 3 * rows * seq_len * n_mla * (config.kv_lora_rank + config.qk_rope_head_dim) * a)
    return {k: int(v) for k, v in out.items()}


def plan(model_config: Any, stages: Sequence[Any], learner: Any, plan: Any, num_ranks: int = 1,
         summary: Optional[ParamSummary] = None) -> list[StagePlan]:
    """The cost of every stage (module docstring). `stages`: StageConfig-like (seq_len, tokens, batch_tokens,
    segment_tokens); `learner`: LearnerSettings-like (dtype, micro_batch_tokens, micro_batch_seqs, segment_tokens,
    optimizer); `plan`: PlanConfig-like (gpu, num_gpus, mfu, dtype_bytes); `num_ranks`: data-parallel learner ranks."""
    gpu_name = str(_setting(plan, "gpu", "h200"))
    if gpu_name not in GPUS:
        raise ValueError(f"pretrain.plan.gpu: {gpu_name!r} is not one of {', '.join(GPUS)}")
    gpu = GPUS[gpu_name]
    num_gpus, mfu = int(_setting(plan, "num_gpus", 1)), float(_setting(plan, "mfu", 0.35))
    act_bytes = int(_setting(plan, "dtype_bytes", 2))
    optimizer = str(_setting(learner, "optimizer", "adamw"))
    summary = summary or parameter_summary(model_config, optimizer)
    param_bytes = _dtype_bytes(_setting(learner, "dtype", "float32"))
    weight_bytes, grad_bytes, state_bytes = summary.memory(param_bytes)
    plans = []
    for i, stage in enumerate(stages):
        seq_len, batch_tokens = int(stage.seq_len), int(stage.batch_tokens)
        seg = _setting(stage, "segment_tokens") or _setting(learner, "segment_tokens")
        segmented = bool(seg) and seq_len > seg
        steps = max(1, math.ceil(int(stage.tokens) / batch_tokens))
        rows_per_step = max(1, batch_tokens // seq_len)
        rows_per_rank = max(1, math.ceil(rows_per_step / num_ranks))
        mb_rows = max(1, int(_setting(learner, "micro_batch_tokens", 8192)) // seq_len)
        if _setting(learner, "micro_batch_seqs"):
            mb_rows = min(mb_rows, int(learner.micro_batch_seqs))
        mb_rows = min(mb_rows, rows_per_rank)
        fwd = forward_flops_per_token(model_config, summary, seq_len)
        per_token = 3 * sum(fwd.values())
        tokens = steps * batch_tokens
        recompute = sum(fwd.values()) * tokens if segmented else 0.0
        breakdown = activation_bytes(model_config, mb_rows, seq_len, seg if segmented else None, act_bytes,
                                     gpu.kernels)
        plans.append(StagePlan(
            index=i, seq_len=seq_len, segment_tokens=int(seg) if segmented else None, tokens=tokens, steps=steps,
            batch_tokens=batch_tokens, rows_per_step=rows_per_step, rows_per_rank=rows_per_rank,
            micro_batch_rows=mb_rows, micro_batches=math.ceil(rows_per_rank / mb_rows),
            forward_flops_per_token=fwd, flops_per_token=per_token, flops=per_token * tokens,
            recompute_flops=recompute, activation_bytes=sum(breakdown.values()), activation_breakdown=breakdown,
            activation_dtype_bytes=act_bytes, param_dtype_bytes=param_bytes,
            weight_bytes=weight_bytes, grad_bytes=grad_bytes, optimizer_state_bytes=state_bytes,
            num_gpus=num_gpus, gpu=gpu.name,
            time_s=(per_token * tokens + recompute) / (num_gpus * gpu.peak_flops * mfu)))
    return plans


# ---------------------------------------------------------------------------------------------------------------
# Formatting


def human_count(n: float) -> str:
    """15.0T, 400G, 65.5K: a token count."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def human_params(n: float) -> str:
    """2.78T, 105B, 5.1M: a parameter count."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def human_flops(x: float) -> str:
    """2.1e24 (whole runs), 631 GFLOP (per token)."""
    for unit, scale in (("EFLOP", 1e18), ("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if x >= scale and x < 1e21:
            return f"{x / scale:.3g} {unit}"
    return f"{x:.3g}".replace("e+", "e")


def human_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def human_time(s: float) -> str:
    if s < 120:
        return f"{s:.3g} s"
    if s < 2 * 3600:
        return f"{s / 60:.3g} min"
    if s < 48 * 3600:
        return f"{s / 3600:.3g} h"
    return f"{s / 86400:.3g} days"


def _length(n: int) -> str:
    from k3rl.rl.pretrain.stages import human_tokens

    return human_tokens(n)


def format_plan(plans: Sequence[StagePlan], model: str | ParamSummary, cluster: str | GPU, mfu: float = 0.35,
                width: int = 160) -> str:
    """A readable table of `plans`: one row per stage and a total, a header line (model, parameters, cluster) and
    the assumptions below it. `model`: a name or the ParamSummary; `cluster`: a GPU name or GPU."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    gpu = GPUS[cluster] if isinstance(cluster, str) else cluster
    num_gpus = plans[0].num_gpus if plans else 1
    if isinstance(model, ParamSummary):
        lay = model.counts["layers"]
        head = (f"model: {human_params(model.total)} total / {human_params(model.active)} active parameters "
                f"({lay['total']} layers: {lay['kda']} KDA, {lay['mla']} MLA; {lay['moe']} MoE, {lay['dense']} dense)")
    else:
        head = f"model: {model}"
    head += (f"\ncluster: {num_gpus} × {gpu.name} ({human_flops(gpu.peak_flops)}/s peak, "
             f"{_memory(gpu)} each) at MFU {mfu:g}")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for col, justify in (("stage", "left"), ("seq", "right"), ("segment", "right"), ("tokens", "right"),
                         ("steps", "right"), ("rows/step", "right"), ("micro-batch", "right"),
                         ("FLOPs/token", "right"), ("FLOPs", "right"), ("activations/rank", "right"),
                         ("weights+grads+optim", "right"), ("sharded", "right"), ("time", "right")):
        table.add_column(col, justify=justify, no_wrap=True)
    for p in plans:
        table.add_row(
            f"{p.index + 1}", _length(p.seq_len), _length(p.segment_tokens) if p.segment_tokens else "—",
            human_count(p.tokens), f"{p.steps:,}", f"{p.rows_per_step:,}",
            f"{p.micro_batch_rows} × {_length(p.segment_tokens or p.seq_len)}",
            human_flops((p.flops + p.recompute_flops) / p.tokens), human_flops(p.flops + p.recompute_flops),
            human_bytes(p.activation_bytes), human_bytes(p.optimizer_bytes_replicated),
            human_bytes(p.optimizer_bytes_sharded), human_time(p.time_s))
    if plans:
        table.add_section()
        table.add_row("total", "", "", human_count(sum(p.tokens for p in plans)), f"{sum(p.steps for p in plans):,}",
                      "", "", "", human_flops(sum(p.flops + p.recompute_flops for p in plans)),
                      human_bytes(max(p.activation_bytes for p in plans)),
                      human_bytes(plans[0].optimizer_bytes_replicated), human_bytes(plans[0].optimizer_bytes_sharded),
                      human_time(sum(p.time_s for p in plans)))
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, highlight=False).print(table)
    notes = "\n".join(textwrap.fill(line, width, subsequent_indent="    ") for line in _assumptions(plans, gpu))
    return f"{head}\n{buf.getvalue().rstrip()}\n{notes}\n"


_DTYPE_NAMES = {2: "bf16", 4: "fp32", 8: "fp64"}


def _memory(gpu: GPU) -> str:
    """The memory as its datasheet says it: 141 GB, 80 GiB."""
    if gpu.memory_bytes % GiB == 0:
        return f"{gpu.memory_bytes // GiB} GiB"
    return f"{gpu.memory_bytes / 1e9:.0f} GB"


def _assumptions(plans: Sequence[StagePlan], gpu: GPU) -> list[str]:
    lines = ["assumptions:",
             "  tokens: each stage's budget rounded up to whole steps (steps = ⌈tokens / batch_tokens⌉)",
             "  FLOPs: training = 3 × forward; forward = 2 × active non-embedding parameters (LM head included) "
             "+ MLA "
             "causal attention 2·(T/2)·H·(d_qk+d_v) per layer + KDA 6d²+10Cd+⅔C² per head (C = 64); a segmented "
             "stage runs one more forward (pass 1, no grad), counted in its FLOPs, FLOPs/token and time",
             f"  time = FLOPs / (GPUs × peak × MFU); peak: {gpu.source}"]
    if not plans:
        return lines
    act, par = plans[0].activation_dtype_bytes, plans[0].param_dtype_bytes
    paths = ("CUDA kernels: fused SDPA and SiTU-GLU" if gpu.kernels == "cuda"
             else "CPU paths: the T×T attention probabilities when d_qk ≠ d_v")
    lines.append(
        f"  activations/rank: bytes saved for backward by one micro-batch (rows × min(seq, segment) tokens) as this "
        f"code saves them, {_DTYPE_NAMES.get(act, act)} activations with the fp32 parts (norms, KDA kernel, router, "
        f"combine) in fp32, {paths}; "
        f"segmented stages add the MLA latents of the whole row (×3) and the KDA states at each segment boundary; "
        f"not counted: transient buffers (gradients in flight, the LM head's [chunk, V] block), fragmentation, the "
        f"mask of packed documents")
    worst = max(plans, key=lambda p: p.activation_bytes)
    parts = sorted(worst.activation_breakdown.items(), key=lambda kv: -kv[1])
    lines.append(f"  stage {worst.index + 1}'s activations: " + ", ".join(
        f"{name} {human_bytes(b)} ({100 * b / worst.activation_bytes:.0f}%)" for name, b in parts if b))
    lines.append(f"  weights+grads+optim: replicated on every data-parallel rank (this learner); parameters, "
                 f"gradients and moments in the learner dtype ({_DTYPE_NAMES.get(par, par)}; KDA gate/conv "
                 f"parameters fp32), no fp32 master copy; sharded: over all {plans[0].num_gpus} GPUs (FSDP2 / expert "
                 f"parallelism, not built yet)")
    if act != par:
        lines.append(f"  note: activations are planned at {act} bytes (pretrain.plan.dtype_bytes) but the learner's "
                     f"parameters are {par}-byte")
    over = [p for p in plans if p.activation_bytes + p.optimizer_bytes_sharded > gpu.memory_bytes]
    if over:
        lines.append(f"  does not fit one {gpu.name} ({_memory(gpu)}) even with sharded states: "
                     f"stage(s) {', '.join(str(p.index + 1) for p in over)}")
    elif plans[0].optimizer_bytes_replicated > gpu.memory_bytes:
        lines.append(f"  the replicated states alone exceed one {gpu.name} ({_memory(gpu)}): the "
                     f"run needs sharded states")
    return lines


def plan_from_job(cfg: Any) -> tuple[str, list[StagePlan]]:
    """The plan of a loaded JobConfig: model from `pretrain.model_dir`'s config.json when set (else the `model:`
    section), the `learner:` section, `pretrain.stages`, `pretrain.plan`, `pretrain.num_learners` ranks."""
    from pathlib import Path

    from k3rl.model.config import K3Config

    pre = cfg.pretrain
    if pre.model_dir is not None:
        if not (Path(pre.model_dir) / "config.json").is_file():
            raise ValueError(f"pretrain.model_dir: {pre.model_dir} is not a Hugging Face model directory "
                             f"(no config.json)")
        from k3rl.model.formats.layouts import read_config

        config = read_config(pre.model_dir)
        name = str(pre.model_dir)
    else:
        config = K3Config.from_model_config(cfg.model)
        name = "the model: section"
    summary = parameter_summary(config, str(cfg.learner.optimizer))
    plans = plan(config, list(pre.stages), cfg.learner, pre.plan, int(pre.num_learners), summary=summary)
    text = format_plan(plans, summary, str(pre.plan.gpu), float(pre.plan.mfu))
    text = f"{cfg.run.name}: {name}, learner {cfg.learner.dtype} / {cfg.learner.optimizer}, " \
           f"{pre.num_learners} data-parallel rank(s)\n" + text
    return text, plans


# ---------------------------------------------------------------------------------------------------------------
# Measurement: what the plan is compared with


class _Saved:
    """A tensor saved for backward, counted against its storage until autograd drops it."""

    __slots__ = ("tensor", "key", "meter")

    def __init__(self, tensor, key, meter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self):
        self.meter.release(self.key)


class _Meter:
    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def pack(self, t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self.exclude:
            return t
        if key not in self.refs:
            self.refs[key] = 0
            self.sizes[key] = storage.nbytes()
            self.live += self.sizes[key]
            self.peak = max(self.peak, self.live)
        self.refs[key] += 1
        return _Saved(t, key, self)

    @staticmethod
    def unpack(obj):
        return obj.tensor if isinstance(obj, _Saved) else obj

    def release(self, key):
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= self.sizes.pop(key)


def measure_step_memory(learner: Any, trajectories: Sequence[Any]) -> dict[str, Any]:
    """Run one `learner.train_step(trajectories)` and measure what the plan predicts: the peak of the bytes saved
    for backward over the step (each storage counted once, parameters and buffers left out), the states
    rl/train/segments.py keeps across segments (KDA states at each boundary, the MLA latents and their gradient), the
    optimizer states after the step, the parameters and the gradients (at the optimizer step)."""
    import torch

    from k3rl.rl.train import segments

    model = learner.model
    exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    meter = _Meter(exclude)
    seg_bytes = [0]
    grad_bytes = [0]
    original = segments.forward

    def nbytes(tensors) -> int:
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def forward(*args, **kwargs):
        fwd = original(*args, **kwargs)
        states = [t for conv, rec in fwd.entering for t in (*conv.values(), *rec.values())]
        seg_bytes[0] = max(seg_bytes[0], nbytes(states) + 2 * nbytes(fwd.latents.values()))  # latents + gradient
        return fwd

    def at_step(opt, args, kwargs):
        grad_bytes[0] += sum(p.grad.untyped_storage().nbytes() for g in opt.param_groups for p in g["params"]
                             if p.grad is not None)

    hooks = [opt.register_step_pre_hook(at_step) for opt in learner.optimizers]
    segments.forward = forward
    try:
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
            metrics = learner.train_step(trajectories)
    finally:
        segments.forward = original
        for h in hooks:
            h.remove()
    opt_bytes = sum(t.untyped_storage().nbytes() for opt in learner.optimizers for state in opt.state.values()
                    for t in state.values() if torch.is_tensor(t))
    return {"activation_bytes": meter.peak + seg_bytes[0], "saved_peak_bytes": meter.peak,
            "segment_state_bytes": seg_bytes[0], "optimizer_state_bytes": opt_bytes,
            "param_bytes": sum(p.untyped_storage().nbytes() for p in model.parameters()),
            "grad_bytes": grad_bytes[0], "micro_batches": int(metrics.get("micro_batches", 0)), "metrics": metrics}


__all__ = ["GPU", "GPUS", "ParamSummary", "StagePlan", "activation_bytes", "format_plan", "forward_flops_per_token",
           "human_bytes", "human_count", "human_flops", "human_params", "human_time", "measure_step_memory",
           "parameter_summary", "plan", "plan_from_job"]
