"""VLLMEngine: the Engine protocol over vLLM on the CPU, weight updates included."""

import pytest
import torch

from k3rl.rollout.engine import Engine, SamplingParams

pytestmark = pytest.mark.vllm


def hf_logprobs(model, prompt, ids):
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]


def test_protocol_stop_strings_and_n(vllm_engine):
    assert isinstance(vllm_engine, Engine)
    tok = vllm_engine.tokenizer
    prompt = tok("Return the", add_special_tokens=False)["input_ids"]
    out = vllm_engine.generate([prompt, prompt[:2]], SamplingParams(n=3, max_tokens=8, seed=1))
    assert [len(o) for o in out] == [3, 3]
    for samples in out:
        for c in samples:
            assert len(c.token_ids) == len(c.logprobs) and c.finish_reason in ("length", "stop")
    # a stop string that the sampled text contains ends the sample there, and stays in the output
    first = out[0][0]
    text = tok.decode(first.token_ids)
    mid = len(text) // 2
    stop = next(text[i:i + 2] for i in range(mid, len(text) - 1) if text[i:i + 2].strip() and "\ufffd" not in text[i:i + 2])
    again = vllm_engine.generate([prompt], SamplingParams(n=3, max_tokens=8, seed=1, stop=(stop,)))[0][0]
    assert stop in tok.decode(again.token_ids) and again.finish_reason == "stop"
    assert again.token_ids == first.token_ids[:len(again.token_ids)]


def test_load_weights_changes_logprobs_to_the_new_model(vllm_engine, tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    prompt = vllm_engine.tokenizer("Split the path", add_special_tokens=False)["input_ids"]
    try:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        vllm_engine.load_weights(model.state_dict().items(), version=7)
        assert vllm_engine.version == 7
        c = vllm_engine.generate([prompt], SamplingParams(max_tokens=12, seed=2))[0][0]
        new = hf_logprobs(model, prompt, c.token_ids)
        assert (new - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max() < 1e-4
        model.load_state_dict(original)
        old = hf_logprobs(model, prompt, c.token_ids)
        assert (old - new).abs().max() > 1e-2  # the update really changed the model
    finally:
        vllm_engine.load_weights(original.items(), version=0)
    c = vllm_engine.generate([prompt], SamplingParams(max_tokens=6, seed=3))[0][0]
    assert (hf_logprobs(model, prompt, c.token_ids) - torch.tensor(c.logprobs, dtype=torch.float64)).abs().max() < 1e-4


def test_update_without_lm_head_is_refused(vllm_engine, tiny_qwen3_dir):
    from safetensors.torch import load_file

    weights = load_file(str(tiny_qwen3_dir / "model.safetensors"))
    weights.pop("lm_head.weight")
    with pytest.raises(ValueError, match="lm_head.weight"):
        vllm_engine.load_weights(weights.items(), version=1)
    assert vllm_engine.version == 0


def test_bad_sampling_params_are_named():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
