"""A cluster of real processes on loopback: gateway and workers started with the `pdserve` CLI (or
`pdserve up`: ``Up``), KV over UCX."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
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
    device: str = "cpu"  # the workers' --device, where a test gives them one

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


class Up:
    """``pdserve up`` started as a script starts it (``pdserve up &``: SIGINT ignored), read until
    it is up: ``address``, ``base_url`` (the HTTP API's, or None) and ``pids`` (name -> pid)."""

    def __init__(self, *argv: str, unset: tuple[str, ...] = ()) -> None:
        env = {**os.environ, **UCX_ENV}
        for name in unset:
            env.pop(name, None)
        # its processes' logs (a file: a pipe nobody reads would fill and block them), shown
        # when it fails to come up
        self.stderr = tempfile.TemporaryFile(mode="w+")
        # SIGINT ignored as a shell ignores it for a background job (an ignored signal stays
        # ignored across exec). Not with preexec_fn: Python code run in a child forked from this
        # multithreaded process may deadlock or abort before its exec (a CI run saw `up` "exit"
        # with SIGABRT and no output, as such a child would).
        self.proc = subprocess.Popen(
            ["sh", "-c", 'trap "" INT; exec "$@"', "sh"]
            + [sys.executable, "-m", "pdserve.cli", "up", "--port", "0", *argv],
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=env,
        )
        self.address = self.base_url = None
        self.words: list[str] = []  # of the line "pdserve is up: gateway at ..."
        self.pids: dict[str, int] = {}
        for line in self.proc.stdout:  # blocks until `up` prints; it exits (EOF) if it fails
            if line.startswith("pdserve is up: gateway at "):
                self.words = line.split()
                self.address = self.words[5]
            if line.startswith("OpenAI-compatible HTTP API: "):
                self.base_url = line.split()[-1]
            if line.startswith("processes: "):  # "processes: gateway pid 1 at host:port, ..."
                self.pids = {p.split()[0]: int(p.split()[2]) for p in line[11:].split(", ")}
                break
        if not self.address:
            code = self.proc.wait()
            self.stderr.seek(0)
            tail = self.stderr.read()[-4000:]
            self.stderr.close()
            raise AssertionError(
                f"pdserve up exited with {code} before it was up; its stderr:\n{tail}"
            )

    def worker_option(self, name: str, option: str) -> str:
        """The value of ``option`` on worker ``name``'s command line."""
        with open(f"/proc/{self.pids[name]}/cmdline") as f:
            argv = f.read().split("\0")
        return argv[argv.index(option) + 1]

    def stop(self) -> int:
        """SIGINT; its exit status."""
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=30)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()
