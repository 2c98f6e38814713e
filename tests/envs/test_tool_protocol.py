"""Tests of the tool-call protocol: schema derivation, the parser (incl. fuzzing), the executor."""

from __future__ import annotations

import json
import random
import time
from typing import Literal, Optional

import pytest

from k3rl.envs import tools as T
from k3rl.envs.tool_exec import execute
from k3rl.envs.tools import ParseError, ToolCall, format_call, parse, tool, tool_spec


def lookup(query: str, k: int = 5, mode: Literal["fast", "exact"] = "fast", tags: list[str] | None = None,
           weights: dict[str, float] | None = None, scale: float = 1.0, strict: bool = False) -> str:
    """Look something up in the index.

    Longer explanation that the model does not need.

    Args:
        query: what to look for; may span
            two lines.
        k: how many results.
        mode: search mode.
        tags (list[str]): optional tags.
    """
    return query


def test_schema_from_hints_and_docstring():
    spec = tool_spec(lookup)
    s = spec.schema()
    assert s["type"] == "function" and s["function"]["name"] == "lookup"
    assert s["function"]["description"] == "Look something up in the index. Longer explanation that the model does not need."
    p = s["function"]["parameters"]
    assert p["type"] == "object" and p["additionalProperties"] is False
    assert p["required"] == ["query"]
    props = p["properties"]
    assert props["query"] == {"type": "string", "description": "what to look for; may span two lines."}
    assert props["k"] == {"type": "integer", "description": "how many results.", "default": 5}
    assert props["mode"] == {"type": "string", "enum": ["fast", "exact"], "description": "search mode.", "default": "fast"}
    assert props["tags"]["anyOf"] == [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]
    assert props["tags"]["description"] == "optional tags."
    assert props["weights"]["anyOf"][0] == {"type": "object", "additionalProperties": {"type": "number"}}
    assert props["scale"]["type"] == "number" and props["strict"]["type"] == "boolean"
    json.dumps(s)


def test_schema_rest_docstring_and_optional_scalar():
    def f(self, a: Optional[int] = None) -> str:
        """Do f.

        :param a: the a value.
        """

    spec = tool_spec(f)
    assert spec.parameters["properties"]["a"] == {"type": ["integer", "null"], "description": "the a value.", "default": None}
    assert spec.parameters["required"] == []


def test_schema_errors_at_definition_time():
    def no_hint(self, x) -> str:
        """Doc."""

    def no_doc(self, x: int) -> str:
        pass

    def bad_type(self, x: object) -> str:
        """Doc."""

    def star(self, *xs: int) -> str:
        """Doc."""

    with pytest.raises(TypeError, match="needs a type hint"):
        tool(no_hint)
    with pytest.raises(TypeError, match="needs a docstring"):
        tool(no_doc)
    with pytest.raises(TypeError, match="no JSON schema"):
        tool(bad_type)
    with pytest.raises(TypeError, match=r"\*args"):
        tool(star)


def test_parse_well_formed_and_variants():
    text = 'Let me look.\n<tool_call>\n{"name": "lookup", "arguments": {"query": "owl"}}\n</tool_call>'
    assert parse(text) == ToolCall("lookup", {"query": "owl"})
    assert parse(format_call("lookup", {"query": "x", "k": 2})) == ToolCall("lookup", {"query": "x", "k": 2})
    # arguments given as a JSON string, or missing
    assert parse('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>') == ToolCall("a", {"x": 1})
    assert parse('<tool_call>{"name": "a"}</tool_call>') == ToolCall("a", {})
    # the closing tag stripped by the engine's stop string
    assert parse('<tool_call>\n{"name": "a", "arguments": {}}\n') == ToolCall("a", {})
    # only the first call counts
    two = format_call("a", {"x": 1}) + format_call("b", {})
    assert parse(two) == ToolCall("a", {"x": 1})


def test_parse_ignores_calls_inside_thinking():
    inside = "<think>maybe " + format_call("a", {}) + "</think>I am done."
    assert parse(inside).kind == "no_call"
    after = "<think>plan</think>" + format_call("b", {})
    assert parse(after) == ToolCall("b", {})
    unclosed = "<think>" + format_call("a", {})
    assert parse(unclosed).kind == "no_call"


@pytest.mark.parametrize(
    "text, kind, words",
    [
        ("no call here", "no_call", "no tool call"),
        ('<tool_call>{"name": "a", "arguments": {}', "unclosed", "not closed"),
        ("<tool_call>{'name': 'a'}</tool_call>", "bad_json", "not valid JSON"),
        ('<tool_call>{"name": "a", "arguments": {"x": 1,}}</tool_call>', "bad_json", "at character"),
        ("<tool_call>[1, 2]</tool_call>", "bad_shape", "got array"),
        ('<tool_call>{"arguments": {}}</tool_call>', "bad_shape", 'no "name"'),
        ('<tool_call>{"name": 3}</tool_call>', "bad_shape", "must be a string"),
        ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', "bad_shape", "must be a JSON object"),
        ('<tool_call>{"name": "a", "args": {}}</tool_call>', "bad_shape", "unexpected field"),
        ('<tool_call>{"name": "a", "arguments": "{oops"}</tool_call>', "bad_json", "not valid JSON"),
    ],
)
def test_parse_errors_are_named(text, kind, words):
    err = parse(text)
    assert isinstance(err, ParseError) and err.kind == kind and words in err.message


class Box:
    @tool
    def lookup(self, query: str, k: int = 5, scale: float = 1.0, tags: list[str] | None = None) -> str:
        """Look up ``query``."""
        return f"{query}:{k}:{scale}:{tags}"

    @tool
    def boom(self) -> str:
        """Always fails."""
        raise RuntimeError("disk on fire")

    @tool
    def polite(self, x: int) -> str:
        """Refuses negative numbers."""
        if x < 0:
            raise T.ToolError("x must be >= 0")
        return str(x)

    @tool
    def slow(self, seconds: float) -> str:
        """Sleeps."""
        time.sleep(seconds)
        return "done"


SPECS = {n: getattr(Box, n).__k3rl_tool__ for n in ("lookup", "boom", "polite", "slow")}


def run(text: str, timeout: float | None = 5.0) -> T.Observation:
    return execute(SPECS, Box(), parse(text), timeout)


def test_execute_ok_and_coercions():
    assert run(format_call("lookup", {"query": "q"})).text == "q:5:1.0:None"
    # integral float for an int, int for a float
    assert run(format_call("lookup", {"query": "q", "k": 3.0, "scale": 2})).text == "q:3:2:None"
    assert run(format_call("lookup", {"query": "q", "tags": ["a"]})).text == "q:5:1.0:['a']"


@pytest.mark.parametrize(
    "call, kind, words",
    [
        (format_call("lookpu", {"query": "q"}), "unknown_tool",
         "unknown tool 'lookpu'. Available tools: lookup, boom, polite, slow. Did you mean 'lookup'?"),
        (format_call("lookup", {"qeury": "q"}), "bad_arguments", "unknown argument 'qeury' (did you mean 'query'?)"),
        (format_call("lookup", {}), "bad_arguments", "missing required argument 'query'"),
        (format_call("lookup", {"query": "q", "k": "5"}), "bad_arguments", "argument 'k' must be an integer, got string"),
        (format_call("lookup", {"query": "q", "k": 2.5}), "bad_arguments", "must be an integer, got number"),
        (format_call("lookup", {"query": "q", "k": True}), "bad_arguments", "must be an integer, got boolean"),
        (format_call("lookup", {"query": "q", "tags": ["a", 1]}), "bad_arguments", "argument 'tags'"),
        (format_call("boom", {}), "tool_exception", "tool 'boom' failed: RuntimeError: disk on fire"),
        (format_call("polite", {"x": -1}), "tool_error", "Error: x must be >= 0"),
        ("<tool_call>{bad</tool_call>", "bad_json", "not valid JSON"),
    ],
)
def test_execute_errors_name_the_problem(call, kind, words):
    obs = run(call)
    assert not obs.ok and obs.error == kind
    assert obs.text.startswith("Error:") and words in obs.text


def test_execute_timeout_returns_observation():
    started = time.perf_counter()
    obs = run(format_call("slow", {"seconds": 1.0}), timeout=0.05)
    assert time.perf_counter() - started < 0.5
    assert obs.error == "timeout" and "did not finish within 0.05 s" in obs.text
    assert run(format_call("slow", {"seconds": 0.0}), timeout=1.0).text == "done"


def test_inline_tools_run_in_the_callers_thread_and_others_on_the_pool():
    """`@tool(inline=True)` (the environments' own bounded tools: search, open, answer) skips the time limit's
    thread hand-off; every other tool still runs on the pooled thread that enforces tool_timeout_s."""
    import threading

    from k3rl.envs.search import SearchEnv

    class Where:
        @T.tool(inline=True)
        def here(self) -> str:
            """The name of the thread that ran the call."""
            return threading.current_thread().name

        @T.tool
        def there(self) -> str:
            """The name of the thread that ran the call."""
            return threading.current_thread().name

    specs = {n: getattr(Where, n).__k3rl_tool__ for n in ("here", "there")}
    assert execute(specs, Where(), parse(format_call("here")), 5.0).text == threading.current_thread().name
    assert execute(specs, Where(), parse(format_call("there")), 5.0).text == "k3rl-tool"
    assert all(getattr(SearchEnv, n).__k3rl_tool__.inline for n in ("search", "open", "answer"))


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(8 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([rng.randint(-10**6, 10**6), rng.random() * 1e3, 2.0, float(rng.randint(0, 9))])
    if kind in (3, 4):
        return "".join(chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x3000)])) for _ in range(rng.randrange(8)))
    if kind in (5, 6):
        keys = ["name", "arguments", "query", "k", "tags", "scale", "x", "seconds", rng.choice("abc")]
        return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}
    return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]


def test_fuzz_random_bytes_never_raise():
    rng = random.Random(0)
    pieces = [T.TOOL_CALL_START, T.TOOL_CALL_END, T.THINK_START, T.THINK_END, "{", "}", '"name"', ":", ",", "[", "\\"]
    for _ in range(3000):
        raw = bytes(rng.randrange(256) for _ in range(rng.randrange(80))).decode("utf-8", errors="replace")
        text = "".join(rng.choice([raw, rng.choice(pieces), raw[: rng.randrange(len(raw) + 1)]]) for _ in range(rng.randrange(1, 6)))
        result = parse(text)
        assert isinstance(result, (ToolCall, ParseError))
        obs = execute(SPECS, Box(), result, None)
        assert isinstance(obs, T.Observation) and isinstance(obs.text, str) and obs.text


def test_fuzz_random_json_calls_never_raise():
    rng = random.Random(1)
    names = ["lookup", "polite", "boom", "nope", ""]
    outcomes = {"ok": 0, "error": 0}
    for _ in range(3000):
        roll = rng.random()
        if roll < 0.15:
            body = {"name": "lookup", "arguments": {"query": str(_random_json(rng, 3)), "k": rng.randint(-3, 30)}}
        elif roll < 0.6:
            body = {"name": rng.choice(names), "arguments": _random_json(rng, 1) if rng.random() < 0.3 else
                    {rng.choice(["query", "k", "x", "tags", "scale", "zzz"]): _random_json(rng, 2) for _ in range(rng.randrange(4))}}
        else:
            body = _random_json(rng)
        text = json.dumps(body)
        if rng.random() < 0.3:
            text = text[: rng.randrange(len(text) + 1)]
        result = parse(T.TOOL_CALL_START + text + (T.TOOL_CALL_END if rng.random() < 0.8 else ""))
        assert isinstance(result, (ToolCall, ParseError))
        obs = execute(SPECS, Box(), result, None)
        assert obs.ok or obs.text.startswith("Error:")
        outcomes["ok" if obs.ok else "error"] += 1
    # the generator reaches both outcomes, so the test exercises the executor, not just the parser
    assert outcomes["ok"] > 50 and outcomes["error"] > 500


def test_deep_nesting_is_an_error_not_a_crash():
    deep = "[" * 100000 + "]" * 100000
    assert parse(T.TOOL_CALL_START + deep + T.TOOL_CALL_END).kind in ("bad_json", "bad_shape")


def test_render_tools_prompt_lists_protocol_and_schemas():
    def answer(self, text: str) -> str:
        """Final answer."""

    spec, final = tool_spec(lookup), tool_spec(answer, terminal=True)
    text = T.render_tools_prompt({"lookup": spec, "answer": final}, "You are helpful.")
    assert text.startswith("You are helpful.")
    assert T.TOOL_CALL_START in text and T.TOOL_CALL_END in text and T.TOOL_RESPONSE_START in text
    assert json.dumps(spec.schema(), ensure_ascii=False) in text
    assert "call `answer`; that ends the conversation" in text
    assert T.format_observation("hi") == "<tool_response>\nhi\n</tool_response>"
    assert T.STOP_SEQUENCES == ("</tool_call>",)
