"""A judge model's grade as a reward: answers that exact match and F1 cannot score ("the Bard of Avon" for
"Shakespeare"), graded by a model served behind an OpenAI-compatible endpoint (`vllm serve`, any hosted API).

`Judge(base_url, model).grade(question, answer, gold, evidence)` sends `JUDGE_PROMPT` (below) as one user message,
greedy, and reads the first `SCORE: x` (x from 0 to 10) of the reply as the grade x / 10. It never raises for
the server's sake: a timeout, a refused or failed request (after the client's retries, util/chat_client.py), a
reply with no score or one out of range give the grade 0 with the reason recorded (`Grade.reason`), and the
episode goes on. Grades are cached per (question, answer, gold, evidence) in the process, the bounded reasons
included except the transient ones (a timeout or a server down may be gone on the next call). An empty answer
is 0 without asking.

Environments take a judge by setting (`judge: {base_url, model, …}` of `SearchEnv`, the long-context families
in both servings): the grade replaces F1 as the answer's part of the reward, and the episode's metrics hold
`judge_score` and `judge_failed` (with `judge_reason` in its info). Any other environment calls
`judge_for(settings).grade(...)` in its own `reward()`: one `Judge`, and so one cache, per distinct settings in
a process.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from k3rl.util.chat_client import EndpointClient, EndpointError

JUDGE_PROMPT = """You are grading an answer to a question against the gold answers.

Question: {question}
Gold answers: {gold}
Evidence the answer should rest on: {evidence}
Answer to grade: {answer}

Give 10 if the answer means the same as a gold answer (other wording, spelling or detail is fine), 0 if it is
wrong, empty or says it does not know, and a value in between if it is partly right. Reply with one line:
SCORE: <a number from 0 to 10>"""
"""The one message the judge gets; `{gold}` and `{evidence}` are " | "-joined (evidence: "none given")."""

SCORE = re.compile(r"SCORE\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


@dataclass(frozen=True)
class Grade:
    """A judged answer: `score` in [0, 1]; `reason` is empty when the judge gave a score, else why it is 0."""

    score: float
    reason: str = ""
    reply: str = ""
    cached: bool = False

    @property
    def failed(self) -> bool:
        return bool(self.reason)


def parse_score(reply: str) -> tuple[float, str]:
    """(grade in [0, 1], "") from the first `SCORE: x` of `reply`, or (0, why) when there is none in 0–10."""
    match = SCORE.search(reply)
    if match is None:
        return 0.0, "unparseable: no 'SCORE: x' in the reply"
    value = float(match.group(1))
    if not 0 <= value <= 10:
        return 0.0, f"unparseable: score {match.group(1)} is outside 0–10"
    return value / 10, ""


class Judge:
    """Grades answers by asking `model` at `base_url` (module docstring)."""

    def __init__(self, base_url: str, model: str, api_key: str = "EMPTY", timeout_s: float = 30.0, retries: int = 2,
                 max_tokens: int = 32, cache_size: int = 65536):
        if not model:
            raise ValueError("judge: `model` (the served model's name) is required")
        if timeout_s <= 0 or retries < 0 or max_tokens < 1:
            raise ValueError(f"judge: timeout_s > 0, retries ≥ 0 and max_tokens ≥ 1 needed, got {timeout_s}, "
                             f"{retries}, {max_tokens}")
        self.model, self.max_tokens, self.cache_size = model, int(max_tokens), int(cache_size)
        self.client = EndpointClient(base_url, api_key, timeout_s, retries, max_reply_chars=4096,
                                     timeout_key="judge.timeout_s", deadline_key="judge.timeout_s")
        self._cache: OrderedDict[tuple, Grade] = OrderedDict()
        self._lock = threading.Lock()
        self.requests = 0
        """Requests sent (cache misses that reached the server)."""

    def grade(self, question: str, answer: Optional[str], gold: Sequence[str], evidence: Sequence[str] = ()) -> Grade:
        """The judge's grade of `answer` (module docstring); never raises for the server's sake."""
        if not (answer or "").strip():
            return Grade(0.0)  # nothing to judge: a grade of 0, not a failure of the judge
        key = (question, answer, tuple(gold), tuple(evidence))
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return _as_cached(self._cache[key])
        prompt = JUDGE_PROMPT.format(question=question, answer=answer, gold=" | ".join(gold),
                                     evidence=" | ".join(evidence) or "none given")
        with self._lock:
            self.requests += 1
        try:
            reply = self.client.chat([{"role": "user", "content": prompt}], self.model, self.max_tokens, stop=[]).text
        except EndpointError as e:
            grade = Grade(0.0, f"{e.kind}: {e}")
            if e.transient:
                return grade
        else:
            score, reason = parse_score(reply)
            grade = Grade(score, reason, reply)
        with self._lock:
            self._cache[key] = grade
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grade


def _as_cached(grade: Grade) -> Grade:
    return Grade(grade.score, grade.reason, grade.reply, cached=True)


_JUDGES: dict[tuple, Judge] = {}
_JUDGES_LOCK = threading.Lock()
SETTINGS = ("base_url", "model", "api_key", "timeout_s", "retries", "max_tokens", "cache_size")


def judge_for(settings: Mapping[str, Any]) -> Judge:
    """The process's `Judge` of these settings (`base_url` and `model` required; the rest as `Judge`), made once:
    environments made per episode share its cache. Unknown keys are named."""
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise ValueError(f"judge: unknown setting(s) {', '.join(unknown)}; it takes {', '.join(SETTINGS)}")
    if "base_url" not in settings or "model" not in settings:
        raise ValueError("judge: `base_url` and `model` are required, e.g. {base_url: http://127.0.0.1:8000/v1, "
                         "model: judge}")
    key = tuple(sorted((k, str(v)) for k, v in settings.items()))
    with _JUDGES_LOCK:
        if key not in _JUDGES:
            _JUDGES[key] = Judge(**settings)
        return _JUDGES[key]


def evidence_texts(texts: Mapping[str, str], ids: Sequence[str], max_chars: int = 600) -> list[str]:
    """The texts of evidence passages `ids` found in `texts` (id → text), each cut to `max_chars`: what the judge
    is shown of the evidence (ids alone mean nothing to it)."""
    return [texts[i][:max_chars] for i in ids if i in texts]


def judged_metrics(grade: Grade) -> dict[str, Any]:
    """An episode's metrics of its grade."""
    return {"judge_score": grade.score, "judge_failed": float(grade.failed), "judge_reason": grade.reason}


__all__ = ["Grade", "JUDGE_PROMPT", "Judge", "evidence_texts", "judge_for", "judged_metrics", "parse_score"]
