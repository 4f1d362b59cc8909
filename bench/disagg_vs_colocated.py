"""Disaggregated (1 prefill + 1 decode, one core each) against colocated (one worker, both cores)
on the same workload, in one run; prints both summaries and their ratios.

    .venv/bin/python bench/disagg_vs_colocated.py --requests 64 --users 16 \\
        --prompt-words 0.9:64-256,0.1:2000 --output-len 128 --json out.json
    # the workers' prompt order for the run (default: theirs, shortest first)
    .venv/bin/python bench/disagg_vs_colocated.py --requests 64 --users 16 --prompt-order arrival
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import DISAGGREGATED, load_parser, run_cluster  # noqa: E402
from pdserve.bench_serve import print_summary  # noqa: E402

SETUPS = {"disaggregated": DISAGGREGATED, "colocated": [["colocated", "--threads", "2"]]}


def main() -> None:
    parser = load_parser(requests=64, users=16, prompt_words="0.9:64-256,0.1:2000", output_len=128)
    parser.add_argument(
        "--decode-prefill-budget",
        default=None,
        help="the gateway's --decode-prefill-budget for the disaggregated cluster (default: its own)",
    )
    parser.add_argument(
        "--prompt-order",
        default=None,
        help="every worker's --prompt-order (default: their own)",
    )
    args = parser.parse_args()
    budget = args.decode_prefill_budget
    gateway = {"disaggregated": [] if budget is None else ["--decode-prefill-budget", budget]}
    order = [] if args.prompt_order is None else ["--prompt-order", args.prompt_order]
    results = {}
    for name in SETUPS:
        print(f"== {name}", flush=True)
        workers = [[*argv, *order] for argv in SETUPS[name]]
        results[name] = run_cluster(workers, args, gateway_args=gateway.get(name))
        print_summary(results[name])
    d, c = results["disaggregated"], results["colocated"]
    print("== disaggregated / colocated")
    for key in ("tpot_s", "itl_s", "ttft_s", "tpot_short_prompts_s"):
        if d[key] and c[key]:
            print(
                f"{key}: p50 {d[key]['p50'] / c[key]['p50']:.2f}x, p99 {d[key]['p99'] / c[key]['p99']:.2f}x"
            )
    print(f"output tokens/s: {d['output_tokens_per_s'] / c['output_tokens_per_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    k: {kk: vv for kk, vv in v.items() if kk != "per_request"}
                    for k, v in results.items()
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
