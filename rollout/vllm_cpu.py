"""vLLM on CPU hosts: the settings that make it start fast and run predictably on few cores.

Measured on 2-core machines (docs/environment.md): the in-process engine starts in 2–3 s instead of
18–27 s; one OpenMP thread avoids bimodal throughput when anything else uses a core; a 1 GiB KV
cache is plenty for tiny models. On a GPU host none of this applies and vLLM's defaults are used.
These must be in the environment before vLLM is imported.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def configure_cpu_env(overwrite: bool = False) -> dict[str, str]:
    """Set the CPU settings in os.environ (keeping values the user set unless `overwrite`)."""
    for key, value in CPU_ENV.items():
        if overwrite or key not in os.environ:
            os.environ[key] = value
    return {k: os.environ[k] for k in CPU_ENV}


def make_cpu_llm(model_dir: str, max_model_len: int = 1024, dtype: str = "float32", seed: int = 0,
                 trust_remote_code: bool = False, **kwargs):
    """A `vllm.LLM` for a local model directory with the CPU settings applied; the directory's own code runs
    only with `trust_remote_code` (model/formats/trust.py)."""
    from k3rl.model.formats.trust import check_remote_code

    trust = check_remote_code(model_dir, trust_remote_code)
    configure_cpu_env()
    import vllm

    with _shielded_from_kernel_scan():
        return vllm.LLM(model=str(model_dir), dtype=dtype, max_model_len=max_model_len, enforce_eager=True,
                        seed=seed, trust_remote_code=trust, **kwargs)


@contextmanager
def _shielded_from_kernel_scan():
    """Hide modules that break vLLM-CPU's start-up scan while an engine is built.

    On CPU hosts vLLM rebinds its Triton kernels by scanning the namespace of every loaded module
    and calling `vars(value).get(...)` on each attribute that has a `__dict__`. llvmlite's `ffi.lib`
    (loaded by numba, which bm25s imports on its first search) answers any attribute, `__dict__`
    included, with a function wrapper, so the scan crashes with "'_lib_fn_wrapper' object has no
    attribute 'get'". Such modules hold no vLLM kernels; they are left out of `sys.modules` for the
    duration and put back afterwards.
    """
    hidden = {}
    for name, module in list(sys.modules.items()):
        for value in list(getattr(module, "__dict__", {}).values()):
            try:
                breaks = hasattr(value, "__dict__") and not hasattr(vars(value), "get")
            except TypeError:
                breaks = False
            if breaks:
                hidden[name] = module
                break
    for name in hidden:
        del sys.modules[name]
    try:
        yield
    finally:
        sys.modules.update(hidden)
