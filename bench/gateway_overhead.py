"""What the gateway adds to a request: one closed-loop load sent three ways at once to one
colocated worker (each user's requests go in turn):

- direct: the worker's own ``Decode.Generate`` (prompt token ids, ``prefill_locally``), no gateway;
- grpc:   the gateway's ``Generation.Generate`` (same token ids), which routes to that worker;
- http:   the gateway's OpenAI ``POST /v1/completions`` with ``stream: true`` (same token ids).

Every request: the same prompt length (token ids drawn from the vocabulary), greedy,
``ignore_eos``, the same output length — or, with ``--output-len A-B``, a length drawn per request
(seeded; the modes draw from the same lengths, not the same requests: compare them through
``--spans``' pairs). With one length, every user's request ends at the same
decode step and the next 32 start in the same millisecond: each process on the path (gateway,
worker) takes them one after the other. Drawn lengths spread the starts over the steps, as
requests of a real load arrive. The modes share the worker's batches, so the difference of
their latencies is the path's. Reported per mode: latency and TTFT percentiles (median over
rounds), what the gateway adds (mode minus direct) and the gateway process's CPU per request.
The worker gets one core (``--cpus``), the gateway and this client share the other.

    .venv/bin/python bench/gateway_overhead.py --users 32 --requests 192 --rounds 3 --spans --client-cpu 1 \
        --output-len 8-24 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import statistics
import sys
import time

import aiohttp
import grpc
import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pdserve.services.launcher import start_process, stop_processes  # noqa: E402

from bench.common import ENV, cpu_seconds  # noqa: E402
from bench.gateway_spans import METRICS, Sent, complete, summarize  # noqa: E402
from pdserve.bench_serve import (  # noqa: E402
    RequestResult,
    parse_lengths,
    percentiles,
    sample_length,
)
from pdserve.otlp_sink import SpanSink  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402
from pdserve.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402
from pdserve.v1.convert import sampling_to_proto  # noqa: E402

MODES = ("direct", "grpc", "http")


def _record(r: RequestResult, start: float, now: float, last: float, n: int) -> float:
    if r.output_tokens == 0:
        r.ttft = now - start
    else:
        r.itl.append(now - last)
    r.output_tokens += n
    return now


async def direct(stub, ids: list[int], params, rid: str) -> RequestResult:
    req = worker_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=ids, sampling=params, prefill_locally=True
    )
    r = RequestResult(prompt_words=len(ids))
    start = last = time.perf_counter()
    try:
        async for msg in stub.Generate(req, timeout=600):
            if msg.WhichOneof("kind") == "tokens" and msg.tokens.token_ids:
                last = _record(r, start, time.perf_counter(), last, len(msg.tokens.token_ids))
    except grpc.aio.AioRpcError as e:
        r.error = f"{e.code().name}: {e.details()}"
    r.latency = time.perf_counter() - start
    return r


async def via_grpc(stub, ids: list[int], params, rid: str) -> RequestResult:
    req = generation_pb2.GenerateRequest(
        request_id=rid, token_ids=generation_pb2.TokenIds(ids=ids), sampling=params
    )
    r = RequestResult(prompt_words=len(ids))
    start = last = time.perf_counter()
    try:
        async for delta in stub.Generate(req, timeout=600):
            if delta.token_ids:
                last = _record(r, start, time.perf_counter(), last, len(delta.token_ids))
    except grpc.aio.AioRpcError as e:
        r.error = f"{e.code().name}: {e.details()}"
    r.latency = time.perf_counter() - start
    return r


def _completion(ids: list[int], output_len: int) -> dict:
    return {
        "prompt": ids,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


@contextlib.asynccontextmanager
async def _completion_stream(client, body: dict, headers: dict):
    """POST a streaming completion through ``client``, an aiohttp session (its parser is C, as
    ../shared/bench/openai_load.py sends to OpenAI-style peers) or an httpx client (its parser
    is Python and costs this process more CPU an event): (status, its lines, the event prefix
    in their type, a coroutine reading the body)."""
    if isinstance(client, httpx.AsyncClient):
        async with client.stream(
            "POST", "/v1/completions", json=body, headers=headers, timeout=600
        ) as resp:
            yield resp.status_code, resp.aiter_lines(), "data: {", resp.aread
    else:
        async with client.post("/v1/completions", json=body, headers=headers) as resp:
            yield resp.status, resp.content, b"data: {", resp.read


async def via_http(client, ids: list[int], output_len: int, rid: str) -> RequestResult:
    body = _completion(ids, output_len)
    r = RequestResult(prompt_words=len(ids))
    start = last = time.perf_counter()
    try:
        headers = {"X-Request-Id": rid}
        async with _completion_stream(client, body, headers) as (status, lines, event, read):
            if status != 200:
                r.error = f"HTTP {status}: {(await read())[:200]!r}"
            else:
                async for line in lines:
                    if line.startswith(event):
                        last = _record(r, start, time.perf_counter(), last, 1)
    except (aiohttp.ClientError, httpx.HTTPError) as e:
        r.error = f"{type(e).__name__}: {e}"
    r.latency = time.perf_counter() - start
    return r


async def run_mixed(
    addrs: dict[str, str], args, prompts: list[list[int]], sent: list[Sent] | None = None
) -> dict[str, dict]:
    """Every user sends its requests in turn direct, over gRPC and over HTTP (users start at
    different modes), so the three modes share the worker's batches at every moment: what
    differs between their latencies is the path, not the load. Each request is appended to
    ``sent`` (for the span analysis, gateway_spans.py)."""
    queue = list(reversed(prompts))
    results: dict[str, list[RequestResult]] = {m: [] for m in MODES}
    async with (
        grpc.aio.insecure_channel(addrs["worker"]) as wch,
        grpc.aio.insecure_channel(addrs["gateway"]) as gch,
        contextlib.AsyncExitStack() as stack,
    ):
        base_url = f"http://{addrs['http']}"
        if args.http_client == "httpx":
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            client = await stack.enter_async_context(
                httpx.AsyncClient(base_url=base_url, limits=limits)
            )
        else:
            client = await stack.enter_async_context(
                aiohttp.ClientSession(
                    base_url=base_url,
                    connector=aiohttp.TCPConnector(limit=0),
                    timeout=aiohttp.ClientTimeout(total=600),
                )
            )
        worker = worker_pb2_grpc.DecodeStub(wch)
        gateway = generation_pb2_grpc.GenerationStub(gch)

        async def one(mode: str, prompt: tuple[list[int], int]) -> RequestResult:
            ids, output_len = prompt
            params = sampling_to_proto(
                SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
            )
            rid = f"{mode}-{secrets.token_hex(6)}"
            start_ns = time.time_ns()
            if mode == "direct":
                r = await direct(worker, ids, params, rid)
            elif mode == "grpc":
                r = await via_grpc(gateway, ids, params, rid)
            else:
                r = await via_http(client, ids, output_len, rid)
            if sent is not None and not r.error:
                sent.append(Sent(mode, rid, start_ns, r.latency, r.ttft, r.ttft + sum(r.itl)))
            return r

        async def user(uid: int) -> None:
            n = uid
            while queue:
                mode = MODES[n % len(MODES)]
                results[mode].append(await one(mode, queue.pop()))
                n += 1

        await asyncio.gather(*(user(u) for u in range(args.users)))
    out = {}
    for mode, rs in results.items():
        ok = [r for r in rs if not r.error]
        out[mode] = {
            "requests": len(rs),
            "errors": len(rs) - len(ok),
            "error_samples": sorted({r.error for r in rs if r.error})[:3],
            "latency_s": percentiles([r.latency for r in ok]),
            "ttft_s": percentiles([r.ttft for r in ok]),
            "itl_s": percentiles([g for r in ok for g in r.itl]),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens")
    p.add_argument(
        "--output-len",
        type=parse_lengths,
        default="16",
        help="output tokens: N, or A-B for a length drawn per request (as pdserve bench serve's "
        "--prompt-words; default 16)",
    )
    p.add_argument("--threads", type=int, default=1, help="the worker's torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--http-client",
        choices=("aiohttp", "httpx"),
        default="aiohttp",
        help="the HTTP mode's client library (aiohttp, as the peers' load generator; httpx's "
        "Python parser costs this process more CPU an event)",
    )
    p.add_argument(
        "--client-cpu",
        type=int,
        default=0,
        help="the core this load generator runs on: 0 (beside the gateway) or 1 (beside the "
        "worker, leaving core 0 to the gateway alone)",
    )
    p.add_argument(
        "--worker-nice",
        type=int,
        default=0,
        help="the worker's nice value: above 0, a client beside it (--client-cpu 1) is scheduled "
        "as soon as a message wakes it, not after the engine's time slice",
    )
    p.add_argument(
        "--spans",
        action="store_true",
        help="trace every request and pair it with its worker's spans: what the gateway adds, "
        "request by request (gateway_spans.py)",
    )
    p.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        help="an option for the gateway (repeat; e.g. --gateway-arg=--policy=round_robin)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()
    env = {**ENV, "PDSERVE_CLUSTER_TOKEN": secrets.token_urlsafe(32)}
    procs = []
    sink = SpanSink() if args.spans else None
    sent: list[Sent] | None = [] if args.spans else None
    if sink is not None:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = sink.endpoint
    try:
        os.sched_setaffinity(0, {0})  # the gateway (inherits it) and this client share core 0
        gw = start_process(
            ["gateway", "--port", "0", "--http-port", "0", "--metrics-port", "-1"]
            + args.gateway_arg,
            env=env,
        )
        procs.append(gw.proc)
        worker = start_process(
            ["colocated", "--gateway", gw.registry, "--threads", str(args.threads), "--cpus", "1"]
            + ["--kv-cache-bytes", "2G", "--max-num-seqs", "64", "--metrics-port", "-1"],
            env=env,
        )
        procs.append(worker.proc)
        for tid in os.listdir(f"/proc/{worker.proc.pid}/task"):  # nice is per thread on Linux
            os.setpriority(os.PRIO_PROCESS, int(tid), args.worker_nice)
        os.sched_setaffinity(0, {args.client_cpu})
        addrs = {"worker": worker.address, "gateway": gw.address, "http": gw.http}
        rng = random.Random(args.seed)
        vocab = 49152
        prompts = [
            (
                [rng.randrange(100, vocab) for _ in range(args.prompt_len)],
                sample_length(rng, args.output_len),
            )
            for _ in range(args.requests)
        ]
        warm = argparse.Namespace(**{**vars(args), "users": 6})
        asyncio.run(run_mixed(addrs, warm, prompts[:12]))  # connections, kernels, routes
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for r in range(args.rounds):
            cpu = cpu_seconds([gw.proc])
            got = asyncio.run(run_mixed(addrs, args, prompts, sent))
            gw_requests = got["grpc"]["requests"] + got["http"]["requests"]
            gw_cpu = (cpu_seconds([gw.proc]) - cpu) / max(gw_requests, 1) * 1e3
            for mode, s in got.items():
                s["gateway_cpu_ms_per_request"] = gw_cpu if mode != "direct" else 0.0
                runs[mode].append(s)
                print(
                    f"round {r} {mode:6s}: latency p50 {s['latency_s']['p50'] * 1e3:.1f} p99 "
                    f"{s['latency_s']['p99'] * 1e3:.1f} ms, TTFT p50 {s['ttft_s']['p50'] * 1e3:.1f} "
                    f"p99 {s['ttft_s']['p99'] * 1e3:.1f} ms, errors {s['errors']}",
                    flush=True,
                )
            print(f"round {r} gateway CPU {gw_cpu:.2f} ms per gateway request", flush=True)
        if sink is not None:  # spans are exported in batches: wait for the last ones
            sink.wait_for(lambda spans: complete(sent, spans), timeout=60)
    finally:
        stop_processes(procs)
        if sink is not None:
            sink.stop()

    def med(mode: str, metric: str, q: str) -> float:
        return statistics.median(s[metric][q] for s in runs[mode]) * 1e3

    summary = {}
    for mode in MODES:
        summary[mode] = {
            f"{metric}_{q}_ms": med(mode, metric, q)
            for metric in ("latency_s", "ttft_s")
            for q in ("p50", "p99")
        }
        summary[mode]["gateway_cpu_ms_per_request"] = statistics.median(
            s["gateway_cpu_ms_per_request"] for s in runs[mode]
        )
    print("\nmedian over rounds (ms); added = mode - direct")
    if any(lo != hi for _, lo, hi in args.output_len) or len(args.output_len) > 1:
        print(
            "(output lengths drawn per request: each mode had its own mix; compare --spans' pairs)"
        )
    for mode in MODES:
        s, d = summary[mode], summary["direct"]
        print(
            f"{mode:6s} latency p50 {s['latency_s_p50_ms']:.1f} (+{s['latency_s_p50_ms'] - d['latency_s_p50_ms']:.1f}) "
            f"p99 {s['latency_s_p99_ms']:.1f} (+{s['latency_s_p99_ms'] - d['latency_s_p99_ms']:.1f}); "
            f"TTFT p50 {s['ttft_s_p50_ms']:.1f} (+{s['ttft_s_p50_ms'] - d['ttft_s_p50_ms']:.1f}) "
            f"p99 {s['ttft_s_p99_ms']:.1f} (+{s['ttft_s_p99_ms'] - d['ttft_s_p99_ms']:.1f}); "
            f"gateway CPU {s['gateway_cpu_ms_per_request']:.2f} ms/request"
        )
    paired = summarize(sent, sink.spans(), MODES) if sink is not None else {}
    if paired:
        print("\nper request, paired with its worker's spans (ms, all rounds)")
        for mode, s in paired.items():
            print(
                f"{mode:6s} "
                + "; ".join(
                    f"{m} p50 {s[m]['p50']:.2f} p99 {s[m]['p99']:.2f}" for m in METRICS if m in s
                )
                + f" ({s['requests']} requests)"
            )
            if "added" in s:
                a = s["added"]
                print(
                    f"       added by the gateway: latency p50 {a['path']['p50']:+.2f} p99 "
                    f"{a['path']['p99']:+.2f}, TTFT p50 {a['path_ttft']['p50']:+.2f} p99 "
                    f"{a['path_ttft']['p99']:+.2f}, last token p50 {a['last_hop']['p50']:+.2f} "
                    f"p99 {a['last_hop']['p99']:+.2f}"
                )
    if args.json:
        with open(args.json, "w") as f:
            out = {"config": vars(args), "summary": summary, "runs": runs, "paired": paired}
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
