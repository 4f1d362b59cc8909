"""Routing policies side by side on one load with no shared prefixes (W-mixed by default): one
set of real workers (2 prefill workers, one core each, and a decode worker; prefix caching off, as
no prompt shares a prefix), registered with one gateway per policy. The load runs in
``--pairs`` sets of rounds, one round per policy, every set with prompts of its own (``--seed`` +
the set) and the policies' order reversed every other set (A B, B A, ...), so each policy meets
the same prompts and the machine's slow spells fall on both. Prints each round's summary, then per
policy the median over its rounds and the ratios to the first policy's.

    .venv/bin/python bench/policies.py --pairs 4 --policies least_loaded cost --json out.json

(``bench/prefix_routing.py`` is the same set-up on a repeated-prefix chat workload.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    COMMON,
    TWO_PREFILL,
    gateways_and_workers,
    load_parser,
    warm_then_load,
)
from pdserve.bench_offline import cpu_model  # noqa: E402
from pdserve.bench_serve import print_summary  # noqa: E402

METRICS = ("ttft_s", "tpot_s", "itl_s")


def main() -> None:
    p = load_parser(requests=64, users=16, prompt_words="0.9:64-256,0.1:2000", output_len=128)
    p.add_argument("--policies", nargs="+", default=["least_loaded", "cost"])
    p.add_argument("--pairs", type=int, default=4, help="sets of rounds, one per policy")
    args = p.parse_args()
    runs: dict[str, list[dict]] = {policy: [] for policy in args.policies}
    gateway_args = {policy: ["--policy", policy] for policy in args.policies}
    workers = [[*argv, *COMMON, "--no-prefix-caching"] for argv in TWO_PREFILL]
    with gateways_and_workers(gateway_args, workers) as (gateways, _):
        for k in range(args.pairs):
            load = argparse.Namespace(**{**vars(args), "seed": args.seed + k})
            for policy in args.policies[:: 1 if k % 2 == 0 else -1]:
                print(f"== prompts {k}: {policy}", flush=True)
                runs[policy].append(warm_then_load(gateways[policy], load))
                print_summary(runs[policy][-1])
    medians = {policy: median_summary(s) for policy, s in runs.items() if s}
    base = args.policies[0]
    print(f"== median over each policy's rounds; ratio to {base}")
    for policy, m in medians.items():
        line = " ".join(
            f"{k} p50/p99 {m[k]['p50'] * 1e3:.0f}/{m[k]['p99'] * 1e3:.0f} ms "
            f"({m[k]['p50'] / medians[base][k]['p50']:.2f}x/{m[k]['p99'] / medians[base][k]['p99']:.2f}x)"
            for k in METRICS
        )
        tps = m["output_tokens_per_s"]
        print(
            f"{policy}: {line}; {tps:.1f} tok/s ({tps / medians[base]['output_tokens_per_s']:.2f}x)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_model(), "args": vars(args), "runs": runs}, f, indent=1)


def median_summary(summaries: list[dict]) -> dict:
    """Per metric and percentile, the median over the rounds' summaries."""
    out = {
        k: {q: statistics.median(s[k][q] for s in summaries) for q in ("p50", "p99")}
        for k in METRICS
    }
    out["output_tokens_per_s"] = statistics.median(s["output_tokens_per_s"] for s in summaries)
    return out


if __name__ == "__main__":
    main()
