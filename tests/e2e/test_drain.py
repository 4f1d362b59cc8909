"""SIGTERM to a real decode worker while it streams: it deregisters, lets its streams finish, and
exits 0; with no decode worker left the gateway says NOT_SERVING and answers UNAVAILABLE."""

from __future__ import annotations

import signal

import grpc
import pytest
from pdserve.services.launcher import stop_processes

from pdserve import Client, SamplingParams
from tests.e2e.cluster import start_cluster
from tests.helpers import NOT_SERVING, SERVING, health, wait_until

MAX_TOKENS = 96


def test_sigterm_drains_a_decode_worker_its_streams_finish_and_it_exits_0():
    c = start_cluster("--outage-wait", "0")  # no waiting for a decode worker to come back
    try:
        c.start_worker("prefill", "prefill")
        c.start_worker("decode", "decode", "--drain-timeout", "120")
        decode = c.workers["decode"][0]
        assert health(c.gateway) == SERVING
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        with Client(c.gateway, timeout=180) as client:
            streams = [client.generate_stream(f"Story number {i}:", params) for i in range(8)]
            tokens = [list(next(s).token_ids) for s in streams]  # every stream has started
            decode.send_signal(signal.SIGTERM)
            # It deregisters at once; the prefill worker alone serves nothing.
            wait_until(lambda: health(c.gateway) == NOT_SERVING, 10, "the gateway: NOT_SERVING")
            with pytest.raises(grpc.RpcError) as err:
                client.complete("Hello", params)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            finishes = []
            for s, got in zip(streams, tokens, strict=True):
                for out in s:
                    got.extend(out.token_ids)
                    finishes.append(out.finish_reason)
        assert [len(t) for t in tokens] == [MAX_TOKENS] * 8
        assert finishes.count("length") == 8
        assert decode.wait(timeout=60) == 0
    finally:
        stop_processes(c.procs)
