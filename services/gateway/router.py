"""Routing policies: which decode and prefill worker take a request."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pdserve.services.gateway import cost
from pdserve.services.gateway.config import POLICIES
from pdserve.services.gateway.cost import Job
from pdserve.services.gateway.registry import Worker

# Estimates this close to the cheapest are a tie (taken in turns): a few ms of difference is
# below what an estimate can tell apart.
TIE_FRACTION = 0.05
TIE_S = 0.005


class Router:
    """``least_loaded`` picks the worker with the fewest outstanding tokens (prompt + max_tokens of
    this gateway's requests in flight there), ties taking turns; ``round_robin`` takes turns.

    ``cost`` (gateway/cost.py) picks by what the workers report in their heartbeats: the prefill
    worker that would have the request's prompt computed soonest (its queue, plus the prompt less
    the prefix it has cached, at its measured speed), the decode worker with the request's blocks
    free and the fewest sequences. A request with an affinity key goes to the prefill worker the
    key hashes to (rendezvous hashing) unless that one is more than ``affinity_slack_s`` slower
    than the cheapest. Reports older than ``stale_s`` are not used.

    Each pool (workers of one set of roles) takes turns of its own: a counter shared by the prefill
    and the decode pick of every request would, with two workers of each, always land on the same
    pair."""

    def __init__(self, policy: str, stale_s: float = 20 / 3, affinity_slack_s: float = 0.5) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.policy = policy
        self.stale_s = stale_s
        self.affinity_slack_s = affinity_slack_s
        self._turns: dict[tuple[str, ...], itertools.count[int]] = {}

    def pick(
        self,
        candidates: Sequence[Worker],
        exclude: set[str] = frozenset(),
        job: Job | None = None,
        decode: bool = False,
        now: float | None = None,
    ) -> Worker | None:
        """``job``: the request (the ``cost`` policy without one picks as ``least_loaded``);
        ``decode``: this is the pick of the decode worker of a pair (the others prefill)."""
        pool = [w for w in candidates if w.worker_id not in exclude]
        if not pool:
            return None
        pool.sort(key=lambda w: w.worker_id)
        roles = tuple(sorted({w.role for w in candidates}))
        turn = next(self._turns.setdefault(roles, itertools.count())) % len(pool)
        if self.policy == "round_robin":
            return pool[turn]
        if self.policy == "cost" and job is not None:
            now = cost.now() if now is None else now
            if decode:
                loads = [cost.decode_load(w, job, now, self.stale_s) for w in pool]
                return self._fairest(
                    pool, turn, [i for i, x in enumerate(loads) if x == min(loads)]
                )
            return self._cheapest(pool, turn, job, now)
        ranks = [
            (w.outstanding_tokens, w.failures, (i - turn) % len(pool)) for i, w in enumerate(pool)
        ]
        return pool[ranks.index(min(ranks))]

    def _cheapest(self, pool: list[Worker], turn: int, job: Job, now: float) -> Worker:
        typical = cost.typical_token_s(pool, now, self.stale_s)
        estimates = [cost.prefill_estimate(w, job, now, self.stale_s, typical) for w in pool]
        seconds = [s for s, _ in estimates]
        low = min(seconds)
        if job.affinity_key:
            key = job.affinity_key
            home = max(range(len(pool)), key=lambda i: cost.rendezvous(key, pool[i].worker_id))
            if seconds[home] <= low + self.affinity_slack_s:
                return pool[home]
        tied = [i for i, s in enumerate(seconds) if s <= low * (1 + TIE_FRACTION) + TIE_S]
        # a tie goes where more of the prompt is cached: the next prompt of its kind is cheaper
        # there too; then turns
        most = max(estimates[i][1] for i in tied)
        return self._fairest(pool, turn, [i for i in tied if estimates[i][1] == most])

    @staticmethod
    def _fairest(pool: list[Worker], turn: int, tied: list[int]) -> Worker:
        """Among equally good workers: the one with the fewest failures, then the next in turn."""
        best = min(tied, key=lambda i: (pool[i].failures, (i - turn) % len(pool)))
        return pool[best]
