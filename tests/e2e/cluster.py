"""A cluster of real processes on loopback: gateway and workers started with the `pdserve` CLI, KV over UCX."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from pdserve.services.launcher import start_process, stop_processes

from pdserve.v1 import worker_pb2
from tests.helpers import worker_stats

UCX_ENV = {"UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
WORKER_ARGS = ["--threads", "1", "--kv-cache-bytes", "256M", "--max-num-seqs", "64"]


@dataclass
class Cluster:
    gateway: str
    workers: dict[str, tuple] = field(default_factory=dict)  # name -> (process, address, role)
    procs: list = field(default_factory=list)
    metrics: dict[str, str] = field(
        default_factory=dict
    )  # name ("gateway" too) -> /metrics host:port
    env: dict[str, str] = field(default_factory=dict)

    def start_worker(self, name: str, role: str, *extra: str, stderr=None) -> str:
        proc, address, metrics, *_ = start_process(
            [role, "--gateway", self.gateway, *WORKER_ARGS, *extra],
            env={**UCX_ENV, **self.env},
            stderr=stderr,
        )
        self.workers[name] = (proc, address, role)
        self.metrics[name] = metrics
        self.procs.append(proc)
        return address

    def stats(self, name: str) -> worker_pb2.WorkerStats:
        _, address, role = self.workers[name]
        return worker_stats(address, role)

    def live(self) -> dict[str, tuple[str, str]]:
        """name -> (address, role) of the workers still running: what ``assert_no_leaks`` takes."""
        return {n: (a, role) for n, (p, a, role) in self.workers.items() if p.poll() is None}

    def kill(self, name: str) -> None:
        proc = self.workers.pop(name)[0]
        proc.kill()
        proc.wait()


def start_cluster(*gateway_args: str, env: dict[str, str] | None = None, stderr=None) -> Cluster:
    """A gateway; its workers (``start_worker``) register with the cluster token in ``env``
    (a fresh one unless ``env`` has PDSERVE_CLUSTER_TOKEN)."""
    env = {"PDSERVE_CLUSTER_TOKEN": secrets.token_urlsafe(32), **(env or {})}
    proc, address, metrics, *_ = start_process(
        # every prompt disaggregated (tests see the roles they started), unless gateway_args say
        ["gateway", "--port", "0", "--http-port", "-1", "--decode-prefill-budget", "0"]
        + list(gateway_args),
        env=env,
        stderr=stderr,
    )
    c = Cluster(address, env=env)
    c.procs.append(proc)
    c.metrics["gateway"] = metrics
    return c


@contextmanager
def running_cluster(workers: dict[str, str]) -> Iterator[Cluster]:
    """A gateway and ``workers`` (name -> role), every process stopped when the block ends."""
    c = start_cluster()
    try:
        for name, role in workers.items():
            c.start_worker(name, role)
        yield c
    finally:
        stop_processes(c.procs)
