"""`TorchEngine`: k3rl's own batched sampler for `K3ForCausalLM` and any HF causal LM.

The embedded default on the CPU (vLLM's K3 kernels need CUDA). One `generate` call:
1. left-pads the prompts into one batch and prefills it through the policy adapter (model/policy.py; K3: the hybrid cache, KDA/conv states
   constant in length, MLA latents growing; HF models: their own KV cache) — each prompt once, in
   segments of `prefill_tokens` tokens so a 256K-token prompt needs the activations of one segment,
   then the cache rows are repeated for the `n` samples;
2. decodes one token per running sequence per step, dropping finished rows from the batch
   (`K3Cache.select` / the HF cache's `batch_select_indices`), so sequences that finish early
   cost nothing afterwards.

Sampling follows rollout/engine.py (the same semantics as vLLM's): logits / temperature, top-p
truncation, one categorical draw from a seeded generator; the reported logprob is that of the
raw model distribution. A sample stops at EOS, a stop token, a stop string (checked on the
decoded tail, kept in the output) or `max_tokens`. K3 models also report the routed expert ids
of each sampled token (for routing replay).

Not done here: a prefix cache across calls (each call prefills its prompts in full) and
continuous batching of new requests into a running batch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from rollout.engine import Completion, SamplingParams


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of logits [B, V]; return (tokens [B], raw logprobs of them [B])."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    raw = torch.log_softmax(logits, dim=-1)  # [B, V]
    if temperature == 0:
        tokens = logits.argmax(dim=-1)
    else:
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1.0:
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the top token is always kept)
            drop = sorted_p.cumsum(-1) - sorted_p >= top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens, raw.gather(-1, tokens[:, None])[:, 0]


class TorchEngine:
    """Generate with a PyTorch model in this process; see module docstring."""

    def __init__(self, model, tokenizer, device: str | torch.device = "cpu", seed: int = 0, max_batch: int = 64,
                 prefill_tokens: int = 2048):
        from model.policy import Policy

        self.model = model.to(device).eval()
        self.policy = Policy(self.model)
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.max_batch = max_batch
        if prefill_tokens < 1:
            raise ValueError(f"prefill_tokens: must be ≥ 1, got {prefill_tokens}")
        self.prefill_tokens = prefill_tokens
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.version = 0
        self.is_k3 = self.policy.is_k3
        self.eos_ids = {i for i in [tokenizer.eos_token_id] if i is not None}

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                        **kwargs) -> "TorchEngine":
        from transformers import AutoTokenizer

        from model.policy import load_policy

        policy = load_policy(model_dir, dtype=dtype)
        return cls(policy.model, AutoTokenizer.from_pretrained(model_dir), device=device, **kwargs)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        state = self.model.state_dict()
        updates = dict(named_tensors)
        unknown = sorted(set(updates) - set(state))
        if unknown:
            raise ValueError(f"weight update has tensors this model does not: {unknown[:5]}")
        for name, t in updates.items():
            if state[name].shape != t.shape:
                raise ValueError(f"weight update '{name}': shape {list(t.shape)}, model has {list(state[name].shape)}")
        with torch.no_grad():
            for name, t in updates.items():
                state[name].copy_(t)
        self.version = version

    def reset_cache(self) -> None:
        """Nothing persists between calls (no prefix cache yet)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        per_chunk = max(1, self.max_batch // params.n)
        out: list[list[Completion]] = []
        for i in range(0, len(prompts), per_chunk):
            out += self._generate_batch(prompts[i:i + per_chunk], params)
        return out

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        if any(len(p) == 0 for p in prompts):
            raise ValueError("generate: every prompt needs at least one token")
        B, n, dev = len(prompts), params.n, self.device
        T = max(len(p) for p in prompts)
        ids = torch.full((B, T), self.tokenizer.pad_token_id or 0, dtype=torch.long, device=dev)
        mask = torch.zeros((B, T), dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            ids[b, T - len(p):] = torch.tensor(p, device=dev)
            mask[b, T - len(p):] = 1
        logits, state = self._prefill(ids, mask, T + params.max_tokens)
        rows = torch.arange(B, device=dev).repeat_interleave(n)  # [B·n]
        logits, state = logits[rows], self._select(state, rows)
        N = B * n
        tokens: list[list[int]] = [[] for _ in range(N)]
        logps: list[list[float]] = [[] for _ in range(N)]
        routed: list[list] = [[] for _ in range(N)]
        reasons: list[str] = ["length"] * N
        alive = list(range(N))  # sample index of each row still in the batch
        stop_ids = self.eos_ids | set(params.stop_token_ids)
        window = max((len(s) for s in params.stop), default=0) + 2
        for _ in range(params.max_tokens):
            new, lp = sample_tokens(logits, params.temperature, params.top_p, self.generator)
            keep = []
            for row, s in enumerate(alive):
                tok = int(new[row])
                tokens[s].append(tok)
                logps[s].append(float(lp[row]))
                if tok in stop_ids or (params.stop and self._hits_stop(tokens[s], params.stop, window)):
                    reasons[s] = "stop"
                elif len(tokens[s]) < params.max_tokens:
                    keep.append(row)
            if not keep:
                break
            if len(keep) < len(alive):
                idx = torch.tensor(keep, device=dev)
                state, new = self._select(state, idx), new[idx]
                alive = [alive[r] for r in keep]
            logits, state = self._decode(new, state)
            if state.get("route") is not None:
                for row, s in enumerate(alive):
                    routed[s].append(state["route"][row, -1].tolist())
        if self.is_k3 and state.get("route") is not None:
            # A sample's last token is never fed back, so it has no routing: -1 marks it.
            blank = [[-1] * len(state["route"][0, -1][0])] * state["route"].shape[2]
            for s in range(N):
                routed[s] += [blank] * (len(tokens[s]) - len(routed[s]))
        return [[Completion(tokens[b * n + j], logps[b * n + j], reasons[b * n + j],
                            routed[b * n + j] or None) for j in range(n)] for b in range(B)]

    def _hits_stop(self, tokens: list[int], stops: tuple[str, ...], window: int) -> bool:
        tail = self.tokenizer.decode(tokens[-window:], skip_special_tokens=False)
        return any(s in tail for s in stops)

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor, capacity: int):
        return self.policy.prefill(ids, mask, capacity, segment_tokens=self.prefill_tokens)

    def _decode(self, new: torch.Tensor, state: dict):
        return self.policy.decode(new, state)

    def _select(self, state: dict, index: torch.Tensor) -> dict:
        return self.policy.select(state, index)
