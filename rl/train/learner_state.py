"""A learner's checkpoint: what `Learner.save_into` writes and `Learner.load` / `load_optimizer` read, one writer per
layout, outside the train step.

- unsharded (`write_plain` / `read_plain`): rank 0 writes the model in its family's format (model/policy.py
  `Policy.save`: K3 in the released layout its config chooses, model/formats/layouts.py; other models
  `save_pretrained`; the tokenizer when the model directory has one) and `OPTIMIZER_FILE` (`optimizer_state`: the
  optimizer states, `version`, world size, optimizer name);
- sharded (`write_sharded` / `read_sharded`, expert parallelism or FSDP2): every rank writes its shards of the model
  and optimizer states into `SHARDED_DIR` (torch.distributed.checkpoint, rl/train/parallel.py `save_sharded`), rank 0
  the gathered model in the released layout (readable by any tool, and by an unsharded learner as `rl.model_path`)
  and `SHARDED_META` (`sharded_meta`) instead of `OPTIMIZER_FILE`; it loads only into the same layout;
- every rank: its RNG states (`rng-rank{r}.pt`).

`Learner.save` makes the directory atomic (`rl.checkpoint.atomic_dir`); the trainer writes the learner and its own
state into one `CheckpointManager.begin(step)` directory (rl/checkpoint.py). Each function takes the `Learner`
(rl/train/learner.py, which imports this module) and reads or sets its policy, optimizers, schedulers and `version`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from k3rl.rl import checkpoint as ckpt
from k3rl.rl.train import lora, parallel
from k3rl.rl.train.optim import restore_schedulers

OPTIMIZER_FILE = "optimizer.pt"
SHARDED_DIR = "sharded"
"""A sharded learner's model and optimizer states (torch.distributed.checkpoint), inside its checkpoint."""
SHARDED_META = "sharded_learner.json"
"""What a sharded learner's checkpoint has instead of `OPTIMIZER_FILE`: version, world size, layout, optimizer."""


def read_optimizer_file(path: Path, device: Any) -> dict:
    """`optimizer.pt` read as tensors and plain values only (`weights_only`): a checkpoint handed over from
    another run (`load_optimizer`) or downloaded is untrusted, and a full unpickler would run any code it names.
    Checkpoints written before the optimizer name was saved as a plain string hold the `Optimizer` enum."""
    from k3rl.rl.config import Optimizer

    with torch.serialization.safe_globals([Optimizer]):
        return torch.load(path, map_location=device, weights_only=True)


def optimizer_state(learner: Any) -> dict[str, Any]:
    """The contents of `OPTIMIZER_FILE`."""
    return {"version": learner.version, "optimizers": [o.state_dict() for o in learner.optimizers],
            "world_size": learner.world_size, "optimizer": str(learner.cfg.optimizer)}


def load_optimizer_state(learner: Any, path: Path, state: dict) -> None:
    """Put the optimizer states of `optimizer_state` (read from checkpoint `path`) into the learner's optimizers."""
    if state.get("optimizer") != learner.cfg.optimizer or len(state["optimizers"]) != len(learner.optimizers):
        raise ckpt.CheckpointError(f"{path}: saved with optimizer {state.get('optimizer')!r}, this learner "
                                   f"uses {learner.cfg.optimizer!r}")
    try:
        for opt, sd in zip(learner.optimizers, state["optimizers"]):
            opt.load_state_dict(sd)
    except (ValueError, KeyError) as e:  # e.g. saved before the routed experts were stacked
        raise ckpt.CheckpointError(f"{path}: its optimizer state does not fit this learner's parameters ({e}); "
                                   f"start a new run from its weights instead (rl.model_path={path})") from e


def sharded_meta(learner: Any) -> dict[str, Any]:
    """What a sharded checkpoint records about the learner that wrote it (`SHARDED_META`)."""
    return {"version": learner.version, "world_size": learner.world_size, "expert_parallel": learner.cfg.expert_parallel,
            "fsdp": bool(learner.cfg.fsdp), "optimizer": str(learner.cfg.optimizer)}


def write_plain(learner: Any, directory: Path, tokenizer: Any) -> None:
    """Rank 0 of an unsharded learner: the model in its family's format (with LoRA: merged, and the adapters in
    PEFT's format in `lora.ADAPTER_DIR`), then `OPTIMIZER_FILE`."""
    state = None if learner.lora is None else lora.merged_state_dict(learner.model)
    learner.policy.save(directory, state=state, tokenizer_from=tokenizer,
                        trust_remote_code=learner.cfg.trust_remote_code)
    if learner.lora is not None:
        lora.save_adapter(learner.lora, directory / lora.ADAPTER_DIR, learner.cfg.model_path)
    torch.save(optimizer_state(learner), directory / OPTIMIZER_FILE)


def write_sharded(learner: Any, directory: Path, tokenizer: Any) -> None:
    """Every rank of a sharded learner: its shards in `SHARDED_DIR`; rank 0 the gathered model and `SHARDED_META`."""
    parallel.save_sharded(directory / SHARDED_DIR, learner.model, learner.optimizers)
    state = parallel.full_state_dict(learner.model, learner.mesh)
    if learner.rank == 0:
        learner.policy.save(directory, state=state, tokenizer_from=tokenizer,
                            trust_remote_code=learner.cfg.trust_remote_code)
        (directory / SHARDED_META).write_text(json.dumps(sharded_meta(learner), indent=1) + "\n")


def save_into(learner: Any, directory: str | Path) -> None:
    """`Learner.save_into`: this rank's part of a checkpoint in the learner's layout, then its RNG states."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = learner.tokenizer_path if (learner.tokenizer_path / "tokenizer_config.json").is_file() else None
    if learner.mesh is not None:
        write_sharded(learner, directory, tokenizer)
    elif learner.rank == 0:
        write_plain(learner, directory, tokenizer)
    torch.save(ckpt.capture_rng(), directory / f"rng-rank{learner.rank:05d}.pt")


def read_plain(learner: Any, path: Path) -> None:
    """Weights, optimizer states and `version` of an unsharded checkpoint."""
    opt_file = path / OPTIMIZER_FILE
    if not opt_file.is_file():
        raise ckpt.IncompleteCheckpointError(f"{path}: no {OPTIMIZER_FILE} (not a learner checkpoint)")
    try:
        weights = learner.policy.read_weights(path)
        state = read_optimizer_file(opt_file, learner.device)
    except Exception as e:  # truncated or foreign files: name the checkpoint
        raise ckpt.CorruptCheckpointError(f"{path}: cannot read the learner state ({type(e).__name__}: {e})") from e
    model_state = learner.model.state_dict()
    if learner.lora is not None:
        if not (path / lora.ADAPTER_DIR / "adapter_config.json").is_file():  # refused before anything is written
            raise ckpt.CheckpointError(f"{path}: no {lora.ADAPTER_DIR}/ (not written by a LoRA learner); start a new "
                                       f"run from its weights (rl.model_path={path}) instead")
        # the saved model is merged: the base keeps its own weights, the adapters come from their own files, and
        # the rest (router biases the balancer moved, frozen tensors) from the saved model
        adapted = {name for name, _ in lora.adapted_tensors(learner.model)}
        model_state = {lora.base_name(k): t for k, t in model_state.items() if ".lora_" not in k}
        weights = {k: t for k, t in weights.items() if k not in adapted}
        model_state = {k: t for k, t in model_state.items() if k not in adapted}
    # tied tensors (e.g. lm_head.weight = embed_tokens.weight) are saved once, under one name
    shared: dict[int, set[str]] = {}
    for name, t in model_state.items():
        shared.setdefault(t.data_ptr(), set()).add(name)
    missing = sorted(n for n, t in model_state.items() if not shared[t.data_ptr()] & weights.keys())
    unknown = sorted(set(weights) - set(model_state))
    if missing or unknown:
        raise ckpt.CorruptCheckpointError(f"{path}: does not match this model: missing {missing[:5]}, "
                                          f"unknown {unknown[:5]}")
    with torch.no_grad():
        for name, t in weights.items():
            model_state[name].copy_(t)
    if learner.lora is not None:
        try:
            lora.load_adapter(learner.lora, path / lora.ADAPTER_DIR, learner.cfg.model_path)
        except ValueError as e:
            raise ckpt.CheckpointError(str(e)) from None
    load_optimizer_state(learner, path, state)
    learner.version = int(state["version"])


def read_sharded(learner: Any, path: Path) -> None:
    """Shards and `version` of a checkpoint written under a mesh, into a learner laid out as the one that wrote it."""
    cfg = learner.cfg
    if not (path / SHARDED_META).is_file():
        raise ckpt.CheckpointError(
            f"{path}: saved by an unsharded learner ({OPTIMIZER_FILE}); this learner is sharded "
            f"(learner.expert_parallel = {cfg.expert_parallel}, learner.fsdp = {bool(cfg.fsdp)}, "
            f"{learner.world_size} ranks) and takes sharded checkpoints only; start a new run from its weights "
            f"(rl.model_path={path}) or resume without sharding")
    try:
        meta = json.loads((path / SHARDED_META).read_text())
    except (OSError, ValueError) as e:
        raise ckpt.CorruptCheckpointError(f"{path}: cannot read {SHARDED_META} ({type(e).__name__}: {e})") from e
    mine = sharded_meta(learner)
    keys = ("world_size", "expert_parallel", "fsdp", "optimizer")
    if learner.mesh is None or any(meta.get(k) != mine[k] for k in keys):
        saved = ", ".join(f"{k} {meta.get(k)}" for k in keys)
        this = ", ".join(f"{k} {mine[k]}" for k in keys)
        raise ckpt.CheckpointError(
            f"{path}: saved by a sharded learner ({saved}); this learner has {this}, and a sharded optimizer state "
            f"loads only into the same layout (learner.num_ranks, learner.expert_parallel, learner.fsdp, "
            f"learner.optimizer). Resume with those, or start a new run from its weights (rl.model_path={path}: "
            f"the Hugging Face export beside the shards; the optimizer state starts anew)")
    try:
        parallel.load_sharded(path / SHARDED_DIR, learner.model, learner.optimizers)
    except (FileNotFoundError, KeyError, RuntimeError, ValueError) as e:
        raise ckpt.CorruptCheckpointError(f"{path}: cannot read the sharded learner state in {SHARDED_DIR}/ "
                                          f"({type(e).__name__}: {e})") from e
    learner.version = int(meta["version"])


def read_rng(learner: Any, path: Path) -> None:
    """This rank's RNG states; a rank the checkpoint has none for gets a fresh, distinct stream."""
    rng_file = path / f"rng-rank{learner.rank:05d}.pt"
    if rng_file.is_file():
        ckpt.restore_rng(torch.load(rng_file, weights_only=False))
    else:
        # more ranks than when saved: a fresh, distinct stream per rank and version
        torch.manual_seed(learner.cfg.seed + learner.rank + 1_000_003 * learner.version)


def load(learner: Any, path: str | Path) -> None:
    """`Learner.load`: weights, optimizer states, `version`, the schedule and this rank's RNG states."""
    path = Path(path)
    ckpt.verify(path)
    if (path / SHARDED_META).is_file() or learner.mesh is not None:
        read_sharded(learner, path)
    else:
        read_plain(learner, path)
    restore_schedulers(learner.schedulers, learner.version)
    read_rng(learner, path)


def load_optimizer(learner: Any, path: str | Path) -> None:
    """`Learner.load_optimizer`: another run's optimizer moments under this learner's own hyperparameters."""
    mine = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in learner.optimizers]
    path = Path(path)
    ckpt.verify(path)
    if learner.mesh is not None or (path / SHARDED_META).is_file():
        raise ckpt.CheckpointError(f"{path}: taking another run's optimizer moments is not implemented for sharded "
                                   f"learners (learner.expert_parallel / learner.fsdp); reset them instead")
    try:
        state = read_optimizer_file(path / OPTIMIZER_FILE, learner.device)
    except Exception as e:
        raise ckpt.CorruptCheckpointError(f"{path}: cannot read {OPTIMIZER_FILE} ({type(e).__name__}: {e})") from e
    load_optimizer_state(learner, path, state)
    for opt, groups in zip(learner.optimizers, mine):
        for group, own in zip(opt.param_groups, groups):
            group.update(own)
    restore_schedulers(learner.schedulers, learner.version)
