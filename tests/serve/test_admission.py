"""Decode workers admit by reservation: when every one is full, the gateway queues a request until
a seat frees, and answers RESOURCE_EXHAUSTED once its queue timeout has passed."""

from __future__ import annotations

import concurrent.futures

import grpc

from pdserve import Client, SamplingParams
from pdserve.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.helpers import assert_no_leaks, seat_held, wait_until

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_every_decode_worker_full_past_the_queue_timeout_is_resource_exhausted(cluster):
    c = cluster(prefill=1, decode=2, decode_seqs=1, queue_timeout_s=0.5)
    decode = c.live()
    request = generation_pb2.GenerateRequest(
        token_ids=generation_pb2.TokenIds(ids=[1, 2, 3]),
        sampling=common_pb2.SamplingParams(max_tokens=4),
    )
    with (
        seat_held(decode["decode-0"][0]),
        seat_held(decode["decode-1"][0]),
        grpc.insecure_channel(c.address) as ch,
    ):
        # The client's deadline is far off: the gateway's queue timeout is what ends the wait.
        call = generation_pb2_grpc.GenerationStub(ch).Complete.future(request, timeout=20)
        try:
            err = call.exception(timeout=30)
        finally:
            call.cancel()
    assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "every decode worker stayed full for 0.5 s" in err.details()
    assert c.gateway_metric("pdserve_requests_total", outcome="resource_exhausted") == 1
    assert c.gateway_metric("pdserve_retries_total") == 0  # a full worker is not a failed one
    assert_no_leaks(c.live())


def test_a_request_queues_while_decode_is_full_and_is_served_when_a_seat_frees(cluster):
    c = cluster(prefill=1, decode=2, decode_seqs=1)
    decode = c.live()
    with (
        Client(c.address, timeout=30) as client,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        seat_held(decode["decode-1"][0]),
    ):
        with seat_held(decode["decode-0"][0]):
            pending = pool.submit(client.complete, [1, 2, 3], PARAMS)
            wait_until(
                lambda: c.gateway_metric("pdserve_requests_waiting") == 1,
                10,
                "the request to queue at the gateway",
            )
            assert not pending.done()
        out = pending.result(timeout=30)  # decode-0's seat is free again
        assert (len(out.token_ids), out.finish_reason) == (4, "length")
        wait_until(lambda: c.served("decode-0") == 1, 5, "decode-0 to serve it")
    assert c.gateway_metric("pdserve_requests_waiting") == 0
    assert_no_leaks(c.live())
