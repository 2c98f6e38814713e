"""Multi-turn search episodes through real engines: a tiny Qwen3 taught one oracle demonstration
(so it really calls tools) runs through vLLM and the native engine; the trajectory's behaviour
logprobs equal a transformers forward pass over the trajectory's own tokens.
"""

import pytest
import torch

import k3rl.envs as envs
from k3rl.envs.base import run_episode
from k3rl.rollout.agent_loop import AgentLoop, EpisodeRequest
from k3rl.rollout.chat import ChatRenderer
from k3rl.rollout.engine import SamplingParams
from k3rl.rollout.torch_engine import TorchEngine

PASSAGES = [{"id": f"p{i}", "title": f"Doc {i}", "text": f"Passage {i} says the code word is w{i * 7}."}
            for i in range(4)]
TASK = {"question": "What is the code word of passage 2?", "answers": ["w14"], "evidence": ["p2"],
        "passages": PASSAGES}


@pytest.fixture(scope="module")
def taught(tiny_qwen3_dir):
    """The tiny Qwen3 after overfitting the oracle's transcript of TASK (greedy decoding replays it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
    env = envs.make("search")
    demo = run_episode(env, TASK, env.oracle(TASK))
    assert demo.reward == 1.0
    r = ChatRenderer(tok)
    msgs = demo.messages
    tokens, mask = r.prompt_tokens(msgs[:2]), []
    mask = [0] * len(tokens)
    for m in msgs[2:]:
        if m["role"] == "assistant":
            ids = r.encode(m["content"])
        else:
            ids = r.observation_tokens(m["content"], turn_ended_with_eos=False)
        tokens += ids
        mask += [int(m["role"] == "assistant")] * len(ids)
    ids = torch.tensor([tokens])
    labels = torch.tensor([[t if k else -100 for t, k in zip(tokens, mask)]])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(120):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    assert loss.item() < 0.05
    return model, tok


def check_episode(traj, model, tok):
    assert traj.reward == 1.0 and traj.finish_reason == "done" and len(traj.turn_spans) >= 2
    with torch.no_grad():
        logits = model(torch.tensor([traj.tokens.tolist()])).logits[0].double()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(traj.tokens[1:], dtype=torch.long)[:, None])[:, 0]
    sampled = torch.tensor(traj.loss_mask[1:] == 1)
    assert (lp[sampled] - torch.tensor(traj.logprobs[1:][sampled.numpy()], dtype=torch.float64)).abs().max() < 1e-4
    text = tok.decode(traj.tokens.tolist())
    assert '"name": "search"' in text and '"name": "answer"' in text and "w14" in text


@pytest.mark.vllm
def test_vllm_multi_turn_search_episode(taught, vllm_engine, tiny_qwen3_dir):
    from safetensors.torch import load_file

    model, tok = taught
    original = load_file(str(tiny_qwen3_dir / "model.safetensors"))
    vllm_engine.load_weights(model.state_dict().items(), version=1)
    try:
        loop = AgentLoop(vllm_engine, tok, lambda: envs.make("search"), SamplingParams(temperature=0, max_tokens=160),
                         max_context_tokens=2048, env_name="search")
        (traj,) = loop.run([EpisodeRequest(TASK, "t0", "g0")])
        check_episode(traj, model, tok)
        assert set(traj.versions[traj.loss_mask == 1]) == {1}
    finally:
        vllm_engine.load_weights(original.items(), version=0)


def test_native_engine_multi_turn_search_episode(taught):
    model, tok = taught
    engine = TorchEngine(model, tok)
    loop = AgentLoop(engine, tok, lambda: envs.make("search"), SamplingParams(temperature=0, max_tokens=160),
                     max_context_tokens=2048, env_name="search")
    trajs = loop.run([EpisodeRequest(TASK, "t0", "g0"), EpisodeRequest(TASK, "t0", "g0", 1)])
    for traj in trajs:
        check_episode(traj, model, tok)

