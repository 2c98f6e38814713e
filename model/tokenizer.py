"""A small byte-level BPE tokenizer for the tiny/small K3 models, trained locally with `tokenizers`.

`train_tokenizer(texts, vocab_size)` learns merges from any iterable of strings and returns a
transformers `PreTrainedTokenizerFast` with:
  * fixed ids for the special tokens (`SPECIAL_TOKENS` order): pad 0, bos 1, eos 2 — the
    defaults of `ModelConfig` — and `<|media_pad|>` (the image placeholder) at
    `MEDIA_PLACEHOLDER_ID`;
  * eos = `<|im_end|>`, the end of every chat message, so a sampled assistant turn stops on it;
  * the tool-call markers `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>`
    as atomic, *non-special* added tokens (like Qwen's): they survive
    `decode(skip_special_tokens=True)`, so the tool-call parser (envs/tools.py) still sees them;
  * a chat template in Kimi's message framing
    (`<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>`) for system/user/assistant/tool
    roles; tool messages are wrapped in `<tool_response>…</tool_response>`, OpenAI-style
    `tool_calls` on assistant messages are written in the envs/tools.py text protocol, and
    assistant turns sit in `{% generation %}` blocks so TRL's assistant-only loss can mask them.
Byte-level means every string round-trips (`decode(encode(s)) == s`), whatever the corpus.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

SPECIAL_TOKENS = [
    "<|pad|>", "<|bos|>", "<|im_end|>",
    "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_tool|>", "<|im_middle|>",
    "<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>",
]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
MEDIA_PLACEHOLDER = "<|media_pad|>"
MEDIA_PLACEHOLDER_ID = SPECIAL_TOKENS.index(MEDIA_PLACEHOLDER)
MIN_VOCAB = len(SPECIAL_TOKENS) + len(TOOL_TOKENS) + 256

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{% endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = message['role'] -%}"
    "{%- if role not in ['system', 'user', 'assistant', 'tool'] -%}"
    "{{ raise_exception('chat roles are system, user, assistant and tool; got ' ~ role) }}"
    "{%- endif -%}"
    "<|im_{{ role }}|>{{ role }}<|im_middle|>"
    "{%- if role == 'assistant' -%}"
    "{% generation %}{{ message['content'] or '' }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] if 'function' in call else call -%}"
    "<tool_call>\n{{ {'name': fn['name'], 'arguments': fn['arguments']} | tojson }}\n</tool_call>"
    "{%- endfor -%}"
    "<|im_end|>{% endgeneration %}"
    "{%- elif role == 'tool' -%}"
    "<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>"
    "{%- else -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
                    model_max_length: int = 8192) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of at most `vocab_size` entries (the model's vocab_size) on `texts`."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size: a byte-level BPE with the chat tokens needs ≥ {MIN_VOCAB}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS), min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|im_end|>",
        additional_special_tokens=SPECIAL_TOKENS[3:], model_max_length=model_max_length)
    wrapped.chat_template = CHAT_TEMPLATE
    for i, name in enumerate(SPECIAL_TOKENS):
        assert wrapped.convert_tokens_to_ids(name) == i, f"special token {name} did not get id {i}"
    if len(wrapped) > vocab_size:
        raise ValueError(f"vocab_size: the trained tokenizer has {len(wrapped)} entries > {vocab_size}")
    return wrapped


def load_tokenizer(path: str | Path, trust_remote_code: bool = False, **kwargs) -> PreTrainedTokenizerFast:
    """The tokenizer of a model directory (k3rl's, a released one, or a hub id with `local_files_only`).

    Every k3rl reader goes through here. A tokenizer that is itself remote code (the released Kimi tokenizer:
    `auto_map` in tokenizer_config.json) is imported only when `trust_remote_code` (the job's
    `run.trust_remote_code`); otherwise model/formats/trust.py's `RemoteCodeError` names the file. A kimi_k3 directory's
    config.json names k3rl's remote model code, which a tokenizer never needs: `kimi_k3_config_registered`
    keeps transformers from asking about it. A directory with a `COMPLETE` manifest is verified first
    (model/formats/integrity.py; hashed once per process)."""
    from k3rl.model.formats.config_json import kimi_k3_config_registered
    from k3rl.model.formats.integrity import verify_model_dir
    from k3rl.model.formats.trust import check_remote_code

    verify_model_dir(path)
    trust = check_remote_code(path, trust_remote_code, model=False) if Path(path).is_dir() else trust_remote_code
    with kimi_k3_config_registered():
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust, **kwargs)
