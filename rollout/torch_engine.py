"""`TorchEngine`: k3rl's own batched sampler for `K3ForCausalLM` and any HF causal LM.

The embedded default on the CPU (vLLM's K3 kernels need CUDA). One `generate` call:
1. left-pads the prompts into one batch and prefills it through the policy adapter (model/policy.py; K3: the hybrid cache, KDA/conv states
   constant in length, MLA latents growing; HF models: their own KV cache) — each prompt once, in
   segments of `prefill_tokens` tokens so a 256K-token prompt needs the activations of one segment,
   then the cache rows are repeated for the `n` samples;
2. decodes one token per running sequence per step, dropping finished rows from the batch
   (`K3Cache.select` / the HF cache's `batch_select_indices`), so sequences that finish early
   cost nothing afterwards.

State reuse across turns (`reuse_state`, on by default; K3 only): `generate(..., sessions=…)` names each
sample's session (the agent loop passes one id per episode). When a sample finishes, its row's state is
kept under that id (rollout/sessions.py: the prompt and its sampled tokens but the pending last one). A
later prompt naming that id and extending those tokens exactly is not prefilled again: the kept states of
such prompts are stacked at their different lengths (`K3Cache.stack`: left-padded, exact with RoPE as with
NoPE), grouped by how many new tokens they bring, and only the new tokens run through the model; then
they join the fresh prompts' batch for decoding, in prompt order, so sampling draws the same numbers as a
full prefill would. A prompt that does not extend its session, or whose session was computed by other
weights, is prefilled in full (counted in `stats`). `end_sessions` drops an episode's state;
`load_weights` and `reset_cache` drop them all (`load_weights(..., keep_sessions=True)` keeps them, and
`session_version` tells which weights computed one). HF models (`Policy.resumable` false) and
`reuse_state=False` prefill every prompt in full.

Stale states (`resume_stale`, off by default; the worker sets it for `rollout.partial_resume=keep_state`):
a session kept across a weight update is continued instead of prefilled again, so the new turn reads
context whose KV/recurrent state older weights computed. That is the point of keeping it (no re-prefill
of a long paused episode) and also a mismatch with the version its tokens carry, so it is counted: per
sample (`Completion.stale_state_tokens`) and in `stats.stale_state_tokens`.

Sampling follows rollout/engine.py (the same semantics as vLLM's): logits / temperature, top-p
truncation, one categorical draw from a seeded generator; the reported logprob is that of the
raw model distribution. A sample stops at EOS, a stop token, a stop string (checked on the
decoded tail, kept in the output) or `max_tokens`. K3 models also report the routed expert ids
of each sampled token (for routing replay).

Images (K3 with image input, `image_patch` set): the model never samples a media token (their logits are masked
in sampling; the reported logprob stays the raw one), so every placeholder of a context is an image's;
`generate(..., images=…)` gives each prompt the patches of all its placeholders ([n, C, p, p] uint8 in placeholder
order, model/vision.py `image_patches`); a full prefill takes them all, a resumed session the ones after its kept
tokens, each prefill segment its own (model/policy.py `prefill`).

Not done here: a prefix cache shared between sequences across calls (only a session's own state is
reused) and continuous batching of new requests into a running batch.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from k3rl.rollout.engine import Completion, SamplingParams
from k3rl.rollout.sessions import PrefillStats, Session, SessionStore
from k3rl.rollout.weight_transfer import merge_adapters, split_adapters


def sample_tokens(logits: torch.Tensor, temperature: float, top_p: float,
                  generator: torch.Generator | None, banned: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of logits [B, V], never one of `banned` (ids); return (tokens [B], raw logprobs of
    them [B])."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    raw = torch.log_softmax(logits, dim=-1)  # [B, V]
    if banned is not None:
        logits = logits.index_fill(-1, banned, float("-inf"))
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
                 prefill_tokens: int = 2048, reuse_state: bool = True, resume_stale: bool = False):
        from k3rl.model.policy import Policy

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
        placeholder = getattr(model.config, "media_placeholder_token_id", None) if self.is_k3 else None
        self.image_patch = None if placeholder is None else int(model.config.image_patch_size)
        """The model's patch size when it reads images, else None."""
        self._placeholder = placeholder
        self._banned = None
        """The media tokens (rollout/chat.py `MEDIA_TOKENS`) of a model that reads images: it never samples them, so
        every placeholder in a context is an image's."""
        if placeholder is not None:
            from k3rl.rollout.chat import MEDIA_TOKENS

            unk = getattr(tokenizer, "unk_token_id", None)
            lookup = getattr(tokenizer, "convert_tokens_to_ids", None)  # a bare tokenizer may know ids only
            ids = [] if lookup is None else [i for i in lookup(list(MEDIA_TOKENS)) if i is not None and i != unk]
            self._banned = torch.tensor(sorted({*ids, int(placeholder)}), device=self.device)
        self.eos_ids = {i for i in [tokenizer.eos_token_id] if i is not None}
        self.reuse_state = reuse_state
        self.resume_stale = resume_stale
        """Continue a session whose state older weights computed instead of prefilling it in full."""
        self.sessions = SessionStore()
        self.stats = PrefillStats()
        self._lora_base: dict[str, torch.Tensor] = {}
        """The base value of each tensor an adapter push changes, kept at its first push."""

    @property
    def keeps_state(self) -> bool:
        """Whether `sessions` passed to `generate` are kept and resumed (`reuse_state` and a K3 model)."""
        return self.reuse_state and self.policy.resumable

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32,
                        trust_remote_code: bool = False, **kwargs) -> TorchEngine:
        """The engine of an HF directory; the directory's own code runs only with `trust_remote_code`
        (model/formats/trust.py)."""
        from k3rl.model.policy import load_policy
        from k3rl.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_dir, trust_remote_code=trust_remote_code)
        policy = load_policy(model_dir, dtype=dtype, trust_remote_code=trust_remote_code)
        return cls(policy.model, tokenizer, device=device, **kwargs)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                     keep_sessions: bool = False) -> None:
        """Replace the weights; the kept session states are dropped unless `keep_sessions` (they keep the
        version that computed them, `session_version`; `generate` resumes them under other weights only with
        `resume_stale`)."""
        state = self.model.state_dict()
        # a LoRA learner's adapter push (rollout/weight_transfer.py): factors merged into the engine's base copy
        plain, factors = split_adapters(named_tensors)
        updates = dict(plain)
        unknown = sorted(set(updates) - set(state))
        if unknown:
            raise ValueError(f"weight update has tensors this model does not: {unknown[:5]}")
        for name, t in updates.items():
            if state[name].shape != t.shape:
                raise ValueError(f"weight update '{name}': shape {list(t.shape)}, model has {list(state[name].shape)}")
        merge_adapters(factors, state, self._lora_base)  # checks every pair before it writes
        with torch.no_grad():
            for name, t in updates.items():
                state[name].copy_(t)
        if not keep_sessions:
            self.sessions.clear()
        self.version = version

    def reset_cache(self) -> None:
        """Drop every kept session state."""
        self.sessions.clear()

    def end_sessions(self, ids: Iterable[Hashable]) -> None:
        """Drop the kept states of sessions `ids` (episodes that ended); unknown ids are ignored."""
        self.sessions.end(ids)

    def session_version(self, session: Hashable) -> int | None:
        """Weights version that computed session `session`'s kept state; None when none is kept."""
        return self.sessions.version(session)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 sessions: Sequence[Sequence[Hashable]] | None = None,
                 images: Sequence[np.ndarray | None] | None = None) -> list[list[Completion]]:
        """For each prompt (a list or 1-D integer array of token ids), `params.n` completions. `sessions`:
        per prompt, `params.n` distinct ids, one per sample, whose states are kept after this call and
        resumed by a later prompt that extends them (module docstring); None keeps nothing. `images`: per prompt
        the patches of its image placeholders (module docstring), or None."""
        images = self._check_images(prompts, images)
        if sessions is not None:
            if len(sessions) != len(prompts) or any(len(s) != params.n for s in sessions):
                raise ValueError(f"sessions: need {params.n} ids for each of the {len(prompts)} prompts")
            flat = [k for s in sessions for k in s]
            if len(set(flat)) != len(flat):
                raise ValueError("sessions: an id is given to two samples")
        if not self.keeps_state:
            sessions = None
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        per_chunk = max(1, self.max_batch // params.n)
        out: list[list[Completion]] = []
        for i in range(0, len(prompts), per_chunk):
            out += self._generate_batch(prompts[i:i + per_chunk], params,
                                        None if sessions is None else sessions[i:i + per_chunk],
                                        images[i:i + per_chunk])
        return out

    def _check_images(self, prompts, images) -> list[np.ndarray | None]:
        """Per prompt, its patches (None: no placeholder); a count that does not match is named."""
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"images: {len(images)} entries for {len(prompts)} prompts")
        out = []
        for b, p in enumerate(prompts):
            patches = None if images is None else images[b]
            slots = 0 if self._placeholder is None else int((np.asarray(p) == self._placeholder).sum())
            if patches is not None and self.image_patch is None:
                raise ValueError("images: this model reads no images (media_placeholder_token_id is null)")
            n = 0 if patches is None else len(patches)
            if n != slots:
                raise ValueError(f"images: prompt {b} has {slots} image placeholders but {n} patches")
            out.append(patches if n else None)
        return out

    @torch.no_grad()
    def _generate_batch(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                        sessions: Sequence[Sequence[Hashable]] | None,
                        images: Sequence[np.ndarray | None]) -> list[list[Completion]]:
        prompts = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
        if any(len(p) == 0 for p in prompts):
            raise ValueError("generate: every prompt needs at least one token")
        B, n, dev = len(prompts), params.n, self.device
        order, logits, state, resumed = self._prompt_states(prompts, params, sessions, images)
        stale = {b: kept.stale_tokens(self.version) for b, kept in resumed.items()}
        position = {b: r for r, b in enumerate(order)}
        rows = torch.tensor([position[b] for b in range(B)], device=dev).repeat_interleave(n)  # [B·n]
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
            new, lp = sample_tokens(logits, params.temperature, params.top_p, self.generator, self._banned)
            keep = []
            # one device → host read per step for the whole batch (not one per row: a GPU sync each)
            new_ids, new_lps = new.tolist(), lp.tolist()
            for row, s in enumerate(alive):
                tok = new_ids[row]
                tokens[s].append(tok)
                logps[s].append(new_lps[row])
                if tok in stop_ids or (params.stop and self._hits_stop(tokens[s], params.stop, window)):
                    reasons[s] = "stop"
                elif len(tokens[s]) < params.max_tokens:
                    keep.append(row)
            if sessions is not None and len(keep) < len(alive):
                done = sorted(set(range(len(alive))) - set(keep))
                self._keep_sessions(state, done, [alive[r] for r in done], prompts, tokens, sessions, n, resumed)
            if not keep:
                break
            if len(keep) < len(alive):
                idx = torch.tensor(keep, device=dev)
                state, new = self._select(state, idx), new[idx]
                alive = [alive[r] for r in keep]
            logits, state = self._decode(new, state)
            if state.get("route") is not None:
                step_routes = state["route"][:, -1].tolist()  # [rows, layers, k], one read
                for row, s in enumerate(alive):
                    routed[s].append(step_routes[row])
        if self.is_k3 and state.get("route") is not None:
            # A sample's last token is never fed back, so it has no routing: -1 marks it.
            blank = [[-1] * len(state["route"][0, -1][0])] * state["route"].shape[2]
            for s in range(N):
                routed[s] += [blank] * (len(tokens[s]) - len(routed[s]))
        return [[Completion(tokens[b * n + j], logps[b * n + j], reasons[b * n + j], routed[b * n + j] or None,
                            stale.get(b, 0)) for j in range(n)] for b in range(B)]

    def _prompt_states(self, prompts: list[np.ndarray], params: SamplingParams,
                       sessions: Sequence[Sequence[Hashable]] | None, images: Sequence[np.ndarray | None]
                       ) -> tuple[list[int], torch.Tensor, dict, dict[int, Session]]:
        """Prefill the prompts — from a kept session where one continues, else in full: (the prompt of each
        row, last-position logits [B, V], the decode state with room for `params.max_tokens` more, the
        session each resumed prompt continued)."""
        dev = self.device
        resumed: dict[int, Session] = {}
        for b, p in enumerate(prompts):
            kept, why = (None, None) if sessions is None else \
                self.sessions.take(sessions[b], p, self.version, stale_ok=self.resume_stale)
            if kept is not None:
                resumed[b] = kept
                self.stats.stale_state_tokens += kept.stale_tokens(self.version)
            elif why == "prefix":
                self.stats.prefix_fallbacks += 1
            elif why == "version":
                self.stats.version_fallbacks += 1
        parts: list[tuple[list[int], torch.Tensor, dict]] = []
        fresh = [b for b in range(len(prompts)) if b not in resumed]
        if fresh:
            T = max(len(prompts[b]) for b in fresh)
            ids = torch.full((len(fresh), T), self.tokenizer.pad_token_id or 0, dtype=torch.long, device=dev)
            mask = torch.zeros((len(fresh), T), dtype=torch.long, device=dev)
            for r, b in enumerate(fresh):
                ids[r, T - len(prompts[b]):] = torch.from_numpy(prompts[b]).to(dev)
                mask[r, T - len(prompts[b]):] = 1
            patch_ids, table = self._patch_ids([(prompts[b], images[b], 0, T - len(prompts[b])) for b in fresh], T)
            logits, state = self.policy.prefill(ids, mask, T + params.max_tokens, self.prefill_tokens, patch_ids, table)
            parts.append((fresh, logits, state))
            self.stats.full_prompts += len(fresh)
            self.stats.prefilled_tokens += sum(len(prompts[b]) for b in fresh)
        # Kept states take their new tokens in one step per distinct count: only left padding is exact
        # (a padding column inside a sequence would shift the KDA conv window).
        by_new: dict[int, list[int]] = {}
        for b, kept in resumed.items():
            by_new.setdefault(len(prompts[b]) - len(kept.tokens), []).append(b)
        for new, members in by_new.items():
            kept = [resumed[b] for b in members]
            longest = max(len(k.tokens) for k in kept)
            state = self.policy.stack([k.state for k in kept], capacity=longest + new + params.max_tokens)
            ids = torch.from_numpy(np.stack([prompts[b][len(k.tokens):] for b, k in zip(members, kept)])).to(dev)
            patch_ids, table = self._patch_ids([(prompts[b], images[b], len(k.tokens), -len(k.tokens))
                                                for b, k in zip(members, kept)], new)
            logits, state = self.policy.extend(ids, state, self.prefill_tokens, patch_ids, table)
            parts.append((members, logits, state))
            self.stats.resumed_prompts += len(members)
            self.stats.prefilled_tokens += new * len(members)
            self.stats.reused_tokens += sum(len(k.tokens) for k in kept)
        if len(parts) == 1:
            return (*parts[0], resumed)
        capacity = max(len(p) for p in prompts) + params.max_tokens
        return ([b for members, _, _ in parts for b in members], torch.cat([lg for _, lg, _ in parts]),
                self.policy.stack([st for _, _, st in parts], capacity), resumed)

    def _keep_sessions(self, state: dict, rows: list[int], samples: list[int], prompts: list[np.ndarray],
                       tokens: list[list[int]], sessions: Sequence[Sequence[Hashable]], n: int,
                       resumed: dict[int, Session]) -> None:
        """Keep the state of finished `rows` (sample indices `samples`) under their session ids: it covers
        the prompt and the sampled tokens but the last, which stays pending (rollout/sessions.py); the part a
        resumed prompt's session covered keeps the versions that computed it."""
        for row_state, s in zip(self.policy.split(state, rows), samples):
            b, j = divmod(s, n)
            consumed = np.concatenate([prompts[b], np.asarray(tokens[s][:-1], dtype=np.int64)])
            before = resumed[b].computed_by if b in resumed else np.zeros(0, dtype=np.int64)
            computed_by = np.concatenate([before, np.full(len(consumed) - len(before), self.version, dtype=np.int64)])
            self.sessions.put(sessions[b][j], Session(consumed, row_state, self.version, computed_by))

    def _hits_stop(self, tokens: list[int], stops: tuple[str, ...], window: int) -> bool:
        tail = self.tokenizer.decode(tokens[-window:], skip_special_tokens=False)
        return any(s in tail for s in stops)

    def _patch_ids(self, rows: list[tuple[np.ndarray, np.ndarray | None, int, int]], width: int
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """([B, width] patch ids, the table) for rows (prompt, its patches, first token fed, column of prompt token 0
        in the batch): the placeholders from the first token fed on take their patches in order."""
        if all(patches is None for _, patches, _, _ in rows):
            return None, None
        ids = np.full((len(rows), width), -1, dtype=np.int64)
        tables, offset = [], 0
        for r, (prompt, patches, first, column) in enumerate(rows):
            if patches is None:
                continue
            slots = np.flatnonzero(prompt == self._placeholder)
            before = int((slots < first).sum())
            fed = slots[slots >= first]
            ids[r, fed + column] = offset + before + np.arange(len(fed))
            tables.append(patches)
            offset += len(patches)
        dev = self.device
        return torch.from_numpy(ids).to(dev), torch.from_numpy(np.concatenate(tables)).to(dev)

    def _decode(self, new: torch.Tensor, state: dict):
        return self.policy.decode(new, state)

    def _select(self, state: dict, index: torch.Tensor) -> dict:
        return self.policy.select(state, index)
