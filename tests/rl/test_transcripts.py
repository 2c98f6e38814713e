"""Held-out transcripts (rl/eval/transcripts.py): written and read back, paired before/after with the
changed outcomes first, and what the episodes did counted from the model's own tool calls."""

from __future__ import annotations

import numpy as np

from k3rl.rl.eval.transcripts import behaviour, eval_path, markdown, read_eval_episodes, side_by_side, tool_calls, write_eval_episodes
from k3rl.rollout.trajectory import Trajectory

SEARCH = '<tool_call>\n{"name": "search", "arguments": {"query": "sailor rug"}}\n</tool_call>'


def answer(text: str) -> str:
    return '<tool_call>\n{"name": "answer", "arguments": {"text": "' + text + '"}}\n</tool_call>'


def record(task_id: str, text: str, em: float, f1: float) -> dict:
    return {"task_id": task_id, "reward": 0.9 * f1, "rewards": {"em": em, "f1": f1}, "finish_reason": "done",
            "tool_calls": 1.0, "text": text}


class CharTokenizer:
    """Token id = code point: decode is exact, so the test sees precisely what was written."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(map(chr, ids))


def test_write_and_read_back_the_episodes_after_the_prompt(tmp_path):
    prompt, rest = "PROMPT", SEARCH + "\nobs\n" + answer("grey")
    tokens = np.array([ord(c) for c in prompt + rest], dtype=np.int32)
    n = len(tokens)
    trajs = [Trajectory(tokens=tokens, loss_mask=np.zeros(n, np.uint8), logprobs=np.zeros(n, np.float32),
                        versions=np.full(n, -1, np.int32), turn_spans=np.zeros((0, 2), np.int32),
                        prompt_len=len(prompt), reward=0.9, rewards={"em": 1.0, "f1": 1.0}, task_id=tid,
                        finish_reason="done") for tid in ("t2", "t1")]
    path = write_eval_episodes(tmp_path, 3, trajs, CharTokenizer())
    assert path == eval_path(tmp_path, 3) == tmp_path / "eval" / "step_0003.jsonl"
    rows = read_eval_episodes(path)
    assert [r["task_id"] for r in rows] == ["t1", "t2"]  # sorted, so two evaluations line up
    assert rows[0]["text"] == rest and rows[0]["rewards"] == {"em": 1.0, "f1": 1.0}


def test_tool_calls_reads_every_call_and_skips_broken_ones():
    text = SEARCH + "\n<tool_response>x</tool_response>\n<tool_call>{broken</tool_call>\n" + answer("red, I think")
    calls = tool_calls(text)
    assert [c.name for c in calls] == ["search", "answer"]
    assert calls[1].arguments == {"text": "red, I think"}


def test_behaviour_counts_hedges_searches_and_answers():
    eps = [record("a", SEARCH + answer("grey, I think"), 0, 0.5),
           record("b", SEARCH + answer("grey"), 1, 1.0),
           record("c", answer("blue"), 0, 0.0),
           record("d", "no call at all", 0, 0.0)]
    got = behaviour(eps, hedge=", I think")
    assert got == {"answered": 0.75, "searched": 0.5, "contains_gold": 0.5, "hedged": 0.25}
    assert "hedged" not in behaviour(eps)


def test_side_by_side_puts_the_changed_outcomes_first():
    before = [record("same", answer("x"), 0, 0.0), record("lost", answer("red"), 1, 1.0),
              record("gained", answer("red, I think"), 0, 0.5), record("only-before", answer("x"), 0, 0.0)]
    after = [record("gained", answer("red"), 1, 1.0), record("same", answer("x"), 0, 0.0),
             record("lost", answer("blue"), 0, 0.0)]
    pairs = side_by_side(before, after, k=3)
    assert [p["task_id"] for p in pairs] == ["gained", "lost", "same"]
    assert pairs[0]["before"]["text"].endswith(answer("red, I think"))
    page = markdown(pairs[:1])
    assert "## task gained" in page and "**before RL** — reward 0.450" in page and "**after RL**" in page
