"""A tiny Hugging Face Qwen3 and a tokenizer trained on the spot, for vLLM on machines with no hub.

vLLM's CPU backend runs standard HF architectures (not our K3, whose vLLM kernels need CUDA), so
the vLLM rollout path is tested and benchmarked on a Qwen3 small enough to build in a second.
Nothing is downloaded: the byte-level BPE tokenizer is trained with `tokenizers` on English text
that ships with Python (the standard library's docstrings) unless texts are given, and the
weights are random. head_dim is 32 because vLLM's CPU attention accepts only some head sizes;
embeddings are untied so a weight update must carry `lm_head.weight` (the case that breaks
silently when it is forgotten).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as Qwen models use it: one block per message, then the assistant header to generate from.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_DOC_MODULES = ("argparse", "collections", "functools", "itertools", "json", "logging", "pathlib",
                "re", "string", "textwrap", "typing", "unittest", "dataclasses", "inspect", "pydoc")


def stdlib_texts() -> list[str]:
    """Docstrings of a fixed set of standard-library modules and their public members."""
    texts = []
    for name in _DOC_MODULES:
        mod = importlib.import_module(name)
        texts.append(mod.__doc__ or "")
        for attr in sorted(dir(mod)):
            doc = getattr(getattr(mod, attr, None), "__doc__", None)
            if not attr.startswith("_") and isinstance(doc, str):
                texts.append(doc)
    return [t for t in texts if t.strip()]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 1024):
    """Byte-level BPE with ChatML special tokens, as a transformers `PreTrainedTokenizerFast`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


def build_tiny_qwen3(out_dir: str | Path, seed: int = 0, vocab_size: int = 1024, hidden_size: int = 64,
                     num_layers: int = 2, texts: Iterable[str] | None = None, num_heads: int = 2,
                     intermediate_size: int | None = None, max_position_embeddings: int = 8192) -> Path:
    """Write a random tiny Qwen3 (head_dim 32, one KV head, untied; MLP 2 × hidden unless given) and its tokenizer
    to `out_dir`; return it."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = Path(out_dir)
    tokenizer = train_tokenizer(stdlib_texts() if texts is None else texts, vocab_size)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=False, torch_dtype="float32",
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    # Random init at std 0.02 gives near-uniform next-token distributions; a wider output layer makes
    # sampled logprobs spread out, which makes logprob comparisons meaningful.
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
