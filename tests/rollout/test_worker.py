"""Ray rollout workers: several collect side by side; their trajectories round-trip through Parquet."""

import numpy as np
import pytest

from k3rl.rollout.engine import SamplingParams
from k3rl.rollout.trajectory import load_trajectories, save_trajectories
from k3rl.rollout.worker import RolloutWorker, WorkerSpec, build_engine

pytestmark = pytest.mark.ray

PASSAGES = [{"id": f"p{i}", "title": f"Doc {i}", "text": f"Passage {i} says the code word is w{i * 7}."}
            for i in range(6)]


def tasks(n, offset=0):
    return [(f"t{offset + i}", {"question": f"What is the code word of passage {i}?", "answers": [f"w{i * 7}"],
                                "evidence": [f"p{i}"], "passages": PASSAGES}) for i in range(n)]


def test_two_workers_collect_in_parallel(ray_cluster, tiny_qwen3_dir, tmp_path):
    ray = ray_cluster
    spec = WorkerSpec(model_dir=str(tiny_qwen3_dir), env="search", engine="torch",
                      sampling=SamplingParams(max_tokens=24, seed=0), max_context_tokens=2048)
    actor = ray.remote(RolloutWorker).options(num_cpus=1, max_restarts=0)
    workers = [actor.remote(spec) for _ in range(2)]
    health = ray.get([w.health.remote() for w in workers])
    assert len({h["pid"] for h in health}) == 2 and all(h["ok"] and h["version"] == 0 for h in health)
    refs = [w.collect.remote(tasks(2, offset=2 * k), 2) for k, w in enumerate(workers)]
    batches = ray.get(refs)
    trajs = [t for b in batches for t in b]
    assert len(trajs) == 8 and {t.group_id for t in trajs} == {"t0", "t1", "t2", "t3"}
    for t in trajs:
        assert t.num_sampled > 0 and t.env == "search" and t.finish_reason
        assert (t.versions[t.loss_mask == 1] == 0).all()
    path = save_trajectories(trajs, tmp_path / "rollouts.parquet")
    back = load_trajectories(path)
    for a, b in zip(trajs, back):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
        np.testing.assert_allclose(a.logprobs, b.logprobs)
        assert a.reward == b.reward and a.group_id == b.group_id
    # a weight push reaches every worker with its version
    weights = list(build_engine(spec).model.state_dict().items())
    assert ray.get([w.load_weights.remote(weights, 1) for w in workers]) == [1, 1]
    for w in workers:
        ray.kill(w)


def test_unknown_engine_is_named(tiny_qwen3_dir):
    with pytest.raises(ValueError, match="'tpu'"):
        RolloutWorker(WorkerSpec(model_dir=str(tiny_qwen3_dir), env="search", engine="tpu"))
