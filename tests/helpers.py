"""Checks shared by the in-process tier (tests/serve) and the real-process tier (tests/e2e)."""

from __future__ import annotations

import itertools
import time
import urllib.request
from collections.abc import Callable, Mapping
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(address: str, service: str = "", timeout: float = 5.0) -> int:
    """A server's gRPC health status (SERVING, NOT_SERVING) for ``service`` ("": as a whole)."""
    with grpc.insecure_channel(address) as ch:
        req = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(ch).Check(req, timeout=timeout).status


def worker_stats(
    address: str,
    role: str,
    timeout: float = 5.0,
    credentials: grpc.ChannelCredentials | None = None,
) -> worker_pb2.WorkerStats:
    """A worker's Stats RPC (blocking: call it from a thread that is not the servers' loop);
    ``credentials``: a cluster certificate, for a worker that serves mutual TLS."""
    channel = (
        grpc.insecure_channel(address)
        if credentials is None
        else grpc.secure_channel(address, credentials)
    )
    with channel as ch:
        stub = (
            worker_pb2_grpc.PrefillStub(ch) if role == "prefill" else worker_pb2_grpc.DecodeStub(ch)
        )
        return stub.Stats(worker_pb2.StatsRequest(), timeout=timeout)


def _leaks(s: worker_pb2.WorkerStats) -> bool:
    return (
        s.num_free_blocks != s.num_total_blocks
        or s.num_running
        or s.num_waiting
        or s.outstanding_tokens
    )


def assert_no_leaks(
    workers: Mapping[str, tuple[str, str]],
    timeout: float = 5.0,
    credentials: grpc.ChannelCredentials | None = None,
) -> dict[str, worker_pb2.WorkerStats]:
    """Every worker (name -> (address, role)) says over its Stats RPC that all its KV blocks are
    free and nothing runs or waits there. Polled until ``timeout``: a finished or cancelled
    request's blocks are freed asynchronously (after its transfer settles). Returns the stats."""
    assert workers, "no worker to check"
    deadline = time.monotonic() + timeout
    while True:
        stats = {
            name: worker_stats(address, role, credentials=credentials)
            for name, (address, role) in workers.items()
        }
        leaking = {name: s for name, s in stats.items() if _leaks(s)}
        if not leaking:
            return stats
        if time.monotonic() > deadline:
            detail = "; ".join(
                f"{name}: {s.num_free_blocks}/{s.num_total_blocks} blocks free, "
                f"{s.num_running} running, {s.num_waiting} waiting, "
                f"{s.outstanding_tokens} outstanding tokens"
                for name, s in leaking.items()
            )
            raise AssertionError(f"leaked after {timeout:g} s: {detail}")
        time.sleep(0.02)


def wait_until(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


_holds = itertools.count()


@contextmanager
def seat_held(address: str):
    """Take a decode worker's seat as the gateway would (admitted, blocks reserved) and keep it,
    its KV never sent, until the block ends: then the call is cancelled and the worker frees it."""
    with grpc.insecure_channel(address) as ch:
        call = worker_pb2_grpc.DecodeStub(ch).Generate(
            worker_pb2.DecodeRequest(
                request_id=f"hold-{next(_holds)}",
                prompt_token_ids=[1, 2, 3],
                sampling=common_pb2.SamplingParams(max_tokens=4),
                kv_timeout_ms=60_000,
            ),
            timeout=60,
        )
        try:
            assert next(call).HasField("admitted")
            yield call
        finally:
            call.cancel()


def scrape_metrics(address: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics page at host:port: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric_value(address: str, name: str, **labels: str) -> float:
    """One sample of the /metrics page at host:port (0 when absent)."""
    return scrape_metrics(address).get((name, tuple(sorted(labels.items()))), 0.0)


def process_alive(pid: int) -> bool:
    """The process exists and is not a zombie (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
