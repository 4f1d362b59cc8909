"""What every pdserve server process shares: its READY line, its /metrics server, waiting for a
signal, the health entry for liveness, and running its coroutine."""

from __future__ import annotations

import asyncio
import gc
import signal
import sys

# A health "service" (no RPCs) that says whether the process should be restarted: SERVING from
# start to stop, also while draining or unregistered; a worker's turns NOT_SERVING only when its
# engine thread has died (it never recovers). Kubernetes' liveness probes ask for it; readiness
# asks for "" (can this server do its work now).
LIVENESS = "pdserve.Liveness"


def ready(
    role: str, address: str, metrics: str, http: str | None = None, registry: str | None = None
) -> None:
    """``READY <role> <host:port> metrics=<host:port>`` (metrics=- when /metrics is off); the
    gateway adds `` http=<host:port>`` (- when its HTTP API is off) and ``registry=<host:port>``,
    where workers register.

    What startup allocated (torch and the other modules, the model, the servers: ~200,000
    objects) lives as long as the process, so it is moved out of the garbage collector's
    generations first: a full collection over it paused the event loop (and the engine thread,
    through the GIL) for 120-150 ms on an AVX2 Zen 3, about once a minute at 32 users
    (docs/architecture.md, "Server processes freeze their startup heap")."""
    gc.collect()
    gc.freeze()
    extra = "" if http is None else f" http={http}"
    extra += f" registry={registry}" if registry else ""
    print(f"READY {role} {address} metrics={metrics}{extra}", flush=True)


def serve_metrics(metrics, host: str, port: int) -> str:
    return "-" if port < 0 else metrics.serve(host, port)


async def until_signalled() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def until_signalled_or(task: asyncio.Task[None] | None) -> None:
    """Until SIGINT/SIGTERM, or until ``task`` ends (its exception propagates)."""
    if task is None:
        await until_signalled()
        return
    done, _ = await asyncio.wait(
        [task, asyncio.create_task(until_signalled())], return_when=asyncio.FIRST_COMPLETED
    )
    for t in done:
        t.result()


def run(coro) -> int:
    # a worker's (services/main.py imports the engine before this runs); a gateway never has it
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_grad_enabled(False)
    try:
        asyncio.run(coro)
    except KeyboardInterrupt:
        pass
    return 0
