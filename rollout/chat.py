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
"""

from __future__ import annotations

_SENTINEL = "\x00K3RL-SENTINEL\x00"


class ChatRenderer:
    """Renders prompts and tool observations of one tokenizer into token ids."""

    def __init__(self, tokenizer, tool_role: str = "tool"):
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError(f"tokenizer {type(tokenizer).__name__} has no chat_template; rollouts need one")
        self.tokenizer = tokenizer
        self.tool_role = tool_role
        self.eos_token_id = tokenizer.eos_token_id
        from envs.tools import TOOL_RESPONSE_END, TOOL_RESPONSE_START

        self._wrap = (TOOL_RESPONSE_START, TOOL_RESPONSE_END)
        probe = self._template([{"role": "user", "content": "u"}, {"role": tool_role, "content": "OBS"}], False)
        # Templates such as Qwen3's wrap tool messages in <tool_response> themselves; others don't.
        self._template_wraps = TOOL_RESPONSE_START in probe

    def _template(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_tokens(self, messages: list[dict]) -> list[int]:
        """Tokens of the opening messages followed by the assistant generation prompt."""
        if not messages:
            raise ValueError("a prompt needs at least one message")
        return self.encode(self._template(messages, True))

    def observation_tokens(self, observation: str, turn_ended_with_eos: bool) -> list[int]:
        """Tokens that follow a sampled assistant turn: its closing, one tool message, the next
        generation prompt."""
        content = observation if self._template_wraps else f"{self._wrap[0]}\n{observation}\n{self._wrap[1]}"
        return self._after_turn({"role": self.tool_role, "content": content}, turn_ended_with_eos)

    def user_tokens(self, text: str, turn_ended_with_eos: bool) -> list[int]:
        """Like `observation_tokens`, for a plain user message (e.g. a nudge after a turn with no call)."""
        return self._after_turn({"role": "user", "content": text}, turn_ended_with_eos)

    def _after_turn(self, message: dict, turn_ended_with_eos: bool) -> list[int]:
        text = self._template([{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL},
                               message], True)
        delta = text[text.index(_SENTINEL) + len(_SENTINEL):]
        eos = self.tokenizer.eos_token
        if turn_ended_with_eos and eos and delta.startswith(eos):
            delta = delta[len(eos):]
        return self.encode(delta)
