"""`AgentLoop`: many tool-using episodes at once through one engine, token-faithful.

Each round, every running episode contributes its token list to one batched `generate` call
that stops at the end of a tool call (`</tool_call>`) or at EOS. The sampled tokens are appended
exactly as sampled (loss mask 1); their text is handed to the environment's `Episode.step`,
which parses the call (envs/tools.py: malformed calls become error observations, never
exceptions), runs the tool and enforces the environment's budgets; the observation is rendered
once into tokens (loss mask 0) and appended. An episode also ends when its context would exceed
`max_context_tokens` (`truncated:context`).

The environment sees only text; the engine sees only tokens; the loop is the one place where
they meet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from envs.base import Budget, Env, Episode
from envs.tools import STOP_SEQUENCES
from rollout.chat import ChatRenderer
from rollout.engine import Engine, SamplingParams
from rollout.trajectory import Trajectory, TrajectoryBuilder


@dataclass
class EpisodeRequest:
    """One episode to run: a task and the group it belongs to."""

    task: Any
    task_id: str
    group_id: str
    sample_idx: int = 0


@dataclass
class LoopStats:
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    env_seconds: float = 0.0
    rounds: int = 0
    per_round_batch: list[int] = field(default_factory=list)


class AgentLoop:
    """Runs episodes of one environment class through one engine; see module docstring."""

    def __init__(self, engine: Engine, tokenizer, env_factory: Callable[[], Env], params: SamplingParams,
                 budget: Budget | None = None, max_context_tokens: int = 4096, env_name: str = ""):
        self.engine = engine
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer)
        self.env_factory = env_factory
        self.params = params
        self.budget = budget
        self.max_context_tokens = max_context_tokens
        self.env_name = env_name
        self.stats = LoopStats()
        self._envs: list[Env] = []

    def _count_tokens(self, text: str) -> int:
        return len(self.renderer.encode_text(text, tool_result=True))

    def _turn_text(self, token_ids: list[int]) -> tuple[str, bool]:
        """Text of a sampled turn for the parser, and whether it ended with EOS (dropped from the text)."""
        eos = self.tokenizer.eos_token_id
        ended_with_eos = bool(token_ids) and token_ids[-1] == eos
        ids = token_ids[:-1] if ended_with_eos else token_ids
        return self.tokenizer.decode(ids, skip_special_tokens=False), ended_with_eos

    def run(self, requests: list[EpisodeRequest]) -> list[Trajectory]:
        # Environments are reused across calls (one per concurrent episode): building one may load an index.
        while len(self._envs) < len(requests):
            self._envs.append(self.env_factory())
        episodes = [Episode(env, r.task, self.budget, self._count_tokens) for env, r in zip(self._envs, requests)]
        builders = [TrajectoryBuilder(self.renderer.prompt_tokens(ep.messages)) for ep in episodes]
        finish: dict[int, str] = {}
        for i, b in enumerate(builders):
            if b.length >= self.max_context_tokens:
                finish[i] = "truncated:context"
        while len(finish) < len(episodes):
            active = [i for i in range(len(episodes)) if i not in finish]
            # Episodes near the context limit get fewer new tokens: one generate call per distinct room.
            by_room: dict[int, list[int]] = {}
            for i in active:
                room = min(self.params.max_tokens, self.max_context_tokens - builders[i].length)
                by_room.setdefault(room, []).append(i)
            context_bound = {i for room, idx in by_room.items() if room < self.params.max_tokens for i in idx}
            outs = {}
            t0 = time.perf_counter()
            for room, idx in by_room.items():
                # Episodes whose contexts are identical (a task's group, in its first turn) are asked as
                # one prompt with n samples, so the engine prefills that prompt once.
                same: dict[tuple[int, ...], list[int]] = {}
                for i in idx:
                    same.setdefault(tuple(builders[i].tokens()), []).append(i)
                by_n: dict[int, list[tuple[tuple[int, ...], list[int]]]] = {}
                for prompt, members in same.items():
                    by_n.setdefault(len(members), []).append((prompt, members))
                for n, prompts in by_n.items():
                    params = SamplingParams(n=n, temperature=self.params.temperature, top_p=self.params.top_p,
                                            max_tokens=room, stop=tuple(self.params.stop) + STOP_SEQUENCES,
                                            stop_token_ids=self.params.stop_token_ids, seed=self.params.seed)
                    results = self.engine.generate([list(p) for p, _ in prompts], params)
                    for (_, members), samples in zip(prompts, results):
                        outs.update((i, [c]) for i, c in zip(members, samples))
            self.stats.generate_seconds += time.perf_counter() - t0
            self.stats.rounds += 1
            self.stats.per_round_batch.append(len(active))
            t0 = time.perf_counter()
            for i in active:
                (completion,) = outs[i]
                builder, episode = builders[i], episodes[i]
                builder.append_sampled(completion.token_ids, completion.logprobs, self.engine.version,
                                       completion.routed_experts)
                self.stats.generated_tokens += len(completion.token_ids)
                if completion.finish_reason == "length" and i in context_bound:
                    # The turn was cut by the context window, not by the turn budget: nothing more fits.
                    finish[i] = "truncated:context"
                    continue
                text, ended_with_eos = self._turn_text(completion.token_ids)
                step = episode.step(text)
                if step.done:
                    # Nothing after the last sampled token can be trained on: the terminal tool's result
                    # (often the reward itself) stays out of the trajectory.
                    finish[i] = "truncated:" + episode.finish_reason if episode.truncated else "done"
                    continue
                obs = self.renderer.observation_tokens(step.observation, ended_with_eos)
                if builder.length + len(obs) + 1 > self.max_context_tokens:
                    finish[i] = "truncated:context"
                else:
                    builder.append_context(obs)
            self.stats.env_seconds += time.perf_counter() - t0
        return [self._trajectory(r, ep, b, finish[i]) for i, (r, ep, b) in enumerate(zip(requests, episodes, builders))]

    def _trajectory(self, request: EpisodeRequest, episode: Episode, builder: TrajectoryBuilder,
                    finish_reason: str) -> Trajectory:
        if not episode.done:
            episode.truncate(finish_reason.removeprefix("truncated:"))
        info = episode.info
        numeric = {k: float(v) for k, v in info.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return builder.finish(
            reward=float(episode.reward), rewards={k: v for k, v in numeric.items() if k not in _COUNTERS},
            metrics={k: v for k, v in numeric.items() if k in _COUNTERS} | {"sampled_tokens": float(builder.num_sampled)},
            info={k: v for k, v in info.items() if k not in numeric}, env=self.env_name,
            task_id=request.task_id, group_id=request.group_id, finish_reason=finish_reason)

_COUNTERS = {"turns", "tool_calls", "observation_tokens", "tool_seconds"}
