"""Routing policies: which decode and prefill worker take a request."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pdserve.services.gateway.registry import Worker

POLICIES = ("round_robin", "least_loaded")


class Router:
    """``least_loaded`` picks the worker with the fewest outstanding tokens (prompt + max_tokens of
    this gateway's requests in flight there); ``round_robin`` cycles."""

    def __init__(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self._counter = itertools.count()

    def pick(self, candidates: Sequence[Worker], exclude: set[str] = frozenset()) -> Worker | None:
        pool = [w for w in candidates if w.worker_id not in exclude]
        if not pool:
            return None
        pool.sort(key=lambda w: w.worker_id)
        if self.policy == "round_robin":
            return pool[next(self._counter) % len(pool)]
        return min(
            pool, key=lambda w: (w.outstanding_tokens, w.failures, next(self._counter) % len(pool))
        )
