"""`Policy`: one loaded causal LM behind the few operations the toolkit needs, one class per model family, so the
learner (rl/train/learner.py), SFT and pretraining (through the learner), the native engine (rollout/torch_engine.py)
and the self-check ask one object instead of each probing the model.

- `load_policy(path, dtype, device)`: an HF directory (config.json required); a K3 directory (released layouts or
  k3rl's old one, by config.json's model_type) is read by model/formats/load.py into a `K3Policy`, any other
  causal LM by transformers' Auto classes into an `HFPolicy` (a directory's own code only with `trust_remote_code`,
  model/formats/trust.py); dropout is switched off. `Policy(model)` picks the family by the model's type.
- `final_hidden` / `tree_hidden`: the hidden states the LM head reads, after the final norm (K3 applies it here,
  to the selected `rows` only, so it never runs on prompt rows; HF models return it normed); `tree_hidden` runs a
  prefix tree of `BranchNode`s (rl/train/prefix_tree.py), each shared prefix once; the model computes
  logits for one position only (`logits_to_keep=1`, where supported). `position_ids` packs documents into rows,
  transformers-style (positions restart at 0 per document), for both families.
- `head()` / `selected_logprobs(hidden, targets, chunk_size, entropy)`: the LM head weight and logit scale, and
  log π(target) through the chunked path of model/logprobs.py (no [N, V] logits).
- `prefill` / `decode` / `select`: batched generation with the model's own cache (K3: `K3Cache`, with the routed
  expert ids of every step for routing replay; HF: its KV cache with explicit positions, so left padding is exact);
  a long prompt is prefilled in segments (bounded activations, exact up to rounding).
- `split` / `stack` / `extend` (K3 only, `resumable`): keep one sequence's decode state, merge kept states of
  different lengths into one batch, feed new tokens on top — the native engine's state reuse across turns.
- `save` / `read_weights`: the family's checkpoint format (K3: the released layout its config chooses; HF:
  `save_pretrained`); `set_rope_theta`: the RoPE base of the layers that have one.
- Capability flags the learner asks instead of the type: `segments`, `routing_replay`, `shardable`, `resumable`.

A third model family costs one subclass that overrides these.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from k3rl.model.logprobs import selected_logprobs


@dataclass
class BranchNode:
    """One node of a prefix tree (`Policy.tree_hidden`): `ids` [b, t] continue the path of node `parent` at position
    `start`, the parent's state (one row) repeated to the b rows; `parent` −1: the root, from an empty state."""

    parent: int
    start: int
    ids: torch.Tensor
    """[b, t] int64 tokens, right-padded."""
    valid: torch.Tensor
    """[b, t] bool, real tokens (a node with children is one row without padding)."""
    routed: Optional[torch.Tensor]
    """[b, t, L, k] int64 routing to replay (-1: route), or None."""
    read_b: torch.Tensor
    read_t: torch.Tensor
    """[m] int64 each: the (row, column) positions whose hidden states are returned (duplicates allowed)."""
    patch_ids: Optional[torch.Tensor] = None
    """[b, t] int64: at each image placeholder the row of its patch in the tree's patch table, -1 elsewhere; None:
    no image (rl/train/batching.py `collate_patches`)."""


def load_policy(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                dropout: bool = False, trust_remote_code: bool = False, allow_nonfinite: bool = False) -> Policy:
    """The policy of an HF directory (K3 in any layout model/formats/load.py reads, or any causal LM) in `dtype` on
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
        return K3Policy(load_model(path, dtype=dtype, device=device, allow_nonfinite=allow_nonfinite))
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
    """A causal LM and how to ask it for hidden states, log-probs, cached decoding and its checkpoints; see the module
    docstring. `Policy(model)` is the family class of `model` (`K3Policy` or `HFPolicy`)."""

    is_k3: ClassVar[bool] = False
    segments: ClassVar[bool] = False
    """Trains a unit longer than a segment segment by segment (rl/train/segments.py), packed documents one per row."""
    routing_replay: ClassVar[bool] = False
    """Takes the routed expert ids recorded at sampling (`final_hidden(routed_expert_ids=…)`)."""
    shardable: ClassVar[bool] = False
    """Can be sharded by expert parallelism and FSDP2 (rl/train/parallel.py `apply_parallelism`)."""
    resumable: ClassVar[bool] = False
    """Decode states can be split per sequence, stacked at different lengths and extended (`split`, `stack`,
    `extend`); otherwise callers prefill the whole context again."""

    def __new__(cls, model: nn.Module):
        if cls is Policy:
            cls = K3Policy if _is_k3(model) else HFPolicy
        return super().__new__(cls)

    def __init__(self, model: nn.Module):
        self.model = model
        params = inspect.signature(type(model).forward).parameters
        self._keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

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

    def selected_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor, chunk_size: int = 1024,
                          entropy: bool = False):
        """log π(targets) [N] for hidden rows [N, d] (and the entropy [N] with `entropy`)."""
        weight, scale = self.head()
        return selected_logprobs(hidden, weight, targets, chunk_size, scale, return_entropy=entropy)

    def can_share_prefix(self, recompute: str) -> bool:
        """Whether shared prefixes can be computed once and branched from in training (`tree_hidden`)
        under the learner's `recompute` mode."""
        return True

    def set_recompute(self, mode: str) -> None:
        """Activation recompute in training (rl/config/learner.py `recompute`): `none`, `full` (transformers'
        gradient checkpointing), or `selective`, which only a K3 model has."""
        if mode == "selective":
            raise ValueError(f"learner.recompute=selective: {type(self.model).__name__} is not a K3 model; its parts "
                             "cannot be recomputed apart (use full or none)")
        if mode == "full":
            self.model.gradient_checkpointing_enable()
        elif mode != "none":
            raise ValueError(f"learner.recompute: {mode!r} is not one of none, full, selective")

    def final_hidden(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                     routed_expert_ids: Optional[torch.Tensor] = None,
                     rows: Optional[torch.Tensor] = None,
                     position_ids: Optional[torch.Tensor] = None,
                     images: Optional[dict] = None) -> torch.Tensor:
        """Hidden states after the final norm: [B, T, d], or [N, d] for the positions of the bool mask
        `rows` [B, T]. `attention_mask` [B, T] (0 on padding) is passed to non-K3 models; K3 needs none for
        right padding and takes it as its routing mask, so padding stays out of the router statistics;
        `routed_expert_ids` [B, T, L, k] replays a routing on K3 (-1: route).

        `position_ids` [B, T]: several documents per row, each computed as if alone; a document starts
        wherever the positions do not continue by +1 (0 1 2 0 1 …), right padding continues the count or
        starts its own. K3 takes them as `K3ForCausalLM.forward(position_ids=…)`; other models get them with
        attention_mask=None, from which transformers derives the same block-diagonal causal mask
        (`find_packed_sequence_indices`; their attention implementation must honour it).

        `images`: the image arguments of `input_ids`' placeholders (model/vision.py `image_inputs`: `pixel_values`,
        `image_mask`; K3 with image input); other models refuse them."""
        raise NotImplementedError

    def tree_hidden(self, nodes: list[BranchNode], patch_table: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Hidden states after the final norm at every node's read positions, concatenated in node order [Σ m, d],
        of a prefix tree (`nodes` parents first): each node runs once, from its parent's cache repeated to its rows,
        in one autograd graph, so the gradients reaching a shared prefix are summed over everything that reads it
        (rl/train/prefix_tree.py). K3: its hybrid cache (routing replayed with `routed`); other models: their KV
        cache, positions continuing along the path. `patch_table` [M, C, p, p] uint8: the patches the nodes'
        `patch_ids` point at (K3 with image input)."""
        raise NotImplementedError

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, capacity: int,
                segment_tokens: Optional[int] = None, patch_ids: Optional[torch.Tensor] = None,
                patch_table: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
        """Left-padded prompts [B, T] (mask 0 on padding) → last-position logits [B, V] and the decode state.

        With `segment_tokens`, the prompt goes in segments of that many tokens through the model's own cache
        (K3: KDA and conv states carried, MLA's latents appended and attended by query block; HF: its KV cache),
        so the activations of one step stay bounded by the segment, not the prompt. Images (K3 with image input):
        `patch_ids` [B, T] marks each placeholder's patch in `patch_table` [M, C, p, p] uint8 (-1 elsewhere); a
        segment takes the patches of its own placeholders (model/vision.py `image_inputs`)."""
        raise NotImplementedError

    def decode(self, new: torch.Tensor, state: dict) -> tuple[torch.Tensor, dict]:
        """One new token per row [B] → logits [B, V] and the updated state (K3: `state["route"]` holds the
        routing of this step, [B, 1, L, k])."""
        raise NotImplementedError

    def select(self, state: dict, index: torch.Tensor) -> dict:
        """The decode state of rows `index` (reorder, drop or repeat sequences)."""
        raise NotImplementedError

    def extend(self, ids: torch.Tensor, state: dict, segment_tokens: Optional[int] = None,
               patch_ids: Optional[torch.Tensor] = None, patch_table: Optional[torch.Tensor] = None
               ) -> tuple[torch.Tensor, dict]:
        """New tokens [B, T] (no padding) on top of a decode state → last-position logits [B, V] and the state,
        in segments of `segment_tokens` as `prefill` (images likewise)."""
        raise NotImplementedError(f"{type(self.model).__name__}: kept decode states are K3-only")

    def save(self, directory: Path, state: Optional[Mapping[str, torch.Tensor]] = None, tokenizer_from: Any = None,
             trust_remote_code: bool = False) -> None:
        """Write the model (or the full state dict `state` of it in internal names, e.g. gathered from sharded ranks)
        to `directory` in the family's format, with the tokenizer of directory `tokenizer_from` when given."""
        raise NotImplementedError

    def read_weights(self, directory: Path) -> dict[str, torch.Tensor]:
        """The internal state dict (experts stacked) of a directory `save` wrote, not checked against the model."""
        raise NotImplementedError

    def set_rope_theta(self, theta: float) -> None:
        """Set the RoPE base of the model's attention from now on (saved with its config); refused for a model
        without such a base."""
        config = self.model.config
        raise ValueError(f"rope_theta: the model ({getattr(config, 'model_type', '?')}, mla_use_nope="
                         f"{getattr(config, 'mla_use_nope', None)}) has no RoPE layers to take a base")


class K3Policy(Policy):
    """k3rl's K3ForCausalLM: pre-norm hidden states, the hybrid `K3Cache`, routing replay, segments, sharding, kept
    decode states, the released checkpoint layouts (model/formats/layouts.py) and MLA's RoPE base."""

    is_k3 = True
    segments = True
    routing_replay = True
    shardable = True
    resumable = True

    def set_recompute(self, mode: str) -> None:
        self.model.model.set_recompute(mode)  # model/modeling.py RECOMPUTE_MODES

    def final_hidden(self, input_ids, attention_mask=None, routed_expert_ids=None, rows=None, position_ids=None,
                     images=None):
        mask = None if attention_mask is None else attention_mask.bool()
        out = self.model(input_ids, routed_expert_ids=routed_expert_ids, routing_mask=mask, **(images or {}),
                         return_hidden_states=True, position_ids=position_ids, **self._keep)
        h = out.hidden_states if rows is None else out.hidden_states[rows]
        return self.model.model.norm(h)

    def tree_hidden(self, nodes, patch_table=None):
        from k3rl.model.vision import image_inputs

        capacity = max(n.start + n.ids.shape[1] for n in nodes)
        parents = {n.parent for n in nodes}
        caches, out = {}, []
        for k, node in enumerate(nodes):
            b = node.ids.shape[0]
            if node.parent < 0:
                cache = self.model.new_cache(b, capacity=capacity)
            else:  # a copy of the parent's state per row (`K3Cache.select`): the parent's stays for its other children
                cache = caches[node.parent].select(torch.zeros(b, dtype=torch.long, device=node.ids.device))
            o = self.model(node.ids, cache=cache, routed_expert_ids=node.routed, routing_mask=node.valid,
                           **image_inputs(patch_table, node.patch_ids), return_hidden_states=True, logits_to_keep=1)
            if k in parents:
                caches[k] = cache
            out.append(o.hidden_states[node.read_b, node.read_t])
        return self.model.model.norm(torch.cat(out))

    def prefill(self, ids, mask, capacity, segment_tokens=None, patch_ids=None, patch_table=None):
        from k3rl.model.vision import image_inputs

        B, T = ids.shape
        seg = T if not segment_tokens or segment_tokens >= T else int(segment_tokens)
        cache = self.model.new_cache(B, capacity=capacity)
        cache.pad_len = (mask == 0).sum(1).to(cache.pad_len)  # padding sits in the first columns
        for lo in range(0, T, seg):
            images = {} if patch_ids is None else image_inputs(patch_table, patch_ids[:, lo:lo + seg])
            out = self.model(ids[:, lo:lo + seg], cache=cache, **images, logits_to_keep=1)
        return out.logits[:, -1], {"cache": cache, "route": self.model.last_routed_expert_ids()}

    def decode(self, new, state):
        out = self.model(new[:, None], cache=state["cache"])
        state["route"] = self.model.last_routed_expert_ids()
        return out.logits[:, -1], state

    def select(self, state, index):
        route = state.get("route")
        return {"cache": state["cache"].select(index), "route": None if route is None else route[index]}

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

    def extend(self, ids, state, segment_tokens=None, patch_ids=None, patch_table=None):
        from k3rl.model.vision import image_inputs

        T = ids.shape[1]
        seg = T if not segment_tokens or segment_tokens >= T else int(segment_tokens)
        cache = state["cache"]
        for lo in range(0, T, seg):
            images = {} if patch_ids is None else image_inputs(patch_table, patch_ids[:, lo:lo + seg])
            out = self.model(ids[:, lo:lo + seg], cache=cache, **images, logits_to_keep=1)
        return out.logits[:, -1], {"cache": cache, "route": self.model.last_routed_expert_ids()}

    def save(self, directory, state=None, tokenizer_from=None, trust_remote_code=False):
        """The released layout the model config chooses (model/formats/save.py `save_state_dict`)."""
        from k3rl.model.formats.save import save_state_dict

        save_state_dict(self.model.config, self.model.state_dict() if state is None else state, directory,
                                  tokenizer_from=tokenizer_from, trust_remote_code=trust_remote_code)

    def read_weights(self, directory):
        """Any K3 layout, internal names (model/formats/load.py `read_state_dict`)."""
        from k3rl.model.formats.load import read_state_dict

        return read_state_dict(directory)

    def set_rope_theta(self, theta: float) -> None:
        """Set the RoPE base of the MLA layers (which read `config.rope_theta` at every call, model/mla.py; KDA uses no
        positions). Refused for a model in NoPE mode (`mla_use_nope`)."""
        if getattr(self.model.config, "mla_use_nope", True):
            super().set_rope_theta(theta)
        if not theta > 1.0:
            raise ValueError(f"rope_theta: must be > 1, got {theta}")
        self.model.config.rope_theta = float(theta)


class HFPolicy(Policy):
    """Any other Hugging Face causal LM: normed last hidden states, its own KV cache, `save_pretrained`."""

    def can_share_prefix(self, recompute: str) -> bool:
        # under gradient checkpointing an HF model drops its KV cache in training: no branch to share from
        return recompute == "none"

    def final_hidden(self, input_ids, attention_mask=None, routed_expert_ids=None, rows=None, position_ids=None,
                     images=None):
        _no_images(self.model, images or None)
        packed = {} if position_ids is None else {"position_ids": position_ids}
        out = self.model(input_ids=input_ids, attention_mask=None if packed else attention_mask,
                         output_hidden_states=True, use_cache=False, **packed, **self._keep)
        h = out.hidden_states[-1]
        return h if rows is None else h[rows]

    def tree_hidden(self, nodes, patch_table=None):
        from transformers import DynamicCache

        _no_images(self.model, patch_table)
        parents = {n.parent for n in nodes}
        caches, out = {}, []
        for k, node in enumerate(nodes):
            b, t = node.ids.shape
            past = None
            if node.parent >= 0:  # a new cache over the parent's keys and values, repeated per row (not in place)
                past = DynamicCache([(layer.keys.repeat_interleave(b, 0), layer.values.repeat_interleave(b, 0))
                                     for layer in caches[node.parent].layers], config=self.model.config)
            mask = torch.cat([node.valid.new_ones(b, node.start), node.valid], dim=1).long()
            positions = (node.start + torch.arange(t, device=node.ids.device)).expand(b, t)
            o = self.model(input_ids=node.ids, attention_mask=mask, position_ids=positions, past_key_values=past,
                           use_cache=True, output_hidden_states=True, **self._keep)
            if k in parents:
                caches[k] = o.past_key_values
            out.append(o.hidden_states[-1][node.read_b, node.read_t])
        return torch.cat(out)

    def prefill(self, ids, mask, capacity, segment_tokens=None, patch_ids=None, patch_table=None):
        _no_images(self.model, patch_table)
        B, T = ids.shape
        seg = T if not segment_tokens or segment_tokens >= T else int(segment_tokens)
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        cache = None
        for lo in range(0, T, seg):
            hi = min(T, lo + seg)
            out = self.model(input_ids=ids[:, lo:hi], attention_mask=mask[:, :hi], position_ids=pos[:, lo:hi],
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
        return out.logits[:, -1], {"cache": cache, "mask": mask, "pos": pos[:, -1]}

    def decode(self, new, state):
        mask = torch.cat([state["mask"], torch.ones_like(new)[:, None]], dim=1)
        pos = state["pos"] + 1
        out = self.model(input_ids=new[:, None], attention_mask=mask, position_ids=pos[:, None],
                         past_key_values=state["cache"], use_cache=True)
        return out.logits[:, -1], {"cache": out.past_key_values, "mask": mask, "pos": pos}

    def select(self, state, index):
        cache = state["cache"]
        for layer in cache.layers:
            layer.batch_select_indices(index)
        return {"cache": cache, "mask": state["mask"][index], "pos": state["pos"][index]}

    def save(self, directory, state=None, tokenizer_from=None, trust_remote_code=False):
        """`save_pretrained` (safetensors; of `state`, e.g. LoRA-merged weights, when given), and the tokenizer of
        `tokenizer_from` (its code only when trusted)."""
        self.model.save_pretrained(directory, state_dict=state, safe_serialization=True)
        if tokenizer_from is not None:
            from k3rl.model.tokenizer import load_tokenizer

            load_tokenizer(tokenizer_from, trust_remote_code=trust_remote_code).save_pretrained(directory)

    def read_weights(self, directory):
        """Every `*.safetensors` file of the directory, routed experts stacked (model/formats/names.py)."""
        from safetensors.torch import load_file

        from k3rl.model.formats.names import stack_experts

        weights = {}
        for file in sorted(Path(directory).glob("*.safetensors")):
            weights.update(load_file(file))
        return stack_experts(weights)


def _no_images(model: Any, pixels: Any) -> None:
    if pixels is not None:
        raise ValueError(f"{type(model).__name__}: images are read by K3 models with image input only")


def _is_k3(model: Any) -> bool:
    model = getattr(model, "module", model)  # DDP / accelerate wrappers
    try:
        from k3rl.model.modeling import K3ForCausalLM
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, K3ForCausalLM)
