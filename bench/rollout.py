"""Rollout throughput: generated tokens/s and episodes/s of the native and vLLM engines.

    python bench/rollout.py            # batch 1, 8, 32; 64 new tokens per sample
    python bench/rollout.py --quick    # batch 1, 8; 16 new tokens

Models are built on the spot: the tiny K3 (configs/model/tiny.yaml, random init, its tokenizer)
and the tiny Qwen3 of rollout/tiny_qwen3.py (vLLM on the CPU serves standard HF architectures,
not K3). Baselines, measured in the same run: Hugging Face `generate` (sampling, left-padded
batch, KV cache) on the same Qwen3 — the engines' tokens/s are reported as a ratio to it — and,
for the tiny K3, the same weights with the routed experts run by the per-expert loop
(`kernels/moe/naive.py`, what model/moe.py did before the grouped path) instead of the grouped
matmuls (`kernels/moe/grouped.py`): the "vs naive experts" column.

The tiny K3 is also compared with a dense Qwen3 of its own size (hidden 128, 8 layers, 4 heads, vocabulary
4096, MLP 384 wide: the K3's active FFN width) on the same native engine: the "K3 ÷ Qwen3" table.

    python bench/rollout.py --k3-only  # only the K3 rows and the same-size Qwen3 (no small Qwen3, no vLLM)
Episodes/s runs the agent loop against the search environment (each task carries its own
passages) with a sampling budget of `--max-tokens` per turn; the random models mostly end
after one turn, so episodes/s measures the loop's overhead around generation.

    python bench/rollout.py --multi-turn   # only the multi-turn table: state reuse on vs off
    python bench/rollout.py --contexts 2048 16384 65536   # only K3 ÷ Qwen3 decode at long contexts
Multi-turn episodes on the tiny K3, the native engine with `reuse_state` on and off (the baseline, each
turn prefilled in full), same weights and seed, in the same run: rollout tokens/s and prefilled tokens per
episode. A random model writes no tool calls, so here the parser reads every turn as a `look` call whose
observation length (2–13 lines) is hashed from the turn's text, and episodes end at the turn budget: the
episode shape is real, the model's choices are not.

`--contexts L …`: the tiny K3 and the dense Qwen3 of its size decoding after a prompt of L tokens, at batch 1 and 8
(one prompt prefilled once and `n` samples from it: a GRPO group's shape), EOS ignored so every row decodes the
whole budget. A decode step's time is the call's time minus that of the same prompt's prefill with one token
(measured in the same run), so the table holds decode alone: the K3 reads its constant-size KDA states and the
MLA layers' latents, the Qwen3 its KV cache of every layer.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def prompts_for(tokenizer, batch: int, length: int = 32, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    words = "the river city north king war music water light stone long short early late house".split()
    out = []
    for _ in range(batch):
        text = " ".join(rng.choice(words) for _ in range(length * 2))
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"][:length])
    return out


def timed(fn, repeats: int = 2) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def hf_generate(model, tokenizer, prompts, max_tokens):
    import torch

    T = max(map(len, prompts))
    pad = tokenizer.pad_token_id or 0
    ids = torch.tensor([[pad] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, pad_token_id=pad)
    return int((out.shape[1] - T) * len(prompts))


def engine_generate(engine, prompts, max_tokens):
    from k3rl.rollout.engine import SamplingParams

    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, seed=0))
    return sum(len(c.token_ids) for o in outs for c in o)


def search_tasks(n: int) -> list[dict]:
    passages = [{"id": f"p{i}", "title": f"Doc {i}", "text": f"Passage {i} says the code word is w{i * 7}."}
                for i in range(20)]
    return [{"question": f"What is the code word of passage {i}?", "answers": [f"w{i * 7}"],
             "evidence": [f"p{i}"], "passages": passages} for i in range(n)]


def episodes_per_second(engine, tokenizer, n: int, max_tokens: int) -> float:
    import k3rl.envs as envs
    from k3rl.rollout.agent_loop import AgentLoop, EpisodeRequest
    from k3rl.rollout.engine import SamplingParams

    loop = AgentLoop(engine, tokenizer, lambda: envs.make("search"), SamplingParams(max_tokens=max_tokens, seed=0),
                     max_context_tokens=4096, env_name="search")
    reqs = [EpisodeRequest(t, f"t{i}", f"g{i}") for i, t in enumerate(search_tasks(n))]
    seconds, _ = timed(lambda: loop.run(reqs), repeats=1)
    return n / seconds


def multi_turn(engine, tasks: int, n: int, turns: int, max_tokens: int) -> list[tuple]:
    """Rows (reuse, episodes, turns, tokens/s, prefilled and reused tokens per episode, seconds, trajectories)
    of the same episodes with state reuse off, then on (module docstring)."""
    import random
    import zlib

    import k3rl.envs.tools as T
    from k3rl.envs import Env, tool
    from k3rl.envs.base import Budget
    from k3rl.rollout.agent_loop import AgentLoop, EpisodeRequest
    from k3rl.rollout.engine import SamplingParams
    from k3rl.rollout.sessions import PrefillStats
    from k3rl.rollout.torch_engine import TorchEngine

    class Probe(Env):
        """Look around until the turn budget runs out."""

        def reset(self, task):
            return task["question"]

        @tool
        def look(self, k: int) -> str:
            """Look around.

            Args:
                k: lines to read
            """
            return "\n".join(f"line {j}: the river city north of the king's stone house" for j in range(k))

    def every_turn_a_call(text: str):
        return T.ToolCall("look", {"k": 2 + zlib.crc32(text.encode()) % 12})

    rng = random.Random(0)
    words = "the river city north king war music water light stone long short early late house".split()
    requests = [EpisodeRequest({"question": " ".join(rng.choice(words) for _ in range(rng.randint(8, 80)))},
                               f"t{i}", f"g{i}", j) for i in range(tasks) for j in range(n)]
    parse, T.parse = T.parse, every_turn_a_call
    rows = []
    try:
        for reuse in (False, True):
            eng = TorchEngine(engine.model, engine.tokenizer, seed=0, reuse_state=reuse)
            loop = AgentLoop(eng, eng.tokenizer, Probe, SamplingParams(max_tokens=max_tokens, seed=0),
                             budget=Budget(max_turns=turns), max_context_tokens=8192, env_name="probe")
            loop.run(requests[:1])  # warm-up
            eng.stats, loop.stats.generated_tokens = PrefillStats(), 0
            seconds, trajs = timed(lambda: loop.run(requests), repeats=1)
            st, N = eng.stats, len(requests)
            rows.append((reuse, N, turns, loop.stats.generated_tokens / seconds, st.prefilled_tokens / N,
                         st.reused_tokens / N, seconds, trajs))
    finally:
        T.parse = parse
    return rows


def print_multi_turn(rows: list[tuple], max_tokens: int) -> None:
    import numpy as np

    (*off, off_trajs), (*on, on_trajs) = rows
    same = sum(np.array_equal(a.tokens, b.tokens) for a, b in zip(on_trajs, off_trajs))
    context = np.mean([len(t) for t in on_trajs])
    print(f"\nMulti-turn episodes, tiny K3, {on[1]} episodes ({on[1] // 2} tasks × 2 samples), {on[2]} turns of up to "
          f"{max_tokens} tokens, {context:,.0f} tokens per episode at the end; same tokens in both runs: "
          f"{same}/{len(on_trajs)} episodes\n")
    print("| state reuse | tokens/s | prefilled tokens / episode | reused tokens / episode | seconds | tokens/s vs off "
          "| prefilled vs off |")
    print("|---|---|---|---|---|---|---|")
    for reuse, _, _, tps, pre, kept, sec in (off, on):
        print(f"| {'on' if reuse else 'off'} | {tps:,.0f} | {pre:,.0f} | {kept:,.0f} | {sec:.1f} | {tps / off[3]:.2f}× "
              f"| {pre / off[4]:.2f}× |")


def context_rows(engines, contexts: list[int], batches: tuple[int, ...], new_tokens: int) -> list[tuple]:
    """Rows (context, batch, model, decode tokens/s, prefill seconds) of `engines` [(name, engine, tokenizer)]
    decoding after a prompt of each length (module docstring)."""
    from k3rl.rollout.engine import SamplingParams

    rows = []
    for length in contexts:
        for name, engine, tok in engines:
            engine.eos_ids = set()  # every row decodes the whole budget
            prompt = prompts_for(tok, 1, length=length)
            if len(prompt[0]) < length:
                raise SystemExit(f"--contexts {length}: the prompt text gave only {len(prompt[0])} tokens")
            prefill_s, _ = timed(lambda: engine.generate(prompt, SamplingParams(max_tokens=1, seed=0)), repeats=1)
            for batch in batches:
                params = SamplingParams(n=batch, max_tokens=new_tokens + 1, seed=0)
                seconds, outs = timed(lambda: engine.generate(prompt, params), repeats=1)
                decoded = sum(len(c.token_ids) - 1 for c in outs[0])
                rows.append((length, batch, name, decoded / max(seconds - prefill_s, 1e-9), prefill_s))
            print(f"  {name} at {length:,} tokens: prefill {prefill_s:.1f} s", flush=True)
    return rows


def print_context_rows(rows: list[tuple], new_tokens: int) -> None:
    print(f"\nDecode after a long prompt, native engine, {new_tokens} new tokens per sample, 1 thread: the tiny K3 and "
          f"a dense Qwen3 of its size (hidden 128, 8 layers)\n")
    print("| context | batch | K3 tokens/s | Qwen3 tokens/s | K3 ÷ Qwen3 | K3 prefill s | Qwen3 prefill s |")
    print("|---|---|---|---|---|---|---|")
    by = {(length, batch, name): (tps, pre) for length, batch, name, tps, pre in rows}
    for length, batch in dict.fromkeys((r[0], r[1]) for r in rows):
        (k3, k3_pre), (qw, qw_pre) = by[(length, batch, "tiny K3")], by[(length, batch, "Qwen3 of the K3's size")]
        print(f"| {length:,} | {batch} | {k3:,.0f} | {qw:,.0f} | {k3 / qw:.2f}× | {k3_pre:.1f} | {qw_pre:.1f} |")


def set_expert_impl(model, impl: str) -> None:
    """Run every routed-expert block of `model` with `impl` (kernels/moe: `grouped`, `naive`, `triton`)."""
    from k3rl.model.moe import Experts

    for m in model.modules():
        if isinstance(m, Experts):
            m.impl = impl


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--k3-only", action="store_true", help="only the tiny K3, grouped vs naive experts")
    parser.add_argument("--multi-turn", action="store_true", help="only multi-turn episodes, state reuse on vs off")
    parser.add_argument("--turns", type=int, default=6, help="--multi-turn: turns per episode")
    parser.add_argument("--tasks", type=int, default=8, help="--multi-turn: tasks (2 samples each)")
    parser.add_argument("--contexts", type=int, nargs="+", default=None, metavar="TOKENS",
                        help="only K3 ÷ Qwen3 decode after prompts of these lengths, batch 1 and 8")
    args = parser.parse_args()
    batches = (1, 8) if args.quick else (1, 8, 32)
    max_tokens = args.max_tokens or (16 if args.quick else 64)

    from k3rl.rollout.vllm_cpu import configure_cpu_env

    configure_cpu_env()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from k3rl.rl.commands.model_tools import init_main
    from k3rl.rollout.tiny_qwen3 import build_tiny_qwen3
    from k3rl.rollout.torch_engine import TorchEngine

    torch.set_num_threads(1)  # the same single thread vLLM gets on this machine
    work = Path(tempfile.mkdtemp(prefix="k3rl-bench-"))
    positions = max(8192, 2 * max(args.contexts or [0]))  # NoPE MLA, no KDA positions: only the config's limit
    init_main([str(ROOT / "configs/model/tiny.yaml"), str(work / "k3"), f"model.max_position_embeddings={positions}"])
    k3 = TorchEngine.from_pretrained(work / "k3", seed=0)
    if args.multi_turn:
        mt_tokens = args.max_tokens or 24
        print_multi_turn(multi_turn(k3, args.tasks, 2, args.turns, mt_tokens), mt_tokens)
        return 0
    qwen_dir = build_tiny_qwen3(work / "qwen3")
    # the dense model of the tiny K3's size: hidden 128, 8 layers, 4 heads, vocabulary 4096, MLP 384 wide (what the
    # K3 runs per token: 2 routed experts + 1 shared of 128, or its dense first layer)
    same_dir = build_tiny_qwen3(work / "qwen3-k3-size", vocab_size=4096, hidden_size=128, num_layers=8, num_heads=4,
                                intermediate_size=384, max_position_embeddings=positions)
    same = TorchEngine.from_pretrained(same_dir, seed=0)
    if args.contexts:
        new_tokens = args.max_tokens or 32
        named = [("tiny K3", k3, k3.tokenizer), ("Qwen3 of the K3's size", same, same.tokenizer)]
        print_context_rows(context_rows(named, args.contexts, (1, 8), new_tokens), new_tokens)
        return 0
    k3_naive = TorchEngine.from_pretrained(work / "k3", seed=0)
    set_expert_impl(k3_naive.model, "naive")
    qwen_native = TorchEngine.from_pretrained(qwen_dir, seed=0)
    qwen_hf = AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float32).eval()
    qwen_tok = AutoTokenizer.from_pretrained(qwen_dir)
    engines = [("native", "tiny K3, naive experts", k3_naive, k3.tokenizer), ("native", "tiny K3", k3, k3.tokenizer),
               ("native", "Qwen3 of the K3's size", same, AutoTokenizer.from_pretrained(same_dir))]
    if not args.k3_only:
        engines.append(("native", "tiny Qwen3", qwen_native, qwen_tok))
    if not args.no_vllm and not args.k3_only:
        from k3rl.rollout.vllm_engine import VLLMEngine

        vllm = VLLMEngine(qwen_dir, max_model_len=4096, seed=0)
        engines.append(("vLLM", "tiny Qwen3", vllm, qwen_tok))

    rows, same_rows = [], []
    for batch in batches:
        prompts = prompts_for(qwen_tok, batch)
        base = None
        if not args.k3_only:
            base_s, base_tokens = timed(lambda: hf_generate(qwen_hf, qwen_tok, prompts, max_tokens))
            base = base_tokens / base_s
            rows.append(("HF generate (baseline)", "tiny Qwen3", batch, base, 1.0, None))
        naive = same_size = None
        for kind, name, engine, tok in engines:
            p = prompts_for(tok, batch)
            seconds, tokens = timed(lambda: engine_generate(engine, p, max_tokens))
            tps = tokens / seconds
            if name == "tiny K3, naive experts":
                naive = tps
            if name == "Qwen3 of the K3's size":
                same_size = tps
            rows.append((kind, name, batch, tps, tps / base if "Qwen3" in name and base else None,
                         tps / naive if name.startswith("tiny K3") and naive else None))
        k3_tps = next(r[3] for r in rows if r[1] == "tiny K3" and r[2] == batch)
        same_rows.append((batch, k3_tps, same_size))
    episode_rows = [(kind, name, episodes_per_second(engine, tok, 8, max_tokens)) for kind, name, engine, tok in engines]

    print(f"\nGenerated tokens/s, {max_tokens} new tokens per sample, prompts of 32 tokens, 1 thread "
          f"(torch {torch.__version__}, {os.cpu_count()} cores)\n")
    print("| engine | model | batch | tokens/s | vs HF generate | vs naive experts |")
    print("|---|---|---|---|---|---|")
    for kind, name, batch, tps, ratio, vs_naive in rows:
        print(f"| {kind} | {name} | {batch} | {tps:,.0f} | {'' if ratio is None else f'{ratio:.2f}×'} "
              f"| {'' if vs_naive is None else f'{vs_naive:.2f}×'} |")
    print("\nThe tiny K3 against a dense Qwen3 of its size (hidden 128, 8 layers, vocabulary 4096), native engine\n")
    print("| batch | tiny K3 tokens/s | same-size Qwen3 tokens/s | K3 ÷ Qwen3 |")
    print("|---|---|---|---|")
    for batch, k3_tps, same_tps in same_rows:
        print(f"| {batch} | {k3_tps:,.0f} | {same_tps:,.0f} | {k3_tps / same_tps:.2f}× |")
    print("\nEpisodes/s, agent loop + search environment, 8 episodes at once\n")
    print("| engine | model | episodes/s |")
    print("|---|---|---|")
    for kind, name, eps in episode_rows:
        print(f"| {kind} | {name} | {eps:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
