"""`AgentRunner`: episodes of an agent of the user's own (envs/agent.py), run on a rollout worker.

Each episode runs the agent function in a thread of the worker's process (or, with `env.args.sandbox: process`, in
a fresh subprocess killed at its timeout) with an OpenAI client whose `base_url`
is the worker's endpoint (rollout/agent_endpoint.py) and whose API key is the episode's, so every call lands in
its episode. Meanwhile `run` drains the endpoint's queue: it waits until every running agent has a call waiting
(or a few milliseconds more), then samples all of them in batched `generate` calls (rollout/engine.py
`sample_contexts`: identical prompts, such as a group's first calls, are prefilled once; an engine that keeps
states continues each sequence's session).

An agent that raises, returns something that is not a reward, or runs past `env.args.timeout_s` is a failed
episode: reward 0, the reason in `info["error"]` and `finish_reason` (`failed:exception`, `failed:result`,
`failed:timeout`); its key is closed, so calls it still makes get an error response. The worker carries on.

An episode becomes one trajectory per sequence of its calls, all with its reward and `episode_id`, in the order
the sequences started; an episode that made no call is one placeholder trajectory (one token, nothing to train)
so that it still counts in its group and in success rates.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import openai

from k3rl.envs.agent import AgentEnv
from k3rl.envs.tools import STOP_SEQUENCES
from k3rl.rollout.agent_endpoint import AgentEndpoint, EpisodeCalls, PendingCall
from k3rl.rollout.agent_loop import EpisodeRequest, LoopStats
from k3rl.rollout.chat_api import ChatRequestError
from k3rl.rollout.engine import Engine, SamplingParams, SessionEngine, sample_contexts
from k3rl.rollout.trajectory import Trajectory, TrajectoryBuilder

LINGER_S = 0.02
"""How long a batch waits for agents that have no call waiting yet (they may be running a tool)."""


@dataclass
class AgentRun:
    """One episode: its request, its calls, where the agent runs and what it returned."""

    request: EpisodeRequest
    episode: EpisodeCalls
    thread: threading.Thread | None = None
    process: Any = None
    """With `sandbox: process`: the agent's subprocess and the pipe its outcome comes back on."""
    pipe: Any = None
    outcome: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    failure: str | None = None

    def running(self) -> bool:
        if self.process is None:
            return self.thread.is_alive()
        if self.pipe is not None and self.pipe.poll():
            try:
                self.outcome.update(self.pipe.recv())
            except (EOFError, OSError):
                pass
            self.pipe = None
        if not self.process.is_alive():
            if not self.outcome:
                self.outcome["error"] = f"the agent's process exited with code {self.process.exitcode}"
            return False
        return True

    def stop(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def _in_process(run: Any, base_url: str, key: str, task: Any, timeout_s: float, conn) -> None:
    """A sandboxed agent's subprocess: run it, send back what it returned or raised."""
    out: dict[str, Any] = {}
    call_agent(run, base_url, key, task, timeout_s, out)
    try:
        conn.send(out)
    except Exception as e:  # the result does not pickle: say so instead
        conn.send({"error": f"the agent's result could not be sent back ({type(e).__name__}: {e})"})


def call_agent(run: Any, base_url: str, key: str, task: Any, timeout_s: float, out: dict[str, Any]) -> None:
    """Run the agent function with a client for its episode; what it returns or raises goes into `out`."""
    try:
        if inspect.iscoroutinefunction(run):
            async def main():
                async with openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0,
                                              timeout=timeout_s) as client:
                    return await run(client, task)

            out["result"] = asyncio.run(main())
        else:
            with openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=timeout_s) as client:
                out["result"] = run(client, task)
    except BaseException as e:  # the agent's own failure: a failed episode, never a dead worker
        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc(limit=8)


def reward_of(result: Any) -> tuple[float, dict[str, float]]:
    """(reward, reward components) of what an agent returned: a number, or {"reward": number, "metrics": {…}};
    anything else is a ValueError naming it."""
    metrics: dict[str, float] = {}
    if isinstance(result, dict):
        metrics = result.get("metrics") or {}
        if not isinstance(metrics, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                    for v in metrics.values()):
            raise ValueError(f"the agent's `metrics` must map names to numbers, got {metrics!r}"[:300])
        result = result.get("reward")
    if isinstance(result, bool) or not isinstance(result, (int, float)) or not math.isfinite(result):
        raise ValueError(f"the agent returned {result!r} (a finite number, or {{'reward': number}} expected)"[:300])
    return float(result), {str(k): float(v) for k, v in metrics.items()}


class AgentRunner:
    """Runs agent episodes through one engine and one endpoint; see module docstring."""

    def __init__(self, engine: Engine, tokenizer, env: AgentEnv, params: SamplingParams,
                 max_context_tokens: int = 4096, env_name: str = ""):
        self.engine = engine
        self.tokenizer = tokenizer
        self.env = env
        self.params = params
        self.env_name = env_name
        self.endpoint = AgentEndpoint(tokenizer, max_context_tokens, params.max_tokens)
        self.stats = LoopStats()
        self._sessions = isinstance(engine, SessionEngine)

    def close(self) -> None:
        self.endpoint.close()

    def run(self, requests: list[EpisodeRequest]) -> list[Trajectory]:
        """Run one episode per request to its end; one or more trajectories per episode, in request order."""
        runs = []
        sandboxed = getattr(self.env, "sandbox", "thread") == "process"
        for r in requests:
            episode = self.endpoint.open_episode(f"{r.group_id}#{r.sample_idx}", self.env.timeout_s)
            run = AgentRun(r, episode)
            if sandboxed:
                import multiprocessing

                ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing of the worker's state
                run.pipe, child = ctx.Pipe(duplex=False)
                run.process = ctx.Process(target=_in_process, daemon=True, name=f"k3rl-agent-{episode.episode_id}",
                                          args=(self.env.run, self.endpoint.base_url, episode.key, r.task,
                                                self.env.timeout_s, child))
            else:
                run.thread = threading.Thread(target=call_agent, daemon=True, name=f"k3rl-agent-{episode.episode_id}",
                                              args=(self.env.run, self.endpoint.base_url, episode.key, r.task,
                                                    self.env.timeout_s, run.outcome))
            runs.append(run)
        for run in runs:
            (run.process or run.thread).start()
        while True:
            live = self._live(runs)
            batch = self._gather(len(live), block=bool(live))
            if batch:
                self._sample(batch)
            elif not live:
                break
        for run in runs:
            run.stop()
            self.endpoint.close_episode(run.episode, run.failure or "ended")
        self._refuse_waiting()
        if self._sessions:
            self.engine.end_sessions([s.session for run in runs for s in run.episode.sequences])
        return [t for run in runs for t in self._trajectories(run)]

    def _live(self, runs: list[AgentRun]) -> list[AgentRun]:
        """Runs whose agent is still running; those past their deadline are failed and closed here."""
        live = []
        now = time.monotonic()
        for run in runs:
            if run.failure is not None or not run.running():
                continue
            if now > run.episode.deadline:
                run.failure = "timeout"
                self.endpoint.close_episode(run.episode, f"timed out after {self.env.timeout_s:g} s")
                run.stop()  # a subprocess is killed; a thread is left to fail on its refused calls
                continue
            live.append(run)
        return live

    def _gather(self, live: int, block: bool) -> list[PendingCall]:
        """The calls waiting now: the first waited for (briefly), then up to `LINGER_S` more for the other live
        agents' calls."""
        batch: list[PendingCall] = []
        try:
            batch.append(self.endpoint.calls.get(timeout=0.05) if block else self.endpoint.calls.get_nowait())
        except queue.Empty:
            return batch
        until = time.monotonic() + LINGER_S
        while len(batch) < live:
            left = until - time.monotonic()
            if left <= 0:
                break
            try:
                batch.append(self.endpoint.calls.get(timeout=left))
            except queue.Empty:
                break
        while True:
            try:
                batch.append(self.endpoint.calls.get_nowait())
            except queue.Empty:
                return batch

    def _sample(self, batch: list[PendingCall]) -> None:
        open_calls = [c for c in batch if not c.episode.closed]
        for c in batch:
            if c.episode.closed:
                c.error = ChatRequestError(f"episode {c.episode.episode_id} takes no more calls ({c.episode.closed})",
                                           status=401, type="authentication_error", code="episode_closed")
                c.done.set()
        self.endpoint.version = self.engine.version
        by_room: dict[int, list[PendingCall]] = {}
        for c in open_calls:
            by_room.setdefault(c.max_tokens, []).append(c)
        t0 = time.perf_counter()
        try:
            for room, calls in by_room.items():
                params = SamplingParams(n=1, temperature=self.params.temperature, top_p=self.params.top_p,
                                        max_tokens=room, stop=tuple(self.params.stop) + STOP_SEQUENCES,
                                        stop_token_ids=self.params.stop_token_ids, seed=self.params.seed)
                completions = sample_contexts(self.engine, [c.prompt for c in calls], params,
                                              [c.session for c in calls] if self._sessions else None)
                for c, completion in zip(calls, completions):
                    c.completion = completion
                    self.stats.generated_tokens += len(completion.token_ids)
                    c.done.set()
        except Exception as e:  # the engine failed: every waiting call is answered, then the worker reports it
            for c in open_calls:
                if not c.done.is_set():
                    c.error = ChatRequestError(f"the engine failed: {type(e).__name__}: {e}", status=500,
                                               type="server_error")
                    c.done.set()
            raise
        finally:
            self.stats.generate_seconds += time.perf_counter() - t0
            self.stats.rounds += 1
            self.stats.per_round_batch.append(len(open_calls))

    def _refuse_waiting(self) -> None:
        while True:
            try:
                c = self.endpoint.calls.get_nowait()
            except queue.Empty:
                return
            c.error = ChatRequestError("the episode has ended", status=401, type="authentication_error",
                                       code="episode_closed")
            c.done.set()

    def _trajectories(self, run: AgentRun) -> list[Trajectory]:
        r, outcome = run.request, run.outcome
        reward, rewards, error = 0.0, {}, None
        if run.failure == "timeout":
            finish, error = "failed:timeout", f"the agent ran past env.args.timeout_s={self.env.timeout_s:g}"
        elif "error" in outcome:
            finish, error = "failed:exception", outcome["error"]
        else:
            try:
                reward, rewards = reward_of(outcome.get("result"))
                finish = "done"
            except ValueError as e:
                finish, error = "failed:result", str(e)
        with run.episode.lock:
            sequences = list(run.episode.sequences)
        builders = [s.builder for s in sequences] or [TrajectoryBuilder([self.tokenizer.eos_token_id])]
        info = {"error": error, "traceback": outcome.get("traceback")} if error else {}
        out = []
        for i, builder in enumerate(builders):
            metrics = {"calls": float(len(run.episode.calls)), "sequences": float(len(sequences)),
                       "sequence": float(i), "sampled_tokens": float(builder.num_sampled),
                       "agent_seconds": time.monotonic() - run.started}
            out.append(builder.finish(reward=reward, rewards=rewards, metrics=metrics, info=info, env=self.env_name,
                                      task_id=r.task_id, group_id=r.group_id, finish_reason=finish,
                                      episode_id=run.episode.episode_id))
        return out


__all__ = ["AgentRunner", "call_agent", "reward_of"]
