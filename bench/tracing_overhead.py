"""Tracing on against tracing off: throughput of the same disaggregated cluster (1 prefill + 1
decode, one core each) under a closed loop of users, in alternating rounds within one run.

With tracing on, every process exports OTLP/gRPC to a receiver (pdserve.otlp_sink) running in this
benchmark's process, on the same machine: the collector's own cost is included, as it would be
for a sidecar.

    .venv/bin/python bench/tracing_overhead.py --users 32 --requests 96 --rounds 3 --json out.json
"""

from __future__ import annotations

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import DISAGGREGATED, load_parser, run_cluster  # noqa: E402
from pdserve.otlp_sink import SpanSink  # noqa: E402


def main() -> None:
    p = load_parser(requests=96, users=32, prompt_words="64-256", output_len=32)
    p.add_argument("--rounds", type=int, default=3, help="off/on pairs, alternating")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    with SpanSink() as sink:
        for r in range(args.rounds):
            for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
                env = {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint} if mode == "on" else {}
                s = run_cluster(DISAGGREGATED, args, env)
                runs[mode].append(s)
                print(
                    f"round {r} tracing {mode}: {s['output_tokens_per_s']:.1f} output tok/s, "
                    f"{s['requests_per_s']:.2f} req/s, {s['cluster_cpu_s'] / s['requests'] * 1e3:.0f} ms "
                    f"CPU per request, errors {s['errors']}",
                    flush=True,
                )
        num_spans = len(sink.spans())
    tput = {m: statistics.median(s["output_tokens_per_s"] for s in runs[m]) for m in runs}
    ratio = tput["on"] / tput["off"]
    cpu = {m: statistics.median(s["cluster_cpu_s"] / s["requests"] for s in runs[m]) for m in runs}
    print(
        f"median output tok/s: off {tput['off']:.1f}, on {tput['on']:.1f}: on/off = {ratio:.3f} "
        f"({(1 - ratio) * 100:+.1f}% drop); {num_spans} spans received"
    )
    print(
        f"median cluster CPU per request: off {cpu['off'] * 1e3:.0f} ms, on {cpu['on'] * 1e3:.0f} ms: "
        f"on/off = {cpu['on'] / cpu['off']:.3f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "median_output_tokens_per_s": tput,
                    "on_over_off": ratio,
                    "spans": num_spans,
                    "median_cpu_s_per_request": cpu,
                    "runs": {
                        m: [{k: v for k, v in s.items() if k != "per_request"} for s in runs[m]]
                        for m in runs
                    },
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
