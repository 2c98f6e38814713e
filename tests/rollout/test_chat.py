"""Token-in/token-out chat rendering: appending per-message tokens reproduces the template."""

import pytest

from k3rl.envs.tools import TOOL_RESPONSE_END, TOOL_RESPONSE_START
from k3rl.rollout.chat import ChatRenderer


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3_dir)


MESSAGES = [{"role": "system", "content": "You answer with tools."}, {"role": "user", "content": "Where is JSON parsed?"}]
TURN = 'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"query": "json"}}\n</tool_call>'


@pytest.mark.parametrize("ended_with_eos", [False, True])
def test_appended_tokens_equal_template_of_whole_conversation(tokenizer, ended_with_eos):
    r = ChatRenderer(tokenizer)
    sampled = r.encode(TURN) + ([tokenizer.eos_token_id] if ended_with_eos else [])
    tokens = r.prompt_tokens(MESSAGES) + sampled + r.observation_tokens("json module: parse", ended_with_eos)
    wrapped = f"{TOOL_RESPONSE_START}\njson module: parse\n{TOOL_RESPONSE_END}"
    full = tokenizer.apply_chat_template(
        MESSAGES + [{"role": "assistant", "content": TURN}, {"role": "tool", "content": wrapped}],
        tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(tokens) == full
    # the model's own tokens sit untouched inside the sequence
    start = len(r.prompt_tokens(MESSAGES))
    assert tokens[start:start + len(sampled)] == sampled


def test_user_nudge_and_errors(tokenizer):
    r = ChatRenderer(tokenizer)
    nudge = tokenizer.decode(r.user_tokens("Please call a tool.", turn_ended_with_eos=True))
    assert nudge == "\n<|im_start|>user\nPlease call a tool.<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="at least one message"):
        r.prompt_tokens([])

    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="chat_template"):
        ChatRenderer(NoTemplate())
