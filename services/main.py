"""Process entry points: ``pdserve gateway | prefill | decode | colocated``.

Each prints one line ``READY <role> <host:port>`` on stdout once it serves (``pdserve up`` and the
end-to-end tests wait for it), and stops cleanly on SIGINT/SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import uuid
from dataclasses import dataclass, field

import grpc
import torch
from pdserve.services.errors import STATUS_CODES
from pdserve.services.gateway.config import GatewayConfig

from pdserve import rpc, telemetry
from pdserve.config import EngineConfig
from pdserve.engine import LLMEngine
from pdserve.model.config import ModelConfig
from pdserve.model.fetch import resolve_model
from pdserve.tokenizer import Tokenizer
from pdserve.v1 import common_pb2, generation_pb2, worker_pb2, worker_pb2_grpc
from pdserve.v1 import generation_pb2_grpc as gen_grpc


@dataclass(frozen=True)
class WorkerOptions:
    role: str  # prefill, decode, colocated
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0
    gateway: str | None = None  # register with this gateway
    transport: str = "ucx"
    advertise: str | None = None  # address registered with the gateway; default host:port
    metrics_port: int = 0  # /metrics over HTTP; 0 picks a port, -1 turns it off
    telemetry: telemetry.TelemetryConfig | None = None


@dataclass(frozen=True)
class GatewayOptions:
    model: str
    host: str = "127.0.0.1"
    port: int = 0
    config: GatewayConfig = field(default_factory=GatewayConfig)
    max_model_len: int | None = None
    metrics_port: int = 0
    telemetry: telemetry.TelemetryConfig = field(
        default_factory=lambda: telemetry.TelemetryConfig("gateway")
    )


def _ready(role: str, address: str, metrics: str) -> None:
    """``READY <role> <host:port> metrics=<host:port>`` (metrics=- when /metrics is off)."""
    print(f"READY {role} {address} metrics={metrics}", flush=True)


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


class Registration:
    """Register with the gateway, then heartbeat at a third of the lease; re-register when the
    gateway forgot this worker (its lease ran out, or the gateway restarted)."""

    def __init__(self, gateway: str, worker_id: str, role: str, address: str, layout) -> None:
        self.stub = worker_pb2_grpc.RegistryStub(rpc.channel(gateway))
        self.request = worker_pb2.RegisterRequest(
            worker_id=worker_id,
            role=role,
            address=address,
            layout=common_pb2.KVLayout(model=layout.model, compat_hash=layout.compat_hash),
        )
        self.period = 1.0

    async def register(self) -> None:
        """Raises SystemExit with the gateway's reason when it refuses this worker."""
        try:
            resp = await self.stub.Register(self.request, timeout=10)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                print(
                    f"pdserve {self.request.role}: gateway refused registration: {e.details()}",
                    file=sys.stderr,
                    flush=True,
                )
                raise SystemExit(2) from None
            raise
        self.period = max(resp.lease_ms / 3000, 0.1)

    async def heartbeat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.period)
            try:
                hb = worker_pb2.HeartbeatRequest(worker_id=self.request.worker_id)
                if not (await self.stub.Heartbeat(hb, timeout=5)).known:
                    await self.register()
            except grpc.aio.AioRpcError:
                continue  # the gateway is away; keep trying


async def serve_worker(opts: WorkerOptions) -> None:
    from pdserve.services.decode.servicer import DecodeServicer
    from pdserve.services.decode.worker import DecodeWorker
    from pdserve.services.prefill.servicer import PrefillServicer
    from pdserve.services.prefill.worker import PrefillWorker

    from pdserve.metrics import WorkerMetrics

    telemetry.setup(opts.telemetry or telemetry.TelemetryConfig(opts.role))
    log = telemetry.logger()
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
    )
    if opts.role == "prefill":
        worker = PrefillWorker(engine, transport, metrics)
        server = rpc.Server(["pdserve.v1.Prefill"], errors=STATUS_CODES)
        worker_pb2_grpc.add_PrefillServicer_to_server(PrefillServicer(worker), server.server)
    else:
        worker = DecodeWorker(engine, transport, metrics)
        server = rpc.Server(["pdserve.v1.Decode"], errors=STATUS_CODES)
        worker_pb2_grpc.add_DecodeServicer_to_server(DecodeServicer(worker), server.server)
    port = server.bind(f"{opts.host}:{opts.port}")
    address = advertised_address(opts.host, port, opts.advertise)
    metrics_address = _serve_metrics(metrics, opts.host, opts.metrics_port)
    worker.start(asyncio.get_running_loop())
    await server.start()
    await server.set_serving(True)
    registration = None
    if opts.gateway:
        reg = Registration(
            opts.gateway, f"{opts.role}-{uuid.uuid4().hex[:8]}", opts.role, address, layout
        )
        await reg.register()  # READY means: registered, the gateway routes here from now on
        registration = asyncio.create_task(reg.heartbeat_forever())
    _ready(opts.role, address, metrics_address)
    log.info(
        "worker.ready",
        role=opts.role,
        address=address,
        metrics=metrics_address,
        kv_blocks=engine.allocator.num_blocks,
        tracing=telemetry.tracing_enabled(),
    )
    try:
        if registration is not None:
            done, _ = await asyncio.wait(
                [registration, asyncio.create_task(_until_signalled())],
                return_when=asyncio.FIRST_COMPLETED,
            )
            for t in done:
                t.result()
        else:
            await _until_signalled()
    finally:
        if registration is not None:
            registration.cancel()
        await server.set_serving(False)
        await server.stop(grace=1.0)
        worker.stop()
        telemetry.shutdown()


async def serve_gateway(opts: GatewayOptions) -> None:
    from pdserve.services.gateway.gateway import Gateway
    from pdserve.services.gateway.servicer import GenerationServicer, RegistryServicer

    telemetry.setup(opts.telemetry)
    folder = resolve_model(opts.model)
    cfg = ModelConfig.from_file(folder / "config.json")
    max_len = min(opts.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    gateway = Gateway(
        Tokenizer.from_folder(folder), max_len, cfg.vocab_size, folder.name, opts.config
    )
    registry = gateway.registry
    server = rpc.Server(
        [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name, "pdserve.v1.Registry"],
        errors=STATUS_CODES,
    )
    gen_grpc.add_GenerationServicer_to_server(GenerationServicer(gateway), server.server)
    worker_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(registry), server.server)
    port = server.bind(f"{opts.host}:{opts.port}")
    metrics_address = _serve_metrics(gateway.metrics, opts.host, opts.metrics_port)
    await server.start()
    await server.set_serving(True)
    _ready("gateway", f"{opts.host}:{port}", metrics_address)
    telemetry.logger().info(
        "gateway.ready",
        address=f"{opts.host}:{port}",
        metrics=metrics_address,
        policy=opts.config.policy,
        tracing=telemetry.tracing_enabled(),
    )
    try:
        await _until_signalled()
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
