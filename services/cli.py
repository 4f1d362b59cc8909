"""``pdserve gateway | prefill | decode | colocated | up | health``: the serving commands' arguments.

The processes themselves start in ``main.py``; ``up`` and the READY handshake are ``launcher.py``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pdserve.services import cpus, launcher, lifecycle
from pdserve.services.admin_cli import admin_commands
from pdserve.services.cli_options import (
    KV_TRANSPORTS,
    drain_arg,
    http_arg,
    observability_args,
    placement_arg,
    policy_arg,
    stream_interval_arg,
    tls_args,
)
from pdserve.services.gateway.config import GatewayConfig
from pdserve.services.gateway.registry import ROLES
from pdserve.services.health_cli import cmd_health

from pdserve import envs
from pdserve.config import CacheConfig, EngineConfig, SchedulerConfig


def engine_config(args) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        device=args.device,
        threads=args.threads,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_bytes=args.kv_cache_bytes,
            enable_prefix_caching=args.prefix_caching,
            resident=args.kv_resident,
            kv_cache_dtype=args.kv_cache_dtype,
        ),
        scheduler=SchedulerConfig.from_args(args),
    )


def gateway_config(args) -> GatewayConfig:
    return GatewayConfig(
        policy=args.policy,
        lease_s=args.lease,
        kv_timeout_s=args.kv_timeout,
        max_attempts=args.max_attempts,
        max_resumes=args.max_resumes,
        queue_timeout_s=args.queue_timeout,
        outage_wait_s=args.outage_wait,
        api_keys_file=args.api_keys,
        local_prefill_tokens=args.local_prefill_tokens,
        decode_prefill_budget_s=args.decode_prefill_budget,
        decode_prefill_max_tokens=args.decode_prefill_max_tokens,
        decode_prefill_share=args.decode_prefill_share,
        probe_interval_s=args.probe_interval,
        real_probe_interval_s=args.real_probe_interval,
        suspect_after_s=args.suspect_after,
        probe_timeout_s=args.probe_timeout,
        real_probe_timeout_s=args.real_probe_timeout,
        engine_timeout_s=args.engine_timeout,
        stuck_step_floor_s=args.stuck_step_floor,
        stuck_step_factor=args.stuck_step_factor,
        affinity_slack_s=args.affinity_slack,
        warm_replies=args.warm_replies,
    )


def telemetry_config(args, service: str):
    from pdserve.telemetry import TelemetryConfig

    return TelemetryConfig(
        service,
        otlp_endpoint=args.otlp_endpoint,
        log_format=args.log_format,
        log_prompts=args.log_prompts,
    )


def tls_config(args):
    """The process's TLSConfig from --tls-*; None without --tls-cert."""
    from pdserve.tls import TLSConfig

    if not (args.tls_cert or args.tls_key or args.tls_ca):
        return None
    return TLSConfig(
        cert=args.tls_cert,
        key=args.tls_key,
        ca=args.tls_ca,
        server_name=getattr(args, "tls_server_name", None),
    )


def cluster_token(args) -> str | None:
    return args.cluster_token or envs.cluster_token()


def worker_options(args):
    """The WorkerOptions of a worker command's parsed ``args``."""
    from pdserve.services.main import WorkerOptions

    stream_ms = getattr(args, "stream_interval", 0.0)  # decode, colocated; a prefill worker's: 0
    return WorkerOptions(
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
        tls=tls_config(args),
        cluster_token=cluster_token(args),
        roofline=args.roofline,
        borrow_cpus=getattr(args, "borrow_cpus", frozenset()),  # prefill and decode only
        stream_interval_s=None if stream_ms is None else stream_ms / 1000,  # None: auto
    )


def cmd_worker(args) -> int:
    from pdserve.services.main import serve_worker
    from pdserve.services.process import run

    cpus.pin(args.cpus, getattr(args, "borrow_cpus", frozenset()), args.threads)
    if args.cpus and args.threads is None:  # one thread per core it is pinned to
        args.threads = len(args.cpus)
    return run(serve_worker(worker_options(args)))


def cmd_gateway(args) -> int:
    from pdserve.services.gateway.server import GatewayOptions, serve_gateway
    from pdserve.services.process import run

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
                tls=tls_config(args),
                registry_port=args.registry_port,
                cluster_token=cluster_token(args),
            )
        )
    )


def add_commands(sub, engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    from pdserve.model.fetch import DEFAULT_MODEL

    gw = sub.add_parser("gateway", help="serve the public gRPC API; workers register here")
    gw.add_argument("--model", default=DEFAULT_MODEL)
    gw.add_argument("--host", default="127.0.0.1")
    gw.add_argument("--port", type=int, default=50051)
    http_arg(gw)
    policy_arg(gw)
    gw.add_argument(
        "--affinity-slack",
        type=float,
        default=GatewayConfig.affinity_slack_s,
        help="policy cost: seconds a request's affinity-key worker may be slower than the cheapest",
    )
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
        help="seconds a KV transfer may take beyond twice the wait expected at its prefill "
        "worker (queue and compute); a decode worker holds the blocks that long",
    )
    gw.add_argument(
        "--max-attempts",
        type=int,
        default=GatewayConfig.max_attempts,
        help="worker pairs a request tries before its first token",
    )
    gw.add_argument(
        "--max-resumes",
        type=int,
        default=GatewayConfig.max_resumes,
        help="times a request whose worker fails after tokens were streamed is continued on "
        "another worker",
    )
    gw.add_argument(
        "--outage-wait",
        type=float,
        default=GatewayConfig.outage_wait_s,
        help="seconds a request waits for a worker to come back when none is left to try "
        "(restarting workers), if the cluster could serve within that long; 0: never waits",
    )
    gw.add_argument(
        "--local-prefill-tokens",
        type=int,
        default=GatewayConfig.local_prefill_tokens,
        help="prompts this short are prefilled by their decode worker, not shipped from a prefill "
        "worker",
    )
    placement_arg(gw)
    gw.add_argument(
        "--queue-timeout",
        type=float,
        default=GatewayConfig.queue_timeout_s,
        help="seconds a request without a deadline waits while every decode worker is full",
    )
    hang = gw.add_argument_group(
        "hang detection", "evict a worker that stops progressing (services/gateway/watchdog.py)"
    )
    hang.add_argument(
        "--probe-interval",
        type=float,
        default=GatewayConfig.probe_interval_s,
        help="seconds between fast probes (Stats) of each worker (0: no hang detection)",
    )
    hang.add_argument(
        "--real-probe-interval",
        type=float,
        default=GatewayConfig.real_probe_interval_s,
        help="seconds between real probes (a 1-token generation) of each decode/colocated worker",
    )
    hang.add_argument(
        "--suspect-after",
        type=float,
        default=GatewayConfig.suspect_after_s,
        help="seconds without a message from a worker running requests before it is probed",
    )
    hang.add_argument(
        "--probe-timeout",
        type=float,
        default=GatewayConfig.probe_timeout_s,
        help="seconds the fast probe (Stats) may take",
    )
    hang.add_argument(
        "--real-probe-timeout",
        type=float,
        default=GatewayConfig.real_probe_timeout_s,
        help="seconds the real probe may take after a failed fast probe",
    )
    hang.add_argument(
        "--engine-timeout",
        type=float,
        default=GatewayConfig.engine_timeout_s,
        help="seconds the real probe may take on a worker that answers Stats (longer than two "
        "chunked-prefill steps)",
    )
    hang.add_argument(
        "--stuck-step-floor",
        type=float,
        default=GatewayConfig.stuck_step_floor_s,
        help="a worker whose Stats answer but whose engine step has run longer than this and "
        "--stuck-step-factor x the step's predicted time is evicted (engine stuck)",
    )
    hang.add_argument(
        "--stuck-step-factor",
        type=float,
        default=GatewayConfig.stuck_step_factor,
        help="multiple of a step's predicted time (learned by the worker from its own recent "
        "steps) that the step may run before its engine counts as stuck (>= 1)",
    )
    gw.add_argument(
        "--api-keys",
        default=GatewayConfig.api_keys_file,
        metavar="FILE",
        help="hashed API keys and their limits (pdserve keys add), re-read on SIGHUP "
        "(default: $PDSERVE_API_KEYS, else none: the gateway is open to anyone)",
    )
    drain_arg(gw)
    gw.add_argument(
        "--registry-port",
        type=int,
        default=None,
        help="serve the worker Registry on this port of its own (0 picks one; with --tls-ca it "
        "requires client certificates); default: on --port",
    )
    tls_args(gw)
    observability_args(gw, metrics_port=0)
    gw.set_defaults(func=cmd_gateway)
    admin_commands(sub)
    for role in ROLES:
        w = sub.add_parser(role, help=f"serve a {role} worker")
        engine_args(w)
        w.add_argument("--host", default="127.0.0.1")
        w.add_argument("--port", type=int, default=0, help="0 picks a free port")
        w.add_argument(
            "--gateway",
            default=None,
            metavar="HOST:PORT[,HOST:PORT...]",
            help="register with every gateway these name; a HOST that resolves to several "
            "addresses (a headless Kubernetes Service) means each of them, resolved again on "
            "every heartbeat round",
        )
        w.add_argument(
            "--transport", default="ucx", choices=KV_TRANSPORTS, help="KV transport (default: ucx)"
        )
        cpus.add_args(w, role)
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
        w.add_argument(
            "--no-roofline",
            dest="roofline",
            action="store_false",
            help="skip measuring memory bandwidth and GEMM rate at start (~0.5 s); then no "
            "pdserve_step_roofline_fraction",
        )
        if role != "prefill":
            stream_interval_arg(w)
        drain_arg(w)
        tls_args(w)
        observability_args(w, metrics_port=0)
        w.set_defaults(func=cmd_worker)
    up = sub.add_parser("up", help="gateway + workers as local processes on loopback")
    engine_args(up)
    stream_interval_arg(up)
    up.add_argument("--port", type=int, default=50051)
    http_arg(up)
    placement_arg(up)
    policy_arg(up)
    up.add_argument(
        "--api-keys",
        default=None,
        metavar="FILE",
        help="the gateway's API key file (pdserve keys add); default: $PDSERVE_API_KEYS, else "
        "none (open to anyone)",
    )
    up.add_argument("--prefill", type=int, default=1)
    up.add_argument("--decode", type=int, default=1)
    up.add_argument("--colocated", type=int, default=0)
    up.add_argument(
        "--threads-per-worker",
        type=int,
        default=None,
        help="torch threads of each worker (default 1); --threads means the same here",
    )
    up.add_argument(
        "--no-pin", dest="pin", action="store_false", help="do not pin workers to cores"
    )
    up.add_argument(
        "--no-borrow",
        dest="borrow",
        action="store_false",
        help="keep the decode worker's steps on its own core while the prefill worker's is idle "
        "(by default, with one of each pinned, they use both)",
    )
    drain_arg(up)
    up.add_argument(
        "--tls",
        action="store_true",
        help="make a throwaway CA and certificates (in a temporary folder, removed on exit): TLS "
        "on the public port, mutual TLS between the processes",
    )
    observability_args(up, metrics_port=0)
    up.set_defaults(func=launcher.cmd_up)
    h = sub.add_parser("health", help="exit 0 iff a pdserve server answers SERVING (gRPC health)")
    h.add_argument("address", help="host:port")
    h.add_argument("--service", default="", help="a service name; default: the server as a whole")
    h.add_argument("--timeout", type=float, default=3.0)
    for flag, what in (("--tls-ca", "the cluster CA"), ("--tls-cert", "our certificate")):
        h.add_argument(flag, default=None, help=f"{what} (PEM): check a mutual-TLS port")
    h.add_argument("--tls-key", default=None, help="our private key (PEM)")
    h.add_argument("--tls-server-name", default=None, help="the name the server's cert carries")
    h.set_defaults(func=cmd_health)
