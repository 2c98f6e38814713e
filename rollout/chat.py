"""Chat rendering, token in / token out: each message is rendered through the tokenizer's chat
template once and appended as tokens; the model's own tokens are never re-rendered.

Re-applying a chat template to the whole conversation after every turn (what many RL stacks do)
re-tokenises the model's text: BPE merges across the turn boundary, templates strip `<think>`
blocks or whitespace, and the trained tokens stop being the sampled ones. Here a conversation is
a token list that only grows:

    prompt   = template(system, user, generation prompt)                    (rendered once)
    + sampled tokens of turn 1                                              (as sampled)
    + delta  = what the template puts between an assistant turn's content
               and the next generation prompt, around one tool message      (rendered once)
    + sampled tokens of turn 2 …

The delta is found by rendering a two-message conversation whose assistant content is a
sentinel and taking the text after the sentinel, so it works with any HF chat template (ChatML,
Qwen3, the tiny K3 tokenizer's). If the model ended its turn with the EOS token itself, the
template's own end-of-turn text is not repeated.

Untrusted text never becomes control tokens. Message contents (system and task text, tool
observations, corpus passages, echoed queries) go through `sanitize` before they reach the
template: every occurrence of a special token's string (`<|im_end|>`, `<|im_system|>`, …) gets a
WORD JOINER (U+2060) after its first character, so it is tokenized as ordinary text and reads the
same; only the template's own structure produces special tokens. Tool results are stricter: the
tool protocol's own added tokens (`<tool_call>`, `</tool_response>`, …) are broken the same way, so a
passage cannot close the tool message or forge a call (the system message, written by the
environment, keeps them: it shows the model the call syntax). Text without such strings is
unchanged, token for token.

Images (envs/media.py `ImagePart`, in a message's content beside text parts) render as the K3 layout's media run
(docs/model_spec.md §9, vLLM's `kimi_k3` processor):

    <|media_begin|> "image {W}x{H}" <|media_content|> <|media_pad|> × (H'/p)·(W'/p) <|media_end|>

W×H the image's original size, H'×W' its fitted size, p the model's patch size (`image_patch`); the model writes each
patch's embedding at its `<|media_pad|>` (model/vision.py), so the pixels travel beside the ids, in the order of
their runs (`images_of`). The template sees a per-renderer random marker where each image goes, which no untrusted
text can forge; a tokenizer without these tokens, or a renderer without a patch size, refuses images by name.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from typing import Any

from k3rl.envs.media import ImagePart, num_patches

_SENTINEL = "\x00K3RL-SENTINEL\x00"
WORD_JOINER = "\u2060"


def control_strings(tokenizer, special_only: bool = True) -> list[str]:
    """The strings `tokenizer` matches as one token before BPE, longest first: its special tokens, and
    with `special_only=False` every other added token too (e.g. `<tool_call>`)."""
    strings = set(getattr(tokenizer, "all_special_tokens", []) or [])
    if not special_only:
        for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
            strings.add(getattr(token, "content", str(token)))
    return sorted((s for s in strings if len(s) > 1), key=len, reverse=True)


def control_pattern(tokenizer, special_only: bool = True) -> re.Pattern | None:
    """One regex matching every string of `control_strings(tokenizer, special_only)` (None when there is none)."""
    strings = control_strings(tokenizer, special_only)
    return re.compile("|".join(map(re.escape, strings))) if strings else None


def neutralize(text: str, pattern: re.Pattern | None) -> tuple[str, int]:
    """`text` with every match of `pattern` (a `control_pattern`) broken by a word joiner after its first
    character, so the tokenizer reads it as ordinary text, and the number of matches broken. The one
    sanitiser of untrusted text: chat rendering (`ChatRenderer.sanitize`) and pretraining data use it."""
    if pattern is None or not isinstance(text, str):
        return text, 0
    return pattern.subn(lambda m: m.group(0)[0] + WORD_JOINER + m.group(0)[1:], text)


MEDIA_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")


def images_of(messages: Sequence[dict[str, Any]]) -> list[ImagePart]:
    """The images of `messages` in the order the renderer places their media runs."""
    return [part for m in messages if isinstance(m.get("content"), list) for part in m["content"]
            if isinstance(part, ImagePart)]


class ChatRenderer:
    """Renders prompts and tool observations of one tokenizer into token ids."""

    def __init__(self, tokenizer, tool_role: str = "tool", image_patch: int | None = None):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat_template; rollouts need one")
        self.tokenizer = tokenizer
        self.tool_role = tool_role
        self.image_patch = image_patch
        """The model's patch size in pixels (model config `image_patch_size`), or None: no images."""
        self._mark = f"\x00k3rl-image-{uuid.uuid4().hex}\x00"
        self.eos_token_id = tokenizer.eos_token_id
        from k3rl.envs.tools import TOOL_RESPONSE_END, TOOL_RESPONSE_START

        self._wrap = (TOOL_RESPONSE_START, TOOL_RESPONSE_END)
        self._specials = control_pattern(tokenizer)
        self._added = control_pattern(tokenizer, special_only=False)
        probe = self._template([{"role": "user", "content": "u"}, {"role": tool_role, "content": "OBS"}], False)
        # Templates such as Qwen3's wrap tool messages in <tool_response> themselves; others don't.
        self._template_wraps = TOOL_RESPONSE_START in probe

    def _template(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def sanitize(self, text: str, tool_result: bool = False) -> str:
        """`text` with every special token's string (and, for a `tool_result`, every added token's) broken
        by a word joiner (see module docstring)."""
        return neutralize(text, self._added if tool_result else self._specials)[0]

    def encode(self, text: str, images: Sequence[ImagePart] = ()) -> list[int]:
        """Tokens of already-rendered text (template output), control strings active; each image marker becomes
        the media run of the next of `images`."""
        pieces = text.split(self._mark)
        if len(pieces) - 1 != len(images):
            raise ValueError(f"{len(pieces) - 1} image markers in the rendered text for {len(images)} images")
        ids = self.tokenizer(pieces[0], add_special_tokens=False)["input_ids"]
        for image, piece in zip(images, pieces[1:]):
            ids = ids + self.media_tokens(image) + self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        return ids

    def media_tokens(self, image: ImagePart) -> list[int]:
        """One image's media run (module docstring)."""
        if self.image_patch is None:
            raise ValueError("an image in a message, but this renderer has no image_patch (the model reads no images)")
        begin, content, pad, end = self._media_ids()
        header = self.tokenizer(f"image {image.size[0]}x{image.size[1]}", add_special_tokens=False)["input_ids"]
        return [begin, *header, content, *[pad] * num_patches(image.pixels, self.image_patch), end]

    def _media_ids(self) -> list[int]:
        ids = self.tokenizer.convert_tokens_to_ids(list(MEDIA_TOKENS))
        unk = getattr(self.tokenizer, "unk_token_id", None)
        missing = [t for t, i in zip(MEDIA_TOKENS, ids) if i is None or (unk is not None and i == unk)]
        if missing:
            raise ValueError(f"tokenizer {type(self.tokenizer).__name__} has no media tokens {missing}: it cannot "
                             "show images")
        return ids

    def _with_marks(self, content: list, tool_result: bool = False) -> str:
        """Content parts as template text: text sanitized, each image as this renderer's marker."""
        return "".join(self._mark if isinstance(p, ImagePart) else self.sanitize(p, tool_result) for p in content)

    def encode_text(self, text: str, tool_result: bool = False) -> list[int]:
        """Tokens of untrusted text (an assistant turn written by a teacher; a tool result when counting
        its tokens): never a special token (nor, for a `tool_result`, an added one)."""
        return self.encode(self.sanitize(text, tool_result))

    def _clean(self, message: dict) -> dict:
        content = message.get("content")
        if isinstance(content, list) and any(isinstance(p, ImagePart) for p in content):
            content = self._with_marks(content)
        elif isinstance(content, list):  # multimodal parts: sanitize the text parts
            content = [{**part, "text": self.sanitize(part["text"])} if isinstance(part, dict) and "text" in part
                       else part for part in content]
        else:
            content = self.sanitize(content)
        return {**message, "content": content}

    def prompt_tokens(self, messages: list[dict]) -> list[int]:
        """Tokens of the opening messages followed by the assistant generation prompt."""
        if not messages:
            raise ValueError("a prompt needs at least one message")
        return self.encode(self._template([self._clean(m) for m in messages], True), images_of(messages))

    def observation_tokens(self, observation: str | list, turn_ended_with_eos: bool) -> list[int]:
        """Tokens that follow a sampled assistant turn: its closing, one tool message (text, or content parts
        with images), the next generation prompt."""
        return self.continuation_tokens([{"role": self.tool_role, "content": observation}], turn_ended_with_eos)

    def user_tokens(self, text: str, turn_ended_with_eos: bool) -> list[int]:
        """Like `observation_tokens`, for a plain user message (e.g. a nudge after a turn with no call)."""
        return self.continuation_tokens([{"role": "user", "content": text}], turn_ended_with_eos)

    def _tool_message(self, message: dict) -> dict:
        """A tool message as the model reads it: untrusted text sanitized as a tool result, wrapped in
        <tool_response> unless the template wraps it itself."""
        content = message["content"]
        text = self._with_marks(content, True) if isinstance(content, list) else self.sanitize(content, True)
        content = text if self._template_wraps else f"{self._wrap[0]}\n{text}\n{self._wrap[1]}"
        return {"role": self.tool_role, "content": content}

    def _prepared(self, message: dict) -> dict:
        return self._tool_message(message) if message["role"] in ("tool", self.tool_role) else self._clean(message)

    def conversation_tokens(self, messages: list[dict]) -> list[int]:
        """Tokens of a whole conversation (system, user, assistant turns as text, tool results) followed by the
        assistant generation prompt: what an OpenAI-style client's history renders to (rollout/chat_api.py).
        Assistant turns are rendered from their text here, so their tokens need not be the ones once sampled."""
        if not messages:
            raise ValueError("a prompt needs at least one message")
        return self.encode(self._template([self._prepared(m) for m in messages], True), images_of(messages))

    def continuation_tokens(self, messages: list[dict], turn_ended_with_eos: bool) -> list[int]:
        """Tokens that follow a sampled assistant turn: its closing, `messages` (tool results and user
        messages, rendered as `conversation_tokens` renders them), the next generation prompt."""
        text = self._template([{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL},
                               *(self._prepared(m) for m in messages)], True)
        delta = text[text.index(_SENTINEL) + len(_SENTINEL):]
        eos = self.tokenizer.eos_token
        if turn_ended_with_eos and eos and delta.startswith(eos):
            delta = delta[len(eos):]
        return self.encode(delta, images_of(messages))


def render_transcript(renderer: ChatRenderer, messages: Sequence[dict[str, Any]]) -> tuple[list[int], list[int], list[int]]:
    """A finished transcript (e.g. an oracle's episode) as the agent loop would have tokenised it.

    Returns (input_ids [N], assistant_masks [N] with 1 on the model's own tokens, the token
    count of each assistant turn). Messages after the last assistant turn (the terminal tool's
    result) are not part of a rollout and are left out.
    """
    from k3rl.envs.tools import STOP_SEQUENCES

    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        raise ValueError("a demonstration needs at least one assistant turn")
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = renderer.prompt_tokens([dict(m) for m in messages[:first]])
    mask = [0] * len(ids)
    turns: list[int] = []
    ended_with_eos = False
    for m in messages[first:last + 1]:
        if m["role"] == "assistant":
            text = m["content"]
            stop = next((s for s in STOP_SEQUENCES if s in text), None)
            if stop is not None and not text.endswith(stop):
                raise ValueError(f"an assistant turn continues after {stop!r}; a rollout would have stopped there")
            part = renderer.encode_text(text)
            # The engine stops at a stop string; any other turn ends with the EOS the model samples.
            ended_with_eos = stop is None
            if ended_with_eos:
                part = part + [renderer.eos_token_id]
            turns.append(len(part))
            ids += part
            mask += [1] * len(part)
        elif m["role"] == "tool":
            part = renderer.observation_tokens(m["content"], ended_with_eos)
            ids += part
            mask += [0] * len(part)
        else:
            raise ValueError(f"unexpected {m['role']!r} message after the first assistant turn")
    return ids, mask, turns
