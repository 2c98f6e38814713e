"""TorchEngine: batched prefill + decode with left padding; logprobs equal a full forward pass."""

import pytest
import torch

from k3rl.rollout.engine import Engine, SamplingParams
from k3rl.rollout.torch_engine import TorchEngine, sample_tokens


def full_forward_logprobs(model, prompt, ids):
    with torch.no_grad():
        out = model(torch.tensor([prompt + ids]))
    logits = out.logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]


@pytest.fixture(scope="module")
def qwen_engine(tiny_qwen3_dir):
    return TorchEngine.from_pretrained(tiny_qwen3_dir, seed=0)


def test_hf_model_batched_different_lengths(qwen_engine):
    tok = qwen_engine.tokenizer
    prompts = [tok("Return the value of the key", add_special_tokens=False)["input_ids"], [5], [7, 8, 9]]
    out = qwen_engine.generate(prompts, SamplingParams(n=2, max_tokens=12, seed=0))
    assert isinstance(qwen_engine, Engine) and [len(o) for o in out] == [2, 2, 2]
    for prompt, samples in zip(prompts, out):
        for c in samples:
            ref = full_forward_logprobs(qwen_engine.model, prompt, c.token_ids)
            assert (ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max() < 1e-4


def test_stop_tokens_strings_and_early_finish(qwen_engine):
    tok = qwen_engine.tokenizer
    prompt = tok("Split the path", add_special_tokens=False)["input_ids"]
    (first,) = qwen_engine.generate([prompt], SamplingParams(max_tokens=16, seed=5))[0]
    stop_tok = first.token_ids[3]
    (c,) = qwen_engine.generate([prompt], SamplingParams(max_tokens=16, seed=5, stop_token_ids=(stop_tok,)))[0]
    assert c.token_ids == first.token_ids[:first.token_ids.index(stop_tok) + 1] and c.finish_reason == "stop"
    text = tok.decode(first.token_ids[:6])
    stop = next(text[i:i + 2] for i in range(len(text) - 1) if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    (c,) = qwen_engine.generate([prompt], SamplingParams(max_tokens=16, seed=5, stop=(stop,)))[0]
    assert stop in tok.decode(c.token_ids) and c.finish_reason == "stop" and len(c.token_ids) <= 6
    assert c.token_ids == first.token_ids[:len(c.token_ids)]


def test_weight_update_and_version(qwen_engine):
    tok = qwen_engine.tokenizer
    prompt = tok("json", add_special_tokens=False)["input_ids"]
    state = {k: v.clone() for k, v in qwen_engine.model.state_dict().items()}
    try:
        bumped = {k: v + 0.05 * torch.randn_like(v) for k, v in state.items()}
        qwen_engine.load_weights(bumped.items(), version=2)
        assert qwen_engine.version == 2
        (c,) = qwen_engine.generate([prompt], SamplingParams(max_tokens=8, seed=1))[0]
        ref = full_forward_logprobs(qwen_engine.model, prompt, c.token_ids)
        assert (ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max() < 1e-4
        with pytest.raises(ValueError, match="shape"):
            qwen_engine.load_weights([("lm_head.weight", torch.zeros(3, 3))], version=3)
        with pytest.raises(ValueError, match="no_such"):
            qwen_engine.load_weights([("no_such.weight", torch.zeros(3))], version=3)
        assert qwen_engine.version == 2
    finally:
        qwen_engine.load_weights(state.items(), version=0)


def test_sampling_distribution_top_p_and_greedy():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_tokens(logits, 1.0, 0.7, gen)[0] for _ in range(4000)])
    freq = torch.bincount(draws[:, 0], minlength=4).double() / 4000
    # top-p 0.7 keeps {0.5, 0.3} renormalised to {0.625, 0.375}
    assert abs(freq[0] - 0.625) < 0.03 and abs(freq[1] - 0.375) < 0.03 and freq[2:].sum() == 0
    tok, lp = sample_tokens(logits, 0.0, 1.0, gen)
    assert tok.item() == 0 and abs(lp.item() - torch.log(torch.tensor(0.5)).item()) < 1e-6
    draws = torch.stack([sample_tokens(logits, 2.0, 1.0, gen)[0] for _ in range(4000)])
    freq = torch.bincount(draws[:, 0], minlength=4).double() / 4000
    expected = torch.softmax(logits[0] / 2.0, -1).double()
    assert (freq - expected).abs().max() < 0.03


class _Tok:
    """The few tokenizer methods TorchEngine uses, for a K3 built without a trained tokenizer."""

    eos_token_id, pad_token_id = 2, 0

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(map(str, ids))


def test_k3_incremental_decode_matches_full_forward_batched_lengths():
    """The tiny-K3 path: left-padded prefill of prompts of different lengths, n samples each, rows
    dropped as they finish; every behaviour logprob equals a full forward pass over prompt + sample
    (float64), and every sampled token but the last carries its routed expert ids."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
    from k3_factory import make_model

    model = make_model(num_hidden_layers=4, kda_layers=(1, 2, 3))
    engine = TorchEngine(model, _Tok(), seed=0)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 97, (n,), generator=gen).tolist() for n in (5, 70, 1, 33)]
    out = engine.generate(prompts, SamplingParams(n=2, max_tokens=12, seed=4))
    lengths = set()
    for prompt, samples in zip(prompts, out):
        for c in samples:
            lengths.add(len(c.token_ids))
            with torch.no_grad():
                logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1]
            ref = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]
            # float64 model; the KDA gate is computed in fp32 (kernels/kda/gate.py), hence not 1e-12
            assert (ref - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max() < 1e-6
            assert len(c.routed_experts) == len(c.token_ids)
            assert all(min(min(layer) for layer in tok) >= 0 for tok in c.routed_experts[:-1])
    stopped = [c for s in out for c in s if c.finish_reason == "stop"]
    assert all(c.token_ids[-1] == 2 for c in stopped)
