"""Conditional disaggregation (services/gateway/placement.py): decisions on recorded worker state,
and a real in-process cluster that prefills short prompts on the decode worker."""

from __future__ import annotations

import grpc
import pytest
from pdserve.services.gateway import placement
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.cost import Report
from pdserve.services.gateway.registry import Worker

from pdserve import Client, SamplingParams
from pdserve.v1 import worker_pb2
from tests.helpers import assert_no_leaks, wait_until

CFG = GatewayConfig(local_prefill_tokens=32, decode_prefill_budget_s=0.5)
BUSY, DISAGGREGATED = placement.PREFILL_BUSY, placement.DISAGGREGATED


def _worker(role: str, **state) -> Worker:
    w = Worker(f"{role}-x", role, "127.0.0.1:1", "h", channel=grpc.insecure_channel("127.0.0.1:1"))
    for k, v in state.items():
        setattr(w, k, v)
    return w


def _report(token_s: float) -> Report:
    return Report(0.0, worker_pb2.WorkerStats(prefill_token_s=token_s))


def test_the_rate_is_tokens_over_busy_time_whatever_order_the_prompts_are_computed_in():
    """Three prompts sent at once to a worker that computes 1,000 tokens/s, the short ones first
    (its "shortest" prompt order), then one more after it idled: 1,000 tokens/s throughout. The
    old measure (tokens queued ahead + its own, over its duration) read 11,000 from the first."""
    p = _worker("prefill")
    for _ in range(3):
        placement.prefill_started(p, 0.0)
    placement.record_prefill(p, 100, 0.1)
    assert p.prefill_rate == pytest.approx(1000.0)
    placement.record_prefill(p, 100, 0.2)
    placement.record_prefill(p, 1000, 1.2)
    assert p.prefill_rate == pytest.approx(1000.0)
    placement.prefill_started(p, 5.0)  # idle since 1.2: its time starts now
    placement.record_prefill(p, 200, 5.2)
    assert p.prefill_rate == pytest.approx(1000.0) and p.prefills_running == 0
    # two ending together (one step): one carries the step's time, the other none
    placement.prefill_started(p, 6.0)
    placement.prefill_started(p, 6.0)
    placement.record_prefill(p, 300, 6.6)
    placement.record_prefill(p, 300, 6.6)
    assert 600 < p.prefill_rate < 1400
    # a failed call teaches nothing, and its time is not counted against the next
    placement.prefill_started(p, 7.0)
    placement.prefill_started(p, 7.0)
    before = p.prefill_rate
    placement.record_prefill(p, None, 9.0)
    assert p.prefill_rate == before
    placement.record_prefill(p, 100, 9.1)
    assert p.prefill_rate == pytest.approx(1000.0, rel=0.1)  # counting 7.0-9.1: ~600


@pytest.mark.parametrize(
    "tokens, prefill_state, decode_state, want",
    [
        # short prompts stay on the decode worker, measured rate or not
        (32, {}, {}, placement.SHORT_PROMPT),
        (33, {}, {}, placement.DISAGGREGATED),  # no rate yet: ship it
        # prefill idle: ship it
        (400, {"prefill_rate": 1000.0}, {}, placement.DISAGGREGATED),
        # nothing measured by this gateway yet: the worker's own report (1 ms a token) decides
        (400, {"report": _report(0.001), "outstanding_tokens": 600, "prompts": 1}, {}, BUSY),
        (
            400,
            {"report": _report(0.0), "outstanding_tokens": 600, "prompts": 1},
            {},
            DISAGGREGATED,
        ),
        # ... and what this gateway measured comes first: 0.3 s here at its 2,000 tokens/s, within
        # the budget (at the report's 1,000, 0.6 s would not be)
        (
            600,
            {
                "prefill_rate": 2000.0,
                "report": _report(0.001),
                "outstanding_tokens": 5000,
                "prompts": 1,
            },
            {},
            BUSY,
        ),
    ],
)
def test_decisions(tokens, prefill_state, decode_state, want):
    p, d = _worker("prefill", **prefill_state), _worker("decode", **decode_state)
    assert placement.decide(tokens, p, d, CFG) == want


@pytest.mark.parametrize(
    "here, there, decode_state, want",
    [
        # it holds more of the prompt (a reply it generated) and runs nothing of ours
        (60, 110, {}, placement.HELD_HERE),
        (60, 61, {}, placement.HELD_HERE),
        (60, 60, {}, DISAGGREGATED),  # as much there: the prefill worker's core is free
        (110, 60, {}, DISAGGREGATED),
        # a stream, or a prompt it is prefilling itself: its TPOT comes first
        (60, 110, {"streams": 1}, DISAGGREGATED),
        (60, 110, {"prompts": 1}, DISAGGREGATED),
    ],
)
def test_an_idle_decode_worker_prefills_what_it_holds_more_of(here, there, decode_state, want):
    p, d = _worker("prefill", prefill_rate=1000.0), _worker("decode", **decode_state)
    assert placement.decide(here, p, d, CFG, there) == want
    off = GatewayConfig(decode_prefill_budget_s=0)
    assert placement.decide(here, p, d, off, there) == DISAGGREGATED


# At 1,000 prompt tokens/s measured: prompt tokens to compute here, those queued at the prefill
# worker and the prompts waiting there (P), the decode worker's streams, own prefills (S: both)
# and the prompt tokens it has taken on
@pytest.mark.parametrize(
    "tokens, queued, waiting, streams, own, own_tokens, want",
    [
        # 0.6 s queued there > 0.4 s here; one prompt waiting pays for 0.4 s of no stream
        (400, 600, 1, 0, 0, 0, BUSY),
        # here would take 0.45 s (50 already taken on) > what waits there (0.4 s)
        (400, 400, 1, 0, 1, 50, DISAGGREGATED),
        # queued long there, but 0.6 s here is over the one waiting prompt's 0.5 s
        (600, 5000, 1, 0, 0, 0, DISAGGREGATED),
        # ... and within ten's: 2 streams held back 0.6 s (1.2 stream-s) against 10 prompts at
        # 0.5 s each (5 s): a prefill-bound load with a small decode batch
        (600, 5000, 10, 2, 0, 0, BUSY),
        # 4 waiting, 8 streams: not starved (fewer than 2 prompts a stream), batch not held back
        (600, 5000, 4, 8, 0, 0, DISAGGREGATED),
        # ... not even by a short prompt the waiting would pay for (2 × 0.2 s ≤ 3 × 0.5 s): 3
        # prompts for 2 streams is a decode batch as large as the prefill worker can feed
        (200, 5000, 3, 2, 0, 0, DISAGGREGATED),
        (300, 5000, 1, 12, 0, 0, DISAGGREGATED),  # a full batch, 1 prompt waiting
        # a prompt it is prefilling itself counts as a stream the next one holds back: 2 × 1.8 s
        # > 6 prompts × 0.5 s (counted as 1 stream, 1.8 s would fit); 8 prompts pay for it
        (400, 5000, 6, 1, 1, 1400, DISAGGREGATED),
        (400, 5000, 8, 1, 1, 1400, BUSY),
        # a deep queue pays for 2 s of one stream, but no prompt longer than a prefill chunk
        # (1,024 tokens) is taken on while a stream runs: each would wait for all of it
        (2000, 50000, 20, 1, 0, 0, DISAGGREGATED),
        (1025, 50000, 20, 1, 0, 0, DISAGGREGATED),
        (1024, 50000, 20, 1, 0, 0, BUSY),
        (2000, 50000, 20, 0, 0, 0, BUSY),  # no stream to hold back
        # no stream at all: 5 prompts' budgets (2.5 s), this one's 2.6 s is over
        (2600, 9000, 5, 0, 0, 0, DISAGGREGATED),
        # many waiting, but what waits there (2 s) is shorter than computing it here (3 s)
        (3000, 2000, 10, 0, 0, 0, DISAGGREGATED),
    ],
)
def test_starved_decisions(tokens, queued, waiting, streams, own, own_tokens, want):
    p = _worker("prefill", prefill_rate=1000.0, outstanding_tokens=queued, prompts=waiting)
    d = _worker("decode", streams=streams, prompts=own, local_prefill_tokens=own_tokens)
    assert placement.decide(tokens, p, d, CFG) == want


def test_a_budget_of_zero_always_disaggregates():
    p = _worker("prefill", prefill_rate=1000.0, outstanding_tokens=10**6)
    off = GatewayConfig(decode_prefill_budget_s=0)
    assert placement.decide(1, p, _worker("decode"), off) == placement.DISAGGREGATED


def test_a_short_prompt_is_prefilled_by_its_decode_worker_and_a_long_one_is_shipped(cluster):
    c = cluster(prefill=1, decode=1, decode_prefill_budget_s=0.5)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    short, long = list(range(5, 15)), list(range(5, 105))
    prefill = c.workers["prefill-0"]
    registry = c.gateway.gateway.registry.workers
    p, d = registry[prefill.worker_id], registry[c.workers["decode-0"].worker_id]
    with Client(c.address, timeout=60) as client:
        got_short = client.complete(short, params)
        got_long = client.complete(long, params)

        # what placement weighs: past its first token a request is a stream on its decode
        # worker, no longer a prompt at the prefill worker; both counts go back to 0 at its end
        # (the gateway counts a request off when its call ends, just after the client has
        # read the last token: waited for, not assumed)
        def ended() -> bool:
            return (p.prompts, d.streams) == (0, 0)

        wait_until(ended, 10, "the requests before to end at the gateway")
        stream = client.generate_stream(long[1:], params)
        next(stream)
        assert (p.prompts, d.streams) == (0, 1)
        for _ in stream:
            pass
        wait_until(ended, 10, "the disaggregated stream to end at the gateway")
        stream = client.generate_stream(short[1:], params)  # a local prefill
        next(stream)
        assert (p.prompts, d.streams) == (0, 1)
        for _ in stream:
            pass
    wait_until(ended, 10, "the local stream to end at the gateway")
    assert c.served("prefill-0") == 2  # the long ones
    assert c.served("decode-0") == 4
    assert c.gateway_metric("pdserve_placement_total", reason="short_prompt") == 2
    assert c.gateway_metric("pdserve_placement_total", reason="disaggregated") == 2
    assert c.gateway_metric("pdserve_requests_without_disaggregation_total") == 0
    assert p.prefill_rate > 0
    # the same tokens either way: the roles run one engine
    off = cluster(prefill=1, decode=1)
    with Client(off.address, timeout=60) as client:
        assert client.complete(short, params).token_ids == got_short.token_ids
        assert client.complete(long, params).token_ids == got_long.token_ids
    assert_no_leaks(c.live())


def _second_request(cluster, first: list[int], params: SamplingParams, then):
    """On 1 prefill + 1 decode workers: ``first``, then the prompt ``then(the cluster, first's
    tokens)`` gives; the cluster and the second's response, whose tokens are checked against
    those of a cluster that saw only it."""
    c = cluster(prefill=1, decode=1, decode_prefill_budget_s=0.5)
    with Client(c.address, timeout=60) as client:
        second = then(c, list(client.complete(first, params).token_ids))
        got = client.complete(second, params)
    off = cluster(prefill=1, decode=1)
    with Client(off.address, timeout=60) as client:
        assert client.complete(second, params).token_ids == got.token_ids
    return c, got


def test_a_prompt_whose_prefix_its_decode_worker_holds_is_prefilled_there(cluster):
    """What a worker would compute decides, not the prompt's length: the decode worker kept the
    first prompt's blocks (decode-side prefix reuse), so the second, which extends it, leaves it 7
    tokens to compute there: short, prefilled where its prefix is."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = list(range(5, 105))  # 100 tokens (6 full blocks of 16): shipped
    c, got = _second_request(cluster, first, params, lambda _c, _t: first + [7, 8, 9])
    assert c.served("prefill-0") == 1
    assert c.gateway_metric("pdserve_placement_total", reason="disaggregated") == 1
    assert c.gateway_metric("pdserve_placement_total", reason="short_prompt") == 1
    assert got.usage.cached_prompt_tokens == 96
    assert_no_leaks(c.live())


def test_a_chats_next_turn_is_prefilled_where_its_reply_was_generated(cluster):
    """The decode worker keeps the reply it generated too, and the gateway counts it there at
    once: the next turn (the prompt, the 40-token reply, 7 new tokens: 147) leaves it 19 tokens
    to compute (the KV of 100 + 39 tokens, 8 blocks, is there), short; counting the prompt's
    blocks alone it would be 51, and the prefill worker would compute all 147."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = list(range(5, 105))
    c, got = _second_request(
        cluster, first, params, lambda _c, reply: first + reply + list(range(7, 14))
    )
    assert c.served("prefill-0") == 1
    assert c.gateway_metric("pdserve_placement_total", reason="short_prompt") == 1
    assert got.usage.cached_prompt_tokens == 128
    assert_no_leaks(c.live())


def test_a_chats_next_turn_goes_to_an_idle_decode_worker_that_holds_more_of_it(cluster):
    """A longer new message (40 tokens: 180 in all) leaves the decode worker 52 tokens to compute
    (over the short prompts' 32) and the prefill worker 84 (it holds the first prompt's 96, not
    the reply): with no stream of ours there, the decode worker prefills it."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    first = list(range(5, 105))

    def next_turn(c, reply: list[int]) -> list[int]:
        d = c.gateway.gateway.registry.workers[c.workers["decode-0"].worker_id]
        wait_until(lambda: d.streams == d.prompts == 0, 10, "the first request to end there")
        return first + reply + list(range(7, 47))

    c, got = _second_request(cluster, first, params, next_turn)
    assert c.served("prefill-0") == 1
    assert c.gateway_metric("pdserve_placement_total", reason="held_here") == 1
    assert got.usage.cached_prompt_tokens == 128
    assert_no_leaks(c.live())


def test_a_decode_worker_counts_as_idle_for_borrowing_only_with_nothing_else_of_ours_there():
    """PrefillRequest.decode_idle: the request just admitted is all this gateway runs on the
    decode worker (no other stream, no prompt it is prefilling itself)."""
    assert placement.decode_idle(_worker("decode", outstanding_tokens=300), 300)
    assert not placement.decode_idle(_worker("decode", outstanding_tokens=600), 300)
    busy = _worker("decode", outstanding_tokens=300, local_prefill_tokens=40)
    assert not placement.decode_idle(busy, 300)


@pytest.mark.parametrize("bad", [-1, 1.5, "1024"])
def test_a_prompt_cap_that_is_not_a_count_of_tokens_is_refused(bad):
    with pytest.raises(
        ValueError, match=f"decode_prefill_max_tokens must be an integer >= 0, got {bad!r}"
    ):
        GatewayConfig(decode_prefill_max_tokens=bad)


def _busy_pair(streams: int) -> tuple[Worker, Worker]:
    """A prefill worker far behind (5,000 tokens to compute at 1,000 a second, 8 prompts waiting)
    and a decode worker running ``streams``: a 400-token prompt (0.4 s) is PREFILL_BUSY."""
    p = _worker("prefill", prefill_rate=1000.0, outstanding_tokens=5000, prompts=8)
    return p, _worker("decode", streams=streams)


def test_prompts_taken_on_for_a_busy_prefill_worker_come_a_share_of_the_time_apart():
    cfg = GatewayConfig(decode_prefill_budget_s=0.5, decode_prefill_share=0.2)
    p, d = _busy_pair(streams=3)  # 8 prompts waiting for 3 streams: starved, not deeply
    assert placement.decide(400, p, d, cfg, t=100.0) == BUSY
    placement.spread(400, p, d, cfg, 100.0)  # 0.4 s there, at most a fifth of its time: 2 s
    assert placement.decide(400, p, d, cfg, t=101.99) == DISAGGREGATED
    assert placement.decide(400, p, d, cfg, t=102.0) == BUSY
    assert placement.decide(20, p, d, cfg, t=100.5) == placement.SHORT_PROMPT  # not held back


def test_a_queue_deep_enough_takes_them_on_within_the_share_wait():
    """8 prompts waiting for 2 streams (DEEP per stream): the decode batch is too small to protect,
    so only the budget holds such prompts back; one prompt fewer waiting and the wait holds."""
    cfg = GatewayConfig(decode_prefill_budget_s=0.5, decode_prefill_share=0.2)
    p, d = _busy_pair(streams=2)
    assert p.prompts == placement.DEEP * 2
    placement.spread(400, p, d, cfg, 100.0)
    assert d.prefill_busy_until == pytest.approx(102.0)
    assert placement.decide(400, p, d, cfg, t=100.5) == BUSY
    p.prompts -= 1
    assert placement.decide(400, p, d, cfg, t=100.5) == DISAGGREGATED
    assert placement.decide(400, p, d, cfg, t=102.0) == BUSY


def test_a_decode_worker_without_streams_takes_them_as_they_come():
    cfg = GatewayConfig(decode_prefill_share=0.2)
    p, d = _busy_pair(streams=0)
    placement.spread(400, p, d, cfg, 100.0)  # nothing held back: no wait
    assert d.prefill_busy_until == 0.0
    d.prefill_busy_until = 200.0  # a wait set while it ran streams
    assert placement.decide(400, p, d, cfg, t=100.0) == BUSY


def test_a_share_of_one_sets_no_wait():
    cfg = GatewayConfig(decode_prefill_share=1.0)
    p, d = _busy_pair(streams=3)
    placement.spread(400, p, d, cfg, 100.0)
    assert placement.decide(400, p, d, cfg, t=100.0) == BUSY


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, float("nan")])
def test_a_share_outside_zero_to_one_is_refused(bad):
    with pytest.raises(ValueError, match=r"decode_prefill_share must be a fraction in \(0, 1\]"):
        GatewayConfig(decode_prefill_share=bad)
