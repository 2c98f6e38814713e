"""vLLM on the CPU samples from a tiny Qwen3 built here; its logprobs are transformers' logprobs."""

import pytest
import torch

pytestmark = pytest.mark.vllm


def test_generate_logprobs_match_transformers(tiny_qwen3_dir, vllm_engine):
    import vllm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)
               for q in ("Which module parses JSON?", "Split a path into parts.")]
    llm = vllm_engine.llm
    params = vllm.SamplingParams(n=2, max_tokens=20, temperature=1.0, logprobs=0, seed=3)
    outs = llm.generate([vllm.inputs.TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    assert len(outs) == 2
    for prompt, out in zip(prompts, outs):
        assert len(out.outputs) == 2
        for sample in out.outputs:
            ids = list(sample.token_ids)
            assert 0 < len(ids) <= 20 and sample.finish_reason in ("length", "stop")
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].double()
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            got = torch.tensor([step[t].logprob for step, t in zip(sample.logprobs, ids)], dtype=torch.float64)
            assert (ref - got).abs().max().item() < 1e-4
            # the comparison is not vacuous: sampled tokens are not all near-certain
            assert ref.min().item() < -0.5


def test_tiny_qwen3_shape(tiny_qwen3_dir):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(tiny_qwen3_dir)
    tok = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    assert cfg.head_dim == 32 and not cfg.tie_word_embeddings and cfg.vocab_size == len(tok)
    text = "Return the JSON value of a string."
    assert tok.decode(tok(text)["input_ids"]) == text
