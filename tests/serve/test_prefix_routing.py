"""Policy ``cost`` in a running cluster: workers report their load and prefix cache in their
heartbeats, the gateway keeps the reports, and a prompt sharing a cached prefix goes to the
prefill worker holding it; a bad affinity key is refused."""

from __future__ import annotations

import grpc
import pytest
from pdserve.services.gateway.cost import Job

from pdserve import Client, SamplingParams
from tests.helpers import assert_no_leaks, wait_until

SHORT = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PREFIX = list(range(100, 300))  # 200 tokens: 12 full blocks of 16
PREFILLS = ("prefill-0", "prefill-1")


def _reported(c, name: str):
    """The gateway's registry entry of worker ``name``."""
    return c.gateway.gateway.registry.workers[c.workers[name].worker_id]


def test_a_repeated_prefix_lands_on_the_prefill_worker_that_holds_it(cluster):
    c = cluster(policy="cost", prefill=2, decode=1, lease_s=0.6)  # heartbeats every 0.2 s
    with Client(c.address, timeout=30) as client:
        out = client.complete([*PREFIX, 7], SHORT)
        assert (len(out.token_ids), out.finish_reason) == (4, "length")
        wait_until(lambda: sum(c.served(n) for n in PREFILLS) == 1, 5, "one prefill counted")
        holder = next(n for n in PREFILLS if c.served(n) == 1)
        other = next(n for n in PREFILLS if n != holder)
        hashes = Job([*PREFIX, 7], 4).hashes(16)
        held, cold = _reported(c, holder), _reported(c, other)
        # The holder's heartbeats report the prefix; the other's do not. Two reports later the
        # gateway no longer remembers where it sent the prompt: only the reports say it.
        since = held.heartbeats
        wait_until(
            lambda: held.heartbeats >= since + 3 and cold.heartbeats >= since + 3,
            5,
            "three heartbeats with stats from each prefill worker",
        )
        assert held.report.summary.hit_blocks(hashes) == 12
        assert cold.report.summary is None or cold.report.summary.hit_blocks(hashes) == 0
        assert not held.cached_recently(hashes[0])
        for i in range(4):
            out = client.complete([*PREFIX, 20 + i, 21], SHORT)
            assert (len(out.token_ids), out.finish_reason) == (4, "length")
        wait_until(lambda: c.served(holder) == 5, 5, f"{holder} to serve 5 prefills")
        assert c.served(other) == 0
        # what the reports said is what the engines hold
        assert c.workers[holder].engine.allocator.lookup(hashes[-1]) is not None
        assert c.workers[other].engine.allocator.lookup(hashes[0]) is None
    assert_no_leaks(c.live())


def test_an_affinity_key_keeps_a_session_on_one_prefill_worker(cluster):
    c = cluster(policy="cost", prefill=2, decode=1)
    with Client(c.address, timeout=30) as client:
        for i in range(4):  # different prompts, no cache to go by: the key decides
            out = client.complete([5, 6, 7 + i], SHORT, affinity_key="session-1")
            assert out.finish_reason == "length"
        served = lambda: sorted(c.served(n) for n in PREFILLS)  # noqa: E731
        wait_until(lambda: served() == [0, 4], 5, f"one prefill worker to serve all 4: {served()}")
    assert_no_leaks(c.live())


@pytest.mark.parametrize(
    "key, message",
    [
        ("k" * 129, "affinity_key has 129 characters; at most 128 are allowed"),
        ("a\nb", "affinity_key 'a\\nb' has a character that is not printable"),
    ],
)
def test_a_bad_affinity_key_is_refused_with_what_is_allowed(shared_cluster, key, message):
    c = shared_cluster
    with Client(c.address, timeout=30) as client, pytest.raises(grpc.RpcError) as err:
        client.complete([1, 2, 3], SHORT, affinity_key=key)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert_no_leaks(c.live())
