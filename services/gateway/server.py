"""The gateway's server: its options, the public Generation API (gRPC, and the OpenAI-compatible
HTTP API) and the Registry workers register with, started in the running event loop
(``GatewayServer``), and the ``pdserve gateway`` process (``serve_gateway``: READY line, drain on
SIGINT/SIGTERM, exit 0).

Health: Generation (and "") is SERVING only while ``registry.can_serve()``; the Registry is
SERVING from start to stop (workers register with a gateway that has none yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from dataclasses import dataclass, field

from pdserve.services import lifecycle, process
from pdserve.services.errors import STATUS_CODES
from pdserve.services.gateway.auth import KeyFileError
from pdserve.services.gateway.config import GatewayConfig

from pdserve import rpc, telemetry, tls
from pdserve.model.config import ModelConfig
from pdserve.model.fetch import resolve_model
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import generation_pb2, worker_pb2_grpc
from pdserve.v1 import generation_pb2_grpc as gen_grpc

GIL_SWITCH_S = 0.0002  # sys.setswitchinterval in the gateway process (serve_gateway)


@dataclass(frozen=True)
class GatewayOptions:
    model: str
    host: str = "127.0.0.1"
    port: int = 0
    config: GatewayConfig = field(default_factory=GatewayConfig)
    max_model_len: int | None = None
    metrics_port: int = 0
    http_port: int = -1  # the OpenAI-compatible HTTP API; 0 picks a port, -1 turns it off
    telemetry: telemetry.TelemetryConfig = field(
        default_factory=lambda: telemetry.TelemetryConfig("gateway")
    )
    drain_timeout_s: float = lifecycle.DRAIN_TIMEOUT_S  # on SIGTERM: for running requests
    # ``tls.cert``/``tls.key``: the public gRPC port and the HTTP API serve TLS with them;
    # ``tls.ca``: the Registry port requires client certificates from this CA and the gateway
    # dials workers with its certificate.
    tls: tls.TLSConfig | None = None
    # The Registry on a port of its own (0 picks one); None: on the public port.
    registry_port: int | None = None
    cluster_token: str | None = None  # required on Register/Heartbeat/Deregister when set

    def __post_init__(self) -> None:
        lifecycle.check(self.drain_timeout_s)
        if self.cluster_token is None and not self.registry_requires_client_cert:
            raise ValueError(
                "worker registration must be authenticated: give a cluster token "
                "(PDSERVE_CLUSTER_TOKEN or --cluster-token), or mutual TLS (--tls-ca, --tls-cert, "
                "--tls-key) with the Registry on its own port (--registry-port)"
            )
        if self.cluster_token == "":
            raise ValueError("the cluster token must not be empty")

    @property
    def registry_requires_client_cert(self) -> bool:
        """Whether the handshake itself refuses a Registry client without a cluster certificate."""
        return self.registry_port is not None and self.tls is not None and self.tls.mutual


GENERATION = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def _gateway_parts(opts: GatewayOptions):
    """The gateway, its worker registry, its public gRPC server and the Registry's own server
    (None when the Registry is on the public one), none of them started yet."""
    from pdserve.services.gateway.auth import load_keys
    from pdserve.services.gateway.gateway import Gateway
    from pdserve.services.gateway.registry import WorkerRegistry
    from pdserve.services.gateway.servicer import GenerationServicer, RegistryServicer

    folder = resolve_model(opts.model)
    cfg = ModelConfig.from_file(folder / "config.json")
    max_len = min(opts.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    registry = WorkerRegistry(opts.config.lease_s, opts.tls)
    gateway = Gateway(
        Tokenizer.from_folder(folder),
        max_len,
        cfg.vocab_size,
        folder.name,
        opts.config,
        load_keys(opts.config.api_keys_file),
        registry=registry,
    )
    registry_servicer = RegistryServicer(registry, opts.cluster_token)
    if opts.registry_port is None:
        server = rpc.Server([GENERATION, "pdserve.v1.Registry"], errors=STATUS_CODES)
        worker_pb2_grpc.add_RegistryServicer_to_server(registry_servicer, server.server)
        registry_server = None
    else:
        server = rpc.Server([GENERATION], errors=STATUS_CODES)
        registry_server = rpc.Server(["pdserve.v1.Registry"], errors=STATUS_CODES)
        worker_pb2_grpc.add_RegistryServicer_to_server(registry_servicer, registry_server.server)
    gen_grpc.add_GenerationServicer_to_server(GenerationServicer(gateway), server.server)
    return gateway, registry, server, registry_server


class GatewayServer:
    """The gateway serving in the running event loop: the public Generation API and the Registry
    workers register with (on the same port, or with ``opts.registry_port`` on its own).
    ``server = await GatewayServer.start(opts)``; ``await server.drain(t)`` lets its requests
    finish; ``await server.stop()``."""

    def __init__(
        self,
        opts: GatewayOptions,
        gateway,
        registry,
        server: rpc.Server,
        registry_server: rpc.Server | None,
    ) -> None:
        self.opts = opts
        self.gateway = gateway  # services.gateway.gateway.Gateway
        self.registry = registry  # services.gateway.registry.WorkerRegistry
        self.server = server
        self.registry_server = registry_server
        self.port = 0
        self.registry_port = 0
        self.metrics_address = "-"  # /metrics host:port, "-" when off
        self.http = None  # services.gateway.openai_http.OpenAIServer, when on
        self.serving = False  # Generation's (and "") health now: registry.can_serve()
        self.draining = False
        self._health: asyncio.Task[None] | None = None
        self.watchdog = None  # services.gateway.watchdog.Watchdog, unless probe_interval_s is 0
        self._stopped = False

    @property
    def address(self) -> str:
        return f"{self.opts.host}:{self.port}"

    @property
    def http_address(self) -> str:
        """The OpenAI-compatible HTTP API's host:port, "-" when off."""
        return "-" if self.http is None else self.http.address

    @property
    def registry_address(self) -> str:
        """Where workers register (``--gateway`` of a worker)."""
        return f"{self.opts.host}:{self.registry_port}"

    @classmethod
    async def start(cls, opts: GatewayOptions) -> GatewayServer:
        gateway, registry, server, registry_server = _gateway_parts(opts)
        served = cls(opts, gateway, registry, server, registry_server)
        try:
            secure = opts.tls is not None and opts.tls.enabled
            public = tls.server_credentials(opts.tls, False) if secure else None
            served.port = served.registry_port = server.bind(f"{opts.host}:{opts.port}", public)
            if registry_server is not None:
                internal = None
                if secure:
                    internal = tls.server_credentials(opts.tls, opts.tls.mutual)
                served.registry_port = registry_server.bind(
                    f"{opts.host}:{opts.registry_port}", internal
                )
            served.metrics_address = process.serve_metrics(
                gateway.metrics, opts.host, opts.metrics_port
            )
            await server.set_serving(False, ["", GENERATION])
            if registry_server is None:
                await server.set_serving(True, ["pdserve.v1.Registry"])
            else:
                await registry_server.set_serving(True)
            if opts.http_port >= 0:
                from pdserve.services.gateway.openai_http import OpenAIServer

                served.http = OpenAIServer(
                    gateway, opts.host, opts.http_port, opts.tls if secure else None
                )
                await served.http.start()
            if registry_server is not None:
                await registry_server.start()
            await server.set_serving(True, [process.LIVENESS])
            await server.start()
            served._health = asyncio.create_task(served._watch_health())
            if opts.config.probe_interval_s > 0:
                from pdserve.services.gateway.watchdog import Watchdog

                served.watchdog = Watchdog(registry, opts.config, gateway.metrics)
                served.watchdog.start()
        except BaseException:
            await served.stop()
            raise
        keys = gateway.keys
        if keys.enabled:
            telemetry.logger().info(
                "auth.keys_loaded",
                keys=len(keys.keys),
                source=str(keys.path) if keys.path else "PDSERVE_API_KEYS",
            )
        else:
            telemetry.logger().warning(
                "auth.disabled",
                message="NO API KEYS CONFIGURED: the gateway serves anyone who can reach "
                f"{served.address}, unlimited. Give it keys with --api-keys FILE "
                "(pdserve keys add) or $PDSERVE_API_KEYS.",
            )
        return served

    def reload_keys(self) -> bool:
        """Read the API key file again (SIGHUP). When it cannot be used, the old keys stay and
        the error is logged; returns whether the new keys are in force."""
        keys = self.gateway.keys
        try:
            n = keys.reload()
        except KeyFileError as e:
            telemetry.logger().error(
                "auth.reload_failed", error=str(e), message="API KEYS NOT RELOADED: old keys stay"
            )
            return False
        telemetry.logger().info("auth.keys_reloaded", keys=n, source=str(keys.path))
        return True

    async def _update_health(self) -> None:
        serving = not self.draining and self.registry.can_serve()
        if serving != self.serving:
            self.serving = serving
            await self.server.set_serving(serving, ["", GENERATION])
            telemetry.logger().info("gateway.health", serving=serving)

    async def _watch_health(self) -> None:
        """Recompute health when a worker registers or leaves, and a few times per lease (leases
        run out without an event)."""
        changed = asyncio.Event()
        self.registry.on_change = changed.set
        tick = min(self.registry.lease_s / 4, 1.0)
        while True:
            await self._update_health()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), tick)
            changed.clear()

    async def drain(self, timeout: float) -> bool:
        """Say NOT_SERVING, refuse new requests (UNAVAILABLE), then wait until the running ones
        are over or ``timeout`` seconds pass; True when they all finished. Workers may still
        register and leave meanwhile. ``stop()`` afterwards."""
        self.draining = True
        await self._update_health()
        gate = self.gateway.gate
        gate.close()
        log = telemetry.logger()
        log.info("gateway.draining", running=gate.active)
        done = await gate.wait_idle(timeout)
        if not done:
            log.warning("gateway.drain_timeout", running=gate.active)
        return done

    async def stop(self, grace: float = 1.0) -> None:
        """Stop serving (calls in flight get ``grace`` seconds), close /metrics and the channels
        to workers; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        if self._health is not None:
            self._health.cancel()
        if self.watchdog is not None:
            await self.watchdog.stop()
        if self.gateway.warmer is not None:
            await self.gateway.warmer.close()
        self.registry.on_change = None
        await self.server.set_serving(False)
        if self.http is not None:
            await self.http.stop(grace=grace)
        if self.registry_server is not None:
            await self.registry_server.stop(grace=grace)
        await self.server.stop(grace=grace)
        self.gateway.metrics.close()
        for w in list(self.registry.workers.values()):
            await w.channel.close()


async def serve_gateway(opts: GatewayOptions) -> None:
    """``pdserve gateway``: serve until signalled."""
    # The gateway forwards tokens: its event loop must get the GIL as soon as a message is
    # there. With CPython's default 5 ms switch interval a background thread (the span
    # exporter, grpc's poller) may hold it that long (docs/benchmarks.md, gateway overhead).
    sys.setswitchinterval(GIL_SWITCH_S)
    telemetry.setup(opts.telemetry)
    try:
        server = await GatewayServer.start(opts)
    except KeyFileError as e:
        print(f"pdserve gateway: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, server.reload_keys)
    process.ready(
        "gateway",
        server.address,
        server.metrics_address,
        server.http_address,
        server.registry_address,
    )
    telemetry.logger().info(
        "gateway.ready",
        address=server.address,
        registry=server.registry_address,
        metrics=server.metrics_address,
        http=server.http_address,
        policy=opts.config.policy,
        tls=opts.tls is not None,
        mutual_tls=opts.tls is not None and opts.tls.mutual,
        tracing=telemetry.tracing_enabled(),
    )
    try:
        await process.until_signalled()
        await server.drain(opts.drain_timeout_s)
    finally:
        await server.stop(grace=1.0)
        telemetry.shutdown()
