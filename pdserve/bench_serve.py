"""``pdserve bench serve``: load on a running gateway over gRPC (``--url``) or its OpenAI-compatible
HTTP API (``--http``: streaming /v1/completions); TTFT, TPOT, ITL percentiles.

Metrics as vLLM's benchmark_serving defines them: TTFT = request sent -> first token; TPOT =
(latency - TTFT) / (output tokens - 1) per request; ITL = every gap between streamed tokens.
Prompts are random words (about one token per word here); outputs have a fixed length with
end-of-sequence ignored; greedy sampling.

Over HTTP every server-sent event that carries a choice is one arrival (the gateway sends one per
decode step, as the gRPC stream does) and the output length is the final usage's.

Load: a closed loop of ``users`` (each sends its next request when its last one ends), or, with
``rate``, Poisson arrivals at that many requests per second.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import ssl
import statistics
import time
from dataclasses import asdict, dataclass, field

import grpc
import httpx

from pdserve.client import tls_credentials
from pdserve.sampling_params import SamplingParams
from pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.v1.convert import sampling_to_proto

WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week case "
    "point government company number group problem fact river stone light music engine garden paper "
    "cloud winter signal"
).split()


@dataclass
class RequestResult:
    prompt_words: int
    prompt_tokens: int = 0  # as the server counted them (its usage), 0 when it sent none
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def parse_lengths(spec: str) -> list[tuple[float, int, int]]:
    """ "64-256" or "0.9:64-256,0.1:2000" -> [(weight, lo, hi)]."""
    out = []
    for part in spec.split(","):
        weight, _, rng = part.rpartition(":")
        lo, _, hi = rng.partition("-")
        out.append((float(weight) if weight else 1.0, int(lo), int(hi or lo)))
    return out


def sample_length(rng: random.Random, dist: list[tuple[float, int, int]]) -> int:
    _, lo, hi = rng.choices(dist, weights=[w for w, _, _ in dist])[0]
    return rng.randint(lo, hi)


async def one_grpc_request(
    stub, words: int, output_len: int, rng: random.Random, timeout: float, metadata=None
) -> RequestResult:
    prompt = " ".join(rng.choice(WORDS) for _ in range(words))
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    req = generation_pb2.GenerateRequest(text=prompt, sampling=sampling_to_proto(params))
    r = RequestResult(prompt_words=words)
    start = last = time.perf_counter()
    try:
        async for delta in stub.Generate(req, timeout=timeout, metadata=metadata):
            if delta.HasField("usage"):
                r.prompt_tokens = delta.usage.prompt_tokens
            if not delta.token_ids:
                continue
            now = time.perf_counter()
            if r.output_tokens == 0:
                r.ttft = now - start
            else:
                r.itl.append(now - last)
            last = now
            r.output_tokens += len(delta.token_ids)
    except grpc.aio.AioRpcError as e:
        r.error = f"{e.code().name}: {e.details()}"
    r.latency = time.perf_counter() - start
    return r


async def one_http_request(
    client: httpx.AsyncClient, words: int, output_len: int, rng: random.Random, timeout: float
) -> RequestResult:
    """One streaming /v1/completions request; ``client`` has the API's base URL."""
    prompt = " ".join(rng.choice(WORDS) for _ in range(words))
    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = RequestResult(prompt_words=words)
    arrivals = 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", "/completions", json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                await resp.aread()
                raise _HTTPError(f"HTTP {resp.status_code}: {resp.text[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise _HTTPError(f"{event['error'].get('code')}: {event['error']['message']}")
                if event.get("usage"):
                    r.output_tokens = event["usage"]["completion_tokens"]
                    r.prompt_tokens = event["usage"]["prompt_tokens"]
                if not event.get("choices"):
                    continue
                now = time.perf_counter()
                if arrivals == 0:
                    r.ttft = now - start
                else:
                    r.itl.append(now - last)
                last = now
                arrivals += 1
    except (httpx.HTTPError, _HTTPError) as e:
        r.error = f"{type(e).__name__}: {e}"
    r.latency = time.perf_counter() - start
    return r


class _HTTPError(Exception):
    pass


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    qs = (
        statistics.quantiles(values, n=100, method="inclusive")
        if len(values) > 1
        else [values[0]] * 99
    )
    return {
        "p50": qs[49],
        "p90": qs[89],
        "p95": qs[94],
        "p99": qs[98],
        "mean": statistics.fmean(values),
    }


def summarize(results: list[RequestResult], wall: float) -> dict:
    ok = [r for r in results if not r.error]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": sorted({r.error for r in results if r.error})[:3],
        "wall_s": wall,
        "output_tokens_per_s": out_tokens / wall,
        # what the server counted (its usage): the offline step to compare with is at this length
        "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in ok) if ok else 0.0,
        "requests_per_s": len(ok) / wall,
        "ttft_s": percentiles([r.ttft for r in ok]),
        "tpot_s": percentiles(tpot),
        "itl_s": percentiles([g for r in ok for g in r.itl]),
        "ttft_long_prompts_s": percentiles([r.ttft for r in ok if r.prompt_words >= 1000]),
        "tpot_short_prompts_s": percentiles(
            [
                (r.latency - r.ttft) / (r.output_tokens - 1)
                for r in ok
                if r.output_tokens > 1 and r.prompt_words < 1000
            ]
        ),
    }


def http_base_url(url: str, tls: bool = False) -> str:
    """``host:port``, ``http://host:port`` or ``http://host:port/v1`` -> ``http://host:port/v1``
    (``https://`` for a bare ``host:port`` with ``tls``)."""
    if "://" not in url:
        url = ("https://" if tls else "http://") + url
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


async def run_load(
    url: str | None,
    num_requests: int,
    users: int,
    rate: float | None,
    prompt_dist: str,
    output_len: int,
    seed: int,
    timeout: float,
    http: str | None = None,
    tls_ca: str | None = None,
    api_key: str | None = None,
) -> dict:
    """Over gRPC to the gateway at ``url``, or over HTTP to the OpenAI API at ``http``."""
    rng = random.Random(seed)
    dist = parse_lengths(prompt_dist)
    jobs = [sample_length(rng, dist) for _ in range(num_requests)]
    async with contextlib.AsyncExitStack() as stack:
        if http:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            client = await stack.enter_async_context(
                httpx.AsyncClient(
                    base_url=http_base_url(http, tls=tls_ca is not None),
                    limits=limits,
                    headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
                    verify=ssl.create_default_context(cafile=tls_ca) if tls_ca else True,
                )
            )

            def one_request(words, output_len, urng, timeout):
                return one_http_request(client, words, output_len, urng, timeout)

        else:
            channel = await stack.enter_async_context(
                grpc.aio.insecure_channel(url)
                if tls_ca is None
                else grpc.aio.secure_channel(url, tls_credentials(tls_ca))
            )
            stub = generation_pb2_grpc.GenerationStub(channel)
            metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

            def one_request(words, output_len, urng, timeout):
                return one_grpc_request(stub, words, output_len, urng, timeout, metadata)

        results: list[RequestResult] = []
        start = time.perf_counter()
        if rate:
            tasks = []
            for words in jobs:
                tasks.append(
                    asyncio.create_task(
                        one_request(words, output_len, random.Random(rng.random()), timeout)
                    )
                )
                await asyncio.sleep(rng.expovariate(rate))
            results = list(await asyncio.gather(*tasks))
        else:
            queue = list(reversed(jobs))

            async def user(uid: int) -> None:
                urng = random.Random(seed * 1000 + uid)
                while queue:
                    results.append(await one_request(queue.pop(), output_len, urng, timeout))

            await asyncio.gather(*(user(u) for u in range(users)))
        wall = time.perf_counter() - start
    summary = summarize(results, wall)
    summary["config"] = {
        "url": url,
        "http": http,
        "requests": num_requests,
        "users": users,
        "rate": rate,
        "prompt_words": prompt_dist,
        "output_len": output_len,
    }
    summary["per_request"] = [asdict(r) | {"itl": None} for r in results]
    return summary


def print_summary(s: dict) -> None:
    def ms(d: dict) -> str:
        return " ".join(f"{k} {v * 1e3:.0f}" for k, v in d.items() if k != "mean") if d else "-"

    print(
        f"{s['requests']} requests, {s['errors']} errors, {s['wall_s']:.1f} s: "
        f"{s['output_tokens_per_s']:.1f} output tokens/s, {s['requests_per_s']:.2f} requests/s, "
        f"prompts of {s['prompt_tokens_mean']:.0f} tokens on average (the server's count)"
    )
    print(f"TTFT ms  {ms(s['ttft_s'])}")
    print(f"TPOT ms  {ms(s['tpot_s'])}")
    print(f"ITL ms   {ms(s['itl_s'])}")
    if s["ttft_long_prompts_s"]:
        print(
            f"TTFT of long prompts ms {ms(s['ttft_long_prompts_s'])}; TPOT of short ones ms {ms(s['tpot_short_prompts_s'])}"
        )
    for e in s["error_samples"]:
        print(f"error: {e}")


def cmd_bench_serve(args) -> int:
    summary = asyncio.run(
        run_load(
            args.url,
            args.requests,
            args.users,
            args.rate,
            args.prompt_words,
            args.output_len,
            args.seed,
            args.timeout,
            args.http,
            args.tls_ca,
            args.api_key,
        )
    )
    print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if summary["errors"] == 0 else 1


def add_command(bsub) -> None:
    s = bsub.add_parser(
        "serve", help="load a running gateway; TTFT/TPOT/ITL percentiles and throughput"
    )
    target = s.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="the gateway's gRPC host:port")
    target.add_argument(
        "--http",
        metavar="URL",
        help="the gateway's OpenAI-compatible HTTP API instead (host:port or http://host:port/v1)",
    )
    s.add_argument("--tls-ca", default=None, help="dial over TLS, trusting this CA (PEM)")
    s.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY"),
        help="sent as Authorization: Bearer (default: $PDSERVE_API_KEY)",
    )
    s.add_argument("--requests", type=int, default=32)
    s.add_argument("--users", type=int, default=8, help="closed loop: concurrent users")
    s.add_argument(
        "--rate", type=float, default=None, help="open loop: Poisson arrivals per second"
    )
    s.add_argument(
        "--prompt-words",
        default="256-768",
        help='uniform range "LO-HI", or a mix "0.9:64-256,0.1:2000"',
    )
    s.add_argument("--output-len", type=int, default=128)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--timeout", type=float, default=600.0)
    s.add_argument(
        "--json", default=None, help="also write the summary (and per-request numbers) here"
    )
    s.set_defaults(func=cmd_bench_serve)
