"""Host-side checks of scripts/compose-e2e, run against the compose cluster's published gateway.

    python deploy/e2e_check.py requests GATEWAY N          # N streams complete
    python deploy/e2e_check.py trace SPANS_JSONL REQUEST_ID  # that request is one full trace
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time

SPAN_NAMES = {"gateway.generate", "router.pick", "decode.admit", "prefill.prefill", "kv.send",
              "decode.kv_receive", "decode.generate"}
SERVICES = {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"}


def requests(gateway: str, num: int, max_tokens: int = 24) -> None:
    from pdserve import Client, SamplingParams

    def one(i: int) -> int:
        with Client(gateway, timeout=300) as c:
            deltas = list(c.generate_stream([{"role": "user", "content": f"Count to {i + 3}."}],
                                            SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                                            request_id=f"e2e-{num}-{i}"))
        assert deltas[-1].finish_reason == "length", deltas[-1]
        return sum(len(d.token_ids) for d in deltas)

    with concurrent.futures.ThreadPoolExecutor(num) as pool:
        counts = list(pool.map(one, range(num)))
    assert counts == [max_tokens] * num, counts
    print(f"{num} requests through {gateway}: {max_tokens} tokens each")


def trace(path: str, request_id: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with open(path) as f:
            spans = [json.loads(line) for line in f if line.strip()]
        roots = [s for s in spans if s["name"] == "gateway.generate" and s["attributes"].get("request_id") == request_id]
        mine = [s for s in spans if roots and s["trace_id"] == roots[0]["trace_id"]]
        if SPAN_NAMES <= {s["name"] for s in mine} or time.monotonic() > deadline:
            break
        time.sleep(0.5)  # the exporters batch every 0.5 s; the file is all there is to poll
    names = {s["name"] for s in mine}
    assert SPAN_NAMES <= names, f"trace of {request_id} has only {sorted(names)}"
    assert {s["service"] for s in mine} == SERVICES, {s["service"] for s in mine}
    by = {s["name"]: s for s in mine}
    assert by["decode.kv_receive"]["parent_span_id"] == by["prefill.prefill"]["span_id"]
    assert by["kv.send"]["attributes"]["bytes"] == by["decode.kv_receive"]["attributes"]["bytes"] > 0
    kv = by["kv.send"]["attributes"]
    print(f"trace {roots[0]['trace_id']}: {len(mine)} spans from {len(SERVICES)} services; "
          f"KV {kv['bytes']} bytes in {kv['seconds'] * 1e3:.1f} ms ({kv['gbps']:.2f} GB/s) over UCX between containers")


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    if cmd == "requests":
        requests(args[0], int(args[1]))
    elif cmd == "trace":
        trace(args[0], args[1])
    else:
        raise SystemExit(f"unknown check {cmd!r}; use requests or trace")
