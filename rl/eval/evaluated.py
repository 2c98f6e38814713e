"""Who `k3rl eval` (rl/eval/grid.py) evaluates: the checks of `eval.model_path` / `eval.endpoint` before anything is
loaded or written, and the evaluated model they name — `LocalModel` (rl/eval/runners.py: the native engine or vLLM,
chosen by `rollout.engine`) or `ServedModel` (rl/eval/endpoint.py: an OpenAI-compatible endpoint).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k3rl.rl.config import ConfigError
from k3rl.rl.eval.endpoint import ServedModel
from k3rl.rl.eval.runners import LocalModel

K3_MODEL_TYPES = ("k3rl_k3", "kimi_k3", "kimi_linear")
"""Model types of the K3 family: k3rl's own (which vLLM does not know) and vLLM's, whose kernels need CUDA."""


def check_evaluated(cfg: Any) -> None:
    """Named errors for the evaluated model of an eval config, without loading it or reaching the network
    (an endpoint is probed when `ServedModel` starts, still before anything is written); its timeouts and limits
    are the schema's to check (rl/config/checks.py)."""
    ev = cfg.eval
    if ev.endpoint is not None:
        if not _is_http_url(str(ev.endpoint)):
            raise ConfigError(f"eval.endpoint: the http(s) base URL of an OpenAI-compatible API, e.g. "
                              f"http://127.0.0.1:8000/v1; got {ev.endpoint!r}")
        if ev.model_path is not None and not _has_tokenizer(Path(ev.model_path)):
            raise ConfigError(f"eval.model_path: {ev.model_path} has no tokenizer (with eval.endpoint only its "
                              f"tokenizer is used: it counts the context lengths)")
        if ev.model_path is not None:
            from k3rl.rl.config import check_model_code

            check_model_code(cfg, "eval.model_path", ev.model_path, model=False)
        return
    if ev.model_path is None:
        raise ConfigError("eval.model_path: set the HF model directory to evaluate (`k3rl init`, `k3rl sft`, a "
                          "checkpoint, or any HF causal LM; its tokenizer also counts the context lengths), or "
                          "eval.endpoint to evaluate a served model")
    path = Path(ev.model_path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"eval.model_path: no Hugging Face model at {path} (config.json missing)")
    if not _has_tokenizer(path):
        raise ConfigError(f"eval.model_path: {path} has no tokenizer")
    if cfg.rollout.engine == "vllm":
        import torch

        from k3rl.model.formats.config_json import model_type_of
        from k3rl.rollout.worker import check_engine_args

        model_type = model_type_of(path)
        if model_type == "k3rl_k3" or (model_type in K3_MODEL_TYPES and not torch.cuda.is_available()):
            why = ("vLLM does not load k3rl's K3 layout (model_type k3rl_k3), and its own K3 kernels need CUDA"
                   if model_type == "k3rl_k3" else f"vLLM's K3 kernels (model_type {model_type}) need CUDA")
            raise ConfigError(f"rollout.engine=vllm: {path} is a K3 model and {why}; evaluate it with "
                              f"rollout.engine=torch")
        if not torch.cuda.is_available():  # vLLM's CPU settings must be in place before it is first imported
            from k3rl.rollout.vllm_cpu import configure_cpu_env

            configure_cpu_env()
        try:
            check_engine_args("vllm", dict(cfg.rollout.engine_args))
        except ValueError as e:
            raise ConfigError(f"rollout.engine_args: {e}") from None


def _is_http_url(url: str) -> bool:
    """Whether `url` is http(s)://HOST[:PORT]/… with a host and a numeric port, if any."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # a port that is not a number, or out of range
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port != 0


def _has_tokenizer(path: Path) -> bool:
    return any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))


def evaluated_model(cfg: Any) -> LocalModel | ServedModel:
    """The evaluated model: the endpoint when `eval.endpoint` is set (probed here: unreachable is a ConfigError),
    else `eval.model_path` on `rollout.engine`."""
    if cfg.eval.endpoint is not None:
        return ServedModel(cfg)
    return LocalModel(cfg, cfg.eval.model_path, str(cfg.rollout.engine))
