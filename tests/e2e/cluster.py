"""A cluster of real processes on loopback: gateway and workers started with the `pdserve` CLI, KV over UCX."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
from pdserve.services.launcher import start_process

from pdserve.v1 import worker_pb2, worker_pb2_grpc

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
        proc, address, metrics = start_process(
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
        with grpc.insecure_channel(address) as ch:
            stub = (
                worker_pb2_grpc.PrefillStub(ch)
                if role == "prefill"
                else worker_pb2_grpc.DecodeStub(ch)
            )
            return stub.Stats(worker_pb2.StatsRequest(), timeout=5)

    def wait_all_free(self, timeout: float) -> dict[str, worker_pb2.WorkerStats]:
        """Poll the workers' Stats RPC until every KV block is free (or the timeout passes)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = {n: self.stats(n) for n, (p, _, _) in self.workers.items() if p.poll() is None}
            if (
                all(s.num_free_blocks == s.num_total_blocks for s in stats.values())
                or time.monotonic() > deadline
            ):
                return stats
            time.sleep(0.05)

    def kill(self, name: str) -> None:
        proc = self.workers.pop(name)[0]
        proc.kill()
        proc.wait()


def start_cluster(*gateway_args: str, env: dict[str, str] | None = None, stderr=None) -> Cluster:
    proc, address, metrics = start_process(
        ["gateway", "--port", "0", *gateway_args], env=env, stderr=stderr
    )
    c = Cluster(address, env=dict(env or {}))
    c.procs.append(proc)
    c.metrics["gateway"] = metrics
    return c
