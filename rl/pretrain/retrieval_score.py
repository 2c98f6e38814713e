"""Retrieval for base models: does the model read the answer out of the context, before it can call any tool?

For tasks of a long-context family (envs/longctx/) at each length, the log-probability of the gold answer after the
plain prompt (envs/longctx/practice.py `plain_prompt`: "<document> … </document>, Question: …, Answer:") is compared
with the same after the same prompt with the evidence passages taken out of the haystack (same question, same other
passages). A model that retrieves puts clearly more mass on the answer when the evidence is there; a model that does
not use the context (a bigram model, or one whose attention never reaches back) scores the same either way. Per
length: the mean log p (nats) with and without the evidence, their mean paired difference (the gain) with a 95%
Student-t interval over tasks, and the share of tasks where the evidence raised it.

What is scored: the tokens of " answer" (the first gold answer after one space, `plain_answer` without its closing
newline: the newline says the answer ended, not where it was read), tokenized after the prompt as the pretraining
text would be (the prompt's own tokens unchanged). Log-probs come from `score`, the learner's own path
(rl/train/learner.py `Learner.score`, as the held-out loss by position in rl/pretrain/climb_report.py: segment by
segment when a prompt is longer than `learner.segment_tokens`). The greedy first-token accuracy is not reported:
`Learner.score` returns the log-probs of the given tokens only, not the argmax.

Tasks are `env.tasks(num_tasks, seed)` of the in-context environment (`envs.make(family, serve="context", length=…)`),
unanswerable ones off (`unanswerable_rate: 0` unless the options say otherwise; an instance without an evidence
passage is skipped and counted). A length is the environment's: the most tokens of its in-context user message
(instructions, document, question: envs/longctx/haystack.py `PROMPT_CONTEXT`; `k3rl eval`'s lengths also count the chat
template and system message); the plain prompt, without the instructions, is a little shorter — its mean tokens are
reported.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

DEFAULT_OPTIONS = {"unanswerable_rate": 0.0}
"""Generator options the score sets unless given: an unanswerable task has no evidence to take away."""


@dataclass
class Pair:
    """One task as two scored sequences: the plain prompt with and without the evidence passages, then the answer."""

    task: int
    with_evidence: np.ndarray
    without_evidence: np.ndarray
    answer_tokens: int


def answer_tokens(tokenizer: Any, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """(prompt ids, answer ids): the answer's ids as they follow the prompt in `prompt + answer` when the prompt's
    ids are a prefix of that (BPE keeps " word" whole), else the answer tokenized alone."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    joint = tokenizer(prompt + answer, add_special_tokens=False)["input_ids"]
    if joint[:len(prompt_ids)] == prompt_ids and len(joint) > len(prompt_ids):
        return prompt_ids, joint[len(prompt_ids):]
    return prompt_ids, tokenizer(answer, add_special_tokens=False)["input_ids"]


def task_pairs(family: str, tokenizer: Any, length: int, num_tasks: int, seed: int,
               options: Optional[dict[str, Any]] = None) -> tuple[list[Pair], int, list[int]]:
    """(pairs, skipped, plain-prompt tokens with the evidence) of `num_tasks` tasks of `family` at `length`."""
    import k3rl.envs as envs
    from k3rl.envs.longctx.practice import plain_answer, plain_prompt

    env = envs.make(family, serve="context", tokenizer=tokenizer, length=int(length),
                    **{**DEFAULT_OPTIONS, **(options or {})})
    pairs, skipped, prompt_tokens = [], 0, []
    for i, task in enumerate(env.tasks(num_tasks, seed=seed)):
        try:
            inst = env.instance(task)
        except ValueError as e:  # a length too short for the family's facts, a source too small
            raise ValueError(f"{family} at {length} tokens, task {i}: {e}") from None
        evidence = set(inst.evidence)
        kept = [(pid, text) for pid, text in inst.passages if pid not in evidence]
        if inst.unanswerable or len(kept) == len(inst.passages):
            skipped += 1
            continue
        answer = plain_answer(inst.answers[0]).rstrip("\n")
        seqs = []
        for passages in (None, kept):
            prompt, ids = answer_tokens(tokenizer, plain_prompt(inst, passages), answer)
            seqs.append(np.asarray(prompt + ids, dtype=np.int64))
            if passages is None:
                prompt_tokens.append(len(prompt))
        pairs.append(Pair(i, seqs[0], seqs[1], len(ids)))
    return pairs, skipped, prompt_tokens


def t_quantile(p: float, df: int) -> float:
    """The `p` quantile (p > 0.5) of Student's t with `df` degrees of freedom, from its density integrated on a grid
    (no scipy; p up to 0.99 for df ≥ 2, 0.975 for df = 1)."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    x = np.linspace(0.0, 16.0, 160_001)  # the 0.975 quantile is 12.71 at df = 1, less above
    pdf = np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df))
    cdf = 0.5 + np.concatenate([[0.0], np.cumsum((pdf[1:] + pdf[:-1]) / 2 * np.diff(x))])
    return float(np.interp(p, cdf, x))


def paired_interval(diffs: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high): the mean of paired differences and its 95% Student-t interval (NaN bounds for n < 2)."""
    from k3rl.rl.eval.evaluate import mean_interval

    n = len(diffs)
    return mean_interval(diffs, z=t_quantile(0.975, n - 1) if n >= 2 else math.nan)


def _trajectory(tokens: np.ndarray, answer: int):
    from k3rl.rl.train.supervised import as_trajectory

    mask = np.zeros(len(tokens), dtype=np.uint8)
    mask[len(tokens) - answer:] = 1
    return as_trajectory(tokens, mask)


def score_pairs(score: Callable[[list], list[np.ndarray]], pairs: Sequence[Pair]) -> dict[str, Any]:
    """Per-task log p(answer) with and without the evidence (`score`: log π of each loss-mask token, as
    `Learner.score`), and the per-length summary."""
    trajectories = [_trajectory(s, p.answer_tokens) for p in pairs for s in (p.with_evidence, p.without_evidence)]
    logps = score(trajectories) if trajectories else []
    with_ = np.array([float(np.sum(lp)) for lp in logps[0::2]])
    without = np.array([float(np.sum(lp)) for lp in logps[1::2]])
    gain, low, high = paired_interval(with_ - without)
    return {"n": len(pairs), "logp_with": float(with_.mean()) if len(pairs) else math.nan,
            "logp_without": float(without.mean()) if len(pairs) else math.nan,
            "gain": gain, "gain_low": low, "gain_high": high,
            "wins": int(np.sum(with_ > without)), "answer_tokens": float(np.mean([p.answer_tokens for p in pairs]))
            if pairs else math.nan,
            "tasks": [{"task": p.task, "logp_with": float(a), "logp_without": float(b)}
                      for p, a, b in zip(pairs, with_, without)]}


def retrieval_score(score: Callable[[list], list[np.ndarray]], tokenizer: Any, families: Sequence[str],
                    lengths: Sequence[int], num_tasks: int, seed: int,
                    options: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """The likelihood score of the model behind `score` (`Learner.score` or `LearnerGroup.score`) for each family
    and length: {"families": {family: {length: summary}}, …}; a summary holds n, skipped, prompt_tokens (mean,
    plain prompt with the evidence), evidence_tokens (mean taken out), logp_with, logp_without, gain with
    gain_low/gain_high (95%), wins (tasks where the evidence raised log p) and each task's numbers."""
    out: dict[str, Any] = {"num_tasks": int(num_tasks), "seed": int(seed), "options": dict(options or {}),
                           "families": {}}
    for family in families:
        rows: dict[str, Any] = {}
        for length in lengths:
            pairs, skipped, prompt_tokens = task_pairs(family, tokenizer, int(length), num_tasks, seed, options)
            row = score_pairs(score, pairs)
            removed = [len(p.with_evidence) - len(p.without_evidence) for p in pairs]
            row.update(skipped=skipped, prompt_tokens=float(np.mean(prompt_tokens)) if prompt_tokens else math.nan,
                       evidence_tokens=float(np.mean(removed)) if removed else math.nan)
            rows[str(int(length))] = row
        out["families"][family] = rows
    return out


def stage_score(cfg: Any, stage: Any, score: Callable[[list], list[np.ndarray]], tokenizer: Any) -> dict[str, Any]:
    """`pretrain.retrieval_score` of a climb's stage (rl/pretrain/climb.py): its lengths up to the stage's
    (`lengths`, or the stage's grid lengths when empty), the held-out task seed `eval.seed`."""
    from omegaconf import OmegaConf

    from k3rl.rl.config import ConfigError
    from k3rl.rl.pretrain.stages import eval_lengths

    conf = cfg.pretrain.retrieval_score
    own = [int(n) for n in conf.lengths]
    lengths = ([n for n in own if n <= stage.seq_len] or [min(own)]) if own else eval_lengths(cfg, stage)
    options = OmegaConf.to_container(conf.options, resolve=True) if OmegaConf.is_config(conf.options) else conf.options
    try:
        return retrieval_score(score, tokenizer, list(conf.families), lengths, int(conf.num_tasks), int(cfg.eval.seed),
                               dict(options))
    except ValueError as e:
        raise ConfigError(f"pretrain.retrieval_score: {e}") from None


def check_settings(cfg: Any) -> None:
    """A ConfigError naming `pretrain.retrieval_score.families` / `.options` when a family is unknown or refuses the
    options (checked on one task's facts, no haystack: before any work)."""
    import k3rl.envs as envs
    from k3rl.envs.longctx.families import GENERATORS
    from k3rl.rl.config import ConfigError

    conf = cfg.pretrain.retrieval_score
    if not conf.enabled:
        return
    bad = [f for f in conf.families if f not in GENERATORS]
    if bad or not conf.families:
        raise ConfigError(f"pretrain.retrieval_score.families: {bad or 'empty'}; choose from {', '.join(GENERATORS)}")
    for family in conf.families:
        try:
            envs.make(family, serve="context", **{**DEFAULT_OPTIONS, **conf.options})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"pretrain.retrieval_score.options: {e}") from None


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """The score without its per-task rows: what a stage's summary (summary.json) keeps."""
    return {**result, "families": {f: {n: {k: v for k, v in row.items() if k != "tasks"} for n, row in rows.items()}
                                   for f, rows in result.get("families", {}).items()}}


def scalars(result: dict[str, Any]) -> dict[str, float]:
    """`retrieval/<family>/<length>/{with,without,gain}`: what the metrics log and TensorBoard take."""
    out = {}
    for family, rows in result.get("families", {}).items():
        for length, row in rows.items():
            for key, name in (("logp_with", "with"), ("logp_without", "without"), ("gain", "gain")):
                if math.isfinite(row[key]):
                    out[f"retrieval/{family}/{length}/{name}"] = row[key]
    return out


def format_table(result: dict[str, Any], title: str = "retrieval") -> str:
    """The score as a small table: one line per family and length."""
    lines = [f"{title}: log p(gold answer) in nats after the plain prompt, with vs without the evidence passages "
             f"({result['num_tasks']} tasks per length, seed {result['seed']})",
             f"  {'family':<10} {'length':>7} {'prompt':>7} {'with':>8} {'without':>8}  {'gain [95% CI]':<26} wins"]
    for family, rows in result.get("families", {}).items():
        for length, r in rows.items():
            ci = f"{r['gain']:+.3f} [{r['gain_low']:+.3f}, {r['gain_high']:+.3f}]"
            lines.append(f"  {family:<10} {length:>7} {r['prompt_tokens']:>7.0f} {r['logp_with']:>8.3f} "
                         f"{r['logp_without']:>8.3f}  {ci:<26} {r['wins']}/{r['n']}")
    return "\n".join(lines)


__all__ = ["DEFAULT_OPTIONS", "Pair", "answer_tokens", "check_settings", "format_table", "paired_interval",
           "retrieval_score", "scalars", "score_pairs", "stage_score", "summary", "t_quantile", "task_pairs"]
