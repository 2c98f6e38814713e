"""The retrieval score of base models (rl/pretrain/retrieval_score.py): log p(gold answer) with vs without the
evidence passages is higher on a model that copies from its context and equal, to the last bit, on one that
cannot see past the previous token; the Student-t interval; a real tiny K3 scored through `Learner.score` (segment
by segment) equals its plain forward."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from k3rl.rl.pretrain.retrieval_score import answer_tokens, format_table, paired_interval, retrieval_score, scalars, t_quantile, task_pairs

SEED = 1_000_003
NEEDLE = {"source": "wiki", "distractors": 0}


@pytest.fixture(scope="module")
def tokenizer(k3_dir):
    from k3rl.model.tokenizer import load_tokenizer

    return load_tokenizer(k3_dir)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max()
    return z - math.log(np.exp(z).sum())


def scorer(next_logits):
    """`Learner.score` of a hand-built model: `next_logits(prefix) -> [V]` float64 logits of the token after
    `prefix`; log π of every loss-mask token (after the first) from the tokens before it."""
    def score(trajectories):
        out = []
        for t in trajectories:
            tokens = np.asarray(t.tokens, dtype=np.int64)
            scored = np.flatnonzero(np.asarray(t.loss_mask)[1:]) + 1
            out.append(np.array([log_softmax(next_logits(tokens[:i]))[tokens[i]] for i in scored]))
        return out
    return score


def copier(vocab: int, strength: float = 50.0):
    """A model that copies: each token's probability grows with how often it occurs in the context so far."""
    return scorer(lambda prefix: np.log1p(strength * np.bincount(prefix, minlength=vocab).astype(np.float64)))


def blind(vocab: int):
    """A bigram model: the logits depend on the last token only, so the context before it changes nothing."""
    v = np.arange(vocab, dtype=np.float64)
    return scorer(lambda prefix: 3.0 * np.sin(0.37 * float(prefix[-1]) + 1.3 * v))


def test_copying_model_scores_higher_with_the_evidence(tokenizer):
    result = retrieval_score(copier(len(tokenizer)), tokenizer, ["needle"], [1024], 6, SEED, NEEDLE)
    row = result["families"]["needle"]["1024"]
    assert row["n"] == 6 and row["skipped"] == 0
    assert row["logp_with"] > row["logp_without"] + 1.0
    assert row["gain_low"] > 0 and row["wins"] == 6
    assert all(t["logp_with"] > t["logp_without"] for t in row["tasks"])
    assert 0 < row["evidence_tokens"] < row["prompt_tokens"] <= 1024
    assert scalars(result)["retrieval/needle/1024/gain"] == pytest.approx(row["gain"])
    assert "needle" in format_table(result)


def test_blind_model_scores_the_same_with_and_without(tokenizer):
    result = retrieval_score(blind(len(tokenizer)), tokenizer, ["needle", "multihop"], [1024], 4, SEED, {})
    for family in ("needle", "multihop"):
        row = result["families"][family]["1024"]
        assert row["n"] == 4 and row["gain"] == 0.0 and row["wins"] == 0
        assert all(t["logp_with"] == t["logp_without"] for t in row["tasks"])
        assert row["logp_with"] < 0


def test_pairs_take_out_exactly_the_evidence(tokenizer):
    """Without evidence = the same prompt minus the evidence passages; the answer is the same tokens at the end."""
    pairs, skipped, _ = task_pairs("needle", tokenizer, 1024, 3, SEED, NEEDLE)
    assert skipped == 0 and len(pairs) == 3
    for p in pairs:
        n = p.answer_tokens
        assert n >= 1 and list(p.with_evidence[-n:]) == list(p.without_evidence[-n:])
        assert len(p.without_evidence) < len(p.with_evidence)
    prompt, ids = answer_tokens(tokenizer, "Question: what colour?\nAnswer:", " purple")
    assert tokenizer.decode(ids) == " purple" and tokenizer.decode(prompt) == "Question: what colour?\nAnswer:"


def test_t_interval():
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 5, 15, 40):
        assert t_quantile(0.975, df) == pytest.approx(scipy_stats.t.ppf(0.975, df), rel=1e-6)
    d = np.array([0.3, -0.1, 0.5, 0.2, 0.9])
    mean, low, high = paired_interval(d)
    half = scipy_stats.t.ppf(0.975, 4) * d.std(ddof=1) / math.sqrt(5)
    assert (low, high) == pytest.approx((mean - half, mean + half), rel=1e-6)
    assert math.isnan(paired_interval([1.0])[1])


def test_tiny_k3_through_the_learner_equals_its_plain_forward(k3_dir, tokenizer):
    """End to end on a real tiny K3: `Learner.score` segment by segment (256 tokens) gives the log-probs of one plain
    float64 forward of the same prompt and answer."""
    from k3rl.rl.train.learner import Learner, LearnerConfig

    learner = Learner(LearnerConfig(model_path=str(k3_dir), algo="nll", dtype="float64", segment_tokens=256,
                                    micro_batch_tokens=4096))
    result = retrieval_score(learner.score, tokenizer, ["needle"], [1024], 2, SEED, NEEDLE)
    row = result["families"]["needle"]["1024"]
    assert row["n"] == 2 and all(math.isfinite(row[k]) for k in ("logp_with", "logp_without", "gain"))
    pairs, _, _ = task_pairs("needle", tokenizer, 1024, 2, SEED, NEEDLE)
    for p, task in zip(pairs, row["tasks"]):
        for tokens, key in ((p.with_evidence, "logp_with"), (p.without_evidence, "logp_without")):
            ids = torch.as_tensor(tokens).unsqueeze(0)
            with torch.no_grad():
                logp = torch.log_softmax(learner.model(ids).logits[0].double(), -1)
            n = p.answer_tokens
            plain = logp[-n - 1:-1].gather(1, ids[0, -n:, None]).sum().item()
            assert task[key] == pytest.approx(plain, abs=1e-9)


def test_climb_reports_the_score_at_each_stage_start_and_end(tmp_path, monkeypatch, capsys):
    """`k3rl pretrain` with `pretrain.retrieval_score.enabled`: a one-step stage writes the score at its start and
    end to `retrieval.json`, logs it as scalars in those steps' metrics rows, prints the table and keeps it in
    `summary.json` and its plot."""
    import json
    from pathlib import Path

    from k3rl.envs.sources import wiki_records
    from k3rl.rl.config import JobConfig, load_config
    from k3rl.rl.metrics import read_metrics
    from k3rl.rl.pretrain.climb import Climb

    repo = Path(__file__).parents[2]
    monkeypatch.setenv("K3RL_DATA", str(tmp_path / "data"))
    corpus = tmp_path / "short.jsonl"
    corpus.write_text("".join(json.dumps({"text": r["extract"]}) + "\n" for r in wiki_records()[:300]))
    path = tmp_path / "climb.yaml"
    path.write_text(
        f"base: {repo / 'configs/model/tiny.yaml'}\n"
        f"run: {{name: rs, output_dir: {tmp_path / 'runs'}}}\n"
        "model: {num_hidden_layers: 4, max_position_embeddings: 4096, linear_attn_config: {kda_layers: [1, 2, 3], "
        "full_attn_layers: [4]}}\n"
        "learner: {micro_batch_tokens: 4096}\n"
        "pretrain:\n"
        f"  sources: {{short: {{path: {corpus}}}}}\n"
        "  heldout_docs: 0\n  eval_grid: false\n"
        "  retrieval_score: {enabled: true, num_tasks: 2, lengths: [1024, 2048], options: {source: wiki}}\n"
        "  stages:\n"
        "    - {seq_len: 1024, tokens: 1024, batch_tokens: 1024, learner: {lr: 1.0e-3, lr_scheduler: constant}}\n")
    Climb(load_config(path, [], JobConfig)).run()
    sdir = tmp_path / "runs/rs/stage1-1K"
    saved = json.loads((sdir / "retrieval.json").read_text())
    assert set(saved) == {"start", "end"} and saved["end"]["step"] == 1
    assert list(saved["end"]["families"]["needle"]) == ["1024"]  # 2048 is past the stage's length
    row = saved["end"]["families"]["needle"]["1024"]
    assert row["n"] == 2 and len(row["tasks"]) == 2
    rows = {r["step"]: r for r in read_metrics(sdir)}
    assert rows[0]["retrieval/needle/1024/gain"] == pytest.approx(saved["start"]["families"]["needle"]["1024"]["gain"])
    assert rows[1]["retrieval/needle/1024/with"] == pytest.approx(row["logp_with"])
    summary = json.loads((tmp_path / "runs/rs/summary.json").read_text())
    assert summary[0]["retrieval_end"]["families"]["needle"]["1024"]["wins"] == row["wins"]
    assert "tasks" not in summary[0]["retrieval_end"]["families"]["needle"]["1024"]
    assert "stage1-1K retrieval at step 1" in capsys.readouterr().out
    assert (tmp_path / "runs/rs/retrieval_gain.png").is_file()


@pytest.mark.parametrize("override, message", [
    ("pretrain.retrieval_score.families=[needel]", "pretrain.retrieval_score.families: ['needel']"),
    ("pretrain.retrieval_score.options={lenght: 3}", "pretrain.retrieval_score.options: "),
    ("pretrain.retrieval_score.options={ask: size}", "pretrain.retrieval_score.options: needle options"),
])
def test_bad_settings_are_named_before_work(override, message):
    from pathlib import Path

    from k3rl.rl.config import ConfigError, PretrainJob, load_config
    from k3rl.rl.pretrain.retrieval_score import check_settings

    cfg = load_config(Path(__file__).parents[2] / "configs/pretrain/cpu.yaml",
                      ["pretrain.retrieval_score.enabled=true", override], PretrainJob)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_settings(cfg)
