"""``pdserve gateway | prefill | decode | colocated | up | health``: the serving commands' arguments.

The processes themselves start in ``main.py``; ``up`` and the READY handshake are ``launcher.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from pdserve.services import launcher, lifecycle
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.registry import ROLES

from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.transfer import TRANSPORTS


def engine_config(args) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        threads=args.threads,
        cache=CacheConfig(block_size=args.block_size, kv_cache_bytes=args.kv_cache_bytes),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens
        ),
    )


def gateway_config(args) -> GatewayConfig:
    return GatewayConfig(
        policy=args.policy,
        lease_s=args.lease,
        kv_timeout_s=args.kv_timeout,
        max_attempts=args.max_attempts,
        queue_timeout_s=args.queue_timeout,
        api_keys_file=args.api_keys,
    )


def telemetry_config(args, service: str):
    from pdserve.telemetry import TelemetryConfig

    return TelemetryConfig(
        service,
        otlp_endpoint=args.otlp_endpoint,
        log_format=args.log_format,
        log_prompts=args.log_prompts,
    )


def cmd_worker(args) -> int:
    from pdserve.services.main import WorkerOptions, run, serve_worker

    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    return run(
        serve_worker(
            WorkerOptions(
                role=args.command,
                engine=engine_config(args),
                host=args.host,
                port=args.port,
                gateway=args.gateway,
                transport=args.transport,
                advertise=args.advertise,
                metrics_port=args.metrics_port,
                telemetry=telemetry_config(args, args.command),
                stall_timeout_s=args.stall_timeout,
                drain_timeout_s=args.drain_timeout,
            )
        )
    )


def cmd_gateway(args) -> int:
    from pdserve.services.main import GatewayOptions, run, serve_gateway

    return run(
        serve_gateway(
            GatewayOptions(
                model=args.model,
                host=args.host,
                port=args.port,
                config=gateway_config(args),
                metrics_port=args.metrics_port,
                http_port=args.http_port,
                telemetry=telemetry_config(args, "gateway"),
                drain_timeout_s=args.drain_timeout,
            )
        )
    )


def cmd_health(args) -> int:
    """Exit 0 iff the server at ``args.address`` says SERVING (a container health check)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(args.address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
    except grpc.RpcError as e:
        print(f"pdserve health: {args.address}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{args.address}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def add_commands(sub, engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    from pdserve.model.fetch import DEFAULT_MODEL

    gw = sub.add_parser("gateway", help="serve the public gRPC API; workers register here")
    gw.add_argument("--model", default=DEFAULT_MODEL)
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=50051)
    _http_arg(gw)
    gw.add_argument("--policy", default=GatewayConfig.policy, help="round_robin or least_loaded")
    gw.add_argument(
        "--lease",
        type=float,
        default=GatewayConfig.lease_s,
        help="seconds a worker stays listed without heartbeat",
    )
    gw.add_argument(
        "--kv-timeout",
        type=float,
        default=GatewayConfig.kv_timeout_s,
        help="seconds a KV transfer may take",
    )
    gw.add_argument(
        "--max-attempts",
        type=int,
        default=GatewayConfig.max_attempts,
        help="worker pairs a request tries before its first token",
    )
    gw.add_argument(
        "--queue-timeout",
        type=float,
        default=GatewayConfig.queue_timeout_s,
        help="seconds a request without a deadline waits while every decode worker is full",
    )
    gw.add_argument(
        "--api-keys",
        default=GatewayConfig.api_keys_file,
        metavar="FILE",
        help="hashed API keys and their limits (pdserve keys add), re-read on SIGHUP "
        "(default: $PDSERVE_API_KEYS, else none: the gateway is open to anyone)",
    )
    _drain_arg(gw)
    _observability_args(gw, metrics_port=0)
    gw.set_defaults(func=cmd_gateway)
    _keys_commands(sub)
    for role in ROLES:
        w = sub.add_parser(role, help=f"serve a {role} worker")
        engine_args(w)
        w.add_argument("--host", default="127.0.0.1")
        w.add_argument("--port", type=int, default=0, help="0 picks a free port")
        w.add_argument("--gateway", default=None, help="register with this gateway (host:port)")
        w.add_argument(
            "--transport", default="ucx", choices=TRANSPORTS, help="KV transport (default: ucx)"
        )
        w.add_argument("--cpus", default="", help="pin to these cores, e.g. 0 or 0,1")
        w.add_argument(
            "--advertise",
            default=None,
            metavar="HOST[:PORT]",
            help="address the gateway dials (default host:port; with --host 0.0.0.0, this "
            "machine's IP)",
        )
        w.add_argument(
            "--stall-timeout",
            type=float,
            default=lifecycle.STALL_TIMEOUT_S,
            help="seconds one engine step may take before the worker says NOT_SERVING and "
            "deregisters (until the step ends)",
        )
        _drain_arg(w)
        _observability_args(w, metrics_port=0)
        w.set_defaults(func=cmd_worker)
    up = sub.add_parser("up", help="gateway + workers as local processes on loopback")
    engine_args(up)
    up.add_argument("--port", type=int, default=50051)
    _http_arg(up)
    up.add_argument("--prefill", type=int, default=1)
    up.add_argument("--decode", type=int, default=1)
    up.add_argument("--colocated", type=int, default=0)
    up.add_argument("--threads-per-worker", type=int, default=1)
    up.add_argument(
        "--no-pin", dest="pin", action="store_false", help="do not pin workers to cores"
    )
    _drain_arg(up)
    _observability_args(up, metrics_port=0)
    up.set_defaults(func=launcher.cmd_up)
    h = sub.add_parser("health", help="exit 0 iff a pdserve server answers SERVING (gRPC health)")
    h.add_argument("address", help="host:port")
    h.add_argument("--service", default="", help="a service name; default: the server as a whole")
    h.add_argument("--timeout", type=float, default=3.0)
    h.set_defaults(func=cmd_health)


def cmd_keys(args) -> int:
    """``pdserve keys add|remove``: edit a key file; ``add`` prints the new key, once."""
    from pathlib import Path

    from pdserve.services.gateway.auth import KeyLimits, add_key, remove_key

    path = Path(args.file)
    try:
        if args.keys_command == "add":
            limits = KeyLimits(rpm=args.rpm, tpm=args.tpm, concurrency=args.concurrency)
            print(add_key(path, args.id, limits))
            print(
                f"added key {args.id!r} to {path}; the key above is not stored anywhere, keep it "
                "(a running gateway reads the file again on SIGHUP)",
                file=sys.stderr,
            )
        else:
            remove_key(path, args.id)
            print(f"removed key {args.id!r} from {path}", file=sys.stderr)
    except ValueError as e:
        print(f"pdserve keys: {e}", file=sys.stderr)
        return 2
    return 0


def _keys_commands(sub) -> None:
    k = sub.add_parser("keys", help="manage the gateway's API key file")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    add = ksub.add_parser("add", help="add a key and print it (once); the file keeps its hash")
    rm = ksub.add_parser("remove", help="remove a key by id")
    for p in (add, rm):
        p.add_argument("--file", required=True, help="the key file (created by add if missing)")
        p.add_argument("--id", required=True, help="the key's name in logs and metrics")
    add.add_argument(
        "--rpm", type=int, default=None, help="requests per minute (default: no limit)"
    )
    add.add_argument(
        "--tpm",
        type=int,
        default=None,
        help="tokens per minute, prompt + max_tokens reserved at admission (default: no limit)",
    )
    add.add_argument(
        "--concurrency", type=int, default=None, help="requests at once (default: no limit)"
    )
    k.set_defaults(func=cmd_keys)


HTTP_PORT = 8000


def _http_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--http-port",
        type=int,
        default=HTTP_PORT,
        help=f"serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        f"/v1/models) on this port (default {HTTP_PORT}; 0 picks one, -1 turns it off)",
    )


def _drain_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=lifecycle.DRAIN_TIMEOUT_S,
        help="on SIGTERM/SIGINT: stop taking requests, give the running ones this many seconds "
        "to finish, then exit 0",
    )


def _observability_args(p: argparse.ArgumentParser, metrics_port: int) -> None:
    from pdserve.telemetry import LOG_FORMATS, TelemetryConfig

    p.add_argument(
        "--metrics-port",
        type=int,
        default=metrics_port,
        help="serve Prometheus /metrics over HTTP on this port (0 picks one, -1 turns it off)",
    )
    p.add_argument(
        "--otlp-endpoint",
        default=TelemetryConfig.otlp_endpoint,
        help="export traces over OTLP/gRPC here, e.g. http://localhost:4317 "
        "(default: $OTEL_EXPORTER_OTLP_ENDPOINT; unset: tracing off)",
    )
    p.add_argument(
        "--log-format",
        default=TelemetryConfig.log_format,
        choices=LOG_FORMATS,
        help="auto: readable in a terminal, JSON lines otherwise",
    )
    p.add_argument(
        "--log-prompts",
        action="store_true",
        help="let logs contain prompts and outputs (off by default)",
    )
