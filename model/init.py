"""`init_model`: a randomly initialised K3 (and, for small vocabularies, its tokenizer) as a Hugging Face directory.

The directory is in the released layout the config chooses (model/formats/layouts.py `layout_for`: `kimi_k3` with
images on, else `kimi_linear`), readable by vLLM and by transformers with `trust_remote_code=True`.

What `k3rl init` (rl/commands/model_tools.py) and the SFT, quickstart and pretraining drivers call. The directory
is written to a temporary sibling and renamed (util/atomic.py `atomic_dir`), so a crash never leaves half a
directory. The tokenizer is a
byte-level BPE trained on texts the command passes in (envs/registry.py `tokenizer_texts`: the built-in wiki
text and the environments' tool protocol; `model/` knows no environment), for vocabularies up to
`TOKENIZER_MAX_VOCAB`; it is trained before the weights are drawn, and the weights come from
`torch.manual_seed(seed)`, so a seed gives the same model every time.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOKENIZER_MAX_VOCAB = 65536


@dataclass
class InitResult:
    path: Path
    parameters: int
    tokenizer_size: int | None

    def line(self) -> str:
        tok = f", tokenizer of {self.tokenizer_size} tokens" if self.tokenizer_size else ""
        return f"wrote {self.path}: {self.parameters:,} parameters{tok}"


def fits_in_memory(config: Any, fraction: float = 0.8) -> tuple[bool, float, float]:
    """Whether the fp32 weights of `config` take at most `fraction` of this machine's memory; (ok, GiB needed, GiB there)."""
    from k3rl.model.params import count_parameters

    need = count_parameters(config)["total"] * 4
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return need <= fraction * have, need / 2**30, have / 2**30


def init_model(config: Any, out_dir: str | Path, seed: int = 0,
               tokenizer_texts: Iterable[str] | None = None) -> InitResult:
    """Write a random `K3ForCausalLM` of `config` (a K3Config) to `out_dir`, with a tokenizer trained on
    `tokenizer_texts` (envs/registry.py `tokenizer_texts()`) when given and the vocabulary is at most
    `TOKENIZER_MAX_VOCAB`.

    Raises ValueError if `out_dir` exists and is not empty, or the weights do not fit in memory."""
    import torch

    from k3rl.model.formats.save import save_model
    from k3rl.model.modeling import K3ForCausalLM
    from k3rl.util.atomic import atomic_dir

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} exists and is not empty")
    ok, need, have = fits_in_memory(config)
    if not ok:
        raise ValueError(f"{need:.1f} GiB of fp32 weights do not fit in {have:.1f} GiB of memory")
    small = config.vocab_size <= TOKENIZER_MAX_VOCAB
    tok = train_builtin_tokenizer(config, tokenizer_texts) if tokenizer_texts is not None and small else None
    torch.manual_seed(seed)
    model = K3ForCausalLM(config)
    with atomic_dir(out_dir) as tmp:
        save_model(model, tmp, tokenizer_from=tok)
    return InitResult(out_dir, sum(p.numel() for p in model.parameters()), len(tok) if tok is not None else None)


def train_builtin_tokenizer(config: Any, texts: Iterable[str]):
    """The built-in byte-level BPE tokenizer for `config` (its special-token ids must be the built-in ones),
    trained on `texts` (envs/registry.py `tokenizer_texts()`)."""
    from k3rl.model.tokenizer import MEDIA_PLACEHOLDER_ID, train_tokenizer

    expected = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    for name, value in expected.items():
        if getattr(config, name) != value:
            raise ValueError(f"{name}: the built-in tokenizer uses id {value}, the config says {getattr(config, name)}")
    if config.media_placeholder_token_id not in (None, MEDIA_PLACEHOLDER_ID):
        raise ValueError(f"media_placeholder_token_id: the built-in tokenizer's <|media_pad|> is "
                         f"{MEDIA_PLACEHOLDER_ID}, the config says {config.media_placeholder_token_id}")
    return train_tokenizer(texts, config.vocab_size, model_max_length=config.max_position_embeddings)
