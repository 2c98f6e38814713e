"""An HTTP client of an OpenAI-compatible API — GET /models and POST /chat/completions — with bounds that a slow,
broken or hostile server cannot stretch: `k3rl eval`'s endpoint runner (rl/eval/endpoint.py) and the judge-model
reward (envs/judge.py) talk through it.

- **A whole-request deadline.** Connecting, sending and reading every byte of the reply fall inside one deadline
  (`timeout_s` per attempt, and never past the caller's own deadline, e.g. the task's): a watchdog shuts the
  socket down when it passes. A timeout that bounds each read instead (the `openai` package's) waits as long as
  a server keeps trickling bytes.
- **Retries of transient failures only** (`TRANSIENT`: connection refused or reset, the deadline, HTTP 5xx, 429,
  408), `retries` times, after 1, 2, 4 … s or the server's `Retry-After` — never longer than one attempt's
  `timeout_s`; a wait that would end past the caller's deadline is not waited: the error is raised at once.
- **A bounded reply.** The body is read up to `12 × max_reply_chars + 64 KiB` bytes (room for the text however
  the JSON escapes it) and no further; the text is cut to `max_reply_chars`. A body over the limit is not read
  on: the text is decoded from its start (`Reply.truncated` says so either way).
- **Every failure is an `EndpointError` with a `kind`**, which an eval row keeps so that a resume retries the
  transient ones.

The standard library's http.client carries the requests (one connection per request); proxy variables
(HTTP_PROXY, …) are not read.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import re
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urlsplit

TRANSIENT = ("connection", "timeout", "server", "rate_limit")
"""Error kinds worth another try later (the server may be back): a resumed eval runs their tasks again. The
others — `refused` (HTTP 4xx: the server will not take this request), `reply` (an answer that is not an
OpenAI chat completion) — and the runner's own (`context`: the prompt is over the served limit; `task`: the
episode failed) would fail the same way again."""

PROBE_TIMEOUT_S = 30.0
PROBE_LIMIT_BYTES = 4 << 20
"""GET /models: its deadline (at most; less when `timeout_s` is less) and the most bytes read of its listing."""

BACKOFF_S = 1.0


class EndpointError(Exception):
    """A request that failed: `kind` (see `TRANSIENT`), the HTTP status when the server answered one, and the
    seconds its `Retry-After` asked for."""

    def __init__(self, kind: str, message: str, status: Optional[int] = None, retry_after: Optional[float] = None):
        super().__init__(message)
        self.kind, self.status, self.retry_after = kind, status, retry_after

    @property
    def transient(self) -> bool:
        return self.kind in TRANSIENT


@dataclass
class Reply:
    """One chat completion: the assistant's text (at most `max_reply_chars`) and what the server said of it."""

    text: str
    finish_reason: Optional[str]
    stop_reason: Any
    """vLLM's name of the stop string that matched (None: the turn ended); absent from other servers' replies."""
    has_stop_reason: bool
    usage: Optional[tuple[Any, Any]]
    """(prompt_tokens, completion_tokens) as the server sent them, unchecked (None: no usage)."""
    truncated: bool


class EndpointClient:
    """GET /models and POST /chat/completions at `base_url` (e.g. http://127.0.0.1:8000/v1); see the module."""

    def __init__(self, base_url: str, api_key: str, timeout_s: float, retries: int, max_reply_chars: int,
                 timeout_key: str = "eval.endpoint_timeout_s", deadline_key: str = "eval.endpoint_task_timeout_s"):
        """`timeout_key` / `deadline_key`: the settings an error names for the attempt's and the caller's time."""
        self.timeout_key, self.deadline_key = timeout_key, deadline_key
        self.base_url = base_url.rstrip("/")
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._https, self._host, self._port = parts.scheme == "https", parts.hostname, parts.port
        self._prefix = parts.path.rstrip("/")
        self.api_key, self.timeout_s, self.retries = api_key, float(timeout_s), int(retries)
        self.max_reply_chars = int(max_reply_chars)
        self.limit_bytes = 12 * self.max_reply_chars + (64 << 10)

    def models(self) -> Any:
        """The parsed JSON of GET /models (one attempt, no retries): EndpointError when it fails or is not JSON."""
        end = time.monotonic() + min(PROBE_TIMEOUT_S, self.timeout_s)
        status, _, body, overflow = self._request("GET", "/models", None, end, PROBE_LIMIT_BYTES)
        if status != 200:
            raise EndpointError(_status_kind(status), f"HTTP {status}", status)
        if overflow:
            raise EndpointError("reply", f"a listing over {PROBE_LIMIT_BYTES} bytes")
        return _json(body)

    def chat(self, messages: list[dict[str, str]], model: str, max_tokens: int, stop: list[str],
             deadline: Optional[float] = None) -> Reply:
        """One greedy chat completion, retried as the module says; `deadline` (time.monotonic()) bounds every
        attempt and wait. EndpointError after the last attempt."""
        payload = json.dumps({"model": model, "messages": messages, "temperature": 0.0, "max_tokens": max_tokens,
                              "stop": stop}).encode()
        attempt = 0
        while True:
            end = time.monotonic() + self.timeout_s
            if deadline is not None:
                if deadline <= time.monotonic():
                    raise EndpointError("timeout", f"the caller's time ({self.deadline_key}) ran out")
                end = min(end, deadline)
            try:
                status, headers, body, overflow = self._request("POST", "/chat/completions", payload, end,
                                                                self.limit_bytes)
                if status != 200:
                    raise EndpointError(_status_kind(status), f"HTTP {status}: {_snippet(body)}", status,
                                        _retry_after(headers.get("Retry-After")))
                return self._reply(body, overflow)
            except EndpointError as e:
                wait = min(BACKOFF_S * 2 ** attempt if e.retry_after is None else e.retry_after, self.timeout_s)
                left = float("inf") if deadline is None else deadline - time.monotonic()
                if not e.transient or attempt >= self.retries or wait >= left:
                    if attempt:
                        e.args = (f"{e.args[0]} (attempt {attempt + 1} of {self.retries + 1})",)
                    raise
                time.sleep(wait)
                attempt += 1

    def _reply(self, body: bytes, overflow: bool) -> Reply:
        """The chat completion in `body`, its text cut to `max_reply_chars`; a body cut at the byte limit
        (`overflow`) gives the start of its text only."""
        if overflow:
            text = _content_prefix(body, self.max_reply_chars)
            if text is None:
                raise EndpointError("reply", f"a reply over {self.limit_bytes} bytes whose start holds no message "
                                             f"content: {_snippet(body)}")
            return Reply(text, None, None, False, None, True)
        data = _json(body)
        try:
            choice = data["choices"][0]
            text = choice["message"].get("content") or ""
            if not isinstance(text, str) or not isinstance(choice, dict):
                raise TypeError(f"content is {type(text).__name__}")
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise EndpointError("reply", f"not a chat completion ({type(e).__name__}: {e}): {_snippet(body)}") from None
        usage = data.get("usage")
        counts = (usage.get("prompt_tokens"), usage.get("completion_tokens")) if isinstance(usage, dict) else None
        return Reply(text[:self.max_reply_chars], choice.get("finish_reason"), choice.get("stop_reason"),
                     "stop_reason" in choice, counts, len(text) > self.max_reply_chars)

    def _request(self, method: str, path: str, payload: Optional[bytes], end: float,
                 limit: int) -> tuple[int, Any, bytes, bool]:
        """(status, headers, at most `limit` bytes of the body, whether there was more) of one request that
        must be over by `end` (time.monotonic()): a watchdog shuts the socket down then, ending any read."""
        left = end - time.monotonic()
        if left <= 0:
            raise EndpointError("timeout", "no time left for the request")
        if self._https:
            conn = http.client.HTTPSConnection(self._host, self._port, timeout=left,
                                               context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=left)
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            sock = conn.sock
            if sock is not None:
                try:
                    # the plain socket's shutdown (an SSL socket's own would drop its state under the reader)
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except OSError:
                    pass

        watchdog = threading.Timer(left, expire)
        watchdog.daemon = True
        watchdog.start()
        headers = {"Authorization": f"Bearer {self.api_key}", "Accept": "application/json"}
        if payload is not None:
            headers["Content-Type"] = "application/json"
        try:
            conn.connect()
            if expired.is_set():
                raise TimeoutError("connected after the deadline")
            conn.request(method, self._prefix + path, body=payload, headers=headers)
            response = conn.getresponse()
            body = response.read(limit + 1)
            if expired.is_set():
                raise TimeoutError("cut at the deadline")
            return response.status, response.headers, body[:limit], len(body) > limit
        except (OSError, http.client.HTTPException, ValueError) as e:
            if expired.is_set() or isinstance(e, TimeoutError):
                raise EndpointError("timeout", f"{method} {self.base_url}{path}: no whole reply within "
                                               f"{self.timeout_s:g} s ({self.timeout_key})") from None
            raise EndpointError("connection", f"{method} {self.base_url}{path}: {type(e).__name__}: {e}") from None
        finally:
            watchdog.cancel()
            conn.close()


def _status_kind(status: int) -> str:
    if status == 429:
        return "rate_limit"
    if status == 408:
        return "timeout"
    return "server" if status >= 500 else "refused"


def _retry_after(value: Optional[str]) -> Optional[float]:
    """Seconds asked for by a `Retry-After` header (a number, or an HTTP date); None when absent or unreadable."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError):
            return None
    return max(0.0, seconds) if seconds == seconds else None


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise EndpointError("reply", f"not JSON ({type(e).__name__}: {str(e)[:120]}): {_snippet(body)}") from None


_CONTENT = re.compile(rb'"content"\s*:\s*"')


def _content_prefix(body: bytes, max_chars: int) -> Optional[str]:
    """The start (at most `max_chars`) of the first `"content"` string in a JSON body cut anywhere; None if
    the body has none."""
    found = _CONTENT.search(body)
    if found is None:
        return None
    raw = body[found.end():].decode("utf-8", errors="ignore")
    # a cut escape (`\u12`, a lone `\`) is dropped: at most 12 characters back (a surrogate pair's escapes)
    for cut in range(len(raw), max(-1, len(raw) - 13), -1):
        try:
            text = json.decoder.scanstring(raw[:cut] + '"', 0)[0][:max_chars]
        except ValueError:
            continue
        # a pair cut in two leaves its high half
        return text[:-1] if text and "\ud800" <= text[-1] <= "\udbff" else text
    return None


def _snippet(body: bytes, n: int = 200) -> str:
    """The start of a body for an error message."""
    text = body[:n].decode("utf-8", errors="replace")
    return repr(text) + ("…" if len(body) > n else "")
