"""Agents written against the OpenAI API (envs/agent.py, rollout/agent_runner.py, rollout/agent_endpoint.py): every
call an agent makes through the `openai` package lands in its own episode with the exact prompt ids the engine saw
and the ids it sampled; a history that extends the previous call continues its sequence token for token, an edited
one starts a new sequence; hostile requests get OpenAI-style errors and the worker carries on; an agent that
raises, returns garbage or hangs is a failed episode."""

from __future__ import annotations

import http.client
import json
import time
from urllib.parse import urlparse

import numpy as np
import pytest

from k3rl.envs.agent import AgentEnv
from k3rl.rollout.agent_loop import EpisodeRequest
from k3rl.rollout.agent_runner import AgentRunner
from k3rl.rollout.engine import SamplingParams

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Look a word up.",
                                           "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]


class Recording:
    """An engine that records what each `generate` call was given and sampled (a `SessionEngine` as the native
    engine is)."""

    def __init__(self, engine):
        self.engine, self.seen = engine, []
        self.tokenizer = engine.tokenizer

    @property
    def version(self):
        return self.engine.version

    def generate(self, prompts, params, sessions=None):
        out = self.engine.generate(prompts, params, sessions=sessions)
        for prompt, samples in zip(prompts, out):
            self.seen += [(np.asarray(prompt).tolist(), list(c.token_ids), list(c.logprobs)) for c in samples]
        return out

    def end_sessions(self, ids):
        self.engine.end_sessions(ids)

    def load_weights(self, named, version):
        self.engine.load_weights(named, version)

    def reset_cache(self):
        self.engine.reset_cache()


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir):
    from k3rl.rollout.torch_engine import TorchEngine

    return TorchEngine.from_pretrained(tiny_qwen3_dir, seed=0)


def runner_for(engine, agent, timeout_s=60.0, max_tokens=12, context=1024):
    return AgentRunner(engine, engine.tokenizer, AgentEnv(agent, timeout_s=timeout_s),
                       SamplingParams(max_tokens=max_tokens, seed=0), max_context_tokens=context, env_name="agent")


def editing_agent(client, task):
    """Its own loop: two calls that extend the history (a tool result, a user nudge), then an edited history."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Word: {task['word']}"}]
    reply = client.chat.completions.create(model="k3rl-policy", messages=messages, tools=TOOLS, max_tokens=8)
    message = reply.choices[0].message
    messages.append(message.model_dump(exclude_none=True))
    if message.tool_calls:
        messages += [{"role": "tool", "tool_call_id": c.id, "content": "42"} for c in message.tool_calls]
    else:
        messages.append({"role": "user", "content": "Go on <|im_end|> please."})
    client.chat.completions.create(model="k3rl-policy", messages=messages, tools=TOOLS)
    summary = [messages[0], {"role": "user", "content": f"Summary so far: looked up {task['word']}. Answer."}]
    client.chat.completions.create(model="k3rl-policy", messages=summary)
    return {"reward": float(len(task["word"]) % 2), "metrics": {"letters": len(task["word"])}}


def test_every_call_lands_in_its_episode_token_in_token_out(engine):
    recording = Recording(engine)
    runner = runner_for(recording, editing_agent)
    words = {"t0": "apple", "t1": "pear"}
    try:
        trajectories = runner.run([EpisodeRequest({"word": w}, tid, f"g-{tid}", j)
                                   for tid, w in words.items() for j in range(2)])
    finally:
        runner.close()
    # 4 episodes × (one sequence of 2 calls + one of 1 call), in request order, each with its episode's reward
    assert [t.episode_id for t in trajectories] == [e for e in ("g-t0#0", "g-t0#1", "g-t1#0", "g-t1#1")
                                                    for _ in range(2)]
    assert [len(t.turn_spans) for t in trajectories] == [2, 1] * 4
    for t in trajectories:
        assert t.finish_reason == "done" and t.reward == len(words[t.task_id]) % 2
        assert t.rewards == {"letters": len(words[t.task_id])} and t.metrics["calls"] == 3
    # what the engine saw and sampled is exactly what the trajectories hold: every sequence's prefix before a
    # turn is that call's prompt, the turn is what was sampled (with its log-probs), nothing re-tokenised
    calls = [(t.tokens[:start].tolist(), t.tokens[start:end].tolist(), t.logprobs[start:end].tolist())
             for t in trajectories for start, end in t.turn_spans]
    assert sorted(map(repr, calls)) == sorted(map(repr, recording.seen))
    # each episode's prompts carry its own task (the word) and no other
    for t in trajectories:
        text = engine.tokenizer.decode(t.tokens[:t.turn_spans[0][0]])
        assert words[t.task_id] in text and all(w not in text for w in words.values() if w != words[t.task_id])
    # untrusted text cannot forge control tokens
    specials = set(engine.tokenizer.all_special_ids)
    for t in trajectories[::2]:
        start, end = t.turn_spans[0][1], t.turn_spans[1][0]
        assert "<|im_end|>" not in engine.tokenizer.decode(t.tokens[start:end], skip_special_tokens=True)
        assert sum(int(x) in specials for x in t.tokens[start:end]) <= 3  # only the template's own
    # every call was sampled once, in batches of any size the timing gave (4 agents × 3 calls)
    assert sum(runner.stats.per_round_batch) == 12 == len(recording.seen)


def hostile_requests(base_url: str, key: str) -> list[tuple[str, str, bytes, dict]]:
    """50 requests no worker may fail on: (method, path, body, headers)."""
    def chat(body, headers=None):
        return ("POST", "/v1/chat/completions", body if isinstance(body, bytes) else json.dumps(body).encode(),
                {"Authorization": f"Bearer {key}", **(headers or {})})

    user = {"role": "user", "content": "hi"}
    cases = [chat(b"{not json"), chat(b""), chat(b"[1, 2]"), chat(b'"text"'), chat(b"null"),
             chat(b"\xff\xfe\x00"), chat(b"[" * 100_000 + b"]" * 100_000),
             chat({"messages": [user]}, {"Authorization": "Bearer wrong-key"}),
             chat({"messages": [user]}, {"Authorization": ""}), chat({"messages": [user]}, {"Authorization": key}),
             chat({}), chat({"messages": []}), chat({"messages": "hi"}), chat({"messages": [None]}),
             chat({"messages": [{"role": "wizard", "content": "hi"}]}), chat({"messages": [{"content": "hi"}]}),
             chat({"messages": [{"role": "user", "content": 5}]}),
             chat({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
             chat({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
             chat({"messages": [user, {"role": "tool", "content": "42"}]}),
             chat({"messages": [user, {"role": "tool", "tool_call_id": "nope", "content": "42"}]}),
             chat({"messages": [{"role": "tool", "tool_call_id": "x", "content": "42"}]}),
             chat({"messages": [user, {"role": "assistant", "content": "ok"}]}),
             chat({"messages": [user, {"role": "assistant", "tool_calls": "x"}, user]}),
             chat({"messages": [user, {"role": "assistant", "tool_calls": [{"id": "a"}]}, user]}),
             chat({"messages": [user, {"role": "assistant", "tool_calls": [
                 {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}, user]}),
             chat({"messages": [user, {"role": "assistant", "tool_calls": [
                 {"id": "a", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}, user]}),
             chat({"messages": [user, {"role": "user", "content": "x", "tool_calls": []}]}),
             chat({"messages": [user, {"role": "system", "content": "late"}]}),
             chat({"messages": [{"role": "system", "content": "only"}]}),
             chat({"messages": [user], "stream": True}), chat({"messages": [user], "n": 3}),
             chat({"messages": [user], "max_tokens": 0}), chat({"messages": [user], "max_tokens": "10"}),
             chat({"messages": [user], "max_tokens": True}), chat({"messages": [user], "temperature": "hot"}),
             chat({"messages": [user], "tools": "lookup"}), chat({"messages": [user], "tools": [{"type": "function"}]}),
             chat({"messages": [user], "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}),
             chat({"messages": [{"role": "user", "content": "word " * 5000}]}),
             chat({"messages": [user] * 5000}),
             chat({"messages": [user]}, {"Content-Length": "-5"}),
             ("GET", "/v1/chat/completions", b"", {"Authorization": f"Bearer {key}"}),
             ("DELETE", "/v1/models", b"", {}), ("POST", "/v2/engines", b"{}", {}), ("GET", "/", b"", {}),
             ("GET", "/../../etc/passwd", b"", {}), ("PUT", "/v1/chat/completions", b"{}", {}),
             ("POST", "/v1/chat/completions?x=1", b"{}", {"Authorization": "Bearer "}),
             chat({"messages": [{"role": "user", "content": None}]})]
    assert len(cases) == 50
    return cases


def send(base_url: str, method: str, path: str, body: bytes, headers: dict) -> tuple[int, dict]:
    url = urlparse(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body)), **headers}
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")
    finally:
        conn.close()


def test_hostile_requests_get_errors_and_the_worker_carries_on(engine):
    answers = []

    def agent(client, task):
        base_url, key = str(client.base_url).rstrip("/"), client.api_key
        for method, path, body, headers in hostile_requests(base_url, key):
            answers.append((path, body[:60], *send(base_url, method, path, body, headers)))
        reply = client.chat.completions.create(model="k3rl-policy", messages=[{"role": "user", "content": "hi"}])
        return float(reply.choices[0].finish_reason in ("stop", "length", "tool_calls"))

    runner = runner_for(engine, agent, context=2048)
    try:
        (trajectory,) = runner.run([EpisodeRequest({}, "t", "g", 0)])
        status, models = send(runner.endpoint.base_url, "GET", "/v1/models", b"", {})
    finally:
        runner.close()
    assert len(answers) == 50
    for path, body, status_, payload in answers:
        assert 400 <= status_ < 500, (path, body, status_, payload)
        assert set(payload["error"]) == {"message", "type", "param", "code"} and payload["error"]["message"]
    codes = {a[3]["error"]["code"] for a in answers}
    assert {"invalid_api_key", "context_length_exceeded", "not_found"} <= codes
    assert trajectory.reward == 1.0 and trajectory.finish_reason == "done" and len(trajectory.turn_spans) == 1
    assert status == 200 and models["data"][0]["id"] == "k3rl-policy"


def test_agents_that_fail_are_failed_episodes_and_the_others_finish(engine):
    def agent(client, task):
        client.chat.completions.create(model="k3rl-policy", messages=[{"role": "user", "content": task["kind"]}])
        if task["kind"] == "raises":
            raise RuntimeError("the agent's own bug")
        if task["kind"] == "garbage":
            return "forty-two"
        if task["kind"] == "hangs":
            time.sleep(60)
        return 1.0

    def no_call(client, task):
        return 0.5

    runner = runner_for(engine, agent, timeout_s=8.0)
    try:
        out = runner.run([EpisodeRequest({"kind": k}, k, k, 0) for k in ("raises", "garbage", "hangs", "fine")])
    finally:
        runner.close()
    by_task = {t.task_id: t for t in out}
    assert by_task["raises"].finish_reason == "failed:exception"
    assert "RuntimeError: the agent's own bug" in by_task["raises"].info["error"]
    assert by_task["garbage"].finish_reason == "failed:result" and "'forty-two'" in by_task["garbage"].info["error"]
    assert by_task["hangs"].finish_reason == "failed:timeout"
    assert by_task["fine"].finish_reason == "done" and by_task["fine"].reward == 1.0
    assert all(by_task[k].reward == 0.0 for k in ("raises", "garbage", "hangs"))

    runner = runner_for(engine, no_call)
    try:
        (placeholder,) = runner.run([EpisodeRequest({}, "t", "g", 0)])
    finally:
        runner.close()
    assert placeholder.reward == 0.5 and placeholder.num_sampled == 0 and len(placeholder) == 1


def test_an_agent_function_is_named_like_a_user_environment(tmp_path, monkeypatch):
    import sys

    from k3rl.envs import make
    from k3rl.envs.registry import resolve

    name = "k3rl_registry_probe_agent"  # a module name no other test imports (sys.modules keeps modules)
    (tmp_path / f"{name}.py").write_text("def run(client, task):\n    return 1.0\n\n"
                                         "def helper(x, y):\n    return x\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setitem(sys.modules, name, None)  # restored (removed) after the test
    del sys.modules[name]
    env = make(f"{name}:run", timeout_s=5)
    assert isinstance(env, AgentEnv) and env.timeout_s == 5.0
    with pytest.raises(Exception, match="missing 2 required positional arguments"):  # a factory, not an agent
        make(f"{name}:helper")
    with pytest.raises(Exception, match="timeout_s"):
        make(f"{name}:run", timeout_s=0)
    assert resolve(f"{name}:run").name == f"{name}:run"


def sandboxed_agent(client, task):
    """Module-level, so that a spawned subprocess can import it."""
    import os

    if task["kind"] == "crashes":
        os._exit(3)
    client.chat.completions.create(model="k3rl-policy", messages=[{"role": "user", "content": "hi"}])
    if task["kind"] == "hangs":
        time.sleep(120)
    return {"reward": 1.0, "metrics": {"pid": os.getpid()}}


def test_a_sandboxed_agent_runs_in_its_own_process_and_is_killed_at_its_timeout(engine):
    import os

    runner = AgentRunner(engine, engine.tokenizer, AgentEnv(sandboxed_agent, timeout_s=20.0, sandbox="process"),
                         SamplingParams(max_tokens=8, seed=0), max_context_tokens=1024, env_name="agent")
    started = time.monotonic()
    try:
        out = runner.run([EpisodeRequest({"kind": k}, k, k, 0) for k in ("fine", "crashes", "hangs")])
    finally:
        runner.close()
    by_task = {t.task_id: t for t in out}
    assert by_task["fine"].finish_reason == "done" and by_task["fine"].reward == 1.0
    assert by_task["fine"].rewards["pid"] != os.getpid() and len(by_task["fine"].turn_spans) == 1
    assert by_task["crashes"].finish_reason == "failed:exception"
    assert "exited with code 3" in by_task["crashes"].info["error"]
    assert by_task["hangs"].finish_reason == "failed:timeout" and len(by_task["hangs"].turn_spans) == 1
    assert time.monotonic() - started < 60  # killed at its timeout, not waited for
    with pytest.raises(ValueError, match="sandbox: one of thread, process"):
        AgentEnv(sandboxed_agent, sandbox="docker")


@pytest.mark.vllm
def test_the_endpoint_serves_agents_from_vllm(vllm_engine):
    """The same endpoint over the vLLM engine (no sessions: every call is a plain `generate`): calls land in their
    episodes, the history edit starts a second sequence, and the tokens are the ones vLLM sampled."""
    runner = runner_for(vllm_engine, editing_agent)
    try:
        trajectories = runner.run([EpisodeRequest({"word": "plum"}, "t", "g", j) for j in range(2)])
    finally:
        runner.close()
    assert [t.episode_id for t in trajectories] == ["g#0", "g#0", "g#1", "g#1"]
    assert [len(t.turn_spans) for t in trajectories] == [2, 1, 2, 1]
    assert all(t.finish_reason == "done" and "plum" in vllm_engine.tokenizer.decode(t.tokens) for t in trajectories)
