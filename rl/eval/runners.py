"""Who `k3rl eval` (rl/eval/grid.py) evaluates: "runners", each turning the tasks of one cell into task rows.

- `ModelRunner`: the model of `eval.model_path` on a local engine through rollout/agent_loop.py's `AgentLoop`,
  greedy, with the rollout limits of `rollout:` — the native engine (rollout/torch_engine.py: K3 or any HF
  causal LM) or vLLM (rollout/vllm_engine.py: any model vLLM runs, not K3), chosen by `rollout.engine`.
- `EndpointRunner`: any model behind an OpenAI-compatible chat endpoint (`eval.endpoint`: `vllm serve`, …),
  a message-level policy (`ChatPolicy`) played through `envs.base.run_episode` like the baselines.
- `run_baseline`: the environment's `oracle` (the ceiling) and `closed_book` (answers at once with another
  task's answer, envs/teachers.py: the floor).

The evaluated model's rows carry the runner name "model" whatever its backend (rl/eval/report.py aggregates
by runner); `describe()` says which backend and model, for results.json. A task that fails is its error row.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from k3rl.rl.config import ConfigError
from k3rl.rl.eval.rows import task_row, tokens_read, transcript

if TYPE_CHECKING:
    from k3rl.rl.eval.cells import GridTask

K3_MODEL_TYPES = ("k3rl_k3", "kimi_k3", "kimi_linear")
"""Model types of the K3 family: k3rl's own (which vLLM does not know) and vLLM's, whose kernels need CUDA."""


# ---- who is evaluated: checks and construction

def check_evaluated(cfg: Any) -> None:
    """Named errors for the evaluated model of an eval config, without loading it or reaching the network
    (an endpoint is probed when `EndpointRunner` starts, still before anything is written)."""
    ev = cfg.eval
    if ev.endpoint is not None:
        if not _is_http_url(str(ev.endpoint)):
            raise ConfigError(f"eval.endpoint: the http(s) base URL of an OpenAI-compatible API, e.g. "
                              f"http://127.0.0.1:8000/v1; got {ev.endpoint!r}")
        if not 0 < ev.endpoint_timeout_s < math.inf or ev.endpoint_retries < 0:
            raise ConfigError(f"eval.endpoint_timeout_s must be > 0 (and finite) and eval.endpoint_retries ≥ 0; got "
                              f"{ev.endpoint_timeout_s} and {ev.endpoint_retries}")
        if ev.endpoint_task_timeout_s is not None and not 0 < ev.endpoint_task_timeout_s < math.inf:
            raise ConfigError(f"eval.endpoint_task_timeout_s: must be > 0 and finite (or null), got "
                              f"{ev.endpoint_task_timeout_s}")
        if ev.endpoint_max_reply_chars < 1:
            raise ConfigError(f"eval.endpoint_max_reply_chars: must be ≥ 1, got {ev.endpoint_max_reply_chars}")
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

        from k3rl.model.formats.layouts import model_type_of
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


def evaluated_runner(cfg: Any) -> ModelRunner | EndpointRunner:
    """The runner of the evaluated model: the endpoint when `eval.endpoint` is set, else `eval.model_path` on
    `rollout.engine`."""
    if cfg.eval.endpoint is not None:
        return EndpointRunner(cfg)
    return ModelRunner(cfg, cfg.eval.model_path, str(cfg.rollout.engine))


# ---- the model on a local engine

class ModelRunner:
    """The evaluated model on the native engine or vLLM, greedy; one AgentLoop per cell."""

    name = "model"

    def __init__(self, cfg: Any, model_path: str, engine: str = "torch"):
        from k3rl.model.tokenizer import load_tokenizer
        from k3rl.rl.config import check_model_code

        self.cfg, self.model_path, self.backend = cfg, str(model_path), engine
        # the directory's own code runs only with run.trust_remote_code (model/formats/trust.py): refused before loading
        check_model_code(cfg, "eval.model_path", model_path)
        trust = bool(cfg.run.trust_remote_code)
        self.tokenizer = load_tokenizer(model_path, trust_remote_code=trust)
        if engine == "vllm":
            from omegaconf import OmegaConf
            from transformers import AutoConfig

            from k3rl.model.formats import layouts as hf_layout
            from k3rl.rollout.vllm_engine import VLLMEngine

            # a K3 directory through k3rl's reader (transformers' own kimi_linear is another model)
            text = (hf_layout.read_config(model_path) if hf_layout.is_k3_dir(model_path)
                    else AutoConfig.from_pretrained(model_path, trust_remote_code=trust).get_text_config())
            self.max_positions = int(getattr(text, "max_position_embeddings", 0) or 0)
            args = OmegaConf.to_container(cfg.rollout.engine_args, resolve=True) or {}
            args["trust_remote_code"] = trust
            self.engine = VLLMEngine(model_path, max_model_len=self.limit(), seed=cfg.run.seed, **args)
        else:
            import torch

            from k3rl.model.policy import load_policy

            self.policy = load_policy(model_path, torch.float32, cfg.run.device, trust_remote_code=trust,
                                      allow_nonfinite=cfg.run.allow_nonfinite_weights)
            self.model = self.policy.model.eval()
            text = self.model.config.get_text_config()
            own = int(getattr(text, "max_position_embeddings", 0) or 0)
            wanted = cfg.eval.max_position_embeddings
            if wanted is not None and wanted != own:
                text.max_position_embeddings = int(wanted)  # read at every forward (model/cache.py make_step)
                self.tokenizer.model_max_length = int(1e30)  # transformers' "no limit": haystack drafts run past it
                print(f"k3rl eval: the model's {own} positions set to {wanted} (eval.max_position_embeddings)",
                      flush=True)
            self.max_positions = int(getattr(text, "max_position_embeddings", 0) or 0)

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "model": self.model_path}

    def limit(self) -> int:
        """The longest context the engine may build: `rollout.max_context_tokens`, within the model's positions."""
        limit = int(self.cfg.rollout.max_context_tokens)
        return min(limit, self.max_positions) if self.max_positions else limit

    def _engine(self):
        if self.backend == "vllm":
            return self.engine
        from omegaconf import OmegaConf

        from k3rl.rollout.torch_engine import TorchEngine

        args = OmegaConf.to_container(self.cfg.rollout.engine_args, resolve=True) or {}  # e.g. prefill_tokens
        return TorchEngine(self.model, self.tokenizer, device=self.cfg.run.device, **args)

    def run(self, cell_tasks: Sequence[GridTask]) -> list[dict[str, Any]]:
        import k3rl.envs as envs
        from k3rl.envs.base import Budget
        from k3rl.rl.eval.cells import env_kwargs
        from k3rl.rl.eval.evaluate import success_rule
        from k3rl.rollout.agent_loop import AgentLoop, EpisodeRequest
        from k3rl.rollout.engine import SamplingParams

        cfg, cell = self.cfg, cell_tasks[0].cell
        kwargs = env_kwargs(cfg, cell, self.tokenizer)
        env0 = envs.make(cell.family, **kwargs)
        key = success_rule(env0, cfg.env.success_key)
        rows, runnable = [], []
        # the prompt is the haystack plus the chat scaffolding and the system message: leave room to answer
        room = int(cfg.rollout.max_new_tokens)
        for gt in cell_tasks:
            need = gt.prompt_tokens + room if cell.serve == "context" else room
            if need > self.limit():
                rows.append(task_row(self.name, gt, 0.0, {}, {}, 0.0, "", key, error=(
                    f"prompt of {gt.prompt_tokens} tokens + {room} to answer exceeds the context limit "
                    f"{self.limit()} (rollout.max_context_tokens, the model's max_position_embeddings "
                    f"{self.max_positions})"), error_kind="context"))
            else:
                runnable.append(gt)
        if not runnable:
            return rows
        budget = Budget(**{**vars(env0.budget), "max_turns": cfg.rollout.max_turns})
        loop = AgentLoop(self._engine(), self.tokenizer, lambda: envs.make(cell.family, **kwargs),
                         SamplingParams(temperature=0.0, max_tokens=room), budget=budget,
                         max_context_tokens=self.limit(), env_name=cell.family)
        started = time.perf_counter()
        try:
            trajectories = loop.run([EpisodeRequest(gt.task, gt.task_id, gt.task_id) for gt in runnable])
        except Exception as e:  # the batch failed (e.g. out of memory): every task of it is an error row
            seconds = time.perf_counter() - started
            return rows + [task_row(self.name, gt, 0.0, {}, {}, seconds / len(runnable), "", key,
                                    error=f"{type(e).__name__}: {e}", error_kind="engine") for gt in runnable]
        seconds = (time.perf_counter() - started) / len(runnable)
        for gt, t in zip(runnable, trajectories):
            transcript = self.tokenizer.decode(t.tokens[t.prompt_len:].tolist(), skip_special_tokens=False)
            metrics = {"tool_calls": t.metrics.get("tool_calls", 0.0), "tokens_read": float(len(t.tokens) - t.num_sampled),
                       "engine_prompt_tokens": t.prompt_len}  # the first prompt as the engine got it
            rows.append(task_row(self.name, gt, t.reward, t.rewards, metrics, seconds, transcript, key))
        return rows


# ---- a served model behind an OpenAI-compatible endpoint

class ChatPolicy:
    """A message-level policy (messages → the assistant's text) that asks an OpenAI-compatible chat endpoint
    (rl/eval/endpoint_client.py), greedy, stopping at the end of a tool call; it keeps the server's token usage of
    every turn and whether a reply was cut at `eval.endpoint_max_reply_chars`.

    What the server is sent is what the native engine renders (rollout/chat.py's `neutralize`): in every
    message the special tokens' strings (`<|im_end|>`, `<|media_pad|>`, …) are broken by a word joiner, in tool
    results every added token's too (`<tool_call>`, `</tool_response>`, …), so a passage cannot end a turn or
    forge a call — `patterns` holds (special, added) `control_pattern`s of the evaluated model's tokenizer.
    Tool results are sent as user messages wrapped in `<tool_response>` (what Qwen-style templates render a
    tool message as): the `tool` role of the OpenAI API needs a `tool_call_id` of a structured call, which
    this text protocol has not. A server that strips the stop string (the OpenAI API does) gets it put back,
    so the environment's parser sees a closed call. `lock`, when given, is held by the caller while it plays
    the episode and released here while waiting for the server: episodes run side by side in threads while
    environment code runs one at a time. `deadline` (time.monotonic()) bounds the whole episode's requests.
    """

    def __init__(self, client: Any, model: str, max_tokens: int, lock: Optional[threading.Lock] = None,
                 patterns: tuple[Any, Any] = (None, None), deadline: Optional[float] = None):
        self.client, self.model, self.max_tokens, self.lock = client, model, max_tokens, lock
        self.patterns, self.deadline = patterns, deadline
        self.usage: list[Optional[tuple[Any, Any]]] = []
        """(prompt_tokens, completion_tokens) of every turn as the server reported them (None: not reported)."""
        self.truncated = False

    def __call__(self, messages: list[dict[str, Any]]) -> str:
        from k3rl.envs.tools import STOP_SEQUENCES, TOOL_CALL_END, TOOL_CALL_START, format_observation
        from k3rl.rollout.chat import neutralize

        special, added = self.patterns
        chat = [{"role": "user", "content": format_observation(neutralize(m["content"], added)[0])}
                if m["role"] == "tool" else {"role": m["role"], "content": neutralize(m["content"], special)[0]}
                for m in messages]
        if self.lock is not None:
            self.lock.release()
        try:
            reply = self.client.chat(chat, self.model, self.max_tokens, list(STOP_SEQUENCES), self.deadline)
        finally:
            if self.lock is not None:
                self.lock.acquire()
        self.usage.append(reply.usage)
        self.truncated |= reply.truncated
        text = reply.text
        if reply.has_stop_reason:  # vLLM names the stop string that matched (None: the end of the turn)
            stopped_at_call = reply.stop_reason == TOOL_CALL_END
        else:  # other servers say only that one did
            stopped_at_call = reply.finish_reason == "stop"
        if stopped_at_call and text.rfind(TOOL_CALL_START) > text.rfind(TOOL_CALL_END):
            text += TOOL_CALL_END
        return text

    def tokens_read(self, own: int) -> tuple[int, str]:
        """Tokens the model read, each once (the prompt and the tool results, as the native engine counts them),
        and a note when they are not the server's: the last turn's prompt less the replies before it, from the
        server's usage when that is a consistent count — integers, prompts > 0 that never shrink, a total within
        [own / 2, 2 × own + 256] of `own` (the row's own count: `tokens_read` of the episode's messages with the
        evaluated model's tokenizer) — else `own`, with a note saying why."""
        usage = self.usage
        if not usage or any(u is None for u in usage):
            return own, "the server reported no usage: tokens_read is the tokenizer's count"
        ints = all(isinstance(n, int) and not isinstance(n, bool) for u in usage for n in u)
        if ints and all(p > 0 and c >= 0 for p, c in usage) and all(a[0] <= b[0] for a, b in zip(usage, usage[1:])):
            read = usage[-1][0] - sum(c for _, c in usage[:-1])
            if own / 2 <= read <= 2 * own + 256:
                return read, ""
        shown = ", ".join(f"{p!r}/{c!r}" for p, c in usage[:4]) + (", …" if len(usage) > 4 else "")
        return own, (f"the server's usage (prompt/completion tokens by turn: {shown}) is not a consistent count: "
                     f"tokens_read is the tokenizer's count")


class EndpointRunner:
    """A served model behind an OpenAI-compatible chat endpoint (`eval.endpoint`); see `ChatPolicy` and
    rl/eval/endpoint_client.py (the deadlines, retries and reply cap).

    Starting it probes GET /models: an unreachable server, a wrong URL, a listing that is not JSON or not a
    model list, a model it does not serve, or a `max_model_len` that is not a positive integer is a named
    ConfigError before any work. A failure later (a timeout or a 5xx after `eval.endpoint_retries` retries, a
    prompt the server refuses) is that task's error row, with its kind. Up to `eval.batch_size` episodes of a
    cell run at once. Lengths are counted with `eval.model_path`'s tokenizer, else the one the served model's
    name resolves to locally (a path, the HF cache); its control tokens are what `ChatPolicy` neutralises.
    """

    name = "model"
    backend = "endpoint"

    def __init__(self, cfg: Any):
        from k3rl.rl.eval.endpoint_client import EndpointClient
        from k3rl.rollout.chat import control_pattern

        ev = cfg.eval
        self.cfg, self.url = cfg, str(ev.endpoint).rstrip("/")
        # the key comes from the environment, never from the config: config.yaml is written next to the results
        self.client = EndpointClient(self.url, os.environ.get("OPENAI_API_KEY") or "EMPTY",
                                     float(ev.endpoint_timeout_s), int(ev.endpoint_retries),
                                     int(ev.endpoint_max_reply_chars))
        self.model, self.max_model_len = self._probe(ev.endpoint_model)
        self.tokenizer = self._tokenizer()
        self.patterns = (control_pattern(self.tokenizer), control_pattern(self.tokenizer, special_only=False))
        self._lock = threading.Lock()

    def _probe(self, wanted: Optional[str]) -> tuple[str, Optional[int]]:
        """The served model to evaluate and its context limit (vLLM reports `max_model_len`), from GET /models."""
        from k3rl.rl.eval.endpoint_client import EndpointError

        where = f"GET {self.url}/models"
        try:
            listing = self.client.models()
        except EndpointError as e:
            if e.status is not None:
                raise ConfigError(f"eval.endpoint: {where} answered HTTP {e.status}; is {self.url} the base URL of "
                                  f"an OpenAI-compatible API (it usually ends in /v1)?") from None
            if e.kind == "reply":
                raise ConfigError(f"eval.endpoint: {where} did not answer a JSON model list: {e}; is {self.url} an "
                                  f"OpenAI-compatible API?") from None
            raise ConfigError(f"eval.endpoint: cannot reach {self.url} ({e}); start the server "
                              f"(e.g. `vllm serve MODEL --port 8000`) or fix the URL") from None
        served = listing.get("data") if isinstance(listing, dict) else None
        if not isinstance(served, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str)
                                                   for m in served):
            raise ConfigError(f"eval.endpoint: {where} is not a model list ({{\"data\": [{{\"id\": …}}, …]}} "
                              f"expected); got {json.dumps(listing)[:200]}")
        names = [m["id"] for m in served]
        if wanted is None and not names:
            raise ConfigError(f"eval.endpoint: {self.url} serves no model (GET /models is empty); set eval.endpoint_model")
        if wanted is not None and wanted not in names:
            raise ConfigError(f"eval.endpoint_model: {wanted!r} is not served at {self.url}; it serves "
                              f"{', '.join(map(repr, names)) or 'nothing'}")
        model = wanted if wanted is not None else names[0]
        limit = next(m.get("max_model_len") for m in served if m["id"] == model)
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
            raise ConfigError(f"eval.endpoint: {where} gives model {model!r} max_model_len {json.dumps(limit)[:80]}; "
                              f"expected a positive integer (the tokens the server holds) or no field")
        return model, limit

    def _tokenizer(self):
        from k3rl.model.tokenizer import load_tokenizer

        trust = bool(self.cfg.run.trust_remote_code)
        if self.cfg.eval.model_path is not None:
            return load_tokenizer(self.cfg.eval.model_path, trust_remote_code=trust)
        try:
            return load_tokenizer(self.model, trust_remote_code=trust, local_files_only=True)
        except Exception:
            raise ConfigError(f"eval.model_path: set it to a local directory with the tokenizer of {self.model!r} "
                              f"(served at {self.url}): lengths are counted with the evaluated model's tokenizer, "
                              f"and {self.model!r} does not resolve to a local one") from None

    def describe(self) -> dict[str, Any]:
        return {"backend": self.backend, "model": self.model, "endpoint": self.url}

    def run(self, cell_tasks: Sequence[GridTask]) -> list[dict[str, Any]]:
        from concurrent.futures import ThreadPoolExecutor

        import k3rl.envs as envs
        from k3rl.envs.base import as_token_counter
        from k3rl.rl.eval.cells import env_kwargs
        from k3rl.rl.eval.evaluate import success_rule

        cell = cell_tasks[0].cell
        kwargs = env_kwargs(self.cfg, cell, self.tokenizer)
        key = success_rule(envs.make(cell.family, **kwargs), self.cfg.env.success_key)
        count = as_token_counter(self.tokenizer)
        workers = max(1, min(len(cell_tasks), int(self.cfg.eval.batch_size)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(lambda gt: self._task(gt, kwargs, key, count), cell_tasks))

    def _task(self, gt: GridTask, kwargs: dict[str, Any], key: Optional[str], count) -> dict[str, Any]:
        import k3rl.envs as envs
        from k3rl.envs.base import Budget, run_episode
        from k3rl.rl.eval.endpoint_client import EndpointError

        room = int(self.cfg.rollout.max_new_tokens)
        if self.max_model_len and gt.cell.serve == "context" and gt.prompt_tokens + room > self.max_model_len:
            return task_row(self.name, gt, 0.0, {}, {}, 0.0, "", key, error=(
                f"prompt of {gt.prompt_tokens} tokens + {room} to answer exceeds the served model's context "
                f"limit {self.max_model_len} (max_model_len at {self.url})"), error_kind="context")
        started = time.perf_counter()
        bound = self.cfg.eval.endpoint_task_timeout_s
        policy = ChatPolicy(self.client, self.model, room, self._lock, self.patterns,
                            None if bound is None else time.monotonic() + float(bound))
        try:
            with self._lock:  # environment code one episode at a time; the policy lets go while the server works
                env = envs.make(gt.cell.family, **kwargs)
                budget = Budget(**{**vars(env.budget), "max_turns": self.cfg.rollout.max_turns})
                result = run_episode(env, gt.task, policy, budget, count)
                own = tokens_read(result.messages, self.tokenizer)
        except EndpointError as e:  # after the retries: this task's error row, with the kind a resume reads
            return task_row(self.name, gt, 0.0, {}, {}, time.perf_counter() - started, "", key,
                            error=f"{type(e).__name__}: {e}", error_kind=e.kind)
        except Exception as e:  # the episode failed (environment code)
            return task_row(self.name, gt, 0.0, {}, {}, time.perf_counter() - started, "", key,
                            error=f"{type(e).__name__}: {e}", error_kind="task")
        read, note = policy.tokens_read(own)
        info = result.info
        from k3rl.rl.eval.cells import REPORTED

        rewards = {k: v for k, v in info.items() if k in REPORTED}
        metrics = {"tool_calls": info.get("tool_calls", 0), "tokens_read": read}
        return task_row(self.name, gt, result.reward, rewards, metrics, time.perf_counter() - started,
                        transcript(result.messages), key, reply_truncated=policy.truncated, note=note)


# ---- the baselines

def run_baseline(name: str, cfg: Any, cell_tasks: Sequence[GridTask], tokenizer: Any) -> list[dict[str, Any]]:
    """The `oracle` or `closed_book` policy on the tasks of one cell (envs.base.run_episode)."""
    import random

    import k3rl.envs as envs
    from k3rl.envs.base import Budget, as_token_counter, run_episode
    from k3rl.envs.teachers import ClosedBookPolicy, terminal_call
    from k3rl.rl.eval.cells import REPORTED, env_kwargs
    from k3rl.rl.eval.evaluate import success_rule

    cell = cell_tasks[0].cell
    env = envs.make(cell.family, **env_kwargs(cfg, cell, tokenizer))
    key = success_rule(env, cfg.env.success_key)
    budget = Budget(**{**vars(env.budget), "max_turns": cfg.rollout.max_turns})
    count = as_token_counter(tokenizer)
    guesses = []
    if name == "closed_book":  # another task's final call: an answer of the right kind, not this task's
        for gt in cell_tasks:
            result = run_episode(env, gt.task, env.oracle(gt.task), budget, count)
            guesses.append(terminal_call(env, result.messages))
    rng = random.Random(f"closed_book:{cfg.eval.seed}:{cell.name}")
    rows = []
    for i, gt in enumerate(cell_tasks):
        started = time.perf_counter()
        try:
            if name == "oracle":
                policy = env.oracle(gt.task)
            else:
                others = [g for j, g in enumerate(guesses) if j != i and g is not None]
                policy = ClosedBookPolicy(rng.choice(others)) if others else (lambda messages: "unanswerable")
            result = run_episode(env, gt.task, policy, budget, count)
            info = result.info
            metrics = {"tool_calls": info.get("tool_calls", 0), "tokens_read": tokens_read(result.messages, tokenizer)}
            rewards = {k: v for k, v in info.items() if k in REPORTED}
            rows.append(task_row(name, gt, result.reward, rewards, metrics, time.perf_counter() - started,
                                 transcript(result.messages), key))
        except Exception as e:  # one task's failure is its row, not the run's end
            rows.append(task_row(name, gt, 0.0, {}, {}, time.perf_counter() - started, "", key,
                                 error=f"{type(e).__name__}: {e}"))
    return rows
