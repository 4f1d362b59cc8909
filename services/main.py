"""Workers' servers and processes: ``pdserve prefill | decode | colocated``.

``WorkerServer`` starts in the running event loop and stops on request (the gateway's is
``gateway/server.py``); the in-process tests (tests/serve) run a whole cluster of them in one
loop. ``serve_worker`` is the process: it starts one, prints one line ``READY <role> <host:port>``
on stdout once it serves (``pdserve up`` and the end-to-end tests wait for it), and on
SIGINT/SIGTERM drains it (``drain``: new requests UNAVAILABLE, running ones finish, within
``--drain-timeout``), stops it and exits 0.

Health (gRPC health, "" and per service) says what the server can do: a worker is SERVING only
while it is registered (when it has a gateway), not draining and its engine thread alive and not
stuck in one command or step for longer than ``stall_timeout_s``; a worker that turns unhealthy
deregisters (the gateway stops routing to it) and registers again if it recovers. The gateway's
health is described in ``gateway/server.py``.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import uuid
from dataclasses import dataclass
from typing import NoReturn

import grpc
from pdserve.services import lifecycle, process
from pdserve.services.errors import STATUS_CODES
from pdserve.services.registration import (
    NoGatewayError,
    Registration,
    RegistrationRefusedError,
)
from pdserve.services.stats import heartbeat_stats

from pdserve import rpc, telemetry, tls
from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine
from pdserve.model.fetch import resolve_model
from pdserve.v1 import worker_pb2_grpc


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
    # measure memory bandwidth and GEMM rate at start (~0.5 s) and export each step's fraction
    # of the roofline (pdserve/roofline.py); off (--no-roofline) for fast test clusters
    roofline: bool = True
    # prefill and decode workers: the cores of the other role's worker beside it, whose time its
    # engine's steps also take while that one is idle (pdserve/engine_loop.py EngineLoop._borrow)
    borrow_cpus: frozenset[int] = frozenset()
    # decode and colocated workers: a request's tokens go to the gateway at most this often,
    # those produced between in one message (pdserve/engine_loop.py EngineLoop._coalesce);
    # None: auto (engine_loop.auto_stream_interval)
    stream_interval_s: float | None = None

    def __post_init__(self) -> None:
        lifecycle.check(self.drain_timeout_s, self.stall_timeout_s)
        if self.stream_interval_s is not None and not self.stream_interval_s >= 0:
            raise ValueError(
                f"--stream-interval must be >= 0 ms, got {self.stream_interval_s * 1000:g}"
            )
        if self.borrow_cpus and self.role == "colocated":
            raise ValueError(
                "a colocated worker borrows no cores (--borrow-cpus): give it --threads"
            )
        if self.tls is not None and not self.tls.mutual:
            raise ValueError(
                "a worker's TLS is mutual: give --tls-ca as well as --tls-cert and --tls-key"
            )


def advertised_address(host: str, port: int, advertise: str | None) -> str:
    """What the gateway should dial: ``advertise`` (its port defaults to ``port``), else host:port,
    with a wildcard host replaced by this machine's address (a container's IP on its network)."""
    if advertise:
        return advertise if ":" in advertise else f"{advertise}:{port}"
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"


def kv_layout(engine: LLMEngine, model_name: str):
    from pdserve.transfer import KVLayout

    cfg = engine.model_config
    return KVLayout(
        model=model_name,
        dtype=engine.runner.pool.dtype,  # the KV cache's (--kv-cache-dtype), not the model's
        block_size=engine.scheduler.block_size,
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
    )


def _transport_options(opts: WorkerOptions) -> dict[str, object]:
    """UCX: message buffers on the engine's device, where its KV pools are (CUDA pools go over
    UCX as CUDA memory, never staged through the host); a decode worker listens for its senders'
    liveness connections (transfer/liveness.py) on the gRPC host, at an ephemeral port, and
    publishes the advertised host; a prefill worker receives nothing and listens for nothing."""
    if opts.transport != "ucx":
        return {}
    device = opts.engine.device
    if opts.role != "decode":
        return {"device": device, "liveness_host": None}
    host = advertised_address(opts.host, 0, opts.advertise).rsplit(":", 1)[0].strip("[]")
    return {"device": device, "liveness_host": opts.host, "liveness_advertise": host}


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

        transport = create_transport(opts.transport, layout, **_transport_options(opts))
    metrics = WorkerMetrics()
    if opts.roofline:
        metrics.watch_roofline(_measure_roofline(engine, opts.role))
    metrics.watch(
        lambda: engine.stats().num_running,
        lambda: engine.stats().num_waiting,
        lambda: engine.num_free_blocks,
        engine.stats().num_total_blocks,
        opts.engine.scheduler.max_num_seqs,
    )
    if opts.role == "prefill":
        worker = PrefillWorker(engine, transport, metrics, opts.borrow_cpus)
        server = rpc.Server(["pdserve.v1.Prefill"], errors=STATUS_CODES)
        worker_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(worker), server.server)
    else:
        worker = DecodeWorker(engine, transport, metrics, opts.borrow_cpus, opts.stream_interval_s)
        server = rpc.Server(["pdserve.v1.Decode"], errors=STATUS_CODES)
        worker_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(worker), server.server)
    return engine, layout, worker, server


def _measure_roofline(engine: LLMEngine, role: str):
    """The engine's roofline on this machine, measured now (with the engine's threads), logged."""
    import torch

    from pdserve import roofline

    rates = roofline.measure_engine(engine)
    telemetry.logger().info(
        "roofline.measured",
        role=role,
        threads=torch.get_num_threads(),
        bandwidth_gb_s=round(rates.bandwidth / 1e9, 2),
        gemm_gflop_s=round(rates.gemm_flops / 1e9, 1),
        gemm_gflop_s_by_kernel={k: round(v / 1e9, 1) for k, v in rates.gemm_rates.items()},
        buffer_mib=rates.buffer_bytes >> 20,
        seconds=round(rates.seconds, 3),
    )
    return roofline.for_engine(engine, rates)


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
            served.metrics_address = process.serve_metrics(
                worker.metrics, opts.host, opts.metrics_port
            )
            worker.start(asyncio.get_running_loop())
            await server.set_serving(False)
            await server.set_serving(True, [process.LIVENESS])
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
                    stats=lambda: heartbeat_stats(worker.loop),
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
            await self.server.set_serving(False, [process.LIVENESS])
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


async def serve_worker(opts: WorkerOptions) -> None:
    """``pdserve prefill|decode|colocated``: serve until signalled (or refused by the gateway)."""
    telemetry.setup(opts.telemetry or telemetry.TelemetryConfig(opts.role))
    try:
        server = await WorkerServer.start(opts)
    except RegistrationRefusedError as e:
        _refused(opts.role, e)
    process.ready(opts.role, server.address, server.metrics_address)
    telemetry.logger().info(
        "worker.ready",
        role=opts.role,
        address=server.address,
        metrics=server.metrics_address,
        kv_blocks=server.engine.allocator.num_blocks,
        kv_dtype=str(server.engine.kv_dtype).removeprefix("torch."),
        tracing=telemetry.tracing_enabled(),
    )
    try:
        await process.until_signalled_or(server.registration)
        await server.drain(opts.drain_timeout_s)
    except RegistrationRefusedError as e:  # on re-registering, after the gateway forgot us
        _refused(opts.role, e)
    finally:
        await server.stop(grace=1.0)
        telemetry.shutdown()


def _refused(role: str, e: RegistrationRefusedError) -> NoReturn:
    print(f"pdserve {role}: gateway refused registration: {e}", file=sys.stderr, flush=True)
    raise SystemExit(2) from None
