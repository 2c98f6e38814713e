"""A real local Ray cluster: actors hold state and round-trip data."""

import numpy as np
import pytest

pytestmark = pytest.mark.ray


def test_actor_round_trip(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    class Counter:
        def __init__(self):
            self.seen = []

        def push(self, x):
            self.seen.append(x)
            return sum(self.seen)

    actor = Counter.remote()
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((64, 64)) for _ in range(3)]
    outs = [ray.get(actor.push.remote(x)) for x in xs]
    np.testing.assert_array_equal(outs[-1], xs[0] + xs[1] + xs[2])
    assert ray.cluster_resources()["CPU"] == 2


def test_tasks_run_in_parallel_workers(ray_cluster):
    ray = ray_cluster

    @ray.remote(num_cpus=1)
    def pid_and_square(x):
        import os

        return os.getpid(), x * x

    results = ray.get([pid_and_square.remote(i) for i in range(6)])
    assert [r[1] for r in results] == [i * i for i in range(6)]
