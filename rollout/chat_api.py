"""The OpenAI chat-completions format on k3rl's side: a request's body checked and turned into the messages the
chat template renders, and a sampled turn turned into the assistant message the client gets back.

Tools follow k3rl's protocol (envs/tools.py): the request's `tools` (OpenAI function schemas) are listed in the
system message the way environments list theirs, the model writes `<tool_call>{"name": …, "arguments": {…}}
</tool_call>`, and that call comes back as the message's `tool_calls` (arguments as a JSON string, an id the
client must quote in its `tool` message). An assistant message of the history is rendered back into the same
text. Every problem with a body is a `ChatRequestError` with the OpenAI error fields (HTTP status, type, param,
code), so the endpoint (rollout/agent_endpoint.py) answers it instead of failing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from k3rl.envs.tools import ParseError, ToolSpec, format_call, parse, render_tools_prompt

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_MESSAGES = 4096


class ChatRequestError(Exception):
    """A request the endpoint refuses: OpenAI's error object (`message`, `type`, `param`, `code`) and a status."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """A checked request: the conversation as k3rl messages (role, text), and what the client asked for."""

    messages: list[dict[str, str]]
    """system (with the tool list), user, assistant (text with its calls written out), tool (result text)."""
    tools: list[dict[str, Any]] = field(default_factory=list)
    max_tokens: int | None = None
    raw: list[dict[str, Any]] = field(default_factory=list, repr=False)
    """The request's own messages, normalised (`normalise_message`): what the next call is compared against."""


def _text(content: Any, where: str) -> str:
    """A message content as text: a string, null, or a list of text parts (other parts are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatRequestError(f"{where}.content[{i}]: only text parts are supported, got {kind!r}",
                                       f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatRequestError(f"{where}.content: a string or a list of text parts, got {type(content).__name__}",
                           f"{where}.content")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, checked: [{id, name, arguments (a dict)}]."""
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise ChatRequestError(f"{where}.tool_calls: a list, got {type(calls).__name__}", f"{where}.tool_calls")
    out = []
    for i, call in enumerate(calls):
        at = f"{where}.tool_calls[{i}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(call.get("id"), str):
            raise ChatRequestError(f"{at}: an object with a string `id` and `function: {{name, arguments}}`", at)
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except (json.JSONDecodeError, RecursionError):
            raise ChatRequestError(f"{at}.function.arguments: not valid JSON", f"{at}.function.arguments") from None
        if not isinstance(parsed, dict):
            raise ChatRequestError(f"{at}.function.arguments: a JSON object", f"{at}.function.arguments")
        out.append({"id": call["id"], "name": fn["name"], "arguments": parsed})
    return out


def normalise_message(message: Any, index: int) -> dict[str, Any]:
    """One request message checked and reduced to what renders: role, text, tool calls, tool_call_id."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ChatRequestError(f"{where}: an object, got {type(message).__name__}", where)
    role = message.get("role")
    if role not in ROLES:
        raise ChatRequestError(f"{where}.role: one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
    if message.get("content") is None and not (role == "assistant" and message.get("tool_calls")):
        raise ChatRequestError(f"{where}.content: required (null only for an assistant message with tool_calls)",
                               f"{where}.content")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role,
                           "content": _text(message.get("content"), where)}
    if role == "assistant":
        out["tool_calls"] = _tool_calls(message.get("tool_calls"), where)
    elif message.get("tool_calls") is not None:
        raise ChatRequestError(f"{where}: only assistant messages carry tool_calls", f"{where}.tool_calls")
    if role == "tool":
        if not isinstance(message.get("tool_call_id"), str):
            raise ChatRequestError(f"{where}: a tool message needs the `tool_call_id` it answers",
                                   f"{where}.tool_call_id")
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _tool_specs(tools: Any) -> list[ToolSpec]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatRequestError(f"tools: a list, got {type(tools).__name__}", "tools")
    specs = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatRequestError(f"tools[{i}]: {{\"type\": \"function\", \"function\": {{\"name\": …}}}}",
                                   f"tools[{i}]")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ChatRequestError(f"tools[{i}].function.parameters: a JSON schema object",
                                   f"tools[{i}].function.parameters")
        specs.append(ToolSpec(fn["name"], str(fn.get("description", "")), params, fn=None))
    return specs


def parse_request(body: Any, max_new_tokens: int) -> ChatRequest:
    """The checked `ChatRequest` of a `/v1/chat/completions` body, or a `ChatRequestError` naming the problem."""
    if not isinstance(body, dict):
        raise ChatRequestError(f"the body must be a JSON object, got {type(body).__name__}")
    if body.get("stream"):
        raise ChatRequestError("stream: streaming is not supported by this endpoint; send stream=false", "stream")
    if body.get("n", 1) != 1:
        raise ChatRequestError("n: this endpoint samples one choice per request", "n")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages: a non-empty list of messages", "messages")
    if len(messages) > MAX_MESSAGES:
        raise ChatRequestError(f"messages: at most {MAX_MESSAGES}, got {len(messages)}", "messages")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ChatRequestError(f"max_tokens: a positive integer, got {limit!r}", "max_tokens")
    for key in ("temperature", "top_p"):
        value = body.get(key)
        if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value)):
            raise ChatRequestError(f"{key}: a number, got {value!r}", key)
    raw = [normalise_message(m, i) for i, m in enumerate(messages)]
    if raw[-1]["role"] == "assistant":
        raise ChatRequestError("messages: the last message is the assistant's; there is nothing to answer",
                               "messages")
    specs = _tool_specs(body.get("tools"))
    return ChatRequest(render_messages(raw, specs), body.get("tools") or [], min(limit or max_new_tokens,
                                                                                  max_new_tokens), raw)


def render_messages(raw: list[dict[str, Any]], specs: list[ToolSpec]) -> list[dict[str, str]]:
    """Normalised messages → the (role, text) messages the chat template renders: the tools listed in the system
    message, assistant calls written out in k3rl's syntax, every tool message answering an open call."""
    out: list[dict[str, str]] = []
    system = [m["content"] for m in raw if m["role"] == "system"]
    if system or specs:
        text = "\n\n".join(system)
        out.append({"role": "system", "content": render_tools_prompt(specs, text) if specs else text})
    open_calls: set[str] = set()
    for i, m in enumerate(raw):
        if m["role"] == "system":
            if any(r["role"] != "system" for r in raw[:i]):
                raise ChatRequestError(f"messages[{i}]: a system message after the conversation started",
                                       f"messages[{i}].role")
            continue
        if m["role"] == "assistant":
            calls = "".join("\n" + format_call(c["name"], c["arguments"]) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] + calls).strip()})
            open_calls = {c["id"] for c in m["tool_calls"]}
        elif m["role"] == "tool":
            if m["tool_call_id"] not in open_calls:
                raise ChatRequestError(f"messages[{i}]: tool_call_id {m['tool_call_id']!r} answers no tool call of "
                                       f"the assistant message before it", f"messages[{i}].tool_call_id")
            open_calls.discard(m["tool_call_id"])
            out.append({"role": "tool", "content": m["content"]})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if not any(m["role"] == "user" for m in out):
        raise ChatRequestError("messages: at least one user message", "messages")
    return out


def reply_message(text: str, call_id: str) -> tuple[dict[str, Any], str]:
    """(the assistant message, finish_reason) of a sampled turn's text: a tool call becomes `tool_calls` (its text
    before the call stays `content`); a turn without a well-formed call is plain content."""
    call = parse(text)
    if isinstance(call, ParseError):
        return {"role": "assistant", "content": text}, "stop"
    before = text[:text.find("<tool_call>")].strip()
    message = {"role": "assistant", "content": before or None,
               "tool_calls": [{"id": call_id, "type": "function",
                               "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}]}
    return message, "tool_calls"


def same_turn(sent: dict[str, Any], received: dict[str, Any]) -> bool:
    """Whether a history's assistant message (normalised) is the turn this endpoint sent: same text (modulo
    surrounding whitespace) and the same calls (ids, names, arguments as JSON values)."""
    want = normalise_message(sent, 0)
    return (received["role"] == "assistant" and received["content"].strip() == want["content"].strip()
            and received["tool_calls"] == want["tool_calls"])


__all__ = ["ChatRequest", "ChatRequestError", "normalise_message", "parse_request", "render_messages",
           "reply_message", "same_turn"]
