"""What the serving benchmarks share: a cluster of real processes for the length of one load run."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets

from pdserve.services.launcher import start_process, stop_processes

from pdserve.bench_serve import run_load

ENV = {"UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
COMMON = ["--kv-cache-bytes", "2G", "--max-num-seqs", "64"]
DISAGGREGATED_NO_BORROW = [
    ["prefill", "--threads", "1", "--cpus", "0"],
    ["decode", "--threads", "1", "--cpus", "1"],
]
# as pdserve up on 2 cores: each worker's steps use the other's core too while that one is idle
DISAGGREGATED = [
    [*DISAGGREGATED_NO_BORROW[0], "--borrow-cpus", "1"],
    [*DISAGGREGATED_NO_BORROW[1], "--borrow-cpus", "0"],
]


TWO_PREFILL = [  # routing between prefill workers: one core each, the decode worker beside them
    ["prefill", "--threads", "1", "--cpus", "0"],
    ["prefill", "--threads", "1", "--cpus", "1"],
    ["decode", "--threads", "1"],
]


def streaming_args(workers: list[list[str]], extra: list[str]) -> list[list[str]]:
    """``workers`` (argv each) with ``extra`` given to those that stream tokens: all but the
    prefill workers (which return only a prompt's first token), e.g. --stream-interval."""
    return [w if w[0] == "prefill" else [*w, *extra] for w in workers]


@contextlib.contextmanager
def cluster(
    workers: list[list[str]],
    env: dict[str, str] | None = None,
    gateway_args: list[str] | None = None,
):
    """A gateway (with ``gateway_args`` too) and ``workers`` (argv each, COMMON added) as real
    processes; yields (gateway address, the processes) and stops them all on exit."""
    workers = [[*argv, *COMMON] for argv in workers]
    with gateways_and_workers({"": gateway_args or []}, workers, env) as (gateways, procs):
        yield gateways[""], procs


@contextlib.contextmanager
def gateways_and_workers(
    gateway_args: dict[str, list[str]],
    workers: list[list[str]],
    env: dict[str, str] | None = None,
):
    """A gateway per entry of ``gateway_args`` (a name: its own options) and one set of
    ``workers`` (argv each) registered with every one of them, as real processes; yields
    ({name: gateway address}, the processes) and stops them all on exit."""
    env = {**ENV, "PDSERVE_CLUSTER_TOKEN": secrets.token_urlsafe(32), **(env or {})}
    procs, gateways = [], {}
    try:
        for name, extra in gateway_args.items():
            gw = start_process(["gateway", "--port", "0", "--http-port", "-1", *extra], env=env)
            procs.append(gw.proc)
            gateways[name] = gw.address
        registry = ",".join(gateways.values())
        for argv in workers:
            procs.append(start_process([*argv, "--gateway", registry], env=env).proc)
        yield gateways, procs
    finally:
        stop_processes(procs)


def run_cluster(
    workers: list[list[str]],
    args,
    env: dict[str, str] | None = None,
    gateway_args: list[str] | None = None,
) -> dict:
    """Start a gateway (with ``gateway_args``) and ``workers`` (argv each), warm up, run the load
    ``args`` describe (requests, users, rate, prompt_words, output_len, seed), stop everything;
    the load's summary."""
    with cluster(workers, env, gateway_args) as (address, procs):
        cpu = cpu_seconds(procs)
        summary = warm_then_load(address, args)
        summary["cluster_cpu_s"] = cpu_seconds(procs) - cpu
        return summary


def warm_then_load(address: str, args, tls_ca: str | None = None) -> dict:
    """A short warm-up, then the load ``args`` describe (requests, users, rate, prompt_words,
    output_len, seed) against the gateway at ``address``; the load's summary."""
    asyncio.run(run_load(address, 4, 2, None, "64-128", 8, 99, 600, tls_ca=tls_ca))
    return asyncio.run(
        run_load(
            address,
            args.requests,
            args.users,
            args.rate,
            args.prompt_words,
            args.output_len,
            args.seed,
            1200,
            tls_ca=tls_ca,
        )
    )


def _with_descendants(pids: list[int]) -> set[int]:
    """``pids`` and every process below them alive now (a server's own worker processes: vLLM's
    engine and worker run in children of the process started)."""
    seen, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:  # it exited meanwhile
            pass
    return seen


def cpu_seconds(procs) -> float:
    """User + system CPU seconds the processes and their live descendants have used so far
    (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in _with_descendants([p.pid for p in procs]):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def load_parser(
    requests: int, users: int, prompt_words: str, output_len: int
) -> argparse.ArgumentParser:
    """The load options both serving benchmarks take, with their own defaults."""
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=requests)
    p.add_argument("--users", type=int, default=users)
    p.add_argument(
        "--rate", type=float, default=None, help="Poisson arrivals per second instead of users"
    )
    p.add_argument("--prompt-words", default=prompt_words)
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p
