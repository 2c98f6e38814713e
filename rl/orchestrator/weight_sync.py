"""`rollout.weight_sync: broadcast`: the learner's weights reach every rollout worker by one collective broadcast
(rollout/weight_broadcast.py) instead of through Ray's object store.

The group is learner rank 0 plus the pool's workers, in slot order. It is formed at the first push and formed again
whenever the pool's workers change (a replaced worker), since a collective needs every member; each push sends only
the layout through Ray, then every worker posts its receive and the learner sends. The learner actor waits inside
`broadcast_send` until every worker has taken the update, so a worker busy with a long rollout holds the learner
until it finishes its call (the object-store path does not: use it with `rl.mode: async` and long episodes).
"""

from __future__ import annotations

from typing import Any, Optional

import ray

from k3rl.rollout.weight_broadcast import BACKENDS


class BroadcastSync:
    """Pushes of the learner group's weights to rollout workers by broadcast; `backend`: gloo or nccl."""

    def __init__(self, learner_actors: list, sharded: bool, backend: str = "gloo", timeout_s: float = 600.0):
        if backend not in BACKENDS:
            raise ValueError(f"rollout weight broadcast: backend {backend!r} is not one of {', '.join(BACKENDS)}")
        self.learners, self.sharded, self.backend, self.timeout_s = learner_actors, sharded, backend, timeout_s
        self.members: Optional[tuple] = None
        """The workers of the group formed last (actor ids, slot order); None before the first push."""
        self.formed = 0
        """How many times a group was formed (1 + replacements that reached a push)."""
        self._send: Optional[Any] = None

    def push(self, workers: list, version: int) -> list:
        """Send the learner's current weights as `version` to `workers`; returns each worker's pending confirmation
        (an ObjectRef resolving to the version it loaded)."""
        members = tuple(w._actor_id for w in workers)
        # a send to a group that lost a member fails (or ends) without it: the new group sends again
        self.wait(ignore_errors=members != self.members)
        if members != self.members:
            self._form(workers)
            self.members = members
        senders = self.learners if self.sharded else self.learners[:1]  # a sharded group gathers collectively
        layout = ray.get([a.broadcast_pack.remote() for a in senders])[0]
        confirmations = [w.load_broadcast.remote(layout, version) for w in workers]
        self._send = self.learners[0].broadcast_send.remote()
        return confirmations

    def wait(self, ignore_errors: bool = False) -> None:
        """Wait for the last send to finish (it raises here if it failed, unless `ignore_errors`)."""
        if self._send is not None:
            send, self._send = self._send, None
            try:
                ray.get(send)
            except Exception:
                if not ignore_errors:
                    raise

    def _form(self, workers: list) -> None:
        address = ray.get(self.learners[0].broadcast_address.remote())
        size = len(workers) + 1
        ray.get([self.learners[0].broadcast_join.remote(address, 0, size, self.backend, self.timeout_s)]
                + [w.broadcast_join.remote(address, i + 1, size, self.backend, self.timeout_s)
                   for i, w in enumerate(workers)])
        self.formed += 1


__all__ = ["BroadcastSync"]
