"""`AgentLoop`: many tool-using episodes at once through one engine, token-faithful.

Each round, every running episode contributes its token list to one batched `generate` call
that stops at the end of a tool call (`</tool_call>`) or at EOS. The sampled tokens are appended
exactly as sampled (loss mask 1); their text is handed to the environment's `Episode.step`,
which parses the call (envs/tools.py: malformed calls become error observations, never
exceptions), runs the tool and enforces the environment's budgets; the observation is rendered
once into tokens (loss mask 0) and appended. An episode also ends when its context would exceed
`max_context_tokens` (`truncated:context`).

Partial rollouts: `run(..., max_rounds=k)` stops after k rounds and hands back each unfinished
episode as a `PausedEpisode` (request, the environment's `Episode` with its env object, the tokens
so far); `run(..., resume=[…])` continues them at that turn boundary. Nothing about a paused
episode leaves the process. Its next turns are sampled by whatever weights the engine holds then
and carry that version. Under `reprefill` (rl/config/sections.py `rollout.partial_resume`) the engine prefills
the whole context again under those weights; under `keep_state` it continues the episode's session
state, part of which older weights computed: each trajectory counts, over its turns, the context
tokens read from such a state (`metrics["stale_state_tokens"]`, from `Completion.stale_state_tokens`).

State reuse: with an engine that keeps states (rollout/engine.py `SessionEngine`, the native engine),
each episode is one session of the engine, and each round hands it the context as an array (no
per-token Python list); the engine prefills only what the episode added since its last turn. The loop
ends an episode's session when the episode ends; a paused episode keeps it (across a weight update only
under `keep_state`; otherwise the engine drops it and the next turn is prefilled in full).

Context compaction (`Compaction`, `rollout.compaction_tokens`): when an episode's context reaches the budget at a
turn boundary, the tool result is followed by a user message asking for a summary of the progress; the model's
summary turn is sampled (and trained) like any other, and the episode goes on as a new sequence that starts from
[system, task, summary] (`SUMMARY_HEADER` + the summary's text, in a user message): the environment keeps its
state, the engine prefills the short new context once (a new session, whose state later turns reuse). A
compacted episode ends as several trajectories sharing its `episode_id` and reward (`run` hands them back as a
list); they count as one sample of the group (rl/train/advantages.py `compute_advantages`).

The environment sees only text; the engine sees only tokens; the loop is the one place where
they meet.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from k3rl.envs.base import Budget, Env, Episode
from k3rl.envs.tools import STOP_SEQUENCES
from k3rl.rollout.chat import ChatRenderer, images_of
from k3rl.rollout.engine import Engine, SamplingParams, SessionEngine, sample_contexts
from k3rl.rollout.trajectory import Trajectory, TrajectoryBuilder

SUMMARY_HEADER = "Your progress so far (you summarised it when your context was full):\n"


@dataclass
class Compaction:
    """Context compaction settings (rl/config/sections.py `rollout.compaction_*`; module docstring)."""

    tokens: int
    """Context length at a turn boundary that triggers a summary."""
    prompt: str
    summary_tokens: int = 256
    max_compactions: int = 4


@dataclass
class EpisodeRequest:
    """One episode to run: a task and the group it belongs to."""

    task: Any
    task_id: str
    group_id: str
    sample_idx: int = 0


@dataclass
class PausedEpisode:
    """An episode between two turns: what `run(..., resume=…)` needs to continue it.

    Held in the memory of the process that runs the loop (a rollout worker); never pickled."""

    request: EpisodeRequest
    episode: Episode
    """The environment's side: messages, budgets, counters, and the env object with its state."""
    builder: TrajectoryBuilder
    """Tokens so far, each sampled token with the policy version that sampled it."""
    pauses: int = 0
    """Times the episode was paused so far."""
    finish: str | None = field(default=None, repr=False)
    """Set by `run` once the episode has ended."""
    session: Any = field(default=None, repr=False)
    """The engine session holding this episode's decode state (engines with sessions)."""
    stale_state_tokens: int = 0
    """Context tokens its turns so far read from a decode state older weights computed (`keep_state`)."""
    opening: list = field(default_factory=list, repr=False)
    """The opening messages (system, task): where a compacted episode starts again."""
    sequences: list = field(default_factory=list, repr=False)
    """Builders of the sequences that compaction ended (the current one is `builder`)."""
    summarising: bool = False
    """The next turn is the summary compaction asked for."""
    summaries: list = field(default_factory=list, repr=False)


def episode_trajectories(item: Any) -> list[Trajectory]:
    """The trajectories of one ended episode as `AgentLoop.run` returns it: one, or a compacted episode's list."""
    return list(item) if isinstance(item, list) else [item]


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
                 budget: Budget | None = None, max_context_tokens: int = 4096, env_name: str = "",
                 compaction: Compaction | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.image_patch = getattr(engine, "image_patch", None)
        """The model's patch size when it reads images (envs/media.py), else None."""
        self.renderer = ChatRenderer(tokenizer, image_patch=self.image_patch)
        self.env_factory = env_factory
        self.params = params
        self.budget = budget
        self.max_context_tokens = max_context_tokens
        self.env_name = env_name
        self.compaction = compaction
        self.stats = LoopStats()
        self._free_envs: list[Env] = []
        """Environments of ended episodes, reused (building one may load an index); a paused episode keeps its own."""
        self._sessions = isinstance(engine, SessionEngine)
        self._session_ids = itertools.count()

    def _count_tokens(self, text: str) -> int:
        return len(self.renderer.encode_text(text, tool_result=True))

    def _turn_text(self, token_ids: list[int]) -> tuple[str, bool]:
        """Text of a sampled turn for the parser, and whether it ended with EOS (dropped from the text)."""
        eos = self.tokenizer.eos_token_id
        ended_with_eos = bool(token_ids) and token_ids[-1] == eos
        ids = token_ids[:-1] if ended_with_eos else token_ids
        return self.tokenizer.decode(ids, skip_special_tokens=False), ended_with_eos

    def run(self, requests: list[EpisodeRequest], max_rounds: int | None = None,
            resume: Sequence[PausedEpisode] = ()) -> list:
        """Run `requests`, and continue the `resume`d episodes, until they end — or for at most `max_rounds`
        rounds (one turn per episode each) in this call. Returns one item per episode, resumed ones first:
        its `Trajectory` when it ended (a list of them, one per sequence, when it was compacted:
        `episode_trajectories`), else a `PausedEpisode` to pass back as `resume` later (only with `max_rounds`)."""
        if max_rounds is not None and max_rounds < 1:
            raise ValueError(f"max_rounds: must be ≥ 1 or None, got {max_rounds}")
        for p in resume:
            if p.finish is not None or p.episode.done:
                raise ValueError(f"episode {p.request.group_id!r} #{p.request.sample_idx} has ended; only paused "
                                 f"episodes resume")
        states = list(resume) + [self._start(r) for r in requests]
        rounds = 0
        while max_rounds is None or rounds < max_rounds:
            active = [p for p in states if p.finish is None]
            if not active:
                break
            self._round(active)
            rounds += 1
        out: list = []
        for p in states:
            if p.finish is None:
                p.pauses += 1
                out.append(p)
            else:
                out.append(self._trajectory(p))
                self._free_envs.append(p.episode.env)
        return out

    def _start(self, request: EpisodeRequest) -> PausedEpisode:
        env = self._free_envs.pop() if self._free_envs else self.env_factory()
        episode = Episode(env, request.task, self.budget, self._count_tokens, image_patch=self.image_patch)
        p = PausedEpisode(request, episode, self._builder(episode.messages),
                          session=(id(self), next(self._session_ids)), opening=list(episode.messages))
        if p.builder.length >= self.max_context_tokens:
            p.finish = "truncated:context"
        return p

    def _builder(self, messages: list[dict]) -> TrajectoryBuilder:
        """A sequence starting with `messages` rendered as a prompt, their images beside it."""
        builder = TrajectoryBuilder(self.renderer.prompt_tokens(messages))
        builder.append_images([part.pixels for part in images_of(messages)])
        return builder

    def _round(self, active: list[PausedEpisode]) -> None:
        """One turn of every active episode: batched generate calls, then each environment's step."""
        # Episodes near the context limit get fewer new tokens: one generate call per distinct room.
        by_room: dict[int, list[int]] = {}
        context_bound = set()
        for i, p in enumerate(active):
            turn = self.compaction.summary_tokens if p.summarising else self.params.max_tokens
            room = min(turn, self.max_context_tokens - p.builder.length)
            by_room.setdefault(room, []).append(i)
            if room < turn:
                context_bound.add(i)
        outs = {}
        t0 = time.perf_counter()
        for room, idx in by_room.items():
            params = SamplingParams(n=1, temperature=self.params.temperature, top_p=self.params.top_p,
                                    max_tokens=room, stop=tuple(self.params.stop) + STOP_SEQUENCES,
                                    stop_token_ids=self.params.stop_token_ids, seed=self.params.seed)
            images = None
            if self.image_patch is not None:
                images = [active[i].builder.patches(self.image_patch) for i in idx]
                images = None if all(x is None for x in images) else images
            completions = sample_contexts(self.engine, [active[i].builder.token_array() for i in idx], params,
                                          [active[i].session for i in idx] if self._sessions else None, images)
            outs.update((i, [c]) for i, c in zip(idx, completions))
        self.stats.generate_seconds += time.perf_counter() - t0
        self.stats.rounds += 1
        self.stats.per_round_batch.append(len(active))
        t0 = time.perf_counter()
        for i, p in enumerate(active):
            (completion,) = outs[i]
            builder, episode = p.builder, p.episode
            builder.append_sampled(completion.token_ids, completion.logprobs, self.engine.version,
                                   completion.routed_experts)
            p.stale_state_tokens += completion.stale_state_tokens
            self.stats.generated_tokens += len(completion.token_ids)
            if completion.finish_reason == "length" and i in context_bound:
                # The turn was cut by the context window, not by the turn budget: nothing more fits.
                p.finish = "truncated:context"
                continue
            text, ended_with_eos = self._turn_text(completion.token_ids)
            if p.summarising:
                self._compact(p, text)
                continue
            step = episode.step(text)
            if step.done:
                # Nothing after the last sampled token can be trained on: the terminal tool's result
                # (often the reward itself) stays out of the trajectory.
                p.finish = "truncated:" + episode.finish_reason if episode.truncated else "done"
                continue
            shown = episode.messages[-1]["content"]  # the tool message: its text, or text and images
            obs = self.renderer.observation_tokens(shown, ended_with_eos)
            c = self.compaction
            if c is not None and builder.length + len(obs) >= c.tokens and len(p.sequences) < c.max_compactions:
                # the tool result, then the request for a summary: the next turn is the summary (module docstring)
                obs = self.renderer.continuation_tokens([{"role": self.renderer.tool_role, "content": shown},
                                                         {"role": "user", "content": c.prompt}], ended_with_eos)
                p.summarising = True
            if builder.length + len(obs) + 1 > self.max_context_tokens:
                p.finish = "truncated:context"
            else:
                builder.append_context(obs)
                builder.append_images([part.pixels for part in images_of([episode.messages[-1]])])
        if self._sessions:
            self.engine.end_sessions([p.session for p in active if p.finish is not None])
        self.stats.env_seconds += time.perf_counter() - t0

    def _compact(self, p: PausedEpisode, summary: str) -> None:
        """End the episode's sequence after its summary turn and go on from [system, task, summary]; an episode
        whose new start would not leave room under the compaction budget ends (`truncated:context`)."""
        p.summarising = False
        builder = self._builder(p.opening + [{"role": "user", "content": SUMMARY_HEADER + summary}])
        p.summaries.append(summary)
        if builder.length >= self.compaction.tokens:
            p.finish = "truncated:context"
            return
        p.sequences.append(p.builder)
        p.builder = builder
        if self._sessions:  # the new start is prefilled once, in a session of its own
            self.engine.end_sessions([p.session])
            p.session = (id(self), next(self._session_ids))

    def _trajectory(self, p: PausedEpisode) -> Trajectory | list[Trajectory]:
        if p.sequences:
            episode_id = f"{p.request.group_id}#{p.request.sample_idx}"
            out = []
            for builder in [*p.sequences, p.builder]:
                t = self._sequence(p, builder)
                t.episode_id = episode_id
                t.metrics["compactions"] = float(len(p.sequences))
                t.info["summaries"] = list(p.summaries)
                out.append(t)
            return out
        return self._sequence(p, p.builder)

    def _sequence(self, p: PausedEpisode, builder: TrajectoryBuilder) -> Trajectory:
        request, episode, finish_reason = p.request, p.episode, p.finish
        if not episode.done:
            episode.truncate(finish_reason.removeprefix("truncated:"))
        info = episode.info
        numeric = {k: float(v) for k, v in info.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        traj = builder.finish(
            reward=float(episode.reward), rewards={k: v for k, v in numeric.items() if k not in _COUNTERS},
            metrics={k: v for k, v in numeric.items() if k in _COUNTERS} | {"sampled_tokens": float(builder.num_sampled)},
            info={k: v for k, v in info.items() if k not in numeric}, env=self.env_name,
            task_id=request.task_id, group_id=request.group_id, finish_reason=finish_reason)
        # Partial rollouts: how many sampled tokens an older policy than the episode's last one sampled.
        sampled = traj.versions[traj.loss_mask.astype(bool)]
        traj.metrics["stale_sampled_tokens"] = float((sampled < sampled.max()).sum()) if len(sampled) else 0.0
        traj.metrics["pauses"] = float(p.pauses)
        traj.metrics["stale_state_tokens"] = float(p.stale_state_tokens)
        return traj

_COUNTERS = {"turns", "tool_calls", "observation_tokens", "tool_seconds"}
