"""A released-format K3 directory (MXFP4 experts, sharded, `language_model.` names) loads into k3rl and trains.

The directory is synthesized the way `moonshotai/Kimi-K3` is laid out, at tiny size (tests/model/k3_factory.py,
experts of width 32 so that MXFP4's groups of 32 fit): config.json from `config_json.released_config` plus an
llm-compressor-style compressed-tensors `quantization_config`, bfloat16 weights (the router bias float32)
sharded over ≥ 3 files with an index, the routed experts stored by `weight_files.write_weights` as
`weight_packed`/`weight_scale`. `load.load_model` must give a K3ForCausalLM whose weights equal, bit for
bit, a native model holding the dequantized values (computed here from model/formats/mxfp4.py on the stacked experts,
not through the reader), hence the same logits; and a `Learner` starts from the directory and takes a step.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from k3_factory import make_config, make_model

from k3rl.model.formats import mxfp4
from k3rl.model.formats.config_json import released_config
from k3rl.model.formats.load import load_model
from k3rl.model.formats.names import to_released_names
from k3rl.model.formats.weight_files import INDEX_NAME, write_weights


def _stored(name: str, t: torch.Tensor) -> torch.Tensor:
    """The dtype a released checkpoint stores `name` in: bfloat16, the router bias float32."""
    return t if name.endswith("e_score_correction_bias") or not t.is_floating_point() else t.to(torch.bfloat16)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(directory, native model, the state dict it should load as: float64, experts dequantized)."""
    config = make_config(moe_intermediate_size=32, checkpoint_layout="kimi_k3")
    native = make_model(config, dtype=torch.float32, seed=3)
    state = native.state_dict()
    directory = tmp_path_factory.mktemp("released-k3")
    tensors = {n: _stored(n, t) for n, t in to_released_names(state, "kimi_k3").items()}
    quantization = write_weights(directory, tensors, max_shard_bytes=16 << 10, quantize="mxfp4")
    assert quantization is not None
    raw = released_config(config, "kimi_k3", torch.bfloat16)
    # As llm-compressor writes it: every Linear targeted, the non-expert ones ignored.
    raw["quantization_config"] = mxfp4.quantization_config(
        targets=["Linear"], ignore=["lm_head", "re:.*self_attn.*", "re:.*mlp.*", "re:.*shared_experts.*", "re:.*gate$"])
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    want = {}
    for name, t in state.items():
        if ".experts.w" in name:  # stacked [E, out, in]: quantized along `in`, per expert and row
            want[name] = mxfp4.dequantize(*mxfp4.quantize(t.to(torch.bfloat16)), dtype=torch.float64)
        else:
            want[name] = _stored(name, t).to(torch.float64) if t.is_floating_point() else t
    return directory, native, want


def test_released_directory_layout(released):
    directory, _, _ = released
    index = json.loads((directory / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) >= 3
    names = index["weight_map"].keys()
    assert all(n.startswith("language_model.") for n in names)
    assert "language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_packed" in names
    assert not any(n.endswith("experts.3.w2.weight") for n in names)


def test_load_model_gives_the_dequantized_weights_and_their_logits(released):
    directory, native, want = released
    loaded = load_model(directory, dtype=torch.float64)
    got = loaded.state_dict()
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name].to(t.dtype), t), name
    experts = [n for n in want if ".experts.w" in n]
    assert experts and all(not torch.equal(want[n], native.state_dict()[n].double()) for n in experts)  # lossy
    reference = make_model(make_config(moe_intermediate_size=32, checkpoint_layout="kimi_k3"), dtype=torch.float64)
    reference.load_state_dict(want)
    ids = torch.randint(0, reference.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = loaded(ids).logits, reference(ids).logits
    torch.testing.assert_close(a, b, atol=1e-12, rtol=0.0)
    assert (a - native.double()(ids).logits).abs().max() > 1e-6  # the quantization is visible in the logits


def test_learner_starts_from_the_released_directory(released):
    from k3rl.rl.train.learner import Learner, LearnerConfig
    from k3rl.rollout.engine import SamplingParams
    from k3rl.rollout.torch_engine import TorchEngine
    from k3rl.rollout.trajectory import TrajectoryBuilder

    directory, _, _ = released
    learner = Learner(LearnerConfig(model_path=str(directory), lr=1e-3, max_grad_norm=10.0, micro_batch_tokens=64))
    engine = TorchEngine(load_model(directory), SimpleNamespace(eos_token_id=None, pad_token_id=0), seed=0)
    prompts = [[3, 10, 20, 30], [3, 7, 8]]
    trajectories = []
    for g, completions in enumerate(engine.generate(prompts, SamplingParams(n=2, max_tokens=5, seed=0))):
        for j, c in enumerate(completions):
            builder = TrajectoryBuilder(prompts[g])
            builder.append_sampled(c.token_ids, c.logprobs, version=0, routed_experts=c.routed_experts)
            trajectories.append(builder.finish(reward=float(j == 0), group_id=f"g{g}", task_id=f"t{g}"))
    before = {n: t.clone() for n, t in learner.named_weights()}
    metrics = learner.train_step(trajectories)
    assert metrics["skipped"] == 0.0 and metrics["mismatch_kl"] < 1e-5
    after = dict(learner.named_weights())
    expert = next(n for n in before if ".experts.w1" in n)
    assert not torch.equal(before[expert], after[expert])  # the dequantized experts train
