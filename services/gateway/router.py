"""Routing policies: which decode and prefill worker take a request."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pdserve.services.gateway.registry import Worker

POLICIES = ("round_robin", "least_loaded")


class Router:
    """``least_loaded`` picks the worker with the fewest outstanding tokens (prompt + max_tokens of
    this gateway's requests in flight there), ties taking turns; ``round_robin`` takes turns.

    Each pool (workers of one set of roles) takes turns of its own: a counter shared by the prefill
    and the decode pick of every request would, with two workers of each, always land on the same
    pair."""

    def __init__(self, policy: str) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self._turns: dict[tuple[str, ...], itertools.count[int]] = {}

    def pick(self, candidates: Sequence[Worker], exclude: set[str] = frozenset()) -> Worker | None:
        pool = [w for w in candidates if w.worker_id not in exclude]
        if not pool:
            return None
        pool.sort(key=lambda w: w.worker_id)
        roles = tuple(sorted({w.role for w in candidates}))
        turn = next(self._turns.setdefault(roles, itertools.count())) % len(pool)
        if self.policy == "round_robin":
            return pool[turn]
        ranks = [
            (w.outstanding_tokens, w.failures, (i - turn) % len(pool)) for i, w in enumerate(pool)
        ]
        return pool[ranks.index(min(ranks))]
