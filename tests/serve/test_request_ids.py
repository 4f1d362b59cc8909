"""A request id is one request on a worker while it runs: a second request with the same id is
refused with INVALID_ARGUMENT and the first goes on. (Two gateways' liveness probes once shared
ids: the second took the first's output stream and, refused by the engine, ended it, so the first
timed out and a busy, healthy worker was evicted.)"""

from __future__ import annotations

import threading

import grpc
import pytest
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.watchdog import Watchdog
from pdserve.services.lifecycle import PROBE_PREFIX

from tests.helpers import assert_no_leaks, wait_until
from tests.serve.test_health import _local_generate, _pause


def test_a_request_id_in_flight_is_refused_and_the_first_request_goes_on(cluster):
    c = cluster(prefill=0, decode=0, colocated=1)
    w = c.workers["colocated-0"]
    release, held = _pause(c, w)  # the first request stays in flight until released
    got: dict[str, object] = {}

    def first() -> None:
        try:
            got["first"] = _local_generate(w.address, "same-id")
        except grpc.RpcError as e:  # reported below, not lost in the thread
            got["first"] = e

    t = threading.Thread(target=first)
    try:
        t.start()
        wait_until(lambda: "same-id" in w.worker.loop._streams, 10, "the first request's stream")
        with pytest.raises(grpc.RpcError) as err:
            _local_generate(w.address, "same-id")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'same-id' is already in use" in err.value.details()
    finally:
        release.set()
        t.join(30)
    assert held.result(10) is True
    responses = got["first"]
    assert not isinstance(responses, grpc.RpcError), responses
    tokens = [t for r in responses for t in r.tokens.token_ids]
    assert len(tokens) == 4 and responses[-1].tokens.finish_reason == "length"
    assert_no_leaks(c.live())


def test_each_gateway_probes_with_ids_of_its_own():
    a, b = (Watchdog(None, GatewayConfig(), None) for _ in range(2))
    ids = [next(a._ids), next(a._ids), next(b._ids)]
    assert all(i.startswith(PROBE_PREFIX) for i in ids)
    assert len(set(ids)) == 3
