"""The ``cost`` routing policy on recorded worker stats: the exact pick for each situation.

Each test builds the heartbeat reports a gateway would hold (``WorkerStats`` as a worker sends
them, through the Registry's path: ``Report.from_proto``) and asserts which worker the router picks.
"""

from __future__ import annotations

import hashlib
from collections import Counter

import grpc
import pytest
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.cost import (
    MAX_KV_HOLD_S,
    Job,
    Report,
    believed_cached,
    kv_hold_s,
    prefill_estimate,
    prompt_ended,
    prompt_sent,
    record_hits,
    rendezvous,
    tokens_to_compute,
)
from pdserve.services.gateway.registry import Worker
from pdserve.services.gateway.router import Router
from pdserve.services.stats import summary_to_proto

from pdserve.kv_cache.allocator import prefix_block_hashes
from pdserve.kv_cache.prefix_summary import MAX_BYTES, PrefixSummary
from pdserve.v1 import worker_pb2

NOW = 1000.0
STALE_S = 2.0
SYSTEM = list(range(1000, 1600))  # a 600-token system prompt: 37 full blocks of 16


@pytest.fixture
def channel():
    ch = grpc.insecure_channel("127.0.0.1:1")  # never dialled: the router only reads
    yield ch
    ch.close()


def worker(channel, worker_id: str, role: str = "prefill") -> Worker:
    return Worker(worker_id, role, "127.0.0.1:1", "h", channel=channel)


def report(
    queue_s: float = 0.0,
    token_s: float = 1e-3,
    cached: list[int] | None = None,
    age: float = 0.0,
    running: int = 0,
    waiting: int = 0,
    free: int = 1000,
) -> Report:
    """A heartbeat's stats, as the Registry servicer turns them into a Report ``age`` s ago."""
    stats = worker_pb2.WorkerStats(
        num_total_blocks=1000,
        num_free_blocks=free,
        num_running=running,
        num_waiting=waiting,
        prefill_queue_s=queue_s,
        prefill_token_s=token_s,
    )
    summary = PrefixSummary.build(16, prefix_block_hashes(cached or [], 16))
    stats.prefix_summary.CopyFrom(summary_to_proto(summary))
    return Report.from_proto(stats, NOW - age)


def chat(turn: int) -> Job:
    """The system prompt and a 40-token user message."""
    return Job(SYSTEM + list(range(turn * 100, turn * 100 + 40)), max_tokens=32)


def pick(router: Router, workers: list[Worker], job: Job, **kw) -> str:
    return router.pick(workers, job=job, now=NOW, **kw).worker_id


def test_a_prefix_hit_wins_over_an_idle_worker_when_it_is_cheaper(channel):
    a, b = worker(channel, "prefill-a"), worker(channel, "prefill-b")
    a.reported(report(queue_s=0.1, cached=SYSTEM))  # busy, but holds the system prompt
    b.reported(report())  # idle, cold
    router = Router("cost", stale_s=STALE_S)
    # a: 0.1 + (640 - 592) * 1 ms = 0.148 s; b: 640 * 1 ms = 0.64 s
    assert prefill_estimate(a, chat(1), NOW, STALE_S) == pytest.approx((0.148, 592))
    assert prefill_estimate(b, chat(1), NOW, STALE_S) == pytest.approx((0.64, 0))
    assert [pick(router, [a, b], chat(t)) for t in range(4)] == ["prefill-a"] * 4


def test_an_overloaded_worker_loses_despite_its_prefix_hit(channel):
    a, b = worker(channel, "prefill-a"), worker(channel, "prefill-b")
    a.reported(report(queue_s=2.0, cached=SYSTEM))  # 2.048 s
    b.reported(report())  # 0.64 s
    assert pick(Router("cost", stale_s=STALE_S), [a, b], chat(1)) == "prefill-b"


def test_a_slower_worker_loses_at_equal_cache(channel):
    a, b = worker(channel, "prefill-a"), worker(channel, "prefill-b")
    a.reported(report(token_s=2e-3))
    b.reported(report(token_s=1e-3))
    assert pick(Router("cost", stale_s=STALE_S), [a, b], chat(1)) == "prefill-b"


def test_requests_sent_since_the_last_report_count_on_top_of_it(channel):
    a, b = worker(channel, "prefill-a"), worker(channel, "prefill-b")
    a.reported(report(cached=SYSTEM))
    b.reported(report())
    router = Router("cost", stale_s=STALE_S)
    sent_at = a.sent(1000)  # 1 s of prompts this gateway sent to a since its report
    assert pick(router, [a, b], chat(1)) == "prefill-b"  # a: 1.048 s, b: 0.64 s
    a.done(sent_at, 1000)
    assert pick(router, [a, b], chat(1)) == "prefill-a"
    # a request sent before a report is in that report: its end does not count it off again
    sent_at = a.sent(500)
    a.reported(report(queue_s=0.5, cached=SYSTEM))
    a.done(sent_at, 500)
    assert a.unreported_tokens == 0 and a.unreported_requests == 0


def test_prompts_a_report_missed_still_count_as_this_gateways_in_flight(channel):
    """A report generated before the prompts this gateway sent just ahead of it reached the
    worker counts them nowhere (sent before the report arrived: not "sent since"); this gateway's
    own work in flight there is the floor of the queue, as least_loaded would count it."""
    a, b = worker(channel, "prefill-a"), worker(channel, "prefill-b")
    router = Router("cost", stale_s=STALE_S)
    sent_at = a.sent(2000)
    a.outstanding_tokens += 2000
    a.reported(report())  # says idle: the 2,000 tokens had not reached its queue yet
    b.reported(report(queue_s=0.5))
    assert prefill_estimate(a, chat(1), NOW, STALE_S)[0] == pytest.approx(2.0 + 0.64)
    assert pick(router, [a, b], chat(1)) == "prefill-b"
    a.done(sent_at, 2000)
    a.outstanding_tokens -= 2000
    assert pick(router, [a, b], chat(1)) == "prefill-a"
    # a report that knows more than this gateway (other gateways' prompts) is believed
    a.reported(report(queue_s=3.0))
    a.outstanding_tokens = 1000
    assert prefill_estimate(a, chat(1), NOW, STALE_S)[0] == pytest.approx(3.0 + 0.64)


def test_a_report_ages_and_a_stale_one_is_not_used(channel):
    a, b = worker(channel, "prefill-a"), worker(channel, "prefill-b")
    router = Router("cost", stale_s=STALE_S)
    # a reported 1.0 s queued 0.8 s ago: 0.2 s left, less than b's fresh 0.5 s
    a.reported(report(queue_s=1.0, age=0.8))
    b.reported(report(queue_s=0.5))
    assert prefill_estimate(a, chat(1), NOW, STALE_S)[0] == pytest.approx(0.2 + 0.64)
    assert pick(router, [a, b], chat(1)) == "prefill-a"
    # a's report is older than stale_s: its cache and idle queue are not believed; what this
    # gateway has in flight there (2,000 prompt tokens) is
    a.reported(report(cached=SYSTEM, age=STALE_S + 0.1))
    a.outstanding_tokens = 2000
    assert prefill_estimate(a, chat(1), NOW, STALE_S) == pytest.approx((2.0 + 0.64, 0))
    assert pick(router, [a, b], chat(1)) == "prefill-b"


def test_the_kv_hold_covers_twice_the_wait_expected_at_the_prefill_worker(channel):
    """The decode worker's hold on a prompt's blocks (``kv_timeout_ms``): the timeout beyond
    twice the prefill worker's queue and compute, so a prompt queued longer than the timeout
    alone is not timed out there, and PROMPT_AGING (4) times its own compute, which later and
    shorter prompts may take ahead of it there; bounded."""
    a = worker(channel, "prefill-a")
    # no report yet: the prompt at KV_HOLD_TOKEN_S a token, not the router's optimistic default
    own = 640 * 0.02
    assert kv_hold_s(a, chat(1), NOW, STALE_S, 30.0) == pytest.approx(30 + 2 * own + 4 * own)
    a.reported(report(queue_s=40.0, cached=SYSTEM))  # 40 s queued; the system prompt cached
    own = 0.048  # 48 tokens at the reported 1 ms
    assert kv_hold_s(a, chat(1), NOW, STALE_S, 30.0) == pytest.approx(30 + 2 * (40 + own) + 4 * own)
    a.reported(report())  # idle
    assert kv_hold_s(a, chat(1), NOW, STALE_S, 30.0) == pytest.approx(30 + 6 * 0.64)
    # prompts this gateway sent there that the report missed: counted whole
    a.outstanding_tokens = 5000
    assert kv_hold_s(a, chat(1), NOW, STALE_S, 30.0) == pytest.approx(30 + 2 * 5.64 + 4 * 0.64)
    a.reported(report(queue_s=1e6))
    assert kv_hold_s(a, chat(1), NOW, STALE_S, 30.0) == MAX_KV_HOLD_S
    assert kv_hold_s(a, chat(1), NOW, STALE_S, 7200.0) == 7200.0  # never below the timeout


def test_a_prompt_sent_lately_counts_as_cached_before_any_report_says_so(channel):
    a, b = worker(channel, "prefill-a"), worker(channel, "prefill-b")
    a.reported(report())
    b.reported(report())
    router = Router("cost", stale_s=STALE_S)
    first = chat(0)
    a.prompt_cached(first.hashes(16), 16)
    assert pick(router, [a, b], chat(1)) == "prefill-a"  # the system prompt's 37 blocks
    for _ in range(3):  # while it is there, reports that lack it do not count
        a.reported(report())
    assert pick(router, [a, b], chat(1)) == "prefill-a"
    a.prompt_ended(first.hashes(16), computed=True)
    a.reported(report())  # one report after it ended it is still remembered (built before?)...
    assert pick(router, [a, b], chat(1)) == "prefill-a"
    a.reported(report())  # ...two later, only what the reports say counts: evicted since
    assert prefill_estimate(a, chat(1), NOW, STALE_S)[1] == 0


def test_the_reply_a_decode_worker_generated_counts_as_cached_there_for_the_next_turn(channel):
    """A decode (or colocated) worker keeps the full blocks of what it generated: the next turn
    (the prompt, the reply, a new message) finds them there before any report lists them; the
    reply's last token is not counted (its KV was never written), nor a reply when the request
    failed before its prompt was there."""
    d = worker(channel, "decode-a", role="decode")
    d.reported(report())
    first = chat(0)  # 640 tokens: 40 full blocks
    reply = list(range(5000, 5032))  # 32 tokens: the KV of 640 + 31 (41 full blocks, not 42)
    prompt_sent(d, first)
    prompt_ended(d, first, True, reply)
    turn = Job(first.prompt_ids + reply + list(range(6000, 6040)), max_tokens=32)
    assert believed_cached(d, turn, d.report) == 41 * 16
    elsewhere = Job(first.prompt_ids + [7] + reply, max_tokens=32)  # the reply after another
    assert believed_cached(d, elsewhere, d.report) == 40 * 16
    other = worker(channel, "decode-b", role="decode")
    other.reported(report())
    prompt_sent(other, first)
    prompt_ended(other, first, False, reply)
    assert believed_cached(other, turn, other.report) == 0


def test_a_prompt_that_failed_before_its_blocks_were_there_is_not_remembered(channel):
    a = worker(channel, "prefill-a")
    a.reported(report())
    first = chat(0)
    a.prompt_cached(first.hashes(16), 16)
    a.prompt_cached(first.hashes(16), 16)  # two prompts of it in flight
    a.prompt_ended(first.hashes(16), computed=False)
    assert a.cached_recently(first.hashes(16)[0])  # the other is still there
    a.prompt_ended(first.hashes(16), computed=False)
    assert not a.cached_recently(first.hashes(16)[0])


def test_a_worker_whose_prompts_miss_the_prefix_expected_there_counts_for_what_they_find(channel):
    """More sessions sent to a worker than its cache holds: its filter still lists a session's
    history when the prompt arrives, but the history was evicted and is computed again. Its
    answers say so, and the router stops expecting that prefix there until they find it again."""
    a, b = worker(channel, "prefill-a"), worker(channel, "prefill-b")
    history = list(range(5000, 5400))  # 400 tokens of the session's earlier turns
    job = Job(SYSTEM + history + list(range(40)), max_tokens=32)  # 1,040 tokens
    a.reported(report(queue_s=0.2, cached=SYSTEM + history))  # lists 62 blocks: 992 tokens
    b.reported(report(cached=SYSTEM))  # 37 blocks: 592 tokens
    router = Router("cost", stale_s=STALE_S)
    # a: 0.2 + (1040 - 992) * 1 ms = 0.248 s; b: (1040 - 592) * 1 ms = 0.448 s
    assert prefill_estimate(a, job, NOW, STALE_S) == pytest.approx((0.248, 992))
    assert pick(router, [a, b], job) == "prefill-a"
    for _ in range(4):  # each found the system prompt only
        record_hits(a, believed_cached(a, job, a.report), 592)
    # each answer weighs 0.25: 1 - (1 - 592/992) * (1 - 0.75^4) = 0.724
    assert a.hit_share == pytest.approx(1 - (1 - 592 / 992) * (1 - 0.75**4))
    cached = int(992 * a.hit_share)
    assert prefill_estimate(a, job, NOW, STALE_S) == pytest.approx(
        (0.2 + (1040 - cached) / 1e3, cached)
    )
    assert pick(router, [a, b], job) == "prefill-b"  # 0.2 + > 0.3 s against 0.448 s
    assert b.hit_share == 1.0
    for _ in range(8):  # then its prompts found what was expected (or more) again
        record_hits(a, believed_cached(a, job, a.report), 992)
    assert a.hit_share > 0.95
    assert pick(router, [a, b], job) == "prefill-a"
    record_hits(a, 0, 0)  # nothing expected: nothing learnt
    assert a.hit_share > 0.95


def test_a_worker_that_reports_no_prefix_summary_is_expected_to_cache_nothing(channel):
    """A worker with prefix caching off sends no summary: a prompt sent there lately is not
    cached there, and the next one like it goes where it is cheaper by the queues alone."""
    a, b = worker(channel, "prefill-a"), worker(channel, "prefill-b")
    router = Router("cost", stale_s=STALE_S)
    first = chat(0)
    a.prompt_cached(first.hashes(16), 16)
    a.reported(Report.from_proto(worker_pb2.WorkerStats(prefill_token_s=1e-3), NOW))
    b.reported(report(queue_s=0.1))
    assert a.cached_recently(first.hashes(16)[0])  # sent there, but its report says no cache
    assert prefill_estimate(a, chat(1), NOW, STALE_S) == pytest.approx((0.64, 0))
    assert tokens_to_compute(a, chat(1), NOW, STALE_S) == 640
    assert pick(router, [a, b], chat(1)) == "prefill-a"  # 0.64 s against b's 0.74 s
    b.reported(report(queue_s=0.1, cached=SYSTEM))  # b holds the system prompt: 0.148 s
    assert pick(router, [a, b], chat(1)) == "prefill-b"


def test_what_is_sent_since_the_report_queues_only_its_uncached_tokens(channel):
    """Sessions of one system prompt keep landing on its holder: each one sent there adds its
    48 tokens past the cached blocks to the holder's queue estimate, not its 640 (the holder computes only those);
    counted as the whole prompt, two sent there made the idle cold worker look cheaper."""
    a, b = worker(channel, "prefill-a"), worker(channel, "prefill-b")
    a.reported(report(cached=SYSTEM))
    b.reported(report())
    router = Router("cost", stale_s=STALE_S)
    for turn in range(1, 6):
        job = chat(turn)
        assert pick(router, [a, b], job) == "prefill-a", turn
        todo = tokens_to_compute(a, job, NOW, STALE_S)
        assert todo == 8 + 40  # the system prompt's partial last block and the user message
        a.sent(todo)
        prompt_sent(a, job)
    assert prefill_estimate(a, chat(6), NOW, STALE_S)[0] == pytest.approx(5 * 48e-3 + 48e-3)
    # a prompt of another system prompt: cold on both, the idle one computes it sooner
    assert tokens_to_compute(b, Job(list(range(5000, 5640)), 32), NOW, STALE_S) == 640
    assert pick(router, [a, b], Job(list(range(5000, 5640)), 32)) == "prefill-b"


def test_the_affinity_key_keeps_its_worker_within_the_slack(channel):
    a, b = worker(channel, "prefill-a"), worker(channel, "prefill-b")
    a.reported(report())
    b.reported(report())
    router = Router("cost", stale_s=STALE_S, affinity_slack_s=0.5)
    homes = {}
    for key in ("alice", "bob", "carol", "dave", "erin", "frank"):
        job = Job(chat(1).prompt_ids, 32, affinity_key=key)
        homes[key] = {pick(router, [a, b], job) for _ in range(4)}
    assert all(len(h) == 1 for h in homes.values()), homes  # the same worker every time
    assert set().union(*homes.values()) == {"prefill-a", "prefill-b"}  # keys spread over both
    spread = Counter(
        max(["prefill-a", "prefill-b"], key=lambda w: rendezvous(f"session-{i}", w))
        for i in range(1000)
    )
    assert 450 <= spread["prefill-a"] <= 550, spread
    # the home worker falls behind by more than the slack: the key moves
    key = next(k for k, h in homes.items() if h == {"prefill-a"})
    job = Job(chat(1).prompt_ids, 32, affinity_key=key)
    a.reported(report(queue_s=0.4))
    assert pick(router, [a, b], job) == "prefill-a"  # 1.04 s <= 0.64 s + 0.5 s
    a.reported(report(queue_s=0.6))
    assert pick(router, [a, b], job) == "prefill-b"  # 1.24 s > 1.14 s
    # without the home worker, its keys go to the cheapest
    assert pick(router, [a, b], job, exclude={"prefill-a"}) == "prefill-b"


def test_ties_take_turns(channel):
    a, b = worker(channel, "prefill-a"), worker(channel, "prefill-b")
    a.reported(report())
    b.reported(report())
    router = Router("cost", stale_s=STALE_S)
    picks = [pick(router, [a, b], chat(t)) for t in range(4)]
    assert sorted(picks) == ["prefill-a", "prefill-a", "prefill-b", "prefill-b"]


def test_decode_workers_by_free_blocks_then_batch(channel):
    d1, d2 = worker(channel, "decode-1", "decode"), worker(channel, "decode-2", "decode")
    router = Router("cost", stale_s=STALE_S)
    job = chat(1)  # 640 + 32 tokens: 42 blocks of 16
    d1.reported(report(running=1, free=500))
    d2.reported(report(running=5, free=900))
    assert pick(router, [d1, d2], job, decode=True) == "decode-1"  # the smaller batch
    d1.reported(report(running=1, free=41))
    assert pick(router, [d1, d2], job, decode=True) == "decode-2"  # d1 cannot take it now
    d1.reported(report(running=3, free=500))
    d1.sent(0, 42)
    d1.sent(0, 42)
    d1.sent(0, 42)  # 3 sent since its report: 6 sequences to d2's 5
    assert pick(router, [d1, d2], job, decode=True) == "decode-2"


def test_a_decode_worker_without_a_fresh_report_counts_its_blocks_free(channel):
    """One that just (re)joined is not passed over for an idle one that reported: before the
    fix its "blocks assumed free" counted as none free, so it got nothing until it reported."""
    d1, d2 = worker(channel, "decode-1", "decode"), worker(channel, "decode-2", "decode")
    router = Router("cost", stale_s=STALE_S)
    d2.reported(report(free=1000))
    assert pick(router, [d1, d2], chat(1), decode=True) == "decode-1"  # never reported
    d1.reported(report(free=1000, age=3 * STALE_S))  # rejoined after its last report went stale
    picks = [pick(router, [d1, d2], chat(t), decode=True) for t in range(4)]
    assert sorted(picks) == ["decode-1", "decode-1", "decode-2", "decode-2"]  # idle alike: turns
    d1.calls.add(object())  # this gateway's call in flight there: d2 now
    assert pick(router, [d1, d2], chat(1), decode=True) == "decode-2"


def test_without_a_request_cost_picks_as_least_loaded(channel):
    a, b = worker(channel, "prefill-a"), worker(channel, "prefill-b")
    a.outstanding_tokens = 10
    assert Router("cost").pick([a, b]).worker_id == "prefill-b"


def test_bad_settings_say_what_is_allowed():
    with pytest.raises(
        ValueError, match="routing policy must be one of cost, least_loaded, round_robin"
    ):
        Router("fastest")
    with pytest.raises(ValueError, match="affinity_slack_s must be >= 0 seconds, got -1"):
        GatewayConfig(affinity_slack_s=-1)


def test_the_prefix_summary_finds_the_leading_cached_blocks_and_stays_bounded():
    hashes = prefix_block_hashes(list(range(160)), 16)  # 10 blocks
    summary = PrefixSummary.build(16, hashes[:6])
    assert summary.hit_blocks(hashes) == 6
    assert summary.hit_blocks(prefix_block_hashes(list(range(1, 161)), 16)) == 0
    assert len(summary.bloom) == 256  # the smallest filter
    many = [i.to_bytes(4, "little") * 4 for i in range(100_000)]
    assert len(PrefixSummary.build(16, many).bloom) == MAX_BYTES
    assert len(PrefixSummary.build(16, many[:1000]).bloom) == 2048  # >= 10 bits per block
    with pytest.raises(ValueError, match="power of two of at most 16384 bytes, got 300"):
        PrefixSummary(16, 1, bytes(300))
    # a summary that does not parse is treated as none (the worker is routed as cold)
    broken = worker_pb2.WorkerStats()
    broken.prefix_summary.CopyFrom(worker_pb2.PrefixSummary(block_size=16, bloom=bytes(300)))
    assert Report.from_proto(broken, NOW).summary is None


def test_false_positives_stay_near_one_percent():
    def block_hash(i: int) -> bytes:  # as the allocator's: uniform 16 bytes
        return hashlib.blake2b(i.to_bytes(4, "little"), digest_size=16).digest()

    cached = [block_hash(i) for i in range(2000)]
    summary = PrefixSummary.build(16, cached)
    assert all(h in summary for h in cached)
    others = [block_hash(i) for i in range(2000, 22_000)]
    rate = sum(h in summary for h in others) / len(others)
    assert rate < 0.02, rate
