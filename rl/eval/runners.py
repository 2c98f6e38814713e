"""How held-out tasks are played: one `Runner` protocol, `play(tasks) -> trajectories`, with three implementations —
`LocalRunner` (an engine in this process: the native one or vLLM, through rollout/agent_loop.py's `AgentLoop`),
`EndpointRunner` (a model behind an OpenAI-compatible endpoint, rl/eval/endpoint.py) and the trainer's Ray rollout
pool (rl/orchestrator/pool_runner.py) — and one scorer, rl/eval/evaluate.py's `score`, for what they return.

Callers: the trainer's held-out evaluation (the pool), SFT's (`greedy_report`: a `LocalRunner` on the model it
trained), and `k3rl eval` / pretraining's per-stage grid (rl/eval/grid.py), whose evaluated model on a local engine
is `LocalModel` here (rows of rl/eval/rows.py per cell; rl/eval/endpoint.py's `ServedModel` for an endpoint).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional, Protocol

from k3rl.rl.eval.cells import env_kwargs
from k3rl.rl.eval.rows import task_row

if TYPE_CHECKING:
    from k3rl.rl.eval.cells import GridTask


class Runner(Protocol):
    """Plays one episode per `(task_id, task)` and returns what finished — each with `reward`, `rewards` (reward
    components) and `metrics`, what `score` reads — in the runner's order (task order, except the Ray pool's:
    as they arrive)."""

    def play(self, tasks: Sequence[tuple[str, Any]]) -> list[Any]: ...


class LocalRunner:
    """Episodes on `engine` in this process: one `AgentLoop` over the environment of `make_env` with `sampling`,
    `budget` and `max_context_tokens`, all tasks of a call batched together; returns rollout.trajectory's
    `Trajectory`s in task order (each task its own group, `task_id` both ids)."""

    def __init__(self, engine: Any, tokenizer: Any, make_env: Callable[[], Any], sampling: Any, *, budget: Any,
                 max_context_tokens: int, env_name: str):
        self.engine, self.tokenizer, self.make_env, self.sampling = engine, tokenizer, make_env, sampling
        self.budget, self.max_context_tokens, self.env_name = budget, max_context_tokens, env_name

    def play(self, tasks: Sequence[tuple[str, Any]]) -> list[Any]:
        from k3rl.rollout.agent_loop import AgentLoop, EpisodeRequest, episode_trajectories

        loop = AgentLoop(self.engine, self.tokenizer, self.make_env, self.sampling, budget=self.budget,
                         max_context_tokens=self.max_context_tokens, env_name=self.env_name)
        return [t for item in loop.run([EpisodeRequest(task, task_id, task_id) for task_id, task in tasks])
                for t in episode_trajectories(item)]


def greedy_report(model: Any, tokenizer: Any, env_name: str, tasks: Sequence[Any], env_kwargs: Optional[dict] = None,
                  *, max_new_tokens: int = 128, max_turns: Optional[int] = None, max_context_tokens: int = 4096,
                  success_key: Optional[str] = None, device: str = "cpu") -> dict[str, Any]:
    """Greedy episodes of `model` (the native engine, a `LocalRunner`) on `tasks`, scored by rl/eval/evaluate.py's
    `held_out_summary` (`success_key` None: the environment's rule): SFT's held-out evaluation (`eval.json`). The
    model's training mode is restored after."""
    import k3rl.envs as envs
    from k3rl.envs.base import with_budget
    from k3rl.rl.eval.evaluate import held_out_summary, success_rule
    from k3rl.rollout.engine import SamplingParams
    from k3rl.rollout.torch_engine import TorchEngine

    was_training = model.training
    env0 = envs.make(env_name, tokenizer=tokenizer, **(env_kwargs or {}))
    key = success_rule(env0, success_key)
    budget = env0.budget if max_turns is None else with_budget(env0.budget, max_turns=max_turns)
    names = set(env0.tool_specs())
    runner = LocalRunner(TorchEngine(model, tokenizer, device=device), tokenizer,
                         lambda: envs.make(env_name, tokenizer=tokenizer, **(env_kwargs or {})),
                         SamplingParams(temperature=0.0, max_tokens=max_new_tokens), budget=budget,
                         max_context_tokens=max_context_tokens, env_name=env_name)
    started = time.perf_counter()
    trajectories = runner.play([(str(i), t) for i, t in enumerate(tasks)])
    seconds = time.perf_counter() - started
    model.train(was_training)
    return held_out_summary(trajectories, tokenizer, names, key, seconds)


class LocalModel:
    """`k3rl eval`'s evaluated model on the native engine or vLLM, greedy: a `LocalRunner` per cell."""

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

            from k3rl.model.formats.config_json import is_k3_dir, read_config
            from k3rl.rollout.vllm_engine import VLLMEngine

            # a K3 directory through k3rl's reader (transformers' own kimi_linear is another model)
            text = (read_config(model_path) if is_k3_dir(model_path)
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

    def rows(self, cell_tasks: Sequence[GridTask]) -> list[dict[str, Any]]:
        """The task rows of one cell: first a `context` error row for each prompt the engine cannot hold with room
        to answer, then the others, played together; a batch that fails is an `engine` error row for each task."""
        import k3rl.envs as envs
        from k3rl.envs.base import with_budget
        from k3rl.rl.eval.evaluate import success_rule
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
        runner = LocalRunner(self._engine(), self.tokenizer, lambda: envs.make(cell.family, **kwargs),
                             SamplingParams(temperature=0.0, max_tokens=room),
                             budget=with_budget(env0.budget, max_turns=cfg.rollout.max_turns),
                             max_context_tokens=self.limit(), env_name=cell.family)
        started = time.perf_counter()
        try:
            trajectories = runner.play([(gt.task_id, gt.task) for gt in runnable])
        except Exception as e:  # the batch failed (e.g. out of memory): every task of it is an error row
            seconds = time.perf_counter() - started
            return rows + [task_row(self.name, gt, 0.0, {}, {}, seconds / len(runnable), "", key,
                                    error=f"{type(e).__name__}: {e}", error_kind="engine") for gt in runnable]
        seconds = (time.perf_counter() - started) / len(runnable)
        for gt, t in zip(runnable, trajectories):
            text = self.tokenizer.decode(t.tokens[t.prompt_len:].tolist(), skip_special_tokens=False)
            metrics = {"tool_calls": t.metrics.get("tool_calls", 0.0), "tokens_read": float(len(t.tokens) - t.num_sampled),
                       "engine_prompt_tokens": t.prompt_len}  # the first prompt as the engine got it
            rows.append(task_row(self.name, gt, t.reward, t.rewards, metrics, seconds, text, key))
        return rows
