"""envs/judge.py: a judge model's grade as a reward, against local HTTP servers that grade, time out, return
garbage or unparseable replies — a grade of 0 with the reason, never an exception; grades cached per answer; the
long-context families in both servings reward the grade instead of F1. (A real `vllm serve`:
tests/rl/test_eval_endpoint.py.)"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import k3rl.envs as envs
from k3rl.envs.base import run_episode
from k3rl.envs.judge import JUDGE_PROMPT, Judge, judge_for, parse_score


class Server:
    """A chat-completions server on 127.0.0.1 whose reply body `respond(prompt)` gives (bytes, or a str that is
    sent as the message content of a chat completion); it records every prompt."""

    def __init__(self, respond):
        self.prompts: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][0]["content"]
                owner.prompts.append(prompt)
                out = respond(prompt)
                if isinstance(out, str):
                    out = json.dumps({"choices": [{"message": {"role": "assistant", "content": out},
                                                   "finish_reason": "stop"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                try:
                    self.wfile.write(out)
                except OSError:  # the client gave up (a timeout test)
                    pass

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(request):
    servers = []

    def start(respond):
        servers.append(Server(respond))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


@pytest.mark.parametrize("reply, expected", [
    ("SCORE: 7", (0.7, "")), ("The answer is close.\nscore = 10", (1.0, "")), ("SCORE: 0.5 then SCORE: 9", (0.05, "")),
    ("SCORE: 12", (0.0, "unparseable: score 12 is outside 0–10")), ("SCORE: -1", (0.0, "unparseable: score -1 is "
                                                                                  "outside 0–10")),
    ("Looks right to me.", (0.0, "unparseable: no 'SCORE: x' in the reply")), ("", (0.0, "unparseable: no 'SCORE: "
                                                                                       "x' in the reply")),
])
def test_parse_score(reply, expected):
    assert parse_score(reply) == expected


def test_a_grade_is_asked_once_per_answer_and_shows_the_judge_the_gold(server):
    s = server(lambda prompt: "SCORE: 8")
    judge = Judge(s.url, "judge")
    first = judge.grade("Who wrote Hamlet?", "the Bard of Avon", ["William Shakespeare"], ["Hamlet is a tragedy by "
                                                                                         "Shakespeare."])
    assert (first.score, first.reason, first.cached) == (0.8, "", False)
    assert s.prompts == [JUDGE_PROMPT.format(question="Who wrote Hamlet?", answer="the Bard of Avon",
                                             gold="William Shakespeare",
                                             evidence="Hamlet is a tragedy by Shakespeare.")]
    again = judge.grade("Who wrote Hamlet?", "the Bard of Avon", ["William Shakespeare"], ["Hamlet is a tragedy by "
                                                                                         "Shakespeare."])
    assert (again.score, again.cached, len(s.prompts)) == (0.8, True, 1)
    other = judge.grade("Who wrote Hamlet?", "Marlowe", ["William Shakespeare"])
    assert not other.cached and len(s.prompts) == 2 and "none given" in s.prompts[1]
    assert judge.grade("Who wrote Hamlet?", "  ", ["William Shakespeare"]).score == 0.0 and len(s.prompts) == 2


def test_a_server_that_times_out_gives_0_with_the_reason_and_is_asked_again_later(server):
    s = server(lambda prompt: time.sleep(3) or "SCORE: 10")
    judge = Judge(s.url, "judge", timeout_s=0.5, retries=1)
    t = time.monotonic()
    grade = judge.grade("q", "a", ["a"])
    assert time.monotonic() - t < 2.9  # two attempts of 0.5 s and one back-off of 0.5 s, not the server's 3 s
    assert grade.score == 0.0 and grade.reason.startswith("timeout:") and "judge.timeout_s" in grade.reason
    assert grade.failed and not judge.grade("q", "a", ["a"]).cached  # a transient failure is not cached


@pytest.mark.parametrize("body, reason", [
    (b"<html>not json</html>", "reply:"), (b'{"choices": []}', "reply: not a chat completion"),
    ("I cannot grade this.", "unparseable: no 'SCORE: x'"),
])
def test_garbage_gives_0_with_the_reason(server, body, reason):
    s = server(lambda prompt: body)
    judge = Judge(s.url, "judge", retries=0)
    grade = judge.grade("q", "a", ["a"])
    assert grade.score == 0.0 and grade.reason.startswith(reason)
    assert judge.grade("q", "a", ["a"]).cached and len(s.prompts) == 1  # it would say the same again


def test_an_unreachable_judge_gives_0_not_an_exception():
    grade = Judge("http://127.0.0.1:9/v1", "judge", timeout_s=1, retries=0).grade("q", "a", ["a"])
    assert grade.score == 0.0 and grade.reason.startswith("connection:")


def test_settings_are_checked_when_the_environment_is_made():
    with pytest.raises(ValueError, match="unknown setting.*url"):
        envs.make("needle", judge={"url": "http://127.0.0.1:8000/v1", "model": "j"})
    with pytest.raises(ValueError, match="`base_url` and `model` are required"):
        envs.make("needle", serve="search", judge={"base_url": "http://127.0.0.1:8000/v1"})
    with pytest.raises(ValueError, match="not an http"):
        judge_for({"base_url": "ftp://x", "model": "j"})


@pytest.mark.parametrize("serve", ["context", "search"])
def test_the_long_context_families_reward_the_grade_instead_of_f1(server, serve):
    s = server(lambda prompt: "SCORE: 3")
    env = envs.make("needle", serve=serve, length=1024, source="wiki", evidence_weight=0.0,
                    judge={"base_url": s.url, "model": "judge"})
    task = env.tasks(1, seed=5)[0]
    result = run_episode(env, task, env.oracle(task))
    assert result.info["em"] == 1.0  # the oracle's answer is right: F1 would give 1
    assert result.reward == pytest.approx(0.3)
    assert (result.info["judge_score"], result.info["judge_failed"], result.info["judge_reason"]) == (0.3, 0.0, "")
    inst = env.instance(task)
    evidence = dict(inst.passages)[inst.evidence[0]]
    assert len(s.prompts) == 1 and inst.question in s.prompts[0] and evidence[:200] in s.prompts[0]
