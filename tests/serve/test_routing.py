"""Which prefill and decode worker serve a request, per routing policy; fallbacks without a pair."""

from __future__ import annotations

import grpc
import pytest

from pdserve import Client, SamplingParams
from tests.helpers import assert_no_leaks, wait_until, worker_stats

SHORT = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _served(c, names) -> dict[str, int]:
    return {n: c.served(n) for n in names}


def _complete_sequentially(c, n: int) -> None:
    with Client(c.address, timeout=30) as client:
        for i in range(n):
            out = client.complete([1, 2, 3, 4 + i], SHORT)
            assert (len(out.token_ids), out.finish_reason) == (4, "length")


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded"])
def test_sequential_requests_spread_evenly_over_two_prefill_and_two_decode_workers(cluster, policy):
    """round_robin takes turns; least_loaded, among idle workers (a tie), takes turns too."""
    c = cluster(policy=policy)
    _complete_sequentially(c, 8)
    expected = {"prefill-0": 4, "prefill-1": 4, "decode-0": 4, "decode-1": 4}
    # A decode worker counts a request once its stream has closed, just after the client's reply.
    wait_until(
        lambda: _served(c, expected) == expected, 5, f"{expected}, got {_served(c, expected)}"
    )
    assert c.gateway_metric("pdserve_retries_total") == 0
    assert_no_leaks(c.live())


def test_least_loaded_sends_new_requests_away_from_a_busy_decode_worker(cluster):
    c = cluster(policy="least_loaded")
    with Client(c.address, timeout=30) as client:
        long = client.generate_stream(
            [5, 6, 7], SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
        )
        next(long), next(long)  # streaming: it holds prompt + 4,000 tokens of decode-x's budget
        busy = [n for n in ("decode-0", "decode-1") if worker_stats(*c.live()[n]).num_running]
        assert len(busy) == 1, busy
        idle = "decode-1" if busy == ["decode-0"] else "decode-0"
        for i in range(4):
            out = client.complete([9, 10 + i], SHORT)
            assert out.finish_reason == "length"
        wait_until(lambda: c.served(idle) == 4, 5, f"{idle} to serve 4 requests")
        assert c.served(busy[0]) == 0
        long.cancel()
    assert_no_leaks(c.live())


def test_without_prefill_workers_a_colocated_worker_serves(cluster):
    c = cluster(prefill=0, decode=0, colocated=1)
    with Client(c.address, timeout=30) as client:
        out = client.complete("What is the capital of France?", SHORT)
    assert (len(out.token_ids), out.finish_reason) == (4, "length")
    assert c.gateway_metric("pdserve_requests_without_disaggregation_total") == 1
    wait_until(lambda: c.served("colocated-0") == 1, 5, "the colocated worker to count it")
    assert_no_leaks(c.live())


def test_no_worker_registered_answers_unavailable(cluster):
    c = cluster(prefill=0, decode=0)
    with Client(c.address, timeout=30) as client, pytest.raises(grpc.RpcError) as err:
        client.complete("hi", SHORT)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no worker could serve the request: no worker is registered" in err.value.details()
