"""SFT warm start (rl/orchestrator/sft.py, trained by the learner's `nll` objective through rl/train/supervised.py):
demonstrations are the agent loop's own tokens, the loss rows are exactly the model's turns, the loss
is the masked cross-entropy, micro-batching equals one batch, epochs are seeded shuffles,
a short `k3rl sft` run lowers the loss and saves a loadable model, SFT teaches the tool protocol to
a tiny model, and bad configs fail with named errors.

A toy search environment (three one-sentence passages per task, a one-line system prompt) keeps a
demonstration near 450 tokens, so all of this runs on two CPU cores in a few minutes; the real search
environment differs only in its corpus and its long system prompt.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from k3rl.envs.registry import register
from k3rl.envs.search import SearchEnv
from k3rl.rl.commands.sft import main
from k3rl.rl.config import ConfigError, SFTConfig, SFTLearner
from k3rl.rl.eval.runners import greedy_report
from k3rl.rl.orchestrator.demonstrations import collect_demonstrations, demonstrations
from k3rl.rl.train.batching import collate, to_train_sequence
from k3rl.rl.train.learner import Learner, LearnerConfig
from k3rl.rl.train.supervised import as_trajectory, step_batches, train_supervised
from k3rl.rollout.chat import render_transcript as render_demonstration

REPO = Path(__file__).parents[2]
ADJECTIVES = ["old", "small", "famous", "northern", "hidden", "painted", "silver", "quiet"]
NOUNS = ["bridge", "festival", "harbour", "tower", "market", "garden", "library", "lake"]
REGIONS = ["Amber", "Cobalt", "Juniper", "Saffron", "Willow", "Granite", "Heron", "Maple"]
SYLLABLES = ["ka", "lo", "mi", "ren", "tas", "vo", "dri", "sel", "mar", "zen", "bo", "lu"]


def toy_tasks(n: int, seed: int = 0) -> list[dict]:
    """`n` questions "which article is described as …?", each over its own three passages (one is the answer)."""
    rng = random.Random(seed)
    entities: dict[str, str] = {}
    while len(entities) < n + 2:
        name = "".join(rng.sample(SYLLABLES, 3)).capitalize()
        desc = f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} of the {rng.choice(REGIONS)} valley"
        if desc not in entities.values():
            entities[name] = desc
    items = list(entities.items())
    tasks = []
    for i, (name, desc) in enumerate(items[:n]):
        chosen = [(name, desc), *rng.sample([e for e in items if e[0] != name], 2)]
        passages = [{"id": f"{nm.lower()}#0", "title": nm, "text": f"{nm} is the {d}."} for nm, d in chosen]
        rng.shuffle(passages)
        question = f'Which article is described as "{desc}"? Answer with its title.'
        tasks.append({"id": f"toy-{seed}-{i}", "question": question, "answers": [name],
                      "evidence": [f"{name.lower()}#0"], "passages": passages})
    return tasks


@register("sft-toy-search")
class ToySearch(SearchEnv):
    """Search over three passages per task, with a one-line system prompt (short demonstrations)."""

    def __init__(self, **kwargs):
        super().__init__(corpus=None, **kwargs)

    def system_message(self) -> str:
        return "Answer the question with the tools search, open and answer."

    def tasks(self, n: int, seed: int = 0) -> list[dict]:
        return toy_tasks(n, seed)


def write_job(tmp_path: Path, name: str, **sft) -> Path:
    """A `k3rl sft` recipe: the tiny K3 model section, the toy environment, `sft` settings."""
    job = {"base": [str(REPO / "configs/model/tiny.yaml")],
           "run": {"output_dir": str(tmp_path), "name": name, "seed": 0},
           "env": {"name": "sft-toy-search"},
           "rollout": {"max_turns": 4, "max_new_tokens": 96, "max_context_tokens": 1024},
           "sft": sft}
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(job))
    return path


@pytest.fixture(scope="module")
def k3_run(tmp_path_factory):
    """`k3rl sft` from nothing: the tiny K3 built from its recipe, 4 toy demonstrations, 8 steps."""
    tmp = tmp_path_factory.mktemp("sft-k3")
    path = write_job(tmp, "k3", num_tasks=4, max_steps=8, batch_size=1, grad_accum=2, learner={"lr": 3e-3, "warmup_steps": 0},
                     logging_steps=2, eval_tasks=2)
    assert main([str(path), "sft.learner.logprob_chunk_size=64"]) == 0
    return tmp / "k3"


@pytest.fixture(scope="module")
def k3_tokenizer(k3_run):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(k3_run / "init")


def sft_cfg(**kw) -> SFTConfig:
    return SFTConfig(**{**dict(env="sft-toy-search", learner=SFTLearner(warmup_steps=0), logging_steps=1), **kw})


class ReplayEngine:
    """An engine that "samples" each demonstration's own assistant tokens: given a prompt, it finds
    the demonstration the prompt is a prefix of and returns the tokens up to the end of that turn."""

    version = 0

    def __init__(self, demos: list[tuple[list[int], list[int]]]):
        self.demos = demos

    def generate(self, prompts, params):
        from k3rl.rollout.engine import Completion

        out = []
        for p in prompts:
            match = [(ids, mask) for ids, mask in self.demos if ids[:len(p)] == p and len(ids) > len(p)]
            assert match, "the agent loop built a context that is no demonstration's prefix"
            ids, mask = match[0]
            assert mask[len(p)] == 1, "the agent loop asks for a turn where the demonstration has context tokens"
            end = len(p)
            while end < len(ids) and mask[end]:
                end += 1
            out.append([Completion(ids[len(p):end], [0.0] * (end - len(p)), "stop")])
        return out

    def load_weights(self, named_tensors, version):
        raise NotImplementedError

    def reset_cache(self):
        pass


@pytest.mark.parametrize("which", ["k3", "qwen3"])
def test_demonstrations_are_the_agent_loops_own_tokens(which, k3_tokenizer, tiny_qwen3_dir):
    from transformers import AutoTokenizer

    import k3rl.envs as envs
    from k3rl.envs.base import run_episode
    from k3rl.rollout.agent_loop import AgentLoop, EpisodeRequest
    from k3rl.rollout.chat import ChatRenderer
    from k3rl.rollout.engine import SamplingParams

    tokenizer = k3_tokenizer if which == "k3" else AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    tasks = toy_tasks(3, seed=5)
    data = demonstrations("sft-toy-search", 3, 5, tokenizer)
    assert data.num_rows == 3 and set(data["reward"]) == {1.0}
    demos = [(row["input_ids"], row["assistant_masks"]) for row in data]

    # The agent loop, driven by an engine that samples the demonstrations' assistant tokens, builds
    # exactly the demonstrations: same tokens, and loss mask = assistant mask.
    loop = AgentLoop(ReplayEngine(demos), tokenizer, lambda: envs.make("sft-toy-search"),
                     SamplingParams(temperature=0.0, max_tokens=96), max_context_tokens=4096)
    trajectories = loop.run([EpisodeRequest(t, t["id"], t["id"]) for t in tasks])
    for traj, (ids, mask) in zip(trajectories, demos):
        assert traj.tokens.tolist() == ids
        assert traj.loss_mask.tolist() == mask
        assert traj.reward == 1.0 and traj.finish_reason == "done"

    # Detokenised, a demonstration is the transcript: the prompt is the chat template's, every
    # assistant span is the oracle's text, every context span after it carries the tool's output.
    renderer = ChatRenderer(tokenizer)
    env = envs.make("sft-toy-search")
    for task, (ids, mask) in zip(tasks, demos):
        messages = run_episode(env, task, env.oracle(task), count_tokens=lambda s: len(renderer.encode(s))).messages
        assert render_demonstration(renderer, messages)[:2] == (ids, mask)
        spans, start = [], 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or mask[i] != mask[start]:
                spans.append((mask[start], tokenizer.decode(ids[start:i], skip_special_tokens=False)))
                start = i
        prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
        assert spans[0] == (0, prompt)
        said = [m["content"] for m in messages if m["role"] == "assistant"]
        tools = [m["content"] for m in messages if m["role"] == "tool"][:-1]  # the terminal result is not trained
        assert [text for kind, text in spans if kind == 1] == said
        context = [text for kind, text in spans[1:] if kind == 0]
        assert len(context) == len(tools) and all(out in text for out, text in zip(tools, context))


def test_render_keeps_rollout_turn_ends(k3_tokenizer):
    from k3rl.envs.tools import format_call
    from k3rl.rollout.chat import ChatRenderer

    renderer = ChatRenderer(k3_tokenizer)
    opening = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    call = format_call("search", {"query": "x"})
    # A turn without a call ends with the EOS the model samples; the next context skips the template's own end.
    ids, mask, turns = render_demonstration(renderer, opening + [
        {"role": "assistant", "content": "thinking"}, {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": call}, {"role": "tool", "content": "final"}])
    first = renderer.prompt_tokens(opening)
    said = renderer.encode("thinking") + [k3_tokenizer.eos_token_id]
    assert ids[:len(first) + len(said)] == first + said
    rest = ids[len(first) + len(said):]
    obs = renderer.observation_tokens("ok", turn_ended_with_eos=True)
    assert rest == obs + renderer.encode(call)
    assert mask == [0] * len(first) + [1] * len(said) + [0] * len(obs) + [1] * len(renderer.encode(call))
    assert turns == [len(said), len(renderer.encode(call))]
    with pytest.raises(ValueError, match="continues after"):
        render_demonstration(renderer, opening + [{"role": "assistant", "content": call + " and more"}])


def tokenizer_of(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def nll_learner(path, **kw) -> Learner:
    return Learner(LearnerConfig(model_path=str(path), algo="nll", **kw))


def test_loss_mask_is_exactly_the_assistant_tokens(k3_run):
    """A demonstration trains where its next token is the assistant's: right-padded in a micro-batch,
    the loss rows are the assistant mask shifted by one, and nothing else."""
    data = demonstrations("sft-toy-search", 3, 1, tokenizer_of(k3_run / "init"))
    seqs = [to_train_sequence(as_trajectory(r["input_ids"], r["assistant_masks"]), 1.0) for r in data]
    mb = collate(seqs, torch.device("cpu"), None)
    lengths = mb.valid.sum(1).tolist()
    assert len(set(lengths)) > 1, "the batch should need padding"
    expected_targets = []
    for b, row in enumerate(data):
        n = len(row["input_ids"]) - 1
        assert lengths[b] == n and mb.input_ids[b, :n].tolist() == row["input_ids"][:-1]
        assert mb.loss_mask[b].tolist() == [bool(m) for m in row["assistant_masks"][1:]] + [False] * (mb.input_ids.shape[1] - n)
        expected_targets += [t for t, m in zip(row["input_ids"][1:], row["assistant_masks"][1:]) if m]
    assert mb.targets.tolist() == expected_targets


@pytest.mark.parametrize("which", ["k3", "qwen3"])
def test_loss_is_cross_entropy_on_assistant_tokens_only(which, k3_run, tiny_qwen3_dir):
    """The learner's `nll` loss on three padded demonstrations equals the cross-entropy of full logits,
    each demonstration alone, on its assistant targets (float64 weights: equal to rounding)."""
    path = k3_run / "init" if which == "k3" else tiny_qwen3_dir
    data = demonstrations("sft-toy-search", 3, 2, tokenizer_of(path))
    learner = nll_learner(path, lr=0.0, micro_batch_seqs=3, logprob_chunk_size=100, dtype="float64")
    model = learner.model
    total, count = 0.0, 0
    with torch.no_grad():  # before the step: it moves K3's router biases even at lr 0
        for row in data:
            ids = torch.tensor([row["input_ids"]])
            logits = (model(ids) if which == "k3" else model(input_ids=ids)).logits[0, :-1]  # [T-1, V]
            keep = torch.tensor(row["assistant_masks"][1:], dtype=torch.bool)
            total += F.cross_entropy(logits[keep], ids[0, 1:][keep], reduction="sum").item()
            count += int(keep.sum())
    metrics = learner.train_step([as_trajectory(r["input_ids"], r["assistant_masks"]) for r in data])
    assert metrics["micro_batches"] == 1 and metrics["skipped"] == 0
    assert count == metrics["num_loss_tokens"]
    assert metrics["loss"] == pytest.approx(total / count, rel=1e-9)


@pytest.mark.parametrize("which", ["k3", "qwen3"])
def test_gradient_accumulation_equals_one_batch(which, k3_run, tiny_qwen3_dir):
    """One step on 4 demonstrations of unequal length: micro-batches of 4, 2 and 1 (`sft.batch_size`)
    give the same weights (and, for K3, the same router biases: padding stays out of the balancing).
    AdamW with ε = 1 makes the first update ≈ lr·g, so equal gradients mean equal weights. Without prefix trees:
    a tree counts its shared system prompt once in the router statistics, so how the demonstrations fall into
    micro-batches would move the biases (tests/rl/test_prefix_tree.py checks the gradients with trees)."""
    path = k3_run / "init" if which == "k3" else tiny_qwen3_dir
    data = demonstrations("sft-toy-search", 4, 3, tokenizer_of(path))
    examples = [as_trajectory(r["input_ids"], r["assistant_masks"]) for r in data]
    states = []
    for micro in (4, 2, 1):
        learner = nll_learner(path, lr=0.5, adam_eps=1.0, max_grad_norm=0.0, micro_batch_seqs=micro, share_prefix=False)
        before = {k: v.clone() for k, v in learner.model.state_dict().items()}
        metrics = learner.train_step(examples)
        assert metrics["micro_batches"] == 4 // micro
        states.append({k: v.detach().clone() for k, v in learner.model.state_dict().items()})
    moved = max((states[0][k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-3
    for other in states[1:]:
        for k, v in states[0].items():
            torch.testing.assert_close(other[k], v, rtol=1e-4, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_step_batches_cover_each_epoch_once_in_a_seeded_order():
    batches = step_batches(10, 4, 7, seed=3)
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2, 4]
    for epoch in (batches[0:3], batches[3:6]):
        assert sorted(i for b in epoch for i in b) == list(range(10))
    assert batches[:3] != batches[3:6]  # a fresh order every epoch
    assert step_batches(10, 4, 7, seed=3) == batches and step_batches(10, 4, 7, seed=4) != batches


def test_k3rl_sft_lowers_the_loss_and_saves_a_loadable_model(k3_run):
    from transformers import AutoTokenizer

    from k3rl.model.formats.load import load_model

    for name in ("config.yaml", "demos.json", "metrics.jsonl", "loss.png", "eval.json",
                 "model/config.json", "model/model.safetensors.index.json", "model/tokenizer.json", "init/config.json"):
        assert (k3_run / name).is_file(), name
    assert list((k3_run / "tb").glob("events.out.tfevents.*"))
    assert json.loads((k3_run / "demos.json").read_text())["kept"] == 4
    logs = [json.loads(line) for line in (k3_run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in logs if "loss" in r]
    assert len(losses) >= 4 and losses[-1] < 0.8 * losses[0]
    evaluation = json.loads((k3_run / "eval.json").read_text())
    assert evaluation["tasks"] == 2 and 0.0 <= evaluation["success"] <= 1.0

    # The saved directory is the trained model: it loads (model/formats/layouts.py, the released layout) and scores
    # the demonstrations better than the initial model does.
    tokenizer = AutoTokenizer.from_pretrained(k3_run / "model")
    row = demonstrations("sft-toy-search", 1, 0, tokenizer)[0]
    ids = torch.tensor([row["input_ids"]])
    keep = torch.tensor(row["assistant_masks"][1:], dtype=torch.bool)
    nll = {}
    for which in ("init", "model"):
        lm = load_model(k3_run / which)
        with torch.no_grad():
            nll[which] = F.cross_entropy(lm(ids).logits[0, :-1][keep], ids[0, 1:][keep]).item()
    assert nll["model"] < nll["init"] - 0.5


def test_sft_teaches_the_tool_protocol(tiny_qwen3_dir):
    """A random tiny Qwen3 never writes a tool call; after 40 steps of the learner's `nll` objective on 8
    demonstrations its greedy rollouts (TorchEngine + AgentLoop) on those tasks call tools well-formed on
    every turn and solve them."""
    tokenizer = tokenizer_of(tiny_qwen3_dir)
    learner = nll_learner(tiny_qwen3_dir, lr=3e-3, lr_scheduler="constant_with_warmup", warmup_steps=5,
                          micro_batch_seqs=8)
    tasks = toy_tasks(8, seed=0)
    kwargs = dict(max_new_tokens=96, max_turns=4, max_context_tokens=1024)
    before = greedy_report(learner.model, tokenizer, "sft-toy-search", tasks, **kwargs)
    assert before["first_turn_well_formed"] == 0.0 and before["success"] == 0.0
    report = collect_demonstrations("sft-toy-search", 8, 0, tokenizer, tasks=tasks)
    examples = [as_trajectory(r["input_ids"], r["assistant_masks"]) for r in report.rows]
    rows = train_supervised(learner, examples, step_batches(len(examples), 8, 40, seed=0), lambda *_: None, 10)
    assert [r["step"] for r in rows] == [1, 10, 20, 30, 40] and rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    after = greedy_report(learner.model, tokenizer, "sft-toy-search", tasks, **kwargs)
    assert after["first_turn_well_formed"] == 1.0 and after["turns_well_formed"] == 1.0
    assert after["success"] >= 0.75, after


def test_imperfect_teachers_mix_by_rate_and_are_scored_by_the_environment(k3_tokenizer):
    """`closed_book_rate` / `hedging_rate`: those fractions of the tasks are played by a teacher that
    answers at once with another task's answer, or that hedges the oracle's answer; the environment
    scores them (a hedged answer is not an exact match); the draw is deterministic in the seed and
    the other tasks keep the oracle's demonstrations unchanged."""
    import k3rl.envs as envs
    from k3rl.envs.base import run_episode
    from k3rl.envs.tools import ToolCall, parse

    tasks = toy_tasks(40, seed=3)
    kw = dict(tasks=tasks, min_reward=0.0)
    plain = collect_demonstrations("sft-toy-search", 40, 3, k3_tokenizer, **kw)
    mixed = collect_demonstrations("sft-toy-search", 40, 3, k3_tokenizer, closed_book_rate=0.3, hedging_rate=0.3,
                                   teacher_seed=7, **kw)
    again = collect_demonstrations("sft-toy-search", 40, 3, k3_tokenizer, closed_book_rate=0.3, hedging_rate=0.3,
                                   teacher_seed=7, **kw)
    assert [r["input_ids"] for r in mixed.rows] == [r["input_ids"] for r in again.rows]
    teachers = [r["teacher"] for r in mixed.rows]
    assert 4 <= teachers.count("closed_book") <= 20 and 4 <= teachers.count("hedging") <= 20, teachers
    assert mixed.summary()["teachers"] == {t: teachers.count(t) for t in set(teachers)}
    assert "closed_book" in mixed.line() and "hedging" in mixed.line()
    env = envs.make("sft-toy-search")
    for row, base, task in zip(mixed.rows, plain.rows, tasks):
        text = k3_tokenizer.decode([t for t, m in zip(row["input_ids"], row["assistant_masks"]) if m])
        if row["teacher"] == "oracle":
            assert row["input_ids"] == base["input_ids"]
        elif row["teacher"] == "closed_book":
            assert row["turns"] == 1 and "search" not in text and text.startswith("I will answer from memory.")
            assert row["reward"] < 1.0 or task["answers"][0] in text  # a guess is right only by luck
        else:
            assert text.count("search") == base_text_count(k3_tokenizer, base, "search")
            assert f'{task["answers"][0]}, I think' in text and row["reward"] < base["reward"]
    # the hedging teacher scored by the environment itself: F1 only, no exact match
    from k3rl.envs.teachers import HedgingPolicy

    result = run_episode(env, tasks[0], HedgingPolicy(env.oracle(tasks[0]), env))
    last = parse([m for m in result.messages if m["role"] == "assistant"][-1]["content"])
    assert isinstance(last, ToolCall) and last.arguments["text"].endswith(", I think")
    assert result.info["em"] == 0.0 and 0.0 < result.info["f1"] < 1.0
    with pytest.raises(ValueError, match="closed_book_rate \\+ hedging_rate"):
        collect_demonstrations("sft-toy-search", 4, 0, k3_tokenizer, closed_book_rate=0.6, hedging_rate=0.5)


def base_text_count(tokenizer, row, word: str) -> int:
    return tokenizer.decode([t for t, m in zip(row["input_ids"], row["assistant_masks"]) if m]).count(word)


def test_bad_configs_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="sft.env: unknown environment 'no-such-env'"):
        main([str(write_job(tmp_path, "a", env="no-such-env"))])
    with pytest.raises(ConfigError, match="env.name: unknown environment 'nope'"):
        main([str(write_job(tmp_path, "b")), "env.name=nope"])
    missing = tmp_path / "no-model"
    with pytest.raises(ConfigError, match=f"sft.model_dir: {missing} does not exist"):
        main([str(write_job(tmp_path, "c", model_dir=str(missing)))])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="not a Hugging Face model directory"):
        main([str(write_job(tmp_path, "d", model_dir=str(tmp_path / "empty")))])
    with pytest.raises(ConfigError, match="unknown config key 'sft.batch'"):
        main([str(write_job(tmp_path, "e")), "sft.batch=4"])
    with pytest.raises(ConfigError, match="sft.grad_accum: must be > 0"):
        main([str(write_job(tmp_path, "f", grad_accum=0))])
    with pytest.raises(ConfigError, match=r"sft.hedging_rate: must be in \[0, 1\), got 1.5"):
        main([str(write_job(tmp_path, "g", hedging_rate=1.5))])
    with pytest.raises(ConfigError, match=r"sft.closed_book_rate \+ sft.hedging_rate: must be < 1"):
        main([str(write_job(tmp_path, "h", hedging_rate=0.6, closed_book_rate=0.5))])
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
