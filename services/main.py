"""Servers and process entry points: ``pdserve gateway | prefill | decode | colocated``.

``WorkerServer`` and ``GatewayServer`` start in the running event loop and stop on request; the
in-process tests (tests/serve) run a whole cluster of them in one loop. ``serve_worker`` and
``serve_gateway`` are the processes: each starts one, prints one line ``READY <role> <host:port>``
on stdout once it serves (``pdserve up`` and the end-to-end tests wait for it), and on
SIGINT/SIGTERM drains it (``drain``: new requests UNAVAILABLE, running ones finish, within
``--drain-timeout``), stops it and exits 0.

Health (gRPC health, "" and per service) says what the server can do: a worker is SERVING only
while it is registered (when it has a gateway), not draining and its engine thread alive and not
stuck in one command or step for longer than ``stall_timeout_s``; a worker that turns unhealthy
deregisters (the gateway stops routing to it) and registers again if it recovers. The gateway's
Generation service (and "") is SERVING only while ``registry.can_serve()``; its Registry service
is SERVING from start to stop (workers register with a gateway that has none yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import uuid
from dataclasses import dataclass, field
from typing import NoReturn

import grpc
import torch
from pdserve.services import lifecycle
from pdserve.services.errors import STATUS_CODES
from pdserve.services.gateway.auth import KeyFileError
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.registration import (
    NoGatewayError,
    Registration,
    RegistrationRefusedError,
)

from pdserve import rpc, telemetry, tls
from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine
from pdserve.model.config import ModelConfig
from pdserve.model.fetch import resolve_model
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import generation_pb2, worker_pb2_grpc
from pdserve.v1 import generation_pb2_grpc as gen_grpc

# A health "service" (no RPCs) that says whether the process should be restarted: SERVING from
# start to stop, also while draining or unregistered; a worker's turns NOT_SERVING only when its
# engine thread has died (it never recovers). Kubernetes' liveness probes ask for it; readiness
# asks for "" (can this server do its work now).
LIVENESS = "pdserve.Liveness"


@dataclass(frozen=True)
class WorkerOptions:
    role: str  # prefill, decode, colocated
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0
    # register with every gateway this names: HOST:PORT[,HOST:PORT...], each HOST re-resolved
    # every heartbeat round (services/registration.py)
    gateway: str | None = None
    transport: str = "ucx"
    advertise: str | None = None  # address registered with the gateway; default host:port
    metrics_port: int = 0  # /metrics over HTTP; 0 picks a port, -1 turns it off
    telemetry: telemetry.TelemetryConfig | None = None
    # unhealthy (NOT_SERVING, deregistered) while the engine is stuck in one step this long
    stall_timeout_s: float = lifecycle.STALL_TIMEOUT_S
    drain_timeout_s: float = lifecycle.DRAIN_TIMEOUT_S  # on SIGTERM: for running requests
    # Mutual TLS: serve Prefill/Decode to holders of a cluster certificate only, and dial the
    # gateway's Registry with ours. A worker's TLS is always mutual.
    tls: tls.TLSConfig | None = None
    cluster_token: str | None = None  # sent with Register/Heartbeat/Deregister

    def __post_init__(self) -> None:
        lifecycle.check(self.drain_timeout_s, self.stall_timeout_s)
        if self.tls is not None and not self.tls.mutual:
            raise ValueError(
                "a worker's TLS is mutual: give --tls-ca as well as --tls-cert and --tls-key"
            )


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


def _ready(
    role: str, address: str, metrics: str, http: str | None = None, registry: str | None = None
) -> None:
    """``READY <role> <host:port> metrics=<host:port>`` (metrics=- when /metrics is off); the
    gateway adds `` http=<host:port>`` (- when its HTTP API is off) and ``registry=<host:port>``,
    where workers register."""
    extra = "" if http is None else f" http={http}"
    extra += f" registry={registry}" if registry else ""
    print(f"READY {role} {address} metrics={metrics}{extra}", flush=True)


def _serve_metrics(metrics, host: str, port: int) -> str:
    return "-" if port < 0 else metrics.serve(host, port)


def advertised_address(host: str, port: int, advertise: str | None) -> str:
    """What the gateway should dial: ``advertise`` (its port defaults to ``port``), else host:port,
    with a wildcard host replaced by this machine's address (a container's IP on its network)."""
    if advertise:
        return advertise if ":" in advertise else f"{advertise}:{port}"
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"


async def _until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def kv_layout(engine: LLMEngine, model_name: str):
    from pdserve.transfer import KVLayout

    cfg = engine.model_config
    return KVLayout(
        model=model_name,
        dtype=engine.dtype,
        block_size=engine.scheduler.block_size,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
    )


def _worker_parts(opts: WorkerOptions):
    """A worker's engine, KV layout, worker and gRPC server, none of them started yet."""
    from pdserve.services.decode.servicer import DecodeServicer
    from pdserve.services.decode.worker import DecodeWorker
    from pdserve.services.prefill.servicer import PrefillServicer
    from pdserve.services.prefill.worker import PrefillWorker

    from pdserve.metrics import WorkerMetrics

    engine = LLMEngine(opts.engine, detokenize=False)
    model_name = resolve_model(opts.engine.model).name
    layout = kv_layout(engine, model_name)
    transport = None
    if opts.role != "colocated":
        from pdserve.transfer import create_transport

        transport = create_transport(opts.transport, layout)
    metrics = WorkerMetrics()
    metrics.watch(
        lambda: engine.stats().num_running,
        lambda: engine.stats().num_waiting,
        lambda: engine.num_free_blocks,
        engine.stats().num_total_blocks,
        opts.engine.scheduler.max_num_seqs,
    )
    if opts.role == "prefill":
        worker = PrefillWorker(engine, transport, metrics)
        server = rpc.Server(["pdserve.v1.Prefill"], errors=STATUS_CODES)
        worker_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(worker), server.server)
    else:
        worker = DecodeWorker(engine, transport, metrics)
        server = rpc.Server(["pdserve.v1.Decode"], errors=STATUS_CODES)
        worker_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(worker), server.server)
    return engine, layout, worker, server


class WorkerServer:
    """A prefill, decode or colocated worker serving in the running event loop: its engine thread,
    KV transport, gRPC server and, with ``opts.gateway``, its registration and heartbeats.

    ``server = await WorkerServer.start(opts)`` returns once it serves (and is registered);
    ``await server.drain(timeout)`` lets its requests finish, ``await server.stop()`` ends it.
    The ``pdserve <role>`` process runs one until signalled; the in-process tests (tests/serve)
    start several in one event loop.
    """

    def __init__(self, opts: WorkerOptions, engine: LLMEngine, worker, server: rpc.Server) -> None:
        self.opts = opts
        self.role = opts.role
        self.engine = engine
        self.worker = worker  # PrefillWorker or DecodeWorker
        self.server = server
        self.worker_id = f"{opts.role}-{uuid.uuid4().hex[:8]}"
        self.port = 0
        self.address = ""  # what the gateway dials (``advertised_address``)
        self.metrics_address = "-"  # /metrics host:port, "-" when off
        # Health and heartbeats (``_watch``): the task ends only when the gateway refuses this
        # worker (RegistrationRefusedError).
        self.registration: asyncio.Task[None] | None = None
        self._registration: Registration | None = None
        self.healthy = False  # what the health service says now
        self.unhealthy_reason = "starting"
        self.draining = False
        self._stopped = False

    @classmethod
    async def start(cls, opts: WorkerOptions) -> WorkerServer:
        """Load the engine, serve, register; RegistrationRefusedError (stopped again) when the
        gateway refuses it. NOT_SERVING until registered."""
        engine, layout, worker, server = _worker_parts(opts)
        served = cls(opts, engine, worker, server)
        try:
            credentials = (
                tls.server_credentials(opts.tls, require_client_cert=True) if opts.tls else None
            )
            served.port = port = server.bind(f"{opts.host}:{opts.port}", credentials)
            served.address = address = advertised_address(opts.host, port, opts.advertise)
            served.metrics_address = _serve_metrics(worker.metrics, opts.host, opts.metrics_port)
            worker.start(asyncio.get_running_loop())
            await server.set_serving(False)
            await server.set_serving(True, [LIVENESS])
            await server.start()
            if opts.gateway:
                served._registration = Registration(
                    opts.gateway,
                    served.worker_id,
                    opts.role,
                    address,
                    layout,
                    opts.tls,
                    opts.cluster_token,
                )
            await served._check()  # registers: started means the gateway routes here now
            served.registration = asyncio.create_task(served._watch())
        except BaseException:
            await served.stop()
            raise
        return served

    def _engine_problem(self) -> str | None:
        loop = self.worker.loop
        if not loop.alive:
            return "engine thread has ended" + (f": {loop.error}" if loop.error else "")
        busy = loop.busy_for()
        if busy > self.opts.stall_timeout_s:
            return f"engine stuck in one step for {busy:.1f} s"
        return None

    async def _check(self) -> None:
        """Health now: on a change, deregister (unhealthy) or register (healthy again), and say so
        on the health service."""
        if self.draining:
            return
        problem = self._engine_problem()
        if not self.worker.loop.alive:  # for good: let the orchestrator restart the process
            await self.server.set_serving(False, [LIVENESS])
        if (problem is None) == self.healthy:
            return
        reg = self._registration
        log = telemetry.logger()
        if problem is not None:
            self.healthy, self.unhealthy_reason = False, problem
            await self.server.set_serving(False)
            log.error("worker.unhealthy", worker_id=self.worker_id, reason=problem)
            if reg is not None:
                await reg.deregister(f"engine unhealthy: {problem}")
            return
        if reg is not None:
            await reg.register()
        self.healthy, self.unhealthy_reason = True, ""
        await self.server.set_serving(True)
        log.info("worker.serving", worker_id=self.worker_id)

    async def _watch(self) -> None:
        """Check health a few times a second; heartbeat at the registration's period while
        healthy (an unhealthy worker sends none: it has deregistered)."""
        tick = min(0.25, self.opts.stall_timeout_s / 4)
        loop = asyncio.get_running_loop()
        reg = self._registration
        next_beat = loop.time() + (reg.period if reg else 0)
        while True:
            await asyncio.sleep(tick)
            try:
                await self._check()
            except (grpc.aio.AioRpcError, NoGatewayError):
                continue  # registering again failed: the gateways are away; try next time
            if reg is not None and self.healthy and loop.time() >= next_beat:
                started = loop.time()  # a slow round (a gateway not answering) takes from the gap
                await reg.heartbeat()
                next_beat = started + reg.period

    async def drain(self, timeout: float) -> bool:
        """Say NOT_SERVING, deregister, refuse new requests (UNAVAILABLE: the gateway tries
        another worker), then wait until the running ones are over or ``timeout`` seconds pass;
        True when they all finished. ``stop()`` afterwards."""
        self.draining, self.healthy, self.unhealthy_reason = True, False, "draining"
        if self.registration is not None:
            self.registration.cancel()
        await self.server.set_serving(False)
        if self._registration is not None:
            await self._registration.deregister("draining")
        gate = self.worker.gate
        gate.close()
        log = telemetry.logger()
        log.info("worker.draining", worker_id=self.worker_id, running=gate.active)
        done = await gate.wait_idle(timeout)
        if not done:
            log.warning("worker.drain_timeout", worker_id=self.worker_id, running=gate.active)
        return done

    async def stop(self, grace: float = 1.0) -> None:
        """Stop heartbeats, stop serving (calls in flight get ``grace`` seconds), stop the engine
        thread, close the transport and /metrics; idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self.healthy = False
        if self.registration is not None:
            self.registration.cancel()
        await self.server.set_serving(False)
        self.worker.gate.close()
        await self.server.stop(grace=grace)
        # Cancelled calls free their blocks in their own `finally`; let them finish before the
        # engine thread and the transport go, so no handler runs against a closed transport.
        await self.worker.gate.wait_idle(grace + 5.0)
        self.worker.stop()
        self.worker.metrics.close()
        if self._registration is not None:
            await self._registration.close()


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
            served.metrics_address = _serve_metrics(gateway.metrics, opts.host, opts.metrics_port)
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
            await server.set_serving(True, [LIVENESS])
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


async def _until_signalled_or(task: asyncio.Task[None] | None) -> None:
    """Until SIGINT/SIGTERM, or until ``task`` ends (its exception propagates)."""
    if task is None:
        await _until_signalled()
        return
    done, _ = await asyncio.wait(
        [task, asyncio.create_task(_until_signalled())], return_when=asyncio.FIRST_COMPLETED
    )
    for t in done:
        t.result()


async def serve_worker(opts: WorkerOptions) -> None:
    """``pdserve prefill|decode|colocated``: serve until signalled (or refused by the gateway)."""
    telemetry.setup(opts.telemetry or telemetry.TelemetryConfig(opts.role))
    try:
        server = await WorkerServer.start(opts)
    except RegistrationRefusedError as e:
        _refused(opts.role, e)
    _ready(opts.role, server.address, server.metrics_address)
    telemetry.logger().info(
        "worker.ready",
        role=opts.role,
        address=server.address,
        metrics=server.metrics_address,
        kv_blocks=server.engine.allocator.num_blocks,
        tracing=telemetry.tracing_enabled(),
    )
    try:
        await _until_signalled_or(server.registration)
        await server.drain(opts.drain_timeout_s)
    except RegistrationRefusedError as e:  # on re-registering, after the gateway forgot us
        _refused(opts.role, e)
    finally:
        await server.stop(grace=1.0)
        telemetry.shutdown()


def _refused(role: str, e: RegistrationRefusedError) -> NoReturn:
    print(f"pdserve {role}: gateway refused registration: {e}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None


async def serve_gateway(opts: GatewayOptions) -> None:
    """``pdserve gateway``: serve until signalled."""
    telemetry.setup(opts.telemetry)
    try:
        server = await GatewayServer.start(opts)
    except KeyFileError as e:
        print(f"pdserve gateway: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, server.reload_keys)
    _ready(
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
        await _until_signalled()
        await server.drain(opts.drain_timeout_s)
    finally:
        await server.stop(grace=1.0)
        telemetry.shutdown()


def run(coro) -> int:
    torch.set_grad_enabled(False)
    try:
        asyncio.run(coro)
    except KeyboardInterrupt:
        pass
    return 0
