"""More than one gateway: a worker registers with every gateway ``--gateway`` names.

Several ``HOST:PORT`` separated by commas, or one name that resolves to several addresses (a
headless Kubernetes Service), resolved again on every heartbeat round. Each gateway then lists
every worker, so a request through any of them is served, and a gateway that goes away does not
stop the worker from renewing its lease with the others.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
from pdserve.services import registration
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.server import GatewayOptions, GatewayServer

from pdserve import Client, SamplingParams
from pdserve.certs import CertificateAuthority
from tests.helpers import assert_no_leaks, wait_until

PARAMS = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
LEASE_S = 0.6  # heartbeats every 0.2 s


def _gateway(c) -> GatewayServer:
    """Another gateway of the cluster ``c`` (same model and cluster token)."""
    return c.loop.run(
        GatewayServer.start(
            GatewayOptions(
                model=str(c.model),
                config=GatewayConfig(lease_s=LEASE_S),
                metrics_port=-1,
                http_port=-1,
                cluster_token=c.token,
            )
        )
    )


def _lists(g: GatewayServer, *workers) -> bool:
    """Every worker is listed by ``g``, lease running."""
    listed = g.registry.workers
    return all(w.worker_id in listed and listed[w.worker_id].alive for w in workers)


def _complete(address: str) -> str:
    with Client(address, timeout=30) as client:
        return client.complete([5, 6, 7, 8], PARAMS).finish_reason


def test_parse_gateways():
    assert registration.parse_gateways("a:1, b.svc:50051,[::1]:7") == [
        ("a", 1),
        ("b.svc", 50051),
        ("::1", 7),
    ]
    for bad in ("", "a", "a:", ":1", "a:x"):
        with pytest.raises(ValueError):
            registration.parse_gateways(bad)


def test_resolve_gives_every_address_of_a_name():
    assert asyncio.run(registration.resolve("127.0.0.1", 5)) == ["127.0.0.1:5"]
    assert asyncio.run(registration.resolve("::1", 5)) == ["[::1]:5"]
    assert asyncio.run(registration.resolve("localhost", 5)) in (["127.0.0.1:5"], ["[::1]:5"])
    with pytest.raises(OSError):
        asyncio.run(registration.resolve("no-such-host.invalid", 5))


def test_a_worker_registers_with_every_gateway_and_survives_one_going_away(cluster):
    c = cluster(prefill=0, decode=0, lease_s=LEASE_S)
    g1, g2 = c.gateway, _gateway(c)
    try:
        both = f"{g1.registry_address},{g2.registry_address}"
        p = c.start_worker("prefill-0", "prefill", gateway=both)
        d = c.start_worker("decode-0", "decode", gateway=both)
        for g in (g1, g2):
            assert _lists(g, p, d)
            assert _complete(g.address) == "length"  # served through either gateway
        assert c.served("decode-0") == 2
        assert d._registration.registered == sorted([g1.registry_address, g2.registry_address])

        c.loop.run(g1.stop(grace=0))
        # Several leases later the workers are still listed by the gateway that stayed (their
        # heartbeats to it go on while the other does not answer), and it serves.
        wait_until(lambda: d._registration.registered == [g2.registry_address], 10, "g1 dropped")
        for _ in range(3):
            c.loop.run(asyncio.sleep(LEASE_S))
            assert _lists(g2, p, d)
        assert p.healthy and d.healthy
        assert _complete(g2.address) == "length"
        assert_no_leaks(c.live())
    finally:
        c.loop.run(g2.stop(grace=0))


def test_a_name_is_resolved_again_every_round(cluster, monkeypatch):
    """``--gateway gateways.test:50051`` as a headless Service: the gateways behind the name
    change, and the worker follows (registers with a new one, drops one gone, keeps the last
    answer while the name does not resolve)."""
    c = cluster(prefill=0, decode=0, lease_s=LEASE_S)
    g1, g2 = c.gateway, _gateway(c)
    behind: list[str] = [g1.registry_address]
    asked: list[tuple[str, int]] = []

    hang = threading.Event()

    async def fake_dns(host: str, port: int) -> list[str]:
        asked.append((host, port))
        if hang.is_set():
            await asyncio.sleep(3600)
        if not behind:
            raise OSError("name does not resolve")
        return list(behind)

    monkeypatch.setattr(registration, "resolve", fake_dns)
    try:
        d = c.start_worker("decode-0", "decode", gateway="gateways.test:50051")
        assert asked[0] == ("gateways.test", 50051)
        assert _lists(g1, d) and not _lists(g2, d)

        behind.append(g2.registry_address)  # a second gateway pod
        wait_until(lambda: _lists(g2, d), 10, "the worker to register with the new gateway")
        assert _complete(g2.address) == "length"

        behind.clear()  # DNS fails for a while: the worker keeps the gateways it had
        n = len(asked)
        wait_until(lambda: len(asked) > n + 3, 10, "more heartbeat rounds")
        assert _lists(g1, d) and _lists(g2, d)
        hang.set()  # DNS hangs: each round gives up on it in time, the leases are renewed
        n = len(asked)
        wait_until(lambda: len(asked) > n + 3, 10, "more heartbeat rounds")
        for _ in range(3):
            c.loop.run(asyncio.sleep(LEASE_S))
            assert _lists(g1, d) and _lists(g2, d)
        hang.clear()

        behind.append(g2.registry_address)  # g1's pod is gone from the Service
        c.loop.run(g1.stop(grace=0))
        # g1's link goes on the next resolve round; its heartbeats may fail before that
        wait_until(
            lambda: list(d._registration.links) == [g2.registry_address], 10, "g1's link dropped"
        )
        assert d._registration.registered == [g2.registry_address]
        assert _complete(g2.address) == "length"
        assert_no_leaks(c.live())
    finally:
        c.loop.run(g2.stop(grace=0))


def test_no_gateway_at_start_fails_the_start(cluster, monkeypatch):
    c = cluster(prefill=0, decode=0)

    async def nothing(host: str, port: int) -> list[str]:
        raise OSError("name does not resolve")

    monkeypatch.setattr(registration, "resolve", nothing)
    with pytest.raises(registration.NoGatewayError, match="none resolved"):
        c.start_worker("decode-0", "decode", gateway="gateways.test:50051")


def test_over_tls_the_worker_checks_the_gateway_name_not_the_ip_it_dials(
    cluster, monkeypatch, tmp_path
):
    """The gateways' certificate names the Service (``gw.test``), not pod IPs: the worker dials the
    IP the name resolved to and checks the name."""
    ca = CertificateAuthority(tmp_path)
    certs = {"gateway": ca.issue("gateway", ("gw.test",)), "worker": ca.issue("worker")}
    c = cluster(prefill=0, decode=0, certs=certs)
    registry = c.gateway.registry_address  # 127.0.0.1:port: not in the gateway's certificate
    port = int(registry.rsplit(":", 1)[1])

    async def fake_dns(host: str, port_: int) -> list[str]:
        return [registry] if host == "gw.test" else [f"{host}:{port_}"]

    monkeypatch.setattr(registration, "resolve", fake_dns)
    with pytest.raises(registration.NoGatewayError):  # by IP the name check fails
        c.start_worker("decode-x", "decode", gateway=registry)
    d = c.start_worker("decode-0", "decode", gateway=f"gw.test:{port}")
    assert _lists(c.gateway, d)


def test_a_gateway_that_never_answers_does_not_hold_up_the_others_heartbeats(cluster, monkeypatch):
    """A new gateway pod whose address takes connections but says nothing (a hung process, a
    half-dead node): its calls time out within the round, so the gateway that answers keeps the
    worker's lease."""
    c = cluster(prefill=0, decode=0, lease_s=LEASE_S)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # the kernel completes handshakes; nobody ever reads or writes
    behind = [c.gateway.registry_address]

    async def fake_dns(host: str, port: int) -> list[str]:
        return list(behind)

    monkeypatch.setattr(registration, "resolve", fake_dns)
    try:
        d = c.start_worker("decode-0", "decode", gateway="gateways.test:50051")
        behind.append(f"127.0.0.1:{silent.getsockname()[1]}")
        wait_until(lambda: len(d._registration.links) == 2, 10, "the silent gateway to be tried")
        for _ in range(5):  # several leases: every one renewed in time
            c.loop.run(asyncio.sleep(LEASE_S))
            assert _lists(c.gateway, d)
        assert d._registration.registered == [c.gateway.registry_address]
        assert _complete(c.address) == "length"
    finally:
        silent.close()
