"""rl/eval/evaluate.py: the one scorer — success by the environment's rule, reward components with intervals,
breakdowns by task field — checked against hand-computed cases; and the one Runner protocol it scores."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from k3rl.rl.eval.evaluate import breakdown, is_success, mean_interval, score, success_rule
from k3rl.rl.metrics import wilson_interval


def ep(reward: float, tool_calls: float = 1.0, **rewards: float) -> SimpleNamespace:
    return SimpleNamespace(reward=reward, rewards=rewards, metrics={"tool_calls": tool_calls})


def test_success_follows_the_declared_component_else_the_reward():
    assert is_success(ep(0.2, em=1.0), "em") and not is_success(ep(1.0, em=0.0), "em")
    assert is_success(ep(1.0), "em")  # the episode does not report em: its reward decides
    assert is_success(ep(1.0, em=0.0), None) and not is_success(ep(0.99), None)


def test_the_environment_declares_its_rule():
    import k3rl.envs as envs
    from k3rl.envs import Env

    class Plain(Env):
        def reset(self, task):
            return "hi"

    assert success_rule(Plain) is None and success_rule(Plain, "f1") == "f1"
    needle = envs.make("needle", length=300, serve="context")
    assert success_rule(needle) == "em"
    assert success_rule(envs.make("search", corpus=None)) == "em"


def test_score_against_a_hand_computed_case():
    eps = [ep(1.0, 2.0, em=1.0, f1=1.0), ep(0.5, 1.0, em=0.0, f1=0.5), ep(0.0, 0.0, em=0.0, f1=0.0),
           ep(0.75, 1.0, em=1.0)]
    s = score(eps, "em")
    assert (s.n, s.successes, s.rate) == (4, 2, 0.5)
    assert s.interval == wilson_interval(2, 4)
    # f1 over the three episodes that report it: mean 0.5, sd 0.5, half width 1.96·0.5/√3
    mean, lo, hi = s.components["f1"]
    assert mean == pytest.approx(0.5) and hi - mean == pytest.approx(1.959963984540054 * 0.5 / math.sqrt(3))
    assert s.reward[0] == pytest.approx(2.25 / 4) and s.tool_calls == pytest.approx(1.0)
    m = s.metrics("eval/")
    assert m["eval/success_rate"] == 0.5 and m["eval/num_tasks"] == 4 and m["eval/em"] == 0.5
    assert m["eval/f1_ci_low"] == pytest.approx(lo) and m["eval/reward_mean"] == pytest.approx(0.5625)
    assert "success 0.500 = 2/4" in s.line() and "f1 0.500 [" in s.line()


def test_mean_interval_edges():
    assert all(math.isnan(x) for x in mean_interval([]))
    mean, lo, hi = mean_interval([0.3])
    assert mean == 0.3 and math.isnan(lo) and math.isnan(hi)
    assert mean_interval([1.0, 1.0, 1.0]) == (1.0, 1.0, 1.0)
    empty = score([], None)
    assert empty.n == 0 and empty.rate == 0.0 and empty.interval == (0.0, 1.0)


def test_breakdown_by_task_fields():
    eps = [ep(1.0, em=1.0), ep(0.0, em=0.0), ep(1.0, em=1.0), ep(1.0, em=1.0)]
    tasks = [{"family": "needle", "length": 4096}, {"family": "needle", "length": 4096},
             {"family": "needle", "length": 16384}, {"family": "multihop"}]
    cells = breakdown(eps, tasks, ["family", "length"], "em")
    assert {k: (v.successes, v.n) for k, v in cells.items()} == {
        ("multihop", None): (1, 1), ("needle", 4096): (1, 2), ("needle", 16384): (1, 1)}
    with pytest.raises(ValueError, match="3 tasks for 4 trajectories"):
        breakdown(eps, tasks[:3], ["family"], "em")


def test_every_runner_plays_task_pairs():
    """One protocol, `play(tasks) -> trajectories`, for the local engine, the endpoint and the trainer's Ray pool."""
    import inspect

    from k3rl.rl.eval.endpoint import EndpointRunner
    from k3rl.rl.eval.runners import LocalRunner
    from k3rl.rl.orchestrator.pool_runner import PoolRunner

    for runner in (LocalRunner, EndpointRunner, PoolRunner):
        assert list(inspect.signature(runner.play).parameters) == ["self", "tasks"], runner
