"""`K3ForCausalLM`: the K3 hybrid MoE text model as a Hugging Face `PreTrainedModel` (docs/model_spec.md §1, §3, §4).

    e = embed_tokens(ids)  (image patch embeddings replace the rows at media placeholders, §9)
    for each layer ℓ: token mixer = KDA if (ℓ+1) ∈ kda_layers else MLA; FFN = MoE or dense MLP;
                      inputs mixed by Block AttnRes (§7) or the plain pre-norm residual
    logits = lm_head(RMSNorm_{model.norm}(h_final)) · logit_scale

One `forward` serves training (no cache), prefill (`use_cache=True` or a fresh `K3Cache`) and
decode (a filled cache and new tokens, usually one); the KDA and MLA layers pick their
chunked/expanded or recurrent/absorbed paths from the number of new tokens.
`logits_to_keep` limits the lm_head to the positions a loss needs (last n, given indices, or a
[B, T] boolean mask), so RL losses need not materialise full-vocabulary logits everywhere.
`routed_expert_ids` replays a recorded routing ([B, T, n_moe_layers, k], -1 where nothing was recorded)
and `routing_mask` keeps padding out of the router statistics; every forward leaves the routing it used
in `last_routed_expert_ids()`.
`position_ids` packs several documents into each row for training, the way transformers' packing
(`DataCollatorWithFlattening`) does it: positions restart at 0 with each document, and each document is
computed exactly as if it were alone (KDA/conv states reset, MLA attends within it, RoPE from its own 0).

Checkpoint names are those of the text-only Kimi-Linear/K3 layout (`model.embed_tokens`,
`model.layers.{i}.self_attn.*`, `….block_sparse_moe.*` or `….mlp.*`, `model.norm`,
`model.output_attn_res_*`, `lm_head`), so `save_pretrained` output maps one to one onto the
released tensors (the stacked routed experts are written per expert, model/formats/names.py) (plus
`model.patch_embed.proj` when images are enabled). The Auto classes
are registered under model_type "k3rl_k3" (transformers ships its own "kimi_linear" with a
different module layout). MTP layers (§10) and the ViT tower are not built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput

from k3rl.model.attn_res import ResidualStream, RMSNorm
from k3rl.model.cache import K3Cache, StepInfo, make_step
from k3rl.model.config import K3Config
from k3rl.model.formats.names import register_expert_conversion
from k3rl.model.kda import KimiDeltaAttention, ShortConv
from k3rl.model.mla import MultiheadLatentAttention
from k3rl.model.moe import Experts, Router, build_ffn, is_moe_layer
from k3rl.model.vision import PatchEmbed


class AttnResProj(nn.Linear):
    """The pseudo-query `w` [1, d] of one AttnRes mix; initialised to zero (uniform mix at start)."""

    def __init__(self, dim: int) -> None:
        super().__init__(dim, 1, bias=False)


RECOMPUTE_MODES = ("none", "full", "selective")
"""Activation recompute in training (`K3Model.set_recompute`): none; `full`, each whole layer recomputed in
backward (only its input kept); `selective`, only the KDA mixers, the MoE blocks and the AttnRes mixes, whose saved
tensors are the bulk of a layer's (rl/pretrain/cost.py), while norms, MLA and dense FFNs keep theirs."""


class K3DecoderLayer(nn.Module):
    """One layer: token mixer (`self_attn`), FFN (`block_sparse_moe` or `mlp`), norms, AttnRes queries."""

    recompute = "none"
    """`K3Model.set_recompute`'s mode. The KDA mixer, the MoE block and the two AttnRes mixes keep only their
    inputs and run again in backward under `selective`, and under `full` inside a cache (without one `full`
    recomputes the whole layer)."""

    def __init__(self, config: K3Config, layer_idx: int) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer_idx = layer_idx
        mixer = KimiDeltaAttention if config.is_kda_layer(layer_idx) else MultiheadLatentAttention
        self.self_attn = mixer(config, layer_idx)
        self.is_moe = is_moe_layer(config, layer_idx)
        setattr(self, "block_sparse_moe" if self.is_moe else "mlp", build_ffn(config, layer_idx))
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        if config.attn_res_block_size is not None:
            self.self_attention_res_norm = RMSNorm(d, eps)
            self.self_attention_res_proj = AttnResProj(d)
            self.mlp_res_norm = RMSNorm(d, eps)
            self.mlp_res_proj = AttnResProj(d)

    def forward(self, stream: ResidualStream, step: StepInfo, routed_expert_ids: torch.Tensor | None = None,
                routing_mask: torch.Tensor | None = None) -> ResidualStream:
        """stream → stream after this layer's mixer and FFN; `routed_expert_ids` [B, T, k] replays routing,
        `routing_mask` [B, T] marks the tokens the router counts (model/moe.py `Router.forward`)."""
        parts = self._recomputing(step)
        x, stream = stream.mixer_input(self.layer_idx, getattr(self, "self_attention_res_proj", None),
                                       getattr(self, "self_attention_res_norm", None), parts)
        stream = stream.add(self._mixer(self.input_layernorm(x), step))
        x = self.post_attention_layernorm(stream.mix(getattr(self, "mlp_res_proj", None),
                                                     getattr(self, "mlp_res_norm", None), parts))
        if not self.is_moe:
            return stream.add(self.mlp(x))
        if parts:
            return stream.add(checkpoint(self.block_sparse_moe, x, routed_expert_ids, routing_mask, use_reentrant=False))
        return stream.add(self.block_sparse_moe(x, routed_expert_ids, routing_mask))

    def _recomputing(self, step: StepInfo) -> bool:
        """Whether the KDA mixer, MoE block and AttnRes mixes recompute, each on its own."""
        parts = self.recompute == "selective" or (self.recompute == "full" and step.cache is not None)
        return parts and self.training and torch.is_grad_enabled()

    def _mixer(self, x: torch.Tensor, step: StepInfo) -> torch.Tensor:
        """The token mixer; under selective recompute a KDA mixer keeps only x and the cache state it started
        from. With a cache (segment-recurrent training, rl/train/segments.py) the mixer replaces this layer's
        entries, so the recompute in backward first puts back the state the forward read, and afterwards the
        entries the forward wrote (the recomputed ones would hold the recompute's graph alive)."""
        attn = self.self_attn
        if not (self._recomputing(step) and isinstance(attn, KimiDeltaAttention)):
            return attn(x, step)
        cache, i = step.cache, self.layer_idx
        if cache is None:
            return checkpoint(attn, x, step, use_reentrant=False)
        calls = []

        def run(x: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor) -> torch.Tensor:
            written = cache.conv[i], cache.recurrent[i]
            cache.conv[i], cache.recurrent[i] = conv, recurrent
            out = attn(x, step)
            if calls:  # the recompute in backward
                cache.conv[i], cache.recurrent[i] = written
            calls.append(True)
            return out

        return checkpoint(run, x, cache.conv[i], cache.recurrent[i], use_reentrant=False)


class K3PreTrainedModel(PreTrainedModel):
    config_class = K3Config
    config: K3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["K3DecoderLayer"]
    _supports_sdpa = True
    _keep_in_fp32_modules_strict = ["A_log", "dt_bias", "q_conv1d", "k_conv1d", "v_conv1d", "e_score_correction_bias"]

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, AttnResProj):
            init.zeros_(module.weight)
        elif isinstance(module, ShortConv):
            bound = module.weight.shape[-1] ** -0.5
            init.uniform_(module.weight, a=-bound, b=bound)
        elif isinstance(module, Router):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, Experts):
            # expert by expert, w1 w2 w3: the draws of the per-expert nn.Linear modules they replace
            for weights in module.per_expert():
                for name, w in zip(("w1", "w2", "w3"), weights):
                    if not getattr(getattr(module, name), "_is_hf_initialized", False):
                        init.normal_(w, mean=0.0, std=std)
        else:
            super()._init_weights(module)
        if isinstance(module, KimiDeltaAttention):
            A_log, dt_bias = module.initial_gate_values()
            init.copy_(module.A_log, A_log)
            init.copy_(module.dt_bias, dt_bias)


class K3Model(K3PreTrainedModel):
    """Embeddings, decoder layers and the final AttnRes mix; returns the pre-norm h_final."""

    def __init__(self, config: K3Config) -> None:
        super().__init__(config)
        d = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, d)
        self.layers = nn.ModuleList(K3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        if config.attn_res_block_size is not None:
            self.output_attn_res_norm = RMSNorm(d, config.rms_norm_eps)
            self.output_attn_res_proj = AttnResProj(d)
        if config.media_placeholder_token_id is not None:
            self.patch_embed = PatchEmbed(config)
        self.gradient_checkpointing = False
        self.post_init()

    def set_recompute(self, mode: str) -> None:
        """Activation recompute in training, one of RECOMPUTE_MODES. `full` is transformers' gradient checkpointing
        (`gradient_checkpointing_enable`) of whole layers, which a cache cannot take (MLA writes its latent buffer
        in place): in segment-recurrent training `full` recomputes what `selective` does."""
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute: {mode!r} is not one of {', '.join(RECOMPUTE_MODES)}")
        self.gradient_checkpointing = mode == "full"
        for layer in self.layers:
            layer.recompute = mode

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    def forward(self, input_ids: torch.Tensor, step: StepInfo, pixel_values=None,
                routed_expert_ids: torch.Tensor | None = None, routing_mask: torch.Tensor | None = None,
                image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B, T] → h_final [B, T, d] (pre-norm, spec §1 step 3)."""
        h = self.embed_tokens(input_ids)  # [B, T, d]
        if pixel_values is not None:
            if not hasattr(self, "patch_embed"):
                raise ValueError("pixel_values: this model has no image input (media_placeholder_token_id is null)")
            h = self.patch_embed.fuse(input_ids, h, pixel_values, image_mask)
        stream = ResidualStream.start(h, self.config.attn_res_block_size)
        moe_idx = 0
        for layer in self.layers:
            ids = None
            if layer.is_moe and routed_expert_ids is not None:
                ids, moe_idx = routed_expert_ids[:, :, moe_idx], moe_idx + 1
            if self.gradient_checkpointing and self.training and step.cache is None and torch.is_grad_enabled():
                stream = checkpoint(layer, stream, step, ids, routing_mask, use_reentrant=False)
            else:
                stream = layer(stream, step, ids, routing_mask)
        return stream.mix(getattr(self, "output_attn_res_proj", None), getattr(self, "output_attn_res_norm", None))


@dataclass
class K3CausalLMOutput(ModelOutput):
    """loss (mean next-token CE over labels ≠ -100), logits, the cache, and the pre-norm h_final [B, T, d]."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    cache: K3Cache | None = None
    hidden_states: torch.Tensor | None = None


class K3ForCausalLM(K3PreTrainedModel):
    """The K3 text model with its separate (untied) lm_head."""

    def __init__(self, config: K3Config) -> None:
        super().__init__(config)
        self.model = K3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def new_cache(self, batch_size: int, capacity: int = 256) -> K3Cache:
        """An empty decode cache in this model's dtype and device."""
        w = self.lm_head.weight
        return K3Cache.create(self.config, batch_size, capacity, dtype=w.dtype, device=w.device)

    def last_routed_expert_ids(self) -> torch.Tensor | None:
        """Routing of the latest forward, [B, T, n_moe_layers, k] int64 (None without MoE layers)."""
        ids = [layer.block_sparse_moe.last_expert_ids for layer in self.model.layers if layer.is_moe]
        return torch.stack(ids, dim=2) if ids and all(i is not None for i in ids) else None

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | list[torch.Tensor] | None = None,
        cache: K3Cache | None = None,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool = False,
        logits_to_keep: int | torch.Tensor = 0,
        routed_expert_ids: torch.Tensor | None = None,
        routing_mask: torch.Tensor | None = None,
        return_hidden_states: bool = False,
        position_ids: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
    ) -> K3CausalLMOutput:
        """Training, prefill or decode step.

        Args:
            input_ids: [B, T] new tokens (T ≥ 1).
            pixel_values: images for the media placeholders in `input_ids` (see model/vision.py).
            image_mask: [B, T] bool, the placeholders that take `pixel_values` (default: every placeholder token; one
                outside it, e.g. sampled by the model, is embedded as an ordinary token).
            cache: decode state to continue from and update in place; None with `use_cache=True`
                creates one (returned in the output).
            labels: [B, T] targets aligned with input_ids (shifted inside; -100 ignored).
            attention_mask: [B, T] or [B, past+T], 0 only for left padding in the first step.
            logits_to_keep: 0 = all positions; int n = last n; 1-D LongTensor = those positions
                ([B, n, V]); [B, T] BoolTensor = the marked tokens, flattened ([N, V]).
            routed_expert_ids: [B, T, n_moe_layers, k] routing to replay; a token's row with any -1 (not
                recorded) is routed by the model's own router.
            routing_mask: [B, T] bool, the tokens whose routing counts in the router-balancing statistics
                (False on padding, which is never replayed either); None: every token counts.
            return_hidden_states: also return the pre-norm h_final [B, T, d].
            position_ids: [B, T] int, packed documents (training only: no cache, no use_cache). A document
                starts at column 0 and wherever position_ids[b, t] != position_ids[b, t-1] + 1 (transformers'
                `find_packed_sequence_indices` rule); positions are the RoPE positions, so give each
                document 0, 1, 2, …. Right padding may continue the last document's count or start its own
                (give it consecutive positions: each restart costs KDA a 64-token chunk). With `labels`, the
                first token of a document is never the target of the previous one.
        """
        if input_ids.ndim != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids: expected [B, T] with T ≥ 1, got shape {list(input_ids.shape)}")
        if labels is not None and not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
            raise ValueError("labels: the loss needs logits at every position; leave logits_to_keep=0")
        if cache is None and use_cache:
            cache = self.new_cache(input_ids.shape[0], capacity=input_ids.shape[1])
        step = make_step(tuple(input_ids.shape), input_ids.device, cache, attention_mask,
                         self.config.max_position_embeddings, position_ids)
        h = self.model(input_ids, step, pixel_values, routed_expert_ids, routing_mask, image_mask)  # [B, T, d]
        if cache is not None:
            cache.commit(input_ids.shape[1])
        kept = _keep(h, logits_to_keep)
        logits = self.lm_head(self.model.norm(kept)) * self.config.logit_scale
        loss = None
        if labels is not None:
            if step.documents is not None:
                # No target across a document boundary: a document's first token is nobody's next token.
                starts = torch.zeros_like(step.documents, dtype=torch.bool)  # [B, T]
                starts[:, 1:] = step.documents[:, 1:] != step.documents[:, :-1]
                labels = labels.masked_fill(starts.to(labels.device), -100)
            shifted = logits[:, :-1].flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32))
            loss = F.cross_entropy(shifted, labels[:, 1:].flatten().to(logits.device), ignore_index=-100)
        return K3CausalLMOutput(loss=loss, logits=logits, cache=cache,
                                hidden_states=h if return_hidden_states else None)


def _keep(h: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The rows of h [B, T, d] the lm_head is applied to (see `K3ForCausalLM.forward`)."""
    if isinstance(logits_to_keep, int):
        if logits_to_keep < 0:
            raise ValueError(f"logits_to_keep: must be ≥ 0, got {logits_to_keep}")
        return h[:, -logits_to_keep:] if logits_to_keep else h
    if logits_to_keep.dtype == torch.bool:
        if logits_to_keep.shape != h.shape[:2]:
            raise ValueError(f"logits_to_keep: a mask must be [B, T] = {list(h.shape[:2])}, "
                             f"got {list(logits_to_keep.shape)}")
        return h[logits_to_keep.to(h.device)]  # [N, d]
    return h[:, logits_to_keep.to(h.device)]


register_expert_conversion(K3Config.model_type)
AutoModel.register(K3Config, K3Model, exist_ok=True)
AutoModelForCausalLM.register(K3Config, K3ForCausalLM, exist_ok=True)
