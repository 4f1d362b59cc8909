"""What the gateway adds to each request, read from its trace (``gateway_overhead.py --spans``).

Comparing latency percentiles of the direct and gateway modes mixes in everything that differs
between two requests of the same load (where each lands in the worker's batches): on 2 cores that
is ±10 ms. Here each request is paired with itself: its worker's spans (``decode.admit``,
``decode.generate``, with the ``first_token_s`` attribute) say how long the worker spent on it,
from the moment it arrived to its last token, and the client measured the whole. Per request:

- ``path``  = client latency − the worker's time: the network hops and whatever sits in between
  (for direct: client ↔ worker; through the gateway: client ↔ gateway ↔ worker and the gateway);
- ``path_ttft`` = client TTFT − the worker's own TTFT (from its first span's start);
- ``last_hop`` = when the client got the last token − when the worker sent it (its
  ``decode.generate`` span ends just before): that token's way from worker to client, whatever
  the request's stream does after it (a status, a closing chunk) left out;
- ``inside`` (gateway modes) = the ``gateway.generate`` span − the worker's time: what the
  gateway process spends on the request between taking it and answering its last chunk (biased
  low by the worker's span ending after its last message left);
- ``added_first`` / ``added_last`` (gateway modes): what the gateway measures itself (span
  attributes ``gateway_added_ttft_s`` / ``gateway_added_s``, services/gateway/accounting.py):
  from the request's arrival to its first worker call, plus from the worker's first / last
  message arriving to its answer being handed to the client's connection. No clock pairing and
  no client in it; the loopback hops are not in it either.

The gateway adds ``path(mode) − path(direct)``, reported as the difference of percentiles, and,
bounded from above, ``inside``. All clocks are one host's wall clock. Tracing is on for every
mode, so its own cost (spans exported by the gateway and the worker) is counted too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.bench_serve import percentiles
from pdserve.otlp_sink import Span

WORKER_SPANS = ("decode.admit", "decode.generate")
METRICS = ("path", "path_ttft", "last_hop", "inside", "added_first", "added_last")


@dataclass
class Sent:
    """One request as the client saw it (``time.time_ns`` at its start)."""

    mode: str
    request_id: str
    start_ns: int
    latency_s: float
    ttft_s: float
    last_s: float  # from its start to its last token


def _worker_time(spans: list[Span]) -> tuple[float, float, int] | None:
    """(seconds from the worker's first span's start to its last span's end, the worker's TTFT
    from that same start, when its ``decode.generate`` span ended: just before it sent its last
    token); None if its spans are not all there."""
    gen = [s for s in spans if s["name"] == "decode.generate"]
    if not gen or "first_token_s" not in gen[0]["attributes"]:
        return None
    start = min(s["start_ns"] for s in spans)
    end = max(s["end_ns"] for s in spans)
    first = gen[0]["start_ns"] + gen[0]["attributes"]["first_token_s"] * 1e9
    return (end - start) / 1e9, (first - start) / 1e9, gen[-1]["end_ns"]


def complete(sent: Iterable[Sent], spans: list[Span]) -> bool:
    """Whether every request's spans have arrived (``SpanSink.wait_for``)."""
    return all(v is not None for v in per_request(sent, spans).values())


def per_request(sent: Iterable[Sent], spans: list[Span]) -> dict[str, dict | None]:
    """request id -> {"path", "path_ttft", "inside"} in seconds, None while spans are missing."""
    by_trace: dict[str, list[Span]] = {}
    roots: dict[str, Span] = {}
    direct: dict[str, list[Span]] = {}
    for s in spans:
        rid = s["attributes"].get("request_id", "")
        if s["name"] == "gateway.generate":
            roots[rid] = s
        elif s["name"] in WORKER_SPANS:
            by_trace.setdefault(s["trace_id"], []).append(s)
            direct.setdefault(rid, []).append(s)
    out: dict[str, dict | None] = {}
    for r in sent:
        root = roots.get(r.request_id)
        mine = direct.get(r.request_id, []) if r.mode == "direct" else []
        if root is not None:
            mine = by_trace.get(root["trace_id"], [])
        worker = _worker_time(mine) if mine else None
        if worker is None or (r.mode != "direct" and root is None):
            out[r.request_id] = None
            continue
        busy, ttft, sent_last_ns = worker
        row = {
            "path": r.latency_s - busy,
            "path_ttft": r.ttft_s - ttft,
            "last_hop": (r.start_ns - sent_last_ns) / 1e9 + r.last_s,
        }
        if root is not None:
            row["inside"] = (root["end_ns"] - root["start_ns"]) / 1e9 - busy
            attrs = root["attributes"]
            if "gateway_added_s" in attrs:  # measured by the gateway itself (accounting.py)
                row["added_first"] = attrs["gateway_added_ttft_s"]
                row["added_last"] = attrs["gateway_added_s"]
        out[r.request_id] = row
    return out


def summarize(sent: list[Sent], spans: list[Span], modes: Iterable[str]) -> dict[str, dict]:
    """Per mode: percentiles (ms) of path, path_ttft and inside, and what the gateway adds over
    direct (the difference of path percentiles)."""
    rows = per_request(sent, spans)
    out: dict[str, dict] = {}
    for mode in modes:
        mine = [rows[r.request_id] for r in sent if r.mode == mode and rows.get(r.request_id)]
        out[mode] = {
            metric: {q: v * 1e3 for q, v in percentiles([m[metric] for m in mine]).items()}
            for metric in METRICS
            if mine and metric in mine[0]
        }
        out[mode]["requests"] = len(mine)
    base = out.get("direct")
    for mode, s in out.items():
        if mode != "direct" and base and base["requests"] and s["requests"]:
            s["added"] = {
                metric: {q: s[metric][q] - base[metric][q] for q in ("p50", "p99")}
                for metric in ("path", "path_ttft", "last_hop")
            }
    return out
