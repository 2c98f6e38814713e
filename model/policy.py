"""`Policy`: one loaded policy — k3rl's K3 or any Hugging Face causal LM — behind the few operations the
toolkit needs, so the learner (rl/train/learner.py), SFT (through the learner: rl/train/supervised.py), the native engine
(rollout/torch_engine.py) and the self-check ask one object instead of each probing the model.

- `load_policy(path, dtype, device)`: an HF directory (config.json required); a K3 directory (released
  layouts or k3rl's old one, by config.json's model_type) is read by model/formats/layouts.py, any other causal LM
  by transformers' Auto classes (a directory's own code only with `trust_remote_code`, model/formats/trust.py);
  dropout is switched off.
- `is_k3`: answered once, by type.
- `final_hidden(input_ids, attention_mask, routed_expert_ids, rows, position_ids)`: the hidden states the LM
  head reads. K3 returns its pre-norm state (`return_hidden_states=True`) and the final norm is applied
  here — to the selected `rows` only when they are given, so the norm never runs on prompt rows; other
  models are called with `output_hidden_states=True`, whose last entry is already normed. Either way the
  model computes logits for one position only (`logits_to_keep=1`, where supported). `position_ids` packs
  documents into rows, transformers-style (positions restart at 0 per document), for both families.
- `head()` / `selected_logprobs(hidden, targets, chunk_size, entropy)`: the LM head weight and logit
  scale, and log π(target) through the chunked path of model/logprobs.py (no [N, V] logits).
- `prefill` / `decode` / `select`: batched generation with the model's own cache (K3: `K3Cache`, with the
  routed expert ids of every step for routing replay; HF: its KV cache with explicit positions, so left
  padding is exact); a long prompt is prefilled in segments (bounded activations, exact up to rounding).
- `split` / `stack` / `extend` (K3 only, `resumable`): keep one sequence's decode state, merge kept states of
  different lengths into one batch, feed new tokens on top — the native engine's state reuse across turns.

A third model family costs one subclass that overrides these.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from k3rl.model.logprobs import selected_logprobs


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                dropout: bool = False, trust_remote_code: bool = False, allow_nonfinite: bool = False) -> Policy:
    """The policy of an HF directory (K3 in any layout model/formats/layouts.py reads, or any causal LM) in `dtype` on
    `device`; its dropout is switched off (RL compares the policy with itself) unless `dropout`. A directory whose
    config.json asks for its own model code (`auto_map`) is loaded only with `trust_remote_code` (model/formats/trust.py);
    a K3 directory never runs its code (k3rl reads it natively). Either kind is verified against its `COMPLETE`
    manifest when it has one, and NaN/±inf weights are a `NonFiniteWeightsError` naming the tensors unless
    `allow_nonfinite` (model/formats/integrity.py)."""
    from k3rl.model.formats import integrity
    from k3rl.model.formats.config_json import is_k3_dir
    from k3rl.model.formats.layouts import CONFIG_FILE
    from k3rl.model.formats.load import load_model
    from k3rl.model.formats.trust import check_remote_code

    path = Path(path)
    if is_k3_dir(path):  # K3 has no dropout
        return Policy(load_model(path, dtype=dtype, device=device, allow_nonfinite=allow_nonfinite))
    integrity.verify_model_dir(path)
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no Hugging Face model at {path} (config.json missing)")
    from transformers import AutoConfig, AutoModelForCausalLM

    trust = check_remote_code(path, trust_remote_code)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    for name, value in list(config.to_dict().items()):
        if not dropout and (name.endswith("dropout") or name.endswith("_pdrop")) and isinstance(value, float):
            setattr(config, name, 0.0)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, trust_remote_code=trust)
    bad = integrity.nonfinite_tensors(model.state_dict().items())
    integrity.refuse_nonfinite(bad, path, allow_nonfinite)
    return Policy(model.to(device))


class Policy:
    """A causal LM and how to ask it for hidden states, log-probs and cached decoding; see module docstring."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.is_k3 = _is_k3(model)
        params = inspect.signature(type(model).forward).parameters
        self._keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    # ---- scoring

    def check_head(self) -> None:
        """The chunked log-prob path models `scale · h Wᵀ`: no LM-head bias, no logit soft-capping."""
        head = self.model.get_output_embeddings()
        text_config = self.model.config.get_text_config()
        if getattr(head, "bias", None) is not None:
            raise ValueError(f"{type(self.model).__name__}: the LM head has a bias, which the chunked "
                             f"log-prob path does not model")
        if getattr(text_config, "final_logit_softcapping", None):
            raise ValueError(f"{type(self.model).__name__}: final_logit_softcapping is not supported by the "
                             f"chunked log-prob path")

    def nonfinite_parameters(self) -> list[str]:
        """Names of parameters holding a NaN or ±inf (a policy that cannot be trained or sampled)."""
        with torch.no_grad():
            return [name for name, p in self.model.named_parameters() if not bool(torch.isfinite(p).all())]

    def head(self) -> tuple[torch.Tensor, float]:
        """(LM head weight [V, d], logit scale)."""
        scale = getattr(self.model.config.get_text_config(), "logit_scale", None) or 1.0
        return self.model.get_output_embeddings().weight, float(scale)

    def final_hidden(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                     routed_expert_ids: Optional[torch.Tensor] = None,
                     rows: Optional[torch.Tensor] = None,
                     position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Hidden states after the final norm: [B, T, d], or [N, d] for the positions of the bool mask
        `rows` [B, T]. `attention_mask` [B, T] (0 on padding) is passed to non-K3 models; K3 needs none for
        right padding and takes it as its routing mask, so padding stays out of the router statistics;
        `routed_expert_ids` [B, T, L, k] replays a routing on K3 (-1: route).

        `position_ids` [B, T]: several documents per row, each computed as if alone; a document starts
        wherever the positions do not continue by +1 (0 1 2 0 1 …), right padding continues the count or
        starts its own. K3 takes them as `K3ForCausalLM.forward(position_ids=…)`; other models get them with
        attention_mask=None, from which transformers derives the same block-diagonal causal mask
        (`find_packed_sequence_indices`; their attention implementation must honour it)."""
        if self.is_k3:
            mask = None if attention_mask is None else attention_mask.bool()
            out = self.model(input_ids, routed_expert_ids=routed_expert_ids, routing_mask=mask,
                             return_hidden_states=True, position_ids=position_ids, **self._keep)
            h = out.hidden_states if rows is None else out.hidden_states[rows]
            return self.model.model.norm(h)
        packed = {} if position_ids is None else {"position_ids": position_ids}
        out = self.model(input_ids=input_ids, attention_mask=None if packed else attention_mask,
                         output_hidden_states=True, use_cache=False, **packed, **self._keep)
        h = out.hidden_states[-1]
        return h if rows is None else h[rows]

    def branch_hidden(self, prefix: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor, rows: torch.Tensor,
                      prefix_routed: Optional[torch.Tensor] = None,
                      routed_expert_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Hidden states after the final norm of `rows` [B, T] (→ [N, d]) of B sequences that all start with
        `prefix` [1, P] and go on with `input_ids` [B, T] (right-padded, `valid` 0 on padding): the prefix is
        computed once and its cache repeated to the rows, one autograd graph, so gradients reaching the prefix
        are summed over the rows (group prefix sharing, rl/train/segments.py). K3: its hybrid cache (routing replayed
        with `prefix_routed` / `routed_expert_ids`); other models: their KV cache, positions continuing after P."""
        B, T = input_ids.shape
        P = prefix.shape[1]
        if self.is_k3:
            cache = self.model.new_cache(1, capacity=P + T)
            self.model(prefix, cache=cache, routed_expert_ids=prefix_routed, logits_to_keep=1)
            cache = cache.select(torch.zeros(B, dtype=torch.long, device=input_ids.device))
            out = self.model(input_ids, cache=cache, routed_expert_ids=routed_expert_ids, routing_mask=valid.bool(),
                             return_hidden_states=True, logits_to_keep=1)
            return self.model.model.norm(out.hidden_states[rows])
        cache = self.model(input_ids=prefix, use_cache=True, **self._keep).past_key_values
        cache.batch_repeat_interleave(B)
        mask = torch.cat([valid.new_ones(B, P), valid], dim=1).long()
        positions = (P + torch.arange(T, device=input_ids.device)).expand(B, T)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True, output_hidden_states=True, **self._keep)
        return out.hidden_states[-1][rows]

    def selected_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, chunk_size: int = 1024,
                          entropy: bool = False):
        """log π(targets) [N] for hidden rows [N, d] (and the entropy [N] with `entropy`)."""
        weight, scale = self.head()
        return selected_logprobs(hidden, weight, targets, chunk_size, scale, return_entropy=entropy)

    # ---- generation

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, capacity: int,
                segment_tokens: Optional[int] = None) -> tuple[torch.Tensor, dict]:
        """Left-padded prompts [B, T] (mask 0 on padding) → last-position logits [B, V] and the decode state.

        With `segment_tokens`, the prompt goes in segments of that many tokens through the model's own cache
        (K3: KDA and conv states carried, MLA's latents appended and attended by query block; HF: its KV cache),
        so the activations of one step stay bounded by the segment, not the prompt."""
        B, T = ids.shape
        seg = T if not segment_tokens or segment_tokens >= T else int(segment_tokens)
        if self.is_k3:
            cache = self.model.new_cache(B, capacity=capacity)
            cache.pad_len = (mask == 0).sum(1).to(cache.pad_len)  # padding sits in the first columns
            for lo in range(0, T, seg):
                out = self.model(ids[:, lo:lo + seg], cache=cache, logits_to_keep=1)
            return out.logits[:, -1], {"cache": cache, "route": self.model.last_routed_expert_ids()}
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = None
        for lo in range(0, T, seg):
            hi = min(T, lo + seg)
            out = self.model(input_ids=ids[:, lo:hi], attention_mask=mask[:, :hi], position_ids=pos[:, lo:hi],
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
        return out.logits[:, -1], {"cache": cache, "mask": mask, "pos": pos[:, -1]}

    def decode(self, new: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        """One new token per row [B] → logits [B, V] and the updated state (K3: `state["route"]` holds the
        routing of this step, [B, 1, L, k])."""
        if self.is_k3:
            out = self.model(new[:, None], cache=state["cache"])
            state["route"] = self.model.last_routed_expert_ids()
            return out.logits[:, -1], state
        mask = torch.cat([state["mask"], torch.ones_like(new)[:, None]], dim=1)
        pos = state["pos"] + 1
        out = self.model(input_ids=new[:, None], attention_mask=mask, position_ids=pos[:, None],
                         past_key_values=state["cache"], use_cache=True)
        return out.logits[:, -1], {"cache": out.past_key_values, "mask": mask, "pos": pos}

    def select(self, state: dict, index: torch.Tensor) -> dict:
        """The decode state of rows `index` (reorder, drop or repeat sequences)."""
        if self.is_k3:
            route = state.get("route")
            return {"cache": state["cache"].select(index), "route": None if route is None else route[index]}
        cache = state["cache"]
        for layer in cache.layers:
            layer.batch_select_indices(index)
        return {"cache": cache, "mask": state["mask"][index], "pos": state["pos"][index]}


    # ---- kept states (K3): one sequence's state outlives its batch and is resumed later

    @property
    def resumable(self) -> bool:
        """Whether decode states can be split per sequence, stacked at different lengths and extended: K3
        (`K3Cache.unstack` / `stack`). HF KV caches are not (their layouts vary by model and version): callers
        prefill the whole context again."""
        return self.is_k3

    def split(self, state: dict, rows: list[int]) -> list[dict]:
        """The decode state of each of `rows` alone (one sequence, its padding dropped)."""
        route = state.get("route")
        caches = state["cache"].unstack(rows)
        return [{"cache": c, "route": None if route is None else route[r:r + 1, -1:].clone()}
                for r, c in zip(rows, caches)]

    def stack(self, states: list[dict], capacity: int = 0) -> dict:
        """One batch state of every row of `states`, in order, left-padded to the longest (`K3Cache.stack`)."""
        routes = [s.get("route") for s in states]
        route = None if any(r is None for r in routes) else torch.cat([r[:, -1:] for r in routes])
        cache = type(states[0]["cache"]).stack([s["cache"] for s in states], capacity)
        return {"cache": cache, "route": route}

    def extend(self, ids: torch.Tensor, state: dict, segment_tokens: Optional[int] = None) -> tuple[torch.Tensor, dict]:
        """New tokens [B, T] (no padding) on top of a decode state → last-position logits [B, V] and the state,
        in segments of `segment_tokens` as `prefill`."""
        if not self.resumable:
            raise NotImplementedError(f"{type(self.model).__name__}: kept decode states are K3-only")
        T = ids.shape[1]
        seg = T if not segment_tokens or segment_tokens >= T else int(segment_tokens)
        cache = state["cache"]
        for lo in range(0, T, seg):
            out = self.model(ids[:, lo:lo + seg], cache=cache, logits_to_keep=1)
        return out.logits[:, -1], {"cache": cache, "route": self.model.last_routed_expert_ids()}


def _is_k3(model: Any) -> bool:
    model = getattr(model, "module", model)  # DDP / accelerate wrappers
    try:
        from k3rl.model.modeling import K3ForCausalLM
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, K3ForCausalLM)
