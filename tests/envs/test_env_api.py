"""Tests of the Env API: the README example, episodes, budgets and truncation reasons, the registry."""

from __future__ import annotations

import json
import time

import pytest

from k3rl.envs import Budget, Env, Episode, format_call, register, registry, run_episode, tool
from k3rl.envs.base import approx_token_count, as_token_counter, last_observation
from k3rl.rl.commands.envs import main as envs_command


class Guess(Env):
    """Find a secret number in 1..100 by probing."""

    def reset(self, task):
        self.secret = task["secret"]
        return "I picked a number in 1..100. Probe it, then answer."

    @tool
    def probe(self, n: int) -> str:
        """Compare n with the secret: returns higher, lower or equal."""
        return "higher" if n < self.secret else "lower" if n > self.secret else "equal"

    @tool(terminal=True)
    def answer(self, n: int) -> float:
        """Submit the secret number; ends the episode."""
        return float(n == self.secret)


def bisect(messages):
    """Binary search over the transcript: a real policy written against the text protocol."""
    lo, hi, last = 1, 100, None
    for m in messages:
        if m["role"] == "assistant":
            last = json.loads(m["content"].split("<tool_call>")[1].split("</tool_call>")[0])["arguments"]["n"]
        elif m["role"] == "tool" and last is not None:
            if m["content"] == "equal":
                return format_call("answer", {"n": last})
            lo, hi = (last + 1, hi) if m["content"] == "higher" else (lo, last - 1)
    return format_call("probe", {"n": (lo + hi) // 2})


def always(text):
    return lambda messages: text


def test_readme_example_solves_and_scores():
    for secret in (1, 37, 100):
        result = run_episode(Guess(), {"secret": secret}, bisect)
        assert result.reward == 1.0
        assert result.info["finish_reason"] == "answered" and not result.info["truncated"]
        assert result.info["calls_by_name"]["answer"] == 1
        assert result.info["tool_calls"] == result.info["calls_by_name"]["probe"] <= 7
    wrong = run_episode(Guess(), {"secret": 5}, always(format_call("answer", {"n": 6})))
    assert wrong.reward == 0.0


def test_messages_shape():
    ep = Episode(Guess(), {"secret": 3})
    assert [m["role"] for m in ep.messages] == ["system", "user"]
    assert "<tools>" in ep.messages[0]["content"] and '"name": "probe"' in ep.messages[0]["content"]
    step = ep.step(format_call("probe", {"n": 50}))
    assert step.observation == "lower" and step.ok and not step.done
    assert ep.messages[-1] == {"role": "tool", "name": "probe", "content": "lower"}
    assert last_observation(ep.messages) == "lower"


def test_no_tool_call_ends_the_episode_with_zero():
    result = run_episode(Guess(), {"secret": 3}, always("I give up."))
    assert result.info["finish_reason"] == "no_tool_call" and result.reward == 0.0 and result.info["turns"] == 1


def test_malformed_call_is_an_observation_and_the_episode_goes_on():
    ep = Episode(Guess(), {"secret": 3})
    step = ep.step('<tool_call>{"name": "probe", "arguments": {"n": "fifty"}}</tool_call>')
    assert not step.ok and not step.done and "argument 'n' must be an integer" in step.observation
    step = ep.step("<tool_call>{oops}</tool_call>")
    assert "not valid JSON" in step.observation
    ep.step(format_call("answer", {"n": 3}))
    assert ep.reward == 1.0 and ep.info["errors_by_kind"] == {"bad_arguments": 1, "bad_json": 1}
    with pytest.raises(RuntimeError, match="already finished"):
        ep.step("more")


def test_max_turns_truncates():
    result = run_episode(Guess(), {"secret": 3}, always(format_call("probe", {"n": 50})), Budget(max_turns=4))
    assert result.info["finish_reason"] == "max_turns" and result.info["truncated"]
    assert result.info["turns"] == 4 and result.reward == 0.0


def test_max_tool_calls_truncates_but_answer_is_always_allowed():
    ep = Episode(Guess(), {"secret": 3}, Budget(max_tool_calls=2))
    ep.step(format_call("probe", {"n": 50}))
    ep.step(format_call("probe", {"n": 20}))
    ep2 = Episode(Guess(), {"secret": 3}, Budget(max_tool_calls=2))
    for n in (50, 20):
        ep2.step(format_call("probe", {"n": n}))
    assert ep2.step(format_call("answer", {"n": 3})).finish_reason == "answered" and ep2.reward == 1.0
    step = ep.step(format_call("probe", {"n": 10}))
    assert step.done and ep.finish_reason == "max_tool_calls" and "budget of 2 calls is spent" in step.observation


class Loud(Env):
    """Returns long observations."""

    def reset(self, task):
        return "go"

    @tool
    def shout(self, n: int) -> str:
        """Return n characters."""
        return "x" * n

    @tool
    def nap(self, seconds: float) -> str:
        """Sleep a while."""
        time.sleep(seconds)
        return "rested"

    def reward(self) -> float:
        return 0.5


def test_observation_budgets():
    ep = Episode(Loud(), None, Budget(max_observation_chars=100, max_observation_tokens=None))
    step = ep.step(format_call("shout", {"n": 1000}))
    assert step.observation.startswith("x" * 100) and "[… 900 more characters not shown]" in step.observation
    ep = Episode(Loud(), None, Budget(max_observation_tokens=50, max_observation_chars=None))
    assert not ep.step(format_call("shout", {"n": 100})).done
    step = ep.step(format_call("shout", {"n": 400}))
    assert step.done and ep.finish_reason == "max_observation_tokens" and ep.truncated
    assert ep.observation_tokens <= 50 and "observation budget reached" in step.observation
    # a reward() method wins over everything else
    assert ep.reward == 0.5


def test_token_counter_is_used_for_the_observation_budget():
    ep = Episode(Loud(), None, Budget(max_observation_tokens=10), count_tokens=len)
    step = ep.step(format_call("shout", {"n": 30}))
    assert step.done and ep.observation_tokens <= 10


def test_tool_timeout_is_an_error_observation():
    ep = Episode(Loud(), None, Budget(tool_timeout_s=0.05))
    step = ep.step(format_call("nap", {"seconds": 1.0}))
    assert not step.ok and not step.done and "did not finish within 0.05 s" in step.observation
    assert ep.info["errors_by_kind"] == {"timeout": 1}


def test_token_counters():
    assert approx_token_count("abcdefgh") == 2
    assert as_token_counter(None)("abcd") == 1
    assert as_token_counter(lambda s: s.split())("a b c") == 3
    assert as_token_counter(lambda s: 7)("whatever") == 7

    class HF:
        def encode(self, text, add_special_tokens=True):
            return [0] * (len(text.split()) + (2 if add_special_tokens else 0))

    assert as_token_counter(HF())("a b c") == 3
    with pytest.raises(TypeError):
        as_token_counter(42)


def test_subclass_can_remove_or_add_tools():
    class NoProbe(Guess):
        def probe(self, n: int) -> str:
            return "hidden"

    class More(Guess):
        @tool
        def hint(self) -> str:
            """Say whether the secret is even."""
            return str(self.secret % 2 == 0)

    assert list(NoProbe.tool_specs()) == ["answer"]
    assert list(More.tool_specs()) == ["probe", "answer", "hint"]
    assert [s["function"]["name"] for s in More.tool_schemas()] == ["probe", "answer", "hint"]


def test_registry_register_make_list(capsys):
    register("test-guess")(Guess)
    try:
        assert isinstance(registry.make("test-guess"), Guess)
        with pytest.raises(ValueError, match="already registered"):
            register("test-guess")(Loud)
        with pytest.raises(KeyError, match="unknown environment 'nope'; registered:"):
            registry.make("nope")
        names = [e.name for e in registry.list_envs()]
        for expected in ("search", "needle", "multihop", "aggregate", "ith", "test-guess"):
            assert expected in names
        assert envs_command([]) == 0
        out = capsys.readouterr().out.splitlines()
        assert any(line.startswith("search ") for line in out)
        assert any(line.startswith("test-guess") and "Find a secret number" in line for line in out)
        assert len(out) == len(names)
    finally:
        registry._REGISTRY.pop("test-guess")


def test_readme_example_is_what_the_readme_shows():
    """The first Python block of envs/README.md defines a working env in at most 15 lines."""
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "envs" / "README.md").read_text()
    code = readme.split("```python\n", 1)[1].split("```", 1)[0]
    body = code.split("\n\n", 1)[1].strip().splitlines()
    assert len(body) <= 15
    namespace: dict = {}
    try:
        exec(compile(code, "envs/README.md", "exec"), namespace)
        env = registry.make("guess")
        assert run_episode(env, {"secret": 42}, bisect).reward == 1.0
        assert envs_command([]) == 0
    finally:
        registry._REGISTRY.pop("guess", None)


def test_truncate_from_outside():
    ep = Episode(Guess(), {"secret": 3})
    ep.step(format_call("probe", {"n": 50}))
    ep.truncate("max_context_tokens")
    assert ep.done and ep.truncated and ep.finish_reason == "max_context_tokens" and ep.reward == 0.0
    with pytest.raises(ValueError):
        Episode(Guess(), {"secret": 3}).truncate("answered")
