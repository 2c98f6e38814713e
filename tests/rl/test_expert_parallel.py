"""Expert parallelism × FSDP2 (rl/train/parallel.py `apply_parallelism`, rl/train/expert_parallel.py) equals one rank.

One spawn of 4 gloo ranks runs every parallel case (process start-up dominates the time on the CPU), while
the test process computes the one-rank reference:
* phase 1, side by side: `ep2` on ranks 0-1 (EP = 2, FSDP, DP = 1) and `ep2_nofsdp` on ranks 2-3 (EP = 2
  without FSDP: gradients summed by `sync_grads`);
* phase 2: `ep2dp2` on ranks 0-3 (EP = 2 × DP = 2, FSDP; the experts also sharded over DP).
Each case trains a tiny float64 K3 (3 layers, 2 MoE layers, 4 experts top-2) for two AdamW steps on the
same global batch as the reference: step 1 routed by the router, with the bias of one MoE layer pushing
every token away from experts 2 and 3 (so the ranks owning them receive no rows there), step 2 replaying
recorded expert ids (some rows -1, the first MoE layer replayed onto experts 0-1 only). Compared with the
reference: the loss and every parameter's gradient (gathered) at both steps, the router biases after
balancing on every rank (statistics reduced over the ranks), the weights after step 2; the run is then
resumed from the torch.distributed.checkpoint written after step 1 into a model built from another seed,
and its step 2 must equal the uninterrupted one. Each rank stores exactly 1/EP of the expert bytes
(1/(EP·DP) with FSDP, which also shards them over DP).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from k3_factory import make_config, make_model  # noqa: E402

B, T, E, K = 4, 7, 4, 2  # global sequences, tokens per sequence, experts, experts per token
# case: (ranks, EP, FSDP); the cases of one phase run side by side on disjoint ranks.
CASES = {"ep2": ([0, 1], 2, True), "ep2_nofsdp": ([2, 3], 2, False), "ep2dp2": ([0, 1, 2, 3], 2, True)}
PHASES = [["ep2", "ep2_nofsdp"], ["ep2dp2"]]
RTOL, ATOL = 1e-10, 1e-12


def _model(seed: int = 0):
    model = make_model(make_config(num_hidden_layers=3, kda_layers=(1, 2)), seed=seed).train()
    # Layer 1's router avoids experts 2 and 3 under its own routing: their owners receive no rows there.
    model.model.layers[1].block_sparse_moe.gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, -10.0, -10.0]))
    return model


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (B, T), generator=g)  # [B, T]
    adv = torch.randn(B, generator=g, dtype=torch.float64)  # [B]
    replay = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * (T - 1) * 2)])
    replay = replay.view(B, T - 1, 2, K)  # [B, T-1, L, k]
    replay[:, :, 0] = torch.tensor([0, 1])  # the first MoE layer replayed onto experts 0 and 1 only
    replay[0, :3] = -1  # rows without a recording are routed by the router
    return ids, adv, replay


def _loss(model, ids, adv, replay, n_tokens: int) -> torch.Tensor:
    """The learner's contract: a sum over this rank's tokens divided by the GLOBAL token count."""
    from k3rl.model.policy import Policy

    policy = Policy(model)
    b = ids.shape[0]
    h = policy.final_hidden(ids[:, :-1], routed_expert_ids=replay)  # [b, T-1, d]
    logp = policy.selected_logprobs(h.flatten(0, 1), ids[:, 1:].flatten())  # [b·(T-1)]
    return -(logp.view(b, -1) * adv[:, None]).sum() / n_tokens


def _grads(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is not None:
            out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    return out


def _step(model, opt, ids, adv, replay, group=None, mesh=None):
    """Forward, backward, gradient sum, AdamW step, router balancing; (loss, grads before the step)."""
    from k3rl.rl.train import parallel
    from k3rl.rl.train.router_balance import balance_routers

    loss = _loss(model, ids, adv, replay, B * (T - 1))
    loss.backward()
    if mesh is not None:
        parallel.sync_grads(model, mesh)
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        loss = total
    grads = _grads(model)
    opt.step()
    opt.zero_grad()
    balance_routers(model, group=group)
    return loss.item(), grads


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def _reference() -> dict:
    ids, adv, replay = _batch()
    model = _model()
    opt = _optimizer(model)
    out = {}
    out["loss1"], out["grads1"] = _step(model, opt, ids, adv, None)
    out["loss2"], out["grads2"] = _step(model, opt, ids, adv, replay)
    out["state2"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def _run_case(case: str, mesh, rank: int, tmp: str) -> None:
    from k3rl.rl.train import parallel
    from k3rl.rl.train.expert_parallel import expert_parameters, local_nbytes

    ranks, ep, fsdp = CASES[case]
    group = parallel.mesh_group(mesh)
    me, world = ranks.index(rank), len(ranks)
    ids, adv, replay = _batch()
    rows = slice(me * B // world, (me + 1) * B // world)
    ids, adv, replay = ids[rows], adv[rows], replay[rows]

    model = _model()
    full_expert_bytes = sum(p.nbytes for n, p in model.named_parameters() if ".experts." in n)
    parallel.apply_parallelism(model, mesh, fsdp=fsdp)
    out = {"expert_bytes": local_nbytes(p for _, p in expert_parameters(model)), "full_expert_bytes": full_expert_bytes}
    opt = _optimizer(model)
    out["loss1"], out["grads1"] = _step(model, opt, ids, adv, None, group, mesh)
    parallel.save_sharded(os.path.join(tmp, case), model, [opt], group)
    out["loss2"], out["grads2"] = _step(model, opt, ids, adv, replay, group, mesh)
    out["state2"] = parallel.full_state_dict(model, mesh)

    resumed = parallel.apply_parallelism(_model(seed=5), mesh, fsdp=fsdp)
    opt = _optimizer(resumed)
    parallel.load_sharded(os.path.join(tmp, case), resumed, [opt], group)
    out["resumed_loss2"], _ = _step(resumed, opt, ids, adv, replay, group, mesh)
    out["resumed_state2"] = parallel.full_state_dict(resumed, mesh)
    out["biases"] = {n: b.clone() for n, b in resumed.named_buffers() if n.endswith("e_score_correction_bias")}
    torch.save(out, os.path.join(tmp, f"{case}-rank{me}.pt"))


def _worker(rank: int, world: int, init_file: str, tmp: str) -> None:
    from k3rl.rl.train import parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # Every rank creates every mesh (new process groups need the whole default group), then runs its cases.
        meshes = {case: parallel.make_mesh(ep, "cpu", ranks) for case, (ranks, ep, _) in CASES.items()}
        for phase in PHASES:
            for case in phase:
                if rank in CASES[case][0]:
                    _run_case(case, meshes[case], rank, tmp)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _close(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), f"{what}: names differ: {set(got) ^ set(want)}"
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {k}: {m}")


def test_expert_parallel_fsdp_equals_one_rank():
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.spawn(_worker, args=(4, os.path.join(tmp, "init"), tmp), nprocs=4, join=False)
        want = _reference()  # meanwhile, in this process
        while not ctx.join():
            pass
        results = {case: [torch.load(os.path.join(tmp, f"{case}-rank{r}.pt")) for r in range(len(CASES[case][0]))]
                   for case in CASES}
    assert want["loss1"] != want["loss2"]
    want_biases = {n: v for n, v in want["state2"].items() if n.endswith("e_score_correction_bias")}
    assert not torch.equal(want_biases["model.layers.2.block_sparse_moe.gate.e_score_correction_bias"],
                           torch.zeros(E, dtype=torch.float32)), "the balancing moved no bias: nothing tested"
    for case, per_rank in results.items():
        ranks, ep, fsdp = CASES[case]
        shards = len(ranks) if fsdp else ep  # FSDP shards each expert slice again over DP
        for r, res in enumerate(per_rank):
            assert res["expert_bytes"] * shards == res["full_expert_bytes"], (case, r, res["expert_bytes"])
            for key in ("loss1", "loss2", "resumed_loss2"):
                torch.testing.assert_close(res[key], want[key.replace("resumed_", "")], rtol=RTOL, atol=0)
            _close(res["grads1"], want["grads1"], f"{case} rank {r} grads step 1")
            _close(res["grads2"], want["grads2"], f"{case} rank {r} grads step 2 (replay)")
            _close(res["biases"], want_biases, f"{case} rank {r} router biases")
        root = per_rank[0]
        _close(root["state2"], want["state2"], f"{case} weights after step 2")
        _close(root["resumed_state2"], want["state2"], f"{case} resumed weights after step 2")
