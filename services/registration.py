"""A worker's registration with every gateway: ``--gateway HOST:PORT[,HOST:PORT...]``.

Each ``HOST:PORT`` may name several gateways: the host is resolved (DNS) again on every heartbeat
round, and the worker registers with, and heartbeats to, every address it resolves to. On
Kubernetes ``--gateway`` is a headless Service (one DNS A record per gateway pod), so every
gateway replica lists every worker and none of them is the only one that knows the cluster: a
client may be sent to any replica. A gateway that goes away only stops being heartbeated; one
that appears is registered with on the next round (within a third of the lease).

``Registration`` keeps one ``GatewayLink`` (a channel and a Registry stub) per resolved address.
Over TLS each link dials the address but checks the name the worker was given (``HOST``, or
``--tls-server-name``): the gateways' certificates carry names, not pod IPs.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable

import grpc

from pdserve import rpc, telemetry, tls
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

# Registry calls that say the gateway will not take this worker whatever it retries.
REFUSED = (
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
)


class RegistrationRefusedError(RuntimeError):
    """A gateway refused this worker (its KV layout differs from its peers', say): the message
    is the gateway's reason. The ``pdserve <role>`` process prints it and exits with code 2."""


class NoGatewayError(ConnectionError):
    """No gateway could be reached (none resolved, or none answered)."""


def parse_gateways(spec: str) -> list[tuple[str, int]]:
    """``"a:1,b:2"`` -> ``[("a", 1), ("b", 2)]``; an IPv6 host in brackets (``[::1]:50051``)."""
    out = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"gateway address {part!r} is not HOST:PORT")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise ValueError("no gateway address given")
    return out


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to, as ``ip:port``, IPv4 ones only when there are any (a
    dual-stack name would otherwise count each gateway twice); sorted. Raises OSError."""
    if _is_ip(host):
        return [_join(host, port)]
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    v4 = {i[4][0] for i in infos if i[0] == socket.AF_INET}
    v6 = {i[4][0] for i in infos if i[0] == socket.AF_INET6}
    return [_join(ip, port) for ip in sorted(v4 or v6)]


Resolver = Callable[[str, int], Awaitable[list[str]]]


class GatewayLink:
    """Registration with one gateway address."""

    def __init__(self, address: str, server_name: str | None, reg: Registration) -> None:
        self.address = address
        self.reg = reg
        cfg = reg.tls_config
        credentials = tls.channel_credentials(cfg) if cfg is not None else None
        options = tls.channel_options(cfg)
        if cfg is not None and not options and server_name:
            options = [("grpc.ssl_target_name_override", server_name)]
        self.channel = rpc.channel(address, credentials, options)
        self.stub = worker_pb2_grpc.RegistryStub(self.channel)
        self.registered = False
        self.period = 1.0

    async def register(self, timeout: float = 10.0) -> None:
        """Raises RegistrationRefusedError with the gateway's reason when it refuses the worker,
        AioRpcError when it cannot be reached."""
        try:
            resp = await self.stub.Register(
                self.reg.request, timeout=timeout, metadata=self.reg.metadata
            )
        except grpc.aio.AioRpcError as e:
            self.registered = False
            if e.code() in REFUSED:
                raise RegistrationRefusedError(e.details()) from None
            raise
        self.registered = True
        self.period = max(resp.lease_ms / 3000, 0.1)

    async def heartbeat(self, stats: worker_pb2.WorkerStats | None = None) -> None:
        """Renew the lease, reporting ``stats`` (what the gateway routes by); register when the
        gateway does not know this worker (its lease ran out, the gateway restarted, or this is a
        gateway not registered with yet). A gateway that does not answer is tried again next
        round."""
        try:
            hb = worker_pb2.HeartbeatRequest(worker_id=self.reg.request.worker_id, stats=stats)
            timeout = self.reg.round_timeout
            resp = await self.stub.Heartbeat(hb, timeout=timeout, metadata=self.reg.metadata)
            if not resp.known:
                await self.register(timeout)
        except grpc.aio.AioRpcError:
            self.registered = False

    async def deregister(self, reason: str) -> None:
        """Best effort: a gateway that does not answer lets the lease run out."""
        self.registered = False
        try:
            await self.stub.Deregister(
                worker_pb2.DeregisterRequest(worker_id=self.reg.request.worker_id, reason=reason),
                timeout=2,
                metadata=self.reg.metadata,
            )
        except grpc.aio.AioRpcError:
            pass


class Registration:
    """Register with every gateway ``gateways`` names, then heartbeat all of them at a third of
    the (shortest) lease, resolving the names again each round. ``stats``: what each heartbeat
    reports (``services/stats.py heartbeat_stats``), taken once per round."""

    def __init__(
        self,
        gateways: str,
        worker_id: str,
        role: str,
        address: str,
        layout,
        tls_config: tls.TLSConfig | None = None,
        cluster_token: str | None = None,
        resolver: Resolver | None = None,
        stats: Callable[[], worker_pb2.WorkerStats] | None = None,
    ) -> None:
        self.targets = parse_gateways(gateways)
        self.tls_config = tls_config
        self.metadata = ((tls.TOKEN_METADATA_KEY, cluster_token),) if cluster_token else ()
        self.request = worker_pb2.RegisterRequest(
            worker_id=worker_id,
            role=role,
            address=address,
            layout=common_pb2.KVLayout(model=layout.model, compat_hash=layout.compat_hash),
        )
        self.resolver = resolver or resolve
        self.stats = stats
        self.links: dict[str, GatewayLink] = {}  # by resolved address
        self._resolved: dict[tuple[str, int], list[str]] = {}  # the last good answer per target

    @property
    def period(self) -> float:
        return min((link.period for link in self.links.values()), default=1.0)

    @property
    def round_timeout(self) -> float:
        """How long a call of a heartbeat round may take: a gateway that does not answer must
        not hold up the others' heartbeats past their leases."""
        return min(5.0, self.period)

    @property
    def registered(self) -> list[str]:
        """The gateway addresses this worker is registered with now."""
        return sorted(a for a, link in self.links.items() if link.registered)

    async def _refresh(self) -> list[GatewayLink]:
        """Resolve every target again; open links to new addresses, close those gone. A name that
        does not resolve now (or not within a round's timeout) keeps its last addresses. Returns
        the new links."""
        wanted: dict[str, str] = {}  # address -> the name its certificate carries
        for host, port in self.targets:
            try:  # bounded: a slow DNS must not hold up the heartbeats either
                answer = await asyncio.wait_for(self.resolver(host, port), self.round_timeout)
                self._resolved[host, port] = answer
            except (OSError, TimeoutError) as e:
                telemetry.logger().warning("gateway.unresolved", gateway=host, error=repr(e))
            for address in self._resolved.get((host, port), []):
                wanted.setdefault(address, host)
        for address in [a for a in self.links if a not in wanted]:
            link = self.links.pop(address)
            telemetry.logger().info("gateway.gone", gateway=address)
            await link.channel.close()
        new = [GatewayLink(a, name, self) for a, name in wanted.items() if a not in self.links]
        self.links.update((link.address, link) for link in new)
        return new

    @staticmethod
    async def _each(calls) -> list[BaseException | None]:
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:  # a refusal is final; a bug is not swallowed
            if isinstance(r, BaseException) and not isinstance(r, grpc.aio.AioRpcError):
                raise r
        return results

    async def register(self) -> None:
        """Register with every gateway resolved now. RegistrationRefusedError when one refuses;
        NoGatewayError when none took it (the others are tried again at each heartbeat)."""
        await self._refresh()
        results = await self._each([link.register() for link in self.links.values()])
        if not any(r is None for r in results):
            errors = [f"{a}: {r.code().name}" for a, r in zip(self.links, results, strict=True)]
            raise NoGatewayError(
                f"no gateway took the registration ({', '.join(errors) or 'none resolved'}; "
                f"--gateway {','.join(_join(h, p) for h, p in self.targets)})"
            )

    async def heartbeat(self) -> None:
        """One round: resolve, register with new gateways, heartbeat the others."""
        new = await self._refresh()
        stats = self.stats() if self.stats is not None else None
        calls = [
            link.register(self.round_timeout) if link in new else link.heartbeat(stats)
            for link in self.links.values()
        ]
        await self._each(calls)

    async def deregister(self, reason: str) -> None:
        await asyncio.gather(*(link.deregister(reason) for link in self.links.values()))

    async def close(self) -> None:
        links, self.links = list(self.links.values()), {}
        for link in links:
            await link.channel.close()
