"""The locally trained byte-level BPE: fixed special-token ids matching ModelConfig, eos = end of a
chat message, tool-call markers atomic and kept by skip_special_tokens, the chat template's roles,
byte-exact round trips, save/load, and compatibility with the rollout chat renderer."""

from __future__ import annotations

import itertools

import pytest

from k3rl.model.tokenizer import MEDIA_PLACEHOLDER_ID, SPECIAL_TOKENS, TOOL_TOKENS, load_tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def tok():
    from k3rl.envs.corpus import builtin_texts

    return train_tokenizer(itertools.islice(builtin_texts("wiki"), 400), vocab_size=1024)


MESSAGES = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Find the tallest mountain."},
    {"role": "assistant", "content": "Searching.",
     "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"query": "tallest mountain"}}}]},
    {"role": "tool", "content": "Mount Everest, 8849 m"},
    {"role": "assistant", "content": "Mount Everest."},
]


def test_special_ids_and_vocab(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|media_pad|>") == MEDIA_PLACEHOLDER_ID
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert len(tok) <= 1024
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], vocab_size=100)


def test_chat_template_and_tool_tokens(tok):
    text = tok.apply_chat_template(MESSAGES, tokenize=False)
    assert text.startswith("<|im_system|>system<|im_middle|>You are helpful.<|im_end|><|im_user|>user<|im_middle|>")
    assert '<tool_call>\n{"name": "search", "arguments": {"query": "tallest mountain"}}\n</tool_call><|im_end|>' in text
    assert "<|im_tool|>tool<|im_middle|><tool_response>\nMount Everest, 8849 m\n</tool_response><|im_end|>" in text
    prompt = tok.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|>")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for t in TOOL_TOKENS:
        assert tok.convert_tokens_to_ids(t) in ids  # one token each
    kept = tok.decode(ids, skip_special_tokens=True)
    assert "<tool_call>" in kept and "</tool_response>" in kept and "<|im_end|>" not in kept
    masked = tok.apply_chat_template(MESSAGES, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assistant = [i for i, m in zip(masked["input_ids"], masked["assistant_masks"]) if m]
    assert tok.decode(assistant).startswith("Searching.<tool_call>") and tok.decode(assistant).endswith("Mount Everest.<|im_end|>")
    with pytest.raises(Exception, match="chat roles"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def test_byte_level_round_trip_and_save_load(tok, tmp_path):
    s = "Ünïcødé 世界 \t\n emoji 🎉 \x00 <|not special|>"
    assert tok.decode(tok(s)["input_ids"]) == s
    tok.save_pretrained(tmp_path)
    back = load_tokenizer(str(tmp_path))
    assert back(s)["input_ids"] == tok(s)["input_ids"]
    assert back.apply_chat_template(MESSAGES, tokenize=False) == tok.apply_chat_template(MESSAGES, tokenize=False)


def test_rollout_chat_renderer_accepts_it(tok):
    from k3rl.rollout.chat import ChatRenderer

    renderer = ChatRenderer(tok)
    prompt = renderer.prompt_tokens(MESSAGES[:2])
    obs = renderer.observation_tokens("42", turn_ended_with_eos=True)
    text = tok.decode(prompt + [tok.eos_token_id] + obs)
    assert text.count("<tool_response>") == 1 and text.endswith("<|im_assistant|>assistant<|im_middle|>")
