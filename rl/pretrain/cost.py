"""What one stage costs per token: the training FLOPs and the bytes autograd saves for one micro-batch.

FLOPs. Forward per token = 2 × the active parameters without the input embedding (the LM head counts; top-k of the
routed experts), plus what the parameters do not show:
  * MLA, causal attention at length T: scores and values over T/2 earlier keys on average, 2 · T/2 · H · (d_qk + d_v)
    per token and layer (the expanded form the learner trains with, d_qk = qk_nope + qk_rope);
  * KDA, per token and head: 6d² + 10Cd + ⅔C² with d the head dim and C = 64 the chunk (docs/performance.md).
Training = 3 × forward; a stage trained segment by segment runs one more forward (rl/pretrain/plan.py counts it).

Activation memory: the bytes autograd saves for backward during one micro-batch, counted per token and layer for
what OUR implementation keeps (model/*.py, kernels/*), times the tokens alive at once (rows × min(seq_len,
segment_tokens)):
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
every document to whole 64-token chunks. rl/pretrain/measure.py measures a real step to check these counts.

Recompute (`learner.recompute`, model/modeling.py RECOMPUTE_MODES) trades those bytes for one more forward of what it
recomputes: `selective` keeps nothing of the KDA mixers, MoE blocks and AttnRes mixes but their inputs (the norms'
outputs and the stream's sources, already counted) and, during the backward of one of them, that one's tensors
again (`recompute`: the largest such part);
`full` without segments keeps only each layer's input (`layer_inputs`: d values per token for each layer's
output and each AttnRes block sum) and the largest layer's tensors during its recompute; in a segmented stage `full` is `selective` (the
model's rule: a cache takes no whole-layer recompute).
"""

from __future__ import annotations

import math
from typing import Any, Optional

from k3rl.rl.pretrain.param_memory import ParamSummary

CHUNK = 64
"""KDA chunk length C (kernels/kda/chunk.py CHUNK_SIZE)."""
# What kernels/kda/chunk.py saves for backward, in fp32 values per token and head: KDA_CORE[0] + KDA_CORE[1]·K
# + K²/KDA_CORE[2] (the two per-chunk K×K states over C = 64 tokens). Fitted exactly (to the byte) to the saved
# bytes of the chunked kernel at K = 16, 32, 48, 64 and 128 (the bool masks and sub-chunk constants left out).
KDA_CORE = (445.375, 26.65625, 32)


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
                     kernels: str = "cuda", recompute: str = "none") -> dict[str, int]:
    """Bytes saved for backward by one micro-batch of `rows` rows of `seq_len` tokens, by part (module docstring);
    `segment_tokens` below seq_len: segment by segment. `dtype_bytes`: the activations' dtype (2: bf16).
    `recompute`: none, full or selective (module docstring)."""
    if recompute not in ("none", "full", "selective"):
        raise ValueError(f"recompute: {recompute!r} is not one of none, full, selective")
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
    if recompute != "none":
        streams = L + (math.ceil(L / S) if S is not None else 0)  # each layer's output, and AttnRes's block sums
        _apply_recompute(out, "selective" if segmented else recompute, L, n_kda, n_mla, n_moe, streams * n_q * d * a)
    return {k: int(v) for k, v in out.items()}


def _apply_recompute(out: dict[str, float], mode: str, L: int, n_kda: int, n_mla: int, n_moe: int,
                     input_bytes: float) -> None:
    """Turn the no-recompute parts `out` into what `mode` keeps (module docstring), in place."""
    def per_layer(part: str, n: int) -> float:
        return out.get(part, 0.0) / n if n else 0.0

    if mode == "selective":
        largest = max(per_layer("kda", n_kda), per_layer("moe", n_moe), per_layer("attn_res", L))
        out["kda"] = out["moe"] = out["attn_res"] = 0.0
        out["recompute"] = largest
        return
    mixer = max(per_layer("kda", n_kda), per_layer("mla", n_mla))
    ffn = max(per_layer("moe", n_moe), per_layer("dense_ffn", L - n_moe))
    largest = mixer + ffn + per_layer("norms", L) + per_layer("attn_res", L)
    for part in ("kda", "mla", "moe", "dense_ffn", "norms", "attn_res"):
        out[part] = 0.0
    out["layer_inputs"] = input_bytes
    out["recompute"] = largest


__all__ = ["CHUNK", "KDA_CORE", "activation_bytes", "forward_flops_per_token"]
