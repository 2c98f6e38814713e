"""The learner on real models: logprobs agree with the rollout engine, a step moves logprobs the way the
advantages say, micro-batching and data parallelism do not change the update, the NaN guard skips
a step on every rank, weights and checkpoints round-trip exactly, and (tiny K3) router balancing
and routing replay.

Trajectories are sampled by `TorchEngine` from the same weights, so behaviour logprobs are the
policy's own. Invariance tests run in float64: Adam's first step is sign(g)·lr, and float32
summation noise on near-zero gradients would flip signs and hide real differences.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from k3rl.rl import checkpoint as ckpt
from k3rl.rl.train.batching import pack_micro_batches
from k3rl.rl.train.group import LearnerGroup
from k3rl.rl.train.learner import Learner, LearnerConfig
from k3rl.rl.train.parallel import split_balanced
from k3rl.rollout.engine import SamplingParams
from k3rl.rollout.trajectory import Trajectory, TrajectoryBuilder
from tests.hostile import RunsCode

PROMPTS = [[5, 17, 42, 99, 7, 250], [11, 12, 300, 8], [60, 61, 62, 63, 64, 65, 66]]


def sample(engine, prompts, group_size=4, max_tokens=10, seed=0, reward=lambda g, j: float(j == 0)):
    """One group per prompt; sample j of group g gets reward(g, j)."""
    outs = engine.generate(prompts, SamplingParams(n=group_size, max_tokens=max_tokens, seed=seed))
    trajectories = []
    for g, (prompt, completions) in enumerate(zip(prompts, outs)):
        for j, c in enumerate(completions):
            builder = TrajectoryBuilder(prompt)
            builder.append_sampled(c.token_ids, c.logprobs, version=0, routed_experts=c.routed_experts)
            trajectories.append(builder.finish(reward=reward(g, j), group_id=f"g{g}", task_id=f"t{g}"))
    return trajectories


def behaviour(t: Trajectory) -> np.ndarray:
    return t.logprobs[1:][t.loss_mask[1:].astype(bool)].astype(np.float64)


def weights(source) -> dict[str, torch.Tensor]:
    return dict(source.named_weights())


def assert_same_weights(a: dict, b: dict, atol: float = 0.0):
    """Bitwise equal (atol 0), or within atol for float64 tensors and 1e-6 for tensors a model keeps
    in float32 under a float64 policy (K3's conv and router-bias tensors)."""
    assert a.keys() == b.keys()
    for name in a:
        if atol == 0.0:
            assert torch.equal(a[name], b[name]), name
        else:
            tol = atol if a[name].dtype == torch.float64 else max(atol, 1e-6)
            torch.testing.assert_close(a[name], b[name], atol=tol, rtol=0.0, msg=name)


@pytest.fixture(scope="module")
def qwen_batch(tiny_qwen3_dir):
    from k3rl.rollout.torch_engine import TorchEngine

    engine = TorchEngine.from_pretrained(tiny_qwen3_dir, seed=0)
    return sample(engine, PROMPTS)


def qwen_cfg(model_dir, **kw) -> LearnerConfig:
    base = dict(model_path=str(model_dir), lr=1e-4, max_grad_norm=10.0, micro_batch_tokens=64)
    return LearnerConfig(**{**base, **kw})


def test_pack_micro_batches_respects_budget():
    lengths = [5, 17, 3, 9, 9, 30, 1]
    batches = pack_micro_batches(lengths, 20)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 20
    assert [5] in batches  # longer than the budget: alone
    capped = pack_micro_batches([2] * 7, 100, max_seqs=3)
    assert [len(b) for b in capped] == [3, 3, 1]
    assert split_balanced([10, 1, 1, 8], 2) == [[0], [1, 2, 3]]  # loads 10 and 10
    assert split_balanced([3], 2) == [[0], []]


def test_logprobs_match_engine_and_first_step_is_on_policy(tiny_qwen3_dir, qwen_batch):
    learner = Learner(qwen_cfg(tiny_qwen3_dir))
    for t, lp in zip(qwen_batch, learner.score(qwen_batch)):
        np.testing.assert_allclose(lp, behaviour(t), atol=1e-4)
    m = learner.train_step(qwen_batch)
    assert m["skipped"] == 0.0 and m["skip_reason"] == "" and m["version"] == learner.version == 1
    assert m["mismatch_kl"] < 1e-6 and abs(m["tis_weight"] - 1.0) < 1e-4 and m["clip_frac"] == 0.0
    assert m["num_seqs"] == len(qwen_batch) and m["num_loss_tokens"] == sum(len(behaviour(t)) for t in qwen_batch)
    assert m["grad_norm"] > 0 and m["train_tokens_per_s"] > 0 and m["micro_batches"] >= 2


def test_steps_raise_rewarded_and_lower_unrewarded_logprobs(tiny_qwen3_dir, qwen_batch):
    learner = Learner(qwen_cfg(tiny_qwen3_dir))
    before = [lp.sum() for lp in learner.score(qwen_batch)]
    initial = weights(learner)
    for _ in range(3):
        assert learner.train_step(qwen_batch)["skipped"] == 0.0
    after = [lp.sum() for lp in learner.score(qwen_batch)]
    delta = np.array(after) - np.array(before)
    rewarded = np.array([t.reward == 1.0 for t in qwen_batch])
    assert (delta[rewarded] > 0).all(), delta
    assert (delta[~rewarded] < 0).all(), delta
    changed = weights(learner)
    assert any(not torch.equal(initial[k], changed[k]) for k in initial)
    assert learner.version == 3


def test_kl_to_reference_starts_at_zero_and_grows(tiny_qwen3_dir, qwen_batch):
    from k3rl.rl.config import load_config

    cfg = LearnerConfig.from_job(load_config(None, ["algo.name=ppo", "learner.lr=1e-3"]), tiny_qwen3_dir,
                                 algo_args={"kl_coef": 0.1}, micro_batch_tokens=64)
    assert (cfg.algo, cfg.lr, cfg.model_path) == ("ppo", 1e-3, str(tiny_qwen3_dir))
    learner = Learner(cfg)
    assert learner.ref_policy is not None
    first = learner.train_step(qwen_batch)
    second = learner.train_step(qwen_batch)
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-9) and second["kl_ref"] > 1e-4


@pytest.mark.parametrize("key,bad", [("optimizer", "sgd"), ("dtype", "int8"), ("lr_scheduler", "step")])
def test_the_loader_refuses_a_choice_the_learner_does_not_recheck(key, bad):
    """`LearnerConfig` leaves the choices of the `learner:` section to the config loader, which names the key."""
    from k3rl.rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=rf"learner\.{key}.*'{bad}'"):
        load_config(None, [f"learner.{key}={bad}"])


def test_bfloat16_policy_trains(tiny_qwen3_dir, qwen_batch):
    learner = Learner(qwen_cfg(tiny_qwen3_dir, dtype="bfloat16", lr=1e-3))
    assert learner.model.lm_head.weight.dtype == torch.bfloat16
    m = learner.train_step(qwen_batch)
    assert m["skipped"] == 0.0 and m["mismatch_kl"] < 1e-2 and learner.version == 1


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_micro_batch_size_does_not_change_the_update(tiny_qwen3_dir, qwen_batch, algo):
    one = Learner(qwen_cfg(tiny_qwen3_dir, algo=algo, dtype="float64", micro_batch_tokens=1))
    big = Learner(qwen_cfg(tiny_qwen3_dir, algo=algo, dtype="float64", micro_batch_tokens=100_000))
    m1, m2 = one.train_step(qwen_batch), big.train_step(qwen_batch)
    assert m1["micro_batches"] == len(qwen_batch) and m2["micro_batches"] == 1
    for key in ("loss", "grad_norm", "mismatch_kl", "tis_weight"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-9, abs=1e-12), key
    assert_same_weights(weights(one), weights(big), atol=1e-12)


@pytest.mark.parametrize("poison", ["behaviour_logprob", "reward"])
def test_nonfinite_batch_is_skipped(tiny_qwen3_dir, qwen_batch, poison):
    learner = Learner(qwen_cfg(tiny_qwen3_dir, compute_entropy=True))
    bad = list(qwen_batch)
    bad[2] = Trajectory(**{**vars(qwen_batch[2]), "logprobs": qwen_batch[2].logprobs.copy()})
    if poison == "reward":
        bad[2].reward = float("nan")
    else:
        bad[2].logprobs[np.flatnonzero(bad[2].loss_mask)[1]] = np.nan
    before = weights(learner)
    m = learner.train_step(bad)
    assert m["skipped"] == 1.0 and m["skip_reason"] in ("nonfinite_loss", "nonfinite_grad")
    assert m["version"] == learner.version == 0
    assert_same_weights(before, weights(learner))
    assert all(not opt.state for opt in learner.optimizers)
    assert all(p.grad is None for p in learner.params)
    clean = learner.train_step(qwen_batch)
    assert clean["skipped"] == 0.0 and learner.version == 1 and clean["entropy"] > 0


def test_nonfinite_weights_at_load_refuse_to_start(tmp_path, tiny_qwen3_dir):
    """A NaN in the loaded weights would make every step skip, forever: the learner refuses, naming it (its loader,
    model/policy.py `load_policy`, refuses first: model/formats/integrity.py)."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "nan-policy"
    shutil.copytree(tiny_qwen3_dir, d)
    tensors = load_file(str(d / "model.safetensors"))
    name = sorted(k for k in tensors if k.endswith("q_proj.weight"))[0]
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"{d}: non-finite weights \(NaN or ±inf\) in 1 tensor: {name} \(1 value\)"):
        Learner(qwen_cfg(d))


def test_named_weights_load_into_a_fresh_model(tiny_qwen3_dir, qwen_batch):
    from transformers import AutoModelForCausalLM

    learner = Learner(qwen_cfg(tiny_qwen3_dir))
    learner.train_step(qwen_batch)
    named = learner.named_weights()
    fresh = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir)
    assert [n for n, _ in named] == list(fresh.state_dict()) and "lm_head.weight" in dict(named)
    fresh.load_state_dict(dict(named))
    ids = torch.from_numpy(qwen_batch[0].tokens.astype(np.int64))[None]
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, learner.model.eval()(ids).logits, atol=0, rtol=0)
    learner.model.train()
    snapshot = {n: t.clone() for n, t in named}
    learner.train_step(qwen_batch)
    assert all(torch.equal(snapshot[n], t) for n, t in named), "named_weights must be copies"


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_from_checkpoint_equals_uninterrupted(tmp_path, tiny_qwen3_dir, qwen_batch, optimizer):
    # with a warmup, a resumed learner that forgot its place in the schedule would take step 2 at lr 0
    cfg = qwen_cfg(tiny_qwen3_dir, optimizer=optimizer, weight_decay=0.01, lr_scheduler="cosine", warmup_steps=1,
                   total_steps=4)
    first, second = qwen_batch[:8], qwen_batch[4:]
    a = Learner(cfg)
    a.train_step(first)
    manager = ckpt.CheckpointManager(tmp_path / "ckpt", keep=2)
    with manager.begin(1) as tmp:
        a.save_into(tmp)
        ckpt.save_trainer_state(tmp, {"step": 1, "unconsumed": second[:2]})
    rng_at_save = torch.get_rng_state()
    a.train_step(second)
    torch.rand(7)

    b = Learner(cfg)
    path = ckpt.find_latest(tmp_path / "ckpt")
    b.load(path)
    assert torch.equal(torch.get_rng_state(), rng_at_save) and b.version == 1
    b.train_step(second)
    assert_same_weights(weights(a), weights(b))
    assert [(s.last_epoch, s.get_last_lr()) for s in b.schedulers] == [(s.last_epoch, s.get_last_lr())
                                                                       for s in a.schedulers]
    for oa, ob in zip(a.optimizers, b.optimizers):
        sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
        assert sa.keys() == sb.keys()
        for k in sa:
            for name, value in sa[k].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb[k][name])), (k, name)
    assert len(b.optimizers) == (2 if optimizer == "muon" else 1)
    state = ckpt.load_trainer_state(path, restore_rng_state=False)
    assert state["step"] == 1 and [t.tokens.tolist() for t in state["unconsumed"]] == [
        t.tokens.tolist() for t in second[:2]]


def test_learning_rate_follows_the_schedule_and_skipped_steps_do_not_advance_it(tiny_qwen3_dir, qwen_batch):
    """`lr` of each step = peak × transformers' cosine-with-warmup factor of the step (step 0: 0); a skipped
    step (here an empty batch; the non-finite guard skips the same way) leaves the schedule where it was;
    `constant` never moves the rate."""
    import math

    learner = Learner(qwen_cfg(tiny_qwen3_dir, lr=1e-3, lr_scheduler="cosine", warmup_steps=2, total_steps=6))
    factor = [k / 2 if k < 2 else 0.5 * (1 + math.cos(math.pi * (k - 2) / 4)) for k in range(6)]
    seen = [learner.train_step(qwen_batch[:4])["lr"] for _ in range(3)]
    skipped = learner.train_step(qwen_batch[:0])
    assert skipped["skipped"] == 1 and skipped["skip_reason"] == "empty_batch"
    seen += [learner.train_step(qwen_batch[:4])["lr"] for _ in range(3)]
    assert seen == pytest.approx([1e-3 * f for f in factor], abs=1e-12)
    constant = Learner(qwen_cfg(tiny_qwen3_dir, lr=1e-3))
    assert [constant.train_step(qwen_batch[:4])["lr"] for _ in range(2)] == [1e-3, 1e-3]
    with pytest.raises(ValueError, match="total_steps"):
        qwen_cfg(tiny_qwen3_dir, lr_scheduler="linear")
    with pytest.raises(ValueError, match="constant_with_warmup"):
        qwen_cfg(tiny_qwen3_dir, warmup_steps=3)


def test_saved_dir_is_a_hugging_face_model_and_damage_is_named(tmp_path, tiny_qwen3_dir, qwen_batch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    learner = Learner(qwen_cfg(tiny_qwen3_dir))
    learner.train_step(qwen_batch)
    learner.save(tmp_path / "policy")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    assert_same_weights(weights(learner), {n: t for n, t in reloaded.state_dict().items()})
    assert AutoTokenizer.from_pretrained(tmp_path / "policy").eos_token_id is not None
    assert not list(tmp_path.glob(".tmp-*"))

    other = Learner(qwen_cfg(tiny_qwen3_dir))
    with pytest.raises(ckpt.IncompleteCheckpointError):
        other.load(tiny_qwen3_dir)  # a plain HF dir: no manifest, no optimizer state
    with open(tmp_path / "policy" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ckpt.CorruptCheckpointError, match="model.safetensors"):
        other.load(tmp_path / "policy")


def test_optimizer_state_of_another_checkpoint_runs_no_pickled_code(tmp_path, tiny_qwen3_dir):
    learner = Learner(qwen_cfg(tiny_qwen3_dir))
    learner.save(tmp_path / "other")
    marker = tmp_path / "ran"
    state = torch.load(tmp_path / "other" / "optimizer.pt", weights_only=True)
    state["payload"] = RunsCode(marker)
    torch.save(state, tmp_path / "other" / "optimizer.pt")
    ckpt.mark_complete(tmp_path / "other")  # a hostile checkpoint comes with a manifest that matches
    for load in (learner.load_optimizer, learner.load):
        with pytest.raises(ckpt.CorruptCheckpointError, match="optimizer.pt|learner state"):
            load(tmp_path / "other")
        assert not marker.exists()


def test_tied_embeddings_round_trip(tmp_path, qwen_batch):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(1)
    config = Qwen3Config(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "tied")
    learner = Learner(qwen_cfg(tmp_path / "tied", optimizer="muon", lr=1e-3))
    assert learner.model.lm_head.weight is learner.model.model.embed_tokens.weight
    assert all(p is not learner.model.lm_head.weight for p in learner.optimizers[1].param_groups[0]["params"])
    learner.train_step(qwen_batch)
    learner.save(tmp_path / "ckpt")
    other = Learner(qwen_cfg(tmp_path / "tied", optimizer="muon", lr=1e-3))
    other.load(tmp_path / "ckpt")
    assert_same_weights(weights(learner), weights(other))


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, tiny_qwen3_dir, qwen_batch, monkeypatch):
    learner = Learner(qwen_cfg(tiny_qwen3_dir))
    manager = ckpt.CheckpointManager(tmp_path, keep=3)
    with manager.begin(1) as tmp:
        learner.save_into(tmp)
    learner.train_step(qwen_batch)

    real_save = torch.save

    def crash(obj, f, *a, **k):  # the model files are written; the optimizer state is not
        if str(f).endswith("optimizer.pt"):
            raise OSError("disk full")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        with manager.begin(2) as tmp:
            learner.save_into(tmp)
    assert ckpt.find_latest(tmp_path) == tmp_path / "step-000001"
    assert not (tmp_path / "step-000002").exists() and not list(tmp_path.glob(".tmp-*"))
    assert (tmp_path / "latest").read_text().strip() == "step-000001"


@pytest.mark.ray
def test_two_rank_group_matches_one_rank(ray_cluster, tmp_path, tiny_qwen3_dir, qwen_batch):
    cfg = qwen_cfg(tiny_qwen3_dir, dtype="float64", micro_batch_tokens=48)
    single = Learner(cfg)
    expected = single.train_step(qwen_batch)

    group = LearnerGroup(cfg, num_ranks=2, num_cpus_per_rank=1)
    try:
        got = group.train_step(qwen_batch)
        assert got["num_ranks"] == 2 and got["skipped"] == 0.0 and group.version == 1
        for key in ("loss", "grad_norm", "mismatch_kl", "num_loss_tokens", "num_seqs"):
            assert got[key] == pytest.approx(expected[key], rel=1e-9, abs=1e-12), key
        assert_same_weights(weights(single), dict(group.named_weights(0)), atol=1e-12)
        assert_same_weights(dict(group.named_weights(0)), dict(group.named_weights(1)))

        # NaN in a trajectory that lands on rank 1 only: both ranks skip
        parts = split_balanced([len(t.tokens) for t in qwen_batch], 2)
        poisoned = list(qwen_batch)
        i = parts[1][0]
        poisoned[i] = Trajectory(**{**vars(qwen_batch[i]), "logprobs": np.full_like(qwen_batch[i].logprobs, np.nan)})
        before = dict(group.named_weights(1))
        skipped = group.train_step(poisoned)
        assert skipped["skipped"] == 1.0 and skipped["skip_reason"] == "nonfinite_loss" and group.version == 1
        assert_same_weights(before, dict(group.named_weights(0)))
        assert_same_weights(before, dict(group.named_weights(1)))

        group.save(tmp_path / "group-ckpt")
        assert sorted(p.name for p in (tmp_path / "group-ckpt").glob("rng-rank*.pt")) == [
            "rng-rank00000.pt", "rng-rank00001.pt"]
        restored = Learner(cfg)
        restored.load(tmp_path / "group-ckpt")
        assert restored.version == 1
        assert_same_weights(weights(single), weights(restored), atol=1e-12)
        assert group.load(tmp_path / "group-ckpt") == 1
    finally:
        group.shutdown()


@pytest.mark.ray
def test_one_rank_group_equals_learner(ray_cluster, tiny_qwen3_dir, qwen_batch):
    cfg = qwen_cfg(tiny_qwen3_dir, dtype="float64")
    single = Learner(cfg)
    single.train_step(qwen_batch)
    group = LearnerGroup(cfg, num_ranks=1, num_cpus_per_rank=0.5)
    try:
        assert group.train_step(qwen_batch)["num_ranks"] == 1
        assert_same_weights(weights(single), dict(group.named_weights()), atol=1e-12)
        # the reference the rollout pool pushes: put by the learner actor, the same tensors after the step
        ref = group.weights_ref()
        assert isinstance(ref, ray_cluster.ObjectRef)
        pushed = dict(ray_cluster.get(ref))
        assert pushed.keys() == weights(single).keys()
        assert_same_weights(weights(single), pushed, atol=1e-12)
    finally:
        group.shutdown()


# --- tiny K3 (configs/model/tiny.yaml, random init): router balancing and routing replay ---

K3_PROMPTS = [[3, 100, 200, 300, 400, 500], [3, 7, 8, 9]]


def save_tiny_k3(path: Path):
    """A random tiny K3 (configs/model/tiny.yaml, seed 0, a wide LM head) saved as an HF dir at `path`; the model."""
    from k3rl.model.modeling import K3ForCausalLM
    from k3rl.rl.config import load_model_config

    torch.manual_seed(0)
    k3 = K3ForCausalLM(load_model_config(str(Path(__file__).parents[2] / "configs/model/tiny.yaml")))
    with torch.no_grad():
        k3.lm_head.weight.normal_(0.0, 0.3)  # spread-out next-token distributions
    k3.save_pretrained(path)
    return k3


@pytest.fixture(scope="module")
def k3_setup(tmp_path_factory):
    """The tiny K3 saved as an HF dir, and trajectories its TorchEngine sampled (with routing)."""
    from k3rl.rollout.torch_engine import TorchEngine

    path = tmp_path_factory.mktemp("tiny-k3")
    k3 = save_tiny_k3(path)
    tokenizer = SimpleNamespace(eos_token_id=None, pad_token_id=0)  # ids only: no stop strings, no decoding
    engine = TorchEngine(k3, tokenizer, seed=0)
    batch = sample(engine, K3_PROMPTS, group_size=3, max_tokens=8)
    return path, batch


def k3_cfg(path, **kw) -> LearnerConfig:
    return LearnerConfig(**{**dict(model_path=str(path), lr=1e-3, max_grad_norm=10.0, micro_batch_tokens=64), **kw})


def test_k3_logprobs_match_engine_and_routers_are_balanced(k3_setup):
    path, batch = k3_setup
    assert batch[0].routed_experts is not None and batch[0].routed_experts.shape[1:] == (7, 2)
    learner = Learner(k3_cfg(path))
    for t, lp in zip(batch, learner.score(batch)):
        np.testing.assert_allclose(lp, behaviour(t), atol=2e-4)
    bias_before = {n: t for n, t in learner.named_weights() if n.endswith("e_score_correction_bias")}
    m = learner.train_step(batch)
    assert m["skipped"] == 0.0 and m["mismatch_kl"] < 1e-5
    maxvio = {k: v for k, v in m.items() if k.startswith("maxvio/")}
    assert len(maxvio) == 7 and all(v >= 0 for v in maxvio.values()) and m["maxvio_max"] == max(maxvio.values())
    bias_after = {n: t for n, t in learner.named_weights() if n in bias_before}
    assert any(not torch.equal(bias_before[n], bias_after[n]) for n in bias_before)
    assert all(t.dtype == torch.float32 for t in bias_after.values())


def test_k3_padding_micro_batches_and_recompute_do_not_change_update_or_balancing(k3_setup):
    path, batch = k3_setup
    one = Learner(k3_cfg(path, dtype="float64", micro_batch_tokens=1))
    padded = Learner(k3_cfg(path, dtype="float64", micro_batch_tokens=100_000))
    m1, m2 = one.train_step(batch), padded.train_step(batch)
    assert m1["micro_batches"] == len(batch) and m2["micro_batches"] == 1
    lengths = {len(t.tokens) for t in batch}
    assert len(lengths) > 1, "the batch must need padding for this test to mean anything"
    for key in [k for k in m1 if k.startswith("maxvio/")] + ["loss", "grad_norm"]:
        assert m1[key] == pytest.approx(m2[key], rel=1e-9, abs=1e-12), key
    assert_same_weights(weights(one), weights(padded), atol=1e-10)
    # activation recompute runs parts of the forward again inside backward, under the same routing rules
    for mode in ("full", "selective"):
        recomputed = Learner(k3_cfg(path, dtype="float64", micro_batch_tokens=100_000, recompute=mode))
        assert recomputed.train_step(batch)["maxvio_max"] == pytest.approx(m2["maxvio_max"], rel=1e-12), mode
        assert_same_weights(weights(recomputed), weights(padded), atol=1e-10)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_k3_recompute_in_segments_and_shared_prefixes_gives_the_same_update(k3_setup, mode):
    """Segment-recurrent training with a shared prompt (the recipe's long path, rl/train/segments.py) keeps its
    update and router statistics when the KDA mixers and MoE blocks recompute through the cache."""
    path, batch = k3_setup
    kw = dict(dtype="float64", micro_batch_tokens=100_000, segment_tokens=5, share_prefix=True)
    plain = Learner(k3_cfg(path, **kw))
    recomputed = Learner(k3_cfg(path, recompute=mode, **kw))
    calls = {}
    for learner in (plain, recomputed):
        for layer in learner.model.model.layers:  # KDA mixer and MoE block calls, the recomputes counted
            for part in (layer.self_attn, getattr(layer, "block_sparse_moe", None)):
                if part is not None:
                    part.register_forward_pre_hook(lambda *_, who=learner: calls.__setitem__(id(who), calls.get(id(who), 0) + 1))
    m1, m2 = plain.train_step(batch), recomputed.train_step(batch)
    assert calls[id(recomputed)] > calls[id(plain)], "nothing was recomputed"
    for key in [k for k in m1 if k.startswith("maxvio/")] + ["loss", "grad_norm"]:
        assert m2[key] == pytest.approx(m1[key], rel=1e-9, abs=1e-12), key
    assert_same_weights(weights(recomputed), weights(plain), atol=1e-10)


def test_k3_routing_replay_uses_the_recorded_experts(k3_setup):
    path, batch = k3_setup
    traj = batch[0]
    recorded = torch.from_numpy(traj.routed_experts[:-1].astype(np.int64))  # [n, L, k] of the input tokens
    known = (recorded >= 0).all(-1)  # [n, L]
    assert known.any() and (~known).any()

    def used_routing(replay: bool) -> torch.Tensor:
        learner = Learner(k3_cfg(path, routing_replay=replay))
        with torch.no_grad():  # move every router bias so the learner's own choice differs
            for r in learner._routers:
                r.e_score_correction_bias.copy_(torch.linspace(-1.0, 1.0, r.num_experts))
        learner.score([traj])
        return learner.model.last_routed_expert_ids()[0]  # [n, L, k]

    replayed, own = used_routing(True), used_routing(False)
    assert torch.equal(replayed[known], recorded[known])
    assert not torch.equal(own[known], recorded[known])
    # unrecorded tokens (prompt, last token) are routed by the learner, exactly as without replay, up to the
    # first recorded token (later positions see replayed experts in their context)
    first = int(np.argmax(known.all(-1).numpy()))
    assert torch.equal(replayed[:first], own[:first])


def test_nll_objective_hand_computed(tiny_qwen3_dir):
    """`algo: nll` (rl/algos/nll.py) trains demonstrations that have no reward and no group: the step's loss
    is −mean log p of the loss-mask tokens from full float64 logits, and micro-batching leaves the update
    unchanged."""
    from transformers import AutoModelForCausalLM

    demos = []
    for prompt, answer in ((PROMPTS[0], [20, 21, 22, 2]), (PROMPTS[1], [30, 31, 2]), (PROMPTS[2], [40, 2])):
        builder = TrajectoryBuilder(prompt)
        builder.append_sampled(answer, [0.0] * len(answer), version=0)
        builder.append_context([9, 9])  # context after the answer: read, not trained
        demos.append(builder.finish(reward=0.0, task_id="demo"))
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float64).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for t in demos:
            tokens = torch.tensor(t.tokens, dtype=torch.long)
            logp = model(tokens[None]).logits[0, :-1].log_softmax(-1)[torch.arange(len(tokens) - 1), tokens[1:]]
            sel = torch.from_numpy(t.loss_mask[1:].astype(bool))
            total, count = total - float(logp[sel].sum()), count + int(sel.sum())
    one = Learner(qwen_cfg(tiny_qwen3_dir, algo="nll", dtype="float64", micro_batch_tokens=1))
    big = Learner(qwen_cfg(tiny_qwen3_dir, algo="nll", dtype="float64", micro_batch_tokens=100_000))
    m_one, m_big = one.train_step(demos), big.train_step(demos)
    assert m_big["num_loss_tokens"] == count == 9 and m_big["skipped"] == 0
    assert m_big["loss"] == pytest.approx(total / count, rel=1e-10)
    assert m_one["loss"] == pytest.approx(total / count, rel=1e-10) and m_one["micro_batches"] == 3
    assert_same_weights(weights(one), weights(big), atol=1e-12)
    after = big.score(demos)  # the step made the demonstrations more likely
    assert -sum(a.sum() for a in after) / count < total / count
