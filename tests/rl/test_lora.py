"""LoRA through PEFT (rl/train/lora.py, `learner.lora`): in float64, the adapters' gradients are the full model's
gradients (at the merged weights) projected onto the adapters — K3 with its stacked routed experts targeted, and a
tiny Qwen3; only adapters train and hold optimizer state; the engines get merged weights that give the learner's
log-probs; a checkpoint holds the merged model (read as a plain one) and PEFT's adapter files (read by
`PeftModel.from_pretrained`), and a resume restores the adapters and their optimizer state exactly."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from k3rl.model.policy import load_policy
from k3rl.rl.config.learner import LoraSettings
from k3rl.rl.train import lora
from k3rl.rl.train.learner import Learner, LearnerConfig
from tests.rl.test_learner import PROMPTS, behaviour, sample, save_tiny_k3

K3_PROMPTS = [[5, 17, 42, 99, 7, 250], [11, 12, 300, 8]]


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-k3-lora")
    save_tiny_k3(path)
    return path


def randomise_adapters(model: torch.nn.Module, seed: int = 0) -> None:
    """PEFT starts B at 0 (ΔW = 0, and A gets no gradient): give both factors values so every path is tested."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids).logits[:, :-1]
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).sum()


@pytest.mark.parametrize("family", ["k3", "qwen3"])
def test_adapter_gradients_are_the_full_gradients_projected(family, k3_dir, tiny_qwen3_dir):
    path = k3_dir if family == "k3" else tiny_qwen3_dir
    policy = load_policy(path, torch.float64, torch.device("cpu"))
    peft_model = lora.apply_lora(policy, LoraSettings(rank=3, alpha=6.0))
    model = policy.model
    randomise_adapters(model)
    layers = dict(lora.adapted_tensors(model))
    if family == "k3":
        leaf = {n.removesuffix(".weight").rsplit(".", 1)[1] for n in layers}
        assert leaf >= {"w1", "w2", "w3", "q_proj", "kv_b_proj", "gate_proj"}
        assert not any(n.endswith("gate.weight") for n in layers)  # the routers stay frozen
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert type(peft_model).__name__ == ("PeftModel" if family == "k3" else "PeftModelForCausalLM")

    plain = load_policy(path, torch.float64, torch.device("cpu")).model
    merged = lora.merged_state_dict(model)
    assert merged.keys() == plain.state_dict().keys()
    plain.load_state_dict(merged)
    ids = torch.tensor([[5, 17, 42, 99, 7, 250, 11, 12, 300, 8, 60, 61]])
    torch.testing.assert_close(model(ids).logits, plain(ids).logits, atol=1e-10, rtol=0)

    loss_of(model, ids).backward()
    loss_of(plain, ids).backward()
    full = dict(plain.named_parameters())
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)
    for name, layer in layers.items():
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        expected = torch.autograd.grad(layer.get_delta_weight("default"), [a, b], full[name].grad)
        torch.testing.assert_close(a.grad, expected[0], atol=1e-10, rtol=1e-8, msg=f"{name} A")
        torch.testing.assert_close(b.grad, expected[1], atol=1e-10, rtol=1e-8, msg=f"{name} B")


def k3_learner(path, **kw) -> Learner:
    return Learner(LearnerConfig(**{**dict(model_path=str(path), lr=1e-2, max_grad_norm=10.0,
                                           micro_batch_tokens=64, lora=LoraSettings(rank=4, alpha=8.0)), **kw}))


def k3_engine(path):
    """The tiny K3's engine without a tokenizer (ids only: no stop strings, no decoding)."""
    from k3rl.rollout.torch_engine import TorchEngine

    model = load_policy(path, torch.float32, torch.device("cpu")).model
    return TorchEngine(model, SimpleNamespace(eos_token_id=None, pad_token_id=0), seed=0)


@pytest.fixture(scope="module")
def k3_batch(k3_dir):
    return sample(k3_engine(k3_dir), K3_PROMPTS, group_size=3, max_tokens=8)


def test_a_lora_learner_trains_adapters_only_and_engines_get_its_merged_weights(k3_dir, k3_batch):
    learner = k3_learner(k3_dir)
    frozen = {n: p.detach().clone() for n, p in learner.model.named_parameters() if ".lora_" not in n}
    adapters = [p for n, p in learner.model.named_parameters() if ".lora_" in n]
    assert {id(p) for p in learner.params} == {id(p) for p in adapters}
    for _ in range(2):
        m = learner.train_step(k3_batch)
        assert m["skipped"] == 0.0
    assert all(torch.equal(frozen[n], p) for n, p in learner.model.named_parameters() if ".lora_" not in n)
    state = [t for o in learner.optimizers for s in o.state.values() for t in s.values() if torch.is_tensor(t)
             and t.dim() > 0]
    assert state and sum(t.numel() for t in state) == 2 * sum(p.numel() for p in adapters)  # Adam's two moments
    assert m["trainable_params"] == sum(p.numel() for p in adapters)
    steps = sum(1 for o in learner.optimizers for s in o.state.values() for t in s.values() if torch.is_tensor(t)
                and t.dim() == 0)  # AdamW's fp32 step count per tensor
    assert m["optimizer_state_mib"] * 2**20 == 2 * 4 * sum(p.numel() for p in adapters) + 4 * steps
    assert any(p.abs().sum() > 0 for n, p in learner.model.named_parameters() if ".lora_B" in n)  # they moved

    engine = k3_engine(k3_dir)
    engine.load_weights(learner.named_weights(), version=learner.version)
    fresh = sample(engine, K3_PROMPTS, group_size=2, max_tokens=6, seed=3)
    for t, lp in zip(fresh, learner.score(fresh)):
        np.testing.assert_allclose(lp, behaviour(t), atol=2e-4)


def test_a_lora_checkpoint_is_a_plain_model_plus_peft_adapters_and_resumes_exactly(tmp_path, k3_dir, k3_batch):
    learner = k3_learner(k3_dir)
    learner.train_step(k3_batch)
    learner.save(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "adapter" / "adapter_config.json").is_file()
    plain = load_policy(tmp_path / "ckpt", torch.float32, torch.device("cpu")).model.eval()
    ids = torch.tensor([K3_PROMPTS[0]])
    learner.model.eval()
    with torch.no_grad():  # float32: (W + BA)x and Wx + B(Ax) round differently (the float64 test is exact)
        torch.testing.assert_close(plain(ids).logits, learner.model(ids).logits, atol=1e-4, rtol=0)
    learner.model.train()

    resumed = k3_learner(k3_dir)
    resumed.load(tmp_path / "ckpt")
    mine = lora.adapter_state_dict(learner.lora)
    assert mine.keys() == lora.adapter_state_dict(resumed.lora).keys()
    assert all(torch.equal(mine[k], t) for k, t in lora.adapter_state_dict(resumed.lora).items())
    a, b = learner.train_step(k3_batch), resumed.train_step(k3_batch)
    assert a["loss"] == b["loss"]
    after = lora.adapter_state_dict(resumed.lora)
    assert all(torch.equal(t, after[k]) for k, t in lora.adapter_state_dict(learner.lora).items())

    other = k3_learner(k3_dir, lora=LoraSettings(rank=2))
    with pytest.raises(Exception, match="do not match this learner's"):
        other.load(tmp_path / "ckpt")
    full = Learner(LearnerConfig(model_path=str(k3_dir), lr=1e-2, micro_batch_tokens=64))
    full.save(tmp_path / "full")
    with pytest.raises(Exception, match="not written by a LoRA learner"):
        k3_learner(k3_dir).load(tmp_path / "full")


def test_peft_reads_the_adapters_of_a_qwen3_checkpoint(tmp_path, tiny_qwen3_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from k3rl.rollout.torch_engine import TorchEngine

    batch = sample(TorchEngine.from_pretrained(tiny_qwen3_dir, seed=0), PROMPTS)
    learner = Learner(LearnerConfig(model_path=str(tiny_qwen3_dir), lr=1e-2, micro_batch_tokens=64,
                                    lora=LoraSettings(rank=4, alpha=8.0, targets=["q_proj", "v_proj", "down_proj"])))
    learner.train_step(batch)
    learner.save(tmp_path / "ckpt")
    base = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    peft_model = PeftModel.from_pretrained(base, tmp_path / "ckpt" / "adapter").eval()
    ids = torch.tensor([PROMPTS[0]])
    learner.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, learner.model(ids).logits, atol=1e-6, rtol=0)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt").eval()
        torch.testing.assert_close(merged(ids).logits, learner.model(ids).logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("settings, message", [
    (dict(lora=LoraSettings(rank=4), expert_parallel=2), "lora: adapters on a sharded learner"),
    (dict(lora=LoraSettings(rank=-1)), "lora: rank ≥ 0"),
])
def test_bad_lora_settings_are_named(k3_dir, settings, message):
    with pytest.raises(ValueError, match=message):
        LearnerConfig(model_path=str(k3_dir), **settings)


def test_a_target_that_matches_nothing_is_named(k3_dir):
    with pytest.raises(ValueError, match="learner.lora.targets"):
        k3_learner(k3_dir, lora=LoraSettings(rank=2, targets=["no_such_proj"]))


def test_the_plans_adapter_count_is_what_peft_builds(k3_dir):
    """rl/pretrain/param_memory.py `lora_parameters` (bench/parallel.py --plan's LoRA rows) counts the adapters PEFT
    puts on the model, here the tiny K3."""
    from k3rl.rl.pretrain.param_memory import lora_parameters

    policy = load_policy(k3_dir, torch.float32, torch.device("cpu"))
    lora.apply_lora(policy, LoraSettings(rank=5))
    built = sum(p.numel() for n, p in policy.model.named_parameters() if ".lora_" in n)
    assert sum(lora_parameters(policy.model.config, 5).values()) == built


def test_export_merges_the_adapters_into_their_base(tmp_path, k3_dir, k3_batch, capsys):
    from k3rl.rl.commands.model_tools import export_main

    learner = k3_learner(k3_dir)
    learner.train_step(k3_batch)
    learner.save(tmp_path / "ckpt")
    assert export_main([str(k3_dir), str(tmp_path / "out"), "--merge-lora", str(tmp_path / "ckpt" / "adapter")]) == 0
    assert "LoRA adapters of" in capsys.readouterr().out
    exported = load_policy(tmp_path / "out", torch.float32, torch.device("cpu")).model.eval()
    saved = load_policy(tmp_path / "ckpt", torch.float32, torch.device("cpu")).model.eval()
    ids = torch.tensor([K3_PROMPTS[1]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, saved(ids).logits, atol=1e-6, rtol=0)
    assert export_main([str(k3_dir), str(tmp_path / "bad"), "--merge-lora", str(tmp_path)]) == 2
    assert "no adapter_config.json" in capsys.readouterr().err


def nbytes(named) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def test_an_adapter_push_gives_the_native_engine_the_merged_weights(k3_dir, k3_batch):
    """`learner.lora.push: adapters`: the engine adds P @ Q to its own base copy (rollout/weight_transfer.py) and
    ends with the learner's merged weights, push after push (each exact, not a sum of the previous)."""
    learner = k3_learner(k3_dir)
    engine = k3_engine(k3_dir)
    for _ in range(2):
        learner.train_step(k3_batch)
        push = learner.push_weights()
        engine.load_weights(push, version=learner.version)
        merged = lora.merged_state_dict(learner.model)
        for name, t in engine.model.state_dict().items():
            torch.testing.assert_close(t, merged[name], atol=2e-6, rtol=0, msg=name)
    full = learner.named_weights()
    assert nbytes(push) < 0.5 * nbytes(full), (nbytes(push), nbytes(full))
    assert any(n.endswith("e_score_correction_bias") for n, _ in push)  # the routers' moved biases travel too
    fresh = sample(engine, K3_PROMPTS, group_size=2, max_tokens=6, seed=4)
    for t, lp in zip(fresh, learner.score(fresh)):
        np.testing.assert_allclose(lp, behaviour(t), atol=2e-4)

    before = {n: t.clone() for n, t in engine.model.state_dict().items()}
    broken = [(n, t) for n, t in push if not n.endswith("@lora_Q")]
    with pytest.raises(ValueError, match="incomplete factors"):
        engine.load_weights(broken, version=99)
    assert engine.version == learner.version
    assert all(torch.equal(before[n], t) for n, t in engine.model.state_dict().items())  # nothing written

    merged_push = k3_learner(k3_dir, lora=LoraSettings(rank=4, alpha=8.0, push="merged")).push_weights()
    assert [n for n, _ in merged_push] == [n for n, _ in full]


@pytest.mark.vllm
def test_vllm_serves_the_pushed_adapters_as_a_lora_adapter(tiny_qwen3_dir, vllm_cpu, tmp_path):
    """`learner.lora.push: adapters` to the vLLM engine (rollout/vllm_engine.py): each push becomes a vLLM LoRA
    adapter over the unchanged base, and vLLM's behaviour log-probs are the LoRA learner's, push after push, and
    with the learner's checkpoint adapter directory loaded as it is (`load_adapter_dir`); a push vLLM cannot serve
    is refused by name and the engine keeps the adapter it had."""
    from k3rl.rollout.vllm_engine import VLLMEngine

    learner = Learner(LearnerConfig(model_path=str(tiny_qwen3_dir), lr=5e-2, micro_batch_tokens=64,
                                    lora=LoraSettings(rank=4, alpha=8.0)))
    engine = VLLMEngine(tiny_qwen3_dir, max_model_len=256, seed=0, lora_rank=4)
    for step in range(2):
        learner.train_step(sample(engine, PROMPTS, group_size=2, max_tokens=6, seed=step))
        push = learner.push_weights()
        engine.load_weights(push, version=learner.version)
        fresh = sample(engine, PROMPTS, group_size=2, max_tokens=6, seed=10 + step)
        for t, lp in zip(fresh, learner.score(fresh)):
            np.testing.assert_allclose(lp, behaviour(t), atol=2e-4)
    assert nbytes(push) < 0.2 * nbytes(learner.named_weights())
    # a LoRA checkpoint's adapter directory (PEFT's format) is read by vLLM's LoRA loader as it is
    learner.save(tmp_path / "ckpt")
    engine.load_adapter_dir(tmp_path / "ckpt" / "adapter", version=learner.version)
    fresh = sample(engine, PROMPTS, group_size=2, max_tokens=6, seed=20)
    for t, lp in zip(fresh, learner.score(fresh)):
        np.testing.assert_allclose(lp, behaviour(t), atol=2e-4)
    engine.load_weights(push, version=learner.version)
    before = sample(engine, PROMPTS[:1], group_size=1, max_tokens=6, seed=3)
    with pytest.raises(ValueError, match="built for rank ≤ 4"):
        wide = [(n, torch.cat([t, t], dim=-1 if n.endswith("@lora_P") else 0)) for n, t in push]
        engine.load_weights(wide, version=99)
    with pytest.raises(ValueError, match="learner.lora.push=merged"):
        engine.load_weights(push + [("lm_head.weight", torch.zeros(1))], version=99)
    assert engine.version == learner.version
    after = sample(engine, PROMPTS[:1], group_size=1, max_tokens=6, seed=3)
    assert behaviour(after[0]).tolist() == behaviour(before[0]).tolist()


def adapters_of(learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters() if ".lora_" in n}


@pytest.mark.parametrize("option", [dict(share_prefix=False), dict(segment_tokens=5), dict(routing_replay=False)],
                         ids=["no-prefix-sharing", "segments", "no-routing-replay"])
def test_lora_steps_through_segments_prefix_sharing_and_routing_replay(k3_dir, k3_batch, option):
    """The learner's exact reorganisations of a step (segments, the group's shared prompt computed once, the
    rollout's routing replayed) give LoRA the same adapter update as the plain step; without routing replay the
    router may pick other experts, so only the frozen base is checked. AdamW with eps = 1 makes the first update
    ≈ −lr·gradient (no sign-like amplification of rounding in near-zero gradients)."""
    steps = {}
    for name, kw in (("plain", {}), ("option", option)):
        learner = k3_learner(k3_dir, adam_eps=1.0, lr=1.0, **kw)
        randomise_adapters(learner.model, seed=1)
        frozen = {n: p.detach().clone() for n, p in learner.model.named_parameters() if ".lora_" not in n}
        learner.train_step(k3_batch)
        assert all(torch.equal(frozen[n], p) for n, p in learner.model.named_parameters() if ".lora_" not in n)
        steps[name] = adapters_of(learner)
    if "routing_replay" not in option:
        for n, p in steps["plain"].items():
            torch.testing.assert_close(steps["option"][n], p, atol=2e-5, rtol=1e-4, msg=n)


def test_lora_with_muon_and_the_supervised_objective(k3_dir, k3_batch):
    """`optimizer: muon` and SFT's objective (`algo: nll`, what `k3rl sft` and pretraining run through the learner)
    train the adapters alone: Muon's momentum and AdamW's moments exist for adapter tensors only."""
    learner = k3_learner(k3_dir, optimizer="muon", algo="nll", lr=1e-3)
    before = adapters_of(learner)
    frozen = {n: p.detach().clone() for n, p in learner.model.named_parameters() if ".lora_" not in n}
    learner.train_step(k3_batch)
    adapters = {id(p) for n, p in learner.model.named_parameters() if ".lora_" in n}
    kinds = {type(o).__name__ for o in learner.optimizers}
    assert "Muon" in kinds and all(id(p) in adapters for o in learner.optimizers for p in o.state)
    assert all(torch.equal(frozen[n], p) for n, p in learner.model.named_parameters() if ".lora_" not in n)
    assert any(not torch.equal(before[n], p) for n, p in adapters_of(learner).items())


def test_lora_on_packed_documents_equals_the_documents_apart(k3_dir):
    """Pretraining rows through a LoRA learner (`algo: nll`, documents packed with restarting positions,
    rl/pretrain/packing.py): the adapters' gradients equal those of the documents trained as separate sequences
    (float64)."""
    from tests.rl.test_pretrain import packed, row

    rng = np.random.default_rng(0)
    docs = [rng.integers(20, 400, n) for n in (40, 13, 27)]
    grads = []
    for batch in ([packed(docs)], [row(d) for d in docs]):
        learner = k3_learner(k3_dir, algo="nll", dtype="float64", max_grad_norm=0.0, micro_batch_tokens=4096)
        randomise_adapters(learner.model, seed=2)
        captured = {}
        hooks = [p.register_post_accumulate_grad_hook(lambda p, n=n: captured.__setitem__(n, p.grad.clone()))
                 for n, p in learner.model.named_parameters() if p.requires_grad]
        learner.train_step(batch)
        for h in hooks:
            h.remove()
        assert captured and all(".lora_" in n for n in captured)
        grads.append(captured)
    assert grads[0].keys() == grads[1].keys()
    for n, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][n], atol=1e-10, rtol=1e-8, msg=n)
