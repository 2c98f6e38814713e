"""RL algorithms: every loss and advantage against numbers worked out by hand, clipping, TIS and
the mismatch KL, the registry, and the invariance that makes gradient accumulation (and
data-parallel ranks, which are summed the same way) equal one big batch.

Hand cases write the expected values with plain arithmetic on the chosen log-ratios
(e(x) = exp(x)); none calls the code under test to get them.
"""

import dataclasses
import math
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from k3rl.rl.algos import ALGOS, LossInputs, get_algo

# the policy-gradient algorithms; the supervised objective (nll) has its own test at the end
RL_ALGOS = sorted(name for name, cls in ALGOS.items() if cls.uses_rewards)

e = math.exp


def make(lr, adv, seqs, old=None, beh_minus_old=None, ref=None, n_tok=None, n_seq=None):
    """LossInputs from log-ratios log π_θ/π_old per token (float64; logprobs is a leaf with grad)."""
    old = torch.tensor(old if old is not None else [-1.0 - 0.25 * i for i in range(len(lr))], dtype=torch.float64)
    lp = (old + torch.tensor(lr, dtype=torch.float64)).requires_grad_(True)
    beh = old + torch.tensor(beh_minus_old, dtype=torch.float64) if beh_minus_old is not None else old.clone()
    seq_ids = torch.tensor(seqs, dtype=torch.long)
    n_seqs = int(seq_ids.max()) + 1 if len(seqs) else 0
    return LossInputs(logprobs=lp, old_logprobs=old, behaviour_logprobs=beh,
                      advantages=torch.tensor(adv, dtype=torch.float64), seq_ids=seq_ids, num_seqs=n_seqs,
                      num_tokens_global=n_tok or len(lr), num_seqs_global=n_seq or n_seqs,
                      ref_logprobs=None if ref is None else torch.tensor(ref, dtype=torch.float64))


def loss_and_grad(algo, inputs):
    loss, metrics = algo.loss(inputs)
    loss.backward()
    return loss.item(), inputs.logprobs.grad.tolist(), {k: v.item() for k, v in metrics.items()}


def close(a, b):
    assert a == pytest.approx(b, rel=1e-9, abs=1e-12)


# Shared hand case: seq 0 has 2 tokens with A = +1, seq 1 has 3 tokens with A = −0.5.
# log-ratios 0.1, −0.3 | 0.25, −0.4, 0.0 with ε = 0.2:
#   t0 ρ=e(.1)  A>0 inside          term −e(.1)
#   t1 ρ=e(−.3) A>0 below 1−ε: min picks ρA (unclipped)  term −e(−.3)
#   t2 ρ=e(.25) A<0 above 1+ε: min picks ρA (unclipped)  term 0.5·e(.25)
#   t3 ρ=e(−.4) A<0 below 1−ε: clipped to 0.8·A          term 0.4, gradient 0
#   t4 ρ=1                                            term 0.5
CASE = dict(lr=[0.1, -0.3, 0.25, -0.4, 0.0], adv=[1.0, 1.0, -0.5, -0.5, -0.5], seqs=[0, 0, 1, 1, 1])
TERMS = [-e(0.1), -e(-0.3), 0.5 * e(0.25), 0.4, 0.5]
# d term / d logprob = −ρA on unclipped tokens, 0 on the clipped one
DTERMS = [-e(0.1), -e(-0.3), 0.5 * e(0.25), 0.0, 0.5]


def test_grpo_loss_hand_case():
    loss, grad, m = loss_and_grad(get_algo("grpo", eps_low=0.2, eps_high=0.2), make(**CASE))
    # mean over each sequence's tokens, then mean over the 2 sequences
    close(loss, ((TERMS[0] + TERMS[1]) / 2 + (TERMS[2] + TERMS[3] + TERMS[4]) / 3) / 2)
    for g, d, n in zip(grad, DTERMS, [2, 2, 3, 3, 3]):
        close(g, d / n / 2)
    assert grad[3] == 0.0
    close(m["clip_frac"], 1 / 5)


def test_dr_grpo_loss_hand_case():
    loss, grad, _ = loss_and_grad(get_algo("dr_grpo", max_tokens=4), make(**CASE))
    # token sum ÷ (2 sequences × L = 4)
    close(loss, sum(TERMS) / 8)
    for g, d in zip(grad, DTERMS):
        close(g, d / 8)


def test_rloo_loss_hand_case():
    loss, grad, _ = loss_and_grad(get_algo("rloo"), make(**CASE))
    # token sum per sequence, mean over the 2 sequences
    close(loss, sum(TERMS) / 2)
    for g, d in zip(grad, DTERMS):
        close(g, d / 2)


def test_ppo_loss_hand_case():
    # ε_high = 0.28 changes nothing here: the only ratio above 1.2 has A < 0
    loss, grad, _ = loss_and_grad(get_algo("ppo", eps_low=0.2, eps_high=0.28, dual_clip=3.0), make(**CASE))
    close(loss, sum(TERMS) / 5)
    for g, d in zip(grad, DTERMS):
        close(g, d / 5)


def test_ppo_dual_clip_and_clip_higher():
    # t0 A=−1, ρ=e(1.5)≈4.48 > c=3: bounded at c·|A| = 3, no gradient
    # t1 A=−1, ρ=e(1)≈2.72 < c: unclipped, term e(1), gradient e(1)
    # t2 A=−1, ρ=e(−.5)≈0.61 < 0.8: clipped to 0.8, no gradient
    # t3 A=+1, ρ=e(.5)≈1.65 > 1.28: clipped to −1.28, no gradient
    # t4 A=+1, ρ=e(.24)≈1.27 < 1.28 (would clip at a symmetric 1.2): −e(.24), gradient −e(.24)
    inputs = make(lr=[1.5, 1.0, -0.5, 0.5, 0.24], adv=[-1.0, -1.0, -1.0, 1.0, 1.0], seqs=[0, 0, 0, 1, 1])
    loss, grad, m = loss_and_grad(get_algo("ppo", eps_low=0.2, eps_high=0.28, dual_clip=3.0), inputs)
    close(loss, (3.0 + e(1.0) + 0.8 - 1.28 - e(0.24)) / 5)
    assert grad[0] == 0.0 and grad[2] == 0.0 and grad[3] == 0.0
    close(grad[1], e(1.0) / 5)
    close(grad[4], -e(0.24) / 5)
    close(m["dual_clip_frac"], 1 / 5)
    close(m["clip_frac"], 3 / 5)
    # the dual-clip bound holds however far the ratio runs
    far, _, _ = loss_and_grad(get_algo("ppo"), make(lr=[8.0], adv=[-2.0], seqs=[0]))
    close(far, 3.0 * 2.0)


def test_gspo_sequence_ratio_hand_case():
    # seq 0 (A=+1):  log-ratios .1, −.3 → s = e(−.1) ≈ 0.905 < 0.95, A>0: unclipped, term −e(−.1)
    # seq 1 (A=−.5): log-ratios .3, 0, 0 → s = e(.1) ≈ 1.105 > 1.05, A<0: unclipped, term .5·e(.1)
    # seq 2 (A=+2):  log-ratios .2, .1 → s = e(.15) ≈ 1.162 > 1.05, A>0: clipped, term −2·1.05, no gradient
    inputs = make(lr=[0.1, -0.3, 0.3, 0.0, 0.0, 0.2, 0.1], adv=[1.0, 1.0, -0.5, -0.5, -0.5, 2.0, 2.0],
                  seqs=[0, 0, 1, 1, 1, 2, 2])
    loss, grad, m = loss_and_grad(get_algo("gspo", eps_low=0.05, eps_high=0.05), inputs)
    close(loss, (-e(-0.1) + 0.5 * e(0.1) - 2 * 1.05) / 3)
    # d(−sA)/d logp_t = −A·s/|o_i|, then ÷ 3 sequences; every token of a sequence gets the same
    for t in (0, 1):
        close(grad[t], -e(-0.1) / 2 / 3)
    for t in (2, 3, 4):
        close(grad[t], 0.5 * e(0.1) / 3 / 3)
    assert grad[5] == 0.0 and grad[6] == 0.0
    close(m["seq_clip_frac"], 1 / 3)


def test_cispo_gradient_is_clipped_weight_times_advantage():
    # t0 ρ=e(.1) inside: weight e(.1); t1 ρ=e(.5) ≈ 1.65 capped at 1.2 (PPO would drop it);
    # t2 ρ=e(−.3) ≈ 0.74 kept (no lower bound with ε_low = 1)
    lr, adv, old = [0.1, 0.5, -0.3], [1.0, 1.0, -2.0], [-1.1, -2.5, -0.2]
    inputs = make(lr=lr, adv=adv, seqs=[0, 0, 1], old=old)
    loss, grad, m = loss_and_grad(get_algo("cispo", eps_low=1.0, eps_high=0.2), inputs)
    lp = [-1.0, -2.0, -0.5]
    w = [e(0.1), 1.2, e(-0.3)]
    close(loss, -(w[0] * 1.0 * lp[0] + w[1] * 1.0 * lp[1] + w[2] * -2.0 * lp[2]) / 3)
    for g, wi, a in zip(grad, w, adv):
        close(g, -wi * a / 3)
    close(m["clip_frac"], 1 / 3)


def test_first_epoch_grpo_is_reinforce():
    # old == logprobs: ρ = 1 everywhere, nothing clipped, gradient −A/(|o_i|·S)
    loss, grad, m = loss_and_grad(get_algo("grpo"), make(lr=[0.0] * 3, adv=[2.0, 2.0, -1.0], seqs=[0, 0, 1]))
    close(loss, ((-2.0 - 2.0) / 2 + 1.0) / 2)
    assert grad == pytest.approx([-2.0 / 4, -2.0 / 4, 1.0 / 2])
    assert m["clip_frac"] == 0.0


def test_token_tis_caps_weights_and_mismatch_kl():
    # π_old/μ per token = e(0), e(1) → capped at C = 2, e(−.5); ρ = 1, A = 1
    d = [0.0, 1.0, -0.5]
    inputs = make(lr=[0.0] * 3, adv=[1.0] * 3, seqs=[0, 0, 1], beh_minus_old=[-x for x in d])
    loss, grad, m = loss_and_grad(get_algo("ppo", tis_level="token", tis_cap=2.0), inputs)
    w = [1.0, 2.0, e(-0.5)]
    close(loss, -sum(w) / 3)
    for g, wi in zip(grad, w):
        close(g, -wi / 3)
    close(m["tis_capped_frac"], 1 / 3)
    close(m["tis_weight"], sum(w) / 3)
    close(m["mismatch_kl"], ((e(1.0) - 1.0 - 1.0) + (e(-0.5) + 0.5 - 1.0)) / 3)
    assert m["mismatch_kl"] > 0


def test_sequence_tis_uses_the_product_of_ratios():
    # seq 0: log w = .5 + .5 = 1 → e(1) capped at 2; seq 1: log w = −.5 → e(−.5)
    inputs = make(lr=[0.0] * 3, adv=[1.0] * 3, seqs=[0, 0, 1], beh_minus_old=[-0.5, -0.5, 0.5])
    loss, grad, m = loss_and_grad(get_algo("ppo", tis_level="sequence", tis_cap=2.0), inputs)
    close(loss, -(2.0 + 2.0 + e(-0.5)) / 3)
    assert grad == pytest.approx([-2.0 / 3, -2.0 / 3, -e(-0.5) / 3])
    close(m["tis_capped_frac"], 2 / 3)
    # off: weights are 1 whatever the mismatch
    loss, _, _ = loss_and_grad(get_algo("ppo", tis_level="none"), make(
        lr=[0.0] * 3, adv=[1.0] * 3, seqs=[0, 0, 1], beh_minus_old=[-0.5, -0.5, 0.5]))
    close(loss, -1.0)


def test_mis_masks_tokens_above_the_cap_instead_of_truncating():
    # π_old/μ per token = e(0), e(1) > C = 2 → 0 (masked, not 2), e(−.5) kept; ρ = 1, A = 1
    inputs = make(lr=[0.0] * 3, adv=[1.0] * 3, seqs=[0, 0, 1], beh_minus_old=[0.0, -1.0, 0.5])
    loss, grad, m = loss_and_grad(get_algo("ppo", tis_level="token", tis_cap=2.0, tis_mode="mask"), inputs)
    w = [1.0, 0.0, e(-0.5)]
    close(loss, -sum(w) / 3)
    for g, wi in zip(grad, w):
        close(g, -wi / 3)
    close(m["tis_capped_frac"], 1 / 3)
    close(m["tis_masked_frac"], 1 / 3)
    close(m["tis_weight"], sum(w) / 3)


def test_sequence_mis_drops_the_whole_sequence():
    # seq 0: log w = .5 + .5 = 1 > log 2 → both tokens 0; seq 1: log w = −.5 → e(−.5) (not masked: one-sided)
    inputs = make(lr=[0.0] * 3, adv=[1.0] * 3, seqs=[0, 0, 1], beh_minus_old=[-0.5, -0.5, 0.5])
    loss, grad, m = loss_and_grad(get_algo("grpo", tis_level="sequence", tis_cap=2.0, tis_mode="mask"), inputs)
    # GRPO: mean over a sequence's tokens, then over sequences: (0 + e(−.5)) / 2
    close(loss, -e(-0.5) / 2)
    assert grad == pytest.approx([0.0, 0.0, -e(-0.5) / 2])
    close(m["tis_masked_frac"], 2 / 3)


def test_icepop_masks_both_sides_and_keeps_the_ratio_inside():
    # C = 2: band [.5, 2]; ratios e(1) (above), e(−1) (below), e(.5) and e(−.5) inside, kept as they are
    d = [1.0, -1.0, 0.5, -0.5]
    inputs = make(lr=[0.0] * 4, adv=[1.0] * 4, seqs=[0, 0, 1, 1], beh_minus_old=[-x for x in d])
    loss, grad, m = loss_and_grad(get_algo("ppo", tis_cap=2.0, tis_mode="icepop"), inputs)
    w = [0.0, 0.0, e(0.5), e(-0.5)]
    close(loss, -sum(w) / 4)
    for g, wi in zip(grad, w):
        close(g, -wi / 4)
    close(m["tis_masked_frac"], 2 / 4)
    close(m["tis_capped_frac"], 2 / 4)
    # truncation on the same batch keeps every token: the one below the band at its own ratio
    _, grad, m = loss_and_grad(get_algo("ppo", tis_cap=2.0), make(lr=[0.0] * 4, adv=[1.0] * 4, seqs=[0, 0, 1, 1],
                                                                  beh_minus_old=[-x for x in d]))
    assert grad == pytest.approx([-2.0 / 4, -e(-1.0) / 4, -e(0.5) / 4, -e(-0.5) / 4])
    assert m["tis_masked_frac"] == 0.0


@pytest.mark.parametrize("bad, message", [({"tis_mode": "clip"}, "tis_mode: 'clip' is not one of truncate, mask, "
                                                                   "icepop"),
                                          ({"tis_mode": "icepop", "tis_cap": 1.0}, "icepop's band")])
def test_bad_is_settings_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        get_algo("grpo", **bad)


@pytest.mark.parametrize("mode", ["truncate", "mask", "icepop"])
@pytest.mark.parametrize("name", RL_ALGOS)
def test_mismatch_kl_zero_when_engine_matches(name, mode):
    _, _, m = loss_and_grad(get_algo(name, tis_mode=mode), make(**CASE))
    assert m["mismatch_kl"] == 0.0 and m["tis_capped_frac"] == 0.0 and m["tis_masked_frac"] == 0.0
    close(m["tis_weight"], 1.0)


def test_kl_to_reference():
    # ρ = 1 and A = 0: the loss is the KL term alone; ref − logp = −.5 and .3 in one sequence
    def run(est):
        inputs = make(lr=[0.0, 0.0], adv=[0.0, 0.0], seqs=[0, 0], old=[-1.0, -2.0], ref=[-1.5, -1.7])
        return loss_and_grad(get_algo("grpo", kl_coef=0.1, kl_estimator=est), inputs)

    loss, grad, m = run("k3")
    close(loss, 0.1 * ((e(-0.5) + 0.5 - 1.0) + (e(0.3) - 0.3 - 1.0)) / 2)
    # d/dlogp (e(ref−logp) − (ref−logp) − 1) = 1 − e(ref−logp)
    close(grad[0], 0.1 * (1.0 - e(-0.5)) / 2)
    close(grad[1], 0.1 * (1.0 - e(0.3)) / 2)
    close(m["kl_ref"], ((e(-0.5) + 0.5 - 1.0) + (e(0.3) - 0.3 - 1.0)) / 2)
    loss, grad, _ = run("k1")
    close(loss, 0.1 * (0.5 - 0.3) / 2)
    assert grad == pytest.approx([0.05, 0.05])
    with pytest.raises(ValueError, match="ref_logprobs"):
        get_algo("grpo", kl_coef=0.1).loss(make(**CASE))


@pytest.mark.parametrize("name", sorted(ALGOS))
def test_an_objective_needs_a_reference_exactly_when_it_has_a_kl_penalty(name):
    """`needs_reference` is what the learner asks before loading a reference policy (it reads no settings itself)."""
    assert not get_algo(name).needs_reference
    if name != "nll":
        assert get_algo(name, kl_coef=0.05).needs_reference


# ---- advantages ----

def test_advantages_hand_cases():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    std = math.sqrt((4 * 0.5 ** 2) / 3)
    for name in ("grpo", "gspo", "cispo"):
        a = get_algo(name, adv_eps=1e-6).advantages(r)
        a_hi = 0.5 / (std + 1e-6)
        assert a.tolist() == pytest.approx([a_hi, -a_hi, -a_hi, a_hi])
    r = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    assert get_algo("dr_grpo").advantages(r).tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert get_algo("ppo").advantages(r).tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert get_algo("rloo").advantages(r).tolist() == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    # leave-one-out: 3 − (1+2)/2, 1 − (3+2)/2, 2 − (3+1)/2
    r = torch.tensor([3.0, 1.0, 2.0], dtype=torch.float64)
    assert get_algo("rloo").advantages(r).tolist() == pytest.approx([1.5, -1.5, 0.0])
    s = math.sqrt(((3 - 2) ** 2 + (1 - 2) ** 2 + 0) / 2)
    assert get_algo("ppo", scale_by_std=True, adv_eps=0.0).advantages(r).tolist() == pytest.approx([1 / s, -1 / s, 0])


@pytest.mark.parametrize("name", RL_ALGOS)
@pytest.mark.parametrize("rewards", [[0.7, 0.7, 0.7, 0.7], [0.1, 0.1, 0.1], [1.0]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equal_rewards_give_zero_advantage(name, rewards, dtype):
    # 0.1·3/3 ≠ 0.1 in floating point: the mean is an ulp off, yet the advantage must be exactly 0
    cfg = {"adv_eps": 0.0} if "adv_eps" in {f.name for f in dataclasses.fields(ALGOS[name].Config)} else {}
    for algo in (get_algo(name), get_algo(name, **cfg)):
        a = algo.advantages(torch.tensor(rewards, dtype=dtype))
        assert torch.isfinite(a).all() and (a == 0).all()


def test_batch_advantages_per_group():
    r = torch.tensor([1.0, 5.0, 0.0, 5.0, 3.0])
    a = get_algo("grpo", adv_eps=0.0).batch_advantages(r, ["a", "b", "a", "b", "c"])
    # group a: (1, 0) → mean .5, std √.5; group b equal; group c alone
    assert a.tolist() == pytest.approx([0.5 / math.sqrt(0.5), 0.0, -0.5 / math.sqrt(0.5), 0.0, 0.0])
    with pytest.raises(ValueError, match="group ids"):
        get_algo("grpo").batch_advantages(r, ["a"])


# ---- invariance: micro-batches × accumulation (and DP ranks summed) == one batch ----

def _random_batch(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    seq_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    adv_seq = torch.randn(len(lengths), generator=g, dtype=torch.float64)
    return dict(
        param=torch.randn(n, generator=g, dtype=torch.float64).mul(0.3).sub(1.5).requires_grad_(True),
        old=torch.randn(n, generator=g, dtype=torch.float64).mul(0.3).sub(1.5),
        beh=torch.randn(n, generator=g, dtype=torch.float64).mul(0.3).sub(1.5),
        ref=torch.randn(n, generator=g, dtype=torch.float64).mul(0.3).sub(1.5),
        adv=adv_seq[seq_of], seq_of=seq_of, n_tok=n, n_seq=len(lengths))


def _inputs_for(batch, seqs):
    """LossInputs for the whole sequences `seqs`, with their ids renumbered 0..len(seqs)−1."""
    idx = torch.cat([torch.nonzero(batch["seq_of"] == s)[:, 0] for s in seqs])
    local = {s: i for i, s in enumerate(seqs)}
    return LossInputs(
        logprobs=batch["param"][idx], old_logprobs=batch["old"][idx], behaviour_logprobs=batch["beh"][idx],
        advantages=batch["adv"][idx], seq_ids=torch.tensor([local[int(s)] for s in batch["seq_of"][idx]]),
        num_seqs=len(seqs), num_tokens_global=batch["n_tok"], num_seqs_global=batch["n_seq"],
        ref_logprobs=batch["ref"][idx])


@pytest.mark.parametrize("name", RL_ALGOS)
@pytest.mark.parametrize("tis_level", ["token", "sequence"])
def test_micro_batch_accumulation_equals_one_batch(name, tis_level):
    lengths = [3, 1, 7, 2, 5, 4]
    cfg = dict(kl_coef=0.05, tis_level=tis_level, tis_cap=1.5)
    if name == "gspo":
        cfg.update(eps_low=0.02, eps_high=0.03)
    algo = get_algo(name, **cfg)

    whole = _random_batch(0, lengths)
    loss_whole, m_whole = algo.loss(_inputs_for(whole, list(range(6))))
    loss_whole.backward()

    split = _random_batch(0, lengths)
    total, m_sum = 0.0, {}
    # uneven micro-batches, out of order; also what two DP ranks would hold
    for part in ([4, 1], [0], [5, 2, 3]):
        loss, m = algo.loss(_inputs_for(split, part))
        loss.backward()
        total += loss.item()
        for k, v in m.items():
            m_sum[k] = m_sum.get(k, 0.0) + v.item()

    assert total == pytest.approx(loss_whole.item(), rel=1e-10)
    torch.testing.assert_close(split["param"].grad, whole["param"].grad, rtol=1e-10, atol=1e-12)
    assert whole["param"].grad.abs().sum() > 0
    for k, v in m_whole.items():
        assert m_sum[k] == pytest.approx(v.item(), rel=1e-10, abs=1e-12), k


@pytest.mark.parametrize("name", sorted(ALGOS))
def test_empty_micro_batch(name):
    """A rank or micro-batch with no loss tokens contributes 0 and a zero gradient."""
    inputs = make(lr=[], adv=[], seqs=[], n_tok=10, n_seq=2)
    loss, metrics = get_algo(name).loss(inputs)
    loss.backward()
    assert loss.item() == 0.0 and all(torch.isfinite(v) for v in metrics.values())


# ---- registry, config, imports ----

def test_unknown_algorithm_lists_valid_names():
    with pytest.raises(ValueError) as err:
        get_algo("grpo_v9")
    for name in ("grpo", "dr_grpo", "rloo", "ppo", "gspo", "cispo"):
        assert name in str(err.value)
    assert "grpo_v9" in str(err.value)


def test_unknown_or_invalid_setting():
    with pytest.raises(ValueError, match="unknown setting.*clip_eps.*valid:.*eps_high"):
        get_algo("ppo", clip_eps=0.3)
    with pytest.raises(ValueError, match="tis_level"):
        get_algo("grpo", tis_level="seq")
    with pytest.raises(ValueError, match="dual_clip"):
        get_algo("ppo", dual_clip=0.5)
    assert get_algo("ppo", eps_high=0.3).cfg.eps_high == 0.3


@pytest.mark.parametrize("name", RL_ALGOS)
def test_configs_are_omegaconf_structured(name):
    cls = ALGOS[name]
    cfg = OmegaConf.merge(OmegaConf.structured(cls.Config), {"kl_coef": 0.01})
    algo = cls.from_kwargs(**OmegaConf.to_container(cfg))
    assert algo.cfg.kl_coef == 0.01 and algo.name == name


def test_imports_without_ray_or_vllm():
    code = ("import sys, rl.algos, model.logprobs; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('ray', 'vllm', 'transformers')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_nll_hand_computed_and_accumulates():
    """NLL: −Σ log p / N over the global step; two micro-batches add up to the whole; no rewards used."""
    import torch

    from k3rl.rl.algos import get_algo
    from k3rl.rl.algos.base import LossInputs

    algo = get_algo("nll")
    assert not algo.uses_rewards and algo.advantages(torch.tensor([3.0, -1.0])).tolist() == [1.0, 1.0]
    logp = torch.tensor([-0.5, -1.0, -2.0, -0.25], requires_grad=True)

    def inputs(lp, seq_ids, num_seqs):
        zeros = torch.zeros_like(lp)
        return LossInputs(logprobs=lp, old_logprobs=lp.detach(), behaviour_logprobs=zeros - 9.0,
                          advantages=zeros + 1.0, seq_ids=torch.tensor(seq_ids), num_seqs=num_seqs,
                          num_tokens_global=4, num_seqs_global=2)

    loss, metrics = algo.loss(inputs(logp, [0, 0, 1, 1], 2))
    assert loss.item() == pytest.approx(3.75 / 4) and metrics["nll"].item() == pytest.approx(3.75 / 4)
    loss.backward()
    assert logp.grad.tolist() == [-0.25] * 4
    a, _ = algo.loss(inputs(logp[:2].detach(), [0, 0], 1))
    b, _ = algo.loss(inputs(logp[2:].detach(), [0, 0], 1))
    assert float(a + b) == pytest.approx(float(loss))
    with pytest.raises(ValueError, match="unknown setting"):
        get_algo("nll", kl_coef=0.1)
