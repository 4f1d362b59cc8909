"""Host-side checks of scripts/compose-e2e, run against the compose cluster (exit 1 on failure).

    python deploy/e2e_check.py requests GATEWAY N [TAG]      # N concurrent streams complete
    python deploy/e2e_check.py trace SPANS_JSONL REQUEST_ID  # that request is one full disaggregated trace
    python deploy/e2e_check.py registered ROLE N < LOGS      # the gateway logged N distinct ROLE workers
    python deploy/e2e_check.py decoded < LOGS                # how many requests a decode worker finished

LOGS are a container's JSON log lines (``--log-format json``) as ``docker logs`` prints them.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time
from collections.abc import Iterable, Iterator

SPAN_NAMES = {
    "gateway.generate",
    "router.pick",
    "decode.admit",
    "prefill.prefill",
    "kv.send",
    "decode.kv_receive",
    "decode.generate",
}
SERVICES = {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"}


def requests(gateway: str, num: int, tag: str = "e2e", max_tokens: int = 24) -> None:
    from pdserve import Client, SamplingParams

    def one(i: int) -> int:
        with Client(gateway, timeout=300) as c:
            deltas = list(
                c.generate_stream(
                    [{"role": "user", "content": f"Count to {i + 3}."}],
                    SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                    request_id=f"{tag}-{i}",
                )
            )
        assert deltas[-1].finish_reason == "length", deltas[-1]
        return sum(len(d.token_ids) for d in deltas)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(num) as pool:
        counts = list(pool.map(one, range(num)))
    assert counts == [max_tokens] * num, counts
    print(
        f"{num} concurrent requests ({tag}-0..{num - 1}) through {gateway}: {max_tokens} tokens each, "
        f"{time.perf_counter() - t0:.1f} s"
    )


def trace(path: str, request_id: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:  # the services export in batches: poll the receiver's file until the trace is whole
        with open(path) as f:
            spans = [json.loads(line) for line in f if line.strip()]
        roots = [
            s
            for s in spans
            if s["name"] == "gateway.generate" and s["attributes"].get("request_id") == request_id
        ]
        mine = [s for s in spans if roots and s["trace_id"] == roots[0]["trace_id"]]
        if SPAN_NAMES <= {s["name"] for s in mine} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    names = {s["name"] for s in mine}
    assert SPAN_NAMES <= names, f"trace of {request_id} has only {sorted(names)}"
    assert {s["service"] for s in mine} == SERVICES, {s["service"] for s in mine}
    assert all(s["status"] != "ERROR" for s in mine), [s for s in mine if s["status"] == "ERROR"]
    by = {s["name"]: s for s in mine}
    assert by["decode.kv_receive"]["parent_span_id"] == by["prefill.prefill"]["span_id"]
    assert (
        by["kv.send"]["attributes"]["bytes"] == by["decode.kv_receive"]["attributes"]["bytes"] > 0
    )
    kv = by["kv.send"]["attributes"]
    print(
        f"trace {roots[0]['trace_id']} of {request_id}: {len(mine)} spans from {len(SERVICES)} services; "
        f"KV {kv['bytes']} bytes in {kv['seconds'] * 1e3:.1f} ms, {kv['messages']} messages, "
        "over UCX between containers"
    )


def _events(lines: Iterable[str]) -> Iterator[dict]:
    for line in lines:
        start = line.find("{")  # compose may put terminal codes (ESC[2K) before a line
        if start < 0:
            continue
        try:
            event = json.loads(line[start:])
        except json.JSONDecodeError:
            continue  # not a log event (READY lines, a library's warnings)
        if isinstance(event, dict):
            yield event


def registered(role: str, num: int, lines: Iterable[str]) -> None:
    addresses = {
        e.get("address")
        for e in _events(lines)
        if e.get("event") == "worker.registered" and e.get("role") == role
    }
    assert len(addresses) == num, (
        f"the gateway registered {len(addresses)} {role} workers, not {num}: {sorted(addresses)}"
    )
    print(f"the gateway registered {num} {role} workers: {', '.join(sorted(addresses))}")


def decoded(lines: Iterable[str]) -> int:
    return sum(1 for e in _events(lines) if e.get("event") == "decode.end")


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    try:
        if cmd == "requests":
            requests(args[0], int(args[1]), *args[2:])
        elif cmd == "trace":
            trace(args[0], args[1])
        elif cmd == "registered":
            registered(args[0], int(args[1]), sys.stdin)
        elif cmd == "decoded":
            print(decoded(sys.stdin))
        else:
            raise SystemExit(f"unknown check {cmd!r}; use requests, trace, registered or decoded")
    except AssertionError as e:
        raise SystemExit(f"e2e check {cmd} failed: {e}") from None
