"""Local processes: start a pdserve command and wait for its READY line; ``pdserve up``.

Every serving command prints ``READY <role> <host:port> metrics=<host:port>`` once it serves
(main.py; the gateway adds ``registry=<host:port>``); ``start_process`` waits for that line, so a
caller knows the process is registered.

Worker registration is always authenticated: ``up`` makes a random cluster token and hands it to
the processes in their environment (never on a command line, where ``ps`` shows it); with
``--tls`` it also makes a throwaway CA and certificates, and the processes talk mutual TLS.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from pdserve.services.supervisor import ExitedBeforeReady, FatalExit, Supervisor

from pdserve import envs


class Started(NamedTuple):
    proc: subprocess.Popen
    address: str  # gRPC host:port
    metrics: str  # /metrics host:port, or "-"
    http: str = "-"  # the gateway's OpenAI-compatible HTTP API host:port, or "-"
    registry: str = ""  # where workers register: the gateway's registry=, else ``address``


def start_process(
    argv: list[str], env: dict[str, str] | None = None, timeout: float = 300.0, stderr=None
) -> Started:
    """Start ``pdserve <argv>`` and wait for its READY line."""
    return wait_ready(spawn(argv, env, stderr), argv, timeout)


def spawn(argv: list[str], env: dict[str, str] | None = None, stderr=None) -> subprocess.Popen:
    """``pdserve <argv>`` started, its READY line not yet read (``wait_ready``)."""
    return subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", *argv],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        stderr=stderr,
    )


def wait_ready(proc: subprocess.Popen, argv: list[str], timeout: float = 300.0) -> Started:
    """``proc``'s READY line read; ExitedBeforeReady (and ``proc`` killed) if it never comes."""
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if line.startswith("READY "):
            fields = line.split()
            named = dict(f.split("=", 1) for f in fields[3:] if "=" in f)
            return Started(
                proc,
                fields[2],
                named["metrics"],
                named.get("http", "-"),
                named.get("registry", fields[2]),
            )
        if time.monotonic() > deadline:
            break
    proc.kill()
    code = proc.wait()
    raise ExitedBeforeReady(
        f"pdserve {' '.join(argv)} exited (code {code}) before it was ready", code
    )


def stop_processes(procs: list[subprocess.Popen], grace: float = 10.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _cpu_sets(n: int, threads: int, cores: list[int]) -> list[str]:
    """Spread n workers of ``threads`` threads over the cores: worker i gets ``threads`` cores
    from core i * threads on (mod the number of cores; all of them if there are fewer). One
    core for a two-thread worker made its OpenMP threads wait for each other's time slices at
    every barrier: a colocated W-c32 step took 2.5 s instead of ~70 ms."""
    k = min(threads, len(cores))
    return [",".join(str(cores[(i * k + j) % len(cores)]) for j in range(k)) for i in range(n)]


def _spread_devices(device: str, n: int, gpus: int) -> list[str]:
    """Each of n workers' ``--device``: ``cuda`` without an index on a machine with several GPUs
    puts worker i on GPU i mod their number (a prefill and a decode worker each on its own, KV
    between them over UCX on CUDA memory); any other device (``cpu``, ``cuda:1``) is every
    worker's."""
    if device == "cuda" and gpus > 1:
        return [f"cuda:{i % gpus}" for i in range(n)]
    return [device] * n


def _oversubscribed(workers: int, threads: int, cores: int) -> str | None:
    """A warning when the workers' engine threads outnumber the cores, else None."""
    if workers * threads <= cores:
        return None
    return (
        f"pdserve up: {workers} workers x {threads} threads on {cores} core(s): the workers' "
        "threads share cores and wait for each other (measured on 2 cores: W-c8 191 tok/s with "
        "--threads-per-worker 2, 338 with 1, where each worker also borrows the other's idle "
        "core)"
    )


def _borrowed(roles: list[str], cpus: list[str]) -> dict[int, str]:
    """{worker index: --borrow-cpus}: one pinned prefill and one pinned decode worker on cores of
    their own (the default cluster on a small machine) each use the other's core while that one
    is idle (EngineLoop._borrow). With more workers a worker's idle time is not one other's to
    take: none."""
    if sorted(roles) != ["decode", "prefill"] or not all(cpus):
        return {}
    decode, prefill = roles.index("decode"), roles.index("prefill")
    if cpus[decode] == cpus[prefill]:
        return {}
    return {decode: cpus[prefill], prefill: cpus[decode]}


def engine_argv(args) -> list[str]:
    """The engine options of ``pdserve up`` (all but ``--threads`` and ``--device``, which
    it sets per worker) as a worker's arguments."""
    argv = ["--model", args.model, "--dtype", args.dtype, "--quantization", args.quantization]
    argv += ["--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs)]
    argv += ["--kv-cache-dtype", args.kv_cache_dtype]
    argv += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    argv += ["--prompt-order", args.prompt_order]
    if args.kv_cache_bytes:
        argv += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    if not args.prefix_caching:
        argv.append("--no-prefix-caching")
    if not args.kv_resident:
        argv.append("--lazy-kv-cache")
    return argv


def stream_argv(args, role: str) -> list[str]:
    """What a worker of ``role`` gets of ``pdserve up --stream-interval``: decode and colocated
    workers stream the tokens; a prefill worker returns only the first. Auto (None) is every
    worker's default: nothing to pass."""
    if role == "prefill" or args.stream_interval is None:
        return []
    if not args.stream_interval >= 0:
        raise ValueError(f"--stream-interval must be >= 0 ms, got {args.stream_interval:g}")
    return ["--stream-interval", f"{args.stream_interval:g}"]


def threads_per_worker(args) -> int:
    """``--threads-per-worker``, or ``--threads`` (the engine option of every other command;
    here it is each worker's too, not the cluster's); 1 by default. ValueError when the two
    disagree or are not positive."""
    given = {n for n in (args.threads_per_worker, args.threads) if n is not None}
    if len(given) > 1:
        raise ValueError(
            f"--threads {args.threads} and --threads-per-worker {args.threads_per_worker} "
            "disagree: both are each worker's torch threads, give one"
        )
    n = given.pop() if given else 1
    if n < 1:
        raise ValueError(f"each worker needs at least one thread, got {n}")
    return n


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def cmd_up(args) -> int:
    """Gateway + prefill + decode workers on loopback; Ctrl-C (SIGINT) or SIGTERM stops them all,
    gracefully: the gateway first (it stops taking requests and lets the running ones finish,
    which needs the workers), then the workers; each gets ``--drain-timeout`` (+ 10 s to exit).

    The handlers are installed explicitly: a shell starts a background job (``pdserve up &`` in a
    script) with SIGINT ignored, and Python then raises no KeyboardInterrupt for it."""
    try:
        args.threads_per_worker = threads_per_worker(args)
        stream_argv(args, "decode")  # checked before anything starts
    except ValueError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    observe = ["--log-format", args.log_format] + (["--log-prompts"] if args.log_prompts else [])
    observe += ["--drain-timeout", str(args.drain_timeout)]
    if args.otlp_endpoint:
        observe += ["--otlp-endpoint", args.otlp_endpoint]
    common = [*engine_argv(args), *observe]
    env = {envs.CLUSTER_TOKEN_ENV: envs.cluster_token() or secrets.token_urlsafe(32)}

    def start(argv: list[str]) -> tuple[subprocess.Popen, str]:
        started = start_process(argv, env=env)
        return started.proc, f" at {started.address}, /metrics {started.metrics}"

    cluster = Supervisor(start)
    starting: list[subprocess.Popen] = []  # workers started, not yet READY (nor in ``cluster``)
    certs_dir = Path(tempfile.mkdtemp(prefix="pdserve-tls-")) if args.tls else None
    try:
        gateway_tls, worker_tls, ca = _tls_argv(certs_dir)
        keys = ["--api-keys", args.api_keys] if args.api_keys else []
        gateway_argv = ["gateway", "--model", args.model, *gateway_tls, *keys, *observe]
        gateway_argv += ["--decode-prefill-budget", str(args.decode_prefill_budget)]
        gateway_argv += ["--decode-prefill-max-tokens", str(args.decode_prefill_max_tokens)]
        gateway_argv += ["--decode-prefill-share", str(args.decode_prefill_share)]
        gateway_argv += ["--policy", args.policy, *(["--warm-replies"] * args.warm_replies)]
        ports = {"--port": args.port, "--http-port": args.http_port}
        ports["--metrics-port"] = args.metrics_port
        gateway = start_process([*gateway_argv, *(f"{k}={v}" for k, v in ports.items())], env=env)
        # Restarted, it comes back where the workers and clients know it: the ports it got.
        ports.update({"--port": _port(gateway.address), "--http-port": _port(gateway.http)})
        ports.update({"--metrics-port": _port(gateway.metrics)})
        if "--registry-port" in gateway_argv:
            gateway_argv[gateway_argv.index("--registry-port") + 1] = _port(gateway.registry)
        cluster.add(
            "gateway", [*gateway_argv, *(f"{k}={v}" for k, v in ports.items())], gateway.proc
        )
        roles = (
            ["prefill"] * args.prefill + ["decode"] * args.decode + ["colocated"] * args.colocated
        )
        cores = sorted(os.sched_getaffinity(0))
        cpus = (
            _cpu_sets(len(roles), args.threads_per_worker, cores) if args.pin else [""] * len(roles)
        )
        warning = _oversubscribed(len(roles), args.threads_per_worker, len(cores))
        if warning:
            print(warning, file=sys.stderr, flush=True)
        gpus = 0
        if args.device == "cuda":
            import torch

            gpus = torch.cuda.device_count()
        devices = _spread_devices(args.device, len(roles), gpus)
        # a core each with one thread each (the default): each may borrow the other's
        one_thread = args.threads_per_worker == 1
        borrow = _borrowed(roles, cpus) if args.borrow and one_thread else {}
        metrics = [f"gateway {gateway.metrics}"]
        addresses = [gateway.address]
        argvs = []
        for i, (role, cpu, device) in enumerate(zip(roles, cpus, devices, strict=True)):
            argv = [role, *common, *worker_tls, "--gateway", gateway.registry]
            argv += ["--device", device, "--threads", str(args.threads_per_worker)]
            if cpu:
                argv += ["--cpus", cpu]
            if i in borrow:
                argv += ["--borrow-cpus", borrow[i]]
            argvs.append(argv + stream_argv(args, role))
        # The workers load together (each on its own cores), then each READY is read in turn;
        # one that fails stops them all (``finally``: ``starting`` holds those not yet added).
        starting.extend(spawn(argv, env) for argv in argvs)
        for i, (role, argv) in enumerate(zip(roles, argvs, strict=True)):
            started = wait_ready(starting[0], argv)  # registered with the gateway once READY
            name = f"{role}-{roles[:i].count(role)}"
            cluster.add(name, argv, starting.pop(0))
            metrics.append(f"{name} {started.metrics}")
            addresses.append(started.address)
        try_it = f"pdserve generate --url {gateway.address}" + (f" --tls-ca {ca}" if ca else "")
        print(
            f"pdserve is up: gateway at {gateway.address} ({args.prefill} prefill, {args.decode} decode, "
            f'{args.colocated} colocated). Try: {try_it} "Hello"',
            flush=True,
        )
        if gateway.http != "-":
            scheme = "https" if ca else "http"
            print(f"OpenAI-compatible HTTP API: {scheme}://{gateway.http}/v1", flush=True)
        if ca:
            print(f"TLS: CA {ca} (removed when pdserve up exits)", flush=True)
        print(f"/metrics: {', '.join(metrics)}", flush=True)
        print(
            "processes: "
            + ", ".join(
                f"{s.name} pid {s.proc.pid} at {a}"
                for s, a in zip(cluster.processes, addresses, strict=True)
            ),
            flush=True,
        )
        while True:  # a process that exits is started again (services/supervisor.py)
            cluster.poll()
            time.sleep(0.5)
    except (FatalExit, ExitedBeforeReady) as e:  # a start's failure: its own error is above
        print(f"pdserve up: {e}; stopping the rest", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        # Further signals are ignored while they drain: each is bounded (SIGKILL after grace).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        grace = args.drain_timeout + 10
        procs = cluster.procs
        stop_processes(procs[:1], grace)  # the gateway, draining through the workers
        stop_processes(procs[1:] + starting, grace)
        if certs_dir is not None:
            shutil.rmtree(certs_dir, ignore_errors=True)


def _port(address: str) -> str:
    """host:port -> port; "-" (off) stays "-1"."""
    return "-1" if address == "-" else address.rsplit(":", 1)[1]


def _tls_argv(folder: Path | None) -> tuple[list[str], list[str], str | None]:
    """The gateway's and the workers' TLS flags, and the CA's path, for certificates made in
    ``folder`` (``up --tls``); no flags and no CA without one. The gateway's Registry gets a port
    of its own that requires a cluster certificate."""
    if folder is None:
        return [], [], None
    from pdserve.certs import make_cluster_certs

    made = make_cluster_certs(folder)

    def flags(name: str) -> list[str]:
        f = made[name]
        return ["--tls-ca", str(f.ca), "--tls-cert", str(f.cert), "--tls-key", str(f.key)]

    return [*flags("gateway"), "--registry-port", "0"], flags("worker"), str(made["gateway"].ca)
