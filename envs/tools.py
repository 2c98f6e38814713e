"""The tool-call text protocol: what the model writes, how it is parsed, how a tool declares itself (`@tool`).

Running a parsed call (argument checks, timeout, the observation) is envs/tool_exec.py.

One call per assistant turn, Hermes/Qwen style::

    I should look this up first.
    <tool_call>
    {"name": "search", "arguments": {"query": "tallest mountain", "k": 5}}
    </tool_call>

The result comes back to the model wrapped as ``<tool_response>…</tool_response>``.
The episode ends when the model calls a terminal tool (``answer``), or writes a turn
with no ``<tool_call>`` at all.

Notable choices:
- ``<think>…</think>`` blocks are removed before parsing, so a call drafted while
  thinking is never executed (verl #4757 is that bug in the Hermes parsers).
- Only the first call counts; the rollout side stops generation at ``TOOL_CALL_END``
  (see ``STOP_SEQUENCES``). A missing closing tag is tolerated only when the rest of
  the text is exactly one JSON object, for engines that strip the stop string.
- ``parse`` never raises and ``execute`` (envs/tool_exec.py) never raises: bad JSON, an unknown tool, a
  wrong argument name or type, or an exception inside the tool all become an error
  observation that names the problem, so one bad call never kills a rollout.
- Schemas are derived from type hints and the Google-style docstring of a ``@tool``
  method, in the OpenAI function-calling shape.
"""

from __future__ import annotations

import collections.abc
import enum
import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
THINK_START = "<think>"
THINK_END = "</think>"
# Strings at which a rollout engine should stop generating (keep them in the output).
STOP_SEQUENCES = (TOOL_CALL_END,)

ParseErrorKind = Literal["no_call", "unclosed", "bad_json", "bad_shape"]


class ToolError(Exception):
    """Raised by a tool to tell the model what was wrong; shown as ``Error: <message>``."""


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: tool name and its JSON arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ParseError:
    """Why no call could be read from a turn; ``kind == "no_call"`` means none was attempted."""

    kind: ParseErrorKind
    message: str


@dataclass(frozen=True)
class Observation:
    """The result of one call as the model will see it, and whether it is an error."""

    text: str
    ok: bool
    error: str | None = None
    value: Any = None


@dataclass(frozen=True)
class ToolSpec:
    """A tool: its name, description, JSON-schema parameters and the function behind it."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]
    terminal: bool = False
    param_types: dict[str, Any] = field(default_factory=dict, compare=False)
    inline: bool = False
    """Run in the caller's thread, without the pooled thread that bounds a call by `tool_timeout_s`
    (envs/tool_exec.py): for the environments' own tools whose time the environment bounds (an index lookup, a
    page of a document), where the thread hand-off costs more than the call."""

    def schema(self) -> dict[str, Any]:
        """OpenAI function-calling shape: ``{"type": "function", "function": {...}}``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def tool(fn: Callable | None = None, *, terminal: bool = False, name: str | None = None, inline: bool = False):
    """Mark a method as a tool; ``@tool`` or ``@tool(terminal=True)``.

    A terminal tool ends the episode after it runs; if it returns a number and the
    environment defines no ``reward`` method, that number is the episode's reward.
    ``inline=True`` runs it without the time limit's thread (`ToolSpec.inline`): only for a tool that cannot hang.
    """

    def mark(f: Callable) -> Callable:
        f.__k3rl_tool__ = tool_spec(f, terminal=terminal, name=name, inline=inline)
        return f

    return mark(fn) if fn is not None else mark


_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?)\s*:\s*$")
_ARG_LINE = re.compile(r"^\s*\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_REST_PARAM = re.compile(r"^\s*:param\s+(?:[\w\[\], |]+\s+)?(\w+)\s*:\s*(.*)$")


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a Google-style (or ``:param x:`` reST) docstring into summary and per-argument text."""
    if not doc:
        return "", {}
    summary: list[str] = []
    params: dict[str, str] = {}
    section = current = None
    base_indent = None
    for line in inspect.cleandoc(doc).splitlines():
        indent = len(line) - len(line.lstrip())
        head = _SECTION.match(line)
        rest = _REST_PARAM.match(line)
        if head:
            section, current, base_indent = head.group(1).lower(), None, None
        elif rest:
            section, current = "args", rest.group(1)
            params[current] = rest.group(2).strip()
        elif section in ("args", "arguments", "parameters"):
            arg = _ARG_LINE.match(line)
            if arg and (base_indent is None or indent <= base_indent):
                base_indent = indent
                current = arg.group(1)
                params[current] = arg.group(2).strip()
            elif current and line.strip():
                params[current] = (params[current] + " " + line.strip()).strip()
        elif section is None:
            summary.append(line)
    return " ".join(" ".join(summary).split()), params


def type_schema(tp: Any, where: str = "") -> dict[str, Any]:
    """JSON schema of a Python type hint (str, int, float, bool, list, dict, Literal, Enum, Optional)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is str:
        return {"type": "string"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp in (list, tuple):
        return {"type": "array"}
    if tp is dict:
        return {"type": "object"}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"type": "string", "enum": [str(m.value) for m in tp]}
    if origin is Literal:
        kinds = {type(a) for a in args}
        js = {str: "string", int: "integer", float: "number", bool: "boolean"}
        out: dict[str, Any] = {"enum": list(args)}
        if len(kinds) == 1 and next(iter(kinds)) in js:
            out = {"type": js[next(iter(kinds))], "enum": list(args)}
        return out
    if origin in (list, tuple, collections.abc.Sequence):
        item = args[0] if args else Any
        if item is Any:
            return {"type": "array"}
        return {"type": "array", "items": type_schema(item, where)}
    if origin is dict:
        if len(args) == 2 and args[1] is not Any:
            return {"type": "object", "additionalProperties": type_schema(args[1], where)}
        return {"type": "object"}
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        schemas = [type_schema(a, where) for a in members]
        if type(None) in args:
            schemas.append({"type": "null"})
        if all(set(s) == {"type"} and isinstance(s["type"], str) for s in schemas):
            return {"type": [s["type"] for s in schemas]}
        return {"anyOf": schemas}
    raise TypeError(f"{where}: type {tp!r} has no JSON schema; use str, int, float, bool, list[...], dict[str, ...], Literal or Optional")


def tool_spec(fn: Callable, *, terminal: bool = False, name: str | None = None, inline: bool = False) -> ToolSpec:
    """Build a ``ToolSpec`` from a function's signature, type hints and docstring.

    Raises ``TypeError`` at definition time for a parameter without a type hint, so a
    broken tool is found when the class is written, not mid-rollout.
    """
    tool_name = name or fn.__name__
    summary, docs = parse_docstring(fn.__doc__)
    if not summary:
        raise TypeError(f"tool {tool_name!r} needs a docstring: the model reads it as the tool's description")
    hints = typing.get_type_hints(fn)
    properties: dict[str, Any] = {}
    required: list[str] = []
    types_: dict[str, Any] = {}
    for i, (pname, param) in enumerate(inspect.signature(fn).parameters.items()):
        if i == 0 and pname in ("self", "cls"):
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {tool_name!r}: *args/**kwargs cannot be described to the model")
        if pname not in hints:
            raise TypeError(f"tool {tool_name!r}: parameter {pname!r} needs a type hint")
        schema = type_schema(hints[pname], f"tool {tool_name!r} parameter {pname!r}")
        if pname in docs and docs[pname]:
            schema = {**schema, "description": docs[pname]}
        if param.default is inspect.Parameter.empty:
            required.append(pname)
        elif isinstance(param.default, (str, int, float, bool, type(None))):
            schema = {**schema, "default": param.default}
        properties[pname] = schema
        types_[pname] = hints[pname]
    parameters = {"type": "object", "properties": properties, "required": required, "additionalProperties": False}
    return ToolSpec(tool_name, summary, parameters, fn, terminal, types_, inline)


TOOL_PROMPT_STYLES = ("json", "compact", "minimal")


def _signature(spec: ToolSpec, described: bool = True) -> str:
    """``name(arg: type, arg: type = default): description`` — one line per tool (the compact list;
    the minimal list leaves the description out)."""
    props = spec.parameters.get("properties", {})
    args = []
    for name, p in props.items():
        arg = f"{name}: {p.get('type', 'any')}"
        if "default" in p:
            arg += f" = {json.dumps(p['default'], ensure_ascii=False)}"
        args.append(arg)
    return f"- {spec.name}({', '.join(args)})" + (f": {spec.description}" if described else "")


def render_tools_prompt(specs: Mapping[str, ToolSpec] | list[ToolSpec], preamble: str = "",
                        style: str = "json") -> str:
    """The system-prompt text that tells the model the tools and the call syntax.

    ``style="json"`` lists each tool's full OpenAI schema (what chat models are trained on);
    ``"compact"`` one signature line per tool (about a third of the tokens: the choice for
    small models trained from scratch, where the system prompt is most of every sequence);
    ``"minimal"`` only the call syntax and the bare signatures, no preamble and no descriptions
    (about a sixth of the tokens: for a model that learns the tools from demonstrations alone).
    """
    if style not in TOOL_PROMPT_STYLES:
        raise ValueError(f"tool prompt style {style!r} is not one of {', '.join(TOOL_PROMPT_STYLES)}")
    items = list(specs.values()) if isinstance(specs, Mapping) else list(specs)
    terminal = [s.name for s in items if s.terminal]
    if style == "minimal":
        ends = f"; `{terminal[0]}` ends the conversation" if terminal else ""
        return "\n".join([f'Tools, one call per turn as {TOOL_CALL_START}{{"name": ..., "arguments": {{...}}}}'
                          f"{TOOL_CALL_END}{ends}:", *(_signature(s, described=False) for s in items)])
    lines = [preamble.strip(), ""] if preamble.strip() else []
    lines += [
        "# Tools",
        "",
        "You can call the tools below, one call per turn. To call a tool, write:",
        TOOL_CALL_START,
        '{"name": "<tool name>", "arguments": {<arguments as a JSON object>}}',
        TOOL_CALL_END,
        f"The result is returned inside {TOOL_RESPONSE_START}{TOOL_RESPONSE_END}.",
    ]
    if terminal:
        lines.append(f"When you are done, call `{terminal[0]}`; that ends the conversation.")
    lines += ["", "<tools>"]
    if style == "compact":
        lines += [_signature(s) for s in items]
    else:
        lines += [json.dumps(s.schema(), ensure_ascii=False) for s in items]
    lines.append("</tools>")
    return "\n".join(lines)


def format_call(name: str, arguments: Mapping[str, Any] | None = None) -> str:
    """The exact text a model writes to call ``name`` (what oracles and SFT demos emit)."""
    body = json.dumps({"name": name, "arguments": dict(arguments or {})}, ensure_ascii=False)
    return f"{TOOL_CALL_START}\n{body}\n{TOOL_CALL_END}"


def format_observation(text: str) -> str:
    """Wrap a tool result the way the model sees it."""
    return f"{TOOL_RESPONSE_START}\n{text}\n{TOOL_RESPONSE_END}"


def strip_thinking(text: str) -> str:
    """Drop ``<think>…</think>`` blocks; an unclosed ``<think>`` hides the rest of the turn."""
    out, pos = [], 0
    while True:
        start = text.find(THINK_START, pos)
        if start < 0:
            out.append(text[pos:])
            break
        out.append(text[pos:start])
        end = text.find(THINK_END, start + len(THINK_START))
        if end < 0:
            break
        pos = end + len(THINK_END)
    return "".join(out)


def parse(text: str) -> ToolCall | ParseError:
    """Read the first tool call from an assistant turn. Never raises."""
    try:
        return _parse(text)
    except Exception as exc:  # a parser bug must not kill a rollout; name it instead
        return ParseError("bad_shape", f"could not read the tool call ({type(exc).__name__}: {exc})")


def _parse(text: str) -> ToolCall | ParseError:
    if not isinstance(text, str):
        return ParseError("bad_shape", f"expected text, got {type(text).__name__}")
    visible = strip_thinking(text)
    start = visible.find(TOOL_CALL_START)
    if start < 0:
        return ParseError("no_call", "no tool call in this turn")
    body_start = start + len(TOOL_CALL_START)
    end = visible.find(TOOL_CALL_END, body_start)
    body = visible[body_start:] if end < 0 else visible[body_start:end]
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, RecursionError) as exc:
        if end < 0:
            return ParseError("unclosed", f"the tool call is not closed with {TOOL_CALL_END}")
        msg = exc.msg if isinstance(exc, json.JSONDecodeError) else "nesting too deep"
        pos = getattr(exc, "pos", None)
        where = f" at character {pos}" if pos is not None else ""
        return ParseError("bad_json", f"the tool call is not valid JSON: {msg}{where}")
    if not isinstance(obj, dict):
        return ParseError("bad_shape", f'the tool call must be a JSON object {{"name": ..., "arguments": {{...}}}}, got {json_type(obj)}')
    unknown = sorted(set(obj) - {"name", "arguments"})
    if "name" not in obj:
        return ParseError("bad_shape", 'the tool call has no "name" field')
    if not isinstance(obj["name"], str):
        return ParseError("bad_shape", f'"name" must be a string, got {json_type(obj["name"])}')
    if unknown:
        return ParseError("bad_shape", f"unexpected field(s) {', '.join(map(repr, unknown))} in the tool call; "
                                       "use only \"name\" and \"arguments\"")
    args = obj.get("arguments", {})
    if isinstance(args, str):
        # Some models double-encode arguments the way the OpenAI API transports them.
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return ParseError("bad_json", '"arguments" is a string that is not valid JSON')
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ParseError("bad_shape", f'"arguments" must be a JSON object, got {json_type(args)}')
    return ToolCall(obj["name"], args)


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__
