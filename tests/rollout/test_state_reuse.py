"""State reuse across turns (rollout/sessions.py, rollout/torch_engine.py, `K3Cache.stack`): the same tokens and
logprobs as prefilling every turn in full, for fewer prefilled tokens.

A tiny float64 K3 (tests/model/k3_factory.py) samples random text with the tiny Qwen3's tokenizer; so that
its turns go on, the tool-call parser is replaced by one that reads any text as a call (which one, and how
long its observation is, hashed from the text), and `answer` refuses to end an episode before its third turn.
Torch runs on one thread here: the tiny model's steps are too small to share, and on a busy 2-core box two
threads made them 30 times slower.
"""

from __future__ import annotations

import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import k3rl.envs.tools as T
from k3rl.envs import Env, tool
from k3rl.envs.base import Budget
from k3rl.model.policy import Policy
from k3rl.rollout.agent_loop import AgentLoop, EpisodeRequest
from k3rl.rollout.engine import SamplingParams, SessionEngine
from k3rl.rollout.torch_engine import TorchEngine
from tests.model.k3_factory import make_config, make_model


class Probe(Env):
    """Look around a few times, then answer (from the third turn on)."""

    def reset(self, task):
        self.turn = 0
        return f"Task {task['id']}: " + " ".join(["find the word"] * task["words"])

    @tool
    def look(self, k: int) -> str:
        """Look.

        Args:
            k: how far
        """
        self.turn += 1
        return " ".join(f"seen {j}" for j in range(k))

    @tool(terminal=True)
    def answer(self) -> float:
        """Answer."""
        self.turn += 1
        if self.turn < 3:
            raise ValueError("too early to answer")
        return 1.0


def every_text_is_a_call(text: str):
    h = zlib.crc32(text.encode())
    return T.ToolCall("answer", {}) if h % 3 == 0 else T.ToolCall("look", {"k": 1 + h % 9})


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen3_dir)


def k3(tokenizer, nope: bool, seed: int = 0):
    cfg = make_config(num_hidden_layers=4, kda_layers=(1, 2, 4), vocab_size=len(tokenizer), mla_use_nope=nope,
                      rope_theta=300.0)
    return make_model(cfg, seed=seed)


def recorded(engine):
    """Every completion the engine returns, in call order."""
    log, generate = [], engine.generate

    def recording(prompts, params, **kw):
        out = generate(prompts, params, **kw)
        log.extend(c for samples in out for c in samples)
        return out

    engine.generate = recording
    return log


def assert_same(got, ref):
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert np.abs(np.array(a.logprobs) - np.array(b.logprobs)).max() < 1e-9


@pytest.mark.parametrize("nope", [True, False], ids=["nope", "rope"])
@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["sampled", "greedy"])
def test_agent_loop_same_episodes_fewer_prefilled_tokens(monkeypatch, tokenizer, nope, temperature):
    monkeypatch.setattr(T, "parse", every_text_is_a_call)
    model = k3(tokenizer, nope)
    tasks = [{"id": i, "words": w} for i, w in enumerate((3, 11, 6))]
    requests = [EpisodeRequest(t, f"t{t['id']}", f"g{t['id']}", j) for t in tasks for j in range(2)]
    params = SamplingParams(temperature=temperature, max_tokens=6, seed=3)
    runs = {}
    for reuse in (False, True):
        engine = TorchEngine(model, tokenizer, max_batch=4, reuse_state=reuse)
        log = recorded(engine)
        loop = AgentLoop(engine, tokenizer, Probe, params, budget=Budget(max_turns=5), max_context_tokens=2048)
        trajectories = loop.run(requests)
        runs[reuse] = (engine, log, trajectories)
        assert len(engine.sessions) == 0  # every episode ended, and with it its session
    (off, off_log, off_trajs), (on, on_log, on_trajs) = runs[False], runs[True]
    assert_same(on_log, off_log)
    for a, b in zip(on_trajs, off_trajs):
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.loss_mask, b.loss_mask)
    turns = [len(t.turn_spans) for t in on_trajs]
    assert max(turns) >= 3 and len({len(t) for t in on_trajs}) > 1
    if temperature > 0:
        assert len(set(turns)) > 1
    assert off.stats.resumed_prompts == 0 and off.stats.reused_tokens == 0
    assert on.stats.resumed_prompts > 0 and on.stats.prefix_fallbacks == on.stats.version_fallbacks == 0
    assert on.stats.prefilled_tokens + on.stats.reused_tokens == off.stats.prefilled_tokens
    assert on.stats.prefilled_tokens < off.stats.prefilled_tokens / 2
    if temperature == 0.0:  # a group's samples agree, so later turns too go as one prompt with n=2
        assert on_trajs[0].tokens.tolist() == on_trajs[1].tokens.tolist()


@pytest.mark.parametrize("nope", [True, False], ids=["nope", "rope"])
def test_stack_of_different_lengths_equals_each_row(nope):
    """Rows of 13, 5 (from a padded batch) and 9 tokens stacked, then 2 tokens each and 2 decode steps: the
    logits of each row alone (a full forward), and `unstack` gives back each row's own state."""
    model = make_model(make_config(num_hidden_layers=4, kda_layers=(1, 2, 4), mla_use_nope=nope, rope_theta=300.0),
                       seed=1)
    policy = Policy(model)
    torch.manual_seed(0)
    seqs = [torch.randint(3, 97, (n,)) for n in (13, 5, 9)]
    news = torch.randint(3, 97, (3, 4))
    with torch.no_grad():
        alone = [policy.prefill(s[None], torch.ones(1, len(s), dtype=torch.long), 20)[1] for s in seqs]
        ids = torch.zeros(2, 13, dtype=torch.long)  # rows 0 and 1 as one left-padded batch
        mask = torch.zeros(2, 13, dtype=torch.long)
        for b in (0, 1):
            ids[b, 13 - len(seqs[b]):], mask[b, 13 - len(seqs[b]):] = seqs[b], 1
        _, batch = policy.prefill(ids, mask, 20)
        state = policy.stack([batch, policy.split(alone[2], [0])[0]], capacity=20)
        assert state["cache"].pad_len.tolist() == [0, 8, 4]
        for b, row in enumerate(state["cache"].unstack()):
            ref = alone[b]["cache"]
            assert row.seq_len == ref.seq_len == len(seqs[b])
            for i in ref.latent:
                torch.testing.assert_close(row.latent[i][0], ref.latent[i][0, :ref.seq_len], atol=1e-12, rtol=0)
            for i in ref.recurrent:
                torch.testing.assert_close(row.recurrent[i], ref.recurrent[i], atol=1e-12, rtol=0)
                torch.testing.assert_close(row.conv[i], ref.conv[i], atol=1e-12, rtol=0)
        logits, state = policy.extend(news[:, :2], state)
        steps = [logits]
        for j in (2, 3):
            logits, state = policy.decode(news[:, j], state)
            steps.append(logits)
        got = torch.stack(steps, 1)  # [3, 3, V]
        for b, s in enumerate(seqs):
            full = model(torch.cat([s, news[b]])[None]).logits[0]
            torch.testing.assert_close(got[b], full[len(s) + 1:], atol=1e-10, rtol=1e-9)


def engines(nope: bool = False):
    model = make_model(make_config(num_hidden_layers=4, kda_layers=(1, 2, 4), mla_use_nope=nope, rope_theta=300.0),
                       seed=2)
    tok = SimpleNamespace(eos_token_id=2, pad_token_id=0)  # no stop strings: the engine never decodes text
    return TorchEngine(model, tok, reuse_state=True), TorchEngine(model, tok, reuse_state=False)


def next_turn(prompt, completion, observation):
    return list(prompt) + completion.token_ids + observation


def test_prefix_mismatch_and_new_prompt_fall_back_in_one_batch():
    """Turn 2 of three sessions: one extends its tokens (resumed), one changed an earlier token (prefilled in
    full, counted), one is new; batched together they still equal prefilling every prompt."""
    on, off = engines()
    params = SamplingParams(temperature=1.0, max_tokens=5, seed=7)
    prompts = [[3 + i % 90 for i in range(n)] for n in (21, 8, 14)]
    first = on.generate(prompts, params, sessions=[["a"], ["b"], ["c"]])
    assert_same([c for o in first for c in o], [c for o in off.generate(prompts, params) for c in o])
    assert on.session_version("a") == 0 and len(on.sessions) == 3
    turn2 = [next_turn(prompts[0], first[0][0], [40, 41, 42]),
             [50] + next_turn(prompts[1], first[1][0], [43])[1:],  # its first token changed
             [60, 61, 62, 63, 64, 65, 66]]
    got = on.generate(turn2, params, sessions=[["a"], ["b"], ["new"]])
    assert_same([c for o in got for c in o], [c for o in off.generate(turn2, params) for c in o])
    assert on.stats.resumed_prompts == 1 and on.stats.prefix_fallbacks == 1 and on.stats.full_prompts == 3 + 2
    assert on.stats.reused_tokens == len(prompts[0]) + len(first[0][0].token_ids) - 1  # the last one was pending
    on.end_sessions(["a", "b", "c", "new"])
    assert len(on.sessions) == 0


def test_group_of_samples_resumes_each_own_state():
    """A prompt with n=3 samples keeps three sessions; each sample's next turn continues its own."""
    on, off = engines(nope=True)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=1)
    prompt = [5 + i % 80 for i in range(17)]
    (first,) = on.generate([prompt], params, sessions=[["s0", "s1", "s2"]])
    assert_same(first, off.generate([prompt], params)[0])
    turn2 = [next_turn(prompt, c, [7] * (j + 1)) for j, c in enumerate(first)]
    one = SamplingParams(temperature=1.0, max_tokens=6, seed=2)
    got = on.generate(turn2, one, sessions=[["s0"], ["s1"], ["s2"]])
    assert_same([c for o in got for c in o], [c for o in off.generate(turn2, one) for c in o])
    assert on.stats.resumed_prompts == 3 and on.stats.full_prompts == 1


def test_weight_reload_drops_sessions_unless_kept():
    on, off = engines()
    params = SamplingParams(temperature=0.0, max_tokens=4)
    prompt = [3 + i % 50 for i in range(12)]
    (first,) = on.generate([prompt], params, sessions=[["a"]])[0]
    weights = {k: v.clone() for k, v in on.model.state_dict().items()}
    on.load_weights(weights.items(), version=1)
    assert len(on.sessions) == 0 and on.session_version("a") is None
    turn2 = [next_turn(prompt, first, [9, 9])]
    on.generate(turn2, params, sessions=[["a"]])
    assert on.stats.resumed_prompts == 0 and on.stats.version_fallbacks == 0 and on.stats.full_prompts == 2
    # kept across an update: the caller can see which weights computed it; generate does not resume it
    on.load_weights(weights.items(), version=2, keep_sessions=True)
    assert on.session_version("a") == 1
    turn3 = [next_turn(turn2[0], on.generate(turn2, params)[0][0], [11])]
    (got,) = on.generate(turn3, params, sessions=[["a"]])[0]
    assert on.stats.version_fallbacks == 1 and on.stats.resumed_prompts == 0
    assert_same([got], off.generate(turn3, params)[0])
    on.reset_cache()
    assert len(on.sessions) == 0


def test_resume_stale_continues_a_session_older_weights_computed():
    """`resume_stale` (partial_resume=keep_state): a session kept across a weight update is continued, not
    prefilled in full; its tokens that older weights computed are counted per sample and in `stats`, and still
    on the next turn for the part of the state they computed."""
    on, off = engines()
    on.resume_stale = True
    params = SamplingParams(temperature=0.0, max_tokens=4)
    prompt = [3 + i % 50 for i in range(12)]
    (first,) = on.generate([prompt], params, sessions=[["a"]])[0]
    assert first.stale_state_tokens == 0
    on.load_weights({k: v.clone() for k, v in on.model.state_dict().items()}.items(), version=1, keep_sessions=True)
    kept = len(prompt) + len(first.token_ids) - 1  # the last sampled token was pending
    turn2 = [next_turn(prompt, first, [9, 9])]
    (second,) = on.generate(turn2, params, sessions=[["a"]])[0]
    assert_same([second], off.generate(turn2, params)[0])  # the same weights: the tokens of a full prefill
    assert second.stale_state_tokens == on.stats.stale_state_tokens == kept
    assert on.stats.resumed_prompts == 1 and on.stats.version_fallbacks == 0 and on.stats.full_prompts == 1
    # no update before turn 3: only the part version 0 computed is stale
    (third,) = on.generate([next_turn(turn2[0], second, [11])], params, sessions=[["a"]])[0]
    assert third.stale_state_tokens == kept and on.stats.stale_state_tokens == 2 * kept
    assert on.stats.resumed_prompts == 2 and on.session_version("a") == 1


def test_hf_model_and_reuse_off_prefill_in_full(tiny_qwen3_dir):
    """HF causal LMs keep no sessions (their KV caches are not stacked): every prompt is prefilled in full."""
    from k3rl.rollout.worker import engine_settings

    assert "reuse_state" in engine_settings("torch")
    engine = TorchEngine.from_pretrained(tiny_qwen3_dir, seed=0)
    assert isinstance(engine, SessionEngine) and not engine.keeps_state
    params = SamplingParams(max_tokens=4, seed=0)
    prompt = [5, 6, 7, 8]
    (c,) = engine.generate([prompt], params, sessions=[["x"]])[0]
    assert len(engine.sessions) == 0
    engine.generate([next_turn(prompt, c, [9])], params, sessions=[["x"]])
    assert engine.stats.resumed_prompts == 0
    assert engine.stats.prefilled_tokens == len(prompt) + len(prompt) + len(c.token_ids) + 1


def test_paused_episode_keeps_its_session(monkeypatch, tokenizer):
    """Partial rollouts: an episode paused at a turn boundary keeps its state in the engine and its next turn
    resumes from it; the episodes equal those of one uninterrupted run."""
    monkeypatch.setattr(T, "parse", every_text_is_a_call)
    model = k3(tokenizer, nope=False, seed=4)
    requests = [EpisodeRequest({"id": i, "words": w}, f"t{i}", f"g{i}") for i, w in enumerate((2, 7))]
    params = SamplingParams(temperature=1.0, max_tokens=5, seed=11)
    whole = AgentLoop(TorchEngine(model, tokenizer), tokenizer, Probe, params, budget=Budget(max_turns=4)).run(requests)
    engine = TorchEngine(model, tokenizer)
    loop = AgentLoop(engine, tokenizer, Probe, params, budget=Budget(max_turns=4))
    paused = loop.run(requests, max_rounds=1)
    assert len(engine.sessions) == 2 and engine.stats.resumed_prompts == 0
    done = loop.run([], resume=paused)
    assert engine.stats.resumed_prompts >= 2 and len(engine.sessions) == 0
    for a, b in zip(done, whole):
        assert np.array_equal(a.tokens, b.tokens) and np.allclose(a.logprobs, b.logprobs, atol=1e-6, rtol=0)


def test_compacted_episodes_start_a_fresh_session(monkeypatch, tokenizer):
    """Context compaction (rollout/agent_loop.py) on the native K3 engine: after a summary the episode's new start
    is prefilled once in a session of its own and its later turns reuse that state; the episodes equal those of an
    engine that prefills every turn in full, and no session outlives its episode."""
    from k3rl.rollout.agent_loop import Compaction, episode_trajectories

    monkeypatch.setattr(T, "parse", every_text_is_a_call)
    model = k3(tokenizer, nope=False, seed=2)
    tasks = [{"id": i, "words": w} for i, w in enumerate((2, 5))]
    requests = [EpisodeRequest(t, f"t{t['id']}", f"g{t['id']}", j) for t in tasks for j in range(2)]
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=5)
    opening = AgentLoop(None, tokenizer, Probe, params).renderer.prompt_tokens(
        [{"role": "system", "content": Probe().system_message()}, {"role": "user", "content": Probe().reset(tasks[1])}])
    compaction = Compaction(tokens=len(opening) + 70, prompt="Summarise.", summary_tokens=6)
    runs = {}
    for reuse in (False, True):
        engine = TorchEngine(model, tokenizer, max_batch=4, reuse_state=reuse)
        loop = AgentLoop(engine, tokenizer, Probe, params, budget=Budget(max_turns=8), max_context_tokens=2048,
                         compaction=compaction)
        runs[reuse] = (engine, [t for item in loop.run(requests) for t in episode_trajectories(item)])
        assert len(engine.sessions) == 0
    (off, off_trajs), (on, on_trajs) = runs[False], runs[True]
    assert [t.tokens.tolist() for t in on_trajs] == [t.tokens.tolist() for t in off_trajs]
    assert any(t.metrics.get("compactions", 0) >= 1 for t in on_trajs)
    assert len(on_trajs) > len(requests)  # compacted episodes hand back several sequences
    assert on.stats.prefix_fallbacks == 0 and on.stats.resumed_prompts > 0
    assert on.stats.prefilled_tokens < off.stats.prefilled_tokens
