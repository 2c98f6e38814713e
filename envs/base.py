"""The environment API: one user class, plus the episode machinery that drives it.

A user writes a subclass of ``Env``:

- ``reset(task) -> prompt`` (a string, or chat messages) starts an episode;
- methods marked ``@tool`` are the tools (schema from type hints and docstring);
- a terminal tool (``@tool(terminal=True)``, by convention ``answer``) ends the
  episode; the reward is ``reward()`` if the class defines it, else the number the
  terminal tool returned, else 0.

``Episode`` holds everything the framework owns for one episode (messages, budgets,
counters), so the user's ``self`` namespace stays free. ``Episode.step(text)`` takes
the assistant's text, parses and runs its tool call, and returns the observation; the
token-level agent loop in ``rollout/`` calls exactly this, ``run_episode`` is the
string-level driver used by tests, oracles and evaluation.

Budgets (turns, tool calls, observation tokens, seconds per tool call, image patches) end an
episode with a named truncation reason; the environment never sees tokens except through the
optional ``count_tokens`` callable used for the observation budget.

Images: ``reset`` and tools may return an image or a list of text and images (envs/media.py).
An episode whose model reads images (``image_patch``, the model's patch size) checks each one,
fits it to whole patches and keeps it in the message's content as an ``ImagePart``; a bad image,
or any image for a model without image input, becomes a named ``Error:`` observation.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from k3rl.envs import media
from k3rl.envs import tools as T
from k3rl.envs.tool_exec import execute

Message = dict[str, Any]
TextPolicy = Callable[[list[Message]], str]
"""What plays an episode at the string level (`run_episode`, oracles, teachers): the conversation so far → the
assistant's next text. Not model/policy.py's `Policy`, which is a loaded model."""

FINISH_ANSWERED = "answered"
FINISH_NO_CALL = "no_tool_call"
# Truncations raised by the budget; ``Episode.truncate`` may add others (e.g. a context limit).
TRUNCATIONS = ("max_turns", "max_tool_calls", "max_observation_tokens", "max_image_patches")


def approx_token_count(text: str) -> int:
    """A tokenizer-free estimate (UTF-8 bytes / 4), used when no tokenizer is given."""
    return (len(text.encode("utf-8")) + 3) // 4


def as_token_counter(tokenizer: Any | None) -> Callable[[str], int]:
    """Turn a tokenizer-like object into ``count(text) -> int``.

    Accepts ``None`` (the byte estimate), a callable returning a count or a list of ids,
    an object with ``encode(str) -> list[int]`` (HF tokenizers are asked for no special
    tokens), or an ``encode`` that returns an object with ``.ids`` (``tokenizers.Tokenizer``).
    """
    if tokenizer is None:
        return approx_token_count
    if hasattr(tokenizer, "no_truncation") and (tokenizer.truncation or tokenizer.padding):
        # A tokenizers.Tokenizer saved with truncation or padding would cap or pad every
        # count; count with a copy that has neither.
        tokenizer = type(tokenizer).from_str(tokenizer.to_str())
        tokenizer.no_truncation()
        tokenizer.no_padding()
    encode = getattr(tokenizer, "encode", None)
    if encode is None:
        if not callable(tokenizer):
            raise TypeError("tokenizer must have encode(str) -> list[int] or be a callable counting tokens")

        def count_call(text: str) -> int:
            n = tokenizer(text)
            return n if isinstance(n, int) else len(n)

        return count_call

    def count(text: str) -> int:
        try:
            ids = encode(text, add_special_tokens=False)
        except TypeError:
            ids = encode(text)
        ids = getattr(ids, "ids", ids)
        return len(ids)

    return count


@dataclass(frozen=True)
class Budget:
    """Per-episode limits. ``None`` switches a limit off."""

    max_turns: int | None = 16
    """Assistant turns; the episode is truncated after this many."""
    max_tool_calls: int | None = 32
    """Non-terminal tool calls executed; a terminal call is always allowed."""
    max_observation_tokens: int | None = 65536
    """Tokens of tool output over the episode (counted with ``count_tokens``)."""
    max_observation_chars: int | None = 20000
    """One observation longer than this is clipped, with a note saying so."""
    tool_timeout_s: float | None = 30.0
    """Wall time for one tool call; a slower call returns a timeout error observation."""
    max_image_pixels: int | None = 1 << 22
    """Pixels of one image before fitting (4M); a larger one is the error observation ``too_many_pixels``."""
    max_images_per_turn: int | None = 8
    """Images of one observation; the rest are left out with a note (error kind ``max_images_per_turn``)."""
    max_image_patches: int | None = 16384
    """Image patches over the episode; the image that would pass it is left out and the episode is truncated."""


class Env:
    """Base class of environments: override ``reset`` and add ``@tool`` methods."""

    system_prompt: ClassVar[str] = ""
    """Text placed before the tool list in the system message."""
    tool_prompt: str = "json"
    """How the system message lists the tools: ``json`` schemas or ``compact`` signatures
    (``envs.tools.render_tools_prompt``); an instance may set its own."""
    budget: ClassVar[Budget] = Budget()
    """Default budget; ``Episode`` and ``run_episode`` accept an override."""
    success_metric: ClassVar[str | None] = None
    """The ``metrics()`` component whose value ≥ 1 marks a solved episode (e.g. ``"em"``); None: the
    reward ≥ 1. Evaluation (rl/eval/evaluate.py) and the trainer's success rate follow it."""
    _tool_specs: ClassVar[dict[str, T.ToolSpec]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # The most derived definition of an attribute decides: redefining a tool
        # without @tool removes it from the environment.
        by_attr: dict[str, T.ToolSpec] = {}
        for klass in reversed(cls.__mro__):
            for attr, value in vars(klass).items():
                spec = getattr(value, "__k3rl_tool__", None)
                if spec is not None:
                    by_attr[attr] = spec
                else:
                    by_attr.pop(attr, None)
        specs = {s.name: s for s in by_attr.values()}
        if len(specs) != len(by_attr):
            raise TypeError(f"{cls.__name__}: two tools share a name")
        cls._tool_specs = specs

    @classmethod
    def tool_specs(cls) -> dict[str, T.ToolSpec]:
        """The tools of this environment by name, in definition order."""
        return dict(cls._tool_specs)

    @classmethod
    def tool_schemas(cls) -> list[dict[str, Any]]:
        """The tools as OpenAI function-calling schemas."""
        return [s.schema() for s in cls._tool_specs.values()]

    def system_message(self) -> str:
        """The system text for one episode: ``system_prompt`` plus the tools and call syntax."""
        return T.render_tools_prompt(self._tool_specs, self.system_prompt, self.tool_prompt)

    def reset(self, task: Any) -> str | list[Message]:
        """Start an episode for ``task`` and return the user prompt (or chat messages)."""
        raise NotImplementedError(f"{type(self).__name__} must define reset(task)")

    def reward(self) -> float:
        """The episode's reward; called once when the episode ends."""
        raise NotImplementedError

    def metrics(self) -> dict[str, Any]:
        """Extra per-episode numbers for logs and evaluation (EM, F1, recall …)."""
        return {}

    def tasks(self, n: int, seed: int = 0) -> list[Any]:
        """``n`` tasks for this environment, deterministic in ``seed`` (optional)."""
        raise NotImplementedError(f"{type(self).__name__} does not generate tasks")

    def oracle(self, task: Any) -> TextPolicy:
        """A policy that solves ``task`` through the tool protocol (optional)."""
        raise NotImplementedError(f"{type(self).__name__} has no oracle")


def _defines_reward(env: Env) -> bool:
    return type(env).reward is not Env.reward


@dataclass
class Step:
    """What one assistant turn produced."""

    call: T.ToolCall | T.ParseError
    observation: str | None
    """Raw tool output (not wrapped); ``None`` when the turn ended the episode without a call."""
    ok: bool
    done: bool
    finish_reason: str | None


@dataclass
class EpisodeResult:
    """A finished episode: the transcript, the reward and its info."""

    messages: list[Message]
    reward: float
    info: dict[str, Any]


class Episode:
    """One episode of ``env`` on ``task``: messages, budgets and counters."""

    def __init__(self, env: Env, task: Any, budget: Budget | None = None, count_tokens: Callable[[str], int] | None = None,
                 image_patch: int | None = None):
        self.env = env
        self.image_patch = image_patch
        """The model's patch size in pixels, or None: the model reads no images (envs/media.py)."""
        self.image_patches = 0
        self.task = task
        self.budget = budget or env.budget
        self.count_tokens = count_tokens or approx_token_count
        self.turns = 0
        self.tool_calls = 0
        self.calls_by_name: dict[str, int] = {}
        self.errors_by_kind: dict[str, int] = {}
        self.observation_tokens = 0
        self.tool_seconds = 0.0
        self.finish_reason: str | None = None
        self.terminal_value: Any = None
        self._reward: float | None = None
        self._metrics: dict[str, Any] | None = None
        prompt = env.reset(task)
        system = env.system_message()
        if isinstance(prompt, str) or media.content_parts(prompt) is not None:
            self.messages: list[Message] = [{"role": "system", "content": system},
                                            {"role": "user", "content": self._prompt_content(prompt)}]
        else:
            msgs = [{**m, "content": self._prompt_content(m.get("content"))} for m in prompt]
            if msgs and msgs[0].get("role") == "system":
                msgs[0]["content"] = system + "\n\n" + msgs[0]["content"]
            else:
                msgs.insert(0, {"role": "system", "content": system})
            self.messages = msgs

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def truncated(self) -> bool:
        """Ended by a limit (any finish other than an answer or a turn without a call)."""
        return self.finish_reason not in (None, FINISH_ANSWERED, FINISH_NO_CALL)

    def truncate(self, reason: str) -> None:
        """End the episode from outside with a truncation reason (e.g. the agent loop's context limit)."""
        if reason in (FINISH_ANSWERED, FINISH_NO_CALL):
            raise ValueError(f"{reason!r} is not a truncation reason")
        if not self.done:
            self._finish(reason)

    def step(self, text: str) -> Step:
        """Take one assistant turn: parse its call, run it, append the observation."""
        if self.done:
            raise RuntimeError(f"episode already finished ({self.finish_reason})")
        self.turns += 1
        self.messages.append({"role": "assistant", "content": text})
        call = T.parse(text)
        if isinstance(call, T.ParseError) and call.kind == "no_call":
            self._finish(FINISH_NO_CALL)
            return Step(call, None, True, True, self.finish_reason)
        specs = self.env._tool_specs
        spec = specs.get(call.name) if isinstance(call, T.ToolCall) else None
        terminal = spec is not None and spec.terminal
        b = self.budget
        if not terminal and b.max_tool_calls is not None and self.tool_calls >= b.max_tool_calls:
            obs = T.Observation(f"Error: tool-call budget of {b.max_tool_calls} calls is spent.", False, "budget")
            self._finish("max_tool_calls")
            return self._observe(call, obs)
        started = time.perf_counter()
        obs = execute(specs, self.env, call, b.tool_timeout_s)
        self.tool_seconds += time.perf_counter() - started
        if isinstance(call, T.ToolCall):
            self.calls_by_name[call.name] = self.calls_by_name.get(call.name, 0) + 1
            if not terminal:
                self.tool_calls += 1
        if terminal and obs.ok:
            self.terminal_value = obs.value
            self._finish(FINISH_ANSWERED)
        elif b.max_turns is not None and self.turns >= b.max_turns:
            self._finish("max_turns")
        return self._observe(call, obs)

    def _prompt_content(self, content: Any) -> Any:
        """A prompt's content with its images checked and fitted; a bad one raises `ImageError` (a task the
        environment built wrong, not something the model did)."""
        parts = media.content_parts(content)
        if parts is None:
            return content
        out, note = self._media_parts(parts)
        if note is not None:
            raise media.ImageError(note[0], f"{type(self.env).__name__}.reset: {note[1]}")
        return out

    def _media_parts(self, parts: list[Any]) -> tuple[list[Any], tuple[str, str] | None]:
        """Content parts with every image checked, fitted and counted against the image budgets → (parts,
        (kind, message) of the first problem or None). A bad image makes the whole observation an error; images
        over the per-turn limit are left out; an image over the episode's patch budget ends the episode."""
        b = self.budget
        if self.image_patch is None:
            return [], ("no_image_input", "the model reads no images, and this result holds one")
        out: list[Any] = []
        shown = added = 0
        for i, part in enumerate(parts):
            if not media.is_image(part):
                out.append(part if isinstance(part, str) else T.result_text(part))
                continue
            try:
                checked = media.check_image(part, b.max_image_pixels)
            except media.ImageError as exc:
                return [], (exc.kind, f"image {i + 1} of the result: {exc}")
            if b.max_images_per_turn is not None and shown >= b.max_images_per_turn:
                left = sum(1 for p in parts[i:] if media.is_image(p))
                out.append(f"\n[{left} more images not shown: at most {b.max_images_per_turn} per result]")
                self.errors_by_kind["max_images_per_turn"] = self.errors_by_kind.get("max_images_per_turn", 0) + 1
                break
            fitted = media.fit_to_patches(checked, self.image_patch)
            n = media.num_patches(fitted, self.image_patch)
            if b.max_image_patches is not None and self.image_patches + added + n > b.max_image_patches:
                out.append(f"\n[image budget of {b.max_image_patches} patches reached; the rest is not shown]")
                self._finish("max_image_patches")
                break
            added += n
            shown += 1
            out.append(media.ImagePart(fitted, (checked.shape[1], checked.shape[0])))
        self.image_patches += added  # counted once the whole result is shown
        return out, None

    def _observe(self, call: T.ToolCall | T.ParseError, obs: T.Observation) -> Step:
        parts = media.content_parts(obs.value) if obs.ok else None
        if parts is not None:
            parts, problem = self._media_parts(parts)
            if problem is not None:
                obs = T.Observation(f"Error: {problem[1]}.", False, problem[0])
            elif any(isinstance(p, media.ImagePart) for p in parts):
                return self._observe_media(call, parts)
            else:
                obs = T.Observation("".join(parts), True, None, obs.value)
        text = obs.text
        b = self.budget
        if not obs.ok:
            self.errors_by_kind[obs.error or "error"] = self.errors_by_kind.get(obs.error or "error", 0) + 1
        if b.max_observation_chars is not None and len(text) > b.max_observation_chars:
            cut = len(text) - b.max_observation_chars
            text = text[: b.max_observation_chars] + f"\n[… {cut} more characters not shown]"
        n = self.count_tokens(text)
        if b.max_observation_tokens is not None and self.observation_tokens + n > b.max_observation_tokens:
            left = max(0, b.max_observation_tokens - self.observation_tokens)
            text = _clip_to_tokens(text, left, self.count_tokens)
            n = self.count_tokens(text)
            if not self.done:
                self._finish("max_observation_tokens")
        self.observation_tokens += n
        name = call.name if isinstance(call, T.ToolCall) else None
        self.messages.append({"role": "tool", "name": name, "content": text})
        return Step(call, text, obs.ok, self.done, self.finish_reason)

    def _observe_media(self, call: T.ToolCall | T.ParseError, parts: list[Any]) -> Step:
        """A result with images: its text parts count against the observation tokens (not clipped here: they
        sit between images), its images were counted by `_media_parts`."""
        b = self.budget
        n = sum(self.count_tokens(p) for p in parts if isinstance(p, str))
        if b.max_observation_tokens is not None and self.observation_tokens + n > b.max_observation_tokens:
            parts = [p for p in parts if not isinstance(p, str)]
            n = 0
            if not self.done:
                self._finish("max_observation_tokens")
        self.observation_tokens += n
        name = call.name if isinstance(call, T.ToolCall) else None
        self.messages.append({"role": "tool", "name": name, "content": parts})
        return Step(call, media.message_text(parts), True, self.done, self.finish_reason)

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason

    @property
    def reward(self) -> float:
        """The episode's reward (computed once, when first asked after the end)."""
        if not self.done:
            raise RuntimeError("the episode is still running")
        if self._reward is None:
            if _defines_reward(self.env):
                self._reward = float(self.env.reward())
            elif isinstance(self.terminal_value, (int, float)) and not isinstance(self.terminal_value, bool):
                self._reward = float(self.terminal_value)
            else:
                self._reward = 0.0
        return self._reward

    @property
    def info(self) -> dict[str, Any]:
        """Counters, finish reason and the environment's metrics."""
        if self._metrics is None and self.done:
            self._metrics = dict(self.env.metrics())
        return {
            "finish_reason": self.finish_reason,
            "truncated": self.truncated,
            "turns": self.turns,
            "tool_calls": self.tool_calls,
            "calls_by_name": dict(self.calls_by_name),
            "errors_by_kind": dict(self.errors_by_kind),
            "observation_tokens": self.observation_tokens,
            "image_patches": self.image_patches,
            "tool_seconds": self.tool_seconds,
            **(self._metrics or {}),
        }

    def result(self) -> EpisodeResult:
        return EpisodeResult(list(self.messages), self.reward, self.info)


def _clip_to_tokens(text: str, tokens: int, count: Callable[[str], int]) -> str:
    """The longest prefix of ``text`` that, with a note saying so, fits in ``tokens``."""
    note = "\n[observation budget reached; output clipped]"
    if count(note) > tokens:
        return ""
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(text[:mid] + note) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo] + note


def run_episode(
    env: Env,
    task: Any,
    policy: TextPolicy,
    budget: Budget | None = None,
    count_tokens: Callable[[str], int] | None = None,
    image_patch: int | None = None,
) -> EpisodeResult:
    """Run ``policy`` (messages so far -> next assistant text) on ``task`` for one episode (``image_patch``: the
    patch size of a model that reads images)."""
    episode = Episode(env, task, budget, count_tokens, image_patch)
    while not episode.done:
        episode.step(policy([dict(m) for m in episode.messages]))
    return episode.result()


def with_budget(budget: Budget, **changes: Any) -> Budget:
    """A copy of ``budget`` with some limits changed."""
    return replace(budget, **changes)


def last_observation(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """The newest tool output in a conversation, or ``None`` if there is none yet."""
    for m in reversed(messages):
        if m["role"] == "tool":
            return m["content"]
        if m["role"] == "user":
            return None
    return None


def user_prompt(messages: Sequence[Mapping[str, Any]]) -> str:
    """The first user message of a conversation (what ``reset`` returned)."""
    return next(m["content"] for m in messages if m["role"] == "user")
