"""Argument groups that several serving commands share (``cli.py``): TLS and the cluster token,
the HTTP API's port, routing and placement, streaming, drain, metrics, traces and logs."""

from __future__ import annotations

import argparse

from pdserve.services import lifecycle
from pdserve.services.gateway.config import POLICIES, GatewayConfig
from pdserve.services.gateway.placement import DEEP

from pdserve import envs

# pdserve.transfer.TRANSPORTS, named here without importing the transfer package (torch): the CLI
# builds every command's options, a gateway's too (tests/services/test_cli_defaults.py: equal).
KV_TRANSPORTS = ("ucx", "loopback")


def stream_interval(text: str) -> float | None:
    """``--stream-interval``: milliseconds (>= 0), or auto (None)."""
    if text == "auto":
        return None
    try:
        ms = float(text)
    except ValueError:
        ms = float("nan")
    if not ms >= 0:
        raise argparse.ArgumentTypeError(
            f"--stream-interval is auto or milliseconds >= 0 (0: every token at once), got {text!r}"
        )
    return ms


def stream_interval_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--stream-interval",
        type=stream_interval,
        default=None,
        metavar="MS|auto",
        help="send each request's new tokens at most every MS milliseconds, those produced "
        "meanwhile in one message (the first and the last at once); fewer messages leave more "
        "CPU to the steps when tokens come faster than that. auto (default): 25 when the "
        "engine's threads fill every core the worker may run on (a CPU engine), else 0 (every "
        "token at once)",
    )


def tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", default=None, help="this process's certificate (PEM): serve TLS")
    p.add_argument("--tls-key", default=None, help="its private key (PEM)")
    p.add_argument(
        "--tls-ca",
        default=None,
        help="the cluster CA (PEM): mutual TLS between gateway and workers; only holders of a "
        "certificate it issued can register or serve",
    )
    p.add_argument(
        "--tls-server-name",
        default=None,
        help="the name the cluster peers' certificates carry, checked instead of the host dialed "
        "(e.g. workers that register by IP address)",
    )
    p.add_argument(
        "--cluster-token",
        default=None,
        help=f"the secret workers register with (prefer ${envs.CLUSTER_TOKEN_ENV}: a flag shows "
        "in the process list)",
    )


HTTP_PORT = 8000


def http_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--http-port",
        type=int,
        default=HTTP_PORT,
        help=f"serve the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        f"/v1/models) on this port (default {HTTP_PORT}; 0 picks one, -1 turns it off)",
    )


def policy_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--policy",
        default=GatewayConfig.policy,
        choices=POLICIES,
        help="how the gateway picks workers: cost (the default: by the workers' reported queues, "
        "speeds and prefix caches), least_loaded (this gateway's tokens in flight), round_robin",
    )


def placement_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--decode-prefill-budget",
        type=float,
        default=GatewayConfig.decode_prefill_budget_s,
        metavar="SECONDS",
        help="a decode worker prefills a prompt itself while the prefill worker's queue is longer "
        "and the seconds its own prefills hold its streams back (streams × seconds) fit in this "
        "many per prompt waiting at the prefill worker (0: always disaggregate)",
    )
    p.add_argument(
        "--decode-prefill-max-tokens",
        type=int,
        default=GatewayConfig.decode_prefill_max_tokens,
        metavar="TOKENS",
        help="... but not a prompt longer than this while it runs streams (each would wait "
        "for all of it)",
    )
    p.add_argument(
        "--decode-prefill-share",
        type=float,
        default=GatewayConfig.decode_prefill_share,
        metavar="FRACTION",
        help="... nor, while it runs streams, let such prompts take more than this share of its "
        "time: after one of h seconds it takes the next h / FRACTION seconds later at the "
        f"earliest (1: no limit), unless {DEEP} or more prompts wait at the prefill worker per "
        "stream",
    )
    p.add_argument(
        "--warm-replies",
        action="store_true",
        help="send each finished reply to the prefill worker that computed its prompt, to keep "
        "its KV in that worker's prefix cache: a chat's next turn computes only the new message "
        "(computed in steps no request needs; costs the prefill workers' idle time)",
    )


def drain_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=lifecycle.DRAIN_TIMEOUT_S,
        help="on SIGTERM/SIGINT: stop taking requests, give the running ones this many seconds "
        "to finish, then exit 0",
    )


def observability_args(p: argparse.ArgumentParser, metrics_port: int) -> None:
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
