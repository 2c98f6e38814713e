"""Weight sync: the learner's weights into rollout engines, per path, in ms per GB against memcpy of the same bytes.

A K3 (configs/model/tiny.yaml or small.yaml, random init, fp32) is the learner's (a one-rank `LearnerGroup`, a
Ray actor, as `k3rl train` runs it) and each of `--workers` Ray actors holds a `TorchEngine` of the same model.
One sync = the learner's current weights into every engine (`TorchEngine.load_weights`, every tensor replaced),
timed from the request until every engine confirms. Paths, in the same run:
  * memcpy: one `copy_` of every tensor into a preallocated twin, in this process (the floor of any path);
  * in-process: `Learner.named_weights(copy=False)` → `TorchEngine.load_weights` in this process (no Ray), and
    "(copies)" with `named_weights()`'s fresh copies in between (page faults of a new buffer every sync);
  * Ray, via the driver (before issue 31): the driver `ray.get`s the learner actor's tensors, `ray.put`s them again,
    and hands the reference to every engine;
  * Ray, learner-put (now: rl/train/group.py `LearnerGroup.weights_ref`): the learner actor `ray.put`s its own
    tensors; the driver passes the reference on and never holds the weights;
  * broadcast (gloo) (`rollout.weight_sync: broadcast`, rl/orchestrator/weight_sync.py): the learner actor sends
    its packed buffer to every engine by one collective over TCP (NCCL between GPUs; this box has none).
After the timed syncs each engine's weights are compared with the learner's (bitwise), so a path that skipped a
tensor fails here. Median of `--reps` syncs after one warm-up.

    python bench/weight_sync.py                    # tiny and small, 2 engines
    python bench/weight_sync.py --models tiny      # seconds
    python bench/weight_sync.py --lora 16          # a LoRA learner: adapter pushes vs merged pushes

`--lora R`: the learner trains rank-R adapters (`learner.lora`, rl/train/lora.py's defaults); the same Ray
learner-put path carries either every tensor merged (`learner.lora.push: merged`) or the adapters' factors and the
buffers (`adapters`), which each engine adds to its own copy of the base (rollout/weight_transfer.py). Bytes and
ms per sync; after the syncs every engine's weights are checked against the learner's merged ones (fp32 rounding:
atol 1e-5).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import ray  # noqa: E402
import torch  # noqa: E402
from timing import median_ms  # noqa: E402  (bench/timing.py)

from k3rl.rl.config import JobConfig, RayConfig, load_config  # noqa: E402
from k3rl.rl.orchestrator.cluster import init_ray  # noqa: E402
from k3rl.rl.orchestrator.sft import init_model  # noqa: E402
from k3rl.rl.orchestrator.weight_sync import BroadcastSync  # noqa: E402
from k3rl.rl.train.group import LearnerGroup  # noqa: E402
from k3rl.rl.train.learner import Learner, LearnerConfig  # noqa: E402
from k3rl.rollout.torch_engine import TorchEngine  # noqa: E402


class EngineActor:
    """A rollout engine in its own process, as a rollout worker holds one."""

    def __init__(self, model_dir: str):
        torch.set_num_threads(1)
        self.engine = TorchEngine.from_pretrained(model_dir)

    def load_weights(self, named, version: int) -> int:
        self.engine.load_weights(named, version)
        return version

    def state(self) -> dict:
        return {n: t.clone() for n, t in self.engine.model.state_dict().items()}

    def broadcast_join(self, address: str, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        from k3rl.rollout.weight_broadcast import BroadcastGroup  # as rollout/worker.py's RolloutWorker

        self.group = BroadcastGroup(address, rank, world_size, backend, timeout_s)

    def load_broadcast(self, layout, version: int) -> int:
        return self.load_weights(self.group.receive(layout), version)


def build(model: str, directory: Path) -> Path:
    cfg = load_config(ROOT / f"configs/model/{model}.yaml", [], JobConfig)
    return init_model(cfg.model, directory / model, seed=0)


def measure(model_dir: Path, workers: int, reps: int) -> dict:
    learner = Learner(LearnerConfig(model_path=str(model_dir), lr=1e-4))
    named = learner.named_weights()
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    gb = nbytes / 1e9
    twin = [torch.empty_like(t) for _, t in named]

    def memcpy():
        for (_, t), d in zip(named, twin):
            d.copy_(t)

    local = TorchEngine.from_pretrained(model_dir)
    rows = {"memcpy": median_ms(memcpy, reps),
            "in-process (copies)": median_ms(lambda: local.load_weights(learner.named_weights(), 1), reps),
            "in-process": median_ms(lambda: local.load_weights(learner.named_weights(copy=False), 1), reps)}

    group = LearnerGroup(LearnerConfig(model_path=str(model_dir), lr=1e-4), num_ranks=1, num_cpus_per_rank=1)
    remote = ray.remote(EngineActor)
    engines = [remote.options(num_cpus=0.5).remote(str(model_dir)) for _ in range(workers)]
    ray.get([e.state.remote() for e in engines])  # loaded

    def push(ref):
        ray.get([e.load_weights.remote(ref, 1) for e in engines])

    rows["Ray, via the driver"] = median_ms(lambda: push(ray.put(group.named_weights())), reps)
    rows["Ray, learner-put"] = median_ms(lambda: push(group.weights_ref()), reps)
    sync = BroadcastSync(group.actors, group.sharded, "gloo")

    def broadcast():
        ray.get(sync.push(engines, 1))
        sync.wait()

    rows["broadcast (gloo)"] = median_ms(broadcast, reps)  # the last path: the check below is on its result
    want = dict(group.named_weights())
    for e in engines:
        got = ray.get(e.state.remote())
        bad = [n for n, t in want.items() if not torch.equal(got[n], t)]
        assert not bad, f"an engine's weights differ from the learner's after a sync: {bad[:3]}"
    group.shutdown()
    for e in engines:
        ray.kill(e)
    return dict(bytes=nbytes, per_gb={k: v / gb for k, v in rows.items()}, ms=rows)


def measure_lora(model_dir: Path, workers: int, reps: int, rank: int) -> list[tuple[str, int, float]]:
    """(push, bytes per sync, ms per sync) of a LoRA learner's merged and adapter pushes (module docstring)."""
    from k3rl.rl.config.learner import LoraSettings
    from k3rl.rl.train.lora import merged_state_dict

    rows = []
    remote = ray.remote(EngineActor)
    for push in ("merged", "adapters"):
        cfg = LearnerConfig(model_path=str(model_dir), lr=1e-4, lora=LoraSettings(rank=rank, alpha=2.0 * rank,
                                                                                  push=push))
        learner = Learner(cfg)  # this process's twin of the actor's, for the byte count
        nbytes = sum(t.numel() * t.element_size() for _, t in learner.push_weights(copy=False))
        group = LearnerGroup(cfg, num_ranks=1, num_cpus_per_rank=1)
        engines = [remote.options(num_cpus=0.5).remote(str(model_dir)) for _ in range(workers)]
        ray.get([e.state.remote() for e in engines])
        ms = median_ms(lambda: ray.get([e.load_weights.remote(group.weights_ref(), 1) for e in engines]), reps)
        # (PEFT starts B at 0, so these pushes carry ΔW = 0: the bytes and time are a real push's, the values are
        # checked in tests/rl/test_lora.py with trained adapters)
        want = {k: v for k, v in ray.get(group.actors[0].named_weights.remote())}
        for e in engines:
            got = ray.get(e.state.remote())
            bad = [n for n, t in want.items() if not torch.allclose(got[n], t, atol=1e-5, rtol=0)]
            assert not bad, f"{push}: an engine's weights differ from the learner's merged ones: {bad[:3]}"
        assert merged_state_dict(learner.model).keys() == want.keys()
        rows.append((push, nbytes, ms))
        group.shutdown()
        for e in engines:
            ray.kill(e)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lora", type=int, default=None, metavar="RANK", help="a LoRA learner: adapter vs merged pushes")
    args = ap.parse_args(argv)
    init_ray(RayConfig(address=None, num_cpus=2), log_to_driver=False)
    what = f"LoRA rank {args.lora}, " if args.lora else ""
    print(f"load {os.getloadavg()[0]:.2f}, {args.workers} engines, {what}median of {args.reps} syncs; every engine's "
          f"weights checked against the learner's after the syncs")
    header = (["model", "push", "MB per sync", "ms per sync", "bytes vs merged", "time vs merged"] if args.lora else
              ["model", "MB", "path", "ms per sync", "ms/GB", "÷ memcpy"])
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            if args.lora:
                (_, mb, mt), (_, ab, at) = measure_lora(build(model, Path(tmp)), args.workers, args.reps, args.lora)
                rows = [(model, push, f"{b / 1e6:.1f}", f"{t:.1f}", f"{b / mb:.3f}×", f"{t / mt:.2f}×")
                        for push, b, t in (("merged", mb, mt), ("adapters", ab, at))]
            else:
                r = measure(build(model, Path(tmp)), args.workers, args.reps)
                base = r["per_gb"]["memcpy"]
                rows = [(model, f"{r['bytes'] / 1e6:.0f}", path, f"{ms:.1f}", f"{r['per_gb'][path]:.0f}",
                         f"{r['per_gb'][path] / base:.1f}×") for path, ms in r["ms"].items()]
            for row in rows:
                print("| " + " | ".join(row) + " |", flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
