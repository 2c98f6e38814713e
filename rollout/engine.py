"""The `Engine` protocol: token ids in, sampled token ids and their logprobs out.

Engines never see text or chat messages: the agent loop renders tokens once (rollout/chat.py)
and keeps the sampled tokens exactly as the engine returned them, so the learner trains on the
very tokens that were sampled. Two engines implement it: `VLLMEngine` (any model vLLM serves)
and `TorchEngine` (k3rl's own, for K3 on the CPU and any HF causal LM).

Sampling semantics shared by both engines (they must agree in distribution): logits / temperature,
then nucleus (top-p) truncation, then one categorical draw. The reported logprob of a sampled
token is that of the unmodified model distribution (log_softmax of the raw logits), which is what
the learner recomputes; temperature 0 means greedy.

`SessionEngine` is the optional extension for engines that keep an episode's decode state between its
turns (`TorchEngine` with `reuse_state`, rollout/sessions.py): the agent loop uses it when an engine has
it, and calls plain `generate(prompts, params)` otherwise (vLLM reuses prefixes with its own cache).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class SamplingParams:
    """What to sample for each prompt."""

    n: int = 1
    """Samples per prompt."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 128
    stop: tuple[str, ...] = ()
    """Strings that end a sample; the stop string stays in the output (the parser needs it)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a sample (kept in the output); the engine adds the tokenizer's EOS."""
    seed: int | None = None

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be ≥ 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be ≥ 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be ≥ 1, got {self.max_tokens}")
        self.stop = tuple(self.stop)
        self.stop_token_ids = tuple(self.stop_token_ids)


@dataclass
class Completion:
    """One sample: its tokens, the behaviour logprob of each, and why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """`stop` (EOS, a stop token or a stop string) or `length` (max_tokens)."""
    routed_experts: list | None = field(default=None, repr=False)
    """Per sampled token, the routed expert ids of each MoE layer (engines that can report them)."""
    stale_state_tokens: int = 0
    """Prompt tokens read from a kept decode state that older weights than this sample's computed (engines
    that continue a stale session, rollout/sessions.py); 0 when the current weights computed the whole context."""


@runtime_checkable
class Engine(Protocol):
    version: int
    """Policy version of the weights currently loaded (0 for the initial weights)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        """For each prompt, `params.n` completions."""

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace the weights (checkpoint names) and set the policy version."""

    def reset_cache(self) -> None:
        """Drop cached prefixes/KV state computed with older weights."""


@runtime_checkable
class SessionEngine(Engine, Protocol):
    """An engine that keeps each sample's state under a session id between `generate` calls."""

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 sessions: Sequence[Sequence[Hashable]] | None = None) -> list[list[Completion]]:
        """As `Engine.generate`; prompts may also be 1-D integer arrays. `sessions`: per prompt, `params.n`
        ids (one per sample) whose states are kept; a later prompt naming an id and extending that sample's
        tokens continues from its state instead of prefilling them again."""

    def end_sessions(self, ids: Iterable[Hashable]) -> None:
        """Drop the kept states of sessions `ids` (their episodes ended)."""


def sample_contexts(engine: Engine, contexts: Sequence[Any], params: SamplingParams,
                    sessions: Sequence[Hashable] | None = None, images: Sequence[Any] | None = None
                    ) -> list[Completion]:
    """One completion per context (1-D int arrays) in as few `generate` calls as the engine needs: identical
    contexts (a task's group, in its first turn) are asked as one prompt with n samples, so the engine prefills
    that prompt once; contexts are compared as arrays, and only those of equal length. `sessions`: one per context
    for an engine that keeps states (`SessionEngine`), which then prefills only what each session added. `images`:
    one per context, the patches of its image placeholders or None (rollout/torch_engine.py); contexts are the same
    only with the same pixels."""
    import numpy as np

    def same_images(a: int, b: int) -> bool:
        if images is None or (images[a] is None and images[b] is None):
            return True
        return images[a] is not None and images[b] is not None and np.array_equal(images[a], images[b])

    same: list[tuple[Any, list[int]]] = []
    by_len: dict[int, list[int]] = {}
    for i, context in enumerate(contexts):
        groups = by_len.setdefault(len(context), [])
        match = next((g for g in groups if np.array_equal(same[g][0], context) and same_images(same[g][1][0], i)),
                     None)
        if match is None:
            groups.append(len(same))
            same.append((context, [i]))
        else:
            same[match][1].append(i)
    by_n: dict[int, list[tuple[Any, list[int]]]] = {}
    for prompt, members in same:
        by_n.setdefault(len(members), []).append((prompt, members))
    out: list[Completion | None] = [None] * len(contexts)
    for n, prompts in by_n.items():
        p = SamplingParams(n=n, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
                           stop=params.stop, stop_token_ids=params.stop_token_ids, seed=params.seed)
        media = {} if images is None else {"images": [images[m[0]] for _, m in prompts]}
        if sessions is not None:
            results = engine.generate([c for c, _ in prompts], p, sessions=[[sessions[i] for i in m] for _, m in prompts],
                                      **media)
        else:
            results = engine.generate([np.asarray(c).tolist() for c, _ in prompts], p, **media)
        for (_, members), samples in zip(prompts, results):
            for i, completion in zip(members, samples):
                out[i] = completion
    return out
