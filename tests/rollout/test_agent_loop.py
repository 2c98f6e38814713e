"""The agent loop: token-faithful multi-turn episodes, masks, malformed calls, budgets.

A scripted engine (it "samples" given texts, token by token through the real tokenizer) pins
down the loop's bookkeeping exactly; tests with real engines live beside the engines.
"""

import pytest

from k3rl.envs import Env, format_call, tool
from k3rl.rollout.agent_loop import AgentLoop, EpisodeRequest
from k3rl.rollout.engine import Completion, SamplingParams


class Calc(Env):
    """Add numbers with a tool, then answer."""

    def reset(self, task):
        self.target = task["a"] + task["b"]
        return f"What is {task['a']} + {task['b']}?"

    @tool
    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: first addend
            b: second addend
        """
        return a + b

    @tool(terminal=True)
    def answer(self, value: int) -> float:
        """Give the final answer.

        Args:
            value: the sum
        """
        return float(value == self.target)


class ScriptedEngine:
    """Returns the next scripted text of each episode, tokenised; logprob -0.5 per token."""

    def __init__(self, tokenizer, scripts, eos_after=()):
        self.tokenizer, self.scripts, self.version = tokenizer, [list(s) for s in scripts], 3
        self.eos_after = set(eos_after)
        self.seen_prompts = []

    def generate(self, prompts, params):
        out = []
        for p in prompts:
            self.seen_prompts.append(list(p))
            # identify the episode by its first user message tokens (prompts differ per task)
            k = self.index[tuple(p[:self.prefix_len])]
            text = self.scripts[k].pop(0)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if k in self.eos_after:
                ids = ids + [self.tokenizer.eos_token_id]
            reason = "length" if len(ids) > params.max_tokens else "stop"
            ids = ids[:params.max_tokens]
            out.append([Completion(ids, [-0.5] * len(ids), reason)])
        return out

    def load_weights(self, named, version):
        self.version = version

    def reset_cache(self):
        pass


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3_dir)


def run(tokenizer, tasks, scripts, eos_after=(), prefix_cut=0, **kw):
    engine = ScriptedEngine(tokenizer, scripts, eos_after)
    loop = AgentLoop(engine, tokenizer, Calc, SamplingParams(max_tokens=64), env_name="calc", **kw)
    prompts = [loop.renderer.prompt_tokens([{"role": "system", "content": Calc().system_message()},
                                            {"role": "user", "content": Calc().reset(t)}]) for t in tasks]
    engine.prefix_len = min(len(p) for p in prompts) - prefix_cut  # a compacted restart ends otherwise
    engine.index = {tuple(p[:engine.prefix_len]): i for i, p in enumerate(prompts)}
    assert len(engine.index) == len(tasks)
    reqs = [EpisodeRequest(t, f"t{i}", f"g{i}") for i, t in enumerate(tasks)]
    return loop, engine, loop.run(reqs)


CALL = "I will add.\n" + format_call("add", {"a": 2, "b": 3})
ANSWER = format_call("answer", {"value": 5})


@pytest.mark.parametrize("eos", [False, True])
def test_multi_turn_episode_is_token_faithful(tokenizer, eos):
    loop, engine, (traj,) = run(tokenizer, [{"a": 2, "b": 3}], [[CALL, ANSWER]], eos_after=[0] if eos else [])
    assert traj.reward == 1.0 and traj.finish_reason == "done"
    assert traj.metrics["turns"] == 2 and traj.metrics["tool_calls"] == 1
    # loss mask covers exactly the sampled tokens, with their logprobs and the engine's version
    sampled = [tokenizer(t, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
               for t in (CALL, ANSWER)]
    assert [traj.tokens[s:e].tolist() for s, e in traj.turn_spans] == sampled
    assert traj.loss_mask.sum() == sum(map(len, sampled))
    assert set(traj.logprobs[traj.loss_mask == 1]) == {-0.5} and set(traj.logprobs[traj.loss_mask == 0]) == {0.0}
    assert set(traj.versions[traj.loss_mask == 1]) == {3}
    # the second generate call saw exactly the first turn's tokens plus the observation
    second = engine.seen_prompts[1]
    assert second == traj.tokens[:traj.turn_spans[1][0]].tolist()
    # detokenising the whole trajectory reproduces the transcript
    text = tokenizer.decode(traj.tokens.tolist())
    assert CALL in text and ANSWER in text and "<tool_response>\n5\n</tool_response>" in text
    assert text.startswith(tokenizer.decode(traj.tokens[:traj.prompt_len].tolist()))


def test_malformed_call_gives_error_observation_and_episode_goes_on(tokenizer):
    bad = ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": </tool_call>',
           format_call("multiply", {"a": 1}), format_call("add", {"a": "two", "c": 3}), ANSWER]
    _, _, (traj,) = run(tokenizer, [{"a": 2, "b": 3}], [bad])
    assert traj.reward == 1.0 and traj.metrics["turns"] == 4
    text = tokenizer.decode(traj.tokens[traj.prompt_len:].tolist())
    assert text.count("<tool_response>") == 3  # three error observations; the answer ends the episode
    assert "JSON" in text and "multiply" in text and "'c'" in text


def test_batched_episodes_of_different_lengths(tokenizer):
    tasks = [{"a": 2, "b": 3}, {"a": 10, "b": 20}, {"a": 1, "b": 1}]
    scripts = [[CALL, ANSWER], [format_call("answer", {"value": 31})],
               [CALL, CALL, CALL, format_call("answer", {"value": 2})]]
    loop, _, trajs = run(tokenizer, tasks, scripts)
    assert [t.reward for t in trajs] == [1.0, 0.0, 1.0]
    assert [len(t.turn_spans) for t in trajs] == [2, 1, 4]
    assert loop.stats.per_round_batch == [3, 2, 1, 1]
    assert [t.group_id for t in trajs] == ["g0", "g1", "g2"]


def test_context_budget_truncates(tokenizer):
    loop, _, (traj,) = run(tokenizer, [{"a": 2, "b": 3}], [[CALL] * 50], max_context_tokens=900)
    assert traj.prompt_len < 500 and len(traj.turn_spans) >= 2
    assert traj.finish_reason == "truncated:context" and len(traj) <= 900
    assert traj.reward == 0.0


def test_group_first_turn_is_one_prompt_with_n_samples(tiny_qwen3_dir, tokenizer):
    from k3rl.rollout.torch_engine import TorchEngine

    engine = TorchEngine.from_pretrained(tiny_qwen3_dir, seed=0)
    calls = []
    generate = engine.generate

    def recording(prompts, params, **sessions):
        calls.append((len(prompts), params.n))
        return generate(prompts, params, **sessions)

    engine.generate = recording
    loop = AgentLoop(engine, tokenizer, Calc, SamplingParams(max_tokens=8, seed=0), env_name="calc")
    trajs = loop.run([EpisodeRequest({"a": 1, "b": 2}, "t0", "g0", j) for j in range(3)]
                     + [EpisodeRequest({"a": 5, "b": 5}, "t1", "g1", j) for j in range(3)])
    assert calls[0] == (2, 3)  # two distinct prompts, three samples each, in one call
    assert len(trajs) == 6 and all(t.num_sampled > 0 for t in trajs)
    firsts = [t.tokens[t.turn_spans[0][0]:t.turn_spans[0][1]].tolist() for t in trajs[:3]]
    assert len({tuple(f) for f in firsts}) > 1  # the samples of a group differ


def compaction_setup(tokenizer):
    """(summary, task, renderer, opening messages, the restart's prompt tokens) of the compaction tests."""
    from k3rl.rollout.agent_loop import SUMMARY_HEADER

    summary, task = "Added 2 and 3.", {"a": 2, "b": 3}
    opening = [{"role": "system", "content": Calc().system_message()}, {"role": "user", "content": Calc().reset(task)}]
    renderer = AgentLoop(None, tokenizer, Calc, SamplingParams()).renderer
    return summary, task, renderer, opening, renderer.prompt_tokens(
        opening + [{"role": "user", "content": SUMMARY_HEADER + summary}])


def test_compaction_continues_the_episode_from_its_summary(tokenizer):
    """`Compaction`: past the budget the tool result is followed by the summary request, the summary turn is
    sampled (loss mask 1) and the episode goes on as a second sequence from [system, task, summary]; both
    sequences share the episode id and its reward, and the environment kept its state across the cut."""
    from k3rl.rollout.agent_loop import Compaction, episode_trajectories

    summary, task, renderer, opening, restart = compaction_setup(tokenizer)
    first_turn = len(renderer.prompt_tokens(opening)) + len(tokenizer(CALL, add_special_tokens=False)["input_ids"])
    assert first_turn + 8 > len(restart) + 1  # the first tool result crosses the budget below
    compaction = Compaction(tokens=len(restart) + 1, prompt="Summarise <|im_end|> now.", summary_tokens=32)
    loop, engine, (item,) = run(tokenizer, [task], [[CALL, summary, ANSWER]], compaction=compaction,
                                 prefix_cut=10)
    first, second = episode_trajectories(item)
    assert first.episode_id == second.episode_id == "g0#0" and first.reward == second.reward == 1.0
    assert first.metrics["compactions"] == second.metrics["compactions"] == 1.0
    assert second.info["summaries"] == [summary] and second.finish_reason == "done"
    # the first sequence: the call, its result and the request (context), the summary as sampled
    (call, summ) = [first.tokens[a:b].tolist() for a, b in first.turn_spans]
    assert tokenizer.decode(summ) == summary and first.loss_mask[first.turn_spans[1][0]:].all()
    between = tokenizer.decode(first.tokens[first.turn_spans[0][1]:first.turn_spans[1][0]])
    assert "Summarise" in between and "<|im_end|> now" not in between  # the request went through the sanitiser
    # the second sequence starts over from the opening and the summary: what the engine was given for the answer
    assert second.tokens[:second.prompt_len].tolist() == restart == engine.seen_prompts[-1]
    assert tokenizer.decode(second.tokens[second.turn_spans[0][0]:second.turn_spans[0][1]]) == ANSWER
    assert second.metrics["tool_calls"] == 1.0  # the environment's own counters ran on across the cut


def test_compaction_stops_when_the_summary_does_not_shorten_the_context(tokenizer):
    from k3rl.rollout.agent_loop import Compaction, episode_trajectories

    long_summary = "word " * 200
    compaction = Compaction(tokens=60, prompt="Summarise.", summary_tokens=400)
    _, _, (item,) = run(tokenizer, [{"a": 2, "b": 3}], [[CALL, long_summary, ANSWER]],
                          compaction=compaction, prefix_cut=10)
    (only,) = episode_trajectories(item)
    assert only.finish_reason == "truncated:context" and only.episode_id == ""


def test_a_compacted_episode_paused_between_turns_ends_as_the_whole_run(tokenizer):
    """Partial rollouts (`run(max_rounds=1)`, then `resume`) with compaction: the paused episode carries its ended
    sequences and its summary request across the pauses, and ends with the sequences of an uninterrupted run."""
    from k3rl.rollout.agent_loop import Compaction, episode_trajectories

    summary, task, renderer, opening, restart = compaction_setup(tokenizer)
    compaction = Compaction(tokens=len(restart) + 1, prompt="Summarise.", summary_tokens=32)
    loop, engine, (whole,) = run(tokenizer, [task], [[CALL, summary, ANSWER]], compaction=compaction, prefix_cut=10)
    engine.scripts = [[CALL, summary, ANSWER]]
    items = loop.run([EpisodeRequest(task, "t0", "g0")], max_rounds=1)
    pauses = 0
    while not isinstance(items[0], list):
        pauses += 1
        items = loop.run([], max_rounds=1, resume=items)
    assert pauses == 2  # paused after the call and after the summary
    got, want = episode_trajectories(items[0]), episode_trajectories(whole)
    assert [t.tokens.tolist() for t in got] == [t.tokens.tolist() for t in want]
    assert [t.episode_id for t in got] == ["g0#0", "g0#0"] and all(t.metrics["pauses"] == 2 for t in got)
