"""Honest health and graceful drain, in process.

A worker says SERVING only once registered and while its engine thread is alive and not stuck; an
unhealthy worker deregisters, so the gateway stops routing to it. The gateway's Generation service
says SERVING only while a request can be served: a decode worker (with or without prefill workers)
or a colocated worker; its Registry service serves throughout. Draining: NOT_SERVING, deregistered,
new calls UNAVAILABLE, running streams finish.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from pdserve.services.gateway.server import GENERATION
from pdserve.services.main import WorkerServer
from pdserve.services.process import LIVENESS

from pdserve import Client, SamplingParams
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.helpers import NOT_SERVING, SERVING, assert_no_leaks, health, wait_until

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _local_generate(address: str, request_id: str = "direct") -> list[worker_pb2.DecodeResponse]:
    """Decode.Generate with prefill_locally, straight to a worker (below the gateway)."""
    with grpc.insecure_channel(address) as ch:
        call = worker_pb2_grpc.DecodeStub(ch).Generate(
            worker_pb2.DecodeRequest(
                request_id=request_id,
                prompt_token_ids=[1, 2, 3],
                sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0),
                prefill_locally=True,
            ),
            timeout=30,
        )
        return list(call)


def _listed(c, w: WorkerServer) -> bool:
    """The gateway routes to ``w``: registered, lease running."""
    listed = c.gateway.registry.workers.get(w.worker_id)
    return listed is not None and listed.alive


def _pause(c, w: WorkerServer):
    """Hold ``w``'s engine thread in one command until ``release`` is set (returns once it is
    held); the future ends (True) when it has been released."""
    held, release = threading.Event(), threading.Event()

    def hold(engine) -> bool:
        held.set()
        return release.wait(60)

    fut = asyncio.run_coroutine_threadsafe(w.worker.loop.call(hold), c.loop.loop)
    assert held.wait(10), "the engine thread did not take the command"
    return release, fut


class _HeldRegistry(worker_pb2_grpc.RegistryServicer):
    """A Registry that holds each Register call until ``release`` is set."""

    def __init__(self) -> None:
        self.addresses: list[str] = []
        self.release = asyncio.Event()

    async def Register(self, request, context):
        self.addresses.append(request.address)
        await self.release.wait()
        return worker_pb2.RegisterResponse(lease_ms=10_000)

    async def Heartbeat(self, request, context):
        return worker_pb2.HeartbeatResponse(known=True)

    async def Deregister(self, request, context):
        return worker_pb2.DeregisterResponse(known=True)


def test_a_worker_is_not_serving_until_it_is_registered(cluster):
    c = cluster(prefill=0, decode=0)
    registry = _HeldRegistry()

    async def serve_registry() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        worker_pb2_grpc.add_RegistryServicer_to_server(registry, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = c.loop.run(serve_registry())
    try:
        opts = c.worker_options("decode", gateway=f"127.0.0.1:{port}")
        starting = asyncio.run_coroutine_threadsafe(WorkerServer.start(opts), c.loop.loop)
        wait_until(lambda: registry.addresses, 30, "the worker to register")
        address = registry.addresses[0]  # it serves gRPC already: health answers
        assert health(address) == NOT_SERVING
        assert health(address, "pdserve.v1.Decode") == NOT_SERVING
        assert health(address, LIVENESS) == SERVING  # registering: not ready, but alive
        c.loop.loop.call_soon_threadsafe(registry.release.set)
        c.workers["decode-0"] = w = starting.result(30)
        assert w.healthy
        assert health(address) == SERVING
        assert health(address, "pdserve.v1.Decode") == SERVING
    finally:
        c.loop.run(server.stop(0))


def test_the_gateway_serves_only_while_a_request_can_be_served(cluster):
    c = cluster(prefill=0, decode=0)
    assert health(c.address) == health(c.address, GENERATION) == NOT_SERVING
    assert health(c.address, "pdserve.v1.Registry") == SERVING  # workers can register
    assert health(c.address, LIVENESS) == SERVING
    with Client(c.address, timeout=30) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.complete([1, 2, 3], PARAMS)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        # Prefill workers alone serve nothing: NOT_SERVING, and a request gets UNAVAILABLE.
        c.start_worker("prefill-0", "prefill")
        assert c.loop.run(_settled(c)) is False
        assert health(c.address) == health(c.address, GENERATION) == NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            client.complete([1, 2, 3], PARAMS)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        # A decode worker completes the path (with no prefill worker it would prefill locally).
        c.start_worker("decode-0", "decode")
        assert c.loop.run(_settled(c)) is True
        assert health(c.address) == health(c.address, GENERATION) == SERVING
        assert client.complete([1, 2, 3], PARAMS).finish_reason == "length"

        # It leaves (drains): nothing serves any more.
        assert c.loop.run(c.workers["decode-0"].drain(5)) is True
        assert c.loop.run(_settled(c)) is False
        assert health(c.address) == NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            client.complete([1, 2, 3], PARAMS)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        # A colocated worker serves alone, and with prefill workers beside it.
        c.start_worker("colocated-0", "colocated")
        assert c.loop.run(_settled(c)) is True
        assert health(c.address) == SERVING
        assert client.complete([1, 2, 3], PARAMS).finish_reason == "length"
    assert_no_leaks(c.live())


async def _settled(c) -> bool:
    """The gateway's health once it has seen the registry's last change (the check runs on the
    loop, so one pass of it settles what the test just did); True: SERVING."""
    await c.gateway._update_health()
    return c.gateway.serving


def test_the_gateway_stops_serving_when_the_last_workers_lease_runs_out(cluster):
    c = cluster(prefill=0, decode=0, colocated=1, lease_s=1.0)
    assert health(c.address) == SERVING
    c.stop_worker("colocated-0")  # gone without deregistering: its lease runs out
    wait_until(lambda: health(c.address) == NOT_SERVING, 10, "the gateway to say NOT_SERVING")
    assert health(c.address, GENERATION) == NOT_SERVING


def test_a_stuck_engine_makes_its_worker_unhealthy_until_it_moves_again(cluster):
    c = cluster(prefill=0, decode=0)
    stuck = c.start_worker("colocated-0", "colocated", stall_timeout_s=0.5)
    c.start_worker("colocated-1", "colocated")
    release, blocked = _pause(c, stuck)
    try:
        wait_until(lambda: health(stuck.address) == NOT_SERVING, 10, "NOT_SERVING")
        assert health(stuck.address, "pdserve.v1.Decode") == NOT_SERVING
        assert "engine stuck in one step" in stuck.unhealthy_reason
        wait_until(lambda: not _listed(c, stuck), 5, "the gateway to drop the stuck worker")
        assert health(c.address) == SERVING  # colocated-1
        with Client(c.address, timeout=30) as client:
            for i in range(4):
                assert client.complete([1, 2, 3 + i], PARAMS).finish_reason == "length"
        # a worker counts a request just after its last token: wait for the count
        wait_until(lambda: c.served("colocated-1") == 4, 5, "colocated-1 to serve all 4")
        assert c.served("colocated-0") == 0
    finally:
        release.set()
    assert blocked.result(10) is True
    wait_until(lambda: health(stuck.address) == SERVING, 10, "SERVING again")
    wait_until(lambda: _listed(c, stuck), 5, "the worker to register again")
    assert_no_leaks(c.live())


def test_a_dead_engine_thread_makes_its_worker_unavailable_and_unlisted(cluster):
    c = cluster(prefill=0, decode=0, colocated=2)
    dead = c.workers["colocated-0"]

    def broken_step():
        raise RuntimeError("injected engine failure")

    dead.engine.step = broken_step  # the engine thread dies at its next step
    with pytest.raises(grpc.RpcError) as err:
        _local_generate(dead.address)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "the engine thread has ended: RuntimeError: injected engine failure" in (
        err.value.details()
    )
    wait_until(lambda: health(dead.address) == NOT_SERVING, 10, "NOT_SERVING")
    assert health(dead.address, "pdserve.v1.Decode") == NOT_SERVING
    assert health(dead.address, LIVENESS) == NOT_SERVING  # for good: to be restarted
    assert health(c.workers["colocated-1"].address, LIVENESS) == SERVING
    wait_until(lambda: not _listed(c, dead), 5, "the gateway to drop the dead worker")
    with pytest.raises(grpc.RpcError) as err:  # a new request fails at once, it does not hang
        _local_generate(dead.address, "again")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with Client(c.address, timeout=30) as client:
        for i in range(4):
            assert client.complete([1, 2, 3 + i], PARAMS).finish_reason == "length"
    wait_until(lambda: c.served("colocated-1") == 4, 5, "colocated-1 to serve all 4")
    c.stop_worker("colocated-0")
    assert_no_leaks(c.live())


def test_draining_a_decode_worker_lets_its_streams_finish_and_sends_new_requests_elsewhere(
    cluster,
):
    c = cluster(prefill=1, decode=2)
    d0 = c.workers["decode-0"]
    long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    with Client(c.address, timeout=60) as client:
        streams = [client.generate_stream([7, 8, 9 + i], long) for i in range(8)]
        tokens = [list(next(s).token_ids) for s in streams]  # each is admitted and prefilled
        # Hold decode-0's engine, so that its streams are still running when it drains.
        release, paused = _pause(c, d0)
        try:
            assert d0.worker.gate.active == 4  # least_loaded: 4 streams on each decode worker
            draining = asyncio.run_coroutine_threadsafe(d0.drain(30), c.loop.loop)
            wait_until(lambda: not _listed(c, d0), 5, "decode-0 to deregister")
            assert health(d0.address) == health(d0.address, "pdserve.v1.Decode") == NOT_SERVING
            assert health(d0.address, LIVENESS) == SERVING  # draining is no reason to restart
            with pytest.raises(grpc.RpcError) as err:  # a new admission there: UNAVAILABLE
                _local_generate(d0.address)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "this decode worker is draining" in err.value.details()
            # New requests go to decode-1 while decode-0's streams wait.
            for i in range(3):
                assert client.complete([4, 5, 6 + i], PARAMS).finish_reason == "length"
            assert health(c.address) == SERVING
            assert not draining.done()
        finally:
            release.set()
        assert paused.result(10) is True
        finishes = []
        for s, got in zip(streams, tokens, strict=True):
            for out in s:
                got.extend(out.token_ids)
                finishes.append(out.finish_reason)
        assert [len(t) for t in tokens] == [300] * 8
        assert finishes.count("length") == 8
        assert draining.result(30) is True  # every stream finished within the bound
        assert c.served("decode-0") == 4  # its 4 streams; none of the new requests
        wait_until(lambda: c.served("decode-1") == 4 + 3, 5, "decode-1: its 4 streams + 3 new")
        assert_no_leaks(c.live())  # decode-0 still answers Stats while it drains

        # decode-1 drains too: the prefill worker alone serves nothing.
        assert c.loop.run(c.workers["decode-1"].drain(5)) is True
        wait_until(lambda: health(c.address) == NOT_SERVING, 5, "the gateway: NOT_SERVING")
        with pytest.raises(grpc.RpcError) as err:
            client.complete([1, 2, 3], PARAMS)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert_no_leaks(c.live())


def test_a_draining_gateway_refuses_new_requests_and_finishes_running_ones(cluster):
    c = cluster(prefill=1, decode=1)
    long = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True)
    d0 = c.workers["decode-0"]
    with Client(c.address, timeout=60) as client:
        stream = client.generate_stream([7, 8, 9], long)
        got = list(next(stream).token_ids)
        release, paused = _pause(c, d0)
        try:
            draining = asyncio.run_coroutine_threadsafe(c.gateway.drain(30), c.loop.loop)
            wait_until(lambda: health(c.address) == NOT_SERVING, 5, "the gateway: NOT_SERVING")
            assert health(c.address, LIVENESS) == SERVING
            with pytest.raises(grpc.RpcError) as err:
                client.complete([1, 2, 3], PARAMS)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert err.value.details() == "the gateway is draining (shutting down)"
            assert not draining.done()
        finally:
            release.set()
        paused.result(10)
        for out in stream:
            got.extend(out.token_ids)
    assert len(got) == 300
    assert draining.result(30) is True
    assert_no_leaks(c.live())
