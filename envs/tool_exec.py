"""Running a parsed tool call (envs/tools.py): its arguments checked against the tool's schema, the call
itself (optionally under a timeout, on a pooled daemon thread), and the observation shown to the model.

``execute`` never raises: a parse error, an unknown tool (with the closest name), a bad argument (named, with a
"did you mean"), a timeout or an exception inside the tool all become ``Observation(ok=False)`` whose text starts
with ``Error:``, so one bad call never kills a rollout. Nothing is coerced but integral floats for integers and
integers for numbers: a string "5" for an integer is an error the model is told about.
"""

from __future__ import annotations

import difflib
import json
import queue
import threading
from collections.abc import Callable, Mapping
from typing import Any

from k3rl.envs.media import content_parts, is_image
from k3rl.envs.tools import TOOL_CALL_END, TOOL_CALL_START, Observation, ParseError, ToolCall, ToolError, ToolSpec, json_type


def check_value(value: Any, schema: Mapping[str, Any], path: str) -> tuple[Any, str | None]:
    """Check ``value`` against a schema made by ``type_schema``; return (value, error).

    Integral floats are accepted for integers and integers for numbers; nothing else is
    coerced, so a string "5" for an integer is an error the model is told about.
    """
    if "anyOf" in schema:
        for sub in schema["anyOf"]:
            got, err = check_value(value, sub, path)
            if err is None:
                return got, None
        return value, f"{path} has the wrong type ({json_type(value)})"
    if "enum" in schema and value not in schema["enum"]:
        return value, f"{path} must be one of {json.dumps(schema['enum'])}, got {json.dumps(value)[:60]}"
    kind = schema.get("type")
    if kind is None:
        return value, None
    kinds = kind if isinstance(kind, list) else [kind]
    for k in kinds:
        ok, got = _accept(value, k)
        if ok:
            if k == "array" and "items" in schema:
                out = []
                for i, item in enumerate(got):
                    v, err = check_value(item, schema["items"], f"{path}[{i}]")
                    if err:
                        return value, err
                    out.append(v)
                got = out
            if k == "object" and isinstance(schema.get("additionalProperties"), dict):
                sub_schema = schema["additionalProperties"]
                for key, item in got.items():
                    _, err = check_value(item, sub_schema, f"{path}[{key!r}]")
                    if err:
                        return value, err
            return got, None
    want = " or ".join(kinds)
    return value, f"{path} must be {_article(want)} {want}, got {json_type(value)} {json.dumps(value, default=str)[:60]}"


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def _accept(value: Any, kind: str) -> tuple[bool, Any]:
    if kind == "string":
        return isinstance(value, str), value
    if kind == "boolean":
        return isinstance(value, bool), value
    if kind == "integer":
        if isinstance(value, bool):
            return False, value
        if isinstance(value, int):
            return True, value
        if isinstance(value, float) and value.is_integer():
            return True, int(value)
        return False, value
    if kind == "number":
        return (isinstance(value, (int, float)) and not isinstance(value, bool)), value
    if kind == "array":
        return isinstance(value, list), value
    if kind == "object":
        return isinstance(value, dict), value
    if kind == "null":
        return value is None, value
    return False, value


def validate_arguments(spec: ToolSpec, arguments: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Check a call's arguments against a tool's schema; return (clean arguments, errors)."""
    props = spec.parameters["properties"]
    errors: list[str] = []
    clean: dict[str, Any] = {}
    unknown = [a for a in arguments if a not in props]
    for a in unknown:
        hint = difflib.get_close_matches(a, list(props), n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        errors.append(f"unknown argument {a!r}{extra}; {spec.name!r} takes {_names(props) or 'no arguments'}")
    for a in spec.parameters["required"]:
        if a not in arguments:
            errors.append(f"missing required argument {a!r}")
    for a, value in arguments.items():
        if a in props:
            got, err = check_value(value, props[a], f"argument {a!r}")
            if err:
                errors.append(err)
            clean[a] = got
    return clean, errors


def _names(props: Mapping[str, Any]) -> str:
    return ", ".join(repr(p) for p in props)


def execute(specs: Mapping[str, ToolSpec], owner: Any, call: ToolCall | ParseError, timeout_s: float | None = None) -> Observation:
    """Run a parsed call against the tools of ``owner``. Never raises.

    Every failure comes back as ``Observation(ok=False)`` whose text starts with
    ``Error:`` and names the problem (the parse error, the unknown tool and the closest
    name, the bad argument, the timeout, or the exception the tool raised).
    """
    if isinstance(call, ParseError):
        fix = f' Write {TOOL_CALL_START}{{"name": ..., "arguments": {{...}}}}{TOOL_CALL_END}.'
        return Observation(f"Error: {call.message}.{fix}", False, call.kind)
    spec = specs.get(call.name) if isinstance(call.name, str) else None
    if spec is None:
        hint = difflib.get_close_matches(str(call.name), list(specs), n=1)
        extra = f" Did you mean {hint[0]!r}?" if hint else ""
        return Observation(
            f"Error: unknown tool {call.name!r}. Available tools: {', '.join(specs)}.{extra}", False, "unknown_tool"
        )
    args, errors = validate_arguments(spec, call.arguments)
    if errors:
        return Observation(f"Error: bad arguments for {spec.name!r}: " + "; ".join(errors) + ".", False, "bad_arguments")
    try:
        value = _call(spec.fn, owner, args, None if spec.inline else timeout_s)
    except TimeoutError:
        return Observation(f"Error: tool {spec.name!r} did not finish within {timeout_s:g} s.", False, "timeout")
    except ToolError as exc:
        return Observation(f"Error: {exc}", False, "tool_error")
    except Exception as exc:
        return Observation(f"Error: tool {spec.name!r} failed: {type(exc).__name__}: {exc}", False, "tool_exception")
    return Observation(result_text(value), True, None, value)


def result_text(value: Any) -> str:
    """How a tool's return value is shown to the model."""
    if value is None:
        return "ok"
    if isinstance(value, str):
        return value
    parts = content_parts(value)
    if parts is not None:  # images: their text parts here; the episode shows the images (envs/base.py)
        return "".join("[image]" if is_image(p) else result_text(p) for p in parts)
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, ensure_ascii=False, default=str)
    return str(value)


def _call(fn: Callable, owner: Any, args: dict[str, Any], timeout_s: float | None) -> Any:
    if timeout_s is None:
        return fn(owner, **args)
    # A pooled daemon thread bounds the wait. Python cannot kill it, so a tool that
    # hangs keeps running in the background while the episode moves on with a timeout
    # observation; the thread rejoins the pool when the call returns.
    try:
        worker = _IDLE_WORKERS.pop()
    except IndexError:
        worker = _Worker()
    box: dict[str, Any] = {}
    finished = threading.Event()
    worker.jobs.put((fn, owner, args, box, finished))
    if not finished.wait(timeout_s):
        raise TimeoutError
    if "error" in box:
        raise box["error"]
    return box.get("value")


class _Worker(threading.Thread):
    """A daemon thread that runs tool calls handed to it (one thread start per pool miss)."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="k3rl-tool")
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.start()

    def run(self) -> None:
        while True:
            fn, owner, args, box, finished = self.jobs.get()
            try:
                box["value"] = fn(owner, **args)
            except BaseException as exc:
                box["error"] = exc
            finished.set()
            _IDLE_WORKERS.append(self)


_IDLE_WORKERS: list[_Worker] = []


__all__ = ["check_value", "execute", "result_text", "validate_arguments"]
