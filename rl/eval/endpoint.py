"""A served model behind an OpenAI-compatible chat endpoint (`eval.endpoint`: `vllm serve`, …): `EndpointRunner` plays
tasks with a message-level policy (`ChatPolicy`) through `envs.base.run_episode` — the Runner of rl/eval/runners.py
for a model k3rl does not hold — and `ServedModel` is `k3rl eval`'s evaluated model on it (rl/eval/grid.py): the
probe of the server, the tokenizer that counts lengths, a cell's task rows.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from k3rl.rl.config import ConfigError
from k3rl.rl.eval.cells import env_kwargs
from k3rl.rl.eval.rows import task_row, tokens_read, transcript

if TYPE_CHECKING:
    from k3rl.rl.eval.cells import GridTask

COUNTERS = ("turns", "tool_calls", "observation_tokens", "tool_seconds")
ENDPOINT_IMAGE_PATCH = 14
"""Images sent to a served model are fitted to 14-pixel patches (the released K3 ViT's) before they go as PNG; the
server's own processor takes them from there."""
"""Episode counters that are not reward components (rollout/agent_loop.py keeps them apart the same way)."""


class ChatPolicy:
    """A message-level policy (messages → the assistant's text) that asks an OpenAI-compatible chat endpoint
    (util/chat_client.py), greedy, stopping at the end of a tool call; it keeps the server's token usage of
    every turn and whether a reply was cut at `eval.endpoint_max_reply_chars`.

    What the server is sent is what the native engine renders (rollout/chat.py's `neutralize`): in every
    message the special tokens' strings (`<|im_end|>`, `<|media_pad|>`, …) are broken by a word joiner, in tool
    results every added token's too (`<tool_call>`, `</tool_response>`, …), so a passage cannot end a turn or
    forge a call — `patterns` holds (special, added) `control_pattern`s of the evaluated model's tokenizer.
    Images (envs/media.py) go as `image_url` parts holding PNG data URLs, beside the text parts.
    Tool results are sent as user messages wrapped in `<tool_response>` (what Qwen-style templates render a
    tool message as): the `tool` role of the OpenAI API needs a `tool_call_id` of a structured call, which
    this text protocol has not. A server that strips the stop string (the OpenAI API does) gets it put back,
    so the environment's parser sees a closed call. `lock`, when given, is held by the caller while it plays
    the episode and released here while waiting for the server: episodes run side by side in threads while
    environment code runs one at a time. `deadline` (time.monotonic()) bounds the whole episode's requests.
    """

    def __init__(self, client: Any, model: str, max_tokens: int, lock: Optional[threading.Lock] = None,
                 patterns: tuple[Any, Any] = (None, None), deadline: Optional[float] = None):
        self.client, self.model, self.max_tokens, self.lock = client, model, max_tokens, lock
        self.patterns, self.deadline = patterns, deadline
        self.usage: list[Optional[tuple[Any, Any]]] = []
        """(prompt_tokens, completion_tokens) of every turn as the server reported them (None: not reported)."""
        self.truncated = False

    def __call__(self, messages: list[dict[str, Any]]) -> str:
        from k3rl.envs.media import openai_content
        from k3rl.envs.tools import STOP_SEQUENCES, TOOL_CALL_END, TOOL_CALL_START, format_observation
        from k3rl.rollout.chat import neutralize

        special, added = self.patterns
        chat = [{"role": "user", "content": openai_content(m["content"], format_observation,
                                                            lambda t: neutralize(t, added)[0])}
                if m["role"] == "tool" else
                {"role": m["role"], "content": openai_content(m["content"], None, lambda t: neutralize(t, special)[0])}
                for m in messages]
        if self.lock is not None:
            self.lock.release()
        try:
            reply = self.client.chat(chat, self.model, self.max_tokens, list(STOP_SEQUENCES), self.deadline)
        finally:
            if self.lock is not None:
                self.lock.acquire()
        self.usage.append(reply.usage)
        self.truncated |= reply.truncated
        text = reply.text
        if reply.has_stop_reason:  # vLLM names the stop string that matched (None: the end of the turn)
            stopped_at_call = reply.stop_reason == TOOL_CALL_END
        else:  # other servers say only that one did
            stopped_at_call = reply.finish_reason == "stop"
        if stopped_at_call and text.rfind(TOOL_CALL_START) > text.rfind(TOOL_CALL_END):
            text += TOOL_CALL_END
        return text

    def tokens_read(self, own: int) -> tuple[int, str]:
        """Tokens the model read, each once (the prompt and the tool results, as the native engine counts them),
        and a note when they are not the server's: the last turn's prompt less the replies before it, from the
        server's usage when that is a consistent count — integers, prompts > 0 that never shrink, a total within
        [own / 2, 2 × own + 256] of `own` (the row's own count: `tokens_read` of the episode's messages with the
        evaluated model's tokenizer) — else `own`, with a note saying why."""
        usage = self.usage
        if not usage or any(u is None for u in usage):
            return own, "the server reported no usage: tokens_read is the tokenizer's count"
        ints = all(isinstance(n, int) and not isinstance(n, bool) for u in usage for n in u)
        if ints and all(p > 0 and c >= 0 for p, c in usage) and all(a[0] <= b[0] for a, b in zip(usage, usage[1:])):
            read = usage[-1][0] - sum(c for _, c in usage[:-1])
            if own / 2 <= read <= 2 * own + 256:
                return read, ""
        shown = ", ".join(f"{p!r}/{c!r}" for p, c in usage[:4]) + (", …" if len(usage) > 4 else "")
        return own, (f"the server's usage (prompt/completion tokens by turn: {shown}) is not a consistent count: "
                     f"tokens_read is the tokenizer's count")


@dataclass
class ChatEpisode:
    """One task played on the endpoint, as `score` reads it (`reward`, `rewards`, `metrics`), with its messages, a
    note on the token count, whether a reply was cut, and its error (`error_kind`: util/chat_client.py's
    kinds or `task`) when it failed."""

    reward: float = 0.0
    rewards: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    messages: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""
    truncated: bool = False
    error: str = ""
    error_kind: str = ""


class EndpointRunner:
    """Plays (task_id, task) pairs on the environment of `make_env` against `client`'s `model`, up to `workers`
    episodes at once (environment code one at a time, under a lock the policy releases while the server works),
    each bounded by `task_timeout_s`; returns one `ChatEpisode` per task, in task order. A failure (an
    `EndpointError` after the client's retries, or the environment's code) is that episode's error."""

    def __init__(self, client: Any, model: str, make_env: Callable[[], Any], tokenizer: Any, *, max_tokens: int,
                 max_turns: Optional[int], patterns: tuple[Any, Any], task_timeout_s: Optional[float], workers: int):
        from k3rl.envs.base import as_token_counter

        self.client, self.model, self.make_env, self.tokenizer = client, model, make_env, tokenizer
        self.max_tokens, self.max_turns, self.patterns = max_tokens, max_turns, patterns
        self.task_timeout_s, self.workers = task_timeout_s, workers
        self.count = as_token_counter(tokenizer)
        self._lock = threading.Lock()

    def play(self, tasks: Sequence[tuple[str, Any]]) -> list[ChatEpisode]:
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            return list(pool.map(lambda item: self._episode(item[1]), tasks))

    def _episode(self, task: Any) -> ChatEpisode:
        from k3rl.envs.base import run_episode, with_budget
        from k3rl.util.chat_client import EndpointError

        started = time.perf_counter()
        bound = self.task_timeout_s
        policy = ChatPolicy(self.client, self.model, self.max_tokens, self._lock, self.patterns,
                            None if bound is None else time.monotonic() + float(bound))
        try:
            with self._lock:  # environment code one episode at a time; the policy lets go while the server works
                env = self.make_env()
                budget = with_budget(env.budget, max_turns=self.max_turns)
                result = run_episode(env, task, policy, budget, self.count, image_patch=ENDPOINT_IMAGE_PATCH)
                own = tokens_read(result.messages, self.tokenizer)
        except EndpointError as e:  # after the retries: this task's error, with the kind a resume reads
            return ChatEpisode(seconds=time.perf_counter() - started, error=f"{type(e).__name__}: {e}",
                               error_kind=e.kind)
        except Exception as e:  # the episode failed (environment code)
            return ChatEpisode(seconds=time.perf_counter() - started, error=f"{type(e).__name__}: {e}",
                               error_kind="task")
        read, note = policy.tokens_read(own)
        info = result.info
        rewards = {k: float(v) for k, v in info.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                   and k not in COUNTERS}
        return ChatEpisode(result.reward, rewards, {"tool_calls": info.get("tool_calls", 0), "tokens_read": read},
                           result.messages, time.perf_counter() - started, note, policy.truncated)


class ServedModel:
    """`k3rl eval`'s evaluated model behind an OpenAI-compatible chat endpoint (`eval.endpoint`), played by an
    `EndpointRunner`; see `ChatPolicy` and util/chat_client.py (the deadlines, retries and reply cap).

    Starting it probes GET /models: an unreachable server, a wrong URL, a listing that is not JSON or not a
    model list, a model it does not serve, or a `max_model_len` that is not a positive integer is a named
    ConfigError before any work. A failure later (a timeout or a 5xx after `eval.endpoint_retries` retries, a
    prompt the server refuses) is that task's error row, with its kind. Up to `eval.batch_size` episodes of a
    cell run at once. Lengths are counted with `eval.model_path`'s tokenizer, else the one the served model's
    name resolves to locally (a path, the HF cache); its control tokens are what `ChatPolicy` neutralises.
    """

    name = "model"
    backend = "endpoint"

    def __init__(self, cfg: Any):
        from k3rl.rollout.chat import control_pattern
        from k3rl.util.chat_client import EndpointClient

        ev = cfg.eval
        self.cfg, self.url = cfg, str(ev.endpoint).rstrip("/")
        # the key comes from the environment, never from the config: config.yaml is written next to the results
        self.client = EndpointClient(self.url, os.environ.get("OPENAI_API_KEY") or "EMPTY",
                                     float(ev.endpoint_timeout_s), int(ev.endpoint_retries),
                                     int(ev.endpoint_max_reply_chars))
        self.model, self.max_model_len = self._probe(ev.endpoint_model)
        self.tokenizer = self._tokenizer()
        self.patterns = (control_pattern(self.tokenizer), control_pattern(self.tokenizer, special_only=False))

    def _probe(self, wanted: Optional[str]) -> tuple[str, Optional[int]]:
        """The served model to evaluate and its context limit (vLLM reports `max_model_len`), from GET /models."""
        from k3rl.util.chat_client import EndpointError

        where = f"GET {self.url}/models"
        try:
            listing = self.client.models()
        except EndpointError as e:
            if e.status is not None:
                raise ConfigError(f"eval.endpoint: {where} answered HTTP {e.status}; is {self.url} the base URL of "
                                  f"an OpenAI-compatible API (it usually ends in /v1)?") from None
            if e.kind == "reply":
                raise ConfigError(f"eval.endpoint: {where} did not answer a JSON model list: {e}; is {self.url} an "
                                  f"OpenAI-compatible API?") from None
            raise ConfigError(f"eval.endpoint: cannot reach {self.url} ({e}); start the server "
                              f"(e.g. `vllm serve MODEL --port 8000`) or fix the URL") from None
        served = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(served, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str)
                                                   for m in served):
            raise ConfigError(f"eval.endpoint: {where} is not a model list ({{\"data\": [{{\"id\": …}}, …]}} "
                              f"expected); got {json.dumps(listing)[:200]}")
        names = [m["id"] for m in served]
        if wanted is None and not names:
            raise ConfigError(f"eval.endpoint: {self.url} serves no model (GET /models is empty); set eval.endpoint_model")
        if wanted is not None and wanted not in names:
            raise ConfigError(f"eval.endpoint_model: {wanted!r} is not served at {self.url}; it serves "
                              f"{', '.join(map(repr, names)) or 'nothing'}")
        model = wanted if wanted is not None else names[0]
        limit = next(m.get("max_model_len") for m in served if m["id"] == model)
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
            raise ConfigError(f"eval.endpoint: {where} gives model {model!r} max_model_len {json.dumps(limit)[:80]}; "
                              f"expected a positive integer (the tokens the server holds) or no field")
        return model, limit

    def _tokenizer(self):
        from k3rl.model.tokenizer import load_tokenizer

        trust = bool(self.cfg.run.trust_remote_code)
        if self.cfg.eval.model_path is not None:
            return load_tokenizer(self.cfg.eval.model_path, trust_remote_code=trust)
        try:
            return load_tokenizer(self.model, trust_remote_code=trust, local_files_only=True)
        except Exception:
            raise ConfigError(f"eval.model_path: set it to a local directory with the tokenizer of {self.model!r} "
                              f"(served at {self.url}): lengths are counted with the evaluated model's tokenizer, "
                              f"and {self.model!r} does not resolve to a local one") from None

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "model": self.model, "endpoint": self.url}

    def rows(self, cell_tasks: Sequence[GridTask]) -> list[dict[str, Any]]:
        """The task rows of one cell, in task order: a prompt longer than the server holds is a `context` error row,
        the others are played by an `EndpointRunner`."""
        import k3rl.envs as envs
        from k3rl.rl.eval.evaluate import success_rule

        cell = cell_tasks[0].cell
        kwargs = env_kwargs(self.cfg, cell, self.tokenizer)
        key = success_rule(envs.make(cell.family, **kwargs), self.cfg.env.success_key)
        room = int(self.cfg.rollout.max_new_tokens)
        bound = self.cfg.eval.endpoint_task_timeout_s
        runner = EndpointRunner(self.client, self.model, lambda: envs.make(cell.family, **kwargs), self.tokenizer,
                                max_tokens=room, max_turns=self.cfg.rollout.max_turns, patterns=self.patterns,
                                task_timeout_s=None if bound is None else float(bound),
                                workers=max(1, min(len(cell_tasks), int(self.cfg.eval.batch_size))))
        rows: list[Optional[dict[str, Any]]] = [None] * len(cell_tasks)
        runnable = []
        for i, gt in enumerate(cell_tasks):
            if self.max_model_len and gt.cell.serve == "context" and gt.prompt_tokens + room > self.max_model_len:
                rows[i] = task_row(self.name, gt, 0.0, {}, {}, 0.0, "", key, error=(
                    f"prompt of {gt.prompt_tokens} tokens + {room} to answer exceeds the served model's context "
                    f"limit {self.max_model_len} (max_model_len at {self.url})"), error_kind="context")
            else:
                runnable.append(i)
        episodes = runner.play([(cell_tasks[i].task_id, cell_tasks[i].task) for i in runnable]) if runnable else []
        for i, ep in zip(runnable, episodes):
            gt = cell_tasks[i]
            if ep.error:
                rows[i] = task_row(self.name, gt, 0.0, {}, {}, ep.seconds, "", key, error=ep.error,
                                   error_kind=ep.error_kind)
            else:
                rows[i] = task_row(self.name, gt, ep.reward, ep.rewards, ep.metrics, ep.seconds,
                                   transcript(ep.messages), key, reply_truncated=ep.truncated, note=ep.note)
        return rows
