"""Fault soak: requests through `pdserve up` (2 prefill + 2 decode workers) while a fault injector
SIGKILLs and SIGSTOPs random workers (bounded count); `pdserve up` restarts the killed ones, the
stopped ones are continued after a while. Every request must complete with the output an
undisturbed pass gave, and no worker may hold a KV block at the end.

    .venv/bin/python bench/soak.py --requests 1000 --users 16 --faults 12 --json soak.json

Reported: requests completed (and how many failed), outputs equal to the reference (greedy, fp32),
resumes and retries per request (gateway metrics), extra latency of requests that overlapped a
fault (p50/p99 against those that did not), leaked blocks (Stats of every worker after the load),
and per fault the time until the gateway acted: a resume, a retry or an eviction that followed it
(gateway metrics, polled every 50 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import grpc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import ENV  # noqa: E402
from pdserve.bench_serve import WORDS, percentiles  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402
from pdserve.v1 import generation_pb2, generation_pb2_grpc  # noqa: E402
from pdserve.v1.convert import sampling_to_proto  # noqa: E402
from tests.helpers import (  # noqa: E402
    assert_no_leaks,
    process_alive,
    scrape_metrics,
    wait_until,
    worker_stats,
)

# what the gateway does about a fault, by metric (counters; any of them moving counts)
ACTIONS = ("pdserve_resumes_total", "pdserve_retries_total", "pdserve_evictions_total")


@dataclass
class Up:
    """A `pdserve up` process and what it printed: names -> (pid, address), kept current as it
    restarts processes."""

    proc: subprocess.Popen
    gateway: str = ""
    metrics: str = ""
    workers: dict[str, tuple[int, str]] = field(default_factory=dict)
    restarts: int = 0
    ready: threading.Event = field(default_factory=threading.Event)

    def follow(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("/metrics: gateway "):
                self.metrics = line.split()[2].rstrip(",")
            elif line.startswith("processes: "):
                for part in line[len("processes: ") :].strip().split(", "):
                    name, _, pid, _, address = part.split()
                    if name == "gateway":
                        self.gateway = address
                    else:
                        self.workers[name] = (int(pid), address)
                self.ready.set()
            elif (
                " restarted (pid " in line
            ):  # pdserve up: decode-0 restarted (pid N, ...) at A, ...
                name = line.split()[2]
                pid = int(line.split("(pid ")[1].split(",")[0])
                address = line.split(" at ")[1].split(",")[0]
                if name != "gateway":
                    self.workers[name] = (pid, address)
                self.restarts += 1


def start_up(args) -> Up:
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--prefill", "2", "--decode", "2"]
    argv += ["--port", "0", "--http-port", "-1", "--dtype", "float32", "--kv-cache-bytes", "1G"]
    argv += ["--quantization", args.quantization]
    argv += ["--log-format", "json"]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=open(args.log, "w"),  # noqa: SIM115 (the process keeps it)
        text=True,
        env={**os.environ, **ENV},
    )
    up = Up(proc)
    threading.Thread(target=up.follow, daemon=True).start()
    if not up.ready.wait(600):
        proc.kill()
        raise RuntimeError(f"pdserve up did not come up; see {args.log}")
    return up


def all_answer(up: Up) -> bool:
    """Whether every worker of ``up`` (at its latest address) answers its Stats RPC."""
    try:
        for name, (_, address) in sorted(up.workers.items()):
            worker_stats(address, name.split("-")[0], timeout=2.0)
    except grpc.RpcError:
        return False
    return True


def actions(up: Up) -> float:
    m = scrape_metrics(up.metrics)
    return sum(v for (name, _), v in m.items() if name in ACTIONS)


def inject(up: Up, args, rng: random.Random, stop: threading.Event, log: list[dict]) -> None:
    """Every few seconds a fault on a random worker: SIGKILL (pdserve up restarts it) or SIGSTOP
    for a while, then SIGCONT. Waits for the gateway to act on each before the next."""
    for _ in range(args.faults):
        if stop.wait(rng.uniform(args.fault_gap_s / 2, args.fault_gap_s * 1.5)):
            return
        # a worker that is up (one killed earlier may still be restarting)
        name = rng.choice([n for n, (pid, _) in sorted(up.workers.items()) if process_alive(pid)])
        pid, _ = up.workers[name]
        kind = rng.choice(("kill", "stop"))
        before = actions(up)
        t0 = time.monotonic()
        try:
            os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        except ProcessLookupError:  # it died meanwhile: no fault this round
            continue
        acted = None
        while time.monotonic() - t0 < args.stop_s:
            if actions(up) > before:
                acted = time.monotonic() - t0
                break
            time.sleep(0.05)
        if kind == "stop":
            stop.wait(max(0.0, args.stop_s - (time.monotonic() - t0)))
            os.kill(pid, signal.SIGCONT)
        log.append({"t": t0, "kind": kind, "worker": name, "gateway_acted_after_s": acted})
        print(f"fault: {kind} {name}; gateway acted after {acted}", flush=True)


async def load(up: Up, args, prompts: list[str], params, results: list[dict]) -> None:
    queue = [(i, prompts[i % len(prompts)]) for i in range(args.requests)][::-1]
    async with grpc.aio.insecure_channel(up.gateway) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)

        async def user() -> None:
            while queue:
                i, prompt = queue.pop()
                req = generation_pb2.GenerateRequest(text=prompt, sampling=params)
                r = {"i": i, "start": time.monotonic(), "tokens": [], "error": ""}
                try:
                    async for delta in stub.Generate(req, timeout=args.timeout):
                        r["tokens"] += delta.token_ids
                except grpc.aio.AioRpcError as e:
                    r["error"] = f"{e.code().name}: {e.details()}"
                r["end"] = time.monotonic()
                results.append(r)

        await asyncio.gather(*(user() for _ in range(args.users)))


async def reference(up: Up, prompts: list[str], params) -> list[list[int]]:
    async with grpc.aio.insecure_channel(up.gateway) as ch:
        stub = generation_pb2_grpc.GenerationStub(ch)
        out = []
        for p in prompts:
            resp = await stub.Complete(generation_pb2.GenerateRequest(text=p, sampling=params))
            out.append(list(resp.token_ids))
        return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--prompts", type=int, default=40, help="distinct prompts (reference outputs)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--faults", type=int, default=12)
    p.add_argument("--fault-gap-s", type=float, default=4.0)
    p.add_argument("--stop-s", type=float, default=8.0, help="how long a SIGSTOP lasts")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quantization",
        default="none",
        help="the workers' --quantization (default none: dense fp32, whose outputs depend neither "
        "on the batch nor on a resume, so that every difference from the reference is the fault "
        "handling's; the default model's own 4-bit blocks on fp32 round differently in steps of "
        "up to 8 rows and of more, docs/architecture.md)",
    )
    p.add_argument("--log", default="soak-up.log", help="pdserve up's stderr")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rng = random.Random(args.seed)
    prompts = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(16, 96))) for _ in range(args.prompts)
    ]
    params = sampling_to_proto(
        SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    )
    up = start_up(args)
    faults: list[dict] = []
    results: list[dict] = []
    try:
        want = asyncio.run(reference(up, prompts, params))
        before = scrape_metrics(up.metrics)
        stop = threading.Event()
        injector = threading.Thread(target=inject, args=(up, args, rng, stop, faults))
        start = time.monotonic()
        injector.start()
        try:
            asyncio.run(load(up, args, prompts, params, results))
        finally:
            stop.set()
            injector.join()
        wall = time.monotonic() - start
        after = scrape_metrics(up.metrics)
        # a worker killed by the last faults may still be restarting: wait for all of them
        wait_until(lambda: all_answer(up), 120, "every worker to answer after the last fault")
        # blocks of cancelled requests are freed as their transfers settle: give them 30 s
        workers = {n: (a, n.split("-")[0]) for n, (_, a) in sorted(up.workers.items())}
        try:
            assert_no_leaks(workers, timeout=30)
            leaks = {n: 0 for n in workers}
        except AssertionError as e:
            print(f"LEAK: {e}", flush=True)
            leaks = {
                n: (lambda s: s.num_total_blocks - s.num_free_blocks)(worker_stats(a, r))
                for n, (a, r) in workers.items()
            }
    finally:
        up.proc.send_signal(signal.SIGINT)
        up.proc.wait(120)

    def delta(name: str) -> float:
        return sum(v for (n, _), v in after.items() if n == name) - sum(
            v for (n, _), v in before.items() if n == name
        )

    ok = [r for r in results if not r["error"]]
    equal = sum(r["tokens"] == want[r["i"] % len(prompts)] for r in ok)
    windows = [(f["t"], f["t"] + args.stop_s) for f in faults]

    def hit(r: dict) -> bool:
        return any(r["start"] <= b and a <= r["end"] for a, b in windows)

    lat_hit = [r["end"] - r["start"] for r in ok if hit(r)]
    lat_clean = [r["end"] - r["start"] for r in ok if not hit(r)]
    acted = [f["gateway_acted_after_s"] for f in faults if f["gateway_acted_after_s"] is not None]
    summary = {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "error_samples": sorted({r["error"] for r in results if r["error"]})[:5],
        "outputs_equal_to_reference": equal,
        "wall_s": wall,
        "faults": faults,
        "restarts": up.restarts,
        "resumes": delta("pdserve_resumes_total"),
        "retries": delta("pdserve_retries_total"),
        "evictions": delta("pdserve_evictions_total"),
        "hang_detection_s_mean": delta("pdserve_hang_detection_seconds_sum")
        / max(delta("pdserve_hang_detection_seconds_count"), 1),
        "latency_s_overlapping_a_fault": percentiles(lat_hit),
        "latency_s_without_fault": percentiles(lat_clean),
        "gateway_acted_after_s": percentiles(acted),
        "faults_not_acted_on": len(faults) - len(acted),
        "leaked_blocks": leaks,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "faults"}, indent=2))
    if lat_hit and lat_clean:
        extra = {
            q: (summary["latency_s_overlapping_a_fault"][q] - summary["latency_s_without_fault"][q])
            for q in ("p50", "p99")
        }
        print(
            f"extra latency of a request overlapping a fault: p50 {extra['p50']:.2f} s, p99 {extra['p99']:.2f} s"
        )
    print(f"median gateway reaction: {statistics.median(acted) if acted else float('nan'):.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    ok_all = len(ok) == args.requests and equal == len(ok) and not any(leaks.values())
    sys.exit(0 if ok_all else 1)


if __name__ == "__main__":
    main()
