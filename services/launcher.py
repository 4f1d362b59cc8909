"""Local processes: start a pdserve command and wait for its READY line; ``pdserve up``.

Every serving command prints ``READY <role> <host:port> metrics=<host:port>`` once it serves
(main.py); ``start_process`` waits for that line, so a caller knows the process is registered.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import NamedTuple


class Started(NamedTuple):
    proc: subprocess.Popen
    address: str  # gRPC host:port
    metrics: str  # /metrics host:port, or "-"
    http: str = "-"  # the gateway's OpenAI-compatible HTTP API host:port, or "-"


def start_process(
    argv: list[str], env: dict[str, str] | None = None, timeout: float = 300.0, stderr=None
) -> Started:
    """Start ``pdserve <argv>`` and wait for its READY line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", *argv],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        stderr=stderr,
    )
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        if line.startswith("READY "):
            fields = line.split()
            http = next((f.removeprefix("http=") for f in fields if f.startswith("http=")), "-")
            return Started(proc, fields[2], fields[3].removeprefix("metrics="), http)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"pdserve {' '.join(argv)} exited (code {proc.wait()}) before it was ready")


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


def _cpu_sets(n: int) -> list[str]:
    """Spread n workers over the cores: worker i gets core i mod num_cores."""
    cores = sorted(os.sched_getaffinity(0))
    return [str(cores[i % len(cores)]) for i in range(n)]


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def cmd_up(args) -> int:
    """Gateway + prefill + decode workers on loopback; Ctrl-C (SIGINT) or SIGTERM stops them all,
    gracefully: the gateway first (it stops taking requests and lets the running ones finish,
    which needs the workers), then the workers; each gets ``--drain-timeout`` (+ 10 s to exit).

    The handlers are installed explicitly: a shell starts a background job (``pdserve up &`` in a
    script) with SIGINT ignored, and Python then raises no KeyboardInterrupt for it."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    observe = ["--log-format", args.log_format] + (["--log-prompts"] if args.log_prompts else [])
    observe += ["--drain-timeout", str(args.drain_timeout)]
    if args.otlp_endpoint:
        observe += ["--otlp-endpoint", args.otlp_endpoint]
    common = [
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--quantization",
        args.quantization,
        "--block-size",
        str(args.block_size),
        *observe,
    ]
    if args.kv_cache_bytes:
        common += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    procs: list[subprocess.Popen] = []
    try:
        gw, address, gw_metrics, http = start_process(
            [
                "gateway",
                "--model",
                args.model,
                "--port",
                str(args.port),
                "--http-port",
                str(args.http_port),
                "--metrics-port",
                str(args.metrics_port),
                *observe,
            ]
        )
        procs.append(gw)
        roles = (
            ["prefill"] * args.prefill + ["decode"] * args.decode + ["colocated"] * args.colocated
        )
        cpus = _cpu_sets(len(roles)) if args.pin else [""] * len(roles)
        starting = []
        for role, cpu in zip(roles, cpus, strict=True):
            argv = [role, *common, "--gateway", address, "--threads", str(args.threads_per_worker)]
            if cpu:
                argv += ["--cpus", cpu]
            starting.append(argv)
        metrics = [f"gateway {gw_metrics}"]
        for argv in starting:  # each is registered with the gateway once READY
            started = start_process(argv)
            procs.append(started.proc)
            metrics.append(f"{argv[0]} {started.metrics}")
        print(
            f"pdserve is up: gateway at {address} ({args.prefill} prefill, {args.decode} decode, "
            f'{args.colocated} colocated). Try: pdserve generate --url {address} "Hello"',
            flush=True,
        )
        if http != "-":
            print(f"OpenAI-compatible HTTP API: http://{http}/v1", flush=True)
        print(f"/metrics: {', '.join(metrics)}", flush=True)
        while all(p.poll() is None for p in procs):
            time.sleep(0.5)
        print("pdserve up: a process exited; stopping the rest", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        # Further signals are ignored while they drain: each is bounded (SIGKILL after grace).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        grace = args.drain_timeout + 10
        stop_processes(procs[:1], grace)  # the gateway, draining through the workers
        stop_processes(procs[1:], grace)
