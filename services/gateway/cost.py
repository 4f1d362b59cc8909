"""The ``cost`` routing policy's estimates, from what workers report in their heartbeats.

Several gateways send to the same workers, so what one gateway remembers of its own requests is
not a worker's load. Each heartbeat (every lease/3 s) carries the worker's ``WorkerStats``: its
queued prompt work in seconds, its measured seconds per prompt token, its batch and free blocks,
and a Bloom filter of the blocks it has cached, prompts' and generated ones
(``pdserve/kv_cache/prefix_summary.py``).
Between two heartbeats the report ages: its queue drains at one second per second, and what this
gateway has sent there since (``Worker.unreported_*``) is added on top. A report older than
``stale_s`` (two heartbeats missed) is not used: the worker is then estimated from this
gateway's own requests in flight, as ``least_loaded`` does.

    prefill worker:  seconds = queue_s + (prompt tokens - cached prefix tokens) * token_s
                     (queue_s: the report's, aged, plus the prompt tokens less their cached
                     prefix of what this gateway sent there since; at least this gateway's
                     own prompt tokens to compute in flight there)
    decode worker:   (blocks for the request not free, sequences running and waiting, -free blocks)

The cached prefix is the prompt's leading run of block hashes found in the worker's filter or
among the prompts this gateway has sent there that are still there or ended less than two reports
ago (maybe not in a filter yet, maybe still being computed: a prompt that shares it waits for it
there; with what a decode or colocated worker generated for them), times the share of such
prefixes its prompts have found there (``record_hits``).
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.services.gateway.registry import Worker

from pdserve.config import PROMPT_AGING
from pdserve.kv_cache.allocator import prefix_block_hashes
from pdserve.kv_cache.prefix_summary import PrefixSummary
from pdserve.v1 import worker_pb2

DEFAULT_TOKEN_S = 1e-3  # a worker that has not measured its prefill yet (nor been measured)
DEFAULT_BLOCK_SIZE = 16  # what a request's blocks are counted in before any report says
KV_HOLD_MARGIN = 2.0  # times the wait expected at the prefill worker that a KV hold allows
KV_HOLD_TOKEN_S = 0.02  # a KV hold's seconds per prompt token while the worker has measured none
MAX_KV_HOLD_S = 3600.0  # unless --kv-timeout itself is longer
HIT_SHARE_WEIGHT = 0.25  # of each answer in a worker's hit share (cost.record_hits)


def summary_from_proto(m: worker_pb2.PrefixSummary) -> PrefixSummary | None:
    """None when the worker sent none (block_size 0) or one that does not parse (a broken or
    other-version worker: routed as if it cached nothing, rather than refused)."""
    if not m.block_size:
        return None
    try:
        return PrefixSummary(m.block_size, m.num_hashes, bytes(m.bloom), m.num_probes or 1)
    except ValueError:
        return None


@dataclass(frozen=True)
class Report:
    """A worker's heartbeat stats as this gateway received them at ``at`` (time.monotonic()),
    its prefix summary parsed."""

    at: float
    stats: worker_pb2.WorkerStats
    summary: PrefixSummary | None = None

    @classmethod
    def from_proto(cls, stats: worker_pb2.WorkerStats, at: float) -> Report:
        return cls(at, stats, summary_from_proto(stats.prefix_summary))

    @property
    def queue_s(self) -> float:
        return max(self.stats.prefill_queue_s, 0.0)

    @property
    def token_s(self) -> float:
        return max(self.stats.prefill_token_s, 0.0)


@dataclass
class Job:
    """What the router knows of a request: its prompt, its output budget, its affinity key."""

    prompt_ids: list[int]
    max_tokens: int
    affinity_key: str = ""
    _hashes: dict[int, list[bytes]] = field(default_factory=dict, repr=False)

    def hashes(self, block_size: int) -> list[bytes]:
        """The prompt's block hashes a worker could reuse (not the last token's block)."""
        if block_size not in self._hashes:
            usable = self.prompt_ids[: len(self.prompt_ids) - 1]
            self._hashes[block_size] = prefix_block_hashes(usable, block_size)
        return self._hashes[block_size]


def fresh_report(w: Worker, now: float, stale_s: float) -> Report | None:
    r = w.report
    return r if r is not None and now - r.at <= stale_s else None


def measured_token_s(w: Worker, r: Report | None) -> float | None:
    """Seconds per prompt token: as ``w`` measured it, else as this gateway did, else None."""
    if r is not None and r.token_s > 0:
        return r.token_s
    return 1.0 / w.prefill_rate if w.prefill_rate else None


def typical_token_s(pool: list[Worker], now: float, stale_s: float) -> float:
    """What a worker that has measured nothing yet is assumed to take per prompt token: the
    average of those that have (the same model everywhere), else DEFAULT_TOKEN_S."""
    known = [measured_token_s(w, fresh_report(w, now, stale_s)) for w in pool]
    known = [t for t in known if t is not None]
    return sum(known) / len(known) if known else DEFAULT_TOKEN_S


def believed_cached(w: Worker, job: Job, r: Report | None) -> int:
    """Prompt tokens ``w``'s filter and the prompts sent there by this gateway lately say it
    holds: the leading blocks found in either; none when its fresh report carries no summary (its
    prefix caching is off, or the summary did not parse)."""
    if r is not None and r.summary is None:
        return 0
    summary = r.summary if r is not None else None
    block_size = summary.block_size if summary is not None else w.recent_block_size
    if not block_size:
        return 0
    n = 0
    for h in job.hashes(block_size):
        if not ((summary is not None and h in summary) or w.cached_recently(h)):
            break
        n += 1
    return n * block_size


def cached_tokens(w: Worker, job: Job, r: Report | None) -> int:
    """Prompt tokens ``w`` is expected to find cached: what it is believed to hold
    (``believed_cached``) times the share of such a prefix its prompts have been finding there
    (``record_hits``)."""
    return discounted(w, believed_cached(w, job, r))


def discounted(w: Worker, believed: int) -> int:
    """Of ``believed`` cached prompt tokens at ``w``, those it is expected to find."""
    return int(believed * w.hit_share)


def record_hits(w: Worker, expected: int, found: int) -> None:
    """A prompt sent to ``w`` believed to find ``expected`` prompt tokens cached there
    (``believed_cached`` at routing) found ``found``. Where a worker is sent more sessions than its cache holds, the
    filter and the prompts sent lately say a session's history is there when it has been
    evicted since: each such prompt computes its history again, the router's queue estimate
    counted only the new turn, and more sessions followed (a TTFT p99 of 8-11 s against round
    robin's 3-4 at 16 sessions, docs/benchmarks.md). The share found discounts what the router
    expects there until prompts find their prefixes again."""
    if expected <= 0:
        return
    share = min(1.0, found / expected)
    w.hit_share += HIT_SHARE_WEIGHT * (share - w.hit_share)


def prefill_estimate(
    w: Worker, job: Job, now: float, stale_s: float, default_token_s: float = DEFAULT_TOKEN_S
) -> tuple[float, int]:
    """(estimated seconds until ``w``, a prefill worker or one prefilling locally, has computed
    ``job``'s prompt; the prompt tokens it finds cached). ``default_token_s``: its speed if it
    has measured none (``typical_token_s``)."""
    queue, own, cached = _prefill_parts(w, job, now, stale_s, default_token_s)
    return queue + own, cached


def _prefill_parts(
    w: Worker, job: Job, now: float, stale_s: float, default_token_s: float
) -> tuple[float, float, int]:
    """``prefill_estimate``'s (seconds queued ahead, seconds of the prompt's own compute, prompt
    tokens cached)."""
    r = fresh_report(w, now, stale_s)
    token_s = measured_token_s(w, r) or default_token_s
    mine = w.outstanding_tokens if w.role == "prefill" else w.local_prefill_tokens
    queue = mine * token_s
    if r is not None:
        # what this gateway has in flight there is a floor: a report generated before prompts
        # sent just ahead of it reached the worker counts them neither in its queue nor as sent
        # since, and the worker looked idle
        queue = max(queue, max(0.0, r.queue_s - (now - r.at)) + w.unreported_tokens * token_s)
    cached = cached_tokens(w, job, r)
    return queue, (len(job.prompt_ids) - cached) * token_s, cached


def kv_hold_s(prefill: Worker, job: Job, now: float, stale_s: float, kv_timeout_s: float) -> float:
    """How long a decode worker holds ``job``'s blocks for the KV ``prefill`` computes (and the
    prefill call's deadline when the client set none): ``kv_timeout_s`` beyond twice the time
    ``prefill`` is expected to take to reach and compute the prompt (its queue included). A hold
    of ``kv_timeout_s`` alone timed out every prompt that queued longer than that at a busy
    prefill worker, which the gateway then started again from the back of the queue (W-mixed on
    one Zen 3 prefill core: 13 of 62 disaggregated prompts, some after 18 of 30 layers). The wait
    is the router's estimate (its queue at least what this gateway has in flight there), but
    until the worker has a measured rate (before its first heartbeat) at a slow one: a hold too
    long costs nothing unless the KV never comes, one too short throws a prefill away. A worker
    that computes the shortest prompts first (its default) may pass this one over for later,
    shorter ones for up to PROMPT_AGING times its own compute time: that is added."""
    queue, own, _ = _prefill_parts(prefill, job, now, stale_s, KV_HOLD_TOKEN_S)
    # and what later, shorter prompts may take ahead of it ("shortest" prompt order)
    hold = kv_timeout_s + KV_HOLD_MARGIN * (queue + own) + PROMPT_AGING * own
    return min(hold, max(MAX_KV_HOLD_S, kv_timeout_s))


def decode_load(w: Worker, job: Job, now: float, stale_s: float) -> tuple[int, int, float]:
    """(1 when the request's blocks are not free there, sequences there, -free blocks): lower
    is better. Without a fresh report: this gateway's calls there, its blocks assumed free."""
    r = fresh_report(w, now, stale_s)
    if r is None:  # (re)joined or silent: every block it last said it has, else any number
        total = w.report.stats.num_total_blocks if w.report is not None else math.inf
        return (0, len(w.calls), -total)
    needed = request_blocks(w, len(job.prompt_ids) + job.max_tokens)
    free = r.stats.num_free_blocks - w.unreported_blocks
    seqs = r.stats.num_running + r.stats.num_waiting + w.unreported_requests
    return (int(free < needed), seqs, -free)


def block_size(w: Worker) -> int:
    """The worker's block size, as its last report says."""
    r = w.report
    return r.summary.block_size if r is not None and r.summary is not None else DEFAULT_BLOCK_SIZE


def request_blocks(w: Worker, num_tokens: int) -> int:
    """KV blocks ``num_tokens`` take on ``w``."""
    return -(-num_tokens // block_size(w))


def tokens_to_compute(worker: Worker, job: Job, now: float, stale_s: float) -> int:
    """The prompt tokens ``worker`` is expected to compute for ``job``: what is added to its queue
    until its next report (its cached prefix is not work; the report's queue does not count it
    either)."""
    return work_and_belief(worker, job, now, stale_s)[0]


def work_and_belief(worker: Worker, job: Job, now: float, stale_s: float) -> tuple[int, int]:
    """(``tokens_to_compute``, ``believed_cached``): what a prefill is sent with, and what its
    answer is held against (``record_hits``), from one look at the worker's filter."""
    believed = believed_cached(worker, job, fresh_report(worker, now, stale_s))
    return len(job.prompt_ids) - discounted(worker, believed), believed


def prompt_ended(worker: Worker, job: Job, computed: bool, generated: Sequence[int] = ()) -> None:
    """The prompt ``prompt_sent`` sent to ``worker`` has ended there (``Worker.prompt_ended``).
    ``generated``: the tokens a colocated or decode worker generated for it; it keeps the full
    blocks they filled (but the last token's: its KV was never written) as it keeps the prompt's
    (``Scheduler._publish_generated``), so a chat's next turn, which sends them again, is
    cheaper there before its next report says so."""
    size = worker.recent_block_size
    if not size:
        return
    kept = reply_hashes(job, size, generated) if computed else ()
    worker.prompt_ended(job.hashes(size), computed, kept)


def reply_hashes(job: Job, size: int, generated: Sequence[int]) -> list[bytes]:
    """The hashes of the full blocks after ``job.hashes(size)`` that the prompt's tail and the
    reply ``generated`` fill, but the reply's last token (its KV is never written); chained on
    from the prompt's, not hashing all of it again. [] for a reply of one token or none."""
    if len(generated) < 2:
        return []
    hashes = job.hashes(size)
    n = len(hashes)
    tokens = [*job.prompt_ids[n * size :], *generated[:-1]]
    return prefix_block_hashes(tokens, size, hashes[-1] if n else None)


def prompt_sent(worker: Worker, job: Job) -> None:
    """The prompt has been sent to ``worker``: its blocks count as cached there from now on. A
    prompt sharing its prefix that arrives while it is computed waits there for it and reuses it
    (``pdserve/scheduler.py``), so it is cheaper there already; its wait is in the queue."""
    size = block_size(worker)
    worker.prompt_cached(job.hashes(size), size)


def rendezvous(key: str, worker_id: str) -> int:
    """Highest-random-weight hashing: a key's worker stays the same while it is a candidate, and
    only the keys of a worker that leaves move."""
    digest = hashlib.blake2b(f"{key}\0{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def now() -> float:
    return time.monotonic()
