"""Workers known to the gateway: registered with a lease (renewed by heartbeats) or listed statically."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.services.gateway.send_order import SendOrder

from pdserve import rpc, tls
from pdserve.v1 import worker_pb2_grpc

ROLES = ("prefill", "decode", "colocated")


@dataclass(eq=False)
class Worker:
    worker_id: str
    role: str
    address: str
    compat_hash: str
    static: bool = False
    lease_expires: float = float("inf")
    # of requests this gateway has in flight there: prompt tokens to compute (prefill workers),
    # prompt + max_tokens (decode and colocated workers)
    outstanding_tokens: int = 0
    failures: int = 0
    prefill_rate: float | None = None  # prefill workers: prompt tokens computed/s (placement.py)
    # what prefill_rate is measured from (placement.record_prefill): this gateway's prefill calls
    # running there, since when they have kept it busy, exponential averages of prompt tokens
    # computed and of the seconds they took
    prefills_running: int = 0
    prefill_busy_from: float = 0.0
    prefill_averages: list = field(default_factory=list, repr=False)
    local_prefill_tokens: int = 0  # prompt tokens it is computing itself for us now
    # decode workers: until when they take no prompt for a busy prefill worker (placement.spread)
    prefill_busy_until: float = 0.0
    # of this gateway's requests there: prompts queued or computing, streams past their first
    # token (decode and colocated workers) — placement.py weighs one against the other
    prompts: int = 0
    streams: int = 0
    channel: object = field(default=None, repr=False)
    # the gateway's calls running there now; evict() cancels them (their requests resume elsewhere)
    calls: set = field(default_factory=set, repr=False)
    evicted: str | None = None  # why it was evicted, until it registers again
    # registered again after an eviction: not routed to until a probe passes (gateway/watchdog.py)
    probation: bool = False
    deregistered: bool = False  # it left (draining, unhealthy engine) until it registers again
    # counts its comebacks (registered again after it was evicted, left or expired; a probe passed
    # after probation): a request that saw it fail tries it again once it came back
    incarnation: int = 0
    # time.monotonic() of the last message the gateway read from it (watchdog.py's progress watch)
    last_progress: float = field(default_factory=time.monotonic)
    # What its heartbeats report (gateway/cost.py Report), and what this gateway sent there
    # since the last one: the ``cost`` policy routes by the sum.
    report: object = None
    heartbeats: int = 0  # reports received: a request sent before the last one is in it
    unreported_tokens: int = 0  # prompt tokens of requests sent since, still running there
    unreported_requests: int = 0
    unreported_blocks: int = 0  # KV blocks those requests take (decode workers)
    # block hashes of the prompts sent there and still there (in flight), and of those that
    # ended there in this heartbeat period and the one before (their blocks are cached there,
    # but maybe not in its last report yet; after that the reports say whether they still are),
    # and their block size
    _in_flight_hashes: Counter = field(default_factory=Counter, repr=False)
    recent_hashes: set = field(default_factory=set, repr=False)
    _older_hashes: set = field(default_factory=set, repr=False)
    recent_block_size: int = 0
    # The share of the cached prefix this gateway expected there that its prompts found there
    # (an average over its answers, cost.record_hits): below 1 while its cache evicts what the
    # gateway believes it holds (more sessions sent there than it can keep).
    hit_share: float = 1.0
    # prefill workers: this gateway's prompts go there in the order their KV holds were sized
    send_order: SendOrder = field(default_factory=SendOrder, repr=False)

    def __post_init__(self) -> None:
        if self.channel is None:
            self.channel = rpc.channel(self.address)
        if self.role == "prefill":
            self.stub = worker_pb2_grpc.PrefillStub(self.channel)
        else:
            self.stub = worker_pb2_grpc.DecodeStub(self.channel)

    @property
    def registered(self) -> bool:
        """Listed with a lease running (or static) and not evicted: heartbeats are accepted."""
        return self.evicted is None and (self.static or time.monotonic() < self.lease_expires)

    @property
    def alive(self) -> bool:
        """Routed to: registered and not on probation."""
        return self.registered and not self.probation

    def sent(self, num_tokens: int, num_blocks: int = 0) -> int:
        """A request is sent here: counted on top of the last report until the next one. Returns
        what ``done`` takes back."""
        self.unreported_tokens += num_tokens
        self.unreported_requests += 1
        self.unreported_blocks += num_blocks
        return self.heartbeats

    def done(self, sent_at: int, num_tokens: int, num_blocks: int = 0) -> None:
        """The request ``sent`` returned ``sent_at`` for has ended here (uncounted once a report
        came since: the report counted it)."""
        if sent_at == self.heartbeats:
            self.unreported_tokens -= num_tokens
            self.unreported_requests -= 1
            self.unreported_blocks -= num_blocks

    def prompt_cached(self, block_hashes: list[bytes], block_size: int) -> None:
        """A prompt of these block hashes was sent here (its blocks are, or are being, cached)."""
        if block_size != self.recent_block_size:
            self.recent_hashes, self._older_hashes = set(), set()
            self._in_flight_hashes = Counter()
            self.recent_block_size = block_size
        self._in_flight_hashes.update(block_hashes)

    def prompt_ended(self, block_hashes: list[bytes], computed: bool, kept=()) -> None:
        """The prompt ``prompt_cached`` was told of has ended here: its blocks count as cached
        until two reports have come since (one built before it ended may lack them); then the
        reports alone say, as they are newer. Counting them from the send for two periods kept a
        session's history "cached" after the worker had evicted it (a turn ~5 s later, within
        two 3 s periods). ``computed``: False when it failed before its blocks were there;
        ``kept``: the hashes of the blocks past the prompt's that it left cached (a reply's)."""
        in_flight = self._in_flight_hashes
        for h in block_hashes:
            if in_flight[h] > 1:
                in_flight[h] -= 1
            else:
                in_flight.pop(h, None)
        if computed:
            self.recent_hashes.update(block_hashes)
            self.recent_hashes.update(kept)

    def cached_recently(self, block_hash: bytes) -> bool:
        return (
            block_hash in self._in_flight_hashes
            or block_hash in self.recent_hashes
            or block_hash in self._older_hashes
        )

    def reported(self, report) -> None:
        """A heartbeat's stats arrived: they count every request sent before."""
        self.report = report
        self.heartbeats += 1
        self.unreported_tokens = self.unreported_requests = self.unreported_blocks = 0
        self._older_hashes, self.recent_hashes = self.recent_hashes, set()

    def track(self, call) -> None:
        """A call of the gateway's starts here: its progress is watched from now on."""
        if not self.calls:
            self.last_progress = time.monotonic()
        self.calls.add(call)

    def progressed(self) -> None:
        """A message arrived from this worker (cheap: called per streamed message)."""
        self.last_progress = time.monotonic()

    def evict(self, reason: str) -> None:
        """Stop routing here and cancel the calls running here: their requests see the worker
        fail (``reason``) and continue elsewhere. It rejoins when it registers again."""
        self.evicted = reason
        self.lease_expires = 0.0
        for call in list(self.calls):
            call.cancel()


class LayoutMismatchError(ValueError):
    pass


class WorkerRegistry:
    """``tls``: with mutual TLS, the gateway dials workers with its certificate and checks theirs
    against the cluster CA."""

    def __init__(self, lease_s: float, tls_config: tls.TLSConfig | None = None) -> None:
        self.lease_s = lease_s
        self._credentials = None
        self._options = tls.channel_options(tls_config)
        if tls_config is not None and tls_config.mutual:
            self._credentials = tls.channel_credentials(tls_config)
        self.workers: dict[str, Worker] = {}
        self.compat_hash: str | None = None  # of the first worker; every other must match
        # called when a worker registers or deregisters (a lease running out is seen by polling)
        self.on_change: Callable[[], None] | None = None
        # set by the hang watchdog: an evicted worker that registers again is on probation (not
        # routed to) until one of its probes passes
        self.probation_on_rejoin = False
        # time.monotonic() when can_serve() last found a serving path (None: never)
        self.path_seen: float | None = None

    def register(
        self, worker_id: str, role: str, address: str, compat_hash: str, static: bool = False
    ) -> Worker:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        if not address:
            raise ValueError("a worker must give its gRPC address")
        live = [w for w in self.workers.values() if w.registered and w.worker_id != worker_id]
        expected = live[0].compat_hash if live else None
        if expected is not None and compat_hash != expected:
            raise LayoutMismatchError(
                f"worker {worker_id} at {address} has KV layout {compat_hash}, but the workers already "
                f"registered have {expected}: start every worker with the same model, dtype and block size, "
                "and the same KV cache dtype (--kv-cache-dtype)"
            )
        old = self.workers.get(worker_id)
        if old is not None and old.address == address and old.role == role:
            if old.evicted is not None and old.calls:
                # The calls evict() cancelled are still unwinding, and must see it evicted to
                # resume elsewhere: it stays evicted, and its next heartbeat registers it again.
                return old
            if old.evicted is not None and self.probation_on_rejoin:
                old.probation = True
            if not old.registered or old.deregistered:
                old.incarnation += 1
            old.evicted = None
            old.deregistered = False
            old.lease_expires = time.monotonic() + self.lease_s
            self._changed()
            return old
        w = Worker(
            worker_id,
            role,
            address,
            compat_hash,
            static=static,
            lease_expires=time.monotonic() + self.lease_s,
            channel=rpc.channel(address, self._credentials, self._options),
        )
        self.workers[worker_id] = w
        self._changed()
        return w

    def deregister(self, worker_id: str) -> bool:
        """The worker leaves (draining, or its engine is unhealthy): no new request is routed
        there. It stays listed, not alive, so requests running there keep its channel; it may
        register again. False if it was not alive here."""
        w = self.workers.get(worker_id)
        if w is None or not w.registered:
            return False
        w.static = False
        w.lease_expires = 0.0
        w.deregistered = True
        self._changed()
        return True

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    def evict(self, worker: Worker, reason: str) -> None:
        """``worker.evict(reason)``, and the gateway's health looks again."""
        worker.evict(reason)
        self._changed()

    def rejoined(self, worker: Worker) -> None:
        """A worker on probation passed a probe: routed to again, its failures forgotten (they
        led to its eviction; least_loaded would otherwise pass it over while another is idle)."""
        worker.probation = False
        worker.failures = 0
        worker.incarnation += 1
        self._changed()

    def heartbeat(self, worker_id: str, report=None) -> bool:
        """Renew the lease; ``report``: its stats (gateway/cost.py Report), kept for routing."""
        w = self.workers.get(worker_id)
        if w is None or not w.registered:
            return False
        w.lease_expires = time.monotonic() + self.lease_s
        if report is not None:
            w.reported(report)
        return True

    def alive(self, role: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role and w.alive]

    def still_failed(self, failed: dict[str, int]) -> set[str]:
        """Of ``failed`` (worker id -> its incarnation when it failed a request), the ids of those
        that have not come back since."""
        return {
            wid
            for wid, n in failed.items()
            if wid in self.workers and self.workers[wid].incarnation == n
        }

    def can_serve(self) -> bool:
        """A request can be served: there is a decode worker (with a prefill worker the request is
        disaggregated; without one, the decode worker prefills locally, the counted fallback) or a
        colocated worker. Prefill workers alone serve nothing. Mirrors ``Gateway._pick``. Notes
        the time in ``path_seen`` when True (the gateway's health loop asks at least every second)."""
        serving = bool(self.alive("decode") or self.alive("colocated"))
        if serving:
            self.path_seen = time.monotonic()
        return serving
