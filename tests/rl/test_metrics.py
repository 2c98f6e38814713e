"""rl/metrics.py's MetricsLogger on resume: metrics.jsonl keeps the steps the checkpoint covers, the resumed run
appends the rest, and a step is never written twice."""

from __future__ import annotations

import pytest

from k3rl.rl.metrics import MetricsLogger, read_metrics


def test_a_resumed_log_holds_each_step_once(tmp_path):
    first = MetricsLogger(tmp_path, total_steps=4, console=False)
    for step in range(4):
        first.log(step, {"loss": float(step)})
    first.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # torn by the crash
    resumed = MetricsLogger(tmp_path, total_steps=4, resume_step=1, console=False)
    with pytest.raises(ValueError, match="step 1 logged after step 1"):
        resumed.log(1, {"loss": 9.0})
    for step in (2, 3):
        resumed.log(step, {"loss": 10.0 + step})
    with pytest.raises(ValueError, match="step 3 logged after step 3"):
        resumed.log(3, {"loss": 0.0})
    resumed.close()
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]


def test_non_finite_values_are_written_as_null():
    import json

    from k3rl.rl.metrics import null_nonfinite

    def refuse(constant):
        raise ValueError(constant)

    value = {"grid": [{"score": float("nan")}, {"score": 0.5}], "loss": (float("inf"), -float("inf"), 1.0), "n": 3}
    text = json.dumps(null_nonfinite(value), allow_nan=False)
    assert json.loads(text, parse_constant=refuse) == {"grid": [{"score": None}, {"score": 0.5}],
                                                       "loss": [None, None, 1.0], "n": 3}
