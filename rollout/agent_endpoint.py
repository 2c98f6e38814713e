"""`AgentEndpoint`: an OpenAI-compatible chat-completions server on a rollout worker, for agents written against
the OpenAI API (`/v1/chat/completions`, `/v1/models`; `stream: false`).

Each episode gets a key (`open_episode`); an agent's client sends it as its API key, and every call is recorded
in that episode, token in, token out:

* the prompt is rendered by the special-token-safe `ChatRenderer` (rollout/chat.py) from the request's messages
  (rollout/chat_api.py) — unless the request *continues* one of the episode's sequences: its messages are the
  messages of that sequence's last call, then the assistant message this endpoint returned, then only tool or
  user messages. The prompt is then that sequence's tokens, the sampled tokens exactly as sampled, and the new
  messages rendered once (`continuation_tokens`); nothing is re-tokenised. Any other history (edited, summarised,
  a sub-agent's) starts a new sequence of the episode.
* the sampled ids, their log-probs and the policy version go into the sequence's `TrajectoryBuilder`; each call
  keeps the exact prompt ids the engine saw (`EpisodeCalls.calls`).

Calls are not run by the HTTP threads: they wait in a queue that the worker's collect loop (rollout/agent_runner.py)
drains into batched `generate` calls, so concurrent episodes share the engine as the agent loop's do. Sampling is
the job's (`rollout.temperature`, `top_p`): a request's own values are ignored, since RL needs the behaviour policy
it was configured with; `max_tokens` is capped by `rollout.max_new_tokens` and the context window.

Bad requests — malformed JSON, an unknown or closed episode key, a prompt longer than the context window, roles
out of order, a tool message answering no call — get OpenAI-style error responses (rollout/chat_api.py
`ChatRequestError`); nothing a client sends can stop the worker.
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from k3rl.rollout.chat import ChatRenderer
from k3rl.rollout.chat_api import ChatRequest, ChatRequestError, parse_request, reply_message, same_turn
from k3rl.rollout.trajectory import TrajectoryBuilder

MODEL_NAME = "k3rl-policy"
MAX_BODY_BYTES = 16 << 20


@dataclass
class CallSequence:
    """One token sequence of an episode: what its calls extended, and how its last call ended."""

    builder: TrajectoryBuilder
    raw: list[dict[str, Any]]
    """The last call's request messages (normalised), then the assistant message sent back."""
    ended_with_eos: bool = False
    busy: bool = False
    session: Any = None


@dataclass
class CallRecord:
    """One chat call as the engine saw it."""

    sequence: int
    prompt_ids: np.ndarray
    sampled_ids: list[int]
    logprobs: list[float]
    version: int


@dataclass
class EpisodeCalls:
    """An episode's calls and sequences, keyed by its API key."""

    key: str
    episode_id: str
    deadline: float
    sequences: list[CallSequence] = field(default_factory=list)
    calls: list[CallRecord] = field(default_factory=list)
    closed: str | None = None
    """Why the episode takes no more calls (ended, timed out), or None."""
    opened_sequences: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


@dataclass
class PendingCall:
    """A call waiting for the collect loop: its prompt, its room for new tokens, and where the answer goes."""

    episode: EpisodeCalls
    prompt: np.ndarray
    max_tokens: int
    session: Any
    done: threading.Event = field(default_factory=threading.Event)
    completion: Any = None
    error: ChatRequestError | None = None


class AgentEndpoint:
    """The server, its episodes and its call queue; see module docstring."""

    def __init__(self, tokenizer, max_context_tokens: int, max_new_tokens: int, host: str = "127.0.0.1",
                 port: int = 0):
        self.renderer = ChatRenderer(tokenizer)
        self.tokenizer = tokenizer
        self.max_context_tokens = max_context_tokens
        self.max_new_tokens = max_new_tokens
        self.version = 0
        """The policy version of the engine's weights (the collect loop sets it)."""
        self.calls: queue.Queue[PendingCall] = queue.Queue()
        self._episodes: dict[str, EpisodeCalls] = {}
        self._ids = 0
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer((host, port), _handler(self))
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name="k3rl-agent-endpoint", daemon=True)
        self._thread.start()
        self.base_url = f"http://{host}:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def open_episode(self, episode_id: str, timeout_s: float) -> EpisodeCalls:
        """A new episode with its own key; calls after `timeout_s` are refused."""
        episode = EpisodeCalls(secrets.token_urlsafe(24), episode_id, time.monotonic() + timeout_s)
        with self._lock:
            self._episodes[episode.key] = episode
        return episode

    def close_episode(self, episode: EpisodeCalls, reason: str) -> None:
        """No more calls for `episode`; its key is forgotten."""
        with episode.lock:
            episode.closed = episode.closed or reason
        with self._lock:
            self._episodes.pop(episode.key, None)

    # -- one request --------------------------------------------------------------------------------------------

    def handle(self, method: str, path: str, authorization: str | None, body: bytes) -> tuple[int, dict[str, Any]]:
        """(status, JSON body) of one HTTP request; never raises."""
        try:
            path = path.split("?", 1)[0].rstrip("/")
            if method == "GET" and path == "/v1/models":
                return 200, {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "k3rl"}]}
            if path != "/v1/chat/completions":
                raise ChatRequestError(f"unknown path {path!r}; this endpoint serves /v1/chat/completions and "
                                       f"/v1/models", status=404, code="not_found")
            if method != "POST":
                raise ChatRequestError(f"{method} {path}: use POST", status=405, code="method_not_allowed")
            episode = self._episode(authorization)
            try:
                data = json.loads(body)
            except (ValueError, RecursionError):
                raise ChatRequestError("the body is not valid JSON") from None
            request = parse_request(data, self.max_new_tokens)
            return 200, self._complete(episode, request)
        except ChatRequestError as e:
            return e.status, e.body()
        except Exception as e:  # a bug here must not kill the worker: the agent gets a server error
            return 500, ChatRequestError(f"internal error: {type(e).__name__}: {e}", status=500,
                                         type="server_error").body()

    def _episode(self, authorization: str | None) -> EpisodeCalls:
        scheme, _, key = (authorization or "").partition(" ")
        with self._lock:
            episode = self._episodes.get(key.strip()) if scheme == "Bearer" else None
        if episode is None:
            raise ChatRequestError("unknown API key: each episode calls with the key it was given (the episode may "
                                   "have ended)", status=401, type="authentication_error", code="invalid_api_key")
        return episode

    def _complete(self, episode: EpisodeCalls, request: ChatRequest) -> dict[str, Any]:
        with episode.lock:
            if episode.closed:
                raise ChatRequestError(f"episode {episode.episode_id} takes no more calls ({episode.closed})",
                                       status=401, type="authentication_error", code="episode_closed")
            index, delta = self._continued(episode, request)
            if index is None:
                prompt = np.asarray(self.renderer.conversation_tokens(request.messages), dtype=np.int32)
                session = (episode.episode_id, episode.opened_sequences)
                episode.opened_sequences += 1
            else:
                seq = episode.sequences[index]
                prompt = np.concatenate([seq.builder.token_array(), np.asarray(delta, dtype=np.int32)])
                session = seq.session
            room = min(request.max_tokens, self.max_context_tokens - len(prompt))
            if room < 1:
                raise ChatRequestError(f"the prompt is {len(prompt)} tokens; the context window is "
                                       f"{self.max_context_tokens} (rollout.max_context_tokens)", "messages",
                                       code="context_length_exceeded")
            if index is not None:
                episode.sequences[index].busy = True
        pending = PendingCall(episode, prompt, room, session)
        self.calls.put(pending)
        pending.done.wait(max(0.0, episode.deadline - time.monotonic()) + 1.0)
        with episode.lock:
            if index is not None:
                episode.sequences[index].busy = False
            if pending.completion is None:
                raise pending.error or ChatRequestError(f"episode {episode.episode_id}: no completion before its "
                                                        f"deadline", status=408, code="timeout")
            c = pending.completion
            if index is None:
                seq = CallSequence(TrajectoryBuilder(prompt.tolist()), [], session=session)
                episode.sequences.append(seq)
                index = len(episode.sequences) - 1
            else:
                seq = episode.sequences[index]
                seq.builder.append_context(delta)
            seq.builder.append_sampled(c.token_ids, c.logprobs, self.version, c.routed_experts)
            episode.calls.append(CallRecord(index, prompt, list(c.token_ids), list(c.logprobs), self.version))
            eos = self.tokenizer.eos_token_id
            seq.ended_with_eos = bool(c.token_ids) and c.token_ids[-1] == eos
            ids = c.token_ids[:-1] if seq.ended_with_eos else c.token_ids
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            message, finish = reply_message(text, f"call_{len(episode.calls)}_{secrets.token_hex(4)}")
            if c.finish_reason == "length":
                finish = "length"
            seq.raw = request.raw + [message]
        return {"id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion", "created": int(time.time()),
                "model": MODEL_NAME, "choices": [{"index": 0, "message": message, "finish_reason": finish,
                                                  "logprobs": None}],
                "usage": {"prompt_tokens": int(len(prompt)), "completion_tokens": len(c.token_ids),
                          "total_tokens": int(len(prompt)) + len(c.token_ids)}}

    def _continued(self, episode: EpisodeCalls, request: ChatRequest) -> tuple[int | None, list[int] | None]:
        """(the index of the idle sequence this request continues, the tokens of its new messages), or (None,
        None) for a new sequence (module docstring)."""
        for index in range(len(episode.sequences) - 1, -1, -1):
            seq = episode.sequences[index]
            k = len(seq.raw)
            if seq.busy or len(request.raw) <= k or request.raw[:k - 1] != seq.raw[:k - 1]:
                continue
            new = request.raw[k:]
            if not same_turn(seq.raw[-1], request.raw[k - 1]) or any(m["role"] not in ("tool", "user") for m in new):
                continue
            rendered = request.messages[len(request.messages) - len(new):]
            return index, self.renderer.continuation_tokens(rendered, seq.ended_with_eos)
        return None, None


def _handler(endpoint: AgentEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            size = self.headers.get("Content-Length")
            try:
                n = int(size or 0)
            except ValueError:
                n = -1
            if n < 0 or n > MAX_BODY_BYTES:
                status, payload = 413, ChatRequestError(f"the body must be 0…{MAX_BODY_BYTES} bytes (Content-Length "
                                                        f"{size!r})", status=413).body()
                self.close_connection = True
            else:
                body = self.rfile.read(n) if n else b""
                status, payload = endpoint.handle(self.command, self.path, self.headers.get("Authorization"), body)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = _serve

        def log_message(self, format: str, *args: Any) -> None:  # quiet: calls are recorded, not logged
            pass

    return Handler


__all__ = ["AgentEndpoint", "CallRecord", "EpisodeCalls", "MODEL_NAME", "PendingCall", "CallSequence"]
